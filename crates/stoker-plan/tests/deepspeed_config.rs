//! Importing DeepSpeed ds_config.json: batch arithmetic checked against the world size with
//! the offending keys named, stage / offload / precision blocks read, "auto" left to stoker.

mod common;

use stoker_plan::deepspeed::DsConfig;
use stoker_plan::input::PlanInput;
use stoker_plan::resolve::resolve;
use stoker_plan::PlanError;

fn node(world_per_node: u64) -> PlanInput {
    PlanInput::from_toml_str(
        "cli",
        &format!(
            "model = {{ preset = \"llama-7b\" }}\nhardware = {{ preset = \"a100-80gb\", devices_per_node = {world_per_node} }}"
        ),
    )
    .unwrap()
}

fn ds(text: &str) -> Result<DsConfig, PlanError> {
    DsConfig::from_json_str("ds_config.json", text)
}

#[test]
fn batch_mismatch_names_every_key_and_number() {
    let cfg = ds(
        r#"{"train_batch_size": 1024, "train_micro_batch_size_per_gpu": 16,
                     "gradient_accumulation_steps": 4}"#,
    )
    .unwrap();
    let err = cfg.to_training(8).unwrap_err().to_string();
    assert_eq!(
        err,
        "DeepSpeed config ds_config.json: train_batch_size 1024 != train_micro_batch_size_per_gpu \
         16 x gradient_accumulation_steps 4 x world size 8 (= 512)"
    );
    // The same through resolve, where the world size comes from the hardware.
    let err = resolve(&PlanInput::default(), Some(&cfg), &node(8)).unwrap_err();
    assert!(matches!(err, PlanError::DeepSpeed { .. }), "{err}");
}

#[test]
fn two_batch_keys_determine_the_third_or_say_why_not() {
    let t = ds(r#"{"train_batch_size": 1024, "train_micro_batch_size_per_gpu": 16}"#)
        .unwrap()
        .to_training(8)
        .unwrap();
    assert_eq!(t.accumulation_steps, Some(8));
    let err = ds(r#"{"train_batch_size": 1000, "train_micro_batch_size_per_gpu": 16}"#)
        .unwrap()
        .to_training(8)
        .unwrap_err()
        .to_string();
    assert!(err.contains("train_batch_size 1000 is not divisible by train_micro_batch_size_per_gpu 16 x world size 8 (= 128)"), "{err}");
}

#[test]
fn the_chapters_own_config_on_one_8_gpu_node() {
    // Section 4.4.3: train_batch_size 1024, gradient_accumulation_steps 4, ZeRO stage 2:
    // on 8 GPUs each takes micro-batches of 1024 / (4 x 8) = 32.
    let cfg = ds(
        r#"{"train_batch_size": 1024, "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 2, "allgather_partitions": true,
        "allgather_bucket_size": 5e8, "reduce_scatter": true, "reduce_bucket_size": 5e8}}"#,
    )
    .unwrap();
    let t = cfg.to_training(8).unwrap();
    assert_eq!(
        (t.global_batch, t.micro_batch, t.accumulation_steps),
        (Some(1024), Some(32), Some(4))
    );
    assert_eq!(t.strategy.as_deref(), Some("zero2"));
    assert_eq!(t.bucket_mb, Some(1e9 / 1048576.0)); // 5e8 16-bit elements, in MiB
                                                    // With llama-7b, 32 sequences of 4096 tokens per micro-batch cannot fit: the plan says so.
    let r = resolve(&PlanInput::default(), Some(&cfg), &node(8)).unwrap();
    let p = stoker_plan::plan(r, None);
    assert!(
        p.decision
            .warnings
            .iter()
            .any(|w| w.starts_with("the configuration asks for zero2: it does NOT fit")),
        "{:?}",
        p.decision.warnings
    );
}

