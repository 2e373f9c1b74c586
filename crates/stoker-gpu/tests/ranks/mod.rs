//! What the resident-training tests share: a tiny GPT, its windows of micro-batches
//! (each ignoring a different count of targets), the optimizers' scalars, a replica per
//! strategy, and N in-process ranks training it.

// Each test file uses some of these.
#![allow(dead_code)]

use std::ops::Range;

use stoker_comm::{run_local, Communicator, DEFAULT_TIMEOUT};
use stoker_gpu::parallel::{GradRule, Replica, Strategy, ThroughHost};
use stoker_gpu::sample::{batch, gpt, ids, Ranges};
use stoker_gpu::step::optimizer::{Optimizer, Scalars};
use stoker_gpu::step::options::StepOptions;
use stoker_gpu::step::{GptGpuStep, TokenBatch};
use stoker_gpu::{Act, Backend, Host};
use stoker_kernels::{AdamWStep, GptDims, SgdStep};
use stoker_testkit::assert_close;

pub const DIMS: GptDims = GptDims {
    vocab: 53,
    context: 8,
    d_model: 16,
    n_layer: 2,
    n_head: 2,
};
/// Sequences of one micro-batch, positions of each.
pub const B: usize = 2;
pub const T: usize = 8;
/// Micro-batches of a window over all ranks (6: 1, 2 and 3 ranks share it evenly).
pub const MICRO: usize = 6;
pub const WINDOWS: usize = 3;
pub const SEED: u64 = 40;

/// A window's micro-batches: tokens and targets of each; micro-batch `k` ignores `k`
/// targets, so the ranks' counts differ.
pub fn window(w: usize) -> Vec<(Vec<i64>, Vec<i64>)> {
    (0..MICRO)
        .map(|k| {
            let seed = 1000 + 10 * (w * MICRO + k) as u64;
            let tokens: Vec<i64> = ids(B * T, seed, DIMS.vocab)
                .iter()
                .map(|&x| x as i64)
                .collect();
            let mut targets: Vec<i64> = ids(B * T, seed + 1, DIMS.vocab)
                .iter()
                .map(|&x| x as i64)
                .collect();
            targets.iter_mut().take(k).for_each(|t| *t = -1);
            (tokens, targets)
        })
        .collect()
}

/// Segments as stoker-train makes them: weight decay on tensors of rank >= 2.
pub fn segments(ranges: &Ranges) -> Vec<(Range<usize>, bool)> {
    stoker_gpu::sample::segments(&stoker_kernels::gpt_params(&DIMS), ranges)
}

/// The step's options `strategy` runs with on rank `rank_world.0` of `rank_world.1`:
/// ZeRO-2's gradients in slots, ZeRO-3's parameters sharded.
pub fn options_for(strategy: Strategy, rank_world: (usize, usize)) -> StepOptions {
    strategy.step_options(StepOptions::default(), rank_world)
}

/// Clipping to `clip`, no loss scale.
pub fn rule(clip: Option<f64>) -> GradRule {
    GradRule {
        clip,
        loss_scale: None,
    }
}

pub fn scalars(opt: Optimizer, t: u64) -> Scalars {
    match opt {
        Optimizer::AdamW => Scalars::AdamW(AdamWStep::new(3e-3, 0.9, 0.95, 1e-8, 0.1, t)),
        Optimizer::Sgd { .. } => Scalars::Sgd(SgdStep {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.01,
            nesterov: false,
            first: t == 1,
        }),
    }
}

/// What one rank ends with: each window's report (loss, tokens, norm), its master range
/// and values, its compute copy (under ZeRO-3 its shard of it: [`compute_copy`]).
pub type RankEnd = (Vec<(f64, u64, f64)>, Range<usize>, Vec<f32>, Vec<f32>);

/// `WINDOWS` windows of rank `comm.rank()`'s share of the micro-batches.
pub fn train<T: Act, C: Communicator>(
    comm: &C,
    strategy: Strategy,
    opt: Optimizer,
    rule: GradRule,
    round_seed: Option<u64>,
) -> RankEnd {
    train_with::<T, C>(
        comm,
        (strategy, StepOptions::default()),
        opt,
        rule,
        round_seed,
    )
}

