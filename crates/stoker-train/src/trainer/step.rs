//! One optimizer step over a rank's accumulation window, in the phase order of
//! [`crate::parallel`]:
//!
//! 1. the window's micro-batches on the step path, their gradients summed locally and
//!    reduced as the strategy wants them;
//! 2. the window's scalars summed over ranks, and the gradient normalized by the global
//!    batch's valid targets;
//! 3. fp16: unscale, and an overflow every rank agrees on (the step is skipped together);
//! 4. the global gradient norm and clipping;
//! 5. the optimizer on the strategy's range, every rank's parameters brought up to date,
//!    and the model's variables (or a GPU's copies) refreshed.

use stoker_precision::{LossScaler, StepDecision};

use crate::accumulate::MicroBatch;
use crate::clip::clip_to;
use crate::error::{Result, TrainError};
use crate::loss::valid_count;
use crate::offload::MasterView;
use crate::precision::Fx;

use super::path::{PathInputs, StepPath};
use super::{StepReport, Trainer};

/// The loss scaler's verdict on step `step` (counted from 0) and its overflow: why the
/// step is skipped, if it is. An overflow that finds the scale already at its floor fails
/// the step where `stop_at_min_scale` (`[loss_scale]`) says to stop there. `found_inf`
/// is every rank's, so every rank decides alike.
pub(super) fn scaler_verdict(
    scaler: &mut LossScaler,
    found_inf: bool,
    stop_at_min_scale: bool,
    step: u64,
) -> Result<Option<String>> {
    match scaler.update(found_inf) {
        StepDecision::Step => Ok(None),
        StepDecision::Skip(rep) if rep.at_min_scale && stop_at_min_scale => {
            Err(TrainError::LossScaleAtMinimum {
                step: step + 1,
                scale: rep.scale_before,
                detail: rep.summary(),
            })
        }
        StepDecision::Skip(rep) => Ok(Some(rep.summary())),
    }
}

impl Trainer {
    /// One optimizer step over this rank's accumulation window (its part of the global
    /// batch; every rank's window has the same shapes).
    pub fn train_step(&mut self, window: &[MicroBatch]) -> Result<StepReport> {
        if self.path.resident().is_some() {
            return self.resident_step(window);
        }
        let step = self.step;
        // The global batch's target capacity, which every rank knows without asking: the
        // backward divides by it, the count over all ranks corrects it afterwards.
        let capacity =
            self.strategy.world_size() * window.iter().map(|m| m.targets.len()).sum::<usize>();
        let local_count: usize = window.iter().map(|m| valid_count(&m.targets)).sum();
        let loss_scale = self.scaler.as_ref().map_or(1.0, |s| s.scale());
        let factor = (capacity > 0).then(|| loss_scale as f64 / capacity as f64);
        let loss_sum = self.micro_batches(window, factor, step == 0)?;
        let (loss, count) = self.normalize_globally(loss_sum, local_count, capacity)?;
        let mut report = StepReport {
            step: step + 1,
            loss,
            count,
            // Not measured on a step the scaler skips (its gradients overflowed).
            grad_norm: f64::NAN,
            lr: self.schedule.lr_at(step),
            loss_scale,
            skipped: None,
            sync: self.strategy.stats(),
        };
        if let Some(why) = self.unscale_or_skip()? {
            report.skipped = Some(why);
            report.sync = self.strategy.stats();
            self.step += 1;
            return Ok(report);
        }
        report.grad_norm = self.norm_and_clip(step, loss)?;
        self.update(step, report.lr)?;
        // After the parameter refresh: its all-gather (ZeRO) belongs to this step.
        report.sync = self.strategy.stats();
        self.step += 1;
        Ok(report)
    }

    /// Phase 1: every micro-batch of the window on the step path, into the running sum;
    /// returns the window's summed loss.
    fn micro_batches(
        &mut self,
        window: &[MicroBatch],
        factor: Option<f64>,
        first_step: bool,
    ) -> Result<f64> {
        let k = window.len();
        self.strategy.begin_window(k)?;
        let fx = Fx::new(self.precision, self.fp8.as_ref()).with_kernels(self.kernels);
        let on = PathInputs {
            model: &*self.model,
            model_config: &self.model_config,
            params: &self.params,
            fx: &fx,
            device: &self.device,
            precision: self.precision,
            kernels: self.kernels,
        };
        let grads = &mut self.grads;
        grads.sum.begin(&mut grads.buf);
        for (j, mb) in window.iter().enumerate() {
            let reduce = self.strategy.begin_micro_batch(j, k)?;
            let target = grads.sum.target(&mut grads.buf);
            let loss = self.path.micro_batch(
                &on,
                &mut *self.strategy,
                mb,
                factor,
                reduce,
                target,
                first_step,
            )?;
            grads.sum.push(&mut grads.buf, loss);
        }
        let loss_sum = grads.sum.finish(&mut grads.buf);
        self.strategy.finish_window(&mut grads.buf)?;
        Ok(loss_sum)
    }

