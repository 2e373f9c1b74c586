//! Data parallelism for the resident steps, on the backend's own buffers: the update
//! after a window of micro-batches under DDP, ZeRO-1, -2 or -3 (`data_parallel`,
//! `zero1`; ZeRO-3's sharded compute copy is the step's, `crate::step::sharded_params`),
//! and one rank's training (`replica`: the micro-batches accumulated with no collective,
//! then one reduction, one scalar collective for the window's `tally` and one update).
//! Deterministic mode's window (`deterministic`, with `grad_tree`'s sums) gives the same
//! bits at every power-of-two world size. The collectives themselves (through host memory, or NCCL on device memory) are
//! `crate::collectives`, re-exported here.
//!
//! The order is the CPU trainer's (docs/distributed.md): data parallelism is the only
//! degree here, validated when a replica is made.

pub mod data_parallel;
mod deterministic;
pub mod grad_rule;
pub mod grad_tree;
pub mod landing;
pub mod offload;
pub mod replica;
pub mod state_at;
pub mod tally;
pub mod zero1;

pub use crate::collectives::{self, Collectives, ThroughHost};
pub use data_parallel::{DataParallel, Strategy};
pub use grad_rule::GradRule;
pub use offload::Offloaded;
pub use replica::{Replica, Trainable, WindowReport};
pub use state_at::{MasterAndMoments, StateAt};
pub use tally::Tally;
pub use zero1::Zero1;
