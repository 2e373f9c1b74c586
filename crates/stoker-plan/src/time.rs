//! Step time: compute from FLOPs at an assumed utilization, exposed communication, offload.
//!
//! Compute: `6P + 12*L*h*s` FLOPs per token for forward + backward (PaLM, arXiv 2204.02311,
//! appendix B); activation checkpointing re-runs the forward, 4/3 of that (and so does
//! ZeRO-3 where it checkpoints its units, `Setup::checkpoints`).
//! Overlap model: gradient reductions hide behind the backward pass (2/3 of a micro-batch's
//! compute); ZeRO-3's prefetched all-gathers hide behind the whole micro-batch; the
//! all-gather of updated parameters after the optimizer step (ZeRO-1/2) is exposed.
//! Offload: gradients go down and updated 16-bit parameters come back over PCIe, and the CPU
//! steps the optimizer at host memory bandwidth (reading and writing its states once);
//! neither is assumed hidden.
//! Activation traffic: where the setup says each activation crosses host memory
//! `activation_passes` times (at f32 width) beyond what the FLOP rate covers (unfused ops
//! writing fresh outputs: candle's graph path), that traffic at host memory bandwidth is
//! added to each micro-batch (and recomputed with the forward under checkpointing).

use serde::Serialize;

use crate::activation::activations;
use crate::comm::Comm;
use crate::hardware::Hardware;
use crate::model::ModelSpec;
use crate::setup::{state_bytes, Setup};
use crate::strategy::{Stage, Strategy};

/// Timing of one optimizer step on one device.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StepTime {
    /// FLOPs one device computes per step (including recomputation).
    pub flops: f64,
    /// Compute time, s.
    pub compute_s: f64,
    /// Collectives, s, if nothing overlapped.
    pub comm_s: f64,
    /// Collectives left exposed with overlap, s.
    pub exposed_comm_s: f64,
    /// PCIe transfers and the CPU optimizer step of offload, s.
    pub offload_s: f64,
    /// Activation traffic beyond the FLOP rate (`Setup::activation_passes`), s; part
    /// of the step, never overlapped.
    pub activation_traffic_s: f64,
    /// Step time without overlap: compute + comm + offload + activation traffic, s.
    pub step_no_overlap_s: f64,
    /// Step time with overlap: compute + exposed comm + offload + activation traffic, s.
    pub step_s: f64,
    /// Global samples (sequences) per second at `step_s`.
    pub samples_per_s: f64,
    /// Global tokens per second at `step_s`.
    pub tokens_per_s: f64,
}

/// Times one step of `strategy` with `micro` x `accum` sequences per device.
#[allow(clippy::too_many_arguments)]
pub fn step_time(
    model: &ModelSpec,
    hw: &Hardware,
    setup: &Setup,
    strategy: Strategy,
    comm: &Comm,
    micro: u64,
    accum: u64,
    peak_flops: f64,
) -> StepTime {
    let recompute = if setup.checkpoints(strategy.stage, hw.world_size()) {
        4.0 / 3.0
    } else {
        1.0
    };
    let tokens_micro = (micro * setup.seq_len) as f64;
    let micro_flops = tokens_micro * model.train_flops_per_token(setup.seq_len) * recompute;
    let micro_s = micro_flops / (peak_flops * setup.mfu);
    let backward_s = micro_s * 2.0 / 3.0;
    let a = accum as f64;
    let (rs, ag) = (comm.unit_rs_s, comm.unit_ag_s);
    let exposed = match (hw.accelerator, strategy.stage) {
        (false, Stage::Zero3) => cpu_zero3_exposed(hw, comm, a * micro_s),
        // On a CPU the cores that compute also run the collectives (the copies, MPI's
        // progress, the TCP stack); DDP's and ZeRO-1/2's wait after the backward: at 1
        // Gbit/s DDP's step grew by 49-58 ms for 52 ms of link time (docs/distributed.md).
        (false, _) => comm.step_s,
        // An accelerator's copy engines and NICs overlap them.
        (true, Stage::Ddp) => (2.0 * rs - backward_s).max(0.0),
        (true, Stage::Zero1) => (rs - backward_s).max(0.0) + ag,
        (true, Stage::Zero2) => a * (rs - backward_s).max(0.0) + ag,
        (true, Stage::Zero3) => a * (2.0 * ag + rs - micro_s).max(0.0),
    };
    let offload_s = offload_time(model, hw, setup, strategy, accum);
    let activation_traffic_s = a * recompute * activation_traffic(model, hw, setup, micro);
    let compute_s = a * micro_s;
    let step_s = compute_s + exposed + offload_s + activation_traffic_s;
    let global = setup.global_batch as f64;
    StepTime {
        flops: a * micro_flops,
        compute_s,
        comm_s: comm.step_s,
        exposed_comm_s: exposed,
        offload_s,
        activation_traffic_s,
        step_no_overlap_s: compute_s + comm.step_s + offload_s + activation_traffic_s,
        step_s,
        samples_per_s: global / step_s,
        tokens_per_s: global * setup.seq_len as f64 / step_s,
    }
}

