//! The hardware: devices, memory, peak FLOP/s per dtype, links; presets for common nodes.
//!
//! Preset numbers are vendor datasheet values (dense, no sparsity) or, for `cpu`, what was
//! measured on stoker's 2-core build machine (REFERENCES.md; the measurements are in
//! docs/benchmarks.md, "Measurements behind code constants").

use std::collections::BTreeMap;

use serde::Serialize;

use crate::error::{PlanError, Result};
use crate::setup::Dtype;

/// Bytes in a GiB.
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
/// Bytes in the MiB that `bucket_mb` counts (PyTorch's `bucket_cap_mb` is MiB too).
pub const MIB: f64 = 1024.0 * 1024.0;
/// Bytes in a GB (the ZeRO paper's unit).
pub const GB: f64 = 1e9;

/// How a device runs one dtype's matrix multiplies.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DtypeSupport {
    /// Peak dense FLOP/s for matmuls in this dtype.
    pub peak_flops: f64,
    /// False when the dtype is emulated (converted to f32 around each op).
    pub native: bool,
    /// Model FLOP utilization of this dtype's peak measured on this hardware, where it
    /// differs from the preset's default (a CPU's bf16 tile units are so fast that a
    /// training step there is bound by everything else).
    pub mfu: Option<f64>,
}

/// A cluster of identical nodes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Hardware {
    /// Preset name or "custom".
    pub name: String,
    /// Accelerators (or CPU ranks) per node.
    pub devices_per_node: u64,
    /// Number of nodes.
    pub nodes: u64,
    /// Memory of one device, bytes.
    pub device_memory: f64,
    /// Host (CPU) memory of one node, bytes.
    pub host_memory: f64,
    /// Host CPU cores per node (bounds the loader's workers).
    pub host_cores: u64,
    /// Matmul support per dtype; a missing dtype is unsupported.
    pub dtypes: BTreeMap<Dtype, DtypeSupport>,
    /// Achievable ring bus bandwidth inside a node, bytes/s.
    pub intra_node_bw: f64,
    /// Network bandwidth of one node (all NICs together), bytes/s.
    pub inter_node_bw: f64,
    /// What a CPU node's cores can push through its network stack, bytes/s (0: unknown,
    /// taken as `intra_node_bw`); see `stoker_plan::time`.
    pub host_net_bw: f64,
    /// Host<->device link (PCIe) per device, bytes/s, used by offload.
    pub host_link_bw: f64,
    /// Host memory bandwidth of one node, bytes/s, used by the CPU optimizer step.
    pub host_mem_bw: f64,
    /// One device's memory bandwidth, bytes/s (0: unknown): what the memory-bound
    /// kernels of a GPU's resident step run at (`stoker_gpu::forecast`).
    pub device_mem_bw: f64,
    /// Memory taken before the first tensor (CUDA context, cuBLAS/NCCL workspaces), bytes.
    pub runtime_reserve: f64,
    /// Model FLOP utilization assumed when the user gives none.
    pub default_mfu: f64,
    /// A fused attention kernel (FlashAttention) is available, so no s x s matrix is stored.
    pub fused_attention: bool,
    /// The devices are accelerators fed over a host link, so pinned staging buffers help
    /// (false for CPU ranks, which train in host memory).
    pub accelerator: bool,
}

/// Known hardware presets: (name, what it is).
pub const HARDWARE_PRESETS: &[(&str, &str)] = &[
    (
        "a100-80gb",
        "DGX A100 640GB node: 8 x A100-SXM4-80GB, NVLink3, 8 x 200 Gb/s HDR, 2 TB host",
    ),
    (
        "h100-80gb",
        "DGX H100 node: 8 x H100-SXM5-80GB, NVLink4, 8 x 400 Gb/s NDR",
    ),
    (
        "h200-141gb",
        "DGX H200 node: 8 x H200-SXM-141GB, NVLink4, 8 x 400 Gb/s NDR",
    ),
    (
        "cpu",
        "stoker's 2-core build machine: one CPU rank, 24 GiB, bf16 on AMX, fp16 emulated",
    ),
];

