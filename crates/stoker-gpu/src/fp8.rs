//! FP8 delayed scaling on a backend (Transformer Engine's `DelayedScaling`, stoker-precision's
//! [`DelayedScaler`] bit for bit): a set of scalers, one per FP8 tensor (a linear layer's
//! input, weight, output gradient), whose scales, amax histories and per-warp amax partials
//! live in three f32 buffers on the backend and never leave it.
//!
//! - [`Fp8Scalers::quantize`] casts a tensor with its scaler's scale (the one the earlier
//!   steps gave: "delayed") and folds its amax into the scaler's partials, so the
//!   micro-batches of a step add up as `DelayedScaler::record_amax` does;
//! - [`Fp8Scalers::end_step`] is two launches for the whole set: each scaler's amax of
//!   the step folded from its partials, then recorded in its history, its next scale and
//!   `scale_inv`, the ring moved on; [`Fp8Scalers::end_step_over`] takes the largest of
//!   each amax over data-parallel ranks between the two (Transformer Engine's amax
//!   all-reduce), so that every rank takes the scales one rank would;
//! - [`Fp8Scalers::scale_inv`] is the view an FP8 product reads
//!   ([`crate::gemm::matmul_fp8`]), on the device through a pointer, so no scale crosses
//!   the bus in a step.

use std::cell::Cell;

use stoker_precision::{AmaxComputeAlgo, DelayedScaler, DelayedScalingConfig, TensorRole};

use crate::backend::{Backend, View};
use crate::call::Call;
use crate::collectives::Collectives;
use crate::elem::{Act, Fp8, Fp8Dtype};
use crate::error::{check_len, dim, GpuError};

/// Warps of a cast at most, so the amax partials each scaler keeps: 1,024 warps hold
/// 32,768 threads of eight elements each in flight.
pub const AMAX_WARPS: usize = 1024;

/// Values a scaler keeps in the state buffer: scale, scale_inv, the format's largest
/// value times 2^-margin.
const STATE: usize = 3;

/// One scaler's values as read back: what [`DelayedScaler`] holds.
#[derive(Debug, Clone, PartialEq)]
pub struct ScalerValues {
    /// The scale the next casts multiply by.
    pub scale: f32,
    /// `1 / scale`, what the products multiply by.
    pub scale_inv: f32,
    /// The amax history, oldest first, ending with the current step's slot (as
    /// [`DelayedScaler::history`]); the casts of the step not yet ended are in the partials,
    /// not here.
    pub history: Vec<f32>,
}

/// Bytes a set of `count` scalers under `config` holds on a backend: its values,
/// histories, amax partials and step amaxes, f32 each ([`Fp8Scalers::bytes`] once made).
pub fn planned_bytes(count: usize, config: &DelayedScalingConfig) -> usize {
    4 * count * (STATE + config.amax_history_len + AMAX_WARPS + 1)
}

/// A set of delayed scalers on a backend.
pub struct Fp8Scalers<B: Backend> {
    state: B::Buf<f32>,
    history: B::Buf<f32>,
    partials: B::Buf<f32>,
    /// Each scaler's amax of the step, folded from its partials at the step's end: what
    /// the ranks reduce.
    amax: B::Buf<f32>,
    formats: Vec<Fp8Dtype>,
    len: usize,
    /// The current step's slot in every history (all scalers end their steps together).
    pos: Cell<usize>,
    most_recent: bool,
}

impl<B: Backend> Fp8Scalers<B> {
    /// One scaler per entry of `roles` under `config` (the format of each from the recipe
    /// and its role), each with scale 1 and an empty history, as [`DelayedScaler::new`].
    pub fn new(
        be: &B,
        config: &DelayedScalingConfig,
        roles: &[TensorRole],
    ) -> Result<Self, GpuError> {
        const K: &str = "fp8-scalers";
        let bad = |what: String| GpuError::Shape { kernel: K, what };
        if roles.is_empty() {
            return Err(bad("no scaler".into()));
        }
        // The same checks and the same scaled maximum as DelayedScaler::new and ::update.
        for role in roles {
            DelayedScaler::new(config, *role).map_err(|e| bad(e.to_string()))?;
        }
        dim(K, "amax_history_len", config.amax_history_len)?;
        dim(K, "scalers", roles.len())?;
        let formats: Vec<Fp8Dtype> = roles
            .iter()
            .map(|r| Fp8Dtype::of(config.format.format_for(*r)))
            .collect();
        let state: Vec<f32> = formats
            .iter()
            .flat_map(|f| [1.0, 1.0, f.format().max() * (-config.margin).exp2()])
            .collect();
        Ok(Fp8Scalers {
            state: be.upload(&state)?,
            history: be.zeros(roles.len() * config.amax_history_len)?,
            partials: be.zeros(roles.len() * AMAX_WARPS)?,
            amax: be.zeros(roles.len())?,
            formats,
            len: config.amax_history_len,
            pos: Cell::new(0),
            most_recent: config.amax_compute_algo == AmaxComputeAlgo::MostRecent,
        })
    }