    /// Phase 2: the loss sum and valid targets summed over ranks, and the gradient
    /// rescaled from the window's capacity to the global count; the mean loss and count.
    fn normalize_globally(
        &mut self,
        loss_sum: f64,
        local_count: usize,
        capacity: usize,
    ) -> Result<(f64, usize)> {
        let mut scalars = [loss_sum, local_count as f64];
        self.strategy.sum_scalars(&mut scalars)?;
        let [loss_sum, count] = scalars;
        if count > 0.0 && count != capacity as f64 {
            stoker_kernels::flat::scale(&mut self.grads.buf, (capacity as f64 / count) as f32);
        }
        let loss = if count > 0.0 { loss_sum / count } else { 0.0 };
        Ok((loss, count as usize))
    }

    /// Phase 3 (fp16): unscales the gradients and agrees with every rank on an overflow;
    /// why the step is skipped, if it is.
    fn unscale_or_skip(&mut self) -> Result<Option<String>> {
        let Some(scaler) = &mut self.scaler else {
            return Ok(None);
        };
        let layout = &self.params.layout;
        let table = layout.param_table();
        let whole = self.grads.buf.len() == layout.total_len();
        let here = scaler.unscale_and_check(&mut self.grads.buf, whole.then_some(&table))?;
        // Every rank skips together (their gradients are the same sums, but a sharded
        // strategy's are not: agree explicitly).
        let found_inf = self.strategy.any_rank(here)?;
        if found_inf && !here {
            scaler.note_nonfinite("(a gradient on another rank)");
        }
        scaler_verdict(scaler, found_inf, self.stop_at_min_scale, self.step)
    }

    /// Phase 4: the global gradient norm (before clipping), the gradients clipped to
    /// `grad_clip`; a non-finite loss or norm without loss scaling fails naming the first
    /// parameter with a non-finite gradient.
    fn norm_and_clip(&mut self, step: u64, loss: f64) -> Result<f64> {
        // One pass: the f64 norm is finite exactly when every gradient is, so the scan for
        // the offending parameter runs only on failure.
        let norm = self.strategy.sum_of_squares(&self.grads.buf)?.sqrt();
        if self.scaler.is_none() && (!loss.is_finite() || !norm.is_finite()) {
            let param = self
                .params
                .layout
                .first_nonfinite_in(&self.grads.buf, &self.grads.held)
                .unwrap_or("(none: loss only)");
            return Err(TrainError::NonFinite {
                // Counted from 1, as the step lines, metrics and checkpoints count.
                step: step + 1,
                what: if loss.is_finite() { "gradient" } else { "loss" }.into(),
                param: param.into(),
            });
        }
        if self.grad_clip > 0.0 {
            clip_to(&mut self.grads.buf, norm, self.grad_clip);
        }
        Ok(norm)
    }

    /// Phase 5: the optimizer over this rank's range at learning rate `lr`, every rank's
    /// parameters brought up to date, and the model's copies refreshed.
    fn update(&mut self, step: u64, lr: f64) -> Result<()> {
        // The optimizer's pieces of the flat buffer, within what the parameters and the
        // gradients hold (all of either, or one range of the whole buffer).
        let updated = self.optimizer.pieces().clone();
        let (p, g) = (&self.params, &self.grads);
        let (local, local_grads) = match (p.held.local_of(&updated), g.held.local_of(&updated)) {
            (Some(l), Some(g)) => (l, g),
            _ => {
                return Err(TrainError::Layout(format!(
                    "the optimizer updates {:?}, the parameters hold {:?} and the gradients {:?}",
                    updated.ranges(),
                    p.held.ranges(),
                    g.held.ranges()
                )))
            }
        };
        // A model on a GPU whose optimizer updates the whole buffer (one rank, DDP): each
        // parameter's copy up is queued as soon as the optimizer is done with it, so the
        // copies run while the optimizer steps the rest. Sharded updates go up after their
        // all-gather. A non-finite parameter is not sent (the check below fails the step),
        // and unless every parameter went up the whole upload runs after all.
        let upload_each = self.path.staging().is_some() && updated.is_whole(p.layout.total_len());
        let (mut upload_failed, mut uploaded) = (None, 0usize);
        let params = &mut self.params;
        let model = &*self.model;
        let mut each = self.path.staging_mut().filter(|_| upload_each);
        let mut done = |r: std::ops::Range<usize>, v: &[f32], b: Option<&[half::bf16]>| {
            let Some(st) = each.as_mut() else { return };
            if upload_failed.is_some() || !v.iter().all(|x| x.is_finite()) {
                return;
            }
            match st.upload_segment(local.start + r.start, v, b, model.params()) {
                Ok(()) => uploaded += 1,
                Err(e) => upload_failed = Some(e),
            }
        };
        self.optimizer.step_each(
            &mut params.master[local.clone()],
            &self.grads.buf[local_grads],
            lr as f32,
            params
                .bf16_copy
                .as_deref_mut()
                .map(|c| &mut c[local.clone()]),
            &mut done,
        );
        if let Some(e) = upload_failed {
            return Err(e);
        }
        self.strategy.after_update(&mut params.master)?;
        if let (Some(copy), true) = (&mut params.bf16_copy, local.len() < params.master.len()) {
            // The other ranks' shards arrived in FP32: round them as the optimizer does.
            for r in [0..local.start, local.end..params.master.len()] {
                stoker_kernels::flat::to_bf16(&params.master[r.clone()], &mut copy[r]);
            }
        }
        if let Some(param) = params
            .layout
            .first_nonfinite_in(&params.master, &params.held)
        {
            return Err(TrainError::NonFinite {
                // Counted from 1, as the step lines, metrics and checkpoints count.
                step: step + 1,
                what: "value".into(),
                param: param.into(),
            });
        }
        let all_went_up =
            upload_each && Some(uploaded) == self.path.staging().map(|s| s.nonempty());
        self.refresh_model(all_went_up)?;
        if let Some(f) = &self.fp8 {
            // Transformer Engine's amax all-reduce: every rank scales as one rank would.
            let mut amaxes = f.step_amaxes();
            self.strategy.max_over_ranks(&mut amaxes)?;
            f.record_amaxes(&amaxes)?;
            f.update();
        }
        Ok(())
    }

