//! ZeRO-3 on the resident loop (the compute copy sharded, each block gathered into a slot
//! before it runs) on the host backend with in-process ranks: it computes what ZeRO-2
//! computes on the same values, so at 1, 2 and 3 ranks (3: an odd world, shards of
//! unequal length) it trains ZeRO-2's weights bit for bit, evaluates what the unsharded
//! step evaluates, holds on each rank what is planned, and is refused where its step and
//! its strategy disagree.

mod ranks;

use stoker_comm::{run_local, Communicator, DEFAULT_TIMEOUT};
use stoker_gpu::collectives::Mark;
use stoker_gpu::parallel::{Collectives, DataParallel, Replica, Strategy, ThroughHost};
use stoker_gpu::sample::{batch, gpt};
use stoker_gpu::step::optimizer::Optimizer;
use stoker_gpu::step::options::StepOptions;
use stoker_gpu::step::{GptGpuStep, LlamaGpuStep, TokenBatch};
use stoker_gpu::{Act, GpuError, Host, View};
use stoker_kernels::GptDims;
use stoker_testkit::{assert_bits_eq, assert_close};

use ranks::*;

/// `got` (ZeRO-3's ranks) against `want` (another strategy's at the same world): every
/// window's report, every rank's master, and each ZeRO-3 rank's shard of the compute
/// copy against that piece of the other's whole copy, all bit for bit.
fn assert_same_training(got: &[RankEnd], want: &[RankEnd], what: &str) {
    assert_eq!(got.len(), want.len());
    for (rank, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.0, w.0, "{what}: rank {rank}'s window reports");
        assert_eq!(g.1, w.1, "{what}: rank {rank}'s master range");
        assert_bits_eq(&g.2, &w.2, &format!("{what}: rank {rank}'s master"));
        let shard = &w.3[g.1.clone()];
        assert_bits_eq(&g.3, shard, &format!("{what}: rank {rank}'s compute copy"));
    }
}

/// ZeRO-3 trains what ZeRO-2 trains, bit for bit: AdamW with clipping in f32 and bf16,
/// SGD with momentum, fp16 under a loss scale; the optimizer offloaded too; at 1, 2 and
/// 3 ranks.
#[test]
fn zero3_trains_what_zero2_trains_bit_for_bit() {
    let adam = (Optimizer::AdamW, Some(0.05));
    let sgd = (Optimizer::Sgd { momentum: true }, None);
    for world in [1, 2, 3] {
        for (opt, clip) in [adam, sgd] {
            let what = format!("f32, {opt:?} over {world} ranks");
            let zero2 = ranks::<f32>(world, Strategy::Zero2, opt, clip);
            assert_same_training(
                &ranks::<f32>(world, Strategy::Zero3, opt, clip),
                &zero2,
                &what,
            );
        }
        let what = format!("bf16 over {world} ranks");
        let zero2 = ranks::<half::bf16>(world, Strategy::Zero2, adam.0, adam.1);
        let zero3 = ranks::<half::bf16>(world, Strategy::Zero3, adam.0, adam.1);
        assert_same_training(&zero3, &zero2, &what);
        let offloaded = ranks::<half::bf16>(world, Strategy::Zero3Offload, adam.0, adam.1);
        assert_same_training(&offloaded, &zero2, &format!("{what}, offloaded"));
        let what = format!("f16 at 4096 over {world} ranks");
        let zero2 = ranks_scaled::<half::f16>(world, Strategy::Zero2, adam.1, 4096.0);
        let zero3 = ranks_scaled::<half::f16>(world, Strategy::Zero3, adam.1, 4096.0);
        assert_same_training(&zero3, &zero2, &what);
    }
}