/// [`train`] with the step made from `base` (what the strategy needs added).
pub fn train_with<T: Act, C: Communicator>(
    comm: &C,
    (strategy, base): (Strategy, StepOptions),
    opt: Optimizer,
    rule: GradRule,
    round_seed: Option<u64>,
) -> RankEnd {
    train_on::<Host, T, C>(&Host, comm, (strategy, base), opt, rule, round_seed).0
}

/// [`train_with`] on backend `be`; the replica too, as it ended.
pub fn train_on<Be: Backend, T: Act, C: Communicator>(
    be: &Be,
    comm: &C,
    (strategy, base): (Strategy, StepOptions),
    opt: Optimizer,
    rule: GradRule,
    round_seed: Option<u64>,
) -> (RankEnd, Replica<Be, GptGpuStep<Be, T>>) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut replica = replica_on::<Be, T>(be, (strategy, base), opt, (rank, world)).unwrap();
    if let Some(seed) = round_seed {
        replica = replica.with_stochastic_rounding(seed).unwrap();
    }
    let coll = ThroughHost(comm);
    let per = MICRO / world;
    let mut reports = Vec::new();
    for w in 0..WINDOWS {
        let data = window(w);
        let mine: Vec<TokenBatch> = data[rank * per..(rank + 1) * per]
            .iter()
            .map(batch)
            .collect();
        let r = replica
            .window(be, &coll, &mine, &scalars(opt, w as u64 + 1), rule)
            .unwrap();
        reports.push((r.loss, r.tokens, r.grad_norm));
    }
    let (range, master) = replica.state().master(be).unwrap();
    let copy = compute_copy_on(be, &replica);
    ((reports, range, master, copy), replica)
}

/// Rank `rank_world.0`'s replica of the tiny GPT under `strategy` (its step made from
/// `base` with what the strategy needs added) with optimizer `opt`.
pub fn replica<T: Act>(
    (strategy, base): (Strategy, StepOptions),
    opt: Optimizer,
    rank_world: (usize, usize),
) -> Result<Replica<Host, GptGpuStep<Host, T>>, stoker_gpu::GpuError> {
    replica_on::<Host, T>(&Host, (strategy, base), opt, rank_world)
}

/// [`replica`] on backend `be`.
pub fn replica_on<Be: Backend, T: Act>(
    be: &Be,
    (strategy, base): (Strategy, StepOptions),
    opt: Optimizer,
    rank_world: (usize, usize),
) -> Result<Replica<Be, GptGpuStep<Be, T>>, stoker_gpu::GpuError> {
    let g = gpt(&DIMS, SEED, 0.2);
    let step = GptGpuStep::<Be, T>::with_options(
        be,
        DIMS,
        g.offsets.clone(),
        1e-5,
        (B, T),
        strategy.step_options(base, rank_world),
    )?;
    Replica::new(
        be,
        step,
        (strategy, opt),
        &g.params,
        &segments(&g.ranges),
        rank_world,
    )
}

/// A replica's compute copy, widened to f32: the whole, or under ZeRO-3 its shard.
pub fn compute_copy<A: Act>(replica: &Replica<Host, GptGpuStep<Host, A>>) -> Vec<f32> {
    compute_copy_on(&Host, replica)
}

/// [`compute_copy`] on backend `be`.
pub fn compute_copy_on<Be: Backend, A: Act>(
    be: &Be,
    replica: &Replica<Be, GptGpuStep<Be, A>>,
) -> Vec<f32> {
    let bufs = replica.step().buffers();
    match bufs.sharded() {
        Some(s) => s.shard_values(be).unwrap(),
        None => bufs.params(be).unwrap(),
    }
}

pub fn ranks<T: Act>(
    world: usize,
    strategy: Strategy,
    opt: Optimizer,
    clip: Option<f64>,
) -> Vec<RankEnd> {
    ranks_rounded::<T>(world, strategy, opt, clip, None)
}

pub fn ranks_rounded<T: Act>(
    world: usize,
    strategy: Strategy,
    opt: Optimizer,
    clip: Option<f64>,
    round_seed: Option<u64>,
) -> Vec<RankEnd> {
    run_local(world, DEFAULT_TIMEOUT, |comm| {
        train::<T, _>(&comm, strategy, opt, rule(clip), round_seed)
    })
}

