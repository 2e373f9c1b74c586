//! Micro-batches replayed as captured graphs (`StepOptions::graph_micro_batches`, CUDA
//! graphs on a device) against the same micro-batches launched one call at a time, on
//! the host backend that captures (`GraphHost`) and the one that does not (`Host`).
//!
//! A graph replays its launches with the arguments they had at capture, so any argument
//! that depends on the micro-batch would replay stale: the ids' distinct-token count (the
//! embedding's backward), the gradient's scale, whether the loss adds. The windows below
//! change all of them (random ids, targets ignored, two gradient scales, windows of
//! several micro-batches), and the replayed steps must give the eager losses and
//! gradients bit for bit, GPT and Llama, f32 and bf16, and a replica's windows (one rank,
//! and DDP over two ranks, whose first micro-batch of each window replays) the eager
//! weights bit for bit.

mod ranks;

use stoker_comm::{run_local, DEFAULT_TIMEOUT};
use stoker_gpu::parallel::{Strategy, Trainable};
use stoker_gpu::sample::{batch, gpt, ids, llama};
use stoker_gpu::step::buffers::BlockHooks;
use stoker_gpu::step::optimizer::Optimizer;
use stoker_gpu::step::options::StepOptions;
use stoker_gpu::step::{GptGpuStep, LlamaGpuStep};
use stoker_gpu::{Act, Backend, GpuError, GraphHost, Host};
use stoker_kernels::LlamaDims;
use stoker_testkit::assert_bits_eq;

use ranks::{rule, train_on, B, DIMS, SEED, T};

const GRAPHS: StepOptions = StepOptions {
    offload_params: false,
    recompute_attention: false,
    recompute_mlp: false,
    grads_in_slots: false,
    shard_params: None,
    graph_micro_batches: true,
    flash_attention: false,
    fp8_linears: false,
};

/// A micro-batch's tokens and targets.
type Micro = (Vec<i64>, Vec<i64>);
/// A window's micro-batches and their gradient scale.
type Window = (Vec<Micro>, f32);

/// Four windows of three micro-batches over `vocab` (random ids, so each has its own
/// distinct-token count; some targets ignored), with the gradient scale of each window:
/// a scale comes back after another, so a second graph is captured and the first is
/// replayed again.
fn windows(vocab: usize) -> Vec<Window> {
    (0..4u64)
        .map(|w| {
            let micro = (0..3u64)
                .map(|k| {
                    let draw = |s: u64| -> Vec<i64> {
                        ids(B * T, s, vocab).iter().map(|&x| x as i64).collect()
                    };
                    let mut targets = draw(100 + 10 * w + k);
                    for i in 0..k as usize {
                        targets[3 * i] = -1;
                    }
                    (draw(200 + 10 * w + k), targets)
                })
                .collect();
            (micro, if w == 2 { 0.25 } else { 0.5 })
        })
        .collect()
}

/// Each window's summed loss and gradients after `step` ran its micro-batches on `be`.
fn run<Be: Backend, S: Trainable<Be>>(
    be: &Be,
    step: &S,
    params: &[f32],
    data: &[Window],
) -> Vec<(f64, Vec<f32>)> {
    step.load(be, params).unwrap();
    data.iter()
        .map(|(micro, scale)| {
            step.zero_grads(be).unwrap();
            for (j, m) in micro.iter().enumerate() {
                step.queue_micro_batch(be, (batch(m), *scale), j > 0, BlockHooks::default())
                    .unwrap();
            }
            (
                step.loss_sum(be).unwrap(),
                step.buffers().grads(be).unwrap(),
            )
        })
        .collect()
}

/// `graphed`'s windows against `eager`'s, bit for bit.
fn same_windows(what: &str, graphed: &[(f64, Vec<f32>)], eager: &[(f64, Vec<f32>)]) {
    for (w, (g, e)) in graphed.iter().zip(eager).enumerate() {
        assert_eq!(g.0.to_bits(), e.0.to_bits(), "{what}: window {w}'s loss");
        assert_bits_eq(&g.1, &e.1, &format!("{what}: window {w}'s gradients"));
    }
}

#[test]
fn gpt_and_llama_micro_batches_replayed_as_graphs_give_the_eager_bits() {
    fn check<A: Act>() {
        let what = format!("{:?}", A::DTYPE);
        let g = gpt(&DIMS, SEED, 0.2);
        let data = windows(DIMS.vocab);
        let eager = GptGpuStep::<Host, A>::new(&Host, DIMS, g.offsets.clone(), 1e-5, B, T).unwrap();
        let want = run(&Host, &eager, &g.params, &data);
        let be = GraphHost::new();
        let graphed = GptGpuStep::<GraphHost, A>::with_options(
            &be,
            DIMS,
            g.offsets.clone(),
            1e-5,
            (B, T),
            GRAPHS,
        )
        .unwrap();
        same_windows(
            &format!("gpt {what}"),
            &run(&be, &graphed, &g.params, &data),
            &want,
        );
        // Keys (scale 0.5 or 0.25; the loss written or added): three of the four were
        // met twice or more, so captured and replayed.
        assert_eq!(graphed.buffers().graphs_captured(), 3, "gpt {what}");

        let dims = LlamaDims {
            vocab: 43,
            context: 12,
            d_model: 16,
            n_layer: 2,
            n_head: 4,
            n_kv_head: 2,
            ffn_hidden: 24,
        };
        let l = llama(&dims, 6, 0.2);
        let data = windows(dims.vocab);
        let theta = 10_000.0;
        let eager = LlamaGpuStep::<Host, A>::new(&Host, dims, l.offsets.clone(), 1e-5, theta, B, T)
            .unwrap();
        let want = run(&Host, &eager, &l.params, &data);
        let graphed = LlamaGpuStep::<GraphHost, A>::with_options(
            &be,
            dims,
            l.offsets.clone(),
            (1e-5, theta),
            (B, T),
            GRAPHS,
        )
        .unwrap();
        same_windows(
            &format!("llama {what}"),
            &run(&be, &graphed, &l.params, &data),
            &want,
        );
        assert_eq!(graphed.buffers().graphs_captured(), 3, "llama {what}");
    }
    check::<f32>();
    check::<half::bf16>();
}