/// A ZeRO-3 evaluation gathers each block as its forward reaches it: at 2 and 3 ranks,
/// before and after a window, every rank evaluates what one unsharded rank evaluates on
/// the same weights, bit for bit; and a window at another batch shape (the step replaced,
/// its shard copied) goes on as ZeRO-2's does.
#[test]
fn zero3_evaluates_and_changes_shape_as_the_unsharded_step() {
    let run = |world: usize, strategy: Strategy| {
        run_local(world, DEFAULT_TIMEOUT, |comm| {
            let mut replica = replica_for::<f32>(&comm, strategy);
            let coll = ThroughHost(&comm);
            let data = window(0);
            let eval = batch(&data[5]);
            let before = replica.evaluate(&Host, &coll, eval).unwrap();
            let per = MICRO / world;
            let mine: Vec<TokenBatch> = data[comm.rank() * per..(comm.rank() + 1) * per]
                .iter()
                .map(batch)
                .collect();
            let first = scalars(Optimizer::AdamW, 1);
            replica
                .window(&Host, &coll, &mine, &first, rule(Some(0.05)))
                .unwrap();
            let after = replica.evaluate(&Host, &coll, eval).unwrap();
            // One sequence of T positions a micro-batch: a step at another shape.
            let g = gpt(&DIMS, SEED, 0.2);
            let rank_world = (comm.rank(), comm.world_size());
            let short = GptGpuStep::<Host, f32>::with_options(
                &Host,
                DIMS,
                g.offsets.clone(),
                1e-5,
                (1, T),
                options_for(strategy, rank_world),
            )
            .unwrap();
            replica.replace_step(&Host, short).unwrap();
            let data = window(1);
            let halves: Vec<(Vec<i64>, Vec<i64>)> = data
                [comm.rank() * per..(comm.rank() + 1) * per]
                .iter()
                .map(|(x, y)| (x[..T].to_vec(), y[..T].to_vec()))
                .collect();
            let mine: Vec<TokenBatch> = halves.iter().map(batch).collect();
            let r = replica
                .window(
                    &Host,
                    &coll,
                    &mine,
                    &scalars(Optimizer::AdamW, 2),
                    rule(Some(0.05)),
                )
                .unwrap();
            let (range, master) = replica.state().master(&Host).unwrap();
            (before, after, r, range, master)
        })
    };
    let one = &run(1, Strategy::Ddp)[0];
    for world in [2, 3] {
        let zero2 = run(world, Strategy::Zero2);
        for (rank, (got, want)) in run(world, Strategy::Zero3).iter().zip(&zero2).enumerate() {
            let what = format!("rank {rank} of {world}");
            assert_eq!(got.0, one.0, "{what}: the evaluation before training");
            assert_eq!(got.1, want.1, "{what}: the evaluation after a window");
            assert_eq!(got.2, want.2, "{what}: the window at another shape");
            assert_eq!(got.3, want.3, "{what}: the master's range");
            assert_bits_eq(&got.4, &want.4, &format!("{what}: master"));
        }
    }
}

/// Each rank holds the resident runs, two blocks' slots and its shard of the compute
/// copy: with six blocks, at 2 and 3 ranks, what is counted is what is planned, and less
/// than ZeRO-2 holds.
#[test]
fn zero3_holds_a_shard_of_the_parameters_as_planned() {
    let dims = GptDims { n_layer: 6, ..DIMS };
    let g = gpt(&dims, SEED, 0.2);
    let end = g.offsets.end();
    for world in [2, 3] {
        let bytes = run_local(world, DEFAULT_TIMEOUT, |comm| {
            let rank_world = (comm.rank(), comm.world_size());
            let counted = |strategy: Strategy| {
                let r = replica_of::<half::bf16>(&comm, strategy, dims);
                r.state().bytes() + r.step().buffers().bytes()
            };
            let sizes = stoker_gpu::step::gpt::gpt_step_sizes(
                &dims,
                end,
                (B, T),
                options_for(Strategy::Zero3, rank_world),
            );
            let planned = DataParallel::<Host>::planned_bytes(
                Strategy::Zero3,
                Optimizer::AdamW,
                end,
                rank_world,
                stoker_gpu::step::gpt::gpt_block_len(&dims),
            ) + sizes.bytes(2);
            let shard = sizes.sharded.expect("ZeRO-3's sizes").shard;
            (
                planned,
                counted(Strategy::Zero3),
                counted(Strategy::Zero2),
                shard,
            )
        });
        let mut shards = 0;
        for (r, (planned, z3, z2, shard)) in bytes.into_iter().enumerate() {
            assert_eq!(
                planned, z3,
                "rank {r} of {world}: planned and counted bytes"
            );
            assert!(
                z3 < z2,
                "rank {r} of {world}: ZeRO-3 holds {z3}, ZeRO-2 {z2}"
            );
            shards += shard;
        }
        assert_eq!(shards, end, "the {world} shards tile the flat buffer");
    }
}

