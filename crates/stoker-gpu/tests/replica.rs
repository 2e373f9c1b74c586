//! One rank's resident training (`stoker_gpu::parallel`) on the host backend, with
//! in-process ranks: a window of micro-batches is the hand-written loop at one rank, and
//! N ranks under DDP or ZeRO-1 (2 and 3 ranks: an odd world too) train the weights one
//! rank trains on the same window, within f32 rounding of the sums. The window's
//! normalization is by valid targets over every micro-batch and rank: the ranks here get
//! different counts of ignored targets. Bad windows are refused on every rank alike.

mod ranks;

use std::ops::Range;

use stoker_comm::{run_local, Communicator, DEFAULT_TIMEOUT};
use stoker_gpu::parallel::zero1::shard_segments;
use stoker_gpu::parallel::{
    Collectives, DataParallel, GradRule, Replica, Strategy, Tally, ThroughHost, WindowReport, Zero1,
};
use stoker_gpu::sample::{batch, gpt, uniform};
use stoker_gpu::step::optimizer::{Optimizer, OptimizerState, UpdateViews};
use stoker_gpu::step::options::StepOptions;
use stoker_gpu::step::{GptGpuStep, LlamaGpuStep, TokenBatch};
use stoker_gpu::{Act, Backend, Host};
use stoker_kernels::GptDims;
use stoker_testkit::{assert_bits_eq, assert_close, assert_close_scalar};

use ranks::*;

/// One rank's window is the loop written by hand: each micro-batch's gradient scaled by
/// 1 / C (C the window's target capacity), accumulated, one update whose multiplier
/// rescales by C / (the valid targets); bit for bit (the loss within f32 rounding: the
/// window's sum is added up on the backend).
#[test]
fn one_rank_window_is_the_hand_written_loop() {
    let clip = Some(0.05);
    let end = &ranks::<f32>(1, Strategy::Ddp, Optimizer::AdamW, clip)[0];

    let g = gpt(&DIMS, SEED, 0.2);
    let step = GptGpuStep::<Host, f32>::new(&Host, DIMS, g.offsets.clone(), 1e-5, B, T).unwrap();
    step.buffers().load_params(&Host, &g.params).unwrap();
    let opt = OptimizerState::adamw(&Host, &g.params, &segments(&g.ranges)).unwrap();
    let capacity = (MICRO * B * T) as f64;
    for w in 0..WINDOWS {
        let data = window(w);
        let count: usize = data
            .iter()
            .map(|(_, t)| t.iter().filter(|&&x| x != -1).count())
            .sum();
        assert!(count < MICRO * B * T, "window {w} ignores some targets");
        assert_eq!(end.0[w].1, count as u64, "window {w}'s tokens");
        step.buffers().zero_grads(&Host).unwrap();
        let mut loss = 0.0;
        for m in &data {
            loss += step
                .forward_backward(&Host, batch(m), (1.0 / capacity) as f32)
                .unwrap();
        }
        let unscale = (capacity / count as f64) as f32;
        let norm = step
            .update(
                &Host,
                &opt,
                &scalars(Optimizer::AdamW, w as u64 + 1),
                unscale,
                clip,
            )
            .unwrap();
        assert!(
            norm > 0.05,
            "window {w}: norm {norm} does not exercise clipping"
        );
        assert_eq!(end.0[w].2, norm, "window {w}'s norm");
        // The replica adds the micro-batches' sums on the backend, in f32.
        assert_close_scalar(
            end.0[w].0,
            loss / count as f64,
            1e-6,
            &format!("window {w}'s loss"),
        );
    }
    assert_bits_eq(
        &end.2,
        &opt.master(&Host).unwrap(),
        "master after 3 windows",
    );
    assert_bits_eq(&end.3, &end.2, "compute copy: the master");
}

/// 2 and 3 ranks, DDP and ZeRO-1, AdamW and SGD with momentum, clipped: every rank ends
/// with one compute copy, and the master is one rank's within f32 rounding; the windows'
/// losses and norms agree.
#[test]
fn ranks_and_strategies_train_what_one_rank_trains() {
    let clip = Some(0.05);
    for opt in [Optimizer::AdamW, Optimizer::Sgd { momentum: true }] {
        let one = &ranks::<f32>(1, Strategy::Ddp, opt, clip)[0];
        for world in [2, 3] {
            for strategy in [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2] {
                let what = format!("{opt:?}, {strategy:?} over {world} ranks");
                let ends = ranks::<f32>(world, strategy, opt, clip);
                for (rank, end) in ends.iter().enumerate() {
                    assert_bits_eq(
                        &end.3,
                        &ends[0].3,
                        &format!("{what}: rank {rank}'s compute copy"),
                    );
                    for (w, (got, want)) in end.0.iter().zip(&one.0).enumerate() {
                        assert_eq!(got.1, want.1, "{what}: window {w}'s tokens");
                        assert_close_scalar(
                            got.0,
                            want.0,
                            1e-5,
                            &format!("{what}: window {w}'s loss"),
                        );
                        assert_close_scalar(
                            got.2,
                            want.2,
                            1e-5,
                            &format!("{what}: window {w}'s norm"),
                        );
                    }
                }
                let master = match strategy {
                    Strategy::Ddp | Strategy::Offload => ends[0].2.clone(),
                    _ => assemble(&ends),
                };
                assert_bits_eq(
                    &ends[0].3,
                    &master,
                    &format!("{what}: compute copy and master"),
                );
                eprintln!(
                    "{what}: master within {:.1e} of its largest value against 1 rank",
                    stoker_testkit::max_abs_diff(&master, &one.2) / stoker_testkit::max_abs(&one.2)
                );
                assert_weights(&master, &one.2, 1e-5, &what);
            }
        }
    }
}

