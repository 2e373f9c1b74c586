//! The resident training loop on the GPU against the same loop on the host backend: a
//! small GPT, three windows of two micro-batches, DDP (also in deterministic mode), ZeRO-1
//! to -3 and one rank with its blocks' parameters offloaded, f32, bf16 and f16
//! (under a loss scale, after a window whose overflow must be skipped), the
//! GPU's collectives NCCL on device memory at one rank (ZeRO-1's reduce-scatter,
//! all-gather and scalar sums all run through NCCL), the host's through an in-process
//! communicator; then 2 ranks on the one GPU against 1. What `stoker bench gpu-kernels
//! --step` prints after the step check. One GPU cannot host two NCCL ranks (NCCL refuses
//! a device twice in one communicator), so NCCL's grouped paths for uneven pieces, and
//! DDP's all-reduce beyond the probe below, wait for a machine with several GPUs; the
//! 2 ranks here meet through host memory.

use half::bf16;
use std::ops::Range;
use std::sync::Mutex;

use stoker_comm::{local_group, run_local, DEFAULT_TIMEOUT};
use stoker_kernels::AdamWStep;

use super::check::max_abs;
use super::nccl::DeviceNccl;
use super::Device;
use crate::backend::Backend;
use crate::error::GpuError;
use crate::parallel::{Collectives, GradRule, Replica, Strategy, ThroughHost};
use crate::step::optimizer::{Optimizer, Scalars};
use crate::step::options::StepOptions;
use crate::step::{GptGpuStep, TokenBatch};
use crate::{Act, Dtype, Host};

/// One configuration's loop on both backends.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaCompared {
    /// `ddp f32`, `zero-1 bf16`, ...
    pub what: String,
    /// The last window's loss, relative difference.
    pub loss_rel: f64,
    /// The master after the windows: largest difference over the largest value.
    pub master_rel: f64,
}

/// Three blocks: with the parameters offloaded, the backward brings the first back.
const DIMS: stoker_kernels::GptDims = stoker_kernels::GptDims {
    vocab: 71,
    context: 16,
    d_model: 32,
    n_layer: 3,
    n_head: 4,
};

/// The windows' micro-batches: 3 windows of 2, each 3 x 11, a few targets ignored.
fn windows() -> Vec<Vec<(Vec<i64>, Vec<i64>)>> {
    (0..3)
        .map(|w| {
            (0..2)
                .map(|k| {
                    let seed = 500 + 10 * (2 * w + k) as u64;
                    let draw = |s| -> Vec<i64> {
                        crate::sample::ids(33, s, DIMS.vocab)
                            .iter()
                            .map(|&x| x as i64)
                            .collect()
                    };
                    let mut targets = draw(seed + 1);
                    targets.iter_mut().take(k + 1).for_each(|t| *t = -1);
                    (draw(seed), targets)
                })
                .collect()
        })
        .collect()
}

/// One configuration of the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// The strategy.
    pub strategy: Strategy,
    /// The blocks' parameters in host memory.
    pub offload_params: bool,
    /// Deterministic mode's trees of sums.
    pub deterministic: bool,
}

impl Run {
    /// `strategy` with nothing else.
    pub fn of(strategy: Strategy) -> Self {
        Run {
            strategy,
            offload_params: false,
            deterministic: false,
        }
    }
}

