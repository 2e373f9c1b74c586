//! The trainer on the resident loop (`step = "resident"` under one rank, DDP or ZeRO-1 to -3:
//! stoker-gpu's `Replica`, here on its host backend): the path each strategy gets, a run
//! stopped, checkpointed and resumed equal to one that never stopped (bit for bit, on one
//! rank and on ZeRO-1's two), a shorter window and evaluation batches of other shapes
//! against the CPU direct step, and fp16's overflows skipped as the CPU step skips them.

mod common;

use std::rc::Rc;
use std::time::Duration;

use common::ranks::*;
use stoker_comm::{run_local, Communicator};
use stoker_train::accumulate::MicroBatch;
use stoker_train::checkpoint::{LoadedState, Stateful};
use stoker_train::config::TrainConfig;
use stoker_train::layout::FlatLayout;
use stoker_train::models::build_model;
use stoker_train::trainer::{StepReport, Trainer};

/// The config of [`resident_text`]: `step = "resident"` in place of the kernels key.
fn resident(model: &str, precision: &str, optimizer: &str, extra: &str) -> TrainConfig {
    let text = resident_text(model, precision, optimizer, extra, "");
    TrainConfig::parse(&text, std::path::Path::new("resident.toml")).unwrap()
}

/// A trainer for rank `comm.rank()` of `config`'s strategy over `comm`.
fn trainer(config: &TrainConfig, comm: Rc<dyn Communicator>) -> Trainer {
    let m = build_model(&config.model, config.precision, config.kernels, config.seed).unwrap();
    let layout = FlatLayout::of(m.params()).unwrap();
    let strategy = stoker_train::parallel::for_config(config, &layout, comm).unwrap();
    Trainer::with_strategy(config, m, strategy).unwrap()
}

/// This rank's window of step `s`: `k` micro-batches of the global batch.
fn window(model: &str, s: usize, rank: usize, k: usize) -> Vec<MicroBatch> {
    (rank * k..(rank + 1) * k)
        .map(|j| micro_batch(model, s, j))
        .collect()
}

/// `t`'s state as a checkpoint would save it and load it back, after bringing the
/// trainer's mirror up to the loop's; its FP8 scalers as `fp8` makes them of the saved.
fn saved_state_with(
    t: &mut Trainer,
    fp8: impl FnOnce(Option<Fp8Layers>) -> Option<Fp8Layers>,
) -> LoadedState {
    t.sync_host().unwrap();
    let st = t.state();
    LoadedState {
        step: st.step,
        sampler: st.sampler,
        master: st.master.to_vec(),
        optimizer: st.optimizer.to_owned(),
        scaler: st.scaler,
        fp8: fp8(st.fp8),
    }
}

/// The FP8 scalers a checkpoint holds, by layer.
type Fp8Layers = std::collections::BTreeMap<String, stoker_train::precision::LayerScalers>;

/// [`saved_state_with`] without FP8 scalers.
fn saved_state(t: &mut Trainer) -> LoadedState {
    saved_state_with(t, |_| None)
}

/// `got`'s weights and steps (losses, norms, loss scales, skips) are `want`'s, bit for
/// bit.
fn assert_same_run(what: &str, got: (&[f32], &[StepReport]), want: (&[f32], &[StepReport])) {
    assert_eq!(got.0.len(), want.0.len(), "{what}: weights");
    let same = got
        .0
        .iter()
        .zip(want.0)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "{what}: weights differ");
    assert_eq!(got.1.len(), want.1.len(), "{what}: steps");
    for (a, b) in got.1.iter().zip(want.1) {
        let step = format!("{what}: step {}", a.step);
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{step}: loss");
        assert_eq!(a.grad_norm.to_bits(), b.grad_norm.to_bits(), "{step}: norm");
        assert_eq!(a.loss_scale, b.loss_scale, "{step}: loss scale");
        assert_eq!(a.skipped.is_some(), b.skipped.is_some(), "{step}: skip");
    }
}

#[test]
fn the_resident_loop_serves_one_rank_ddp_and_zero1_to_3_and_the_adapter_the_rest() {
    for (extra, world, want) in [
        ("strategy = \"none\"", 1, "resident"),
        ("strategy = \"ddp\"", 2, "resident"),
        ("strategy = \"zero1\"", 2, "resident"),
        ("strategy = \"zero2\"", 2, "resident"),
        (
            "strategy = \"zero2\"\nsync_every_micro_batch = false",
            2,
            "direct",
        ),
        ("strategy = \"zero3\"", 2, "resident"),
        ("strategy = \"ddp\"\ndeterministic = true", 2, "resident"),
        ("strategy = \"zero1\"\ndeterministic = true", 2, "resident"),
        ("strategy = \"zero2\"\ndeterministic = true", 2, "direct"),
    ] {
        let c = resident(GPT, "fp32", ADAMW, extra);
        assert_eq!(c.resident_loop(), want == "resident", "{extra}");
        let names = run_local(world, Duration::from_secs(60), |comm| {
            trainer(&c, Rc::new(comm)).path().name()
        });
        assert!(
            names.iter().all(|n| *n == want),
            "{extra}: paths {names:?}, expected {want}"
        );
    }
}

/// `steps` steps on `world` ranks, stopping after `stop` of them (if given) to save each
/// rank's state and load it into a fresh trainer, which runs the rest. Every rank's whole
/// master and reports.
fn run_with_resume(
    config: &TrainConfig,
    model: &'static str,
    world: usize,
    steps: usize,
    stop: Option<usize>,
) -> Vec<(Vec<f32>, Vec<StepReport>)> {
    let k = 4 / world;
    run_local(world, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let comm: Rc<dyn Communicator> = Rc::new(comm);
        let mut t = trainer(config, comm.clone());
        let mut reports = Vec::new();
        for s in 0..steps {
            if Some(s) == stop {
                let saved = saved_state(&mut t);
                // The fresh trainer starts from other weights: the load must replace them.
                let mut other = config.clone();
                other.seed += 1;
                t = trainer(&other, comm.clone());
                t.load_state(saved).unwrap();
            }
            reports.push(t.train_step(&window(model, s, rank, k)).unwrap());
        }
        (t.full_master().unwrap(), reports)
    })
}

#[test]
fn a_resident_run_resumed_from_its_state_equals_one_that_never_stopped() {
    // SGD without momentum: the trainer's SGD keeps a momentum buffer all the same, and
    // the loop's must match it for the state to cross.
    const PLAIN_SGD: &str = "kind = \"sgd\"\nlr = 0.05\nmomentum = 0.0";
    for (precision, extra, world, optimizer) in [
        ("fp32", "strategy = \"none\"", 1, ADAMW),
        ("bf16", "strategy = \"none\"", 1, ADAMW),
        ("fp32", "strategy = \"zero1\"", 2, ADAMW),
        ("bf16", "strategy = \"ddp\"", 2, ADAMW),
        ("fp32", "strategy = \"zero1\"", 2, SGD),
        ("fp32", "strategy = \"none\"", 1, PLAIN_SGD),
        ("fp16", "strategy = \"zero1\"", 2, ADAMW),
        ("bf16", "strategy = \"zero2\"", 2, ADAMW),
        ("bf16", "strategy = \"zero3\"", 2, ADAMW),
        ("fp16", "strategy = \"zero3\"", 4, SGD),
    ] {
        let c = resident(GPT, precision, optimizer, extra);
        let what = format!("{precision} {extra} on {world} ranks, {optimizer}");
        let straight = run_with_resume(&c, GPT, world, 5, None);
        let resumed = run_with_resume(&c, GPT, world, 5, Some(3));
        for (r, ((m, reps), (want_m, want_reps))) in resumed.iter().zip(&straight).enumerate() {
            assert!(
                m.iter().all(|x| x.is_finite()),
                "{what}: rank {r}'s weights are not finite"
            );
            let same = m
                .iter()
                .zip(want_m)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: rank {r}'s resumed weights differ");
            for (s, (a, b)) in reps.iter().zip(want_reps).enumerate() {
                assert_eq!(
                    a.loss.to_bits(),
                    b.loss.to_bits(),
                    "{what}: rank {r}'s step {s} loss {} against {}",
                    a.loss,
                    b.loss
                );
                assert_eq!(a.step, b.step, "{what}: step count");
            }
        }
    }
}

#[test]
fn deterministic_ddp_and_zero1_on_the_loop_give_one_rank_s_bits_at_2_and_4_ranks() {
    // A global batch of 4 micro-batches: 4 on one rank, 2 on each of two, 1 on each of
    // four; the tree sums them alike (stoker-gpu's tests/deterministic.rs for the sums).
    // ZeRO-1 steps each rank's shard from the same whole gradient and norm.
    for (precision, optimizer, strategy) in [
        ("fp32", ADAMW, "ddp"),
        ("bf16", ADAMW, "ddp"),
        ("fp16", SGD, "ddp"),
        ("bf16", ADAMW, "zero1"),
    ] {
        let mut c = resident(
            GPT,
            precision,
            optimizer,
            &format!("strategy = \"{strategy}\"\ndeterministic = true"),
        );
        c.batch.global_batch = Some(4 * c.batch.micro_batch);
        assert!(c.resident_loop(), "deterministic DDP runs on the loop");
        let one = run_with_resume(&c, GPT, 1, 4, None).remove(0);
        for world in [2, 4] {
            for (r, (m, reps)) in run_with_resume(&c, GPT, world, 4, None).iter().enumerate() {
                let what = format!("{strategy} {precision} {optimizer}, rank {r} of {world}");
                assert_same_run(&what, (m, reps), (&one.0, &one.1));
            }
        }
        // Resumed from a checkpoint mid-run, on 2 ranks: the same bits again.
        for (m, reps) in run_with_resume(&c, GPT, 2, 4, Some(2)) {
            assert_same_run("resumed on 2 ranks", (&m, &reps), (&one.0, &one.1));
        }
    }
}