/// ZeRO-3's exposed collectives on CPU ranks computing for `compute_s` per step: the
/// cores' own part of moving the bytes (the step's collectives at the rate the cores move
/// them: the node's bandwidth, `intra_node_bw`, and across nodes at most what they push
/// through the network stack, `host_net_bw`: copies, TCP) never hides, and the rest of
/// their time on a slower network link (waiting for the wire) hides behind the compute,
/// as the gathers are prefetched a unit ahead and the reduce-scatters left in flight. On
/// one node the two are the same and nothing hides. Measured on the cluster in a box
/// (`make bench-cluster`; docs/benchmarks.md, "Measurements behind code constants").
fn cpu_zero3_exposed(hw: &Hardware, comm: &Comm, compute_s: f64) -> f64 {
    let mut cores_rate = hw.intra_node_bw;
    if hw.nodes > 1 && hw.host_net_bw > 0.0 {
        cores_rate = cores_rate.min(hw.host_net_bw);
    }
    let host_s = match cores_rate > 0.0 {
        true => (comm.step_s * comm.bus_bw / cores_rate).min(comm.step_s),
        false => comm.step_s,
    };
    host_s + (comm.step_s - host_s - compute_s).max(0.0)
}

/// Seconds one micro-batch of `micro` sequences spends moving its activations through
/// host memory `setup.activation_passes` times: the activations it stores (the
/// planner's formula without checkpointing) at f32 width, whatever the precision stores
/// (a CPU's elementwise ops widen 16-bit values to f32: candle's graph path in bf16
/// spends the time fp32 does, docs/plan.md), over the host's memory bandwidth.
fn activation_traffic(model: &ModelSpec, hw: &Hardware, setup: &Setup, micro: u64) -> f64 {
    let Some(arch) = &model.arch else {
        return 0.0;
    };
    // An accelerator's activations live in its own memory: the host's bandwidth says
    // nothing of them. The host's bandwidth is not divided among a node's CPU ranks: the
    // passes were fitted on one rank of two threads, and two ranks of one thread each on
    // candle's graph do not tell whole from halved (docs/plan.md).
    if setup.activation_passes == 0.0 || hw.accelerator || hw.host_mem_bw <= 0.0 {
        return 0.0;
    }
    let bytes = activations(
        arch,
        micro,
        setup.seq_len,
        4.0,
        false,
        setup.flash_attention,
    )
    .total;
    setup.activation_passes * bytes / hw.host_mem_bw
}

fn offload_time(
    model: &ModelSpec,
    hw: &Hardware,
    setup: &Setup,
    strategy: Strategy,
    accum: u64,
) -> f64 {
    if !strategy.offload_optimizer {
        return 0.0;
    }
    let sb = state_bytes(setup.precision, setup.optimizer);
    // Each rank steps its shard; under DDP every rank steps the whole model.
    let shard = if strategy.stage == Stage::Ddp {
        model.params as f64
    } else {
        model.params as f64 / hw.world_size() as f64
    };
    let a = accum as f64;
    // Gradients go down once they are reduced: DDP and ZeRO-1 accumulate on the device
    // and reduce at the last micro-batch only (no_sync), so once per step; ZeRO-2 and
    // ZeRO-3 reduce-scatter every micro-batch, each shard accumulated on the host.
    // Parameters go up once.
    let downs = match strategy.stage {
        Stage::Ddp | Stage::Zero1 => 1.0,
        Stage::Zero2 | Stage::Zero3 => a,
    };
    let mut pcie = downs * shard * sb.grad + shard * sb.weight;
    if strategy.offload_params {
        // Each rank fetches its parameter shard for the forward and again for the backward.
        pcie += a * 2.0 * shard * sb.weight;
    }
    let cpu_bytes = hw.devices_per_node as f64 * shard * 2.0 * sb.host_offload;
    pcie / hw.host_link_bw + cpu_bytes / hw.host_mem_bw
}
