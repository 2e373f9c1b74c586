//! Where a rank's optimizer state lives: on the backend beside the step, or in host
//! memory ([`Offloaded`], ZeRO-Offload). DDP's whole state and ZeRO-1's shard are either;
//! everything that reads, sets, counts or steps a state goes through here, so the two
//! places are one choice.

use std::ops::Range;

use super::offload::Offloaded;
use crate::backend::{Backend, View};
use crate::elem::Act;
use crate::error::GpuError;
use crate::host::Host;
use crate::step::optimizer::{self, Optimizer, OptimizerState, Scalars};

/// A rank's master and the optimizer's buffers by name, read back.
pub type MasterAndMoments = (Vec<f32>, Vec<(&'static str, Vec<f32>)>);

/// An optimizer's state (master and moments), on the backend or in host memory.
pub enum StateAt<B: Backend> {
    /// On the backend, beside the step.
    Here(OptimizerState<B>),
    /// In host memory, stepped by the host build of the same kernels.
    Host(Offloaded<B>),
}

impl<B: Backend> StateAt<B> {
    /// The state of optimizer `kind` over `master` with its `segments`, in host memory
    /// where `offload`.
    pub fn new(
        be: &B,
        kind: Optimizer,
        master: &[f32],
        segments: &[(Range<usize>, bool)],
        offload: bool,
    ) -> Result<Self, GpuError> {
        Ok(match offload {
            false => StateAt::Here(OptimizerState::new(be, kind, master, segments)?),
            true => StateAt::Host(Offloaded::new(kind, master, segments)?),
        })
    }

    /// This state with the bf16 compute copy rounded stochastically under `seed`, its
    /// master being elements `base..` of a flat buffer of `total`.
    pub fn with_stochastic_rounding(self, seed: u64, at: (usize, usize)) -> Result<Self, GpuError> {
        Ok(match self {
            StateAt::Here(opt) => StateAt::Here(opt.with_stochastic_rounding(seed, at)?),
            StateAt::Host(o) => StateAt::Host(o.with_stochastic_rounding(seed, at)?),
        })
    }

    /// Elements of the master.
    pub fn len(&self) -> usize {
        match self {
            StateAt::Here(opt) => opt.len(),
            StateAt::Host(o) => o.optimizer().len(),
        }
    }

    /// Whether the master is empty (a rank's shard of a tiny model).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The master's values, read back from wherever they live.
    pub fn master(&self, be: &B) -> Result<Vec<f32>, GpuError> {
        match self {
            StateAt::Here(opt) => opt.master(be),
            StateAt::Host(o) => o.optimizer().master(&Host),
        }
    }

    /// The master and the optimizer's buffers by name, read back from wherever they live.
    pub fn read(&self, be: &B) -> Result<MasterAndMoments, GpuError> {
        match self {
            StateAt::Here(opt) => Ok((opt.master(be)?, opt.moments(be)?)),
            StateAt::Host(o) => {
                let opt = o.optimizer();
                Ok((opt.master(&Host)?, opt.moments(&Host)?))
            }
        }
    }

    /// Sets the master and the optimizer's buffers (as [`StateAt::read`] names and
    /// orders them), `updates` updates into the run.
    pub fn set(
        &self,
        be: &B,
        master: &[f32],
        moments: &[(&str, &[f32])],
        updates: u64,
    ) -> Result<(), GpuError> {
        match self {
            StateAt::Here(opt) => opt.set(be, master, moments, updates),
            StateAt::Host(o) => o.optimizer().set(&Host, master, moments, updates),
        }
    }

    /// Bytes it holds on the backend (none where it is offloaded).
    pub fn bytes(&self) -> usize {
        match self {
            StateAt::Here(opt) => opt.bytes(),
            StateAt::Host(_) => 0,
        }
    }

    /// Bytes it holds in host memory (none unless it is offloaded).
    pub fn host_bytes(&self) -> usize {
        match self {
            StateAt::Here(_) => 0,
            StateAt::Host(o) => o.host_bytes(),
        }
    }

    /// One optimizer step over `grads` (on `be`, as long as the master) times `mult`,
    /// writing the compute copy `params` (on `be`, as long): on the backend, or on the
    /// host with the gradients copied down and the compute copy up.
    pub fn apply<T: Act>(
        &self,
        be: &B,
        params: View<T>,
        grads: View<f32>,
        scalars: &Scalars,
        mult: f32,
    ) -> Result<(), GpuError> {
        match self {
            StateAt::Here(opt) => optimizer::apply(be, opt, params, grads, scalars, mult),
            StateAt::Host(o) => o.step_on_host(be, grads, params, scalars, mult),
        }
    }

    /// [`Self::apply`] writing a compute copy in host memory (`host_params` must be a view
    /// of a [`crate::host::HostBuf`]: ZeRO-3's shard, the one caller): only an offloaded
    /// state can, the host's optimizer writing it in place.
    pub(crate) fn apply_into_host<T: Act>(
        &self,
        be: &B,
        host_params: View<T>,
        grads: View<f32>,
        scalars: &Scalars,
        mult: f32,
    ) -> Result<(), GpuError> {
        match self {
            StateAt::Here(_) => Err(GpuError::Shape {
                kernel: "offload",
                what: "a compute copy in host memory is written by an optimizer offloaded \
                       there (the parameters offloaded need offload_optimizer)"
                    .into(),
            }),
            StateAt::Host(o) => o.step_into_host(be, grads, host_params, scalars, mult),
        }
    }
}