#[test]
fn a_shorter_window_and_other_evaluation_shapes_track_the_direct_step() {
    for (model, optimizer) in [(GPT, ADAMW), (LLAMA, SGD)] {
        let direct = config(model, "fp32", "direct", optimizer, "strategy = \"none\"");
        let res = resident(model, "fp32", optimizer, "strategy = \"none\"");
        let run = |c: &TrainConfig| {
            run_local(1, Duration::from_secs(60), |comm| {
                let mut t = trainer(c, Rc::new(comm));
                let mut losses = Vec::new();
                for s in 0..3 {
                    losses.push(t.train_step(&window(model, s, 0, 2)).unwrap().loss);
                }
                // One sequence per micro-batch: the step at another shape.
                let short: Vec<MicroBatch> = (0..2)
                    .map(|j| common::token_batch(500 + j, 1, 6, 11, &[j as usize % 3]))
                    .collect();
                losses.push(t.train_step(&short).unwrap().loss);
                // Back to the first shape, then evaluation at a third.
                losses.push(t.train_step(&window(model, 3, 0, 2)).unwrap().loss);
                let eval: Vec<MicroBatch> = (0..2)
                    .map(|j| common::token_batch(900 + j, 3, 6, 11, &[1, 0, 2]))
                    .collect();
                let e = t.evaluate(&eval).unwrap();
                (t.full_master().unwrap(), losses, e)
            })
            .remove(0)
        };
        let (want_m, want_l, want_e) = run(&direct);
        let (m, l, e) = run(&res);
        let what = &model[8..11];
        let d = rel_l2_checked(&m, &want_m);
        eprintln!("{what}: resident loop against the direct step after a shorter window: {d:.2e} (relative L2)");
        assert!(d <= 1e-5, "{what}: weights differ by {d:e}");
        for (s, (a, b)) in l.iter().zip(&want_l).enumerate() {
            stoker_testkit::assert_close_scalar(*a, *b, 1e-5, &format!("{what}: step {s} loss"));
        }
        assert_eq!(e.count, want_e.count, "{what}: evaluation count");
        stoker_testkit::assert_close_scalar(e.loss, want_e.loss, 1e-5, "evaluation loss");
        stoker_testkit::assert_close_scalar(e.accuracy, want_e.accuracy, 0.0, "accuracy");
    }
}

#[test]
fn the_loop_holds_what_its_plan_says() {
    // The planned side of a run's device memory: the loop's bytes from the sizes its
    // buffers are made with, before it exists, against its buffers counted after a step.
    for (model, precision, optimizer, extra, world) in [
        (GPT, "fp32", ADAMW, "strategy = \"none\"", 1),
        (GPT, "bf16", ADAMW, "strategy = \"zero1\"", 2),
        (LLAMA, "bf16", SGD, "strategy = \"ddp\"", 2),
        (LLAMA, "fp32", ADAMW, "strategy = \"zero1\"", 3),
        (GPT, "bf16", SGD, "strategy = \"zero2\"", 2),
        (LLAMA, "fp32", ADAMW, "strategy = \"zero2\"", 3),
        (GPT, "bf16", ADAMW, "strategy = \"zero3\"", 2),
        (LLAMA, "fp32", SGD, "strategy = \"zero3\"", 3),
        // Deterministic mode's scratch for the tree over ranks.
        (
            GPT,
            "bf16",
            ADAMW,
            "strategy = \"ddp\"\ndeterministic = true",
            2,
        ),
    ] {
        let c = resident(model, precision, optimizer, extra);
        let what = format!("{} {precision} {extra} on {world}", &model[8..11]);
        let got = run_local(world, Duration::from_secs(60), |comm| {
            let rank = comm.rank();
            let mut t = trainer(&c, Rc::new(comm));
            t.train_step(&window(model, 0, rank, 1)).unwrap();
            let planned = stoker_train::trainer::planned_resident_bytes(
                &c,
                t.layout().total_len(),
                (rank, world),
            )
            .unwrap();
            let (counted, measured) = t.resident_bytes().unwrap();
            (planned, counted, measured)
        });
        for (r, (planned, counted, measured)) in got.into_iter().enumerate() {
            assert_eq!(
                planned, counted,
                "{what}: rank {r}'s planned and counted bytes"
            );
            assert!(
                planned.state > 0 && planned.steps > 0,
                "{what}: {planned:?}"
            );
            assert_eq!(
                measured, None,
                "{what}: the host build has no driver to ask"
            );
        }
    }
    // Deterministic mode's tree with two levels of partial sums: 4 micro-batches a rank.
    let mut c = resident(
        GPT,
        "fp32",
        ADAMW,
        "strategy = \"ddp\"\ndeterministic = true",
    );
    c.batch.accumulation_steps = Some(4);
    let got = run_local(2, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut t = trainer(&c, Rc::new(comm));
        t.train_step(&window(GPT, 0, rank, 4)).unwrap();
        let len = t.layout().total_len();
        let planned = stoker_train::trainer::planned_resident_bytes(&c, len, (rank, 2)).unwrap();
        (planned, t.resident_bytes().unwrap().0, len)
    });
    for (planned, counted, len) in got {
        assert_eq!(planned, counted, "deterministic, 4 micro-batches a rank");
        // Two gradient-sized f32 buffers of partial sums beyond the plain DDP plan.
        let mut plain = c.clone();
        plain.parallel.deterministic = false;
        let base = stoker_train::trainer::planned_resident_bytes(&plain, len, (0, 2)).unwrap();
        assert!(
            planned.state >= base.state + 2 * 4 * len,
            "{planned:?} against {base:?}"
        );
    }
}

#[test]
fn weights_set_between_windows_keep_the_moments_and_evaluation_sees_a_loaded_state() {
    let c = resident(GPT, "fp32", ADAMW, "strategy = \"zero1\"");
    let eval: Vec<MicroBatch> = (0..2).map(|j| micro_batch(GPT, 99, j)).collect();
    let runs = run_local(2, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let comm: Rc<dyn Communicator> = Rc::new(comm);
        // Four steps straight.
        let mut straight = trainer(&c, comm.clone());
        for s in 0..4 {
            straight.train_step(&window(GPT, s, rank, 2)).unwrap();
        }
        // Two steps, the same weights set again (the moments must survive), two more.
        let mut reset = trainer(&c, comm.clone());
        for s in 0..2 {
            reset.train_step(&window(GPT, s, rank, 2)).unwrap();
        }
        let weights = reset.full_master().unwrap();
        reset.set_master(weights).unwrap();
        for s in 2..4 {
            reset.train_step(&window(GPT, s, rank, 2)).unwrap();
        }
        // A state loaded into a trainer of other weights, evaluated before any window.
        let saved = saved_state(&mut straight);
        let mut other = c.clone();
        other.seed += 1;
        let mut loaded = trainer(&other, comm.clone());
        loaded.load_state(saved).unwrap();
        let want = straight.evaluate(&eval[rank..rank + 1]).unwrap();
        let got = loaded.evaluate(&eval[rank..rank + 1]).unwrap();
        (
            straight.full_master().unwrap(),
            reset.full_master().unwrap(),
            want,
            got,
        )
    });
    for (r, (straight, reset, want, got)) in runs.into_iter().enumerate() {
        let same = straight
            .iter()
            .zip(&reset)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "rank {r}: setting the same weights mid-run changed the run"
        );
        assert_eq!(
            want, got,
            "rank {r}: a loaded state evaluates as the one saved"
        );
    }
}

/// ZeRO-3 on the loop (the compute copy sharded on the backend, each block gathered as
/// it runs) trains what ZeRO-2 on the loop trains, bit for bit, at 2 ranks; its
/// evaluation is a collective that pads a rank with fewer batches (3 against 2 here) and
/// agrees with ZeRO-2's; a rank's evaluation alone is refused naming why; the run
/// reports itself as "zero3"; and the host holds, and is planned to hold, ZeRO-2's share.
#[test]
fn zero3_on_the_loop_trains_and_evaluates_what_zero2_does() {
    let eval: Vec<MicroBatch> = (0..5).map(|j| micro_batch(GPT, 99, j)).collect();
    let run = |strategy: &str| {
        let c = resident(GPT, "bf16", ADAMW, &format!("strategy = \"{strategy}\""));
        run_local(2, Duration::from_secs(60), |comm| {
            let rank = comm.rank();
            let mut t = trainer(&c, Rc::new(comm));
            let reports: Vec<StepReport> = (0..3)
                .map(|s| t.train_step(&window(GPT, s, rank, 2)).unwrap())
                .collect();
            let mine = match rank {
                0 => &eval[..3],
                _ => &eval[3..],
            };
            let e = t.evaluate(mine).unwrap();
            let alone = t.evaluate_local(mine).err().map(|e| e.to_string());
            let name = t.strategy().name();
            // The host's share: what the trainer holds against the planner's prediction.
            let dims = stoker_train::parallel::ParallelDims::resolve(&c, 2, rank, "test").unwrap();
            let plan = stoker_train::planned::predicted(&c, &dims, t.layout());
            let host = (t.held_bytes().model_states(), plan.model_states());
            (t.full_master().unwrap(), reports, e, alone, name, host)
        })
    };
    let (zero2, zero3) = (run("zero2"), run("zero3"));
    for (r, (got, want)) in zero3.iter().zip(&zero2).enumerate() {
        let what = format!("rank {r}");
        assert_same_run(&what, (&got.0, &got.1), (&want.0, &want.1));
        assert_eq!(got.2, want.2, "{what}: the evaluation");
        assert_eq!(got.2.count, want.2.count);
        assert!(got.2.count > 0);
        let alone = got
            .3
            .as_deref()
            .expect("a rank's evaluation alone under ZeRO-3");
        assert!(
            alone.contains("zero3") && alone.contains("collective"),
            "{alone}"
        );
        assert_eq!(want.3, None, "ZeRO-2 evaluates a rank's batches alone");
        assert_eq!((got.4, want.4), ("zero3", "zero2"));
        // The host keeps ZeRO-2's bookkeeping under both, and is planned so.
        eprintln!(
            "{what}: the host's model states held/planned {:.4}",
            got.5 .0 as f64 / got.5 .1
        );
        assert_eq!(got.5, want.5, "{what}: the host's held and planned bytes");
    }
}

