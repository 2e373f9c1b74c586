//! The resident loop behind the trainer (`step = "resident"` under one rank, DDP or
//! ZeRO-1 to -3): stoker-gpu's [`Replica`] (the step, the FP32 master, the optimizer's moments
//! and the reductions, all on the step's backend) fed the trainer's micro-batches. The
//! trainer keeps its schedule, loader, evaluation calls and checkpoints; the master and
//! the moments cross to the host only when it asks for them ([`ResidentRun::state`]).
//!
//! One loop per backend: the host build on a CPU (what the tests run), the device on a
//! GPU (`cuda` feature). Both run the same calls.

use std::ops::Range;
use std::rc::Rc;

use candle_core::Tensor;
use stoker_comm::Communicator;
use stoker_gpu::fp8::ScalerValues;
use stoker_gpu::parallel::{
    Collectives, GradRule, Replica, Strategy as GpuStrategy, Trainable, WindowReport,
};
use stoker_gpu::step::optimizer::{Optimizer as GpuOptimizer, Scalars};
use stoker_gpu::step::options::StepOptions;
use stoker_gpu::step::token_step::MakeStep;
use stoker_gpu::step::TokenBatch;
use stoker_gpu::Backend;

use crate::error::{Result, TrainError};
use crate::loss::IGNORE_INDEX;

/// One micro-batch as a resident loop takes it: token ids `(B, T)` and their targets
/// (the trainer's `MicroBatch`, borrowed: this module sits below the accumulation's).
pub type TokenIds<'a> = (&'a Tensor, &'a [i64]);

/// What the trainer asks of a resident loop, whatever its backend and model.
pub trait ResidentRun {
    /// One accumulation window of this rank's micro-batches (every rank passes as many),
    /// the reductions over the ranks, and the optimizer's update with `scalars`, the mean
    /// gradient clipped and fp16's loss scale applied as `rule` says (the update skipped,
    /// on every rank, where the scaled gradients overflowed).
    fn window(
        &mut self,
        window: &[TokenIds<'_>],
        scalars: &Scalars,
        rule: GradRule,
    ) -> Result<WindowReport>;
    /// One micro-batch's evaluation: the summed loss of its valid targets, how many are
    /// the top-1 logit, how many there are.
    fn evaluate(&mut self, mb: TokenIds<'_>) -> Result<(f64, usize, usize)>;
    /// The range of the flat buffer this rank's master covers (all of it, or its ZeRO-1
    /// shard), its values, and the optimizer's buffers over it, named as a checkpoint
    /// names them.
    fn state(&self) -> Result<ResidentState>;
    /// The range of the flat buffer this rank's master covers.
    fn range(&self) -> Range<usize>;
    /// Sets the whole flat master (the same on every rank) and the optimizer's buffers
    /// over this rank's range, `updates` updates into the run.
    fn load(&mut self, master: &[f32], moments: &[(&str, &[f32])], updates: u64) -> Result<()>;
    /// Bytes the loop holds on its backend, counted from its buffers: the master, moments
    /// (and ZeRO-1's shard of gradients); and every step's buffers (parameters,
    /// gradients, activations, ids), the running one's and those kept for other shapes.
    fn bytes(&self) -> ResidentBytes;
    /// Device memory the loop has taken since its GPU was opened, as the driver reports
    /// it (its buffers, NCCL's communicator, cuBLAS's workspace and whatever the first
    /// launches made); None on the host. The steps allocate nothing once made, so this is
    /// also the peak.
    fn measured_bytes(&self) -> Option<usize>;
    /// The FP8 scalers' values (three per linear layer, in the step's order) where the
    /// linear layers run in FP8; None otherwise.
    fn fp8_values(&self) -> Result<Option<Vec<ScalerValues>>>;
    /// Sets the FP8 scalers' values (a checkpoint's), where the layers run in FP8.
    fn load_fp8(&mut self, values: &[ScalerValues]) -> Result<()>;
}

/// What a resident loop holds on its backend: see [`ResidentRun::bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResidentBytes {
    /// The FP32 master and the optimizer's buffers (ZeRO-1: this rank's shard, and its
    /// shard of gradients; in deterministic mode with its tree's sums).
    pub state: usize,
    /// The steps' buffers.
    pub steps: usize,
    /// Host memory an offload holds (not on the backend, so in no total): the offloaded
    /// master and moments and the buffers the updates copy through, the offloaded
    /// parameters' host copy, gradient sum and landing slots, pinned where copies read
    /// or write them.
    pub host: usize,
}

impl ResidentBytes {
    /// Both (on the backend).
    pub fn total(&self) -> usize {
        self.state + self.steps
    }
}

/// A resident loop's state read back: see [`ResidentRun::state`].
pub struct ResidentState {
    /// The range of the flat buffer the master covers.
    pub range: Range<usize>,
    /// Its values.
    pub master: Vec<f32>,
    /// The optimizer's buffers over it.
    pub moments: Vec<(&'static str, Vec<f32>)>,
}

/// Which strategy and optimizer a resident loop runs, for which rank, from which master.
pub struct RunSetup<'a> {
    /// DDP (one rank too) or ZeRO-1, -2 or -3, offloaded or not.
    pub strategy: GpuStrategy,
    /// AdamW or SGD.
    pub optimizer: GpuOptimizer,
    /// The initial whole flat master, the same on every rank.
    pub master: &'a [f32],
    /// The optimizer's segments of the flat buffer with their weight-decay flags.
    pub segments: Vec<(Range<usize>, bool)>,
    /// This rank and the ranks in all.
    pub rank_world: (usize, usize),
    /// The ranks' communicator (a one-rank group where there is none): the loop's
    /// collectives go through it, or, on GPUs of ranks launched as processes, through
    /// NCCL on device memory, whose id it carries.
    pub comm: Rc<dyn Communicator>,
    /// The training micro-batch's shape: sequences and positions.
    pub shape: (usize, usize),
    /// Where the loop runs.
    pub on: ResidentOn,
    /// How the steps are made: the blocks' parameters offloaded to host memory (one
    /// rank, the optimizer offloaded: the replica refuses anything else), attention
    /// recomputed in the backward.
    pub options: StepOptions,
    /// Deterministic mode's windows of at most this many micro-batches (its trees of
    /// sums), or the default windows.
    pub deterministic: Option<usize>,
}

impl RunSetup<'_> {
    /// The options its steps are made with: the config's, and what the strategy's step
    /// needs on this rank (ZeRO-2's gradient slots, ZeRO-3's shard).
    pub fn step_options(&self) -> StepOptions {
        self.strategy.step_options(self.options, self.rank_world)
    }
}

