//! The kernels' by-value arguments, laid out as cuda/ops declares them (`repr(C)`).

use stoker_kernels::{AdamWStep, SgdStep};

/// Attention's shape: batch, sequence, heads and head width (`Heads` in
/// cuda/ops/elementwise.cuh).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    /// Batch.
    pub b: i32,
    /// Sequence length.
    pub t: i32,
    /// Heads.
    pub h: i32,
    /// Head width.
    pub d: i32,
}

impl Heads {
    /// Elements of one of q, k, v, or of the attention output: `b * h * t * d`.
    pub fn elems(&self) -> usize {
        [self.b, self.h, self.t, self.d]
            .iter()
            .map(|&x| x as usize)
            .product()
    }
}

/// AdamW's scalars for one step (`AdamW` in cuda/ops/optim.cuh): stoker-kernels'
/// [`AdamWStep`], field for field, so the GPU update is the CPU's arithmetic, and how the
/// bf16 copy rounds ([`AdamWArgs::rounded`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWArgs {
    decay: f32,
    w1: f32,
    beta2: f32,
    w2: f32,
    step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
    stochastic: u32,
    seed: u64,
    offset: u64,
}

/// Stochastic rounding of a bf16 copy (llm.c's): element `i` of a launch rounds with the
/// random bits stoker-precision's `f32_to_bf16_stochastic` gives element `offset + i`
/// under `seed`, so a buffer split across launches (a rank's shard) rounds as the whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StochasticRound {
    /// The generator's seed.
    pub seed: u64,
    /// The counter of the launch's first element.
    pub offset: u64,
}

impl AdamWArgs {
    /// These scalars with the bf16 copy rounded by `round` (to nearest even with `None`).
    pub fn rounded(self, round: Option<StochasticRound>) -> Self {
        let (stochastic, seed, offset) = match round {
            Some(r) => (1, r.seed, r.offset),
            None => (0, 0, 0),
        };
        AdamWArgs {
            stochastic,
            seed,
            offset,
            ..self
        }
    }
}

impl From<&AdamWStep> for AdamWArgs {
    fn from(s: &AdamWStep) -> Self {
        AdamWArgs {
            decay: s.decay,
            w1: s.w1,
            beta2: s.beta2,
            w2: s.w2,
            step_size: s.step_size,
            bc2_sqrt: s.bc2_sqrt,
            eps: s.eps,
            stochastic: 0,
            seed: 0,
            offset: 0,
        }
    }
}

/// SGD's scalars for one step (`Sgd` in cuda/ops/optim.cuh): stoker-kernels' [`SgdStep`],
/// field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdArgs {
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    nesterov: i32,
    first: i32,
}

impl From<&SgdStep> for SgdArgs {
    fn from(s: &SgdStep) -> Self {
        SgdArgs {
            lr: s.lr,
            momentum: s.momentum,
            weight_decay: s.weight_decay,
            nesterov: s.nesterov as i32,
            first: s.first as i32,
        }
    }
}

// SAFETY: all three are repr(C) structs of plain numbers (no pointers, no padding the C++
// side lacks: AdamW's u64s start at byte 32 on both), laid out as the kernels' C++ structs
// of the same fields in the same order.
#[cfg(feature = "cuda")]
unsafe impl cudarc::driver::DeviceRepr for Heads {}
#[cfg(feature = "cuda")]
unsafe impl cudarc::driver::DeviceRepr for AdamWArgs {}
#[cfg(feature = "cuda")]
unsafe impl cudarc::driver::DeviceRepr for SgdArgs {}
