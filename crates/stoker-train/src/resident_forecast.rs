//! A config's GPU-resident step timed before it runs (`stoker_gpu::forecast`): the step's
//! own code counted over a device that runs nothing, each launch and product put on the
//! plan's GPU by its roofline. `stoker plan` prints where the time goes, and its rows take
//! the forecast's MFU where the config gives none.

use stoker_gpu::forecast::{
    forecast, gpt_step_work_in, llama_step_work_in, GpuFigures, StepForecast,
};
use stoker_gpu::measured::{measured_in, MeasuredGpu};
use stoker_gpu::Dtype;
use stoker_plan::hardware::Hardware;

use crate::config::TrainConfig;
use crate::error::Result;
use crate::models::ModelConfig;
use crate::precision::Precision;

/// A config's step on one device of a plan's hardware.
#[derive(Debug, Clone)]
pub struct ResidentForecast {
    /// A micro-batch: where its time goes.
    pub micro_batch: StepForecast,
    /// The update after a window.
    pub update: StepForecast,
    /// The GPU's figures it was timed at.
    pub figures: GpuFigures,
    /// Where the figures' efficiencies were measured (`stoker_gpu::measured`), or None
    /// where they are assumed.
    pub measured: Option<&'static MeasuredGpu>,
    /// FLOPs of one micro-batch's step as llm.c counts them (6N + 6LCT a token), for MFU.
    pub model_flops: f64,
    /// Sequences and positions of the micro-batch.
    pub shape: (usize, usize),
    /// Micro-batches a window (the update's share of each is 1 / this).
    pub accumulation: usize,
}

impl ResidentForecast {
    /// Seconds a micro-batch takes with its share of the update.
    pub fn micro_batch_s(&self) -> f64 {
        self.micro_batch.total_s() + self.update.total_s() / self.accumulation.max(1) as f64
    }

    /// MFU as llm.c counts it, at the forecast time.
    pub fn mfu(&self) -> f64 {
        self.model_flops / (self.figures.peak_flops * self.micro_batch_s())
    }

    /// One line: the time and what it goes to.
    pub fn line(&self) -> String {
        let f = &self.micro_batch;
        let ms = |s: f64| s * 1e3;
        let top: Vec<String> = f
            .kernels
            .iter()
            .take(3)
            .map(|k| format!("{} {:.2}", k.kernel, ms(k.seconds)))
            .collect();
        // Flash attention's kernels run on tensor cores: their FLOPs at their own fraction.
        let tensor = match f.kernels.iter().any(|k| k.kernel.starts_with("flash_")) {
            true => format!(
                ", flash attention's at {:.0}% of peak",
                100.0 * self.figures.tensor_kernel_efficiency
            ),
            false => String::new(),
        };
        // FP8's linear layers: their products at FP8's peak (MFU stays over the bf16 peak,
        // as llm.c and the issue count it).
        let fp8 = match f.fp8_products_s > 0.0 {
            true => format!(
                " (of them the FP8 linear layers' {:.2} ms at FP8's {:.0} TFLOP/s)",
                ms(f.fp8_products_s),
                self.figures.fp8_peak_flops / 1e12
            ),
            false => String::new(),
        };
        format!(
            "resident step forecast (micro-batch {} x {}, one device): {:.2} ms a micro-batch \
             with 1/{} of the update's {:.2} ms, MFU {:.1}% (llm.c's count); the micro-batch's \
             products {:.2} ms at {:.0}% of peak{fp8}, attention's per-head products {:.2} ms, \
             kernels {:.2} ms at {:.0}% of {:.0} GB/s{tensor} (largest: {}), {} launches; {}",
            self.shape.0,
            self.shape.1,
            ms(self.micro_batch_s()),
            self.accumulation.max(1),
            ms(self.update.total_s()),
            100.0 * self.mfu(),
            ms(f.products_s),
            100.0 * self.figures.product_efficiency,
            ms(f.batched_products_s),
            ms(f.kernels_s()),
            100.0 * self.figures.memory_efficiency,
            self.figures.mem_bw / 1e9,
            top.join(", "),
            f.launches,
            match self.measured {
                Some(m) => format!("the efficiencies measured on {} on {}", m.gpu, m.date),
                None => "the efficiencies are assumed until a device run measures them".into(),
            }
        )
    }
}

