//! The examples in docs/plan.md stay valid: the plan-input TOML resolves, and the emitted
//! config schema parses as a `TrainingConfig`.

use stoker_plan::emit::TrainingConfig;
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
    assert!(p.config.is_some());
}

#[test]
fn emitted_config_example_parses() {
    let blocks = toml_blocks();
    let cfg: TrainingConfig = toml::from_str(&blocks[1]).unwrap();
    assert_eq!(cfg.parallel.strategy, "zero3");
    assert_eq!(
        cfg.data.micro_batch * cfg.accumulation.accumulation_steps * cfg.parallel.world_size,
        cfg.accumulation.global_batch
    );
}
