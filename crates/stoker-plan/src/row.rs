//! One strategy as the recommendation evaluates it: its best micro-batch, with the memory,
//! collectives and step time there. Its own module, so that the data decision and the
//! report read rows without reaching into the recommendation that makes them.

use serde::Serialize;

use crate::comm::Comm;
use crate::memory::MemoryEstimate;
use crate::strategy::Strategy;
use crate::time::StepTime;

/// One strategy evaluated at its best micro-batch.
#[derive(Clone, Debug, Serialize)]
pub struct StrategyRow {
    /// The strategy.
    pub strategy: Strategy,
    /// Its label, e.g. `zero2+offload-opt`.
    pub label: String,
    /// Sequences per device per micro-step.
    pub micro_batch: u64,
    /// Micro-steps per optimizer step.
    pub accumulation_steps: u64,
    /// Memory at that micro-batch.
    pub memory: MemoryEstimate,
    /// Collectives.
    pub comm: Comm,
    /// Step time.
    pub time: StepTime,
}
