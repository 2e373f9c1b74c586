//! The optimizer-offload path ([`stoker_train::offload`]): a model on a GPU sends every
//! gradient down and every parameter up through host staging buffers. The copies are
//! plain on a CPU, so here the staged step is held to the ordinary one bit for bit (loss,
//! master weights, the variables evaluation reads), in each precision the GPU path runs.
//! The pinned-memory copies themselves need a GPU: scripts/gpu/offload-check.sh.

mod common;

use std::path::Path;

use common::*;
use stoker_train::config::TrainConfig;
use stoker_train::trainer::Trainer;

fn config(precision: &str) -> TrainConfig {
    let text = gpt_config(Path::new("/tmp"), precision, 6, "").replace(
        &format!("precision = \"{precision}\""),
        &format!("precision = \"{precision}\"\nkernels = \"composed\""),
    );
    TrainConfig::parse(&text, Path::new("offload.toml")).unwrap()
}

fn window(step: u64) -> Vec<stoker_train::accumulate::MicroBatch> {
    vec![
        token_batch(100 + step, 4, 16, 24, &[1]),
        token_batch(200 + step, 4, 16, 24, &[]),
    ]
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn staging_through_host_buffers_changes_no_bit() {
    for precision in ["fp32", "bf16", "fp16"] {
        let c = config(precision);
        let mut plain = Trainer::new(&c).unwrap();
        let mut staged = Trainer::new(&c).unwrap();
        assert_eq!(plain.staging_bytes(), 0, "a CPU model stages nothing");
        staged.stage_through_host().unwrap();
        let n = staged.layout.numel();
        let width = if precision == "fp32" { 4 } else { 2 };
        assert_eq!(staged.staging_bytes(), 2 * width * n, "{precision}");
        for step in 0..6 {
            let a = plain.train_step(&window(step)).unwrap();
            let b = staged.train_step(&window(step)).unwrap();
            assert!(a.loss.is_finite(), "{precision}: step {step}");
            assert_eq!(
                a.loss.to_bits(),
                b.loss.to_bits(),
                "{precision}: step {step}"
            );
            assert_eq!(a.grad_norm.to_bits(), b.grad_norm.to_bits(), "{precision}");
            assert_eq!(a.skipped, b.skipped, "{precision}: step {step}");
        }
        assert_eq!(bits(&plain.master), bits(&staged.master), "{precision}");
        // The variables the forward reads were refreshed alike.
        let eval = [token_batch(999, 4, 16, 24, &[])];
        let (ea, eb) = (
            plain.evaluate_local(&eval).unwrap(),
            staged.evaluate_local(&eval).unwrap(),
        );
        assert_eq!(ea.loss.to_bits(), eb.loss.to_bits(), "{precision}");
    }
}

#[test]
fn the_direct_step_has_nothing_to_stage() {
    let text = gpt_config(Path::new("/tmp"), "fp32", 6, "");
    let c = TrainConfig::parse(&text, Path::new("offload.toml")).unwrap();
    let mut t = Trainer::new(&c).unwrap();
    assert!(t.direct());
    let e = t.stage_through_host().unwrap_err().to_string();
    assert!(e.contains("graph path"), "{e}");
}