/// Without clipping the norm does not enter the update, and ZeRO-1's reduce-scatter sums
/// what DDP's all-reduce sums in the same rank order: the two strategies' weights are the
/// same bits, in f32 and with bf16 compute copies (gathered as bf16).
#[test]
fn zero1_is_ddp_bit_for_bit_without_clipping() {
    fn check<T: Act>(world: usize) {
        let ddp = ranks::<T>(world, Strategy::Ddp, Optimizer::AdamW, None);
        let zero = ranks::<T>(world, Strategy::Zero1, Optimizer::AdamW, None);
        let what = format!("{:?} over {world} ranks", T::DTYPE);
        assert_bits_eq(
            &assemble(&zero),
            &ddp[0].2,
            &format!("{what}: ZeRO-1's master"),
        );
        for (z, d) in zero.iter().zip(&ddp) {
            assert_bits_eq(&z.3, &d.3, &format!("{what}: compute copies"));
        }
    }
    check::<f32>(3);
    check::<half::bf16>(2);
}

/// ZeRO-1 at a world whose last rank owns nothing (40 elements over 4 ranks at 16-element
/// boundaries: 16, 16, 8, 0): every rank takes part in the collectives, the empty one
/// updates nothing, and the master is DDP's.
#[test]
fn zero1_with_an_empty_shard_updates_what_ddp_updates() {
    let n = 40;
    let master = uniform(n, 7, 1.0);
    let segs = vec![(0..24, true), (24..40, false)];
    let s = scalars(Optimizer::AdamW, 1);
    let run = |strategy: Strategy, world: usize| {
        run_local(world, DEFAULT_TIMEOUT, |comm| {
            let coll = ThroughHost(&comm);
            let state = DataParallel::new(
                &Host,
                strategy,
                Optimizer::AdamW,
                &master,
                &segs,
                (comm.rank(), world),
            )
            .unwrap();
            let params = Host.upload(&master).unwrap();
            let grads = Host
                .upload(&uniform(n, 100 + comm.rank() as u64, 1.0))
                .unwrap();
            let (squares, partials) = (
                Host.zeros::<f32>(1).unwrap(),
                Host.zeros::<f32>(64).unwrap(),
            );
            let views = UpdateViews {
                params: Host.all(&params),
                grads: Host.all(&grads),
                squares: Host.all(&squares),
                partials: Host.all(&partials),
            };
            let tally = Tally {
                valid: 1.0,
                loss: 0.0,
                micro: 1.0,
                micro_sq: 1.0,
            };
            let (norm, total) = state
                .update(
                    &Host,
                    &coll,
                    views,
                    &s,
                    (tally, 4.0),
                    (GradRule::default(), false),
                )
                .unwrap();
            assert_eq!(total.valid, 4.0, "the tallies summed");
            (
                norm,
                state.master(&Host).unwrap(),
                Host.download(&params).unwrap(),
            )
        })
    };
    let ddp = run(Strategy::Ddp, 4);
    let zero = run(Strategy::Zero1, 4);
    assert_eq!(zero[3].1 .0, 40..40, "the last rank's shard is empty");
    let lens: Vec<usize> = zero.iter().map(|z| z.1 .1.len()).collect();
    assert_eq!(lens, vec![16, 16, 8, 0]);
    let all: Vec<f32> = zero.iter().flat_map(|z| z.1 .1.clone()).collect();
    assert_bits_eq(&all, &ddp[0].1 .1, "ZeRO-1's master pieces against DDP's");
    for (z, d) in zero.iter().zip(&ddp) {
        assert_bits_eq(&z.2, &d.2, "compute copies");
        assert_close_scalar(z.0, d.0, 1e-6, "norms");
    }
}

/// A shard's segments: cut at its ends, moved to start at 0, flags kept.
#[test]
fn shard_segments_cut_and_rebase() {
    let segs = vec![(0..10, true), (10..30, false), (30..31, true)];
    assert_eq!(
        shard_segments(&segs, &(5..16)),
        vec![(0..5, true), (5..11, false)]
    );
    assert_eq!(shard_segments(&segs, &(30..31)), vec![(0..1, true)]);
    assert_eq!(shard_segments(&segs, &(31..31)), vec![]);
}

/// The error of a window of `mine` that the replica must refuse (AdamW, no clipping).
fn refused_window<C: Communicator>(
    replica: &Replica<Host, GptGpuStep<Host, f32>>,
    comm: &C,
    mine: &[TokenBatch],
) -> String {
    replica
        .window(
            &Host,
            &ThroughHost(comm),
            mine,
            &scalars(Optimizer::AdamW, 1),
            rule(None),
        )
        .unwrap_err()
        .to_string()
}

/// A window with no valid target anywhere is refused, naming it, on every rank (after
/// the micro-batches: nothing is communicated before), and the weights are untouched.
#[test]
fn a_window_without_targets_is_refused_on_every_rank() {
    for strategy in [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2] {
        let errs = run_local(2, DEFAULT_TIMEOUT, |comm| {
            let replica = replica_for::<f32>(&comm, strategy);
            let before = replica.step().buffers().params(&Host).unwrap();
            let (tokens, targets) = (vec![1i64; B * T], vec![-1i64; B * T]);
            let b = TokenBatch {
                tokens: &tokens,
                targets: &targets,
                ignore: -1,
            };
            let coll = ThroughHost(&comm);
            assert_eq!(Collectives::<Host>::world(&coll), 2);
            let e = replica
                .window(
                    &Host,
                    &coll,
                    &[b, b],
                    &scalars(Optimizer::AdamW, 1),
                    rule(None),
                )
                .unwrap_err()
                .to_string();
            assert_bits_eq(
                &replica.step().buffers().params(&Host).unwrap(),
                &before,
                "weights",
            );
            e
        });
        for e in errs {
            assert!(
                e.contains("no valid target on any of 2 ranks"),
                "{strategy:?}: {e}"
            );
        }
    }
}

/// Ranks that run different numbers of micro-batches in a window (1, 2 and 3: the middle
/// one runs the mean) are refused on every rank, none left waiting in a collective.
#[test]
fn ranks_with_different_micro_batch_counts_are_refused_on_every_rank() {
    for strategy in [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2] {
        let errs = run_local(3, DEFAULT_TIMEOUT, |comm| {
            let replica = replica_for::<f32>(&comm, strategy);
            let data = window(0);
            let mine: Vec<TokenBatch> = data[..comm.rank() + 1].iter().map(batch).collect();
            refused_window(&replica, &comm, &mine)
        });
        for e in errs {
            assert!(
                e.contains("ran different numbers of micro-batches"),
                "{strategy:?}: {e}"
            );
        }
    }
}