/// The Llama's step sharded (three blocks, grouped-query attention) trains ZeRO-2's
/// weights bit for bit at 3 ranks.
#[test]
fn the_llama_under_zero3_is_zero2_bit_for_bit() {
    let opt = Optimizer::Sgd { momentum: true };
    let run = |strategy: Strategy| {
        run_local(3, DEFAULT_TIMEOUT, |comm| {
            let g = stoker_gpu::sample::llama(&LLAMA3, 77, 0.2);
            let segs =
                stoker_gpu::sample::segments(&stoker_kernels::llama_params(&LLAMA3), &g.ranges);
            let (rank, per) = (comm.rank(), MICRO / 3);
            let opts = options_for(strategy, (rank, 3));
            let step = LlamaGpuStep::<Host, f32>::with_options(
                &Host,
                LLAMA3,
                g.offsets.clone(),
                (1e-5, 10_000.0),
                (B, T),
                opts,
            )
            .unwrap();
            let replica =
                Replica::new(&Host, step, (strategy, opt), &g.params, &segs, (rank, 3)).unwrap();
            let mut reports = Vec::new();
            for w in 0..2 {
                let data = window(w);
                let mine: Vec<TokenBatch> = data[rank * per..(rank + 1) * per]
                    .iter()
                    .map(batch)
                    .collect();
                let coll = ThroughHost(&comm);
                let s = scalars(opt, w as u64 + 1);
                reports.push(
                    replica
                        .window(&Host, &coll, &mine, &s, rule(Some(0.5)))
                        .unwrap(),
                );
            }
            (reports, replica.state().master(&Host).unwrap())
        })
    };
    for (rank, (got, want)) in run(Strategy::Zero3)
        .iter()
        .zip(&run(Strategy::Zero2))
        .enumerate()
    {
        assert_eq!(got.0, want.0, "rank {rank}'s window reports");
        assert_eq!(got.1 .0, want.1 .0, "rank {rank}'s master range");
        assert_bits_eq(&got.1 .1, &want.1 .1, &format!("rank {rank}'s master"));
    }
}

/// A ZeRO-3 replica needs a sharded step and a sharded step needs ZeRO-3, each refused
/// naming why; a shard made for one world gathered by another is refused too, and so is
/// a sharded step run without the replica that gathers its blocks.
#[test]
fn zero3_and_its_step_go_together() {
    run_local(2, DEFAULT_TIMEOUT, |comm| {
        let g = gpt(&DIMS, SEED, 0.2);
        let rank_world = (comm.rank(), comm.world_size());
        let make = |opts: StepOptions| {
            GptGpuStep::<Host, f32>::with_options(
                &Host,
                DIMS,
                g.offsets.clone(),
                1e-5,
                (B, T),
                opts,
            )
            .unwrap()
        };
        let segs = segments(&g.ranges);
        let replica = |strategy: Strategy, opts: StepOptions| {
            Replica::new(
                &Host,
                make(opts),
                (strategy, Optimizer::AdamW),
                &g.params,
                &segs,
                rank_world,
            )
            .err()
            .map(|e| e.to_string())
        };
        let zero2 = options_for(Strategy::Zero2, rank_world);
        let zero3 = options_for(Strategy::Zero3, rank_world);
        let e = replica(Strategy::Zero3, zero2).expect("ZeRO-3 over an unsharded step");
        assert!(e.contains("ZeRO-3") && e.contains("sharded"), "{e}");
        let e = replica(Strategy::Zero2, zero3).expect("ZeRO-2 over a sharded step");
        assert!(e.contains("ZeRO-3"), "{e}");
        // A step sharded for rank 0 of 3 in a world of 2: its first gather refuses.
        let wrong = options_for(Strategy::Zero3, (0, 3));
        let step = make(wrong);
        let e = step
            .buffers()
            .sharded()
            .expect("a sharded step")
            .ensure(&Host, &ThroughHost(&comm), 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 0 of 3"), "{e}");
        // Run without its replica, a sharded step would compute on empty slots: refused.
        let e = make(zero3)
            .forward_backward(&Host, batch(&window(0)[0]), 1.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sharded") && e.contains("replica"), "{e}");
        assert!(replica(Strategy::Zero3, zero3).is_none());
    });
}

/// The shards' compute copies are ZeRO's split of the flat buffer: with the sizes
/// planned before a step exists, every rank's shard has the planned length.
#[test]
fn a_sharded_step_is_sized_as_planned() {
    fn check<A: Act>(world: usize) {
        let g = gpt(&DIMS, SEED, 0.2);
        let end = g.offsets.end();
        for rank in 0..world {
            let opts = options_for(Strategy::Zero3, (rank, world));
            let sizes = stoker_gpu::step::gpt::gpt_step_sizes(&DIMS, end, (B, T), opts);
            let step = GptGpuStep::<Host, A>::with_options(
                &Host,
                DIMS,
                g.offsets.clone(),
                1e-5,
                (B, T),
                opts,
            )
            .unwrap();
            let want = stoker_gpu::collectives::shard_plan(end, world).range(rank);
            let sharded = step.buffers().sharded().expect("a sharded step");
            assert_eq!(sharded.shard_range(), want);
            assert_eq!(sizes.sharded.map(|s| s.shard), Some(want.len()));
            assert_eq!(
                step.buffers().bytes(),
                sizes.bytes(std::mem::size_of::<A>())
            );
        }
    }
    for world in [1, 2, 3, 5] {
        check::<f32>(world);
        check::<half::bf16>(world);
    }
}

/// What a rank's collectives did: elements gathered at once and started, elements
/// reduce-scattered at once and started, marks made and waited for.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Traffic {
    gathered: usize,
    gathers_started: usize,
    scattered: usize,
    scatters_started: usize,
    marks: u64,
    waits: usize,
}

/// [`ThroughHost`] counting what goes through it ([`Traffic`]), marks numbered as a
/// device numbers them, each wait checked against the marks made.
struct Counting<'a, C> {
    inner: ThroughHost<&'a C>,
    seen: std::cell::Cell<Traffic>,
}

