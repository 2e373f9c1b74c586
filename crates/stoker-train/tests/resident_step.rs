//! `step = "resident"`: the GPU step's code (stoker-gpu, on its host backend) inside the
//! whole training loop. Against the CPU direct step (`handwritten`) on the same global
//! batches, the GPT and the Llama (grouped-query) train to the same weights and losses
//! in fp32, track them with bf16 activations and with fp16's (under its loss scale),
//! and every strategy (DDP, ZeRO-1/2/3) at 2 ranks gives one rank's result, as the
//! direct step's strategies do; evaluation too.

mod common;

use common::ranks::*;
use stoker_train::config::{StepKind, TrainConfig};

/// The config of [`resident_text`]: `step = "resident"` in place of the kernels key.
fn resident(model: &str, precision: &str, optimizer: &str, extra: &str) -> TrainConfig {
    let text = resident_text(model, precision, optimizer, extra, "");
    let c = TrainConfig::parse(&text, std::path::Path::new("resident.toml")).unwrap();
    assert_eq!(c.step, Some(StepKind::Resident));
    assert!(
        c.direct_step(),
        "step = \"resident\" runs on the direct path"
    );
    c
}

#[test]
fn the_resident_step_trains_like_the_direct_step_in_fp32_and_tracks_it_in_bf16_and_fp16() {
    for (model, optimizer) in [(GPT, ADAMW), (LLAMA, SGD)] {
        let direct = config(model, "fp32", "direct", optimizer, "");
        let want = train(1, &direct, model, 4, 2, micro_batch).remove(0);
        for precision in ["fp32", "bf16", "fp16"] {
            let got = train(
                1,
                &resident(model, precision, optimizer, ""),
                model,
                4,
                2,
                micro_batch,
            )
            .remove(0);
            let what = format!("{} resident {precision}", &model[8..11]);
            let d = rel_l2_checked(&got.0, &want.0);
            let (tol, loss_tol) = match precision {
                "fp32" => (1e-5, 1e-5),
                // f16 keeps 11 significant bits to bf16's 8.
                "fp16" => (2e-3, 5e-3),
                _ => (2e-2, 2e-2),
            };
            eprintln!("{what}: weights after {STEPS} steps differ from the direct step's by {d:.2e} (relative L2)");
            assert!(
                d <= tol,
                "{what}: weights differ by {d:e} from the direct step's"
            );
            for (s, (a, b)) in got.1.iter().zip(&want.1).enumerate() {
                assert_eq!(a.count, b.count, "{what}: step {s}'s target count");
                stoker_testkit::assert_close_scalar(
                    a.loss,
                    b.loss,
                    loss_tol,
                    &format!("{what}: step {s}'s loss"),
                );
            }
        }
    }
}

#[test]
fn every_strategy_with_the_resident_step_equals_one_rank_and_evaluates_alike() {
    for (model, optimizer) in [(GPT, ADAMW), (LLAMA, ADAMW)] {
        let one = resident(model, "fp32", optimizer, "");
        let reference = train_and_evaluate(1, &one, model, 4, 2, STEPS, 3, micro_batch).remove(0);
        for strategy in strategies() {
            let c = resident(model, "fp32", optimizer, strategy);
            let what = format!("{} resident {}", &model[8..11], strategy.replace('\n', " "));
            for (r, run) in train_and_evaluate(2, &c, model, 4, 1, STEPS, 3, micro_batch)
                .iter()
                .enumerate()
            {
                let d = rel_l2_checked(&run.master, &reference.master);
                assert!(
                    d <= 1e-5,
                    "{what}: rank {r}'s weights differ by {d:e} from one rank's"
                );
                let (e, want) = (run.eval.as_ref().unwrap(), reference.eval.as_ref().unwrap());
                assert_eq!(e.count, want.count, "{what}: rank {r}'s evaluation count");
                stoker_testkit::assert_close_scalar(
                    e.accuracy,
                    want.accuracy,
                    0.0,
                    &format!("{what}: rank {r}'s evaluation accuracy"),
                );
                stoker_testkit::assert_close_scalar(
                    e.loss,
                    want.loss,
                    1e-5,
                    &format!("{what}: rank {r}'s evaluation loss"),
                );
            }
        }
    }
}

/// fp16 through the adapter (ZeRO-3 keeping its gathered parameters through the
/// backward, and ZeRO-2's `no_sync`: the CPU trainer's own loss scaler over the host
/// gradients) and on the loop's ZeRO-3 at 2 ranks trains what the resident loop (its
/// scaler's skip on the backend) trains at one rank.
#[test]
fn fp16_through_the_adapter_trains_what_the_loop_trains() {
    let one = resident(GPT, "fp16", ADAMW, "strategy = \"none\"");
    assert!(one.resident_loop());
    let want = train(1, &one, GPT, 4, 1, micro_batch).remove(0);
    let no_sync = "strategy = \"zero2\"\nsync_every_micro_batch = false";
    for strategy in ZERO3.iter().chain([no_sync].iter()) {
        let c = resident(GPT, "fp16", ADAMW, strategy);
        let on_loop = *strategy == ZERO3[0];
        assert_eq!(c.resident_loop(), on_loop, "{strategy}");
        for (r, got) in train(2, &c, GPT, 4, 1, micro_batch).iter().enumerate() {
            let d = rel_l2_checked(&got.0, &want.0);
            eprintln!("fp16 {strategy}: rank {r} within {d:.1e} of the loop's (relative L2)");
            assert!(
                d <= 1e-5,
                "fp16 {strategy}: rank {r}'s weights differ by {d:e}"
            );
            for (a, b) in got.1.iter().zip(&want.1) {
                assert_eq!(a.loss_scale, b.loss_scale, "{strategy}: step {}", a.step);
                assert_eq!(a.skipped.is_some(), b.skipped.is_some());
            }
        }
    }
}

#[test]
fn what_the_resident_step_cannot_run_is_refused_naming_the_key() {
    let text = |model: &str, precision: &str, device: &str| {
        resident_text(
            model,
            precision,
            ADAMW,
            "",
            &format!("\ndevice = \"{device}\""),
        )
    };
    let err = |t: String| {
        TrainConfig::parse(&t, std::path::Path::new("r.toml"))
            .unwrap_err()
            .to_string()
    };
    let e = err(text(CNN, "fp32", "cpu"));
    assert!(e.contains("step") && e.contains("GPT or a Llama"), "{e}");
    // fp8 runs (its FP8 linear layers: tests/resident_loop.rs); fp64 needs the graph.
    let e = err(text(GPT, "fp64", "cpu"));
    assert!(
        e.contains("precision") && e.contains("fp64 needs the graph"),
        "{e}"
    );
    // On a GPU the resident loop runs (the device keys are checked in config.rs's
    // tests); a build without CUDA says so, naming the key.
    if !cfg!(feature = "cuda") {
        let e = err(text(GPT, "fp32", "cuda"));
        assert!(e.contains("device") && e.contains("no CUDA support"), "{e}");
    }
}