/// The backend a resident loop runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResidentOn {
    /// The host build, on this CPU.
    Host,
    /// A GPU (the `cuda` feature).
    Cuda {
        /// Its index.
        gpu: usize,
        /// Whether it is this rank's own (`device = "cuda"`: the rank's index on its
        /// host) rather than one the config names for every rank (`cuda:N`), which ranks
        /// launched as processes would share: NCCL needs a GPU per rank.
        own: bool,
    },
}

fn gpu_err(what: &str) -> impl FnOnce(stoker_gpu::GpuError) -> TrainError + '_ {
    move |e| TrainError::Strategy(format!("the resident step ({what}): {e}"))
}

/// A [`ResidentRun`] on backend `B` with steps of type `S` (one per batch shape met) and
/// collectives `C`.
///
/// Fields drop in order: the steps' buffers and the collectives before the backend they
/// run on.
pub(crate) struct ResidentLoop<B: Backend, S: Trainable<B>, C: Collectives<B>> {
    replica: Replica<B, S>,
    /// The running step's shape.
    shape: (usize, usize),
    /// Steps made for other shapes, kept for the next time one comes.
    spare: Vec<((usize, usize), S)>,
    make: MakeStep<B, S>,
    /// The backend's free memory before the loop made its buffers (a device's).
    free_at_start: Option<usize>,
    coll: C,
    be: B,
}

impl<B: Backend, S: Trainable<B>, C: Collectives<B>> ResidentLoop<B, S, C> {
    /// The loop of `setup` on `be` with collectives `coll`, its steps made by `make`;
    /// `free_at_start` the device's free memory before anything of the loop's was made
    /// (None on the host).
    pub(crate) fn new(
        be: B,
        coll: C,
        make: MakeStep<B, S>,
        setup: &RunSetup<'_>,
        free_at_start: Option<usize>,
    ) -> Result<Self> {
        let (b, t) = setup.shape;
        let step = make(&be, b, t).map_err(gpu_err("making the step"))?;
        let replica = Replica::new(
            &be,
            step,
            (setup.strategy, setup.optimizer),
            setup.master,
            &setup.segments,
            setup.rank_world,
        )
        .map_err(gpu_err("setting up the optimizer"))?;
        let replica = match setup.deterministic {
            Some(max_micro) => replica
                .with_deterministic(
                    &be,
                    max_micro,
                    setup.rank_world.1,
                    stoker_gpu::parallel::grad_tree::chunk_for(setup.rank_world.1),
                )
                .map_err(gpu_err("setting up deterministic mode"))?,
            None => replica,
        };
        Ok(ResidentLoop {
            be,
            coll,
            replica,
            shape: setup.shape,
            spare: Vec::new(),
            make,
            free_at_start,
        })
    }

