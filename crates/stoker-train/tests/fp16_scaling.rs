//! fp16: a step whose scaled gradients overflow is skipped (weights and optimizer
//! untouched), reported with the overflowing parameter, and the scale backs off.

mod common;

use std::path::Path;

use common::*;
use stoker_train::config::TrainConfig;
use stoker_train::trainer::Trainer;

#[test]
fn overflowing_fp16_step_is_skipped_and_reported() {
    let text = gpt_config(Path::new("/tmp"), "fp16", 4, "");
    let c = TrainConfig::parse(&text, Path::new("t.toml")).unwrap();
    let mut t = Trainer::new(&c).unwrap();
    // A scale so large that f16 gradients overflow.
    let mut st = t.scaler().unwrap().state().clone();
    st.scale = 1e30;
    t.scaler_mut().unwrap().restore(st).unwrap();
    let before = t.master().to_vec();
    let mb = token_batch(7, 2, 16, 24, &[0, 3]);
    let r = t.train_step(&[mb]).unwrap();
    let why = r.skipped.expect("the step must be skipped");
    assert!(
        why.contains("weight") || why.contains("bias"),
        "report names parameters: {why}"
    );
    // The report's own text, without an index of its own beside the trainer's step 1
    // (before: its Debug form, "OverflowReport { step: 0, ..").
    assert_eq!(r.step, 1);
    assert!(
        why.starts_with("inf/NaN gradients (skip #1, 1 in a row); loss scale 1e30 -> 5e29"),
        "{why}"
    );
    assert_eq!(
        t.master(),
        before,
        "a skipped step leaves the master weights alone"
    );
    assert_eq!(t.optimizer().state().step, 0, "and the optimizer");
    assert_eq!(t.scaler().unwrap().scale(), 5e29, "scale x 0.5");
    // No norm is taken of overflowed gradients: NaN, `null` in metrics.jsonl (before: 0,
    // as if the gradients had vanished).
    assert!(r.grad_norm.is_nan(), "skipped step's norm {}", r.grad_norm);
    let line = stoker_train::metrics::Record::Train {
        step: r.step,
        loss: r.loss,
        lr: r.lr,
        grad_norm: r.grad_norm,
        loss_scale: r.loss_scale,
        throughput: 1.0,
        unit: "tokens/s".into(),
        loader_wait_pct: 0.0,
        skipped: true,
        elapsed_s: 1.0,
        world: 1,
        comm_wait_s: 0.0,
        bytes_sent: 0,
        calls_before_last: 0,
        step_s: 0.1,
        rss_bytes: 0,
    };
    let json = serde_json::to_string(&line).unwrap();
    assert!(json.contains("\"grad_norm\":null"), "{json}");
    match serde_json::from_str(&json).unwrap() {
        stoker_train::metrics::Record::Train { grad_norm, .. } => assert!(grad_norm.is_nan()),
        other => panic!("read back as {other:?}"),
    }

    // With the default scale the next step goes through.
    let mut st = t.scaler().unwrap().state().clone();
    st.scale = 65536.0;
    t.scaler_mut().unwrap().restore(st).unwrap();
    let r = t.train_step(&[token_batch(8, 2, 16, 24, &[1, 0])]).unwrap();
    assert!(r.skipped.is_none() && r.loss.is_finite());
    assert_ne!(t.master(), before);
}