/// ZeRO-1's shard state holds a world's share: master and both moments of 16 of 40.
#[test]
fn zero1_state_is_the_shard() {
    let master = uniform(40, 7, 1.0);
    let z = Zero1::new(
        &Host,
        Optimizer::AdamW,
        &master,
        &[(0..40, true)],
        (1, 4),
        false,
    )
    .unwrap();
    assert_eq!(z.shard(), 16..32);
    assert_eq!(z.master(&Host).unwrap(), master[16..32].to_vec());
    assert_eq!(z.bytes(), 16 * (12 + 4));
    assert!(Zero1::new(&Host, Optimizer::AdamW, &master, &[], (4, 4), false).is_err());
}

/// Stochastic rounding of the bf16 compute copy (llm.c's AdamW): after the last window the
/// copy is stoker-precision's `f32_to_bf16_stochastic` of the master at the counter of that
/// update (window k rounds counters from k x n), bit for bit; ZeRO-1's shards at 3 ranks
/// round as DDP's whole copy; about a quarter of the elements round the other way from
/// round-to-nearest. SGD refuses it, naming AdamW.
#[test]
fn stochastic_rounding_of_the_bf16_copy_is_stoker_precisions() {
    let seed = 0xfeed_beef_0123;
    let one = &ranks_rounded::<half::bf16>(1, Strategy::Ddp, Optimizer::AdamW, None, Some(seed))[0];
    let n = one.2.len();
    let mut want = vec![half::bf16::ZERO; n];
    let offset = ((WINDOWS - 1) * n) as u64;
    stoker_precision::stochastic::f32_to_bf16_stochastic(&one.2, &mut want, seed, offset).unwrap();
    let want: Vec<f32> = want.iter().map(|x| x.to_f32()).collect();
    assert_bits_eq(&one.3, &want, "the stochastically rounded copy");
    let nearest: Vec<f32> = one
        .2
        .iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect();
    let other_way = one
        .3
        .iter()
        .zip(&nearest)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    eprintln!("stochastic rounding: {other_way} of {n} elements round away from nearest");
    assert!(
        other_way * 10 > n && other_way * 10 < 4 * n,
        "{other_way} of {n} elements round away from nearest (expected about a quarter)"
    );
    let ddp = ranks_rounded::<half::bf16>(3, Strategy::Ddp, Optimizer::AdamW, None, Some(seed));
    let zero = ranks_rounded::<half::bf16>(3, Strategy::Zero1, Optimizer::AdamW, None, Some(seed));
    for (z, d) in zero.iter().zip(&ddp) {
        assert_bits_eq(&z.3, &d.3, "ZeRO-1's rounded copy against DDP's");
    }
    let refused = run_local(1, DEFAULT_TIMEOUT, |comm| {
        let g = gpt(&DIMS, SEED, 0.2);
        let step = GptGpuStep::<Host, half::bf16>::new(&Host, DIMS, g.offsets.clone(), 1e-5, B, T)
            .unwrap();
        let sgd = (Strategy::Ddp, Optimizer::Sgd { momentum: false });
        let r = Replica::new(
            &Host,
            step,
            sgd,
            &g.params,
            &segments(&g.ranges),
            (comm.rank(), 1),
        );
        r.unwrap()
            .with_stochastic_rounding(seed)
            .err()
            .unwrap()
            .to_string()
    });
    assert!(refused[0].contains("AdamW"), "{}", refused[0]);
}

/// The Llama's step (grouped-query attention, RoPE, SwiGLU) in a replica: 3 ranks under
/// ZeRO-1 train, over two windows with SGD and momentum, what one rank trains on the
/// same micro-batches, within f32 rounding.
#[test]
fn llama_under_zero1_at_3_ranks_trains_what_one_rank_trains() {
    const LLAMA: stoker_kernels::LlamaDims = stoker_kernels::LlamaDims {
        vocab: 53,
        context: 8,
        d_model: 16,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        ffn_hidden: 24,
    };
    let opt = Optimizer::Sgd { momentum: true };
    let run = |world: usize, strategy: Strategy| {
        run_local(world, DEFAULT_TIMEOUT, |comm| {
            let g = stoker_gpu::sample::llama(&LLAMA, 77, 0.2);
            let segs: Vec<(Range<usize>, bool)> =
                stoker_gpu::sample::segments(&stoker_kernels::llama_params(&LLAMA), &g.ranges);
            let step = LlamaGpuStep::<Host, f32>::new(
                &Host,
                LLAMA,
                g.offsets.clone(),
                1e-5,
                10_000.0,
                B,
                T,
            )
            .unwrap();
            let (rank, per) = (comm.rank(), MICRO / world);
            let replica = Replica::new(
                &Host,
                step,
                (strategy, opt),
                &g.params,
                &segs,
                (rank, world),
            )
            .unwrap();
            let mut losses = Vec::new();
            for w in 0..2 {
                let data = window(w);
                let mine: Vec<TokenBatch> = data[rank * per..(rank + 1) * per]
                    .iter()
                    .map(batch)
                    .collect();
                let r = replica
                    .window(
                        &Host,
                        &ThroughHost(&comm),
                        &mine,
                        &scalars(opt, w as u64 + 1),
                        rule(Some(0.5)),
                    )
                    .unwrap();
                losses.push(r.loss);
            }
            let (range, master) = replica.state().master(&Host).unwrap();
            (
                losses,
                range,
                master,
                replica.step().buffers().params(&Host).unwrap(),
            )
        })
    };
    let one = &run(1, Strategy::Ddp)[0];
    let three = run(3, Strategy::Zero1);
    let mut master = Vec::new();
    for (rank, (losses, range, piece, params)) in three.iter().enumerate() {
        assert_eq!(range.start, master.len());
        master.extend_from_slice(piece);
        assert_bits_eq(params, &three[0].3, &format!("rank {rank}'s compute copy"));
        for (got, want) in losses.iter().zip(&one.0) {
            assert_close_scalar(*got, *want, 1e-5, "window loss");
        }
    }
    assert_close(
        &master,
        &one.2,
        1e-5,
        "the Llama's master, ZeRO-1 at 3 ranks against 1 rank",
    );
}

