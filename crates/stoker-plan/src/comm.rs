//! Communication per optimizer step: bytes each strategy moves and their time on a ring.
//!
//! Volumes (ZeRO paper, section 7): DDP's all-reduce is a reduce-scatter plus an all-gather,
//! 2P elements; ZeRO-1/2 do the same two collectives (2P); ZeRO-3 all-gathers parameters in
//! forward and again in backward and reduce-scatters gradients (3P, 1.5x). On a ring of n
//! devices each collective over a buffer of S bytes sends `(n-1)/n * S` per device, so an
//! all-reduce costs `2(n-1)/n * S / busbw` (nccl-tests' bus bandwidth factor).
//!
//! Gradient accumulation changes how often: DDP and ZeRO-1 reduce once per step (no_sync
//! between micro-batches); ZeRO-2 must reduce-scatter every micro-batch (its gradients are
//! sharded, so they cannot accumulate unreduced) and all-gathers once; ZeRO-3 does all three
//! collectives every micro-batch.

use serde::Serialize;

use crate::hardware::Hardware;
use crate::model::ModelSpec;
use crate::setup::Setup;
use crate::strategy::{Stage, Strategy};

/// Collective traffic of one strategy.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Comm {
    /// Bytes of the collectives of one synchronised micro-batch (2P or 3P elements; none on
    /// one device).
    pub bytes_per_sync: f64,
    /// Bytes of all collectives in one optimizer step (with accumulation).
    pub bytes_per_step: f64,
    /// Ring bus bandwidth used, bytes/s.
    pub bus_bw: f64,
    /// Time of one reduce-scatter or all-gather of the gradients (P x reduce dtype), s.
    pub unit_rs_s: f64,
    /// Time of one all-gather of the parameters (P x weight dtype), s.
    pub unit_ag_s: f64,
    /// Time of all collectives of one step if nothing overlaps, s.
    pub step_s: f64,
}

/// Communication of `strategy` with `accum` micro-batches per step.
pub fn communication(
    model: &ModelSpec,
    hw: &Hardware,
    setup: &Setup,
    strategy: Strategy,
    accum: u64,
) -> Comm {
    let p = model.params as f64;
    let n = hw.world_size() as f64;
    let (rs, ag) = (p * setup.reduce_bytes, p * setup.gather_bytes);
    let a = accum as f64;
    let (per_sync, per_step) = if n <= 1.0 {
        // One device runs no collectives: its gradients are already the whole batch's.
        (0.0, 0.0)
    } else {
        match strategy.stage {
            // DDP's all-reduce is a reduce-scatter and an all-gather of the gradients, both
            // in the reduction's dtype; ZeRO-1 gathers the updated parameters instead.
            Stage::Ddp => (2.0 * rs, 2.0 * rs),
            Stage::Zero1 => (rs + ag, rs + ag),
            Stage::Zero2 => (rs + ag, a * rs + ag),
            Stage::Zero3 => (2.0 * ag + rs, a * (2.0 * ag + rs)),
        }
    };
    let bus_bw = hw.ring_bus_bw();
    let ring = if n > 1.0 { (n - 1.0) / n } else { 0.0 };
    // One device moves nothing (and needs no bandwidth: 0 / 0 would be NaN).
    let time = |bytes: f64| if n > 1.0 { ring * bytes / bus_bw } else { 0.0 };
    Comm {
        bytes_per_sync: per_sync,
        bytes_per_step: per_step,
        bus_bw,
        unit_rs_s: time(rs),
        unit_ag_s: time(ag),
        step_s: time(per_step),
    }
}