/// The bytes the loop sends per window against the planner's prediction at an odd world
/// with accumulation: its ZeRO-2 and ZeRO-3 reduce-scatter the blocks every micro-batch
/// but the runs outside them once a window, and its ZeRO-3 gathers blocks into two slots
/// (before: planned as the CPU trainer's whole-buffer reductions, 1.27-1.6x what the
/// loop sends). Three blocks, so that ZeRO-3's slots must gather again each micro-batch.
#[test]
fn the_loop_sends_what_the_plan_says_under_every_strategy() {
    use stoker_train::parallel::ParallelDims;
    let (world, k) = (3, 4);
    for (name, model) in [("gpt", GPT), ("llama", LLAMA)] {
        let model = model.replace("n_layer = 2", "n_layer = 3");
        for strategy in ["ddp", "zero1", "zero2", "zero3"] {
            let text = resident_text(
                &model,
                "fp32",
                ADAMW,
                &format!("strategy = \"{strategy}\""),
                "",
            )
            .replace(
                "micro_batch = 2\n",
                &format!("micro_batch = 2\naccumulation_steps = {k}\n"),
            );
            let c = TrainConfig::parse(&text, std::path::Path::new("t.toml")).unwrap();
            let m = build_model(&c.model, c.precision, c.kernels, c.seed).unwrap();
            let layout = FlatLayout::of(m.params()).unwrap();
            let dims = ParallelDims::resolve(&c, world, 0, "test").unwrap();
            assert_eq!(dims.accumulation_steps, k);
            let planned = stoker_train::planned::predicted(&c, &dims, &layout).bytes_sent_per_step;
            let sent = run_local(world, Duration::from_secs(60), |comm| {
                let rank = comm.rank();
                let mut t = trainer(&c, Rc::new(comm));
                t.train_step(&window(&model, 0, rank, k))
                    .unwrap()
                    .sync
                    .bytes_sent
            });
            for (r, &b) in sent.iter().enumerate() {
                let ratio = b as f64 / planned;
                let what = format!("{name} {strategy} rank {r} of {world}");
                eprintln!("{what}: sent {b} bytes, planned {planned:.0}, ratio {ratio:.4}");
                // The norm's and the tallies' scalar sums are not planned: a few bytes.
                assert!(
                    (0.999..=1.02).contains(&ratio),
                    "{what}: sent {b} bytes, planned {planned:.0}"
                );
            }
        }
    }
}

#[test]
fn a_step_reports_its_own_window_s_traffic() {
    let c = resident(GPT, "fp32", ADAMW, "strategy = \"ddp\"");
    let sent = run_local(2, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut t = trainer(&c, Rc::new(comm));
        (0..3)
            .map(|s| {
                t.train_step(&window(GPT, s, rank, 2))
                    .unwrap()
                    .sync
                    .bytes_sent
            })
            .collect::<Vec<_>>()
    });
    for (r, s) in sent.iter().enumerate() {
        assert!(s[0] > 0, "rank {r}: no bytes counted: {s:?}");
        assert!(
            s.iter().all(|&b| b == s[0]),
            "rank {r}: each window sends as much, not a running total: {s:?}"
        );
    }
}

/// `c`'s plan line on one rank of a device whose 90% is exactly what `c` at micro-batch
/// `micro` needs, with those bytes.
fn plan_line_where_micro_batch_fits(
    c: &TrainConfig,
    micro: usize,
) -> (String, stoker_train::models::resident_run::ResidentBytes) {
    let m = build_model(&c.model, c.precision, c.kernels, c.seed).unwrap();
    let len = FlatLayout::of(m.params()).unwrap().total_len();
    let mut at = c.clone();
    at.batch.micro_batch = micro;
    let need = stoker_train::trainer::planned_resident_bytes(&at, len, (0, 1)).unwrap();
    let device = (need.total() as f64 + 0.5) / 0.9;
    let line = stoker_train::planned::resident_plan_line(c, 1, Some(("test GPU", device)))
        .unwrap()
        .unwrap();
    (line, need)
}