/// Records the all-reduces a replica starts (their offsets in the gradients and lengths)
/// and the finishes, passing everything on to [`ThroughHost`].
struct Recording<'a, C> {
    inner: ThroughHost<&'a C>,
    base: std::cell::Cell<u64>,
    started: std::cell::RefCell<Vec<Range<usize>>>,
    finished: std::cell::Cell<usize>,
}

impl<C: Communicator> Collectives<Host> for Recording<'_, C> {
    fn rank(&self) -> usize {
        Collectives::<Host>::rank(&self.inner)
    }
    fn world(&self) -> usize {
        Collectives::<Host>::world(&self.inner)
    }
    fn all_reduce(
        &self,
        be: &Host,
        buf: stoker_gpu::View<f32>,
    ) -> Result<(), stoker_gpu::GpuError> {
        self.inner.all_reduce(be, buf)
    }
    fn max_of_amaxes(
        &self,
        be: &Host,
        buf: stoker_gpu::View<f32>,
    ) -> Result<(), stoker_gpu::GpuError> {
        self.inner.max_of_amaxes(be, buf)
    }
    unsafe fn start_all_reduce(
        &self,
        be: &Host,
        buf: stoker_gpu::View<f32>,
    ) -> Result<(), stoker_gpu::GpuError> {
        let at = ((buf.addr() - self.base.get()) / 4) as usize;
        self.started.borrow_mut().push(at..at + buf.len());
        self.inner.all_reduce(be, buf)
    }
    unsafe fn start_reduce_scatter(
        &self,
        be: &Host,
        input: stoker_gpu::View<f32>,
        counts: &[usize],
        out: stoker_gpu::View<f32>,
    ) -> Result<(), stoker_gpu::GpuError> {
        let at = ((input.addr() - self.base.get()) / 4) as usize;
        self.started.borrow_mut().push(at..at + input.len());
        self.inner.reduce_scatter(be, input, counts, out)
    }
    fn finish(&self, _: &Host) -> Result<(), stoker_gpu::GpuError> {
        self.finished.set(self.finished.get() + 1);
        Ok(())
    }
    fn reduce_scatter(
        &self,
        be: &Host,
        input: stoker_gpu::View<f32>,
        counts: &[usize],
        out: stoker_gpu::View<f32>,
    ) -> Result<(), stoker_gpu::GpuError> {
        self.inner.reduce_scatter(be, input, counts, out)
    }
    fn all_gather<E: Act>(
        &self,
        be: &Host,
        buf: stoker_gpu::View<E>,
        counts: &[usize],
    ) -> Result<(), stoker_gpu::GpuError> {
        self.inner.all_gather(be, buf, counts)
    }
    fn sum(&self, be: &Host, xs: &[f64]) -> Result<Vec<f64>, stoker_gpu::GpuError> {
        self.inner.sum(be, xs)
    }
}

/// The buckets (torch DDP's overlap, DeepSpeed's `overlap_comm`): beyond one rank, the
/// last micro-batch's backward starts each block's reduction (DDP's all-reduce, ZeRO-1's
/// reduce-scatter into the shard) as soon as the block is done, last block first, then
/// the parameters outside the blocks, then one finish; together they cover every
/// gradient exactly once. The weights are those of one reduction after the backward, bit
/// for bit, at 2 and 3 ranks (GPT), and the Llama's buckets cover its buffer too.
#[test]
fn buckets_overlapping_the_backward_sum_what_one_reduction_sums() {
    for (world, strategy) in [
        (2, Strategy::Ddp),
        (3, Strategy::Ddp),
        (2, Strategy::Zero1),
        (3, Strategy::Zero1),
    ] {
        let runs = |overlap: bool| {
            run_local(world, DEFAULT_TIMEOUT, |comm| {
                let replica = replica_for::<f32>(&comm, strategy).with_overlap(overlap);
                let grads = replica.step().update_views(&Host).unwrap().grads;
                let coll = Recording {
                    inner: ThroughHost(&comm),
                    base: std::cell::Cell::new(grads.addr()),
                    started: Default::default(),
                    finished: Default::default(),
                };
                let per = MICRO / world;
                let mut starts = Vec::new();
                for w in 0..2 {
                    let data = window(w);
                    let rank = comm.rank();
                    let mine: Vec<TokenBatch> = data[rank * per..(rank + 1) * per]
                        .iter()
                        .map(batch)
                        .collect();
                    coll.started.borrow_mut().clear();
                    replica
                        .window(
                            &Host,
                            &coll,
                            &mine,
                            &scalars(Optimizer::AdamW, w as u64 + 1),
                            rule(Some(0.05)),
                        )
                        .unwrap();
                    starts.push(coll.started.borrow().clone());
                }
                let master = replica.state().master(&Host).unwrap();
                (
                    starts,
                    coll.finished.get(),
                    master,
                    replica.step().buffers().params(&Host).unwrap(),
                )
            })
        };
        let (with, without) = (runs(true), runs(false));
        let what = format!("{strategy:?} over {world} ranks");
        let g = gpt(&DIMS, SEED, 0.2);
        let n = g.params.len();
        let blocks = {
            let step =
                GptGpuStep::<Host, f32>::new(&Host, DIMS, g.offsets.clone(), 1e-5, B, T).unwrap();
            step.block_runs().to_vec()
        };
        for (rank, ((starts, finished, master, params), (none, _, master1, params1))) in
            with.iter().zip(&without).enumerate()
        {
            assert_eq!(*finished, 2, "{what}: rank {rank}: one finish a window");
            assert!(
                none.iter().all(|s| s.is_empty()),
                "{what}: no buckets without overlap"
            );
            for s in starts {
                let order: Vec<Range<usize>> = blocks.iter().rev().flatten().cloned().collect();
                assert_eq!(
                    &s[..order.len()],
                    &order[..],
                    "{what}: blocks' runs first, last block first"
                );
                let mut covered: Vec<Range<usize>> = s.clone();
                covered.sort_by_key(|r| r.start);
                let mut at = 0;
                for r in &covered {
                    assert_eq!(
                        r.start, at,
                        "{what}: every gradient reduced once, in runs {covered:?}"
                    );
                    at = r.end;
                }
                assert_eq!(at, n);
            }
            assert_eq!(master.0, master1.0, "{what}: rank {rank}'s range");
            assert_bits_eq(
                &master.1,
                &master1.1,
                &format!("{what}: master, buckets against one reduction"),
            );
            assert_bits_eq(params, params1, &format!("{what}: compute copy"));
        }
    }
    let llama = LLAMA3;
    let g = stoker_gpu::sample::llama(&llama, 5, 0.2);
    let step =
        LlamaGpuStep::<Host, f32>::new(&Host, llama, g.offsets.clone(), 1e-5, 1e4, 1, 4).unwrap();
    let blocks = step.block_runs();
    assert_eq!(blocks.len(), 3);
    let inside: usize = blocks.iter().flatten().map(|r| r.len()).sum();
    let outside: usize = g
        .ranges
        .iter()
        .filter(|(name, _)| !name.contains("layers."))
        .map(|(_, r)| r.len())
        .sum();
    assert_eq!(
        inside + outside,
        g.params.len(),
        "the Llama's blocks and the rest tile it"
    );
    assert!(
        blocks.iter().all(|b| b.len() == 1),
        "each block one run: {blocks:?}"
    );
}

