//! Evaluation and sampling, dispatched on the step path: the direct step evaluates with
//! its training forward on its own buffers; candle's graph with the model's forward;
//! where the parameters are sharded (ZeRO-3), the forward runs group by group (the direct
//! step) or unit by unit (the graph), a collective every rank joins, so no rank ever holds
//! the whole model.

use candle_core::{Device, Tensor};

use crate::accumulate::MicroBatch;
use crate::error::{Result, TrainError};
use crate::models::Model;
use crate::parallel::units::{Collective, UnitPlan, UnitStep};
use crate::parallel::ShardedParams;

use super::path::{by_group, sharded};
use crate::precision::Fx;

use super::Trainer;

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

impl EvalReport {
    /// The means of `count` valid targets whose losses sum to `loss_sum`, `correct` of
    /// them predicted top-1.
    fn of(loss_sum: f64, correct: usize, count: usize) -> Self {
        let c = count.max(1) as f64;
        EvalReport {
            loss: loss_sum / c,
            accuracy: correct as f64 / c,
            count,
        }
    }
}

impl Trainer {
    /// Mean loss and top-1 accuracy over every rank's `batches` (each rank passes its
    /// share; a collective), without gradients.
    pub fn evaluate(&mut self, batches: &[MicroBatch]) -> Result<EvalReport> {
        self.keeping_fp8_state(|t| t.evaluate_everywhere(batches))
    }

