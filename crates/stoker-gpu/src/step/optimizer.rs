//! The optimizer over a step's flat FP32 master on the backend (AdamW or SGD): the master
//! and the optimizer's state live beside the step's buffers, one launch updates every
//! segment (a tensor, or a run of tensors with one weight-decay flag: `optim`), writing
//! the compute copy in the same pass (bf16), or from the master after (f32 copied, f16
//! rounded).
//! The only value read back is the gradient norm, for clipping and the run's metrics.

use std::cell::Cell;
use std::ops::Range;

use stoker_kernels::{AdamWStep, SgdStep};

use crate::args::StochasticRound;
use crate::backend::{Backend, View};
use crate::call::Call;
use crate::elem::{Act, Dtype};
use crate::error::{check_len, GpuError};
use crate::host::Host;
use crate::kernels;
use crate::optim::{self, Segments};

impl Optimizer {
    /// Bytes a state of this optimizer over `len` elements holds: the FP32 master and the
    /// optimizer's buffers (AdamW's two moments, SGD's momentum where it keeps one),
    /// planned before the state exists ([`OptimizerState::bytes`] counts a state's).
    pub fn state_bytes(self, len: usize) -> usize {
        let buffers = match self {
            Optimizer::AdamW => 2,
            Optimizer::Sgd { momentum } => momentum as usize,
        };
        (1 + buffers) * 4 * len
    }
}

/// The optimizer's own buffers.
enum Moments<B: Backend> {
    /// AdamW's first and second moments.
    AdamW { m: B::Buf<f32>, v: B::Buf<f32> },
    /// SGD's momentum buffer (none without momentum).
    Sgd { buf: Option<B::Buf<f32>> },
}

/// An optimizer's state on a backend: the FP32 master, its moments, the segments, and
/// how the bf16 compute copy rounds.
pub struct OptimizerState<B: Backend> {
    pub(crate) master: B::Buf<f32>,
    moments: Moments<B>,
    segments: Segments<B>,
    round: Option<RoundState>,
}

/// Stochastic rounding's counters: the seed, the whole flat buffer's length and where
/// this master starts in it (a shard's offset), updates so far. Update `k`'s element `i`
/// of this master takes counter `k x total + base + i`: the counter stoker-precision's
/// `StochasticRounder` would reach over the whole buffer, whatever the sharding.
struct RoundState {
    seed: u64,
    total: u64,
    base: u64,
    updates: Cell<u64>,
}

impl RoundState {
    /// The next update's rounding.
    fn next(&self) -> StochasticRound {
        let k = self.updates.get();
        self.updates.set(k + 1);
        StochasticRound {
            seed: self.seed,
            offset: k * self.total + self.base,
        }
    }
}

/// Which optimizer a state is made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Optimizer {
    /// AdamW: two moments.
    AdamW,
    /// SGD, with a momentum buffer when `momentum`.
    Sgd {
        /// Whether the state holds a momentum buffer.
        momentum: bool,
    },
}

/// The views an update works on, from a step: the compute copy of the parameters, the
/// f32 gradients (both the flat layout), and the scratch of the norm (one f32 and the
/// per-warp partial sums).
#[derive(Debug, Clone, Copy)]
pub struct UpdateViews<'a, T> {
    /// The compute copy.
    pub params: View<'a, T>,
    /// The gradients.
    pub grads: View<'a, f32>,
    /// One f32: the squared norm.
    pub squares: View<'a, f32>,
    /// The norm's per-warp partial sums.
    pub partials: View<'a, f32>,
}

/// The compute copy (the whole flat buffer) and the norm's scratch (one f32, then the
/// per-warp partial sums): what an update from a shard's gradients (ZeRO-2's) works on,
/// where the whole gradient exists nowhere.
pub type ComputeViews<'a, T> = (View<'a, T>, (View<'a, f32>, View<'a, f32>));

/// One step's scalars: which optimizer, at which step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalars {
    /// AdamW at step `t` (stoker-kernels' `AdamWStep`).
    AdamW(AdamWStep),
    /// SGD (stoker-kernels' `SgdStep`).
    Sgd(SgdStep),
}

impl<B: Backend> OptimizerState<B> {
    /// AdamW over `master` (the flat layout), moments at zero, with `segments`: sorted,
    /// disjoint ranges inside it with their weight-decay flags.
    pub fn adamw(
        be: &B,
        master: &[f32],
        segments: &[(Range<usize>, bool)],
    ) -> Result<Self, GpuError> {
        Self::adamw_over(be, be.upload(master)?, segments)
    }

