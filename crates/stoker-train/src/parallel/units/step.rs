//! One micro-batch of the unit-by-unit step: the plan's schedule run against a source of
//! parameters and a sink of gradients (the rank's collectives, or nothing for a scratch
//! run).

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Tensor, Var};
use stoker_comm::Pending;

use super::plan::{unit_model, Event, UnitPlan};
use crate::accumulate::MicroBatch;
use crate::error::{Result, TrainError};
use crate::layout::FlatLayout;
use crate::loss::{cross_entropy_sum, scalar};
use crate::models::Model;
use crate::models::ModelConfig;
use crate::parallel::ShardedParams;
use crate::pieces::Pieces;
use crate::precision::{Fx, Kernels, Precision};
use crate::vars::add_grad;

/// Where the unit-by-unit step gets each group's parameters and sends its gradients.
pub trait SpanSource {
    /// Starts fetching group `g`'s parameters, flat span `span`, for a later
    /// [`SpanSource::gather`] of the same group.
    fn prefetch(&mut self, g: usize, span: Range<usize>) -> Result<()>;
    /// The parameters of group `g`, flat span `span`: its prefetch completed, or fetched
    /// now.
    fn gather(&mut self, g: usize, span: Range<usize>) -> Result<Vec<f32>>;
    /// Takes `grads`, a micro-batch's gradients of flat span `span`.
    fn scatter(&mut self, grads: Vec<f32>, span: Range<usize>) -> Result<()>;
}

/// The rank's collectives: groups all-gathered from every rank's shard `held`, gradients
/// reduce-scattered into its shard `shard` ([`ShardedParams::start_gather_span`],
/// [`ShardedParams::scatter_span`]).
pub struct Collective<'a> {
    /// The ZeRO-3 strategy's parameter hooks.
    pub strategy: &'a mut dyn ShardedParams,
    /// This rank's shard of the FP32 parameters.
    pub held: &'a [f32],
    /// This rank's shard of the window's gradient sum.
    pub shard: &'a mut [f32],
    /// Gathers started and not yet completed, by group.
    started: Vec<(usize, Pending)>,
}

impl<'a> Collective<'a> {
    /// The collectives of `strategy` over the shards `held` (parameters) and `shard`
    /// (gradient sum), none started.
    pub fn new(strategy: &'a mut dyn ShardedParams, held: &'a [f32], shard: &'a mut [f32]) -> Self {
        Collective {
            strategy,
            held,
            shard,
            started: Vec::new(),
        }
    }
}

impl SpanSource for Collective<'_> {
    fn prefetch(&mut self, g: usize, span: Range<usize>) -> Result<()> {
        let pending = self.strategy.start_gather_span(self.held, span)?;
        self.started.push((g, pending));
        Ok(())
    }

    fn gather(&mut self, g: usize, span: Range<usize>) -> Result<Vec<f32>> {
        let pending = match self.started.iter().position(|(s, _)| *s == g) {
            Some(i) => self.started.remove(i).1,
            None => self.strategy.start_gather_span(self.held, span)?,
        };
        self.strategy.finish_gather_span(pending)
    }

    fn scatter(&mut self, grads: Vec<f32>, span: Range<usize>) -> Result<()> {
        self.strategy.scatter_span(grads, span, self.shard)
    }
}

/// No collectives: zeros for parameters (a step's memory does not depend on their values),
/// gradients dropped. What a scratch micro-batch runs to count the step's memory before
/// training, changing no state; a prefetch holds what the rank's would (the gathered
/// buffer and the rank's piece of it) until its gather.
pub struct Scratch<'a> {
    /// The parts of the flat buffer the rank owns.
    own: &'a Pieces,
    /// Prefetches not yet gathered: group, buffer, the rank's piece.
    started: Vec<(usize, Vec<f32>, Vec<f32>)>,
}

impl<'a> Scratch<'a> {
    /// The scratch source of the rank owning `own` of the flat buffer.
    pub fn new(own: &'a Pieces) -> Self {
        Scratch {
            own,
            started: Vec::new(),
        }
    }
}

impl SpanSource for Scratch<'_> {
    fn prefetch(&mut self, g: usize, span: Range<usize>) -> Result<()> {
        let piece = vec![0.0; self.own.owned_len(&span)];
        self.started.push((g, vec![0.0; span.len()], piece));
        Ok(())
    }

    fn gather(&mut self, g: usize, span: Range<usize>) -> Result<Vec<f32>> {
        match self.started.iter().position(|(s, ..)| *s == g) {
            Some(i) => Ok(self.started.remove(i).1),
            None => Ok(vec![0.0; span.len()]),
        }
    }

    fn scatter(&mut self, _grads: Vec<f32>, _span: Range<usize>) -> Result<()> {
        Ok(())
    }
}

