//! The examples in docs/plan.md stay valid: the plan-input TOML resolves and plans (the
//! emitted training config example is the trainer's schema: stoker-train's
//! `tests/plan_config.rs` parses it).

use stoker_plan::input::PlanInput;
use stoker_plan::resolve::resolve;

fn toml_blocks() -> Vec<String> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/plan.md"))
        .expect("docs/plan.md exists");
    text.split("```toml\n")
        .skip(1)
        .map(|b| b.split("```").next().unwrap_or_default().to_string())
        .collect()
}

#[test]
fn plan_input_example_resolves_and_plans() {
    let blocks = toml_blocks();
    let input = PlanInput::from_toml_str("docs/plan.md", &blocks[0]).unwrap();
    let r = resolve(&PlanInput::default(), None, &input).unwrap();
    assert_eq!(r.model.name, "llama-7b");
    assert_eq!(r.hardware.world_size(), 16);
    let p = stoker_plan::plan(r, None);
    assert!(p.choice.is_some());
}