/// `[loss_scale]` with DeepSpeed's preset, and a run whose gradients overflow at every
/// scale (a NaN weight). Under ZeRO (DeepSpeed's `DynamicLossScaler`) the first overflow
/// spends a hysteresis credit, and by default the run stops at the step whose overflow
/// finds the scale already at the floor, naming it, as `raise_error_at_min_scale` does.
/// Under DDP (DeepSpeed's `FP16_Optimizer`, stage 0) every overflow halves the scale and
/// the run goes on at the floor unless `stop_at_min_scale` asks otherwise.
#[test]
fn an_overflow_at_the_floor_stops_a_deepspeed_scaled_run() {
    /// The strategy, `stop_at_min_scale`, the scales of the skipped steps, and the step
    /// that stops the run.
    type Case = (&'static str, Option<bool>, &'static [f32], Option<u64>);
    let cases: [Case; 4] = [
        ("zero1", None, &[4.0, 4.0, 2.0], Some(4)),
        ("zero1", Some(false), &[4.0, 4.0, 2.0, 1.0, 1.0], None),
        ("ddp", None, &[4.0, 2.0, 1.0, 1.0, 1.0], None),
        ("ddp", Some(true), &[4.0, 2.0], Some(3)),
    ];
    for (strategy, stop, scales, stops_at) in cases {
        let what = format!("{strategy}, stop_at_min_scale {stop:?}");
        let stop_line = stop.map_or(String::new(), |s| format!("stop_at_min_scale = {s}\n"));
        let table = format!(
            "[parallel]\nstrategy = \"{strategy}\"\n[loss_scale]\npreset = \"deepspeed\"\n\
             init_scale = 4.0\n{stop_line}"
        );
        let text = gpt_config(Path::new("/tmp"), "fp16", 8, &table);
        let c = TrainConfig::parse(&text, Path::new("t.toml")).unwrap();
        let mut t = Trainer::new(&c).unwrap();
        let mut poisoned = t.full_master().unwrap();
        poisoned[0] = f32::NAN;
        t.set_master(poisoned).unwrap();
        // Each step skipped, each run at its scale.
        for (s, &scale) in scales.iter().enumerate() {
            let r = t
                .train_step(&[token_batch(s as u64, 2, 16, 24, &[0])])
                .unwrap();
            assert!(r.skipped.is_some(), "{what}: step {}", r.step);
            assert_eq!(r.loss_scale, scale, "{what}: step {}", r.step);
        }
        let Some(step) = stops_at else {
            assert_eq!(t.scaler().unwrap().scale(), 1.0, "{what}: the floor holds");
            continue;
        };
        let msg = t
            .train_step(&[token_batch(step - 1, 2, 16, 24, &[0])])
            .expect_err(&what)
            .to_string();
        assert!(
            msg.starts_with(&format!(
                "step {step}: fp16 overflow with the loss scale already at its minimum (1): \
                 inf/NaN gradients (skip #{step}, {step} in a row); loss scale 1 -> 1"
            )) && msg.contains("loss_scale.stop_at_min_scale"),
            "{what}: {msg}"
        );
    }
}

/// `[loss_scale]` is fp16's: another precision refuses it, naming the table, and bad
/// settings name their key.
#[test]
fn loss_scale_settings_are_checked_against_the_precision() {
    let table = "[loss_scale]\npreset = \"deepspeed\"";
    let text = gpt_config(Path::new("/tmp"), "bf16", 4, table);
    let e = TrainConfig::parse(&text, Path::new("t.toml")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "config key `loss_scale`: only fp16 scales its loss, and precision is \"bf16\": leave \
         the [loss_scale] table out"
    );
    let text = gpt_config(Path::new("/tmp"), "fp16", 4, "[loss_scale]\nhysteresis = 0");
    let e = TrainConfig::parse(&text, Path::new("t.toml")).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("config key `loss_scale.hysteresis`: 0: "),
        "{e}"
    );
    // A config that sets it writes it back as it was read.
    let text = gpt_config(
        Path::new("/tmp"),
        "fp16",
        4,
        "[loss_scale]\npreset = \"deepspeed\"\nmin_scale = 0.25",
    );
    let c = TrainConfig::parse(&text, Path::new("t.toml")).unwrap();
    let again = TrainConfig::parse(&toml::to_string(&c).unwrap(), Path::new("w.toml")).unwrap();
    assert_eq!(again.loss_scale, c.loss_scale);
    assert_eq!(
        c.loss_scaler().unwrap(),
        again.loss_scaler().unwrap(),
        "the same scaler"
    );
}