/// What one micro-batch of the unit-by-unit step needs besides the strategy and buffers.
pub struct UnitStep<'a> {
    /// The plan.
    pub plan: &'a UnitPlan,
    /// The model.
    pub model: &'a ModelConfig,
    /// Its precision.
    pub precision: Precision,
    /// Its kernels.
    pub kernels: Kernels,
    /// The flat layout.
    pub layout: &'a FlatLayout,
    /// The forward context.
    pub fx: &'a Fx<'a>,
    /// The parts of the flat buffer this rank owns (its reduce-scatter outputs' size).
    pub own: &'a Pieces,
    /// Where each unit's variables are built (the trainer's device).
    pub device: &'a candle_core::Device,
}

impl UnitStep<'_> {
    /// A model whose groups `groups` are real (values from each group's span start) and
    /// every other parameter an empty placeholder, on this step's device.
    fn unit_model(&self, groups: Vec<(usize, Arc<Vec<f32>>)>) -> Result<Box<dyn Model>> {
        unit_model(
            self.model,
            self.precision,
            self.kernels,
            self.layout,
            groups,
            self.device,
        )
    }
}

/// Runs one micro-batch `mb` unit by unit: each group's parameters from `source`, the
/// gradient of `factor x (summed loss)` handed back to it group by group (None: no valid
/// target anywhere, no backward; every group still goes back, so every rank runs the same
/// collectives). With `check_grads`, fails naming any parameter no unit gave a gradient
/// (the first step checks, as the whole-graph step does). Returns the summed loss; `peak`
/// rises to the most bytes held at once ([`UnitPlan::peak_bytes`] tells the same before
/// the first step).
pub fn micro_batch(
    step: &UnitStep<'_>,
    source: &mut dyn SpanSource,
    mb: &MicroBatch,
    factor: Option<f64>,
    check_grads: bool,
    peak: &mut usize,
) -> Result<f64> {
    let mut run = UnitRun::new(step, mb, factor);
    for &event in step.plan.schedule() {
        run.event(event, source, peak)?;
        *peak = (*peak).max(run.bytes);
    }
    if check_grads && factor.is_some() {
        if let Some(i) = run.reached.iter().position(|r| !r) {
            return Err(TrainError::NoGradient {
                name: step.layout.slots()[i].name.clone(),
            });
        }
    }
    Ok(run.loss)
}

/// One micro-batch's state as its schedule runs.
struct UnitRun<'s, 'a> {
    step: &'s UnitStep<'a>,
    mb: &'s MicroBatch,
    factor: Option<f64>,
    /// Which parameters got a gradient from some unit (every one must, when checked).
    reached: Vec<bool>,
    /// Groups prefetched and not yet in hand (their bytes are held from the prefetch).
    started: Vec<bool>,
    params: Vec<Option<Arc<Vec<f32>>>>,
    grads: Vec<Option<Vec<f32>>>,
    /// Each unit's input (its checkpoint), the batch's input first.
    inputs: Vec<Tensor>,
    /// The gradient of the next unit's input: what this unit's output backpropagates.
    grad_out: Option<Tensor>,
    loss: f64,
    /// Bytes held now.
    bytes: usize,
}

impl<'s, 'a> UnitRun<'s, 'a> {
    fn new(step: &'s UnitStep<'a>, mb: &'s MicroBatch, factor: Option<f64>) -> Self {
        let groups = step.plan.spans.len();
        UnitRun {
            step,
            mb,
            factor,
            reached: vec![false; step.layout.slots().len()],
            started: vec![false; groups],
            params: vec![None; groups],
            grads: vec![None; groups],
            inputs: vec![mb.input.clone()],
            grad_out: None,
            loss: 0.0,
            bytes: 0,
        }
    }

    fn event(&mut self, event: Event, source: &mut dyn SpanSource, peak: &mut usize) -> Result<()> {
        let (plan, own) = (self.step.plan, self.step.own);
        match event {
            // The gathered buffer, and the rank's piece it sends until it completes.
            Event::Prefetch(g) => {
                let span = plan.spans[g].clone();
                self.bytes += 4 * (span.len() + own.owned_len(&span));
                source.prefetch(g, span)?;
                self.started[g] = true;
            }
            Event::Gather(g) => {
                let span = plan.spans[g].clone();
                let v = source.gather(g, span.clone())?;
                match std::mem::take(&mut self.started[g]) {
                    true => self.bytes -= 4 * own.owned_len(&span),
                    false => self.bytes += 4 * v.len(),
                }
                self.params[g] = Some(Arc::new(v));
            }
            Event::Free(g) => {
                if let Some(v) = self.params[g].take() {
                    self.bytes -= 4 * v.len();
                }
            }
            Event::Forward(u) => {
                let m = self.unit_model(u)?;
                *peak = (*peak).max(self.bytes + crate::models::factory::vars_bytes(&*m));
                let y = m.unit_forward(self.step.fx, u, &self.inputs[u])?.detach();
                self.inputs.push(y);
            }
            Event::Backward(u) => self.backward(u, peak)?,
            Event::Scatter(g) => {
                let v = self.grads[g].take().ok_or_else(|| {
                    TrainError::Units(format!("zero3: group {g} scattered before its backward"))
                })?;
                let span = plan.spans[g].clone();
                *peak = (*peak).max(self.bytes + 4 * own.owned_len(&span));
                self.bytes -= 4 * v.len();
                source.scatter(v, span)?;
            }
        }
        Ok(())
    }

