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
        let n = staged.layout().numel();
        let width = if precision == "fp32" { 4 } else { 2 };
        assert_eq!(staged.staging_bytes(), 2 * width * n, "{precision}");
        let mut skipped = 0;
        for step in 0..6 {
            let a = plain.train_step(&window(step)).unwrap();
            let b = staged.train_step(&window(step)).unwrap();
            skipped += usize::from(b.skipped.is_some());
            assert!(a.loss.is_finite(), "{precision}: step {step}");
            assert_eq!(
                a.loss.to_bits(),
                b.loss.to_bits(),
                "{precision}: step {step}"
            );
            assert_eq!(a.grad_norm.to_bits(), b.grad_norm.to_bits(), "{precision}");
            assert_eq!(a.skipped, b.skipped, "{precision}: step {step}");
        }
        assert_eq!(bits(plain.master()), bits(staged.master()), "{precision}");
        // Each parameter went up once per step that updated (fp16 may skip a step), each
        // as the optimizer finished it: no whole upload on top.
        let params = staged.layout().slots().len();
        let updated = 6 - skipped;
        assert_eq!(
            staged.staging_upload_counts(),
            Some((updated * params, updated * params)),
            "{precision}"
        );
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

/// Every rank's final weights under `strategy` on 2 ranks (threads), through host staging
/// or not.
fn two_ranks(strategy: &str, staged: bool) -> Vec<Vec<u32>> {
    use std::rc::Rc;
    use stoker_comm::{run_local, Communicator};
    let text = gpt_config(
        Path::new("/tmp"),
        "bf16",
        4,
        &format!("[parallel]\nstrategy = \"{strategy}\""),
    )
    .replace(
        "precision = \"bf16\"",
        "precision = \"bf16\"\nkernels = \"composed\"",
    );
    let c = TrainConfig::parse(&text, Path::new("offload.toml")).unwrap();
    run_local(2, std::time::Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let comm: Rc<dyn Communicator> = Rc::new(comm);
        let m =
            stoker_train::models::build_model(&c.model, c.precision, c.kernels, c.seed).unwrap();
        let layout = stoker_train::layout::FlatLayout::of(m.params()).unwrap();
        let s = stoker_train::parallel::for_config(&c, &layout, comm).unwrap();
        let mut t = Trainer::with_strategy(&c, m, s).unwrap();
        if staged {
            t.stage_through_host().unwrap();
        }
        for step in 0..4 {
            let w = vec![
                token_batch(300 + 10 * step + rank as u64, 4, 16, 24, &[]),
                token_batch(400 + 10 * step + rank as u64, 4, 16, 24, &[2]),
            ];
            t.train_step(&w).unwrap();
        }
        if staged {
            // Sharded optimizers upload every parameter after the all-gather; DDP's updates
            // the whole buffer and uploads each as it finishes it.
            let n = t.layout().slots().len();
            let by_segment = if strategy == "ddp" { 4 * n } else { 0 };
            assert_eq!(
                t.staging_upload_counts(),
                Some((4 * n, by_segment)),
                "{strategy}"
            );
        }
        let eval = [token_batch(999, 4, 16, 24, &[])];
        let loss = t.evaluate_local(&eval).unwrap().loss;
        let mut out = bits(&t.full_master().unwrap());
        out.push(loss.to_bits() as u32);
        out.push((loss.to_bits() >> 32) as u32);
        out
    })
    .into_iter()
    .collect()
}

/// The uploads after a sharded optimizer's all-gather (ZeRO-1/2), and the per-parameter
/// uploads under DDP, refresh the variables as the plain path does: weights and the
/// evaluation loss (which reads the variables) bit for bit on every rank.
#[test]
fn data_parallel_strategies_stage_through_host_without_changing_a_bit() {
    for strategy in ["ddp", "zero1", "zero2"] {
        assert_eq!(
            two_ranks(strategy, true),
            two_ranks(strategy, false),
            "{strategy}"
        );
    }
}
