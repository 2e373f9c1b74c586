//! Data parallelism for the resident steps, on the backend's own buffers: the
//! collectives (`collectives`: through host memory and any stoker-comm communicator;
//! NCCL on device memory is the device backend's, `device::nccl`, feature `cuda`), the update after a window of
//! micro-batches under DDP or ZeRO-1 (`data_parallel`, `zero1`), and one rank's training
//! (`replica`: the micro-batches accumulated with no collective, then one reduction, one
//! scalar collective for the window's `tally` and one update).
//!
//! The order is the CPU trainer's (docs/distributed.md): data parallelism is the only
//! degree here, validated when a replica is made; ZeRO-2 and -3 (gradients and
//! parameters sharded while the backward runs) are not built on the resident path.

pub mod collectives;
pub mod data_parallel;
pub mod grad_rule;
pub mod offload;
pub mod replica;
pub mod state_at;
pub mod tally;
pub mod zero1;

pub use collectives::{Collectives, ThroughHost};
pub use data_parallel::{DataParallel, Strategy};
pub use grad_rule::GradRule;
pub use offload::Offloaded;
pub use replica::{Replica, Trainable, WindowReport};
pub use state_at::{MasterAndMoments, StateAt};
pub use tally::Tally;
pub use zero1::Zero1;
