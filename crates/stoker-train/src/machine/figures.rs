//! The machine's own figures, whatever the config: the GEMM rate per dtype, host memory
//! bandwidth and the in-process all-reduce's bus bandwidth, each measured with stoker's
//! own code.

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use stoker_comm::communicator::CommExt;
use stoker_plan::input::HardwareInput;

use super::timing::median_s;
use crate::error::{config_err, Result};

/// The machine's own figures, measured whatever the config: what a machine profile
/// keeps, and what a plan puts in place of a preset's constants.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineFigures {
    /// Logical CPUs this process may use.
    pub cores: usize,
    /// f32 GEMM rate, TFLOP/s.
    pub fp32_tflops: f64,
    /// bf16-operand GEMM rate (f32 accumulation), TFLOP/s.
    pub bf16_tflops: f64,
    /// Host memory bandwidth of a large copy, GB/s (read + write counted once, as
    /// memcpy benchmarks report it).
    pub host_mem_gbyte_s: f64,
    /// All-reduce bus bandwidth of the in-process backend between 2 ranks, GB/s.
    pub allreduce_gbyte_s: f64,
}

/// The dtypes whose GEMM rate the figures hold.
const MEASURED_DTYPES: [&str; 2] = ["fp32", "bf16"];

impl MachineFigures {
    /// Measures them (GEMMs, a copy, an all-reduce: about a second).
    pub fn measure() -> Result<Self> {
        Ok(MachineFigures {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            fp32_tflops: gemm_tflops(false)?,
            bf16_tflops: gemm_tflops(true)?,
            host_mem_gbyte_s: host_mem_gbyte_s()?,
            allreduce_gbyte_s: allreduce_gbyte_s()?,
        })
    }

    /// The measured GEMM rate of the planner's dtype `dtype`, TFLOP/s; None for one that
    /// is not measured (fp16, fp8: the preset's peak stands).
    pub fn peak_tflops(&self, dtype: &str) -> Option<f64> {
        match dtype {
            "fp32" => Some(self.fp32_tflops),
            "bf16" => Some(self.bf16_tflops),
            _ => None,
        }
    }

    /// The figures as planner inputs: `hardware` gets the peaks, links and cores (on top
    /// of the `cpu` preset unless it names another).
    pub fn apply(&self, hardware: &mut HardwareInput) {
        if hardware.preset.is_none() {
            hardware.preset = Some("cpu".into());
        }
        let peaks = hardware.peak_tflops.get_or_insert_with(Default::default);
        for dtype in MEASURED_DTYPES {
            if let Some(tflops) = self.peak_tflops(dtype) {
                peaks.insert(dtype.into(), tflops);
            }
        }
        hardware.emulated = super::emulated_dtypes();
        hardware.host_cores = Some(self.cores as i64);
        hardware.host_mem_gbyte_s = Some(self.host_mem_gbyte_s);
        hardware.host_link_gbyte_s = Some(self.host_mem_gbyte_s);
        hardware.intra_node_gbyte_s = Some(self.allreduce_gbyte_s);
    }

    /// A table for people.
    pub fn to_text(&self) -> String {
        format!(
            "calibration of this machine ({} cores):\n\
             \x20 GEMM fp32          {:>8.3} TFLOP/s  (2048 x 1024 x 1024, stoker's kernels)\n\
             \x20 GEMM bf16 operands {:>8.3} TFLOP/s  ({})\n\
             \x20 host memory        {:>8.2} GB/s     (256 MiB copy)\n\
             \x20 all-reduce         {:>8.2} GB/s     (bus bandwidth, 2 in-process ranks, 16 MiB)\n",
            self.cores,
            self.fp32_tflops,
            self.bf16_tflops,
            match stoker_kernels::bf16_native() {
                true => "stoker's kernels, the CPU's bf16 instructions",
                false => "candle's bf16 matmul: no bf16 hardware, bf16 steps run on the graph",
            },
            self.host_mem_gbyte_s,
            self.allreduce_gbyte_s,
        )
    }
}

/// TFLOP/s of the GEMM a step in this dtype runs, on a 2048 x 1024 x 1024 product: the
/// best of 11 runs, as a peak is what the machine can do; a median draws a busy spell of
/// a shared machine into every MFU planned on it (docs/benchmarks.md, "Measurements
/// behind code constants"). fp32, and bf16 on a CPU with bf16 hardware: stoker's linear
/// layer. bf16 without it: candle's bf16 matmul, which is what a bf16 step runs there (on
/// the graph path; stoker's portable bf16 kernel measured 0.009 TFLOP/s here against the
/// graph step's far higher rate, and every bf16 MFU clamped at 1).
fn gemm_tflops(bf16_operands: bool) -> Result<f64> {
    let (m, k, n) = (2048usize, 1024usize, 1024usize);
    let x = Tensor::rand(-1f32, 1f32, (m, k), &Device::Cpu)?;
    let w = Tensor::rand(-1f32, 1f32, (n, k), &Device::Cpu)?;
    let b = Tensor::zeros(n, candle_core::DType::F32, &Device::Cpu)?;
    let graph_bf16 = bf16_operands && !stoker_kernels::bf16_native();
    let (xh, wt) = (
        x.to_dtype(candle_core::DType::BF16)?,
        w.to_dtype(candle_core::DType::BF16)?.t()?,
    );
    let run = || -> Result<()> {
        match graph_bf16 {
            true => drop(xh.matmul(&wt)?),
            false => drop(stoker_kernels::linear_with(&x, &w, &b, bf16_operands)?),
        }
        Ok(())
    };
    run()?;
    let mut best = f64::INFINITY;
    for _ in 0..11 {
        let t0 = Instant::now();
        run()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(2.0 * (m * k * n) as f64 / best / 1e12)
}

/// GB/s of a 256 MiB copy.
fn host_mem_gbyte_s() -> Result<f64> {
    let len = 256 << 20;
    let src = vec![1u8; len];
    let mut dst = vec![0u8; len];
    let s = median_s(3, || {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        Ok(())
    })?;
    Ok(len as f64 / s / 1e9)
}

/// Bus bandwidth (2 (n-1)/n x bytes / time) of a 16 MiB f32 all-reduce between two
/// ranks of the in-process backend.
fn allreduce_gbyte_s() -> Result<f64> {
    let elems = 4 << 20;
    let times = stoker_comm::local::run_local(2, Duration::from_secs(60), |c| {
        let mut buf = vec![1f32; elems];
        median_s(5, || {
            c.all_reduce(&mut buf)
                .map_err(|e| config_err("calibrate", e.to_string()))
        })
    });
    let mut worst = 0f64;
    for t in times {
        worst = worst.max(t?);
    }
    Ok((4 * elems) as f64 / worst / 1e9)
}