impl<'a, C: Communicator> Counting<'a, C> {
    fn new(comm: &'a C) -> Self {
        Counting {
            inner: ThroughHost(comm),
            seen: Default::default(),
        }
    }

    fn count(&self, f: impl FnOnce(&mut Traffic)) {
        let mut t = self.seen.get();
        f(&mut t);
        self.seen.set(t);
    }
}

impl<C: Communicator> Collectives<Host> for Counting<'_, C> {
    fn rank(&self) -> usize {
        self.inner.0.rank()
    }
    fn world(&self) -> usize {
        self.inner.0.world_size()
    }
    fn all_reduce(&self, be: &Host, buf: View<f32>) -> Result<(), GpuError> {
        self.inner.all_reduce(be, buf)
    }
    fn max_of_amaxes(&self, be: &Host, buf: View<f32>) -> Result<(), GpuError> {
        self.inner.max_of_amaxes(be, buf)
    }
    unsafe fn start_reduce_scatter(
        &self,
        be: &Host,
        input: View<f32>,
        counts: &[usize],
        out: View<f32>,
    ) -> Result<(), GpuError> {
        self.count(|t| t.scatters_started += input.len());
        self.inner.reduce_scatter(be, input, counts, out)
    }
    unsafe fn start_all_gather<E: Act>(
        &self,
        be: &Host,
        buf: View<E>,
        counts: &[usize],
    ) -> Result<(), GpuError> {
        self.count(|t| t.gathers_started += buf.len());
        self.inner.all_gather(be, buf, counts)
    }
    fn mark(&self, _: &Host) -> Result<Mark, GpuError> {
        let k = self.seen.get().marks;
        self.count(|t| t.marks += 1);
        Ok(Mark(k))
    }
    fn wait(&self, _: &Host, mark: Mark) -> Result<(), GpuError> {
        assert!(mark.0 < self.seen.get().marks, "a wait for a mark not made");
        self.count(|t| t.waits += 1);
        Ok(())
    }
    fn reduce_scatter(
        &self,
        be: &Host,
        input: View<f32>,
        counts: &[usize],
        out: View<f32>,
    ) -> Result<(), GpuError> {
        self.count(|t| t.scattered += input.len());
        self.inner.reduce_scatter(be, input, counts, out)
    }
    fn all_gather<E: Act>(
        &self,
        be: &Host,
        buf: View<E>,
        counts: &[usize],
    ) -> Result<(), GpuError> {
        self.count(|t| t.gathered += buf.len());
        self.inner.all_gather(be, buf, counts)
    }
    fn sum(&self, be: &Host, xs: &[f64]) -> Result<Vec<f64>, GpuError> {
        self.inner.sum(be, xs)
    }
}