fn support(tflops: f64, native: bool) -> DtypeSupport {
    DtypeSupport {
        peak_flops: tflops * 1e12,
        native,
        mfu: None,
    }
}

/// The preset `name` stands for, by its canonical name (`h100` is `h100-80gb`, `CPU` and
/// `cpu-only` are `cpu`): the one place the aliases live. None where no preset has it.
pub fn canonical_preset(name: &str) -> Option<&'static str> {
    match name.to_ascii_lowercase().as_str() {
        "a100-80gb" | "a100" => Some("a100-80gb"),
        "h100-80gb" | "h100" => Some("h100-80gb"),
        "h200-141gb" | "h200" => Some("h200-141gb"),
        "cpu" | "cpu-only" => Some("cpu"),
        _ => None,
    }
}

/// Whether `name` is the `cpu` preset, in any case or alias: the preset a CPU config's
/// plan of this machine is made on.
pub fn is_cpu_preset(name: &str) -> bool {
    canonical_preset(name) == Some("cpu")
}

/// Looks up a hardware preset (case-insensitive); unknown names list the known ones.
pub fn preset(name: &str) -> Result<Hardware> {
    let key = canonical_preset(name).unwrap_or_default();
    let gpu = |mem_mib: f64,
               hbm_tbyte_s: f64,
               fp32: f64,
               half: f64,
               fp8: Option<f64>,
               nvlink: f64,
               nic_gbit: f64| {
        let mut dtypes = BTreeMap::new();
        dtypes.insert(Dtype::Fp32, support(fp32, true));
        dtypes.insert(Dtype::Fp16, support(half, true));
        dtypes.insert(Dtype::Bf16, support(half, true));
        if let Some(f) = fp8 {
            dtypes.insert(Dtype::Fp8, support(f, true));
        }
        Hardware {
            name: name.to_ascii_lowercase(),
            devices_per_node: 8,
            nodes: 1,
            device_memory: mem_mib * 1024.0 * 1024.0,
            host_memory: 0.0,
            host_cores: 0,
            dtypes,
            // 80% of NVLink's one-direction bandwidth: what nccl-tests' busbw reaches.
            intra_node_bw: 0.8 * nvlink * GB,
            inter_node_bw: nic_gbit * 1e9 / 8.0,
            host_net_bw: 0.0,
            host_link_bw: 0.0,
            host_mem_bw: 0.0,
            device_mem_bw: hbm_tbyte_s * 1e12,
            runtime_reserve: GIB,
            default_mfu: 0.4,
            fused_attention: true,
            accelerator: true,
        }
    };
    let hw = match key {
        // A100 SXM: 19.5 TF fp32 (no TF32), 312 TF fp16/bf16, no fp8; 81920 MiB reported;
        // 2.039 TB/s HBM2e. Host: the DGX A100 640GB's 2 TB (the 320GB model's is 1 TB).
        "a100-80gb" => Hardware {
            host_memory: 2048.0 * GB,
            host_cores: 128,
            host_link_bw: 25.0 * GB, // PCIe Gen4 x16, ~80% of 32 GB/s
            host_mem_bw: 300.0 * GB, // 2 x EPYC 7742, 16 channels DDR4-3200, ~75% of peak
            ..gpu(81920.0, 2.039, 19.5, 312.0, None, 300.0, 8.0 * 200.0)
        },
        // H100 SXM: 67 TF fp32, 989 TF fp16/bf16, 1979 TF fp8 (dense); 81559 MiB reported;
        // 3.35 TB/s HBM3.
        "h100-80gb" => Hardware {
            host_memory: 2048.0 * GB,
            host_cores: 112,
            host_link_bw: 50.0 * GB, // PCIe Gen5 x16, ~80% of 64 GB/s
            host_mem_bw: 450.0 * GB, // 2 x Xeon 8480C, 16 channels DDR5-4800, ~75% of peak
            ..gpu(81559.0, 3.35, 67.0, 989.0, Some(1979.0), 450.0, 8.0 * 400.0)
        },
        // H200 SXM: H100's compute with 141 GB HBM3e at 4.8 TB/s; 143771 MiB reported.
        "h200-141gb" => Hardware {
            host_memory: 2048.0 * GB,
            host_cores: 112,
            host_link_bw: 50.0 * GB,
            host_mem_bw: 450.0 * GB,
            ..gpu(143771.0, 4.8, 67.0, 989.0, Some(1979.0), 450.0, 8.0 * 400.0)
        },
        "cpu" => {
            let mut dtypes = BTreeMap::new();
            // Per-core peaks from `cargo bench -p stoker-kernels --bench peak` times 2 cores
            // (AVX-512 f32 FMA, AMX bf16; fp16 is candle's emulation), and MFUs from the
            // 822K GPT training step of `make bench-step`: docs/benchmarks.md, "Measurements
            // behind code constants".
            dtypes.insert(
                Dtype::Fp32,
                DtypeSupport {
                    mfu: Some(0.40),
                    ..support(0.426, true)
                },
            );
            dtypes.insert(Dtype::Fp16, support(0.065, false));
            dtypes.insert(
                Dtype::Bf16,
                DtypeSupport {
                    mfu: Some(0.037),
                    ..support(6.26, true)
                },
            );
            Hardware {
                name: "cpu".into(),
                devices_per_node: 1,
                nodes: 1,
                device_memory: 24.0 * GIB,
                host_memory: 24.0 * GIB,
                host_cores: 2,
                dtypes,
                // MPICH, 2 ranks: the bus bandwidth of the DDP gradient buckets of a
                // 10.7M-parameter GPT all-reduced alone (`make bench-ddp`; docs/benchmarks.md,
                // "Measurements behind code constants").
                intra_node_bw: 3.8 * GB,
                inter_node_bw: 10e9 / 8.0,
                host_net_bw: 0.0,
                host_link_bw: 8.0 * GB, // "offload" to the same RAM: a memcpy
                host_mem_bw: 8.0 * GB,
                device_mem_bw: 8.0 * GB, // the device is the host
                runtime_reserve: 0.0,
                default_mfu: 0.40,
                // stoker's attention (the direct step, the fused op) saves each row's
                // log-sum-exp and recomputes one head's T x T scores at a time in backward.
                fused_attention: true,
                accelerator: false,
            }
        }
        _ => {
            return Err(PlanError::UnknownPreset {
                kind: "hardware",
                name: name.to_string(),
                known: HARDWARE_PRESETS
                    .iter()
                    .map(|p| p.0)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        }
    };
    Ok(hw)
}

impl Hardware {
    /// Total devices: the data-parallel world size.
    pub fn world_size(&self) -> u64 {
        self.devices_per_node * self.nodes
    }

    /// Bus bandwidth of a ring over all devices: NVLink inside one node; across nodes the
    /// ring crosses each node's NICs, which bound it (NCCL runs one ring per NIC).
    pub fn ring_bus_bw(&self) -> f64 {
        if self.nodes <= 1 {
            self.intra_node_bw
        } else {
            self.intra_node_bw.min(self.inter_node_bw)
        }
    }

    /// Support of `dtype`, if the device has it.
    pub fn dtype(&self, dtype: Dtype) -> Option<&DtypeSupport> {
        self.dtypes.get(&dtype)
    }

    /// The memory one device has to itself: an accelerator's own; on CPUs the host's
    /// memory shared by the ranks on it (as its FLOP/s are, [`Self::device_peak_flops`]).
    pub fn device_capacity(&self) -> f64 {
        match self.accelerator {
            true => self.device_memory,
            false => self.device_memory / self.devices_per_node.max(1) as f64,
        }
    }

    /// Peak dense FLOP/s of one device in `dtype`: an accelerator's own; CPU ranks on one
    /// node share its cores, whose peak the preset (or the calibration) gives, so each
    /// rank has the node's peak over the ranks on it.
    pub fn device_peak_flops(&self, dtype: Dtype) -> Option<f64> {
        let node = self.dtype(dtype)?.peak_flops;
        Some(match self.accelerator {
            true => node,
            false => node / self.devices_per_node.max(1) as f64,
        })
    }
}