    /// The model's copies of the updated parameters: none under ZeRO-3 (its units build
    /// theirs from gathered groups), a GPU's uploaded from the pinned host buffers (unless
    /// `all_went_up` already, parameter by parameter), the bf16 copy or the master into
    /// the candle variables, or, on the direct step, marked stale until a forward needs
    /// them.
    fn refresh_model(&mut self, all_went_up: bool) -> Result<()> {
        let (p, model) = (&self.params, &*self.model);
        if p.sharded() || all_went_up {
            return Ok(());
        }
        if let Some(staging) = self.path.staging_mut() {
            let src = match &p.bf16_copy {
                Some(c) => MasterView::Bf16(c),
                None => MasterView::F32(&p.master),
            };
            return staging.upload(src, &p.layout, model.params());
        }
        match (&p.bf16_copy, &self.path) {
            (Some(copy), _) => p.layout.unflatten_bf16(copy, model.params()),
            (None, StepPath::Direct { .. } | StepPath::DirectByGroup { .. }) => {
                self.path.vars_left_behind();
                Ok(())
            }
            (None, _) => p.layout.unflatten(&p.master, model.params()),
        }
    }

    /// Runs micro-batch `mb`'s forward and backward and throws its gradients away,
    /// changing no state (no optimizer step, no loss-scaler call, no collective, the
    /// gradient buffer zeroed after), so that a caller can count what one step allocates
    /// ([`StepPath`]'s scratch: a strategy reducing by group runs its schedule over a
    /// communicator that moves no data, ZeRO-3's units run on zeros); the direct step's
    /// activation buffers stay (the step keeps them). Returns the bytes of predicted
    /// workspace the run held meanwhile (the strategy's groups, ZeRO-3's units), which a
    /// count must not take twice; None without running on the resident path (whose step
    /// changes its backend's state). In fp8 the step casts as training does, and the
    /// scalers' amax histories are put back after it (until 2026-12-08 fp8 ran none, and
    /// the planner's formula stood for its activations: a third of what the casts hold).
    pub fn scratch_micro_batch(&mut self, mb: &MicroBatch) -> Result<Option<usize>> {
        if self.path.resident().is_some() {
            return Ok(None);
        }
        self.keeping_fp8_state(|t| t.scratch_step(mb).map(Some))
    }

    /// [`Self::scratch_micro_batch`]'s step.
    fn scratch_step(&mut self, mb: &MicroBatch) -> Result<usize> {
        let fx = Fx::new(self.precision, self.fp8.as_ref()).with_kernels(self.kernels);
        let scale = self.scaler.as_ref().map_or(1.0, |s| s.scale()) as f64;
        let factor = (!mb.targets.is_empty()).then(|| scale / mb.targets.len() as f64);
        let on = PathInputs {
            model: &*self.model,
            model_config: &self.model_config,
            params: &self.params,
            fx: &fx,
            device: &self.device,
            precision: self.precision,
            kernels: self.kernels,
        };
        let predicted =
            self.path
                .scratch(&on, &mut *self.strategy, mb, factor, &mut self.grads.buf)?;
        stoker_kernels::flat::zero(&mut self.grads.buf);
        Ok(predicted)
    }
}