/// The loop on `be` with `coll` (its rank taking its share of each window's two
/// micro-batches): the last window's loss, and this rank's range of the master and its
/// values. f16 runs under fp16's loss scale, after a first window at a scale that must
/// overflow and be skipped.
fn train<B: Backend, T: Act>(
    be: &B,
    coll: &impl Collectives<B>,
    Run {
        strategy,
        offload_params,
        deterministic,
    }: Run,
) -> Result<(f64, Range<usize>, Vec<f32>), GpuError> {
    let g = crate::sample::gpt(&DIMS, 100, 0.2);
    let segments: Vec<_> = crate::sample::segments(&stoker_kernels::gpt_params(&DIMS), &g.ranges);
    let (rank, world) = (coll.rank(), coll.world());
    let opts = strategy.step_options(
        StepOptions {
            offload_params,
            ..StepOptions::default()
        },
        (rank, world),
    );
    let step = GptGpuStep::<B, T>::with_options(be, DIMS, g.offsets.clone(), 1e-5, (3, 11), opts)?;
    let replica = Replica::new(
        be,
        step,
        (strategy, Optimizer::AdamW),
        &g.params,
        &segments,
        (rank, world),
    )?;
    let per = 2 / world;
    // Deterministic mode's trees; a chunk of 1,000 elements so the tree over ranks takes
    // several rounds.
    let replica = match deterministic {
        true => replica.with_deterministic(be, per, world, 1000)?,
        false => replica,
    };
    let mut loss = 0.0;
    let fp16 = T::DTYPE == Dtype::F16;
    let rule = |loss_scale: f32| GradRule {
        clip: Some(0.5),
        loss_scale: fp16.then_some(loss_scale),
    };
    // This rank's share of a window's micro-batches.
    let mine = |micro: &'_ [(Vec<i64>, Vec<i64>)]| -> Vec<(Vec<i64>, Vec<i64>)> {
        micro[rank * per..(rank + 1) * per].to_vec()
    };
    if fp16 {
        let micro = mine(&windows()[0]);
        let batches: Vec<TokenBatch> = micro.iter().map(crate::sample::batch).collect();
        let adam = AdamWStep::new(3e-3, 0.9, 0.95, 1e-8, 0.1, 1);
        let r = replica.window(be, coll, &batches, &Scalars::AdamW(adam), rule(1e9))?;
        if !r.skipped {
            return Err(GpuError::Driver {
                what: "an f16 window at loss scale 1e9".into(),
                error: format!("was not skipped (norm {})", r.grad_norm),
            });
        }
    }
    for (w, micro) in windows().iter().enumerate() {
        let micro = mine(micro);
        let batches: Vec<TokenBatch> = micro.iter().map(crate::sample::batch).collect();
        let adam = AdamWStep::new(3e-3, 0.9, 0.95, 1e-8, 0.1, w as u64 + 1);
        loss = replica
            .window(be, coll, &batches, &Scalars::AdamW(adam), rule(4096.0))?
            .loss;
    }
    let (range, master) = replica.state().master(be)?;
    Ok((loss, range, master))
}

/// `got` against `want`: the loss's relative difference, and the master's largest
/// difference over its largest value.
fn compared(what: String, want: (f64, &[f32]), got: (f64, &[f32])) -> ReplicaCompared {
    let scale = max_abs(want.1).max(f64::MIN_POSITIVE);
    let diff: Vec<f32> = want.1.iter().zip(got.1).map(|(a, b)| a - b).collect();
    ReplicaCompared {
        what,
        loss_rel: (got.0 - want.0).abs() / want.0.abs(),
        master_rel: max_abs(&diff) / scale,
    }
}