/// A rank with no micro-batch in a window, beside one with two, under DDP's buckets: it
/// still joins each block's all-reduce (nothing waits for it), and both refuse the window.
#[test]
fn an_empty_rank_joins_the_buckets_and_the_window_is_refused() {
    let errs = run_local(2, DEFAULT_TIMEOUT, |comm| {
        let replica = replica_for(&comm, Strategy::Ddp);
        let data = window(0);
        let mine: Vec<TokenBatch> = match comm.rank() {
            0 => Vec::new(),
            _ => data[..2].iter().map(batch).collect(),
        };
        refused_window(&replica, &comm, &mine)
    });
    for e in errs {
        assert!(e.contains("ran different numbers of micro-batches"), "{e}");
    }
}

/// The optimizer offloaded to the host (ZeRO-Offload) is DDP with its update stepped by
/// the host build of the same kernels: on the host backend, the same bits, one and two
/// ranks, AdamW (clipped) and SGD, f32 and bf16.
#[test]
fn the_optimizer_offloaded_to_the_host_is_ddp_bit_for_bit() {
    fn check<T: Act>(world: usize, opt: Optimizer, clip: Option<f64>) {
        let ddp = ranks::<T>(world, Strategy::Ddp, opt, clip);
        let off = ranks::<T>(world, Strategy::Offload, opt, clip);
        let what = format!("{:?} {opt:?} over {world} ranks", T::DTYPE);
        for (o, d) in off.iter().zip(&ddp) {
            assert_eq!(o.0, d.0, "{what}: losses, tokens and norms");
            assert_bits_eq(&o.2, &d.2, &format!("{what}: master"));
            assert_bits_eq(&o.3, &d.3, &format!("{what}: compute copies"));
        }
    }
    for world in [1, 2] {
        check::<f32>(world, Optimizer::AdamW, Some(0.05));
        check::<half::bf16>(world, Optimizer::AdamW, Some(0.05));
        check::<f32>(world, Optimizer::Sgd { momentum: true }, None);
    }
}

/// `sharded` with each shard's optimizer offloaded to the host (`offloaded`) is `sharded`
/// bit for bit on the host backend.
fn assert_offload_is<T: Act>(
    (sharded, offloaded): (Strategy, Strategy),
    world: usize,
    (opt, clip, round): (Optimizer, Option<f64>, Option<u64>),
) {
    let zero = ranks_rounded::<T>(world, sharded, opt, clip, round);
    let off = ranks_rounded::<T>(world, offloaded, opt, clip, round);
    let what = format!("{offloaded:?} {:?} {opt:?} over {world} ranks", T::DTYPE);
    assert_bits_eq(
        &assemble(&off),
        &assemble(&zero),
        &format!("{what}: master"),
    );
    for (o, z) in off.iter().zip(&zero) {
        assert_eq!(o.0, z.0, "{what}: losses, tokens and norms");
        assert_bits_eq(&o.3, &z.3, &format!("{what}: compute copies"));
    }
}

/// ZeRO-1 with each shard's optimizer offloaded to the host is ZeRO-1 bit for bit on the
/// host backend: 2 and 3 ranks, AdamW (clipped) and SGD, f32 and bf16, stochastic
/// rounding included (each host shard counting from its place in the whole buffer); and
/// ZeRO-2's likewise, at 1, 2 and 3 ranks.
#[test]
fn sharded_optimizers_offloaded_are_their_strategies_bit_for_bit() {
    let adam = (Optimizer::AdamW, Some(0.05), None);
    let sgd = (Optimizer::Sgd { momentum: true }, None, None);
    let zero1 = (Strategy::Zero1, Strategy::Zero1Offload);
    let zero2 = (Strategy::Zero2, Strategy::Zero2Offload);
    for world in [2, 3] {
        assert_offload_is::<f32>(zero1, world, adam);
        assert_offload_is::<half::bf16>(zero1, world, (adam.0, adam.1, Some(0x5eed)));
        assert_offload_is::<f32>(zero1, world, sgd);
    }
    for world in [1, 2, 3] {
        assert_offload_is::<f32>(zero2, world, adam);
        assert_offload_is::<half::bf16>(zero2, world, adam);
        assert_offload_is::<f32>(zero2, world, sgd);
    }
}