#[test]
fn a_replica_whose_micro_batches_replay_as_graphs_trains_the_eager_weights() {
    for (world, strategy) in [(1, Strategy::Ddp), (2, Strategy::Ddp)] {
        let ends = run_local(world, DEFAULT_TIMEOUT, |comm| {
            let base = |graphs| {
                (
                    strategy,
                    StepOptions {
                        graph_micro_batches: graphs,
                        ..StepOptions::default()
                    },
                )
            };
            let (eager, _) = train_on::<Host, f32, _>(
                &Host,
                &comm,
                base(false),
                Optimizer::AdamW,
                rule(Some(1.0)),
                None,
            );
            let be = GraphHost::new();
            let (graphed, replica) = train_on::<GraphHost, f32, _>(
                &be,
                &comm,
                base(true),
                Optimizer::AdamW,
                rule(Some(1.0)),
                None,
            );
            (eager, graphed, replica.step().buffers().graphs_captured())
        });
        for (rank, (eager, graphed, captured)) in ends.iter().enumerate() {
            let what = format!("{strategy:?} at {world} ranks, rank {rank}");
            assert_eq!(graphed.0.len(), eager.0.len(), "{what}: windows");
            for (w, (g, e)) in graphed.0.iter().zip(&eager.0).enumerate() {
                assert_eq!(g.0.to_bits(), e.0.to_bits(), "{what}: window {w}'s loss");
                assert_eq!(g.2.to_bits(), e.2.to_bits(), "{what}: window {w}'s norm");
            }
            assert_bits_eq(&graphed.2, &eager.2, &format!("{what}: master"));
            assert_bits_eq(&graphed.3, &eager.3, &format!("{what}: compute copy"));
            // One rank: every micro-batch is plain, the first of a window and the rest two
            // keys. Two ranks: the last micro-batch of a rank's window starts the buckets
            // (eager), the others are captured.
            assert!(*captured >= 1, "{what}: nothing was captured");
        }
    }
}

#[test]
fn what_a_graph_cannot_hold_is_refused_while_capturing() {
    let be = GraphHost::new();
    let buf = be.zeros::<f32>(4).unwrap();
    be.begin_capture().unwrap();
    let refused: [(&str, Result<(), GpuError>); 5] = [
        ("read", be.read(be.all(&buf)).map(drop)),
        ("write", be.write_at(be.all(&buf), &[1.0; 4])),
        ("staged write", be.write_staged(be.all(&buf), &[1.0; 4])),
        ("allocation", be.zeros::<f32>(2).map(drop)),
        ("capture", be.begin_capture()),
    ];
    for (what, r) in refused {
        match r {
            Err(GpuError::Capture { what: msg }) => assert!(msg.contains("capture"), "{msg}"),
            other => panic!("{what} while capturing: {other:?}"),
        }
    }
    // A zeroing is recorded, not run: the buffer keeps its values until the replay.
    let graph = be.end_capture().unwrap();
    assert_eq!(graph.len(), 0);
    be.write_at(be.all(&buf), &[1.0, 2.0, 3.0, 4.0]).unwrap();
    be.begin_capture().unwrap();
    be.zero(be.view(&buf, 1..3).unwrap()).unwrap();
    let graph = be.end_capture().unwrap();
    assert_eq!(be.download(&buf).unwrap(), [1.0, 2.0, 3.0, 4.0]);
    // SAFETY: `buf`, the one buffer the capture touched, is alive.
    unsafe { be.replay(&graph) }.unwrap();
    assert_eq!(be.download(&buf).unwrap(), [1.0, 0.0, 0.0, 4.0]);

    assert!(matches!(
        Host.begin_capture(),
        Err(GpuError::Capture { .. })
    ));
    let offloaded = StepOptions {
        offload_params: true,
        ..GRAPHS
    };
    let g = gpt(&DIMS, SEED, 0.2);
    let r = GptGpuStep::<GraphHost, f32>::with_options(
        &be,
        DIMS,
        g.offsets.clone(),
        1e-5,
        (B, T),
        offloaded,
    );
    match r {
        Err(GpuError::Capture { what }) => assert!(what.contains("offloaded"), "{what}"),
        Err(e) => panic!("graphs with an offload: {e}"),
        Ok(_) => panic!("graphs with an offload were not refused"),
    }
}
