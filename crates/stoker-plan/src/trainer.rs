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

/// The resident loop's schedule of collectives under ZeRO-2 and ZeRO-3 (stoker-gpu's
/// `DataParallel` and ZeRO-3's parameter slots), which differs from the CPU trainer's:
/// every micro-batch reduce-scatters each block's gradients, while the runs outside the
/// blocks (embeddings, final norm, head) sum locally over the window and are
/// reduce-scattered once after it. ZeRO-2 then all-gathers the whole buffer; ZeRO-3
/// gathers the blocks into two slots as the forward and backward reach them and, after
/// the update, the runs outside the blocks.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ResidentLoop {
    /// The model's blocks (layers), all of one size.
    pub blocks: u64,
    /// Elements of one block.
    pub block_len: u64,
    /// ZeRO-3: the blocks are gathered per micro-batch into the slots.
    pub gathers_blocks: bool,
}

impl ResidentLoop {
    /// Block gathers in a window of `k` micro-batches. A window starts from empty slots:
    /// its first micro-batch gathers every block for the forward and all but the last
    /// two (still in their slots) for the backward; each later one finds the backward's
    /// last two in the slots at its start and the forward's last two at its turn.
    pub fn block_gathers(&self, k: u64) -> u64 {
        let kept_out = self.blocks.saturating_sub(2);
        self.blocks + kept_out + k.saturating_sub(1) * 2 * kept_out
    }
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
    /// The resident loop's schedule, where the run is on it (its ZeRO-2 and ZeRO-3 send
    /// what [`ResidentLoop`] says; DDP and ZeRO-1 what the CPU trainer sends).
    pub resident: Option<ResidentLoop>,
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
        (_, false) => match run.resident {
            // ZeRO-2's bookkeeping (the stage the loop's ZeRO-3 is planned as too).
            Some(r) => {
                let blocks = (r.blocks * r.block_len) as f64;
                let outside = l - blocks;
                let scattered = k * blocks + outside;
                let gathered = match r.gathers_blocks {
                    true => {
                        (r.block_gathers(run.accumulation.max(1)) * r.block_len) as f64 + outside
                    }
                    false => l,
                };
                ring * 4.0 * (scattered + gathered)
            }
            None => ring * s * (if every { k } else { 1.0 } + 1.0),
        },
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
            resident: None,
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
        // The resident loop: 9 blocks of 100,000 and 100,000 outside. ZeRO-2 reduce-
        // scatters the blocks 4 times and the rest once, then gathers everything:
        // (3.6 + 0.1 + 1) x 0.75 x 4 MB. Its ZeRO-3 (planned as ZeRO-2) gathers the blocks
        // 9 + 7 + 3 x 14 = 58 times and the rest once: (3.6 + 0.1 + 5.8 + 0.1) x 0.75 x 4 MB.
        let loop_run = |gathers_blocks| TrainerRun {
            resident: Some(ResidentLoop {
                blocks: 9,
                block_len: 100_000,
                gathers_blocks,
            }),
            ..run(Stage::Zero2, 4)
        };
        let sent = |r: &TrainerRun| predict(r).bytes_sent_per_step;
        assert!((sent(&loop_run(false)) - 4.7 * 0.75 * 4e6).abs() < 1e-3);
        assert!((sent(&loop_run(true)) - 9.6 * 0.75 * 4e6).abs() < 1e-3);
        let slots = |blocks| ResidentLoop {
            blocks,
            block_len: 1,
            gathers_blocks: true,
        };
        // One block stays in its slot all window; two stay in the two slots.
        assert_eq!(slots(1).block_gathers(4), 1);
        assert_eq!(slots(2).block_gathers(4), 2);
        assert_eq!(slots(3).block_gathers(1), 4);
        assert_eq!(slots(3).block_gathers(4), 4 + 3 * 2);
        let one = predict(&run(Stage::Zero2, 1));
        assert_eq!(one.optimizer, 8e6);
        assert_eq!(one.bytes_sent_per_step, 0.0);
    }
}