    /// Makes the running step the one for `shape` (made on first use, its parameters
    /// copied from the running one on the backend).
    fn use_shape(&mut self, shape: (usize, usize)) -> Result<()> {
        if shape == self.shape {
            return Ok(());
        }
        let step = match self.spare.iter().position(|(s, _)| *s == shape) {
            Some(i) => self.spare.swap_remove(i).1,
            None => (self.make)(&self.be, shape.0, shape.1)
                .map_err(gpu_err("making a step for another batch shape"))?,
        };
        let old = self
            .replica
            .replace_step(&self.be, step)
            .map_err(gpu_err("changing the batch shape"))?;
        self.spare.push((self.shape, old));
        self.shape = shape;
        Ok(())
    }
}

/// The shape `(sequences, positions)` of micro-batch `mb` and its token ids (read out of
/// the tensor once; the step checks and converts them as it writes them).
fn ids_of(mb: TokenIds<'_>) -> Result<((usize, usize), Vec<i64>)> {
    let shape = mb.0.dims2()?;
    let ids = crate::ops::ids_i64(mb.0)?.flatten_all()?.to_vec1::<i64>()?;
    if mb.1.len() != ids.len() {
        return Err(TrainError::Strategy(format!(
            "the resident step: a micro-batch of {} token ids has {} targets",
            ids.len(),
            mb.1.len()
        )));
    }
    Ok((shape, ids))
}

fn batch<'a>(tokens: &'a [i64], targets: &'a [i64]) -> TokenBatch<'a> {
    TokenBatch {
        tokens,
        targets,
        ignore: IGNORE_INDEX,
    }
}

impl<B: Backend, S: Trainable<B>, C: Collectives<B>> ResidentRun for ResidentLoop<B, S, C> {
    fn window(
        &mut self,
        window: &[TokenIds<'_>],
        scalars: &Scalars,
        rule: GradRule,
    ) -> Result<WindowReport> {
        let ids = window
            .iter()
            .map(|mb| ids_of(*mb))
            .collect::<Result<Vec<_>>>()?;
        let mut shape = None;
        for &(s, _) in &ids {
            if *shape.get_or_insert(s) != s {
                return Err(TrainError::Strategy(format!(
                    "the resident step runs a window's micro-batches at one shape; this \
                     window has {:?} and {s:?}",
                    shape.unwrap_or(s)
                )));
            }
        }
        if let Some(s) = shape {
            self.use_shape(s)?;
        }
        let batches: Vec<TokenBatch> = window
            .iter()
            .zip(&ids)
            .map(|(mb, (_, ids))| batch(ids, mb.1))
            .collect();
        self.replica
            .window(&self.be, &self.coll, &batches, scalars, rule)
            .map_err(gpu_err("a training window"))
    }

    fn evaluate(&mut self, mb: TokenIds<'_>) -> Result<(f64, usize, usize)> {
        let (shape, ids) = ids_of(mb)?;
        self.use_shape(shape)?;
        self.replica
            .evaluate(&self.be, &self.coll, batch(&ids, mb.1))
            .map_err(gpu_err("an evaluation batch"))
    }

    fn state(&self) -> Result<ResidentState> {
        let state = self.replica.state();
        let (master, moments) = state
            .state_at()
            .read(&self.be)
            .map_err(gpu_err("reading the master and moments back"))?;
        Ok(ResidentState {
            range: state.range(),
            master,
            moments,
        })
    }

    fn range(&self) -> Range<usize> {
        self.replica.state().range()
    }

    fn load(&mut self, master: &[f32], moments: &[(&str, &[f32])], updates: u64) -> Result<()> {
        self.replica
            .load(&self.be, master, moments, updates)
            .map_err(gpu_err("loading the master and moments"))
    }

    fn bytes(&self) -> ResidentBytes {
        // Every step's buffers: the replica's, and the spares' (other batch shapes).
        let steps =
            || std::iter::once(self.replica.step()).chain(self.spare.iter().map(|(_, s)| s));
        ResidentBytes {
            state: self.replica.state().bytes() + self.replica.tree_bytes(),
            steps: steps().map(|s| s.buffer_bytes()).sum(),
            host: self.replica.state().host_bytes()
                + steps().map(|s| s.buffer_host_bytes()).sum::<usize>(),
        }
    }

    fn measured_bytes(&self) -> Option<usize> {
        Some(self.free_at_start?.saturating_sub(self.be.free_memory()?))
    }

    fn fp8_values(&self) -> Result<Option<Vec<ScalerValues>>> {
        self.replica
            .step()
            .fp8_scalers()
            .map(|f| f.read(&self.be))
            .transpose()
            .map_err(gpu_err("reading the FP8 scalers back"))
    }

    fn load_fp8(&mut self, values: &[ScalerValues]) -> Result<()> {
        match self.replica.step().fp8_scalers() {
            Some(f) => f
                .write(&self.be, values)
                .map_err(gpu_err("loading the FP8 scalers")),
            None => Ok(()),
        }
    }
}