/// The forecast of `cfg`'s resident step at `precision` on one device of `hw`: None off
/// the resident step, on hardware that is no accelerator, or where the device's memory
/// bandwidth or the precision's peak is unknown.
pub fn resident_forecast(
    cfg: &TrainConfig,
    hw: &Hardware,
    precision: Precision,
) -> Result<Option<ResidentForecast>> {
    resident_forecast_in(cfg, hw, precision, stoker_gpu::measured::MEASURED)
}

/// [`resident_forecast`] with the measured efficiencies of `measured` (a GPU's row,
/// where `hw`'s preset has one) in place of `stoker_gpu::measured::MEASURED`.
pub fn resident_forecast_in(
    cfg: &TrainConfig,
    hw: &Hardware,
    precision: Precision,
    measured: &'static [MeasuredGpu],
) -> Result<Option<ResidentForecast>> {
    if !cfg.resident_step() || !hw.accelerator || hw.device_mem_bw <= 0.0 {
        return Ok(None);
    }
    let Ok(dtype) = crate::precision::resident_activations(precision) else {
        return Ok(None);
    };
    let plan_dtype = match dtype {
        Dtype::F32 => stoker_plan::setup::Dtype::Fp32,
        Dtype::Bf16 => stoker_plan::setup::Dtype::Bf16,
        Dtype::F16 => stoker_plan::setup::Dtype::Fp16,
    };
    let Some(peak) = hw.dtype(plan_dtype).map(|d| d.peak_flops) else {
        return Ok(None);
    };
    let b = cfg.batch.micro_batch;
    let opts = cfg.resident_options();
    let gpu_err = |e: stoker_gpu::GpuError| {
        crate::error::config_err("model", format!("the resident step's forecast: {e}"))
    };
    let (work, t, layers, width) = match &cfg.model {
        ModelConfig::Gpt(g) => {
            let d = g.dims();
            let work = gpt_step_work_in(dtype, d, (b, d.context), opts);
            (work, d.context, d.n_layer, d.d_model)
        }
        ModelConfig::Llama(l) => {
            let d = l.dims();
            let work = llama_step_work_in(dtype, d, (b, d.context), opts);
            (work, d.context, d.n_layer, d.d_model)
        }
        ModelConfig::Cnn(_) | ModelConfig::Mlp(_) => return Ok(None),
    };
    let work = work.map_err(gpu_err)?;
    let params = work.params;
    // The preset's measured efficiencies where a device run gave them.
    let measured = measured_in(measured, &hw.name);
    // The FP8 linear layers' products at FP8's peak where the device has one.
    let fp8_peak = match precision {
        Precision::Fp8 => hw
            .dtype(stoker_plan::setup::Dtype::Fp8)
            .map_or(0.0, |d| d.peak_flops),
        _ => 0.0,
    };
    let figures =
        GpuFigures::assumed(peak, hw.device_mem_bw, hw.host_link_bw).with_fp8_peak(fp8_peak);
    let figures = match measured {
        Some(m) => figures.with_efficiencies(&m.efficiencies),
        None => figures,
    };
    let tokens = (b * t) as f64;
    Ok(Some(ResidentForecast {
        micro_batch: forecast(&work.micro_batch, &figures),
        update: forecast(&work.update, &figures),
        figures,
        measured,
        model_flops: tokens * (6.0 * params as f64 + 6.0 * (layers * width * t) as f64),
        shape: (b, t),
        // Given, or DeepSpeed's rule over the plan's devices where only the global
        // batch is.
        accumulation: cfg.batch.accumulation_steps.unwrap_or_else(|| {
            let per_step = b * hw.world_size() as usize;
            cfg.batch
                .global_batch
                .map_or(1, |g| (g / per_step.max(1)).max(1))
        }),
    }))
}