    /// Unit `u`'s model around its gathered groups.
    fn unit_model(&self, u: usize) -> Result<Box<dyn Model>> {
        let groups = self.step.plan.units[u]
            .iter()
            .map(|&g| {
                let v = self.params[g].clone().ok_or_else(|| {
                    TrainError::Units(format!("zero3: unit {u} runs before group {g} is gathered"))
                })?;
                Ok((g, v))
            })
            .collect::<Result<Vec<_>>>()?;
        let m = self.step.unit_model(groups)?;
        let slots = self.step.layout.slots().len();
        if m.params().len() != slots {
            return Err(TrainError::Units(format!(
                "zero3: unit {u}'s model declares {} parameters, the layout {slots}",
                m.params().len()
            )));
        }
        Ok(m)
    }

    /// Unit `u`'s backward: its forward again from its checkpoint with the graph, then the
    /// gradient of its output (the loss, for the last unit) into its groups' gradient
    /// buffers and its input.
    fn backward(&mut self, u: usize, peak: &mut usize) -> Result<()> {
        let (plan, step) = (self.step.plan, self.step);
        let m = self.unit_model(u)?;
        for &g in &plan.units[u] {
            if self.grads[g].is_none() {
                self.grads[g] = Some(vec![0.0; plan.spans[g].len()]);
                self.bytes += 4 * plan.spans[g].len();
            }
        }
        *peak = (*peak).max(self.bytes + crate::models::factory::vars_bytes(&*m));
        let input = match u {
            0 => None,
            _ => Some(Var::from_tensor(&self.inputs[u])?),
        };
        let x = input.as_ref().map_or(&self.inputs[0], |v| v.as_tensor());
        let out = m.unit_forward(step.fx, u, x)?;
        let objective = match (u + 1 == plan.units.len(), &self.grad_out) {
            (true, _) => {
                let (sum, _) = cross_entropy_sum(step.fx, &out, &self.mb.targets)?;
                self.loss = scalar(&sum)?;
                self.factor.map(|f| sum * f).transpose()?
            }
            (false, Some(g)) => Some((out * g)?.sum_all()?),
            (false, None) => None,
        };
        let Some(objective) = objective else {
            return Ok(());
        };
        let store = objective.backward()?;
        for (i, (p, slot)) in m.params().iter().zip(step.layout.slots()).enumerate() {
            let Some(buf) = self.grads[slot.group].as_mut() else {
                continue;
            };
            // A shared group's other parameters get no gradient from this unit.
            let at = slot.offset - plan.spans[slot.group].start;
            self.reached[i] |= add_grad(&store, p, &mut buf[at..at + slot.len])?;
        }
        if let Some(v) = &input {
            let g = store.get(v.as_tensor()).ok_or_else(|| {
                TrainError::Units(format!("zero3: unit {u}'s input got no gradient"))
            })?;
            self.grad_out = Some(g.clone());
        }
        Ok(())
    }
}

/// The model's forward of `input` unit by unit (ZeRO-3: evaluation, sampling): each
/// unit's groups gathered from `source` as it needs them and freed after the last unit that
/// uses them, no backward and no reduction, so the rank holds about what a training unit
/// holds instead of the whole model. Every rank gathers the same groups in the same order
/// (the plan's alone). Returns the last unit's output (the logits), detached.
pub fn forward(
    step: &UnitStep<'_>,
    source: &mut dyn SpanSource,
    input: &candle_core::Tensor,
) -> Result<candle_core::Tensor> {
    let plan = step.plan;
    let n = plan.units.len();
    // The last unit using each group: after it the group is freed.
    let mut last_use = vec![0; plan.spans.len()];
    for (u, groups) in plan.units.iter().enumerate() {
        for &g in groups {
            last_use[g] = u;
        }
    }
    let mut params: Vec<Option<Arc<Vec<f32>>>> = vec![None; plan.spans.len()];
    let mut x = input.clone();
    for u in 0..n {
        let mut groups = Vec::with_capacity(plan.units[u].len());
        for &g in &plan.units[u] {
            if params[g].is_none() {
                params[g] = Some(Arc::new(source.gather(g, plan.spans[g].clone())?));
            }
            groups.push((g, params[g].clone().expect("gathered above")));
        }
        let m = step.unit_model(groups)?;
        x = m.unit_forward(step.fx, u, &x)?.detach();
        for &g in &plan.units[u] {
            if last_use[g] == u {
                params[g] = None;
            }
        }
    }
    Ok(x)
}

/// Evaluation of micro-batch `mb` unit by unit ([`forward`]): the summed loss of the
/// valid targets, how many are the top-1 prediction, and how many there are.
pub fn evaluate(
    step: &UnitStep<'_>,
    source: &mut dyn SpanSource,
    mb: &MicroBatch,
) -> Result<(f64, usize, usize)> {
    let logits = forward(step, source, &mb.input)?;
    crate::loss::loss_and_hits(step.fx, &logits, &mb.targets)
}