    /// Runs `f`, a forward that is not training (evaluation, sampling, the scratch step a
    /// run counts its memory with), and puts the FP8 scalers' state back after it: their
    /// amax histories record training steps alone, so how often a run evaluates or
    /// samples does not change what it trains (before, an fp8 run with `eval_every`
    /// trained other weights than one without).
    pub(super) fn keeping_fp8_state<R>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<R>,
    ) -> Result<R> {
        let saved = self.fp8.as_ref().map(|s| s.state());
        let out = f(self);
        if let (Some(fp8), Some(saved)) = (&self.fp8, saved) {
            fp8.restore(saved);
        }
        out
    }

    /// [`Trainer::evaluate`]'s work.
    fn evaluate_everywhere(&mut self, batches: &[MicroBatch]) -> Result<EvalReport> {
        let local = match self.shards_params() {
            // ZeRO-3 on the resident loop: each block gathered on the loop's backend.
            false if self.resident_forward_gathers() => {
                let padded = self.same_batch_count(batches)?;
                self.evaluate_here(&padded)?
            }
            // What `evaluate_local` runs, inside this call's one keeping of the FP8 state.
            false => self.evaluate_here(batches)?,
            true => {
                let padded = self.same_batch_count(batches)?;
                match self.path.is_direct() {
                    true => self.evaluate_by_group(&padded)?,
                    false => self.evaluate_by_unit(&padded)?,
                }
            }
        };
        let mut x = [
            local.loss * local.count as f64,
            local.count as f64,
            local.accuracy * local.count as f64,
        ];
        self.strategy.sum_scalars(&mut x)?;
        let c = x[1].max(1.0);
        Ok(EvalReport {
            loss: x[0] / c,
            accuracy: x[2] / c,
            count: x[1] as usize,
        })
    }

    /// `batches` padded with masked copies of its last one to the most any rank passed:
    /// under ZeRO-3 every forward is a collective (each group gathered from every rank), so
    /// every rank must run as many as the others, whatever share of the evaluation set it
    /// drew (16 batches over 3 ranks give 6, 5 and 5). The counts are agreed through
    /// [`Strategy::sum_scalars`]; a rank with no batch at all while another has some
    /// cannot pad (it knows no shape), and every rank fails alike, naming the counts.
    fn same_batch_count(&mut self, batches: &[MicroBatch]) -> Result<Vec<MicroBatch>> {
        let (rank, world) = (self.strategy.rank(), self.strategy.world_size());
        let mut counts = vec![0f64; world];
        counts[rank] = batches.len() as f64;
        self.strategy.sum_scalars(&mut counts)?;
        let most = counts.iter().fold(0f64, |a, &b| a.max(b)) as usize;
        if counts.contains(&0.0) && most > 0 {
            return Err(TrainError::Strategy(format!(
                "evaluation under ZeRO-3 runs a collective forward per batch, and the ranks \
                 passed {counts:?} batches: a rank with none cannot join (pass it a masked \
                 batch, MicroBatch::masked)"
            )));
        }
        let mut padded = batches.to_vec();
        if let Some(last) = batches.last() {
            padded.extend((batches.len()..most).map(|_| last.masked()));
        }
        Ok(padded)
    }

    /// ZeRO-3 on the direct step: the training forward through the step's own source, each
    /// parameter group gathered as it needs it and freed after (a collective: every rank
    /// calls it), so evaluation holds what a training step holds, not the whole model (FSDP
    /// evaluates unit by unit too). The forward reduces nothing, so the gradient shard is
    /// empty; the statistics it adds are the next window's to reset.
    fn evaluate_by_group(&mut self, batches: &[MicroBatch]) -> Result<EvalReport> {
        let Trainer {
            path,
            strategy,
            params,
            ..
        } = self;
        let step = path.direct_step().ok_or_else(|| {
            TrainError::Strategy("evaluation by group needs the direct step".into())
        })?;
        let (mut sum, mut correct, mut count) = (0f64, 0usize, 0usize);
        for mb in batches {
            let result = {
                let mut source = by_group(&mut **strategy)?.step_source(&params.master, &mut []);
                step.evaluate_groups(&mut *source, &mb.input, &mb.targets)
            };
            strategy.finish_micro_batch(&mut [])?;
            let (s, c, n) = result?;
            (sum, correct, count) = (sum + s, correct + c, count + n);
        }
        Ok(EvalReport::of(sum, correct, count))
    }

    /// ZeRO-3 on the graph path: candle's forward unit by unit, each unit's groups
    /// gathered as it needs them and freed after their last unit (a collective: every
    /// rank calls it), instead of the whole model at once.
    fn evaluate_by_unit(&mut self, batches: &[MicroBatch]) -> Result<EvalReport> {
        self.by_unit(None, |step, strategy, master| {
            let (mut sum, mut correct, mut count) = (0f64, 0usize, 0usize);
            for mb in batches {
                // Evaluation reduces nothing: no gradient shard to scatter into.
                let mut source = Collective::new(strategy, master, &mut []);
                let (s, c, n) = crate::parallel::units::evaluate(step, &mut source, mb)?;
                (sum, correct, count) = (sum + s, correct + c, count + n);
            }
            Ok(EvalReport::of(sum, correct, count))
        })
    }

    /// ZeRO-3: `f` with a unit-by-unit step over `plan` (else the path's own units, those
    /// of the graph path), the strategy and this rank's shard of the parameters, for a
    /// forward run unit by unit.
    fn by_unit<R>(
        &mut self,
        plan: Option<&UnitPlan>,
        f: impl FnOnce(&UnitStep<'_>, &mut dyn ShardedParams, &[f32]) -> Result<R>,
    ) -> Result<R> {
        let Some(plan) = plan.or(self.path.units()) else {
            return Err(TrainError::Strategy(
                "a forward by unit needs ZeRO-3 and its units".into(),
            ));
        };
        let fx = Fx::new(self.precision, self.fp8.as_ref()).with_kernels(self.kernels);
        let step = UnitStep {
            plan,
            model: &self.model_config,
            precision: self.precision,
            kernels: self.kernels,
            layout: &self.params.layout,
            fx: &fx,
            own: &self.params.held,
            device: &self.device,
        };
        f(&step, sharded(&mut *self.strategy)?, &self.params.master)
    }

    /// Mean loss and top-1 accuracy over this rank's `batches` alone (not under ZeRO-3,
    /// whose forward needs the other ranks: use [`Trainer::evaluate`]). The direct step
    /// runs its training forward on its own buffers (no autograd graph, nothing more to
    /// hold than a training step); the graph path candle's forward.
    pub fn evaluate_local(&mut self, batches: &[MicroBatch]) -> Result<EvalReport> {
        if self.shards_params() || self.resident_forward_gathers() {
            return Err(TrainError::Strategy(
                "the parameters are sharded over the ranks (zero3): evaluate with \
                 Trainer::evaluate, a collective"
                    .into(),
            ));
        }
        self.keeping_fp8_state(|t| t.evaluate_here(batches))
    }

    /// Whether the resident loop's forward is a collective (ZeRO-3 on the loop).
    fn resident_forward_gathers(&self) -> bool {
        matches!(&self.path, super::StepPath::Resident(p) if p.forward_gathers())
    }

    /// [`Trainer::evaluate_local`]'s work, or under ZeRO-3 on the resident loop every
    /// rank's share of a collective evaluation (as many batches on every rank).
    fn evaluate_here(&mut self, batches: &[MicroBatch]) -> Result<EvalReport> {
        // The loop made where it is not, and weights set since it last ran (a checkpoint
        // loaded) sent down first.
        self.make_resident_loop()?;
        self.send_down()?;
        if let Some(path) = self.path.resident() {
            return summed(batches, |mb| path.evaluate(mb));
        }
        if let Some(step) = self.path.direct_step() {
            let master = &self.params.master;
            return summed(batches, |mb| step.evaluate(master, &mb.input, &mb.targets));
        }
        self.sync_vars()?;
        eval_with(&*self.model, &self.fx(), batches)
    }

    /// Samples `n` tokens after `prompt` (GPT), with temperature 1 and a seeded generator.
    /// Under ZeRO-3 a collective (every rank calls it and gets the same tokens): each
    /// token's forward runs unit by unit, gathering each unit's groups as it needs them, so
    /// no rank holds the whole model (FSDP's generation through its wrapped units). On the
    /// resident path it first brings the host's master up to the loop's
    /// ([`Trainer::sync_host`], a collective under ZeRO-1: there every rank calls that
    /// first, and then one rank may sample alone). With `vocab`, only ids below it are
    /// drawn (the softmax over those logits alone, as llm.c samples over GPT-2's 50,257
    /// of its table's 50,304 rows): a table padded past the vocabulary never yields an id
    /// the vocabulary cannot decode.
    pub fn sample(
        &mut self,
        prompt: &[i64],
        n: usize,
        context: usize,
        seed: u64,
        vocab: Option<usize>,
    ) -> Result<Vec<i64>> {
        let how = Sampling {
            n,
            context,
            seed,
            vocab,
        };
        // The resident loop's state first: its FP8 scalers too, before the snapshot that
        // sampling's casts are undone to (a sync inside would be undone with them).
        self.sync_host()?;
        self.keeping_fp8_state(|t| t.sample_with_model(prompt, how))
    }

    /// [`Trainer::sample`]'s work.
    fn sample_with_model(&mut self, prompt: &[i64], how: Sampling) -> Result<Vec<i64>> {
        if self.shards_params() {
            let (p, k) = (self.precision, self.kernels);
            let plan = UnitPlan::for_model(&self.model_config, p, k, &self.params.layout, true)?;
            return self.by_unit(Some(&plan), |step, strategy, master| {
                let mut forward = |x: &Tensor| {
                    let mut source = Collective::new(&mut *strategy, master, &mut []);
                    crate::parallel::units::forward(step, &mut source, x)
                };
                sample_with(&mut forward, step.fx, prompt, how, step.device)
            });
        }
        self.sync_host()?;
        self.sync_vars()?;
        let (model, fx) = (&*self.model, self.fx());
        let mut forward = |x: &Tensor| Ok(model.forward(&fx, x)?.detach());
        sample_with(&mut forward, &fx, prompt, how, &self.device)
    }
}