    /// AdamW over a master of `n` zeros: the same buffers as [`Self::adamw`], with no host
    /// copy of the master to upload (a forecast over a counting backend of a model whose
    /// master would not fit in host memory).
    pub fn adamw_zeros(
        be: &B,
        n: usize,
        segments: &[(Range<usize>, bool)],
    ) -> Result<Self, GpuError> {
        Self::adamw_over(be, be.zeros(n)?, segments)
    }

    /// AdamW over the master `master` on the backend: its moments, zeros.
    fn adamw_over(
        be: &B,
        master: B::Buf<f32>,
        segments: &[(Range<usize>, bool)],
    ) -> Result<Self, GpuError> {
        let n = B::len(&master);
        Ok(OptimizerState {
            master,
            moments: Moments::AdamW {
                m: be.zeros(n)?,
                v: be.zeros(n)?,
            },
            segments: Segments::new(be, segments, n)?,
            round: None,
        })
    }

    /// SGD over `master`, with a momentum buffer when `momentum`.
    pub fn sgd(
        be: &B,
        master: &[f32],
        segments: &[(Range<usize>, bool)],
        momentum: bool,
    ) -> Result<Self, GpuError> {
        let n = master.len();
        let buf = match momentum {
            true => Some(be.zeros(n)?),
            false => None,
        };
        Ok(OptimizerState {
            master: be.upload(master)?,
            moments: Moments::Sgd { buf },
            segments: Segments::new(be, segments, n)?,
            round: None,
        })
    }

    /// The state of `kind` over `master` with `segments` ([`OptimizerState::adamw`],
    /// [`OptimizerState::sgd`]).
    pub fn new(
        be: &B,
        kind: Optimizer,
        master: &[f32],
        segments: &[(Range<usize>, bool)],
    ) -> Result<Self, GpuError> {
        match kind {
            Optimizer::AdamW => Self::adamw(be, master, segments),
            Optimizer::Sgd { momentum } => Self::sgd(be, master, segments, momentum),
        }
    }

    /// This state with the bf16 compute copy rounded stochastically (llm.c's AdamW) under
    /// `seed`, for a master that is elements `base..` of a flat buffer of `total` (the
    /// whole: `total` its length and `base` 0; a ZeRO shard: its range's start). AdamW
    /// only; the f32 compute copy is the master and does not round.
    pub fn with_stochastic_rounding(
        mut self,
        seed: u64,
        (total, base): (usize, usize),
    ) -> Result<Self, GpuError> {
        if !matches!(self.moments, Moments::AdamW { .. }) {
            return Err(GpuError::Shape {
                kernel: "optimizer",
                what: "stochastic rounding of the bf16 copy is AdamW's (llm.c's); SGD rounds \
                       to nearest"
                    .into(),
            });
        }
        self.round = Some(RoundState {
            seed,
            total: total as u64,
            base: base as u64,
            updates: Cell::new(0),
        });
        Ok(self)
    }

    /// Elements of the master.
    pub fn len(&self) -> usize {
        B::len(&self.master)
    }

    /// Whether the master is empty (a rank's shard of a tiny model).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the master and the optimizer's buffers.
    pub fn bytes(&self) -> usize {
        let moments = match &self.moments {
            Moments::AdamW { .. } => 2,
            Moments::Sgd { buf } => buf.is_some() as usize,
        };
        (1 + moments) * 4 * B::len(&self.master)
    }

    /// The master's values.
    pub fn master(&self, be: &B) -> Result<Vec<f32>, GpuError> {
        be.download(&self.master)
    }

    /// The optimizer's buffers by the names a checkpoint gives them (stoker-train's:
    /// `exp_avg` and `exp_avg_sq` for AdamW, `momentum` for SGD with momentum), each as
    /// long as the master.
    pub fn moments(&self, be: &B) -> Result<Vec<(&'static str, Vec<f32>)>, GpuError> {
        Ok(match &self.moments {
            Moments::AdamW { m, v } => {
                vec![
                    ("exp_avg", be.download(m)?),
                    ("exp_avg_sq", be.download(v)?),
                ]
            }
            Moments::Sgd { buf: Some(b) } => vec![("momentum", be.download(b)?)],
            Moments::Sgd { buf: None } => Vec::new(),
        })
    }