    /// Bytes the set holds on the backend ([`planned_bytes`] before it is made).
    pub fn bytes(&self) -> usize {
        4 * (B::len(&self.state)
            + B::len(&self.history)
            + B::len(&self.partials)
            + B::len(&self.amax))
    }

    /// How many scalers the set holds.
    pub fn count(&self) -> usize {
        self.formats.len()
    }

    /// Scaler `s`'s format.
    pub fn format(&self, s: usize) -> Result<Fp8Dtype, GpuError> {
        self.formats.get(s).copied().ok_or_else(|| GpuError::Shape {
            kernel: "fp8-scalers",
            what: format!("scaler {s} of {}", self.formats.len()),
        })
    }

    /// Scaler `s`'s `scale_inv` as a view of one f32: what an FP8 product reads.
    pub fn scale_inv<'a>(&'a self, be: &B, s: usize) -> Result<View<'a, f32>, GpuError> {
        self.format(s)?;
        be.view(&self.state, STATE * s + 1..STATE * s + 2)
    }

    /// `out = fp8(x * scale)` with scaler `s`'s scale (`x` row-major `rows x cols`), and
    /// where `out_t` is given its transpose (`cols x rows`: what FP8 products take for the
    /// other side of a product). With `record`, `x`'s amax is folded into the scaler's
    /// step; a cast again of a tensor already recorded (the backward's) passes `false`.
    #[allow(clippy::too_many_arguments)]
    pub fn quantize<T: Act, Q: Fp8>(
        &self,
        be: &B,
        s: usize,
        x: View<T>,
        shape: (usize, usize),
        out: View<Q>,
        out_t: Option<View<Q>>,
        record: bool,
    ) -> Result<(), GpuError> {
        self.cast(be, s, x, shape, (Some(out), out_t), record)
    }

    /// The transpose alone of `x`'s cast with scaler `s`'s scale, recording nothing: what
    /// a backward needs of a tensor its forward cast as stored.
    pub fn quantize_transposed<T: Act, Q: Fp8>(
        &self,
        be: &B,
        s: usize,
        x: View<T>,
        shape: (usize, usize),
        out_t: View<Q>,
    ) -> Result<(), GpuError> {
        self.cast(be, s, x, shape, (None, Some(out_t)), false)
    }

    /// The cast into `out` and `out_t`, each where given.
    fn cast<T: Act, Q: Fp8>(
        &self,
        be: &B,
        s: usize,
        x: View<T>,
        (rows, cols): (usize, usize),
        (out, out_t): (Option<View<Q>>, Option<View<Q>>),
        record: bool,
    ) -> Result<(), GpuError> {
        const K: &str = "fp8-quantize";
        let format = self.format(s)?;
        if format != Q::DTYPE {
            return Err(GpuError::Shape {
                kernel: K,
                what: format!(
                    "scaler {s} casts to {format:?}, the output holds {:?}",
                    Q::DTYPE
                ),
            });
        }
        let n = rows * cols;
        let cols32 = dim(K, "cols", cols)?;
        dim(K, "rows", rows)?;
        check_len(K, "x", x.len(), n)?;
        for (name, v) in [("out", &out), ("out_t", &out_t)] {
            if let Some(v) = v {
                check_len(K, name, v.len(), n)?;
            }
        }
        // A warp casts 32 packs of eight at a time.
        let warps = n.div_ceil(32 * 8).clamp(1, AMAX_WARPS);
        let amax = if record {
            be.view(&self.partials, s * AMAX_WARPS..(s + 1) * AMAX_WARPS)?
                .addr()
        } else {
            0
        };
        let call = Call::Fp8Quantize {
            dtype: T::DTYPE,
            out: out.map_or(0, |v| v.addr()),
            out_t: out_t.map_or(0, |t| t.addr()),
            amax,
            x: x.addr(),
            scale: be.view(&self.state, STATE * s..STATE * s + 1)?.addr(),
            rows: rows as i64,
            cols: cols32,
            e5m2: (format == Fp8Dtype::E5m2) as i32,
            warps: warps as i32,
        };
        // SAFETY: x, out and out_t (where given) hold rows * cols elements; the scale is
        // one f32 of the state; the amax partials (when recorded) are this scaler's
        // AMAX_WARPS, one per warp, and warps <= AMAX_WARPS.
        unsafe { be.launch(&call) }
    }

    /// Ends the step for every scaler: its amax recorded, its next scale computed, its
    /// history moved on ([`DelayedScaler::update`]). Two launches, nothing read back.
    pub fn end_step(&self, be: &B) -> Result<(), GpuError> {
        self.fold_amax(be)?;
        self.update_scales(be)
    }

    /// [`Self::end_step`] on one of `coll`'s ranks: each scaler's amax of the step is the
    /// largest over the ranks before it is recorded (Transformer Engine's amax
    /// all-reduce), so every rank takes the same scales, those one rank holding the whole
    /// batch would take. One more collective of one f32 per scaler.
    pub fn end_step_over<C: Collectives<B>>(&self, be: &B, coll: &C) -> Result<(), GpuError> {
        self.fold_amax(be)?;
        coll.max_of_amaxes(be, be.all(&self.amax))?;
        self.update_scales(be)
    }

    /// Each scaler's amax of the step into `amax`, its partials cleared.
    fn fold_amax(&self, be: &B) -> Result<(), GpuError> {
        let call = Call::Fp8AmaxFold {
            amax: be.addr(&self.amax),
            history: be.addr(&self.history),
            partials: be.addr(&self.partials),
            count: self.count() as i64,
            len: self.len as i32,
            pos: self.pos.get() as i32,
            parts: AMAX_WARPS as i32,
        };
        // SAFETY: the amax holds one, the history `len` and the partials AMAX_WARPS
        // values for each of `count` scalers (all made so in `new`), and pos < len.
        unsafe { be.launch(&call) }
    }

    /// Each scaler's amax recorded, its next scale computed, the ring moved on.
    fn update_scales(&self, be: &B) -> Result<(), GpuError> {
        let call = Call::Fp8ScaleUpdate {
            state: be.addr(&self.state),
            history: be.addr(&self.history),
            amax: be.addr(&self.amax),
            count: self.count() as i64,
            len: self.len as i32,
            pos: self.pos.get() as i32,
            most_recent: self.most_recent as i32,
        };
        // SAFETY: the state holds STATE, the history `len` values and the amax one for
        // each of `count` scalers (all made so in `new`), and pos < len.
        unsafe { be.launch(&call)? };
        self.pos.set((self.pos.get() + 1) % self.len);
        Ok(())
    }

    /// Takes `other`'s values (the same scalers of another step of the same model: a
    /// running step's replacement at another batch shape goes on from them).
    pub fn copy_from(&self, be: &B, other: &Fp8Scalers<B>) -> Result<(), GpuError> {
        if self.formats != other.formats || self.len != other.len {
            return Err(GpuError::Shape {
                kernel: "fp8-scalers",
                what: "copying another set of scalers: not the same scalers".into(),
            });
        }
        be.copy(be.all(&self.state), be.all(&other.state))?;
        be.copy(be.all(&self.history), be.all(&other.history))?;
        be.copy(be.all(&self.partials), be.all(&other.partials))?;
        self.pos.set(other.pos.get());
        Ok(())
    }

    /// Sets every scaler's scale and history (a checkpoint's: what [`Self::read`] gave, one
    /// per scaler, each history `amax_history_len` long, oldest first); the current step's
    /// casts start from nothing.
    pub fn write(&self, be: &B, values: &[ScalerValues]) -> Result<(), GpuError> {
        const K: &str = "fp8-scalers";
        check_len(K, "values", values.len(), self.count())?;
        let mut state = be.download(&self.state)?;
        let mut history = Vec::with_capacity(self.count() * self.len);
        for (s, v) in values.iter().enumerate() {
            check_len(K, "history", v.history.len(), self.len)?;
            state[STATE * s] = v.scale;
            state[STATE * s + 1] = v.scale_inv;
            history.extend_from_slice(&v.history);
        }
        be.write_at(be.all(&self.state), &state)?;
        be.write_at(be.all(&self.history), &history)?;
        be.zero(be.all(&self.partials))?;
        // Oldest first ending with the current slot: the ring's current slot is the last.
        self.pos.set(self.len - 1);
        Ok(())
    }

    /// Every scaler's values, read back (for checks and checkpoints, not in a step).
    pub fn read(&self, be: &B) -> Result<Vec<ScalerValues>, GpuError> {
        let state = be.download(&self.state)?;
        let history = be.download(&self.history)?;
        Ok((0..self.count())
            .map(|s| {
                let ring = &history[s * self.len..(s + 1) * self.len];
                ScalerValues {
                    scale: state[STATE * s],
                    scale_inv: state[STATE * s + 1],
                    history: (1..=self.len)
                        .map(|k| ring[(self.pos.get() + k) % self.len])
                        .collect(),
                }
            })
            .collect())
    }
}
