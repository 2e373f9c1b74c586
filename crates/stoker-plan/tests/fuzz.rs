//! Property-based fuzzing of the planner's inputs: plan TOML with every numeric field
//! drawn from the whole range of its type (zero, negative, huge, NaN, infinite), presets and
//! options drawn from valid and invalid names, DeepSpeed JSON with arbitrary values for its
//! keys, and byte mutations of a valid plan file. Whatever the input, reading, resolving,
//! planning and printing the plan (text and JSON) never panics (no overflow, no division
//! by zero, no NaN reaching a sort), and an error names the field or the file. A short run
//! in `make test` (`PROPTEST_CASES`, default 256); `make fuzz` runs 20,000.

use proptest::prelude::*;
use stoker_plan::deepspeed::DsConfig;
use stoker_plan::input::PlanInput;

fn int() -> impl Strategy<Value = i64> {
    prop_oneof![
        12 => 1i64..300,
        1 => -3i64..1,
        1 => Just(i64::MAX),
        1 => Just(i64::MIN),
        1 => Just(1 << 40),
        1 => any::<i64>(),
    ]
}

fn float() -> impl Strategy<Value = f64> {
    prop_oneof![
        12 => 0.01f64..1.0,
        1 => -1.0f64..0.0,
        1 => Just(0.0),
        1 => Just(1e300),
        1 => Just(f64::MIN_POSITIVE),
        1 => any::<f64>(),
    ]
}

/// A TOML float: NaN and the infinities have their own spellings.
fn toml_f(v: f64) -> String {
    if v.is_nan() {
        "nan".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        }
    } else {
        format!("{v:e}")
    }
}

fn name(valid: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        9 => prop::sample::select(valid).prop_map(str::to_string),
        1 => "[a-z0-9.-]{0,8}",
    ]
}

const MODELS: &[&str] = &[
    "gpt2-124m",
    "gpt2-1.5b",
    "llama-7b",
    "llama-70b",
    "stoker-gpt",
    "t5-3b",
];
const HARDWARE: &[&str] = &["a100-80gb", "h100-80gb", "h200-141gb", "cpu"];
const PRECISION: &[&str] = &["fp32", "fp16", "bf16", "bf16-pure", "fp8"];
const STRATEGY: &[&str] = &["ddp", "zero1", "zero2", "zero3"];

#[derive(Debug, Clone)]
struct Fields {
    model: String,
    hardware: String,
    ints: Vec<(usize, i64)>,
    floats: Vec<(usize, f64)>,
    precision: String,
    strategy: String,
    params: Option<String>,
    offload: bool,
}

const INT_KEYS: &[(&str, &str)] = &[
    ("hardware", "nodes"),
    ("hardware", "devices_per_node"),
    ("hardware", "host_cores"),
    ("training", "global_batch"),
    ("training", "seq_len"),
    ("training", "micro_batch"),
    ("training", "accumulation_steps"),
    ("model", "layers"),
    ("model", "hidden"),
    ("model", "heads"),
    ("model", "vocab"),
];
const FLOAT_KEYS: &[(&str, &str)] = &[
    ("hardware", "memory_gib"),
    ("hardware", "host_memory_gib"),
    ("hardware", "intra_node_gbyte_s"),
    ("hardware", "inter_node_gbit_s"),
    ("hardware", "host_link_gbyte_s"),
    ("training", "mfu"),
    ("training", "fragmentation"),
    ("training", "safety_margin"),
    ("training", "bucket_mb"),
];

fn fields() -> impl Strategy<Value = Fields> {
    (
        name(MODELS),
        name(HARDWARE),
        prop::collection::vec((0..INT_KEYS.len(), int()), 0..4),
        prop::collection::vec((0..FLOAT_KEYS.len(), float()), 0..3),
        name(PRECISION),
        name(STRATEGY),
        prop::option::weighted(
            0.15,
            prop_oneof![
                Just("7.5B".to_string()),
                Just("0".to_string()),
                Just("1e30".to_string()),
                "[0-9.eEbBmMkK-]{0,6}",
            ],
        ),
        any::<bool>(),
    )
        .prop_map(
            |(model, hardware, ints, floats, precision, strategy, params, offload)| Fields {
                model,
                hardware,
                ints,
                floats,
                precision,
                strategy,
                params,
                offload,
            },
        )
}

