//! The trainer: one model, its flat FP32 master buffer and gradient buffer, the optimizer,
//! the schedule, the loss scaler (fp16) and the FP8 scalers (fp8); one optimizer step per
//! accumulation window.

use candle_core::{Device, Tensor};
use stoker_data::SamplerState;
use stoker_precision::{LossScaler, ScalerConfig, StepDecision};

use crate::accumulate::{
    accumulate, accumulate_direct, AccumulateOptions, MicroBatch, Normalization,
};
use crate::clip::{clip_to, global_norm};
use crate::config::{ModelConfig, OptimizerKind, TrainConfig};
use crate::error::{Result, TrainError};
use crate::layout::FlatLayout;
use crate::loss::{cross_entropy_sum, scalar};
use crate::models::{Cnn, DirectStep, Gpt, LossKind, Mlp, Model};
use crate::optim::{segments, AdamW, Optimizer, Sgd};
use crate::precision::{Fp8State, Fx, Kernels, Precision};
use crate::schedule::Schedule;

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// The optimizer step just finished (1-based count of steps taken, skipped included).
    pub step: u64,
    /// Mean loss over the window's valid targets.
    pub loss: f64,
    /// Valid targets (tokens or samples) in the window.
    pub count: usize,
    /// Global gradient norm after unscaling, before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Loss scale used (1 without scaling).
    pub loss_scale: f32,
    /// Why the step was skipped (fp16 overflow), if it was.
    pub skipped: Option<String>,
}

/// Result of an evaluation pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalReport {
    /// Mean loss over valid targets.
    pub loss: f64,
    /// Top-1 accuracy over valid targets.
    pub accuracy: f64,
    /// Valid targets seen.
    pub count: usize,
}

/// Builds the configured model with its variables in `kernels.param_dtype(precision)`.
pub fn build_model(
    model: &ModelConfig,
    precision: Precision,
    kernels: Kernels,
    seed: u64,
) -> Result<Box<dyn Model>> {
    let (dev, dt) = (Device::Cpu, kernels.param_dtype(precision));
    Ok(match model {
        ModelConfig::Gpt(c) => Box::new(Gpt::new(*c, &dev, dt, seed)?),
        ModelConfig::Cnn(c) => Box::new(Cnn::new(*c, &dev, dt, seed)?),
        ModelConfig::Mlp(c) => Box::new(Mlp::new(c.clone(), &dev, dt, seed)?),
    })
}

/// The training state.
pub struct Trainer {
    /// The model (its variables hold compute-dtype copies of `master`; while the direct
    /// step trains they are refreshed on demand, see [`Trainer::sync_vars`]).
    pub model: Box<dyn Model>,
    /// Whether the model's variables lag `master` (the direct step does not read them).
    vars_stale: std::cell::Cell<bool>,
    /// The model's direct training step, where `kernels = "direct"` gives it one.
    direct: Option<Box<dyn DirectStep>>,
    /// The flat layout of `master` and `grads`.
    pub layout: FlatLayout,
    /// FP32 master weights.
    pub master: Vec<f32>,
    grads: Vec<f32>,
    /// The optimizer over `master`.
    pub optimizer: Box<dyn Optimizer>,
    /// The learning-rate schedule.
    pub schedule: Schedule,
    /// Dynamic loss scaler (fp16 only).
    pub scaler: Option<LossScaler>,
    /// FP8 delayed scalers (fp8 only).
    pub fp8: Option<Fp8State>,
    precision: Precision,
    kernels: Kernels,
    /// bf16 copy of `master` the optimizer writes in its pass (bf16 precision only).
    bf16_copy: Option<Vec<half::bf16>>,
    grad_clip: f64,
    /// Optimizer steps taken (skipped ones included).
    pub step: u64,
    /// Where the training loader stands after the last step.
    pub sampler_state: SamplerState,
}