/// The traffic of ZeRO-3's windows with six blocks at 2 ranks: a block still in its slot
/// is not gathered again, so two micro-batches after an update gather `(2L - 2) + (2L - 4)`
/// blocks (all but the first started while another block runs), and the update gathers
/// the runs outside the blocks at once; every block's gradients are reduce-scattered once
/// per micro-batch, started as its backward is queued, the runs outside once per window at
/// once; every mark is waited for. ZeRO-2 gathers only the whole compute copy after its
/// update. An evaluation after the update gathers block 0 at once and starts the rest.
#[test]
fn zero3_gathers_each_block_only_when_its_slot_lacks_it() {
    let dims = GptDims { n_layer: 6, ..DIMS };
    let g = gpt(&dims, SEED, 0.2);
    let block = stoker_gpu::step::gpt::gpt_block_len(&dims);
    let rest = g.offsets.end() - 6 * block;
    let traffic = |strategy: Strategy| {
        run_local(2, DEFAULT_TIMEOUT, |comm| {
            let replica = replica_of::<f32>(&comm, strategy, dims);
            let coll = Counting::new(&comm);
            let data = window(0);
            let mine: Vec<TokenBatch> = data[comm.rank() * 2..comm.rank() * 2 + 2]
                .iter()
                .map(batch)
                .collect();
            let first = scalars(Optimizer::AdamW, 1);
            replica
                .window(&Host, &coll, &mine, &first, rule(Some(0.05)))
                .unwrap();
            let window = coll.seen.get();
            replica.evaluate(&Host, &coll, mine[0]).unwrap();
            let evaluated = coll.seen.get();
            (window, evaluated)
        })
    };
    for (rank, (window, evaluated)) in traffic(Strategy::Zero3).into_iter().enumerate() {
        let what = format!("ZeRO-3, rank {rank} of 2");
        let (l, micro) = (6, 2);
        assert_eq!(window.gathered, block + rest, "{what}: gathered at once");
        assert_eq!(
            window.gathers_started,
            ((2 * l - 2) + (2 * l - 4) - 1) * block,
            "{what}: gathers started"
        );
        assert_eq!(window.scatters_started, micro * l * block, "{what}");
        assert_eq!(window.scattered, rest, "{what}: the runs outside, at once");
        assert_eq!(
            window.waits as u64, window.marks,
            "{what}: every mark waited for"
        );
        // After the update every slot is stale: the evaluation gathers block 0 at once and
        // starts the other five.
        assert_eq!(evaluated.gathered - window.gathered, block, "{what}");
        assert_eq!(
            evaluated.gathers_started - window.gathers_started,
            5 * block
        );
    }
    for (rank, (window, _)) in traffic(Strategy::Zero2).into_iter().enumerate() {
        let what = format!("ZeRO-2, rank {rank} of 2");
        // Its update gathers the whole compute copy, at once.
        assert_eq!(
            (window.gathered, window.gathers_started),
            (g.offsets.end(), 0),
            "{what}"
        );
        assert_eq!(window.scatters_started, 2 * 6 * block, "{what}");
        assert_eq!(window.waits as u64, window.marks, "{what}");
    }
}