fn toml(f: &Fields) -> String {
    let mut tables: Vec<(&str, Vec<String>)> = vec![
        ("model", vec![]),
        ("hardware", vec![format!("preset = {:?}", f.hardware)]),
        (
            "training",
            vec![
                format!("precision = {:?}", f.precision),
                format!("strategy = {:?}", f.strategy),
                format!("offload_optimizer = {}", f.offload),
            ],
        ),
    ];
    match &f.params {
        Some(p) => tables[0].1.push(format!("params = {p:?}")),
        None => tables[0].1.push(format!("preset = {:?}", f.model)),
    }
    let mut seen = std::collections::BTreeSet::new();
    for &(k, v) in &f.ints {
        let (table, key) = INT_KEYS[k];
        if seen.insert(key) {
            let t = tables.iter_mut().find(|t| t.0 == table).unwrap();
            t.1.push(format!("{key} = {v}"));
        }
    }
    for &(k, v) in &f.floats {
        let (table, key) = FLOAT_KEYS[k];
        if seen.insert(key) {
            let t = tables.iter_mut().find(|t| t.0 == table).unwrap();
            t.1.push(format!("{key} = {}", toml_f(v)));
        }
    }
    // A batch and a sequence length unless drawn above, so that most cases reach the plan.
    for (key, v) in [("global_batch", 64), ("seq_len", 512)] {
        if seen.insert(key) {
            tables[2].1.push(format!("{key} = {v}"));
        }
    }
    tables
        .iter()
        .map(|(t, lines)| format!("[{t}]\n{}\n", lines.join("\n")))
        .collect()
}

/// Resolves, plans and prints; an error must name something (a non-empty message).
fn plan_all(file: &PlanInput, ds: Option<&DsConfig>) -> Result<(), TestCaseError> {
    match stoker_plan::resolve::resolve(file, ds, &PlanInput::default()) {
        Ok(r) => {
            let plan = stoker_plan::plan(r, None);
            prop_assert!(!plan.to_text().is_empty());
            prop_assert!(!plan.to_json().is_empty());
        }
        Err(e) => prop_assert!(!e.to_string().is_empty()),
    }
    Ok(())
}

proptest! {
    #[test]
    fn any_plan_values_resolve_plan_and_print_or_fail_with_a_message(f in fields()) {
        let text = toml(&f);
        match PlanInput::from_toml_str("plan.toml", &text) {
            Ok(input) => plan_all(&input, None)?,
            Err(e) => prop_assert!(e.to_string().contains("plan.toml"), "{e}"),
        }
    }

    #[test]
    fn any_deepspeed_values_read_and_plan_or_fail_naming_the_file(
        tbs in int(), micro in int(), accum in int(), stage in int(), bucket in float(),
        fp16 in any::<bool>(), bf16 in any::<bool>(), device in name(&["cpu", "nvme", "none"]),
    ) {
        let json = format!(
            r#"{{"train_batch_size": {tbs}, "train_micro_batch_size_per_gpu": {micro},
               "gradient_accumulation_steps": {accum},
               "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": {bucket},
                                      "offload_optimizer": {{"device": {device:?}}}}},
               "fp16": {{"enabled": {fp16}}}, "bf16": {{"enabled": {bf16}}}}}"#,
            bucket = if bucket.is_finite() { format!("{bucket:e}") } else { "1e999".into() },
        );
        match DsConfig::from_json_str("ds_config.json", &json) {
            Ok(ds) => {
                let input = PlanInput::from_toml_str(
                    "plan.toml",
                    "[model]\npreset = \"gpt2-124m\"\n[hardware]\npreset = \"a100-80gb\"\n[training]\nseq_len = 1024\n",
                )
                .unwrap();
                plan_all(&input, Some(&ds))?;
            }
            Err(e) => prop_assert!(e.to_string().contains("ds_config.json"), "{e}"),
        }
    }

    #[test]
    fn mutated_plan_files_read_and_plan_or_fail_naming_the_file(
        at in any::<usize>(), bytes in prop::collection::vec(any::<u8>(), 1..6), cut in any::<bool>(),
    ) {
        let valid = "[model]\npreset = \"llama-7b\"\n[hardware]\npreset = \"h100-80gb\"\nnodes = 2\n[training]\nglobal_batch = 1024\nseq_len = 4096\nactivation_checkpointing = true\n";
        let mut v = valid.as_bytes().to_vec();
        let i = at % v.len();
        if cut {
            v.truncate(i);
        } else {
            for (d, s) in v[i..].iter_mut().zip(&bytes) {
                *d = *s;
            }
        }
        let text = String::from_utf8_lossy(&v);
        match PlanInput::from_toml_str("plan.toml", &text) {
            Ok(input) => plan_all(&input, None)?,
            Err(e) => prop_assert!(e.to_string().contains("plan.toml"), "{e}"),
        }
    }
}