impl Trainer {
    /// Builds model, buffers, optimizer, schedule and scalers from `config`.
    pub fn new(config: &TrainConfig) -> Result<Self> {
        let model = build_model(&config.model, config.precision, config.kernels, config.seed)?;
        Self::with_model(config, model)
    }

    /// As [`Trainer::new`] with an already built model.
    pub fn with_model(config: &TrainConfig, model: Box<dyn Model>) -> Result<Self> {
        let layout = FlatLayout::of(model.params())?;
        let master = layout.flatten(model.params())?;
        let o = &config.optimizer;
        let len = layout.total_len();
        let optimizer: Box<dyn Optimizer> = match o.kind {
            OptimizerKind::Adamw => Box::new(AdamW::new(o.adamw(), segments(&layout, false), len)),
            OptimizerKind::Sgd => Box::new(Sgd::new(o.sgd(), segments(&layout, false), len)),
        };
        let scaler = match config.precision.needs_loss_scaling() {
            true => Some(LossScaler::new(ScalerConfig::torch())?),
            false => None,
        };
        let fp8 = (config.precision == Precision::Fp8).then(|| Fp8State::new(Default::default()));
        let direct = match config.kernels.direct_step(config.precision) {
            true => model.direct_step(&layout, config.precision == Precision::Bf16)?,
            false => None,
        };
        Ok(Trainer {
            model,
            vars_stale: std::cell::Cell::new(false),
            direct,
            grads: vec![0.0; len],
            layout,
            master,
            optimizer,
            schedule: config.schedule(),
            scaler,
            fp8,
            precision: config.precision,
            kernels: config.kernels,
            bf16_copy: (config.kernels.param_dtype(config.precision) == candle_core::DType::BF16)
                .then(|| vec![half::bf16::ZERO; len]),
            grad_clip: o.grad_clip,
            step: 0,
            sampler_state: SamplerState::default(),
        })
    }

