//! Memory per device (and per node's host) for one strategy and micro-batch.
//!
//! Model states follow the ZeRO paper (arXiv 1910.02054, section 5 and Figure 1): with N
//! data-parallel devices, DDP holds (w + g + o)P, ZeRO-1 (w + g)P + oP/N, ZeRO-2 wP + (g + o)P/N,
//! ZeRO-3 (w + g + o)P/N, where w, g, o are the bytes per parameter of weights, gradients and
//! optimizer states ([`crate::setup::state_bytes`]). Offloading the optimizer moves o (and a
//! gradient copy) to host memory; offloading parameters (ZeRO-3) moves w too.

use serde::Serialize;

use crate::activation::activations;
use crate::ds_estimate::{self, Formula};
use crate::hardware::Hardware;
use crate::model::ModelSpec;
use crate::setup::{state_bytes, Accounting, Setup, StateBytes};
use crate::strategy::{Stage, Strategy};

/// Bytes held by one device at its peak, by kind.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct DeviceMemory {
    /// Parameters (the working copy, sharded under ZeRO-3).
    pub params: f64,
    /// Gradients (sharded under ZeRO-2/3).
    pub grads: f64,
    /// Optimizer states including the fp32 master copy (sharded under ZeRO-1/2/3).
    pub optimizer: f64,
    /// Activations of one micro-batch.
    pub activations: f64,
    /// Communication buffers: two gradient buckets; under ZeRO-3 also the gathered units.
    pub buckets: f64,
    /// CUDA context and library workspaces.
    pub runtime: f64,
    /// Allocator fragmentation allowance.
    pub fragmentation: f64,
    /// Sum of the above.
    pub total: f64,
    /// Device capacity.
    pub capacity: f64,
    /// Capacity less the safety margin: what `total` must stay under.
    pub usable: f64,
}

impl DeviceMemory {
    /// Parameters + gradients + optimizer states.
    pub fn model_states(&self) -> f64 {
        self.params + self.grads + self.optimizer
    }
}

/// Host memory one node needs for offload.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct HostMemory {
    /// Bytes needed on one node (all its ranks together).
    pub needed: f64,
    /// Node's host memory.
    pub capacity: f64,
    /// Capacity less the safety margin.
    pub usable: f64,
}

/// Memory of one strategy at one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct MemoryEstimate {
    /// Per device.
    pub device: DeviceMemory,
    /// Per node's host.
    pub host: HostMemory,
    /// Device and host both fit under their margins.
    pub fits: bool,
}

/// Bytes per device of weights, gradients and optimizer states, `[w, g, o]`, under `stage`
/// with `world` data-parallel devices and nothing offloaded: the ZeRO paper's sharding rule,
/// defined here once (ZeRO-1 shards o, ZeRO-2 also g, ZeRO-3 also w).
pub fn model_states_by_kind(params: u64, bytes: StateBytes, stage: Stage, world: u64) -> [f64; 3] {
    let (p, n) = (params as f64, world as f64);
    let shard = |b: f64, sharded: bool| if sharded { b * p / n } else { b * p };
    [
        shard(bytes.weight, stage == Stage::Zero3),
        shard(bytes.grad, stage >= Stage::Zero2),
        shard(bytes.optimizer, stage >= Stage::Zero1),
    ]
}

/// Estimates memory for `strategy` with `micro` sequences per device.
pub fn estimate(
    model: &ModelSpec,
    hw: &Hardware,
    setup: &Setup,
    strategy: Strategy,
    micro: u64,
) -> MemoryEstimate {
    let p = model.params as f64;
    let n = hw.world_size() as f64;
    let sb = state_bytes(setup.precision, setup.optimizer);

    // Model states, stoker's accounting: the sharding rule, less what is offloaded.
    let st = strategy.stage;
    let [w, g, o] = model_states_by_kind(model.params, sb, st, hw.world_size());
    let mut params = if strategy.offload_params { 0.0 } else { w };
    let mut grads = if strategy.offload_optimizer && st >= Stage::Zero2 {
        0.0 // reduced shards stream straight to the host through the buckets
    } else {
        g
    };
    let mut optimizer = if strategy.offload_optimizer { 0.0 } else { o };
    let shard = |bytes: f64, sharded: bool| if sharded { bytes * p / n } else { bytes * p };
    let per_rank_host = if strategy.offload_optimizer {
        let sharded = st >= Stage::Zero1;
        shard(sb.host_offload, sharded)
            + if strategy.offload_params {
                sb.weight * p / n
            } else {
                0.0
            }
    } else {
        0.0
    };
    let mut host_needed = per_rank_host * hw.devices_per_node as f64;

    // Buffers: two gradient buckets; ZeRO-3 also holds the unit being used and the one being
    // prefetched, plus the unit's gradients before their reduce-scatter.
    let mut buckets = 2.0 * setup.bucket_bytes.min(sb.grad * p);
    if st == Stage::Zero3 {
        let unit = model.gather_unit().unwrap_or(0) as f64;
        buckets += unit * (2.0 * sb.weight + sb.grad);
    }

    // DeepSpeed's accounting replaces the model states (and the ZeRO-3 gathered layer).
    let formula = match setup.accounting {
        Accounting::Stoker => None,
        Accounting::Deepspeed => Some(Formula::Current),
        Accounting::DeepspeedLegacy => Some(Formula::Legacy),
    };
    if let Some(formula) = formula {
        let largest = model.largest_layer.unwrap_or(0) as f64;
        if let Some(ds) =
            ds_estimate::estimate(p, largest, hw.devices_per_node, hw.nodes, strategy, formula)
        {
            params = ds.gpu_params;
            grads = ds.gpu_grads;
            optimizer = ds.gpu_optimizer;
            host_needed = ds.cpu_per_node;
            buckets = 2.0 * setup.bucket_bytes.min(sb.grad * p);
        }
    }

    let acts = match &model.arch {
        Some(arch) => {
            activations(
                arch,
                micro,
                setup.seq_len,
                setup.precision.activation_bytes(),
                setup.checkpoints(st, hw.world_size()),
                setup.flash_attention,
            )
            .total
        }
        None => 0.0,
    };
    let allocated = params + grads + optimizer + acts + buckets;
    let fragmentation = setup.fragmentation * allocated;
    let total = allocated + fragmentation + hw.runtime_reserve;
    let keep = 1.0 - setup.safety_margin;
    let device = DeviceMemory {
        params,
        grads,
        optimizer,
        activations: acts,
        buckets,
        runtime: hw.runtime_reserve,
        fragmentation,
        total,
        capacity: hw.device_capacity(),
        usable: hw.device_capacity() * keep,
    };
    let host = HostMemory {
        needed: host_needed,
        capacity: hw.host_memory,
        usable: hw.host_memory * keep,
    };
    let host_fits = host.needed == 0.0 || host.needed <= host.usable;
    MemoryEstimate {
        device,
        host,
        fits: device.total <= device.usable && host_fits,
    }
}