/// [`ranks`] with AdamW under fp16's loss scale `scale`.
pub fn ranks_scaled<T: Act>(
    world: usize,
    strategy: Strategy,
    clip: Option<f64>,
    scale: f32,
) -> Vec<RankEnd> {
    let rule = GradRule {
        clip,
        loss_scale: Some(scale),
    };
    run_local(world, DEFAULT_TIMEOUT, |comm| {
        train::<T, _>(&comm, strategy, Optimizer::AdamW, rule, None)
    })
}

/// The whole master from every rank's piece (checking that the pieces tile it).
pub fn assemble(ends: &[RankEnd]) -> Vec<f32> {
    let mut all = Vec::new();
    for (_, range, master, _) in ends {
        assert_eq!(
            range.start,
            all.len(),
            "the shards tile the buffer in rank order"
        );
        assert_eq!(range.len(), master.len());
        all.extend_from_slice(master);
    }
    all
}

/// `got` against `want` parameter by parameter, within `rel`. The attention key bias's
/// true gradient is 0 (the softmax ignores a shift of a query's scores), so what reaches
/// it is rounding noise, which AdamW turns into steps of about lr: its key third is only
/// bounded by the steps taken.
pub fn assert_weights(got: &[f32], want: &[f32], rel: f64, what: &str) {
    let g = gpt(&DIMS, SEED, 0.2);
    let c = DIMS.d_model;
    for (name, r) in &g.ranges {
        if name.ends_with("attn.qkv.bias") {
            let k = r.start + c..r.start + 2 * c;
            let moved: Vec<f32> = k.clone().map(|i| got[i] - want[i]).collect();
            let moved = stoker_testkit::max_abs(&moved);
            assert!(
                moved <= 2.0 * WINDOWS as f64 * 3e-3,
                "{what}: {name} (k) differs by {moved}"
            );
            for rr in [r.start..r.start + c, r.start + 2 * c..r.end] {
                assert_close(&got[rr.clone()], &want[rr], rel, &format!("{what}: {name}"));
            }
            continue;
        }
        assert_close(
            &got[r.clone()],
            &want[r.clone()],
            rel,
            &format!("{what}: {name}"),
        );
    }
}

pub fn replica_for<A: Act>(
    comm: &impl Communicator,
    strategy: Strategy,
) -> Replica<Host, GptGpuStep<Host, A>> {
    replica_of::<A>(comm, strategy, DIMS)
}

/// [`replica_for`] of a GPT of `dims`.
pub fn replica_of<A: Act>(
    comm: &impl Communicator,
    strategy: Strategy,
    dims: GptDims,
) -> Replica<Host, GptGpuStep<Host, A>> {
    let g = gpt(&dims, SEED, 0.2);
    let step = GptGpuStep::<Host, A>::with_options(
        &Host,
        dims,
        g.offsets.clone(),
        1e-5,
        (B, T),
        options_for(strategy, (comm.rank(), comm.world_size())),
    )
    .unwrap();
    Replica::new(
        &Host,
        step,
        (strategy, Optimizer::AdamW),
        &g.params,
        &stoker_gpu::sample::segments(&stoker_kernels::gpt_params(&dims), &g.ranges),
        (comm.rank(), comm.world_size()),
    )
    .unwrap()
}

/// A three-block Llama with grouped-query attention (4 heads over 2).
pub const LLAMA3: stoker_kernels::LlamaDims = stoker_kernels::LlamaDims {
    vocab: 53,
    context: 8,
    d_model: 16,
    n_layer: 3,
    n_head: 4,
    n_kv_head: 2,
    ffn_hidden: 24,
};

/// A step's options with the blocks' parameters offloaded.
pub const OFFLOAD: StepOptions = StepOptions {
    offload_params: true,
    recompute_attention: false,
    recompute_mlp: false,
    grads_in_slots: false,
    shard_params: None,
    graph_micro_batches: false,
    flash_attention: false,
    fp8_linears: false,
};

/// Three blocks: block 0's slot is block 2's in the forward, so the backward must bring
/// block 0's parameters back.
pub const DIMS3: GptDims = GptDims { n_layer: 3, ..DIMS };

/// [`segments`] of a GPT of [`DIMS3`].
pub fn segments3(ranges: &Ranges) -> Vec<(Range<usize>, bool)> {
    stoker_gpu::sample::segments(&stoker_kernels::gpt_params(&DIMS3), ranges)
}