/// Mean loss and top-1 accuracy over `batches`, each evaluated by `eval` (its summed
/// loss, top-1 hits and valid targets).
fn summed(
    batches: &[MicroBatch],
    mut eval: impl FnMut(&MicroBatch) -> Result<(f64, usize, usize)>,
) -> Result<EvalReport> {
    let (mut sum, mut correct, mut count) = (0f64, 0usize, 0usize);
    for mb in batches {
        let (s, c, n) = eval(mb)?;
        (sum, correct, count) = (sum + s, correct + c, count + n);
    }
    Ok(EvalReport::of(sum, correct, count))
}

/// Mean loss and top-1 accuracy of `model` over `batches`.
fn eval_with(model: &dyn Model, fx: &Fx, batches: &[MicroBatch]) -> Result<EvalReport> {
    let (mut sum, mut count, mut correct) = (0f64, 0usize, 0usize);
    for mb in batches {
        let logits = model.forward(fx, &mb.input)?.detach();
        let (s, c, n) = crate::loss::loss_and_hits(fx, &logits, &mb.targets)?;
        (sum, correct, count) = (sum + s, correct + c, count + n);
    }
    Ok(EvalReport::of(sum, correct, count))
}

/// What [`Trainer::sample`] draws: `n` tokens, each from the last `context`, seeded by
/// `seed`, ids below `vocab` where given.
#[derive(Debug, Clone, Copy)]
struct Sampling {
    n: usize,
    context: usize,
    seed: u64,
    vocab: Option<usize>,
}

/// The tokens `how` asks for, sampled after `prompt` from the logits `forward` gives for
/// a `[1, t]` input.
fn sample_with(
    forward: &mut dyn FnMut(&Tensor) -> Result<Tensor>,
    fx: &Fx,
    prompt: &[i64],
    how: Sampling,
    dev: &Device,
) -> Result<Vec<i64>> {
    let Sampling {
        n,
        context,
        seed,
        vocab,
    } = how;
    let mut toks = prompt.to_vec();
    for i in 0..n {
        let start = toks.len().saturating_sub(context);
        let x = Tensor::new(&toks[start..], dev)?.unsqueeze(0)?;
        let logits = forward(&x)?;
        let last = logits.get(logits.dim(0)? - 1)?;
        let last = match vocab {
            Some(v) if v > 0 && v < last.dim(0)? => last.narrow(0, 0, v)?,
            _ => last,
        };
        let p = crate::ops::softmax_last(fx, &last)?
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