#[test]
fn the_plan_line_finds_the_largest_micro_batch_that_fits() {
    // A device whose 90% is exactly what micro-batch 2 needs: 2 fits, 3 does not.
    let c = resident(GPT, "bf16", ADAMW, "strategy = \"none\"");
    let (line, two) = plan_line_where_micro_batch_fits(&c, 2);
    assert!(
        line.contains("the largest micro-batch within 90% of it: 2 ("),
        "{line}"
    );
    // And what recomputing attention and the MLP would allow: at least as many.
    let recomputed: usize = line
        .rsplit_once(" (")
        .and_then(|(_, r)| r.strip_suffix(" with recompute = \"attention+mlp\")"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no recompute figure in {line}"));
    assert!(recomputed >= 2, "{line}");
    let mib = format!("{:.2} MiB planned", two.total() as f64 / (1 << 20) as f64);
    assert!(line.contains(&mib), "{line} (expected {mib})");
    // ZeRO-3 is on the loop (its memory against ZeRO-2's: stoker-gpu's tests/zero3.rs;
    // this GPT's two blocks fill its two slots, so it saves nothing); off the loop, no
    // line.
    let zero3 = resident(GPT, "bf16", ADAMW, "strategy = \"zero3\"");
    let line = stoker_train::planned::resident_plan_line(&zero3, 2, None)
        .unwrap()
        .unwrap();
    assert!(line.contains("(zero3 on 2 rank(s)"), "{line}");
    let off = resident(
        GPT,
        "bf16",
        ADAMW,
        "strategy = \"zero2\"\ndeterministic = true",
    );
    assert!(stoker_train::planned::resident_plan_line(&off, 2, None)
        .unwrap()
        .is_none());
    // fp8's micro-batch rows must be multiples of 16: with context 8, an even micro-batch.
    // A device whose 90% is what micro-batch 5 needs offers 4, not 5.
    let fp8 = resident(GPT16, "fp8", ADAMW, "strategy = \"none\"");
    let (line, _) = plan_line_where_micro_batch_fits(&fp8, 5);
    assert!(
        line.contains("the largest micro-batch within 90% of it: 4 ("),
        "{line}"
    );
}

#[test]
fn a_trainer_that_only_loads_and_reads_weights_never_makes_its_loop() {
    // `stoker export` on a machine without the run's GPU: the loop (and its GPU) is made
    // by the first window or evaluation, not by loading and reading a state.
    let c = resident(GPT, "fp32", ADAMW, "strategy = \"none\"");
    let (saved, want) = run_local(1, Duration::from_secs(60), |comm| {
        let mut t = trainer(&c, Rc::new(comm));
        for s in 0..2 {
            t.train_step(&window(GPT, s, 0, 2)).unwrap();
        }
        (saved_state(&mut t), t.master().to_vec())
    })
    .remove(0);
    // The closure runs once per rank (one here): it takes the state out.
    let saved = std::sync::Mutex::new(Some(saved));
    let got = run_local(1, Duration::from_secs(60), |comm| {
        let mut t = trainer(&c, Rc::new(comm));
        assert!(
            t.resident_bytes().is_none(),
            "made when the trainer was built"
        );
        t.load_state(saved.lock().unwrap().take().unwrap()).unwrap();
        let m = t.master().to_vec();
        assert!(
            t.resident_bytes().is_none(),
            "made by loading or reading weights"
        );
        m
    })
    .remove(0);
    assert_eq!(got, want);
}

#[test]
fn an_offloaded_optimizer_leaves_the_device_only_the_step() {
    // `parallel.offload_optimizer = true` on a GPU (the config is checked there; its plan
    // is the same here): the loop's master and moments are in host memory.
    let mut c = resident(GPT, "bf16", ADAMW, "strategy = \"ddp\"");
    let m = build_model(&c.model, c.precision, c.kernels, c.seed).unwrap();
    let len = FlatLayout::of(m.params()).unwrap().total_len();
    let on_device = stoker_train::trainer::planned_resident_bytes(&c, len, (0, 2)).unwrap();
    c.parallel.offload_optimizer = true;
    let offloaded = stoker_train::trainer::planned_resident_bytes(&c, len, (0, 2)).unwrap();
    assert_eq!(offloaded.state, 0, "{offloaded:?}");
    assert_eq!(offloaded.steps, on_device.steps);
    assert!(on_device.state > 0);
    // ZeRO-1 and ZeRO-2 with their shards offloaded keep only the shard's gradients (and
    // ZeRO-2's landing buffer) on the device.
    for kind in [
        stoker_train::config::StrategyKind::Zero1,
        stoker_train::config::StrategyKind::Zero2,
    ] {
        c.parallel.strategy = kind;
        let plan = |c: &mut TrainConfig, offload: bool| {
            c.parallel.offload_optimizer = offload;
            stoker_train::trainer::planned_resident_bytes(c, len, (0, 2)).unwrap()
        };
        let (off, on) = (plan(&mut c, true), plan(&mut c, false));
        assert_eq!(off.steps, on.steps, "{kind:?}");
        assert!(
            off.state < on.state && off.state > 0,
            "{kind:?}: {off:?} against {on:?}"
        );
    }
}

/// fp16 on the loop: a run whose loss scale starts far too high skips its first steps
/// (every rank alike, the scale halving each time, the weights untouched) and then trains
/// exactly, bit for bit, as a run started at the scale it settled on, at that step: a
/// skipped step leaves no trace in the weights, the moments or the optimizer's count.
#[test]
fn fp16_overflows_skip_steps_and_leave_no_trace() {
    for (extra, world) in [
        ("strategy = \"none\"", 1),
        ("strategy = \"zero1\"", 2),
        ("strategy = \"zero3\"", 2),
    ] {
        let mut c = resident(GPT, "fp16", ADAMW, extra);
        assert!(c.resident_loop(), "{extra}: not on the loop");
        let k = 4 / world;
        // The scale to start from (f16's gradients overflow far below it), and the steps.
        const TOP: i32 = 26;
        const STEPS_AT: usize = 12;
        // The schedule runs to the last step (its learning rate is 0 beyond).
        c.train.steps = STEPS_AT as u64;
        // Steps from `from` to STEPS_AT with the scaler at `scale`, from the seeded weights.
        let run = |scale: f32, from: usize| {
            run_local(world, Duration::from_secs(60), |comm| {
                let rank = comm.rank();
                let mut t = trainer(&c, Rc::new(comm));
                let mut state = saved_state(&mut t);
                state.step = from as u64;
                state.scaler.as_mut().expect("fp16 has a loss scaler").scale = scale;
                t.load_state(state).unwrap();
                let reports: Vec<StepReport> = (from..STEPS_AT)
                    .map(|s| t.train_step(&window(GPT, s, rank, k)).unwrap())
                    .collect();
                (t.full_master().unwrap(), reports)
            })
        };
        let high = run(2f32.powi(TOP), 0);
        let reports = &high[0].1;
        let skipped = reports.iter().take_while(|r| r.skipped.is_some()).count();
        assert!(
            (1..STEPS_AT - 2).contains(&skipped),
            "{extra}: {skipped} of {STEPS_AT} steps skipped at 2^{TOP}"
        );
        for (s, r) in reports.iter().take(skipped + 1).enumerate() {
            assert_eq!(r.loss_scale, 2f32.powi(TOP - s as i32), "{extra}: step {s}");
        }
        for (rank, (_, reps)) in high.iter().enumerate() {
            let same = reps
                .iter()
                .zip(reports)
                .all(|(a, b)| a.skipped.is_some() == b.skipped.is_some());
            assert!(same, "{extra}: rank {rank} skipped other steps than rank 0");
        }
        let settled = run(2f32.powi(TOP - skipped as i32), skipped);
        for (rank, ((m, reps), (want_m, want_reps))) in high.iter().zip(&settled).enumerate() {
            assert!(m.iter().all(|x| x.is_finite()), "{extra}: rank {rank}");
            let same = m
                .iter()
                .zip(want_m)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{extra}: rank {rank}'s weights differ from the settled run's"
            );
            assert_eq!(reps.len() - skipped, want_reps.len());
            for (a, b) in reps[skipped..].iter().zip(want_reps) {
                let what = format!("{extra}: rank {rank}'s step {}", a.step);
                assert_eq!(a.step, b.step, "{what}");
                assert!(a.lr > 0.0, "{what}: the schedule ended");
                assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{what}: loss");
                assert_eq!(a.grad_norm.to_bits(), b.grad_norm.to_bits(), "{what}: norm");
                assert_eq!(a.loss_scale, b.loss_scale, "{what}: loss scale");
                assert_eq!(a.skipped.is_some(), b.skipped.is_some(), "{what}: skip");
            }
        }
        eprintln!("{extra}: {skipped} steps skipped from 2^{TOP}, then the settled run's bits");
    }
}

/// fp16 on the loop under `[loss_scale]`'s DeepSpeed preset: a checkpoint written under
/// torch's settings resumes under the config's (its scale and counters go on), and a run
/// whose gradients overflow at every scale (a NaN weight) stops, on every rank alike, at
/// the step whose overflow finds the scale at DeepSpeed's floor of 1: by default under
/// ZeRO, on request at stage 0 (where DeepSpeed's `FP16_Optimizer` never stops).
#[test]
fn fp16_on_the_loop_stops_at_the_deepspeed_floor() {
    for (extra, world, stop) in [
        ("strategy = \"none\"", 1, Some(true)),
        ("strategy = \"zero1\"", 2, None),
    ] {
        let mut c = resident(GPT, "fp16", ADAMW, extra);
        c.loss_scale = Some(stoker_train::loss_scale::LossScaleConfig {
            preset: stoker_train::loss_scale::ScalerPreset::Deepspeed,
            stop_at_min_scale: stop,
            ..Default::default()
        });
        c.validate().unwrap();
        let k = 4 / world;
        let steps = run_local(world, Duration::from_secs(60), |comm| {
            let rank = comm.rank();
            let mut t = trainer(&c, Rc::new(comm));
            let mut state = saved_state(&mut t);
            state.master[0] = f32::NAN;
            // Saved under torch's settings (no floor, no hysteresis) at a scale of 4.
            let saved = state.scaler.as_mut().expect("fp16 has a loss scaler");
            saved.config = stoker_precision::ScalerConfig::torch();
            (saved.scale, saved.hysteresis_left) = (4.0, 1);
            t.load_state(state).unwrap();
            let mut scales = Vec::new();
            for s in 0..6 {
                match t.train_step(&window(GPT, s, rank, k)) {
                    Ok(r) => {
                        assert!(r.skipped.is_some(), "{extra}: step {} ran", r.step);
                        scales.push(r.loss_scale);
                    }
                    Err(e) => return (scales, e.to_string()),
                }
            }
            panic!("{extra}: rank {rank} never stopped at the floor: {scales:?}")
        });
        for (rank, (scales, msg)) in steps.iter().enumerate() {
            assert_eq!(scales, &[4.0, 2.0], "{extra}: rank {rank}");
            assert!(
                msg.starts_with(
                    "step 3: fp16 overflow with the loss scale already at its minimum (1)"
                ),
                "{extra}: rank {rank}: {msg}"
            );
        }
    }
}

/// `parallel.offload_params` (the blocks' parameters in host memory, streamed up as each
/// block runs; with the optimizer offloaded; under ZeRO-3 each rank's shard in host
/// memory): on the host build, where the config is set after parsing (it is a GPU's key),
/// the trainer trains, evaluates, checkpoints and resumes what the optimizer's offload
/// alone does, bit for bit, on one rank and under ZeRO-3 on two; the loop holds what its
/// plan says, less than without.
#[test]
fn offloaded_parameters_train_what_the_offloaded_optimizer_trains() {
    for (model, precision, optimizer, strategy, world) in [
        (GPT, "bf16", ADAMW, "none", 1),
        (LLAMA, "fp32", SGD, "none", 1),
        // ZeRO-3 at 2 ranks: each rank's shard of the parameters in host memory.
        (GPT, "bf16", ADAMW, "zero3", 2),
    ] {
        // Three blocks: two slots hold less than all of them.
        let three = model.replace("n_layer = 2", "n_layer = 3");
        assert_ne!(three, model);
        let extra = format!("strategy = \"{strategy}\"");
        let mut c = resident(&three, precision, optimizer, &extra);
        c.parallel.offload_optimizer = true;
        let mut p = c.clone();
        p.parallel.offload_params = true;
        let what = format!("{} {precision} {strategy} on {world}", &model[8..11]);
        let run = |c: &TrainConfig| {
            run_local(world, Duration::from_secs(60), |comm| {
                let rank = comm.rank();
                let comm: Rc<dyn Communicator> = Rc::new(comm);
                let mut t = trainer(c, comm.clone());
                let mut reports = Vec::new();
                for s in 0..4 {
                    if s == 2 {
                        // Saved and loaded into a fresh trainer between the steps.
                        let saved = saved_state(&mut t);
                        t = trainer(c, comm.clone());
                        t.load_state(saved).unwrap();
                    }
                    reports.push(t.train_step(&window(model, s, rank, 2 / world)).unwrap());
                }
                let eval = t.evaluate(&[micro_batch(model, 99, rank)]).unwrap();
                let planned = stoker_train::trainer::planned_resident_bytes(
                    c,
                    t.layout().total_len(),
                    (rank, world),
                )
                .unwrap();
                let counted = t.resident_bytes().unwrap().0;
                (t.full_master().unwrap(), reports, eval, planned, counted)
            })
        };
        for (r, (got, want)) in run(&p).iter().zip(&run(&c)).enumerate() {
            let what = format!("{what}, rank {r}");
            assert_same_run(&what, (&got.0, &got.1), (&want.0, &want.1));
            assert_eq!(
                got.2.loss.to_bits(),
                want.2.loss.to_bits(),
                "{what}: evaluation"
            );
            assert_eq!(got.3, got.4, "{what}: planned and counted bytes");
            assert_eq!(
                want.3, want.4,
                "{what}: planned and counted bytes, no offload"
            );
            assert!(
                got.4.steps < want.4.steps,
                "{what}: the offload holds {:?} against {:?}",
                got.4,
                want.4
            );
            eprintln!(
                "{what}: the loop holds {} bytes of step with the parameters offloaded, {} without",
                got.4.steps, want.4.steps
            );
        }
    }
}

/// `recompute = "attention"`: each block's attention probabilities recomputed in its
/// backward, one `[B, H, T, T]` buffer for every block. On the loop (one rank; ZeRO-1,
/// ZeRO-2 and ZeRO-3 on two), a GPT and a Llama train to the same bits as without it,
/// holding less, as planned.
#[test]
fn recomputed_activations_train_the_same_bits_in_less_memory() {
    for (model, extra, world, recompute) in [
        (GPT, "strategy = \"none\"", 1, "attention"),
        (LLAMA, "strategy = \"zero1\"", 2, "attention"),
        (GPT, "strategy = \"zero2\"", 2, "attention"),
        (LLAMA, "strategy = \"zero3\"", 2, "attention"),
        (GPT, "strategy = \"ddp\"", 2, "mlp"),
        (LLAMA, "strategy = \"none\"", 1, "mlp"),
        (GPT, "strategy = \"zero3\"", 2, "attention+mlp"),
    ] {
        let three = model.replace("n_layer = 2", "n_layer = 3");
        let plain = resident(&three, "fp32", ADAMW, extra);
        let lines = format!("\nrecompute = \"{recompute}\"");
        let text = resident_text(&three, "fp32", ADAMW, extra, &lines);
        let rec = TrainConfig::parse(&text, std::path::Path::new("r.toml")).unwrap();
        let what = format!("{} {extra}, recompute {recompute}", &model[8..11]);
        let run = |c: &TrainConfig| {
            run_local(world, Duration::from_secs(60), |comm| {
                let rank = comm.rank();
                let mut t = trainer(c, Rc::new(comm));
                let reports: Vec<StepReport> = (0..3)
                    .map(|s| t.train_step(&window(model, s, rank, 4 / world)).unwrap())
                    .collect();
                let bytes = t.resident_bytes().map(|b| b.0);
                let planned = stoker_train::trainer::planned_resident_bytes(
                    c,
                    t.layout().total_len(),
                    (rank, world),
                );
                (t.full_master().unwrap(), reports, bytes, planned)
            })
        };
        for (r, (got, want)) in run(&rec).iter().zip(&run(&plain)).enumerate() {
            let what = format!("{what}: rank {r}");
            assert_same_run(&what, (&got.0, &got.1), (&want.0, &want.1));
            // The loop's bytes as planned, fewer with the recompute; the adapter's steps
            // are the CPU trainer's to count.
            assert_eq!(got.2, got.3, "{what}: planned and counted");
            if let (Some(g), Some(w)) = (got.2, want.2) {
                assert!(g.steps < w.steps, "{what}: {g:?} against {w:?}");
            }
        }
    }
}

#[test]
fn recompute_without_the_resident_step_is_refused_naming_the_key() {
    let text = config_text(GPT, "fp32", "direct", ADAMW, "")
        .replace("kernels = \"direct\"", "recompute = \"attention\"");
    let e = TrainConfig::parse(&text, std::path::Path::new("r.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("recompute") && e.contains("resident"), "{e}");
}

#[test]
fn micro_batches_replayed_as_cuda_graphs_train_the_same_bits() {
    for (model, precision, extra, world) in [
        (GPT, "fp32", "strategy = \"none\"", 1),
        (LLAMA, "bf16", "strategy = \"ddp\"", 2),
        (GPT, "fp16", "strategy = \"zero1\"", 2),
    ] {
        let plain = resident(model, precision, ADAMW, extra);
        let text = resident_text(model, precision, ADAMW, extra, "\ncuda_graphs = true");
        let graphed = TrainConfig::parse(&text, std::path::Path::new("g.toml")).unwrap();
        assert!(graphed.resident_options().graph_micro_batches);
        let what = format!("{} {precision} {extra}", &model[8..11]);
        let run = |c: &TrainConfig| {
            run_local(world, Duration::from_secs(60), |comm| {
                let rank = comm.rank();
                let mut t = trainer(c, Rc::new(comm));
                let reports: Vec<StepReport> = (0..4)
                    .map(|s| t.train_step(&window(model, s, rank, 4 / world)).unwrap())
                    .collect();
                (t.full_master().unwrap(), reports)
            })
        };
        for (r, (got, want)) in run(&graphed).iter().zip(&run(&plain)).enumerate() {
            assert_same_run(
                &format!("{what}: rank {r}"),
                (&got.0, &got.1),
                (&want.0, &want.1),
            );
        }
    }
}

#[test]
fn flash_attention_trains_what_the_kept_scores_train_within_bf16_rounding() {
    // Heads 16 wide (d_model 32 over 2), the widths the flash kernels are built for.
    let wide = |m: &str| m.replace("d_model = 8", "d_model = 32");
    for (model, extra, world) in [
        (wide(GPT), "strategy = \"none\"", 1),
        (wide(LLAMA), "strategy = \"zero1\"", 2),
    ] {
        let plain = resident(&model, "bf16", ADAMW, extra);
        let text = resident_text(&model, "bf16", ADAMW, extra, "\nflash_attention = true");
        let flash = TrainConfig::parse(&text, std::path::Path::new("f.toml")).unwrap();
        let run = |c: &TrainConfig| {
            run_local(world, Duration::from_secs(60), |comm| {
                let rank = comm.rank();
                let mut t = trainer(c, Rc::new(comm));
                let losses: Vec<f64> = (0..3)
                    .map(|s| {
                        t.train_step(&window(&model, s, rank, 4 / world))
                            .unwrap()
                            .loss
                    })
                    .collect();
                (losses, t.resident_bytes().map(|b| b.0.steps))
            })
        };
        let (got, want) = (run(&flash), run(&plain));
        let what = format!("{} {extra}", &model[8..11]);
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            stoker_testkit::assert_close(&g.0, &w.0, 1e-2, &format!("{what}: rank {r}'s losses"));
            // The probabilities ([B, H, T, T] a block) give way to a row's log-sum-exp.
            assert!(g.1 < w.1, "{what}: rank {r}: {:?} against {:?}", g.1, w.1);
        }
    }
}

#[test]
fn flash_attention_off_the_resident_step_in_fp32_or_with_narrow_heads_is_refused() {
    let wide = GPT.replace("d_model = 8", "d_model = 32");
    for (model, precision, step, why) in [
        (wide.as_str(), "fp32", "resident", "bf16"),
        (
            wide.as_str(),
            "fp16",
            "resident",
            "are f16 (precision = \"fp16\")",
        ),
        (wide.as_str(), "bf16", "handwritten", "resident"),
        (GPT, "bf16", "resident", "4 wide"),
    ] {
        let text = config_text(model, precision, "direct", ADAMW, "").replace(
            "kernels = \"direct\"",
            &format!("step = \"{step}\"\nflash_attention = true"),
        );
        let e = TrainConfig::parse(&text, std::path::Path::new("f.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("flash_attention") && e.contains(why),
            "{precision} {step}: {e}"
        );
    }
}

#[test]
fn cuda_graphs_where_blocks_move_or_off_the_loop_are_refused_naming_the_key() {
    for (step, extra, why) in [
        ("resident", "strategy = \"zero2\"", "zero2"),
        ("resident", "strategy = \"zero3\"", "zero3"),
        ("handwritten", "strategy = \"none\"", "resident"),
    ] {
        let text = config_text(GPT, "fp32", "direct", ADAMW, extra).replace(
            "kernels = \"direct\"",
            &format!("step = \"{step}\"\ncuda_graphs = true"),
        );
        let e = TrainConfig::parse(&text, std::path::Path::new("g.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cuda_graphs") && e.contains(why),
            "{step} {extra}: {e}"
        );
    }
}

/// The resident loop reduces one bucket per block: the CPU trainer's bucket sizes set on
/// it are refused naming the key (they were ignored); off the loop (the adapter's DDP
/// reduction per micro-batch, on the CPU trainer's buckets) they are taken.
#[test]
fn bucket_sizes_on_the_resident_loop_are_refused_naming_the_key() {
    for (extra, refused) in [
        (
            "strategy = \"ddp\"\nbucket_cap_mb = 4.0",
            Some("parallel.bucket_cap_mb"),
        ),
        (
            "strategy = \"zero1\"\nfirst_bucket_mb = 0.5",
            Some("parallel.first_bucket_mb"),
        ),
        (
            "strategy = \"ddp\"\nsync_every_micro_batch = true\nbucket_cap_mb = 4.0",
            None,
        ),
        ("strategy = \"ddp\"\nbucket_cap_mb = 25.0", None),
    ] {
        let text = resident_text(GPT, "fp32", ADAMW, extra, "");
        let parsed = TrainConfig::parse(&text, std::path::Path::new("b.toml"));
        match (refused, parsed) {
            (Some(key), Err(e)) => {
                let e = e.to_string();
                assert!(
                    e.contains(key) && e.contains("one bucket per block"),
                    "{extra}: {e}"
                );
            }
            (None, Ok(_)) => {}
            (want, got) => panic!("{extra}: expected refusal {want:?}, got {:?}", got.err()),
        }
    }
}

#[test]
fn on_a_gpu_the_plan_times_the_resident_step_by_its_forecast() {
    use stoker_plan::input::PlanInput;
    let c = resident(GPT, "bf16", ADAMW, "strategy = \"none\"");
    let on = |hardware: &str| {
        let text = format!("[hardware]\npreset = \"{hardware}\"\ndevices_per_node = 1\n");
        PlanInput::from_toml_str("flags.toml", &text).unwrap()
    };
    let h100 = stoker_plan::hardware::preset("h100-80gb").unwrap();
    let f = stoker_train::resident_forecast::resident_forecast(&c, &h100, c.precision)
        .unwrap()
        .expect("a resident config on an H100 has a forecast");
    assert_eq!(f.figures.mem_bw, 3.35e12);
    assert_eq!(f.figures.peak_flops, 989e12);
    // The planner's MFU is its own FLOPs of a micro-batch over the peak and the
    // forecast, so its compute time is the forecast's.
    let input = stoker_train::planned::plan_input(&c, &on("h100-80gb")).unwrap();
    let model = stoker_plan::resolve::resolve_model(&input.model).unwrap();
    let (b, t) = f.shape;
    let want =
        (b * t) as f64 * model.train_flops_per_token(t as u64) / (989e12 * f.micro_batch_s());
    assert_eq!(input.training.forecast_mfu, Some(want));
    assert_eq!(input.training.mfu, None);
    // A given MFU wins (no forecast asked for); a CPU has none.
    let mut given = c.clone();
    given.plan.get_or_insert_with(Default::default).mfu = Some(0.3);
    let input = stoker_train::planned::plan_input(&given, &on("h100-80gb")).unwrap();
    assert_eq!(
        (input.training.mfu, input.training.forecast_mfu),
        (Some(0.3), None)
    );
    let input = stoker_train::planned::plan_input(&c, &on("cpu")).unwrap();
    assert_eq!(input.training.forecast_mfu, None);
    // The line says where the time goes.
    let line = stoker_train::planned::resident_forecast_line(&c, &h100)
        .unwrap()
        .unwrap();
    assert!(
        line.contains(&format!("MFU {:.1}%", 100.0 * f.mfu())),
        "{line}"
    );
    // This GPT is tiny: its step is its launches' floor, not its FLOPs.
    let launches = format!("{} launches", f.micro_batch.launches);
    assert!(line.contains(&launches), "{line}");
    let floor = f.micro_batch.launches as f64 * f.figures.launch_s;
    assert!(f.micro_batch.total_s() < 1.5 * floor, "{line}");
    // And what recomputing would cost: the recomputed config's own forecast.
    let mut r = c.clone();
    r.recompute = stoker_train::config::Recompute::AttentionAndMlp;
    let again = stoker_train::resident_forecast::resident_forecast(&r, &h100, r.precision)
        .unwrap()
        .unwrap();
    assert!(again.micro_batch_s() > f.micro_batch_s());
    let cost = format!(
        "with recompute = \"attention+mlp\": {:.2} ms",
        again.micro_batch_s() * 1e3
    );
    assert!(line.contains(&cost), "{line}");
    assert!(line.contains("assumed until a device run"), "{line}");
}

/// fp8's forecast times its linear layers' products at the device's FP8 peak (an H100's
/// 1,979 TFLOP/s), and says so; bf16's has no FP8 products and takes no FP8 peak.
#[test]
fn an_fp8_forecast_times_its_linear_layers_at_fp8_s_peak() {
    use stoker_train::resident_forecast::resident_forecast;
    let h100 = stoker_plan::hardware::preset("h100-80gb").unwrap();
    let fp8 = resident(GPT16, "fp8", ADAMW, "strategy = \"none\"");
    let f = resident_forecast(&fp8, &h100, fp8.precision)
        .unwrap()
        .expect("an fp8 resident config on an H100 has a forecast");
    assert_eq!(
        (f.figures.peak_flops, f.figures.fp8_peak_flops),
        (989e12, 1979e12)
    );
    assert!(f.micro_batch.fp8_products_s > 0.0);
    let line = stoker_train::planned::resident_forecast_line(&fp8, &h100)
        .unwrap()
        .unwrap();
    assert!(
        line.contains("the FP8 linear layers'") && line.contains("FP8's 1979 TFLOP/s"),
        "{line}"
    );
    let bf16 = resident(GPT16, "bf16", ADAMW, "strategy = \"none\"");
    let g = resident_forecast(&bf16, &h100, bf16.precision)
        .unwrap()
        .unwrap();
    assert_eq!(
        (g.figures.fp8_peak_flops, g.micro_batch.fp8_products_s),
        (0.0, 0.0)
    );
}

/// A GPU's measured efficiencies (`stoker_gpu::measured`, a device run's fit) replace the
/// assumed ones in the plan's forecast of its preset, and the line says where they came
/// from; another preset keeps the assumed ones.
#[test]
fn a_gpus_measured_efficiencies_time_its_plans() {
    use stoker_gpu::forecast::Efficiencies;
    use stoker_gpu::measured::MeasuredGpu;
    use stoker_train::resident_forecast::resident_forecast_in;
    static TABLE: &[MeasuredGpu] = &[MeasuredGpu {
        preset: "h100-80gb",
        gpu: "NVIDIA H100 80GB HBM3",
        date: "2026-12-06",
        efficiencies: Efficiencies {
            product: 0.35,
            memory: 0.4,
            tensor_kernel: 0.175,
        },
    }];
    // Wide enough that its products are bound by their FLOPs, not their launches.
    let wide = GPT
        .replace("context = 6", "context = 512")
        .replace("d_model = 8", "d_model = 1024")
        .replace("n_head = 2", "n_head = 16");
    let c = resident(&wide, "bf16", ADAMW, "strategy = \"none\"");
    let h100 = stoker_plan::hardware::preset("h100-80gb").unwrap();
    let assumed = resident_forecast_in(&c, &h100, c.precision, &[])
        .unwrap()
        .unwrap();
    let measured = resident_forecast_in(&c, &h100, c.precision, TABLE)
        .unwrap()
        .unwrap();
    assert_eq!(measured.figures.efficiencies(), TABLE[0].efficiencies);
    assert_eq!(assumed.figures.efficiencies(), Efficiencies::ASSUMED);
    // Half of each fraction: the step takes longer, at most twice as long (launches
    // and reads do not slow down).
    let (slow, fast) = (measured.micro_batch_s(), assumed.micro_batch_s());
    assert!(
        slow > 1.2 * fast && slow <= 2.0 * fast,
        "{slow} against {fast}"
    );
    assert!(measured
        .line()
        .contains("measured on NVIDIA H100 80GB HBM3 on 2026-12-06"));
    let h200 = stoker_plan::hardware::preset("h200-141gb").unwrap();
    let other = resident_forecast_in(&c, &h200, c.precision, TABLE)
        .unwrap()
        .unwrap();
    assert_eq!(other.figures.efficiencies(), Efficiencies::ASSUMED);
}

/// A GPT whose widths and micro-batch rows (2 x 8) are multiples of 16, as FP8 products
/// take them.
const GPT16: &str =
    "kind = \"gpt\"\nvocab = 11\ncontext = 8\nd_model = 16\nn_layer = 2\nn_head = 2";

/// A Llama whose widths (32, a key and value head of 16, an MLP of 48) and micro-batch
/// rows are multiples of 16.
const LLAMA16: &str = "kind = \"llama\"\nvocab = 11\ncontext = 8\nd_model = 32\nn_layer = 2\nn_head = 2\nn_kv_head = 1\nffn_hidden = 48";

/// Step `s`'s window of two micro-batches of 2 x 8 tokens.
fn fp8_window(s: usize) -> Vec<MicroBatch> {
    fp8_micro_batches(s, 2)
}

/// Step `s`'s window of `n` micro-batches of 2 x 8 tokens ([`fp8_window`]'s first).
fn fp8_micro_batches(s: usize, n: usize) -> Vec<MicroBatch> {
    (0..n)
        .map(|j| common::token_batch((s * 100 + j) as u64, 2, 8, 11, &[j % 3, (j + s) % 4]))
        .collect()
}

/// `steps` fp8 steps of `config` on one rank, stopping after `stop` of them (if given) to
/// save the state, FP8 scalers included unless `drop_scalers`, into a fresh trainer.
fn fp8_run(
    config: &TrainConfig,
    steps: usize,
    stop: Option<usize>,
    drop_scalers: bool,
) -> (Vec<f32>, Vec<StepReport>) {
    run_local(1, Duration::from_secs(60), |comm| {
        let comm: Rc<dyn Communicator> = Rc::new(comm);
        let mut t = trainer(config, comm.clone());
        let mut reports = Vec::new();
        for s in 0..steps {
            if Some(s) == stop {
                let saved = saved_state_with(&mut t, |fp8| fp8.filter(|_| !drop_scalers));
                t = trainer(config, comm.clone());
                t.load_state(saved).unwrap();
            }
            reports.push(t.train_step(&fp8_window(s)).unwrap());
        }
        (t.full_master().unwrap(), reports)
    })
    .remove(0)
}

/// `model` in fp8 on the loop for 6 steps: resumed at step 3 it equals the run that
/// never stopped, bit for bit; its losses are within 5e-3 of the CPU's simulation of the
/// recipe, and apart from bf16's on the loop (the layers did run in FP8). Returns the run.
fn fp8_on_the_loop_as_the_cpu(model: &str, what: &str) -> (Vec<f32>, Vec<StepReport>) {
    let c = resident(model, "fp8", ADAMW, "strategy = \"none\"");
    assert!(c.resident_loop(), "{what}");
    let straight = fp8_run(&c, 6, None, false);
    let resumed = fp8_run(&c, 6, Some(3), false);
    assert_same_run(
        &format!("{what} fp8 resumed at step 3"),
        (&resumed.0, &resumed.1),
        (&straight.0, &straight.1),
    );
    let text = config_text(model, "fp8", "composed", ADAMW, "strategy = \"none\"");
    let cpu = TrainConfig::parse(&text, std::path::Path::new("cpu.toml")).unwrap();
    let simulated = fp8_run(&cpu, 6, None, false);
    for (a, b) in straight.1.iter().zip(&simulated.1) {
        let rel = (a.loss - b.loss).abs() / b.loss.abs();
        assert!(
            rel < 5e-3,
            "{what} step {}: loss {} on the loop, {} simulated ({rel:.2e})",
            a.step,
            a.loss,
            b.loss
        );
    }
    let bf16 = fp8_run(
        &resident(model, "bf16", ADAMW, "strategy = \"none\""),
        6,
        None,
        false,
    );
    assert!(
        straight
            .1
            .iter()
            .zip(&bf16.1)
            .any(|(a, b)| (a.loss - b.loss).abs() > 1e-4 * b.loss.abs()),
        "{what}: fp8 and bf16 on the loop give the same losses"
    );
    straight
}

/// `steps` fp8 steps of `config` on `world` ranks sharing windows of `global`
/// micro-batches ([`fp8_micro_batches`]): every rank's whole master, reports and FP8
/// scalers (by layer, as checkpoints hold them).
fn fp8_ranks_run(config: &TrainConfig, world: usize, steps: usize, global: usize) -> Vec<RankFp8> {
    let k = global / world;
    run_local(world, Duration::from_secs(60), |comm| {
        let rank = comm.rank();
        let mut t = trainer(config, Rc::new(comm));
        let reports = (0..steps)
            .map(|s| {
                let window = fp8_micro_batches(s, global);
                t.train_step(&window[rank * k..(rank + 1) * k]).unwrap()
            })
            .collect();
        t.sync_host().unwrap();
        let scalers = t.state().fp8.expect("an fp8 run keeps its scalers");
        (t.full_master().unwrap(), reports, scalers)
    })
}

/// What [`fp8_ranks_run`] gives for one rank.
type RankFp8 = (
    Vec<f32>,
    Vec<StepReport>,
    std::collections::BTreeMap<String, stoker_train::precision::LayerScalers>,
);

/// Every scaler's scale and history, as bits.
fn scaler_bits(r: &RankFp8) -> Vec<u32> {
    r.2.values()
        .flatten()
        .flat_map(|s| std::iter::once(s.scale()).chain(s.history()))
        .map(f32::to_bits)
        .collect()
}

/// fp8 on the loop at 2 ranks: each scaler's amax of a step is the largest over the ranks
/// (`Fp8Scalers::end_step_over`), so deterministic DDP and ZeRO-1 give one rank's weights,
/// losses and scalers bit for bit, and every rank of a default DDP holds the same scalers
/// and one rank's weights within bf16's rounding of the sums.
#[test]
fn fp8_on_the_loop_at_2_ranks_takes_one_rank_s_scales() {
    for model in [GPT16, LLAMA16] {
        for strategy in ["ddp", "zero1"] {
            let mut c = resident(
                model,
                "fp8",
                ADAMW,
                &format!("strategy = \"{strategy}\"\ndeterministic = true"),
            );
            c.batch.global_batch = Some(2 * c.batch.micro_batch);
            let one = fp8_ranks_run(&c, 1, 4, 2).remove(0);
            for (r, run) in fp8_ranks_run(&c, 2, 4, 2).iter().enumerate() {
                let what = format!(
                    "{} fp8 deterministic {strategy}, rank {r} of 2",
                    &model[8..11]
                );
                assert_same_run(&what, (&run.0, &run.1), (&one.0, &one.1));
                assert_eq!(scaler_bits(run), scaler_bits(&one), "{what}: scalers");
            }
        }
        let mut c = resident(model, "fp8", ADAMW, "strategy = \"ddp\"");
        c.batch.global_batch = Some(2 * c.batch.micro_batch);
        let one = fp8_ranks_run(&c, 1, 4, 2).remove(0);
        let two = fp8_ranks_run(&c, 2, 4, 2);
        for (r, run) in two.iter().enumerate() {
            let what = format!("{} fp8 ddp, rank {r} of 2", &model[8..11]);
            assert_eq!(scaler_bits(run), scaler_bits(&two[0]), "{what}: scalers");
            let d = common::rel_l2(&run.0, &one.0);
            assert!(d <= 1e-4, "{what}: weights {d:e} from one rank's");
        }
    }
}

/// fp8 on the loop under ZeRO-2 and ZeRO-3 (the weights read and their gradients written
/// in slots, each block's reduced as its backward ends) at 2 ranks:
/// - two blocks, one micro-batch a rank: ZeRO-1's sums, so its weights, losses and
///   scalers, bit for bit, for the GPT and the Llama; each rank's loop holds the bytes
///   its plan says, FP8's scalers and scratch included;
/// - three blocks, two micro-batches a rank (so a slot takes another block's weights and
///   gradients, ZeRO-3 gathers each block again for its backward, and ZeRO-2 reduces each
///   micro-batch): ZeRO-3 is ZeRO-2 bit for bit, and ZeRO-2 is ZeRO-1 within bf16's
///   rounding of the sums, with the same scalers on both ranks.
#[test]
fn fp8_on_the_loop_under_zero2_and_zero3_trains_what_zero1_does() {
    for model in [GPT16, LLAMA16] {
        let config = |strategy: &str, layers: usize, global: usize| {
            let model = model.replace("n_layer = 2", &format!("n_layer = {layers}"));
            let mut c = resident(&model, "fp8", ADAMW, &format!("strategy = \"{strategy}\""));
            c.batch.global_batch = Some(global * c.batch.micro_batch);
            c
        };
        let zero1 = fp8_ranks_run(&config("zero1", 2, 2), 2, 4, 2);
        for strategy in ["zero2", "zero3"] {
            let c = config(strategy, 2, 2);
            for (r, (got, want)) in fp8_ranks_run(&c, 2, 4, 2).iter().zip(&zero1).enumerate() {
                let what = format!("{} fp8 {strategy}, rank {r} of 2", &model[8..11]);
                assert_same_run(&what, (&got.0, &got.1), (&want.0, &want.1));
                assert_eq!(scaler_bits(got), scaler_bits(want), "{what}: scalers");
            }
            let bytes = run_local(2, Duration::from_secs(60), |comm| {
                let rank = comm.rank();
                let mut t = trainer(&c, Rc::new(comm));
                t.train_step(&fp8_window(0)[rank..rank + 1]).unwrap();
                let len = t.layout().total_len();
                let planned =
                    stoker_train::trainer::planned_resident_bytes(&c, len, (rank, 2)).unwrap();
                (planned, t.resident_bytes().unwrap().0)
            });
            for (r, (planned, counted)) in bytes.into_iter().enumerate() {
                assert_eq!(planned, counted, "{strategy} rank {r}: planned and counted");
            }
        }
        let run = |strategy: &str| fp8_ranks_run(&config(strategy, 3, 4), 2, 4, 4);
        let (zero1, zero2, zero3) = (run("zero1"), run("zero2"), run("zero3"));
        for r in 0..2 {
            let what = format!("{} fp8, 3 blocks, rank {r} of 2", &model[8..11]);
            assert_same_run(
                &format!("{what}: zero3 against zero2"),
                (&zero3[r].0, &zero3[r].1),
                (&zero2[r].0, &zero2[r].1),
            );
            assert_eq!(scaler_bits(&zero3[r]), scaler_bits(&zero2[r]), "{what}");
            assert_eq!(scaler_bits(&zero2[r]), scaler_bits(&zero2[0]), "{what}");
            let d = common::rel_l2(&zero2[r].0, &zero1[r].0);
            assert!(d <= 1e-4, "{what}: zero2's weights {d:e} from zero1's");
        }
    }
}

/// fp8 with the blocks' parameters offloaded (two slots on the backend, each block's
/// weights streamed up as it runs, its FP8 casts read from the slot) trains what fp8 with
/// the optimizer offloaded alone trains, bit for bit, scalers included: one rank, and
/// ZeRO-3's shards in host memory at 2 ranks; three blocks, so a slot takes another
/// block's weights.
#[test]
fn fp8_with_offloaded_parameters_trains_what_the_offloaded_optimizer_trains() {
    for (strategy, world) in [("none", 1), ("zero3", 2)] {
        let three = GPT16.replace("n_layer = 2", "n_layer = 3");
        let mut c = resident(&three, "fp8", ADAMW, &format!("strategy = \"{strategy}\""));
        c.parallel.offload_optimizer = true;
        c.batch.global_batch = Some(2 * c.batch.micro_batch);
        let mut p = c.clone();
        p.parallel.offload_params = true;
        let (got, want) = (
            fp8_ranks_run(&p, world, 4, 2),
            fp8_ranks_run(&c, world, 4, 2),
        );
        for (r, (got, want)) in got.iter().zip(&want).enumerate() {
            let what = format!("fp8 {strategy}, params offloaded, rank {r} of {world}");
            assert_same_run(&what, (&got.0, &got.1), (&want.0, &want.1));
            assert_eq!(got.2.len(), 4 * 3, "{what}: four FP8 layers a block");
            assert_eq!(scaler_bits(got), scaler_bits(want), "{what}: scalers");
        }
    }
}

/// `precision = "fp8"` on the resident loop: the GPT's linear layers in FP8 on the step's
/// host build. A run checkpointed and resumed equals one that never stopped, bit for bit,
/// because the checkpoint holds the step's scalers (a resume without them gives other
/// losses); the scalers are held by layer, as the CPU's simulation holds them; and the
/// losses track that simulation's (f32 activations and an FP8 head there, bf16 and a
/// bf16 head here).
#[test]
fn fp8_on_the_loop_keeps_its_scalers_across_a_resume_and_tracks_the_cpu_s_fp8() {
    let c = resident(GPT16, "fp8", ADAMW, "strategy = \"none\"");
    // Largest difference from the CPU's simulation seen: 1.3e-3 (2026-12-07).
    let straight = fp8_on_the_loop_as_the_cpu(GPT16, "gpt");
    let without = fp8_run(&c, 6, Some(3), true);
    assert!(
        without.1[3..]
            .iter()
            .zip(&straight.1[3..])
            .any(|(a, b)| a.loss.to_bits() != b.loss.to_bits()),
        "a resume without the FP8 scalers gave the same losses: the test cannot tell"
    );
    // The scalers as a checkpoint holds them: three per linear layer, by the CPU's names.
    let names = run_local(1, Duration::from_secs(60), |comm| {
        let mut t = trainer(&c, Rc::new(comm));
        t.train_step(&fp8_window(0)).unwrap();
        t.sync_host().unwrap();
        let fp8 = t.state().fp8.expect("an fp8 run keeps its scalers");
        let w = &fp8["h.1.mlp.fc"][1];
        (
            fp8.keys().cloned().collect::<Vec<_>>(),
            w.scale(),
            *w.history().iter().rev().nth(1).unwrap(),
        )
    })
    .remove(0);
    assert_eq!(
        names.0,
        [
            "h.0.attn.proj",
            "h.0.attn.qkv",
            "h.0.mlp.fc",
            "h.0.mlp.proj",
            "h.1.attn.proj",
            "h.1.attn.qkv",
            "h.1.mlp.fc",
            "h.1.mlp.proj"
        ]
    );
    assert!(names.2 > 0.0, "h.1.mlp.fc's weight recorded no amax");
    assert_eq!(names.1, 448.0 / names.2, "h.1.mlp.fc's weight scale");
    // A layer the step has none of (the CPU path's head, from a checkpoint it wrote) is
    // kept through a resident run's syncs, for a later resume on the CPU path.
    let kept = run_local(1, Duration::from_secs(60), |comm| {
        let comm: Rc<dyn Communicator> = Rc::new(comm);
        let mut t = trainer(&c, comm.clone());
        t.train_step(&fp8_window(0)).unwrap();
        let mut head = None;
        let saved = saved_state_with(&mut t, |fp8| {
            let mut fp8 = fp8.unwrap();
            head = Some(fp8["h.0.attn.qkv"].clone());
            fp8.insert("lm_head".into(), fp8["h.0.attn.qkv"].clone());
            Some(fp8)
        });
        let head = head.unwrap();
        let mut t = trainer(&c, comm);
        t.load_state(saved).unwrap();
        t.train_step(&fp8_window(1)).unwrap();
        t.sync_host().unwrap();
        t.state().fp8.unwrap().get("lm_head") == Some(&head)
    })
    .remove(0);
    assert!(kept, "the head's scalers from the checkpoint were dropped");
}

/// fp8 on the resident step: a width or micro-batch rows that FP8 products cannot take
/// are refused naming `model.d_model`, `model.n_kv_head` or
/// `batch.micro_batch`, all when the config is read.
#[test]
fn fp8_on_the_resident_step_refuses_what_it_does_not_run() {
    let parse = |text: String| TrainConfig::parse(&text, std::path::Path::new("f.toml"));
    let refused = |text: String, key: &str, says: &str| {
        let e = parse(text).unwrap_err().to_string();
        assert!(
            e.contains(key) && e.contains(says),
            "{e} should name {key} and say {says}"
        );
    };
    // The Llama of the other tests is 8 wide.
    refused(
        resident_text(LLAMA, "fp8", ADAMW, "strategy = \"none\"", ""),
        "model.d_model",
        "multiples of 16",
    );
    // Its key and value heads: one head of 32 / 4 = 8.
    refused(
        resident_text(
            &LLAMA16.replace("n_head = 2", "n_head = 4"),
            "fp8",
            ADAMW,
            "strategy = \"none\"",
            "",
        ),
        "model.n_kv_head",
        "8 wide",
    );
    refused(
        resident_text(
            &GPT16.replace("d_model = 16", "d_model = 24"),
            "fp8",
            ADAMW,
            "strategy = \"none\"",
            "",
        ),
        "model.d_model",
        "24 wide",
    );
    // Two sequences of 6 positions: rows of 12.
    refused(
        resident_text(
            &GPT16.replace("context = 8", "context = 6"),
            "fp8",
            ADAMW,
            "strategy = \"none\"",
            "",
        ),
        "batch.micro_batch",
        "rows of 12",
    );
}

/// The Llama's seven linear layers a block in FP8 on the loop: a run resumed at step 3
/// equals one that never stopped, bit for bit; its checkpoint names the layers as the
/// CPU's Llama does; its losses track the CPU's simulation.
#[test]
fn fp8_on_the_loop_trains_the_llama_and_resumes_bit_identically() {
    let c = resident(LLAMA16, "fp8", ADAMW, "strategy = \"none\"");
    // Largest difference from the CPU's simulation seen: 5.1e-4 (2026-12-07).
    fp8_on_the_loop_as_the_cpu(LLAMA16, "llama");
    let names = run_local(1, Duration::from_secs(60), |comm| {
        let mut t = trainer(&c, Rc::new(comm));
        t.train_step(&fp8_window(0)).unwrap();
        t.sync_host().unwrap();
        t.state().fp8.unwrap().keys().cloned().collect::<Vec<_>>()
    })
    .remove(0);
    assert_eq!(names.len(), 14);
    assert!(
        names.contains(&"layers.1.self_attn.k_proj".to_string()),
        "{names:?}"
    );
    assert!(
        names.contains(&"layers.0.mlp.down_proj".to_string()),
        "{names:?}"
    );
}

/// Each layer's three scalers' amax recorded in the second step (input, weight, output
/// gradient), by the layer's name: the first casts at scale 1, where the CPU's head (in
/// FP8 there, bf16 on the loop) flushes most of the logits' gradient.
fn first_amaxes(config: &TrainConfig) -> std::collections::BTreeMap<String, [f32; 3]> {
    run_local(1, Duration::from_secs(60), |comm| {
        let mut t = trainer(config, Rc::new(comm));
        t.train_step(&fp8_window(0)).unwrap();
        t.train_step(&fp8_window(1)).unwrap();
        t.sync_host().unwrap();
        t.state()
            .fp8
            .unwrap()
            .into_iter()
            .map(|(name, three)| {
                let recorded = three.each_ref().map(|s| {
                    let h = s.history();
                    h[h.len() - 2]
                });
                (name, recorded)
            })
            .collect()
    })
    .remove(0)
}

/// The loop's scalers record, layer by layer and role by role, the amax the CPU's
/// simulation records for the layer of that name (bf16 activations and a bf16 head
/// against f32 and an FP8 head: within 15%). A scaler index crossed between two layers, in the forward or the
/// backward, or a name given to the wrong layer, records another layer's tensor.
#[test]
fn fp8_on_the_loop_records_each_layer_s_amax_as_the_cpu_s_simulation_does() {
    for model in [GPT16, LLAMA16] {
        let resident_cfg = resident(model, "fp8", ADAMW, "strategy = \"none\"");
        let text = config_text(model, "fp8", "composed", ADAMW, "strategy = \"none\"");
        let cpu_cfg = TrainConfig::parse(&text, std::path::Path::new("cpu.toml")).unwrap();
        let (got, want) = (first_amaxes(&resident_cfg), first_amaxes(&cpu_cfg));
        for (name, three) in &got {
            let cpu = want
                .get(name)
                .unwrap_or_else(|| panic!("{name}: no such layer in the CPU's simulation"));
            for (k, role) in ["input", "weight", "output gradient"].iter().enumerate() {
                let rel = (three[k] as f64 - cpu[k] as f64).abs() / (cpu[k] as f64).abs();
                // Worst seen 7.3e-2 (the Llama's down_proj gradient, 2026-12-07): the CPU's
                // head is in FP8 and its activations f32. A crossed index records another
                // layer's tensor, or nothing (0).
                assert!(
                    rel < 0.15,
                    "{name} {role}: amax {} on the loop, {} simulated",
                    three[k],
                    cpu[k]
                );
            }
        }
    }
}