/// ZeRO-3 with its shard of the compute copy in host memory (FSDP's `FULL_SHARD` with
/// `CPUOffload(offload_params=True)`, DeepSpeed's stage 3 with `offload_param`): each
/// gather stages this rank's piece up from the host, and the offloaded optimizer writes
/// the shard in place. It trains ZeRO-3's weights with the optimizer offloaded, bit for
/// bit, at 1, 2 and 3 ranks in f32, bf16 and f16 under a loss scale; with six blocks at
/// 2 and 3 ranks it holds on the backend what is planned, the shard's bytes fewer; and
/// it needs the optimizer offloaded.
#[test]
fn zero3_with_its_shard_on_the_host_is_zero3_offloaded_bit_for_bit() {
    let zero3 = |base: StepOptions| (Strategy::Zero3Offload, base);
    let (opt, clip) = (Optimizer::AdamW, Some(0.05));
    for world in [1, 2, 3] {
        let run = |base: StepOptions, dtype: &str| {
            run_local(world, DEFAULT_TIMEOUT, |comm| match dtype {
                "f32" => train_with::<f32, _>(&comm, zero3(base), opt, rule(clip), None),
                "bf16" => train_with::<half::bf16, _>(&comm, zero3(base), opt, rule(clip), None),
                _ => {
                    let scaled = stoker_gpu::parallel::GradRule {
                        clip,
                        loss_scale: Some(4096.0),
                    };
                    train_with::<half::f16, _>(&comm, zero3(base), opt, scaled, None)
                }
            })
        };
        for dtype in ["f32", "bf16", "f16"] {
            let what = format!("{dtype} over {world} ranks, the shard on the host");
            let want = run(StepOptions::default(), dtype);
            let got = run(OFFLOAD, dtype);
            for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.0, w.0, "{what}: rank {rank}'s window reports");
                assert_bits_eq(&g.2, &w.2, &format!("{what}: rank {rank}'s master"));
                assert_bits_eq(&g.3, &w.3, &format!("{what}: rank {rank}'s shard"));
            }
        }
    }
    let dims = GptDims { n_layer: 6, ..DIMS };
    let g = gpt(&dims, SEED, 0.2);
    let end = g.offsets.end();
    for world in [2, 3] {
        let bytes = run_local(world, DEFAULT_TIMEOUT, |comm| {
            let rank_world = (comm.rank(), comm.world_size());
            let make = |base: StepOptions| {
                let opts = Strategy::Zero3Offload.step_options(base, rank_world);
                let step = GptGpuStep::<Host, half::bf16>::with_options(
                    &Host,
                    dims,
                    g.offsets.clone(),
                    1e-5,
                    (B, T),
                    opts,
                )
                .unwrap();
                let planned = stoker_gpu::step::gpt::gpt_step_sizes(&dims, end, (B, T), opts);
                (
                    step.buffers().bytes(),
                    planned.bytes(2),
                    planned.sharded.unwrap().shard,
                )
            };
            let (on_host, kept) = (make(OFFLOAD), make(StepOptions::default()));
            // Without the optimizer offloaded the host's shard has no writer: refused.
            let opts = Strategy::Zero3.step_options(OFFLOAD, rank_world);
            let step = GptGpuStep::<Host, f32>::with_options(
                &Host,
                dims,
                g.offsets.clone(),
                1e-5,
                (B, T),
                opts,
            )
            .unwrap();
            let segs = stoker_gpu::sample::segments(&stoker_kernels::gpt_params(&dims), &g.ranges);
            let e = Replica::new(
                &Host,
                step,
                (Strategy::Zero3, Optimizer::AdamW),
                &g.params,
                &segs,
                rank_world,
            )
            .err()
            .map(|e| e.to_string());
            (on_host, kept, e)
        });
        for (r, (on_host, kept, e)) in bytes.into_iter().enumerate() {
            let what = format!("rank {r} of {world}");
            assert_eq!(on_host.0, on_host.1, "{what}: counted and planned");
            assert_eq!(
                kept.0 - on_host.0,
                2 * kept.2,
                "{what}: the shard's bf16 bytes"
            );
            let e = e.expect("the shard on the host without the optimizer offloaded");
            assert!(e.contains("Zero3Offload"), "{what}: {e}");
        }
    }
}

/// One rank needs no collective: ZeRO-1, -2 and -3 windows at one rank, and an
/// evaluation, make no call on the communicator (a single GPU's ZeRO copies nothing
/// through the host), and train what DDP trains there.
#[test]
fn one_rank_calls_no_collective() {
    let run = |strategy: Strategy| {
        run_local(1, DEFAULT_TIMEOUT, |comm| {
            let replica = replica_for::<f32>(&comm, strategy);
            let coll = ThroughHost(&comm);
            for w in 0..2 {
                let data = window(w);
                let mine: Vec<TokenBatch> = data.iter().map(batch).collect();
                let s = scalars(Optimizer::AdamW, w as u64 + 1);
                replica
                    .window(&Host, &coll, &mine, &s, rule(Some(0.05)))
                    .unwrap();
            }
            let e = replica
                .evaluate(&Host, &coll, batch(&window(2)[0]))
                .unwrap();
            let master = replica.state().master(&Host).unwrap().1;
            (comm.stats().calls(), master, e)
        })
        .remove(0)
    };
    let ddp = run(Strategy::Ddp);
    for strategy in [Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
        let (calls, master, e) = run(strategy);
        assert_eq!(calls, 0, "{strategy:?}: calls on a group of one");
        assert_close(&master, &ddp.1, 1e-6, &format!("{strategy:?}: master"));
        assert_eq!(e.2, ddp.2 .2, "{strategy:?}: evaluated targets");
    }
}