    /// The forward context.
    pub fn fx(&self) -> Fx<'_> {
        Fx::new(self.precision, self.fp8.as_ref()).with_kernels(self.kernels)
    }

    /// The precision mode.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Whether training steps run the model's direct step (no autograd graph).
    pub fn direct(&self) -> bool {
        self.direct.is_some()
    }

    /// One optimizer step over an accumulation window.
    pub fn train_step(&mut self, window: &[MicroBatch]) -> Result<StepReport> {
        let step = self.step;
        stoker_kernels::flat::zero(&mut self.grads);
        let loss_scale = self.scaler.as_ref().map_or(1.0, |s| s.scale());
        let fx = Fx::new(self.precision, self.fp8.as_ref()).with_kernels(self.kernels);
        let opts = AccumulateOptions {
            norm: Normalization::WindowCount,
            loss_scale: loss_scale as f64,
            check_grads: step == 0,
        };
        let r = match &mut self.direct {
            Some(step) => {
                accumulate_direct(&mut **step, window, opts, &self.master, &mut self.grads)?
            }
            None => accumulate(
                &*self.model,
                &fx,
                window,
                opts,
                &self.layout,
                &mut self.grads,
            )?,
        };
        let lr = self.schedule.lr_at(step);
        let mut report = StepReport {
            step: step + 1,
            loss: r.loss,
            count: r.count,
            grad_norm: 0.0,
            lr,
            loss_scale,
            skipped: None,
        };
        if let Some(scaler) = &mut self.scaler {
            let table = self.layout.param_table();
            let found_inf = scaler.unscale_and_check(&mut self.grads, Some(&table))?;
            if let StepDecision::Skip(rep) = scaler.update(found_inf) {
                report.skipped = Some(format!("{rep:?}"));
                self.step += 1;
                return Ok(report);
            }
        }
        // One pass: the f64 norm is finite exactly when every gradient is, so the scan for
        // the offending parameter runs only on failure.
        let norm = global_norm(&self.grads);
        if self.scaler.is_none() && (!r.loss.is_finite() || !norm.is_finite()) {
            let param = self
                .layout
                .first_nonfinite(&self.grads)
                .unwrap_or("(none: loss only)");
            return Err(TrainError::NonFinite {
                step,
                what: if r.loss.is_finite() {
                    "gradient"
                } else {
                    "loss"
                }
                .into(),
                param: param.into(),
            });
        }
        if self.grad_clip > 0.0 {
            clip_to(&mut self.grads, norm, self.grad_clip);
        }
        report.grad_norm = norm;
        self.optimizer.step(
            &mut self.master,
            &self.grads,
            lr as f32,
            self.bf16_copy.as_deref_mut(),
        );
        if let Some(param) = self.layout.first_nonfinite(&self.master) {
            return Err(TrainError::NonFinite {
                step,
                what: "value".into(),
                param: param.into(),
            });
        }
        match (&self.bf16_copy, &self.direct) {
            (Some(copy), _) => self.layout.unflatten_bf16(copy, self.model.params())?,
            (None, Some(_)) => self.vars_stale.set(true),
            (None, None) => self.layout.unflatten(&self.master, self.model.params())?,
        }
        if let Some(f) = &self.fp8 {
            f.update();
        }
        self.step += 1;
        Ok(report)
    }

    /// Copies `master` into the model's variables if the direct step has left them
    /// behind; [`Trainer::evaluate`] and [`Trainer::sample`] call it, and so must anything
    /// else that runs the model's candle forward after training steps.
    pub fn sync_vars(&self) -> Result<()> {
        if self.vars_stale.get() {
            self.layout.unflatten(&self.master, self.model.params())?;
            self.vars_stale.set(false);
        }
        Ok(())
    }

    /// Mean loss and top-1 accuracy over `batches`, without gradients.
    pub fn evaluate(&self, batches: &[MicroBatch]) -> Result<EvalReport> {
        self.sync_vars()?;
        let fx = self.fx();
        let (mut sum, mut count, mut correct) = (0f64, 0usize, 0usize);
        for mb in batches {
            let logits = self.model.forward(&fx, &mb.input)?.detach();
            let (s, n) = cross_entropy_sum(&fx, &logits, &mb.targets)?;
            sum += scalar(&s)?;
            count += n;
            let pred = logits
                .argmax(1)?
                .to_dtype(candle_core::DType::I64)?
                .to_vec1::<i64>()?;
            correct += pred.iter().zip(&mb.targets).filter(|(p, t)| p == t).count();
        }
        let c = count.max(1) as f64;
        Ok(EvalReport {
            loss: sum / c,
            accuracy: correct as f64 / c,
            count,
        })
    }

    /// Whether the model's loss is per token or per sample.
    pub fn loss_kind(&self) -> LossKind {
        self.model.loss_kind()
    }

    /// Samples `n` tokens after `prompt` (GPT), with temperature 1 and a seeded generator.
    pub fn sample(&self, prompt: &[i64], n: usize, context: usize, seed: u64) -> Result<Vec<i64>> {
        self.sync_vars()?;
        let mut toks = prompt.to_vec();
        let fx = self.fx();
        for i in 0..n {
            let start = toks.len().saturating_sub(context);
            let x = Tensor::new(&toks[start..], &Device::Cpu)?.unsqueeze(0)?;
            let logits = self.model.forward(&fx, &x)?.detach();
            let last = logits.get(logits.dim(0)? - 1)?;
            let p = crate::ops::softmax_last(&fx, &last)?
                .to_dtype(candle_core::DType::F64)?
                .to_vec1::<f64>()?;
            let u = (crate::params::mix64(seed ^ crate::params::mix64(i as u64)) >> 11) as f64
                / (1u64 << 53) as f64;
            let mut acc = 0.0;
            let next = p
                .iter()
                .position(|&q| {
                    acc += q;
                    acc > u
                })
                .unwrap_or(p.len() - 1);
            toks.push(next as i64);
        }
        Ok(toks[prompt.len()..].to_vec())
    }
}