    /// Sets the master and the optimizer's buffers (named and ordered as
    /// [`OptimizerState::moments`] gives them) from a checkpoint, `updates` updates into
    /// the run (where stochastic rounding's counter stands).
    pub fn set(
        &self,
        be: &B,
        master: &[f32],
        moments: &[(&str, &[f32])],
        updates: u64,
    ) -> Result<(), GpuError> {
        let n = self.len();
        check_len("optimizer", "master", master.len(), n)?;
        let mine: Vec<(&'static str, &B::Buf<f32>)> = match &self.moments {
            Moments::AdamW { m, v } => vec![("exp_avg", m), ("exp_avg_sq", v)],
            Moments::Sgd { buf: Some(b) } => vec![("momentum", b)],
            Moments::Sgd { buf: None } => Vec::new(),
        };
        let names = |v: &mut dyn Iterator<Item = &str>| v.collect::<Vec<_>>().join(", ");
        if mine.len() != moments.len() || mine.iter().zip(moments).any(|((a, _), (b, _))| a != b) {
            return Err(GpuError::Shape {
                kernel: "optimizer",
                what: format!(
                    "buffers [{}] for a state that holds [{}]",
                    names(&mut moments.iter().map(|(n, _)| *n)),
                    names(&mut mine.iter().map(|(n, _)| *n))
                ),
            });
        }
        for ((name, buf), (_, values)) in mine.iter().zip(moments) {
            check_len("optimizer", name, values.len(), n)?;
            be.write(buf, 0, values)?;
        }
        be.write(&self.master, 0, master)?;
        if let Some(r) = &self.round {
            r.updates.set(updates);
        }
        Ok(())
    }
}

/// The gradients' multiplier for an update: `unscale` (1 / the loss scale), times
/// torch's `clip_grad_norm_` coefficient `max_norm / (norm + 1e-6)` where that is below
/// 1 (`norm` of the unscaled gradients), as stoker-train's `clip_to`.
pub fn grad_multiplier(norm: f64, unscale: f32, clip: Option<f64>) -> f32 {
    match clip.and_then(|c| stoker_kernels::flat::clip_coefficient(norm, c)) {
        Some(c) => unscale * c as f32,
        None => unscale,
    }
}

/// The squared norm of `grads` as the device brackets it (`squares` and `partials` its
/// scratch), read back: the one value an update waits for. 0 for no gradients.
pub fn squared_norm<B: Backend>(
    be: &B,
    grads: View<f32>,
    (squares, partials): (View<f32>, View<f32>),
) -> Result<f64, GpuError> {
    if grads.is_empty() {
        return Ok(0.0);
    }
    let warps = super::layout::PARTIAL_WARPS.min(partials.len());
    kernels::sum(be, squares, grads, partials, true, warps, false)?;
    Ok(be.read(squares)?[0] as f64)
}

/// One launch of `opt`'s optimizer over every segment of its master on `grads x mult`,
/// the compute copy `params` (as long as the master) written in the same pass (bf16), or
/// from the master after (f32 copied, f16 rounded to nearest).
pub fn apply<B: Backend, T: Act>(
    be: &B,
    opt: &OptimizerState<B>,
    params: View<T>,
    grads: View<f32>,
    scalars: &Scalars,
    mult: f32,
) -> Result<(), GpuError> {
    let Some(call) = update_call(be, opt, params, grads, scalars, mult)? else {
        return Ok(());
    };
    // SAFETY: `update_call` checked every view against the state's length and made the
    // call over buffers that outlive this function (the views' borrows).
    unsafe { be.launch(&call)? };
    copy_after(be, params, be.all(&opt.master))
}

