//! What a rank's trainer holds, counted from its own buffers: the measured side of the
//! planner's model-state prediction ([`stoker_plan::trainer`]).

use serde::{Deserialize, Serialize};

/// Bytes one rank's trainer holds, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HeldBytes {
    /// Parameters: the FP32 buffer the step reads, the bf16 copy (bf16 precision) and the
    /// model's candle variables.
    pub params: usize,
    /// Gradients: the buffer the backward writes and ZeRO-2's shard-sized running sum.
    pub grads: usize,
    /// Optimizer moments (this rank's range of them).
    pub optimizer: usize,
    /// Workspace: gradient buckets' copies, shard buffers, the deterministic tree's and
    /// per-micro-batch reduction's gradient-sized buffers.
    pub buffers: usize,
}

impl HeldBytes {
    /// Parameters + gradients + optimizer states: the ZeRO paper's model states.
    pub fn model_states(&self) -> usize {
        self.params + self.grads + self.optimizer
    }
}