/// fp16: f16 activations under a loss scale train what f32 trains, within f16's
/// precision, and 2 and 3 ranks (DDP, ZeRO-1) train what one rank trains.
#[test]
fn f16_under_a_loss_scale_tracks_f32_and_ranks_agree() {
    let clip = Some(0.05);
    let full = &ranks::<f32>(1, Strategy::Ddp, Optimizer::AdamW, clip)[0];
    let one = &ranks_scaled::<half::f16>(1, Strategy::Ddp, clip, 4096.0)[0];
    for (w, (got, want)) in one.0.iter().zip(&full.0).enumerate() {
        assert_eq!(got.1, want.1, "f16: window {w}'s tokens");
        assert_close_scalar(got.0, want.0, 2e-3, &format!("f16: window {w}'s loss"));
        assert_close_scalar(got.2, want.2, 2e-2, &format!("f16: window {w}'s norm"));
    }
    // AdamW divides each gradient by its own running scale, so a parameter whose
    // gradient is mostly rounding moves by about lr either way: compare what the three
    // updates moved, as a whole (relative L2), and bound each element by the steps taken.
    let start = gpt(&DIMS, SEED, 0.2).params;
    let moved =
        |m: &[f32]| -> Vec<f64> { m.iter().zip(&start).map(|(a, b)| (a - b) as f64).collect() };
    let (got, want) = (moved(&one.2), moved(&full.2));
    let l2 = |x: &mut dyn Iterator<Item = f64>| x.map(|v| v * v).sum::<f64>().sqrt();
    let rel = l2(&mut got.iter().zip(&want).map(|(a, b)| a - b)) / l2(&mut want.iter().copied());
    eprintln!("f16's updates within {rel:.1e} (relative L2) of f32's");
    assert!(
        rel < 0.1,
        "f16's updates are {rel:.3} (relative L2) from f32's"
    );
    let bound = 2.0 * WINDOWS as f64 * 3e-3;
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= bound,
            "element {i}: f16 moved {a}, f32 {b}"
        );
    }
    for world in [2, 3] {
        for strategy in [Strategy::Ddp, Strategy::Zero1] {
            let what = format!("f16, {strategy:?} over {world} ranks");
            let ends = ranks_scaled::<half::f16>(world, strategy, clip, 4096.0);
            for (w, (got, want)) in ends[0].0.iter().zip(&one.0).enumerate() {
                assert_eq!(got.1, want.1, "{what}: window {w}'s tokens");
                assert_close_scalar(got.0, want.0, 1e-5, &format!("{what}: window {w}'s loss"));
                assert_close_scalar(got.2, want.2, 1e-5, &format!("{what}: window {w}'s norm"));
            }
            let master = match strategy {
                Strategy::Zero1 => assemble(&ends),
                _ => ends[0].2.clone(),
            };
            for end in &ends {
                assert_bits_eq(&end.3, &ends[0].3, &format!("{what}: compute copies"));
            }
            assert_weights(&master, &one.2, 1e-5, &what);
        }
    }
}

/// An fp16 overflow skips the update on every rank under every strategy and leaves no
/// trace: a window at too large a loss scale, then one at a good scale, ends with the
/// bits of the good window alone (the optimizer's first update either way).
#[test]
fn an_f16_overflow_skips_the_update_everywhere_and_leaves_no_trace() {
    let rule = |scale: f32| GradRule {
        clip: Some(0.05),
        loss_scale: Some(scale),
    };
    for world in [1, 2] {
        for strategy in [
            Strategy::Ddp,
            Strategy::Zero1,
            Strategy::Offload,
            Strategy::Zero1Offload,
            Strategy::Zero3,
        ] {
            let what = format!("{strategy:?} over {world} ranks");
            let run = |overflow_first: bool| {
                run_local(world, DEFAULT_TIMEOUT, |comm| {
                    let replica = replica_for::<half::f16>(&comm, strategy);
                    let coll = ThroughHost(&comm);
                    let per = MICRO / world;
                    let mine = |w: usize| -> Vec<(Vec<i64>, Vec<i64>)> {
                        window(w)[comm.rank() * per..(comm.rank() + 1) * per].to_vec()
                    };
                    let first = scalars(Optimizer::AdamW, 1);
                    if overflow_first {
                        let (master, params) = (
                            replica.state().master(&Host).unwrap(),
                            compute_copy(&replica),
                        );
                        let data = mine(0);
                        let batches: Vec<TokenBatch> = data.iter().map(batch).collect();
                        let r = replica
                            .window(&Host, &coll, &batches, &first, rule(1e9))
                            .unwrap();
                        assert!(
                            r.skipped && !r.grad_norm.is_finite() && r.loss.is_finite(),
                            "{what}: rank {} did not skip: {r:?}",
                            comm.rank()
                        );
                        assert_eq!(replica.state().master(&Host).unwrap(), master);
                        assert_bits_eq(
                            &compute_copy(&replica),
                            &params,
                            "the compute copy after a skipped update",
                        );
                    }
                    let data = mine(1);
                    let batches: Vec<TokenBatch> = data.iter().map(batch).collect();
                    let r = replica
                        .window(&Host, &coll, &batches, &first, rule(4096.0))
                        .unwrap();
                    assert!(!r.skipped && r.grad_norm.is_finite(), "{what}: {r:?}");
                    (
                        r,
                        replica.state().master(&Host).unwrap().1,
                        compute_copy(&replica),
                    )
                })
            };
            for (after, alone) in run(true).iter().zip(&run(false)) {
                assert_eq!(after.0, alone.0, "{what}: the good window's report");
                assert_bits_eq(&after.1, &alone.1, &format!("{what}: master"));
                assert_bits_eq(&after.2, &alone.2, &format!("{what}: compute copy"));
            }
        }
    }
}

/// Stochastic rounding writes a bf16 compute copy: an f32 or f16 step refuses it.
#[test]
fn stochastic_rounding_is_refused_for_a_non_bf16_compute_copy() {
    run_local(1, DEFAULT_TIMEOUT, |comm| {
        let e = replica_for::<half::f16>(&comm, Strategy::Ddp)
            .with_stochastic_rounding(7)
            .err()
            .expect("an f16 step took stochastic rounding");
        assert!(e.to_string().contains("f16"), "{e}");
    });
}

