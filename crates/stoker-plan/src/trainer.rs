//! stoker's own trainer: the bytes its buffers hold per rank and the bytes its
//! collectives send per step, for DDP and ZeRO-1/2/3, from the same arithmetic as the
//! ZeRO paper's but with the trainer's own element sizes. Every run prints this
//! prediction beside what it counted ([`TrainerPrediction`] vs the trainer's held bytes
//! and the communicator's counters), so a change that breaks the sharding shows up as a
//! mismatch.
//!
//! Where the trainer differs from the paper's mixed-precision accounting (2-byte weights
//! and gradients, 12-byte optimizer states including the FP32 master):
//! - the trainer's gradients are FP32 (4 bytes), summed in FP32 across micro-batches and
//!   ranks;
//! - its FP32 parameter buffer is the one the step reads (the direct step casts GEMM
//!   operands itself), so under ZeRO-1/2 it is replicated and all-gathered in FP32,
//!   where DeepSpeed shards the master and gathers its 2-byte copy;
//! - the model's candle variables are one more compute-dtype copy, and bf16 keeps a bf16
//!   copy the optimizer writes.
//! - ZeRO-2 reducing every micro-batch holds only its gradient shard on the GPT's direct
//!   step (each group's gradients are reduced as the backward finishes them, workspace
//!   like ZeRO-3's); on the candle-graph path the backward writes a full FP32 gradient
//!   buffer, and what is sharded is the running sum over micro-batches.
//! - ZeRO-3 keeps the FP32 parameters, the gradient sum and the moments as 1/N shards
//!   and no candle variables; its gathered groups are workspace, not model states. It
//!   gathers and reduces every micro-batch, by group: the root groups (embeddings and
//!   final norm) once, each block twice (forward, backward) or once without
//!   `reshard_after_forward`, and reduce-scatters every group once.

use serde::{Deserialize, Serialize};

use crate::strategy::Stage;

/// A model's parameter groups as ZeRO-3 gathers them (elements of the flat buffer).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Default)]
pub struct GroupSpans {
    /// The root groups' elements (the first and the last group: embeddings, final norm).
    pub root: u64,
    /// The blocks' elements (every group between them).
    pub blocks: u64,
    /// Blocks are gathered again for the backward (FSDP's default).
    pub reshard_after_forward: bool,
}

/// One rank of a stoker training run, as the prediction needs it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TrainerRun {
    /// Elements of the flat parameter buffer (parameters plus alignment padding).
    pub flat_len: u64,
    /// Data-parallel ranks.
    pub world: u64,
    /// DDP, ZeRO-1 or ZeRO-2.
    pub stage: Stage,
    /// Optimizer moments per parameter (AdamW 2, SGD with momentum 1).
    pub moments: u64,
    /// Bytes per parameter of the compute copies besides the FP32 buffer (candle
    /// variables, bf16 copy).
    pub copy_bytes: u64,
    /// Micro-batches per optimizer step on each rank.
    pub accumulation: u64,
    /// Gradients reduced after every micro-batch (DDP's `sync_every_micro_batch`, ZeRO-2's
    /// default) instead of only the last.
    pub reduce_every_micro_batch: bool,
    /// Deterministic mode: the whole gradient goes through the reduction tree.
    pub deterministic: bool,
    /// The parameter groups (ZeRO-3's unit of gathering).
    pub groups: GroupSpans,
    /// The GPT's direct step, whose backward hands over gradients group by group (ZeRO-2
    /// then keeps only its shard); false: the candle graph's whole-gradient backward.
    pub direct: bool,
}

/// The predicted bytes of one rank.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerPrediction {
    /// Parameters: FP32 buffer plus compute copies.
    pub params: f64,
    /// Gradients: the backward's FP32 buffer (or shard) plus, on the graph path, ZeRO-2's
    /// shard-sized running sum.
    pub grads: f64,
    /// Optimizer moments (a 1/N shard under ZeRO).
    pub optimizer: f64,
    /// Bytes each rank sends per optimizer step (ring model, the communicator's count),
    /// gradient and parameter collectives only.
    pub bytes_sent_per_step: f64,
}

impl TrainerPrediction {
    /// Parameters + gradients + optimizer states.
    pub fn model_states(&self) -> f64 {
        self.params + self.grads + self.optimizer
    }

    /// One line for people: the model states by kind and the bytes sent per step, MiB.
    pub fn summary(&self) -> String {
        let mib = |b: f64| b / (1u64 << 20) as f64;
        format!(
            "model states {:.2} MiB (params {:.2} + grads {:.2} + optimizer {:.2}), {:.3} MiB sent per step",
            mib(self.model_states()),
            mib(self.params),
            mib(self.grads),
            mib(self.optimizer),
            mib(self.bytes_sent_per_step)
        )
    }
}