/// Every configuration on both backends. The products differ (cuBLAS against the
/// host's), so this is a tolerance: f32 near 1e-5, bf16 near 1e-2, f16 near 1e-3.
pub fn compare_replica(dev: &Device) -> Result<Vec<ReplicaCompared>, GpuError> {
    let host_comm = local_group(1, DEFAULT_TIMEOUT).remove(0);
    let host = ThroughHost(&host_comm);
    let nccl = DeviceNccl::join(dev, &local_group(1, DEFAULT_TIMEOUT).remove(0))?;
    // DDP skips its all-reduces at one rank (whole, and its buckets on NCCL's own
    // stream): each runs once here, so that the calls run (at one rank they leave the
    // values as they are, so a missing wait between the streams would not show: that
    // needs two GPUs).
    let values = [1.0f32, -2.0, 3.5];
    let probe = dev.upload(&values)?;
    nccl.all_reduce(dev, dev.all(&probe))?;
    // SAFETY: nothing writes `probe` before `finish`, and it lives past the download.
    unsafe {
        nccl.start_all_reduce(dev, dev.view(&probe, 0..2)?)?;
        nccl.start_all_reduce(dev, dev.view(&probe, 2..3)?)?;
    }
    nccl.finish(dev)?;
    if dev.download(&probe)? != values {
        return Err(GpuError::Driver {
            what: "NCCL's all-reduce at one rank".into(),
            error: "changed the values".into(),
        });
    }
    // FP8's amax all-reduce (a max over the values' bits as u32) at one rank: the values
    // as they were, a NaN and an infinity included.
    let amaxes = [0.0f32, 2.5, f32::INFINITY, f32::NAN];
    let probe = dev.upload(&amaxes)?;
    nccl.max_of_amaxes(dev, dev.all(&probe))?;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    if bits(&dev.download(&probe)?) != bits(&amaxes) {
        return Err(GpuError::Driver {
            what: "NCCL's max of amaxes at one rank".into(),
            error: "changed the values".into(),
        });
    }
    let mut out = Vec::new();
    let params_off = |strategy| Run {
        offload_params: true,
        ..Run::of(strategy)
    };
    for (run, name) in [
        (Run::of(Strategy::Ddp), "ddp"),
        (Run::of(Strategy::Zero1), "zero-1"),
        (Run::of(Strategy::Zero2), "zero-2"),
        // The compute copy sharded, each block gathered into a slot (NCCL's all-gather
        // at one rank).
        (Run::of(Strategy::Zero3), "zero-3"),
        // The blocks' parameters offloaded (two slots on the device, the update on the
        // host): against the host build's same loop.
        (params_off(Strategy::Offload), "params-off"),
        // ZeRO-3's shard in host memory, each gather staging this rank's piece up.
        (params_off(Strategy::Zero3Offload), "zero-3 params-off"),
        // Deterministic mode's trees (at one rank: the micro-batches' tree alone).
        (
            Run {
                deterministic: true,
                ..Run::of(Strategy::Ddp)
            },
            "ddp deterministic",
        ),
    ] {
        for dtype in ["f32", "bf16", "f16"] {
            let (h, d) = match dtype {
                "f32" => (
                    train::<Host, f32>(&Host, &host, run)?,
                    train::<Device, f32>(dev, &nccl, run)?,
                ),
                "bf16" => (
                    train::<Host, bf16>(&Host, &host, run)?,
                    train::<Device, bf16>(dev, &nccl, run)?,
                ),
                _ => (
                    train::<Host, half::f16>(&Host, &host, run)?,
                    train::<Device, half::f16>(dev, &nccl, run)?,
                ),
            };
            out.push(compared(
                format!("{name} {dtype}"),
                (h.0, &h.2),
                (d.0, &d.2),
            ));
        }
    }
    Ok(out)
}

/// The loop at 2 ranks on GPU `ordinal` as `run` says (threads of this process, each
/// with its own [`Device`] on the one GPU, through an in-process communicator on host
/// memory: what a GPU job over MPI runs) against 1 rank on the same GPU, f32: the same
/// weights within f32 rounding of the sums, or in deterministic mode bit for bit.
pub fn compare_replica_ranks(ordinal: usize, run: Run) -> Result<ReplicaCompared, GpuError> {
    let one_dev = Device::new(ordinal)?;
    let one_comm = local_group(1, DEFAULT_TIMEOUT).remove(0);
    let baseline = Run {
        deterministic: run.deterministic,
        ..Run::of(Strategy::Ddp)
    };
    let one = train::<Device, f32>(&one_dev, &ThroughHost(&one_comm), baseline)?;
    // Made here, one after the other (each disables the context's event tracking before
    // any buffer of its own exists), then handed to the ranks' threads.
    let devices = (0..2)
        .map(|_| Device::new(ordinal))
        .collect::<Result<Vec<_>, _>>()?;
    let devices = Mutex::new(devices);
    let ranks = run_local(2, DEFAULT_TIMEOUT, |comm| {
        let dev = devices
            .lock()
            .map_err(|_| GpuError::Driver {
                what: "taking a rank's device".into(),
                error: "a rank's thread panicked".into(),
            })?
            .pop();
        let dev = dev.ok_or_else(|| GpuError::Driver {
            what: "taking a rank's device".into(),
            error: "none left".into(),
        })?;
        train::<Device, f32>(&dev, &ThroughHost(&comm), run)
    });
    let mut master = Vec::new();
    let mut loss = 0.0;
    for r in ranks {
        let (l, range, piece) = r?;
        if range.start != master.len() {
            return Err(GpuError::Shape {
                kernel: "replica-check",
                what: format!("shard {range:?} after {} elements", master.len()),
            });
        }
        master.extend_from_slice(&piece);
        loss = l;
    }
    Ok(compared(
        format!(
            "{:?}{} f32, 2 ranks vs 1",
            run.strategy,
            if run.deterministic {
                " deterministic"
            } else {
                ""
            }
        ),
        (one.0, &one.2),
        (loss, &master),
    ))
}