/// What a run of [`parameters_offloaded_train_what_the_optimizer_offload_trains_bit_for_bit`]
/// ends with: its windows' reports, master, compute copy and an evaluation.
type OffloadEnd = (Vec<WindowReport>, Vec<f32>, Vec<f32>, (f64, usize, usize));

/// The parameters offloaded (FSDP's `CPUOffload(offload_params=True)`): one rank with the
/// blocks' parameters in host memory, streamed into two slots as each block runs, trains
/// what the optimizer's offload alone trains, bit for bit: the same kernels on the same
/// values at other addresses, the gradients summed in the same order. f32, bf16, and f16
/// under a loss scale; a window at another batch shape and an evaluation between.
#[test]
fn parameters_offloaded_train_what_the_optimizer_offload_trains_bit_for_bit() {
    fn run<A: Act>(offload: bool, loss_scale: Option<f32>) -> OffloadEnd {
        let g = gpt(&DIMS3, SEED, 0.2);
        let make = |b: usize, t: usize| {
            let opts = StepOptions {
                offload_params: offload,
                ..StepOptions::default()
            };
            GptGpuStep::<Host, A>::with_options(&Host, DIMS3, g.offsets.clone(), 1e-5, (b, t), opts)
                .unwrap()
        };
        run_local(1, DEFAULT_TIMEOUT, |comm| {
            let mut replica = Replica::new(
                &Host,
                make(B, T),
                (Strategy::Offload, Optimizer::AdamW),
                &g.params,
                &segments3(&g.ranges),
                (0, 1),
            )
            .unwrap();
            let coll = ThroughHost(&comm);
            let rule = GradRule {
                clip: Some(0.05),
                loss_scale,
            };
            let mut reports = Vec::new();
            for w in 0..WINDOWS {
                if w == 2 {
                    // A shorter batch shape for the last window: a step of its own, the
                    // compute copy copied over.
                    replica.replace_step(&Host, make(B, T - 3)).unwrap();
                }
                let data = window(w);
                let cut: Vec<(Vec<i64>, Vec<i64>)> = data
                    .iter()
                    .map(|(x, y)| match w {
                        2 => (trim(x), trim(y)),
                        _ => (x.clone(), y.clone()),
                    })
                    .collect();
                let batches: Vec<TokenBatch> = cut.iter().map(batch).collect();
                let r = replica
                    .window(
                        &Host,
                        &coll,
                        &batches,
                        &scalars(Optimizer::AdamW, w as u64 + 1),
                        rule,
                    )
                    .unwrap();
                reports.push(r);
            }
            let data = window(7);
            let eval = replica
                .step()
                .evaluate(&Host, batch(&(trim(&data[0].0), trim(&data[0].1))))
                .unwrap();
            (
                reports,
                replica.state().master(&Host).unwrap().1,
                replica.step().buffers().params(&Host).unwrap(),
                eval,
            )
        })
        .remove(0)
    }
    /// Each sequence's first T - 3 positions.
    fn trim(x: &[i64]) -> Vec<i64> {
        x.chunks(T).flat_map(|s| s[..T - 3].to_vec()).collect()
    }
    fn check<A: Act>(loss_scale: Option<f32>) {
        let what = format!("{:?}", A::DTYPE);
        let (plain, off) = (run::<A>(false, loss_scale), run::<A>(true, loss_scale));
        assert_eq!(off.0, plain.0, "{what}: window reports");
        assert_bits_eq(&off.1, &plain.1, &format!("{what}: master"));
        assert_bits_eq(&off.2, &plain.2, &format!("{what}: compute copy"));
        assert_eq!(off.3, plain.3, "{what}: evaluation");
    }
    check::<f32>(None);
    check::<half::bf16>(None);
    check::<half::f16>(Some(4096.0));
}

/// A step with its blocks' parameters offloaded holds two blocks' worth of them on the
/// backend, as planned, and runs only with the optimizer offloaded on one rank.
#[test]
fn an_offloaded_step_holds_two_blocks_and_needs_the_optimizer_offloaded() {
    let g = gpt(&DIMS, SEED, 0.2);
    let plain = GptGpuStep::<Host, f32>::new(&Host, DIMS, g.offsets.clone(), 1e-5, B, T).unwrap();
    let offloaded = || {
        let o = g.offsets.clone();
        GptGpuStep::<Host, f32>::with_options(&Host, DIMS, o, 1e-5, (B, T), OFFLOAD).unwrap()
    };
    let off = offloaded();
    let block = stoker_gpu::step::gpt::gpt_block_len(&DIMS);
    let end = g.offsets.end();
    // The plain step holds every parameter and gradient (4 + 4 bytes); the offloaded one
    // the rest of the buffer and two slots of each.
    let saved = 8 * (end - (end - DIMS.n_layer * block + 2 * block));
    assert_eq!(plain.buffers().bytes() - off.buffers().bytes(), saved);
    let planned = stoker_gpu::step::gpt::gpt_step_sizes(&DIMS, end, (B, T), OFFLOAD).bytes(4);
    assert_eq!(off.buffers().bytes(), planned, "counted against planned");
    for (strategy, world) in [
        (Strategy::Ddp, 1),
        (Strategy::Zero1, 1),
        (Strategy::Offload, 2),
    ] {
        let e = run_local(world, DEFAULT_TIMEOUT, |comm| {
            Replica::new(
                &Host,
                offloaded(),
                (strategy, Optimizer::AdamW),
                &g.params,
                &segments(&g.ranges),
                (comm.rank(), comm.world_size()),
            )
            .err()
            .map(|e| e.to_string())
        });
        for e in e {
            let e = e.unwrap_or_else(|| panic!("{strategy:?} on {world} took an offloaded step"));
            assert!(e.contains("Strategy::Offload"), "{e}");
        }
    }
}