/// [`apply`] of a state in host memory, in pieces: the optimizer's one launch made once
/// (its rounding counter advanced once), then for each of `pieces` (in order; disjoint,
/// starting on multiples of eight, together the whole buffer) `before(piece)`, that
/// piece of the launch and of the compute copy's step after, and `after(piece)`. The
/// offloaded optimizer's pipeline: a piece's gradients come down before it, and its
/// compute copy goes up after, while the host steps the next piece. The same bits as
/// [`apply`] (each pack writes only its own elements).
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply_on_host_in_pieces<T: Act>(
    opt: &OptimizerState<Host>,
    params: View<T>,
    grads: View<f32>,
    (scalars, mult): (&Scalars, f32),
    pieces: &[Range<usize>],
    mut before: impl FnMut(&Range<usize>) -> Result<(), GpuError>,
    mut after: impl FnMut(&Range<usize>) -> Result<(), GpuError>,
) -> Result<(), GpuError> {
    let mut next = 0;
    for r in pieces {
        if r.start != next || !r.start.is_multiple_of(8) || r.end < r.start {
            return Err(GpuError::Shape {
                kernel: "optimizer",
                what: format!("piece {r:?} after {next}: pieces must follow each other from 0, each starting on a multiple of 8"),
            });
        }
        next = r.end;
    }
    crate::error::check_len("optimizer", "pieces", next, opt.len())?;
    let call = update_call(&Host, opt, params, grads, scalars, mult)?;
    let master = Host.all(&opt.master);
    for r in pieces {
        before(r)?;
        if let Some(call) = &call {
            // SAFETY: `update_call` checked every view against the state's length and
            // made the call over buffers that outlive this function (the views'
            // borrows); the piece lies inside it (checked above), and the pieces are
            // disjoint and run one after another.
            unsafe { Host.launch_packs(call, r.clone())? };
        }
        copy_after(&Host, params.slice(r.clone())?, master.slice(r.clone())?)?;
        after(r)?;
    }
    Ok(())
}

/// The optimizer's launch for [`apply`], checked, with the rounding counter advanced;
/// None for an empty state.
fn update_call<B: Backend, T: Act>(
    be: &B,
    opt: &OptimizerState<B>,
    params: View<T>,
    grads: View<f32>,
    scalars: &Scalars,
    mult: f32,
) -> Result<Option<Call>, GpuError> {
    crate::error::check_len("optimizer", "params", params.len(), opt.len())?;
    crate::error::check_len("optimizer", "grads", grads.len(), opt.len())?;
    if opt.is_empty() {
        return Ok(None);
    }
    let copy = match T::DTYPE {
        Dtype::Bf16 => Some(params.cast::<half::bf16>()?),
        Dtype::F32 | Dtype::F16 => None,
    };
    let p = be.all(&opt.master);
    let call = match (&opt.moments, scalars) {
        (Moments::AdamW { m, v }, Scalars::AdamW(s)) => optim::adamw_call(
            be,
            p,
            grads,
            be.all(m),
            be.all(v),
            (
                copy,
                copy.and_then(|_| opt.round.as_ref().map(RoundState::next)),
            ),
            s,
            &opt.segments,
            mult,
        )?,
        (Moments::Sgd { buf }, Scalars::Sgd(s)) => optim::sgd_call(
            be,
            p,
            grads,
            buf.as_ref().map(|b| be.all(b)),
            copy,
            s,
            &opt.segments,
            mult,
        )?,
        (_, s) => {
            return Err(GpuError::Shape {
                kernel: "optimizer",
                what: format!("{s:?} for a state made for the other optimizer"),
            })
        }
    };
    Ok(Some(call))
}

/// The compute copy `params` from the updated master `master` (as long): copied (f32),
/// rounded to nearest (f16); bf16's was written by the update itself.
fn copy_after<B: Backend, T: Act>(
    be: &B,
    params: View<T>,
    master: View<f32>,
) -> Result<(), GpuError> {
    match T::DTYPE {
        Dtype::F32 => be.copy(params.cast::<f32>()?, master),
        Dtype::F16 => kernels::from_f32(be, params, master),
        Dtype::Bf16 => Ok(()),
    }
}

/// The update of a step's [`UpdateViews`] (one rank, or DDP's after the all-reduce):
/// the gradients' squared norm (the one value read back), then [`apply`] on the
/// gradients times [`grad_multiplier`]. Returns the unscaled norm. (With a loss scale the
/// CPU multiplies twice, unscale then clip; here once by their product.)
pub fn update<B: Backend, T: Act>(
    be: &B,
    opt: &OptimizerState<B>,
    views: UpdateViews<T>,
    scalars: &Scalars,
    unscale: f32,
    clip: Option<f64>,
) -> Result<f64, GpuError> {
    let squares = squared_norm(be, views.grads, (views.squares, views.partials))?;
    let norm = squares.sqrt() * unscale as f64;
    let mult = grad_multiplier(norm, unscale, clip);
    apply(be, opt, views.params, views.grads, scalars, mult)?;
    Ok(norm)
}
