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
        why.starts_with("inf/NaN gradients (skip #1, 1 in a row); loss scale 1000000000000000000000000000000 -> 500000000000000000000000000000"),
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

/// `[loss_scale]` with DeepSpeed's preset: its hysteresis and floor, and a run whose
/// gradients overflow at every scale (a NaN weight) stops at the step whose overflow
/// finds the scale already at the floor, naming it, as DeepSpeed's
/// `raise_error_at_min_scale` does; with `stop_at_min_scale = false` it goes on skipping.
#[test]
fn an_overflow_at_the_floor_stops_a_deepspeed_scaled_run() {
    for stop in [true, false] {
        let table = format!(
            "[loss_scale]\npreset = \"deepspeed\"\ninit_scale = 4.0\nstop_at_min_scale = {stop}"
        );
        let text = gpt_config(Path::new("/tmp"), "fp16", 8, &table);
        let c = TrainConfig::parse(&text, Path::new("t.toml")).unwrap();
        let mut t = Trainer::new(&c).unwrap();
        let mut poisoned = t.full_master().unwrap();
        poisoned[0] = f32::NAN;
        t.set_master(poisoned).unwrap();
        // 4 (a hysteresis credit spent), 4 -> 2, 2 -> 1: skipped, each run at its scale.
        for (s, scale) in [(0u64, 4.0f32), (1, 4.0), (2, 2.0)] {
            let r = t.train_step(&[token_batch(s, 2, 16, 24, &[0])]).unwrap();
            assert!(r.skipped.is_some(), "stop {stop}: step {}", r.step);
            assert_eq!(r.loss_scale, scale, "stop {stop}: step {}", r.step);
        }
        let at_floor = t.train_step(&[token_batch(3, 2, 16, 24, &[0])]);
        match (stop, at_floor) {
            (true, Err(e)) => {
                let msg = e.to_string();
                assert!(
                    msg.starts_with(
                        "step 4: fp16 overflow with the loss scale already at its minimum (1): \
                         inf/NaN gradients (skip #4, 4 in a row); loss scale 1 -> 1"
                    ) && msg.contains("loss_scale.stop_at_min_scale"),
                    "{msg}"
                );
            }
            (false, Ok(r)) => {
                assert!(r.skipped.is_some() && r.loss_scale == 1.0, "{r:?}");
                assert_eq!(t.scaler().unwrap().scale(), 1.0, "the floor holds");
            }
            (stop, other) => panic!("stop {stop}: step 4 gave {other:?}"),
        }
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