/// The prediction for `run`.
pub fn predict(run: &TrainerRun) -> TrainerPrediction {
    let l = run.flat_len as f64;
    let n = run.world.max(1) as f64;
    let shard = (l / n).ceil();
    let one_rank = run.world <= 1;
    let stage = if one_rank { Stage::Ddp } else { run.stage };
    let sharded = stage != Stage::Ddp;
    let every = match stage {
        Stage::Zero2 => run.reduce_every_micro_batch && !run.deterministic,
        _ => false,
    };
    let zero3 = stage == Stage::Zero3;
    let grads = match (zero3, every, run.direct) {
        (true, _, _) | (false, true, true) => 4.0 * shard,
        (false, true, false) => 4.0 * l + 4.0 * shard,
        (false, false, _) => 4.0 * l,
    };
    let optimizer = 4.0 * run.moments as f64 * if sharded { shard } else { l };
    // Ring model: an all-reduce of S bytes sends 2(n-1)/n S, a reduce-scatter or an
    // all-gather (n-1)/n S; the deterministic tree sends what an all-reduce does.
    let ring = if one_rank { 0.0 } else { (n - 1.0) / n };
    let s = 4.0 * l;
    let k = run.accumulation.max(1) as f64;
    let sent = match (stage, run.deterministic) {
        (Stage::Ddp, _) => 2.0 * ring * s * if run.reduce_every_micro_batch { k } else { 1.0 },
        (_, true) => 3.0 * ring * s,
        (Stage::Zero1, false) => 2.0 * ring * s,
        (Stage::Zero3, _) => {
            let g = &run.groups;
            let passes = if g.reshard_after_forward { 2.0 } else { 1.0 };
            let gathered = g.root as f64 + passes * g.blocks as f64;
            k * ring * 4.0 * (gathered + (g.root + g.blocks) as f64)
        }
        (_, false) => ring * s * (if every { k } else { 1.0 } + 1.0),
    };
    TrainerPrediction {
        params: (4 + run.copy_bytes) as f64 * if zero3 { shard } else { l },
        grads,
        optimizer,
        bytes_sent_per_step: sent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stage: Stage, world: u64) -> TrainerRun {
        TrainerRun {
            flat_len: 1_000_000,
            world,
            stage,
            moments: 2,
            copy_bytes: 4,
            accumulation: 4,
            reduce_every_micro_batch: stage == Stage::Zero2,
            deterministic: false,
            groups: GroupSpans {
                root: 100_000,
                blocks: 900_000,
                reshard_after_forward: true,
            },
            direct: false,
        }
    }

    #[test]
    fn zero_shards_the_moments_and_keeps_ddp_traffic_except_zero2_per_micro_batch() {
        let ddp = predict(&run(Stage::Ddp, 4));
        let z1 = predict(&run(Stage::Zero1, 4));
        let z2 = predict(&run(Stage::Zero2, 4));
        assert_eq!(ddp.optimizer, 8e6);
        assert_eq!(z1.optimizer, 2e6);
        assert_eq!(z1.params, ddp.params);
        assert_eq!(z1.bytes_sent_per_step, ddp.bytes_sent_per_step);
        assert_eq!(ddp.bytes_sent_per_step, 2.0 * 0.75 * 4e6);
        // Four reduce-scatters and one all-gather.
        assert_eq!(z2.bytes_sent_per_step, 5.0 * 0.75 * 4e6);
        assert_eq!(z2.grads, 4e6 + 1e6);
        // On the direct step, ZeRO-2 keeps only its shard of the gradients.
        let z2_direct = predict(&TrainerRun {
            direct: true,
            ..run(Stage::Zero2, 4)
        });
        assert_eq!(z2_direct.grads, 1e6);
        assert_eq!(z2_direct.bytes_sent_per_step, z2.bytes_sent_per_step);
        // One rank: nothing sharded, nothing sent.
        // ZeRO-3: everything 1/N, no compute copy; per micro-batch the root gathered
        // once, the blocks twice, everything reduce-scattered: (0.1 + 1.8 + 1) x 0.75 x
        // 4 MB x 4 micro-batches.
        let z3 = predict(&TrainerRun {
            copy_bytes: 0,
            ..run(Stage::Zero3, 4)
        });
        assert_eq!((z3.params, z3.grads, z3.optimizer), (1e6, 1e6, 2e6));
        assert!((z3.bytes_sent_per_step - 2.9 * 0.75 * 4e6 * 4.0).abs() < 1e-3);
        let one = predict(&run(Stage::Zero2, 1));
        assert_eq!(one.optimizer, 8e6);
        assert_eq!(one.bytes_sent_per_step, 0.0);
    }
}