#[test]
fn precision_and_offload_blocks() {
    let cfg = ds(
        r#"{"bf16": {"enabled": true}, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"}}}"#,
    )
    .unwrap();
    assert_eq!(cfg.precision, Some("bf16"));
    assert!(cfg.offload_optimizer && cfg.offload_params);
    let t = cfg.to_training(8).unwrap();
    assert_eq!(t.strategy.as_deref(), Some("zero3"));
    assert_eq!(t.optimizer.as_deref(), Some("AdamW"));

    let cfg = ds(r#"{"fp16": {"enabled": true, "initial_scale_power": 16}}"#).unwrap();
    assert_eq!(cfg.precision, Some("fp16"));
    let cfg = ds(r#"{"fp16": {"enabled": "auto"}, "train_batch_size": "auto"}"#).unwrap();
    assert_eq!((cfg.precision, cfg.train_batch_size), (None, None));
}

#[test]
fn contradictions_are_reported_with_their_keys() {
    let e = ds(r#"{"fp16": {"enabled": true}, "bf16": {"enabled": true}}"#).unwrap_err();
    assert!(
        e.to_string()
            .contains("both fp16.enabled and bf16.enabled are true"),
        "{e}"
    );
    let e = ds(r#"{"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}"#)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("zero_optimization.offload_param needs zero_optimization.stage 3, got 2"),
        "{e}"
    );
    let e = ds(r#"{"zero_optimization": {"stage": 5}}"#).unwrap_err();
    assert!(
        e.to_string()
            .contains("zero_optimization.stage must be 0..=3, got 5"),
        "{e}"
    );
    let e = ds(r#"{"train_batch_size": -8}"#).unwrap_err();
    assert!(
        e.to_string()
            .contains("train_batch_size must be a positive integer up to 2^63 - 1, got -8"),
        "{e}"
    );
    let e = ds(r#"{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "disk"}}}"#)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("offload_optimizer.device must be cpu, nvme or none"),
        "{e}"
    );
}

#[test]
fn malformed_json_is_an_error_with_position() {
    let e = ds(r#"{"train_batch_size": 8,"#).unwrap_err();
    assert!(matches!(e, PlanError::Json { .. }));
    assert!(
        e.to_string()
            .starts_with("ds_config.json: malformed JSON: "),
        "{e}"
    );
    assert!(e.to_string().contains("line 1"), "{e}");
    let e = ds("[1, 2]").unwrap_err();
    assert!(e.to_string().contains("expected a JSON object"), "{e}");
}

/// Found by fuzzing (tests/fuzz.rs): batch keys near 2^63 overflowed the product the
/// mismatch message prints; counts above 2^63 - 1 are refused.
#[test]
fn batch_keys_near_2_pow_63_are_a_message_not_an_overflow() {
    let max = i64::MAX;
    let cfg = ds(&format!(
        r#"{{"train_batch_size": {max}, "train_micro_batch_size_per_gpu": {max},
            "gradient_accumulation_steps": {max}}}"#
    ))
    .unwrap();
    let err = cfg.to_training(8).unwrap_err().to_string();
    assert!(err.ends_with("x world size 8 (= more than 2^64)"), "{err}");
    let err = ds(r#"{"train_batch_size": 18446744073709551615}"#)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("train_batch_size must be a positive integer up to 2^63 - 1"),
        "{err}"
    );
}

/// Which optimizer DeepSpeed fuses, for its stage-0 fp16 wrapper: Adam and AdamW (any
/// case) become `FusedAdam` unless `torch_adam`; torch's optimizers, and a client's where
/// the file names none, are not fused.
#[test]
fn the_fused_optimizer_is_adam_unless_torch_adam() {
    for (text, fused) in [
        (r#"{"optimizer": {"type": "AdamW"}}"#, true),
        (
            r#"{"optimizer": {"type": "adam", "params": {"lr": 1e-3}}}"#,
            true,
        ),
        (
            r#"{"optimizer": {"type": "AdamW", "params": {"torch_adam": true}}}"#,
            false,
        ),
        (
            r#"{"optimizer": {"type": "Adam", "params": {"torch_adam": 1}}}"#,
            false,
        ),
        (
            r#"{"optimizer": {"type": "Adam", "params": {"torch_adam": 0}}}"#,
            true,
        ),
        (r#"{"optimizer": {"type": "SGD"}}"#, false),
        (r#"{"train_batch_size": 8}"#, false),
    ] {
        assert_eq!(ds(text).unwrap().fused_optimizer(), fused, "{text}");
    }
}