/// The Llama's step with its blocks' parameters offloaded (three blocks, so the backward
/// brings the first back): two micro-batches give the plain step's losses and summed
/// gradients bit for bit, in f32 and bf16.
#[test]
fn the_llama_step_with_its_parameters_offloaded_is_the_plain_step_bit_for_bit() {
    fn check<A: Act>() {
        let dims = LLAMA3;
        let g = stoker_gpu::sample::llama(&dims, 78, 0.2);
        let o = g.offsets.clone();
        let plain =
            LlamaGpuStep::<Host, A>::new(&Host, dims, o.clone(), 1e-5, 10_000.0, B, T).unwrap();
        let off = LlamaGpuStep::<Host, A>::with_options(
            &Host,
            dims,
            o,
            (1e-5, 10_000.0),
            (B, T),
            OFFLOAD,
        )
        .unwrap();
        let data = window(0);
        let mut losses = [Vec::new(), Vec::new()];
        for (k, step) in [&plain, &off].into_iter().enumerate() {
            step.buffers().load_params(&Host, &g.params).unwrap();
            step.buffers().zero_grads(&Host).unwrap();
            for m in &data[..2] {
                losses[k].push(step.forward_backward(&Host, batch(m), 0.25).unwrap());
            }
        }
        let what = format!("{:?}", A::DTYPE);
        assert_eq!(losses[0], losses[1], "{what}: losses");
        assert_bits_eq(
            &off.buffers().grads(&Host).unwrap(),
            &plain.buffers().grads(&Host).unwrap(),
            &format!("{what}: summed gradients"),
        );
        assert_bits_eq(
            &off.buffers().params(&Host).unwrap(),
            &plain.buffers().params(&Host).unwrap(),
            &format!("{what}: compute copy"),
        );
    }
    check::<f32>();
    check::<half::bf16>();
}

/// ZeRO-2 (the blocks' gradients in two slots, each block's reduce-scattered into the
/// shard after every micro-batch's backward): one rank trains what DDP trains, and at 2
/// and 3 ranks every rank holds the step's slots and its shard (gradients and a landing
/// buffer) instead of the whole gradient, as planned.
#[test]
fn zero2_holds_a_shard_of_the_gradients_and_trains_what_one_rank_trains() {
    let one = &ranks::<f32>(1, Strategy::Ddp, Optimizer::AdamW, Some(0.05))[0];
    let zero2 = &ranks::<f32>(1, Strategy::Zero2, Optimizer::AdamW, Some(0.05))[0];
    for (w, (got, want)) in zero2.0.iter().zip(&one.0).enumerate() {
        assert_eq!(got.1, want.1, "window {w}'s tokens");
        assert_close_scalar(got.0, want.0, 1e-6, &format!("window {w}'s loss"));
    }
    assert_weights(&zero2.2, &one.2, 1e-5, "ZeRO-2 on one rank");
    // Six blocks: the two slots hold a third of the blocks' gradients.
    let dims = GptDims { n_layer: 6, ..DIMS };
    let g = gpt(&dims, SEED, 0.2);
    let end = g.offsets.end();
    for world in [2, 3] {
        let bytes = run_local(world, DEFAULT_TIMEOUT, |comm| {
            let (z2, z1) = (
                replica_of::<f32>(&comm, Strategy::Zero2, dims),
                replica_of::<f32>(&comm, Strategy::Zero1, dims),
            );
            let rank_world = (comm.rank(), comm.world_size());
            let planned = DataParallel::<Host>::planned_bytes(
                Strategy::Zero2,
                Optimizer::AdamW,
                end,
                rank_world,
                stoker_gpu::step::gpt::gpt_block_len(&dims),
            ) + stoker_gpu::step::gpt::gpt_step_sizes(
                &dims,
                end,
                (B, T),
                options_for(Strategy::Zero2, rank_world),
            )
            .bytes(4);
            let counted = |r: &Replica<Host, GptGpuStep<Host, f32>>| {
                r.state().bytes() + r.step().buffers().bytes()
            };
            (planned, counted(&z2), counted(&z1))
        });
        for (r, (planned, z2, z1)) in bytes.into_iter().enumerate() {
            assert_eq!(
                planned, z2,
                "rank {r} of {world}: ZeRO-2's planned and counted bytes"
            );
            assert!(
                z2 < z1,
                "rank {r} of {world}: ZeRO-2 holds {z2}, ZeRO-1 {z1}"
            );
        }
    }
}

/// Parameter offload copies a block up only where its slot lacks it, beside the kernels
/// (`Work::Transfer`, the copy stream's): four blocks, whose first micro-batch copies all
/// four up in the forward, blocks 1 and 0 again in the backward (blocks 3 and 2 are still
/// in their slots at the turn) and every block's gradients down; the second finds blocks
/// 0 and 1 where the backward left them; an update on the host makes every slot stale.
#[test]
fn an_offloaded_step_copies_up_only_the_blocks_its_slots_lack() {
    use stoker_gpu::counting::{CountingBackend, Work};
    let dims = GptDims { n_layer: 4, ..DIMS };
    let g = gpt(&dims, SEED, 0.2);
    let be = CountingBackend::new();
    let o = g.offsets.clone();
    let step =
        GptGpuStep::<CountingBackend, f32>::with_options(&be, dims, o, 1e-5, (B, T), OFFLOAD)
            .unwrap();
    step.buffers().load_params(&be, &g.params).unwrap();
    step.buffers().zero_grads(&be).unwrap();
    let transferred = |work: Vec<Work>| -> usize {
        work.iter()
            .map(|w| match w {
                Work::Transfer { bytes, .. } => *bytes as usize,
                _ => 0,
            })
            .sum()
    };
    let data = window(0);
    let mut blocks = Vec::new();
    let block_bytes = 4 * stoker_gpu::step::gpt::gpt_block_len(&dims);
    let mut micro_batch = |m: &(Vec<i64>, Vec<i64>)| {
        be.take();
        step.forward_backward(&be, batch(m), 0.25).unwrap();
        let bytes = transferred(be.take());
        assert_eq!(bytes % block_bytes, 0, "{bytes} bytes: whole blocks");
        blocks.push(bytes / block_bytes);
    };
    micro_batch(&data[0]);
    micro_batch(&data[1]);
    step.buffers().after_host_update(&be).unwrap();
    micro_batch(&data[0]);
    // Up and down, in blocks: 6 + 4, then 4 + 4, then 6 + 4 again.
    assert_eq!(blocks, [10, 8, 10]);
}
