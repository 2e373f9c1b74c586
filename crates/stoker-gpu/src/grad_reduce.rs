//! A step's gradients meeting the other ranks' (DDP's sum all-reduce) from a backend's
//! buffer. [`ThroughHost`] goes through any stoker-comm [`Communicator`] on host memory:
//! the gradients copied down, reduced, copied back. It is the in-process ranks' path in
//! the tests (the same step code at every world size) and a GPU's path through MPI; NCCL
//! on device memory, which needs no copies, is not wired yet (docs/gpu.md).

use stoker_comm::{CommExt, Communicator};

use crate::backend::{Backend, View};
use crate::error::GpuError;

/// Sums gradients over the ranks, in place.
pub trait GradReduce<B: Backend> {
    /// Replaces `grads` on every rank by their sum over the ranks (rank order).
    fn all_reduce(&self, be: &B, grads: View<f32>) -> Result<(), GpuError>;
}

/// Through a [`Communicator`] on host memory.
#[derive(Debug)]
pub struct ThroughHost<'a, C>(pub &'a C);

impl<B: Backend, C: Communicator> GradReduce<B> for ThroughHost<'_, C> {
    fn all_reduce(&self, be: &B, grads: View<f32>) -> Result<(), GpuError> {
        let mut host = be.read(grads)?;
        self.0.all_reduce(&mut host).map_err(|e| GpuError::Driver {
            what: format!(
                "all-reducing {} gradients over {} ranks ({})",
                host.len(),
                self.0.world_size(),
                self.0.backend()
            ),
            error: e.to_string(),
        })?;
        be.write_at(grads, &host)
    }
}
