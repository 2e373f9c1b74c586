//! ZeRO-3 on the candle-graph path, unit by unit: FSDP with a wrap policy per layer or
//! block ([`Model::units`]) and activation checkpointing at the units' boundaries. A rank
//! gathers one unit's parameter groups at a time, runs that unit and drops them; each
//! group's gradients are reduce-scattered into the rank's shard as soon as the backward is
//! done with the group.
//!
//! Candle's autograd keeps every tensor a forward used until the backward, gathered
//! weights included, so a unit's parameters cannot be freed under a graph that lives on.
//! The forward therefore runs each unit with no graph outliving it and keeps only the
//! unit's input (its checkpoint); the backward gathers each unit again, last unit first,
//! reruns its forward from the checkpoint with the graph, and backpropagates the
//! gradient of its output into its parameters and its input. That is one more forward
//! per micro-batch (about 4/3 of the compute, as activation checkpointing costs) for one
//! unit's parameters, gradients and graph at a time instead of the whole model's.
//!
//! Groups that several units read (the GPT's token embedding, which its tied head reads
//! too) stay gathered from their first use to their last, and their gradients are summed
//! over those units before their reduce-scatter: FSDP's root unit. With
//! `reshard_after_forward = false` a unit's groups stay gathered from its forward to its
//! backward (one gather each, the whole model's parameters at the forward's end).
//!
//! The schedule ([`UnitPlan::schedule`]) is data: [`micro_batch`] runs it, and
//! [`UnitPlan::peak_bytes`] replays it with sizes alone, so the workspace is told before
//! the first step; the planner counts its gathers ([`UnitPlan::gathers`]).

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Tensor, Var};

use super::Strategy;
use crate::accumulate::MicroBatch;
use crate::config::ModelConfig;
use crate::error::{Result, TrainError};
use crate::layout::FlatLayout;
use crate::loss::{cross_entropy_sum, scalar};
use crate::models::Model;
use crate::params::ParamBuilder;
use crate::precision::{Fx, Kernels, Precision};

/// One step of the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// All-gather group `g`'s parameters from the ranks' shards.
    Gather(usize),
    /// Run unit `u`'s forward with no graph outliving it; its output is the next unit's
    /// checkpoint.
    Forward(usize),
    /// Rerun unit `u` from its checkpoint with the graph and backpropagate into its
    /// groups' gradient buffers (allocated zeroed at their first backward) and its input.
    Backward(usize),
    /// Drop group `g`'s gathered parameters.
    Free(usize),
    /// Reduce-scatter group `g`'s gradients into the rank's shard and drop them.
    Scatter(usize),
}

/// The units of one model over its flat layout.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitPlan {
    /// Each unit's parameter groups.
    pub units: Vec<Vec<usize>>,
    /// Each group's span of the flat buffer, by group number.
    pub spans: Vec<Range<usize>>,
    /// Each group's parameter elements (its span without padding).
    pub elems: Vec<usize>,
    /// Keep a unit's gathered groups from its forward to its backward
    /// (`reshard_after_forward = false`).
    pub keep_after_forward: bool,
    /// Bytes of one element of the models' variables.
    pub var_bytes: usize,
}

impl UnitPlan {
    /// The plan of `model` (any build of it: its units do not depend on its values) over
    /// `layout`, whose groups must be numbered 0, 1, 2, ... in buffer order.
    pub fn of(
        model: &dyn Model,
        layout: &FlatLayout,
        reshard_after_forward: bool,
        var_bytes: usize,
    ) -> Result<Self> {
        let ranges = layout.group_ranges();
        if let Some((i, (g, _))) = ranges.iter().enumerate().find(|(i, (g, _))| i != g) {
            return Err(TrainError::Layout(format!(
                "zero3 gathers groups numbered 0, 1, 2, ...; group {g} is the {}th",
                i + 1
            )));
        }
        let mut elems = vec![0; ranges.len()];
        for s in layout.slots() {
            elems[s.group] += s.len;
        }
        let units: Vec<Vec<usize>> = (0..model.units()).map(|u| model.unit_groups(u)).collect();
        if units.is_empty() {
            return Err(TrainError::Layout("zero3: a model without units".into()));
        }
        for g in units.iter().flatten() {
            if *g >= ranges.len() {
                return Err(TrainError::Layout(format!(
                    "zero3: a unit reads group {g}, the layout has {}",
                    ranges.len()
                )));
            }
        }
        // A group no unit reads would never be gathered nor get a gradient.
        if let Some(g) = (0..ranges.len()).find(|g| !units.iter().any(|u| u.contains(g))) {
            return Err(TrainError::Layout(format!(
                "zero3: no unit of the model reads parameter group {g}"
            )));
        }
        Ok(UnitPlan {
            units,
            spans: ranges.into_iter().map(|(_, r)| r).collect(),
            elems,
            keep_after_forward: !reshard_after_forward,
            var_bytes,
        })
    }

    /// The plan of the model `config` describes over `layout` (built from no values: every
    /// parameter an empty placeholder).
    pub fn for_model(
        config: &ModelConfig,
        precision: Precision,
        kernels: Kernels,
        layout: &FlatLayout,
        reshard_after_forward: bool,
    ) -> Result<Self> {
        let dtype = kernels.param_dtype(precision);
        let model = unit_model(config, precision, kernels, layout, Vec::new())?;
        Self::of(
            &*model,
            layout,
            reshard_after_forward,
            dtype.size_in_bytes(),
        )
    }

    /// The lowest-numbered unit reading `g`: the last the backward reaches.
    fn last_backward_user(&self, g: usize) -> Option<usize> {
        self.units.iter().position(|gs| gs.contains(&g))
    }

    /// Whether more than one unit reads `g`.
    fn shared(&self, g: usize) -> bool {
        self.units.iter().filter(|gs| gs.contains(&g)).count() > 1
    }

    /// One micro-batch's events, in order (see the module doc).
    pub fn schedule(&self) -> Vec<Event> {
        let n = self.units.len();
        let mut held = vec![false; self.spans.len()];
        let mut events = Vec::new();
        let gather = |u: usize, held: &mut Vec<bool>, events: &mut Vec<Event>| {
            for &g in &self.units[u] {
                if !held[g] {
                    events.push(Event::Gather(g));
                    held[g] = true;
                }
            }
        };
        // The last unit's forward is its backward's rerun: it runs once.
        for u in 0..n - 1 {
            gather(u, &mut held, &mut events);
            events.push(Event::Forward(u));
            if !self.keep_after_forward {
                for &g in &self.units[u] {
                    if !self.shared(g) {
                        events.push(Event::Free(g));
                        held[g] = false;
                    }
                }
            }
        }
        for u in (0..n).rev() {
            gather(u, &mut held, &mut events);
            events.push(Event::Backward(u));
            for &g in &self.units[u] {
                if self.last_backward_user(g) == Some(u) {
                    events.push(Event::Scatter(g));
                    events.push(Event::Free(g));
                    held[g] = false;
                }
            }
        }
        events
    }

    /// How many times each group is all-gathered per micro-batch.
    pub fn gathers(&self) -> Vec<u64> {
        let mut n = vec![0; self.spans.len()];
        for e in self.schedule() {
            if let Event::Gather(g) = e {
                n[g] += 1;
            }
        }
        n
    }

    /// Bytes of unit `u`'s model variables.
    fn unit_var_bytes(&self, u: usize) -> usize {
        self.var_bytes * self.units[u].iter().map(|&g| self.elems[g]).sum::<usize>()
    }

    /// The most bytes one micro-batch holds at once on the rank owning `own` of the flat
    /// buffer: gathered groups and gradient buffers (FP32), a unit model's variables while
    /// it runs, a reduce-scatter's output; what [`micro_batch`] counts as it runs, told
    /// here from the schedule and the sizes alone.
    pub fn peak_bytes(&self, own: &Range<usize>) -> usize {
        let local = |g: usize| owned_len(own, &self.spans[g]);
        let (mut held, mut peak) = (0usize, 0usize);
        let mut grads = vec![false; self.spans.len()];
        for e in self.schedule() {
            match e {
                Event::Gather(g) => held += 4 * self.spans[g].len(),
                Event::Free(g) => held -= 4 * self.spans[g].len(),
                Event::Forward(u) => peak = peak.max(held + self.unit_var_bytes(u)),
                Event::Backward(u) => {
                    for &g in &self.units[u] {
                        if !grads[g] {
                            grads[g] = true;
                            held += 4 * self.spans[g].len();
                        }
                    }
                    peak = peak.max(held + self.unit_var_bytes(u));
                }
                Event::Scatter(g) => {
                    peak = peak.max(held + 4 * local(g));
                    held -= 4 * self.spans[g].len();
                }
            }
            peak = peak.max(held);
        }
        peak
    }
}

/// Elements of `span` inside `own`: the size of this rank's part of a reduce-scatter.
fn owned_len(own: &Range<usize>, span: &Range<usize>) -> usize {
    span.end
        .min(own.end)
        .saturating_sub(span.start.max(own.start))
}

/// A model of `config` whose groups `groups` (group number, values from the group's span
/// start) are real and every other parameter an empty placeholder.
fn unit_model(
    config: &ModelConfig,
    precision: Precision,
    kernels: Kernels,
    layout: &FlatLayout,
    groups: Vec<(usize, Arc<Vec<f32>>)>,
) -> Result<Box<dyn Model>> {
    let b = ParamBuilder::from_groups(
        candle_core::Device::Cpu,
        kernels.param_dtype(precision),
        layout.clone(),
        groups,
    );
    crate::trainer::model_with_builder(config, b)
}

/// Where the unit-by-unit step gets each group's parameters and sends its gradients.
pub trait SpanSource {
    /// The parameters of flat span `span`.
    fn gather(&mut self, span: Range<usize>) -> Result<Vec<f32>>;
    /// Takes `grads`, a micro-batch's gradients of flat span `span`.
    fn scatter(&mut self, grads: Vec<f32>, span: Range<usize>) -> Result<()>;
    /// The part of the flat buffer this rank owns.
    fn own(&self) -> Range<usize>;
}

/// The rank's collectives: groups all-gathered from every rank's shard `held`, gradients
/// reduce-scattered into its shard `shard` ([`Strategy::gather_span`],
/// [`Strategy::scatter_span`]).
pub struct Collective<'a> {
    /// The ZeRO-3 strategy.
    pub strategy: &'a mut dyn Strategy,
    /// This rank's shard of the FP32 parameters.
    pub held: &'a [f32],
    /// This rank's shard of the window's gradient sum.
    pub shard: &'a mut [f32],
    /// The flat buffer's length.
    pub len: usize,
}

impl SpanSource for Collective<'_> {
    fn gather(&mut self, span: Range<usize>) -> Result<Vec<f32>> {
        self.strategy.gather_span(self.held, span)
    }

    fn scatter(&mut self, grads: Vec<f32>, span: Range<usize>) -> Result<()> {
        self.strategy.scatter_span(grads, span, self.shard)
    }

    fn own(&self) -> Range<usize> {
        self.strategy.holds(self.len)
    }
}

/// No collectives: zeros for parameters (a step's memory does not depend on their values),
/// gradients dropped. What a scratch micro-batch runs to count the step's memory before
/// training, changing no state.
pub struct Scratch {
    /// The part of the flat buffer the rank owns (its reduce-scatter outputs' size).
    pub own: Range<usize>,
}

impl SpanSource for Scratch {
    fn gather(&mut self, span: Range<usize>) -> Result<Vec<f32>> {
        Ok(vec![0.0; span.len()])
    }

    fn scatter(&mut self, _grads: Vec<f32>, _span: Range<usize>) -> Result<()> {
        Ok(())
    }

    fn own(&self) -> Range<usize> {
        self.own.clone()
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
    let plan = step.plan;
    let n = plan.units.len();
    let slots = step.layout.slots();
    // Which parameters got a gradient from some unit (every one must, when checked).
    let mut reached = vec![false; slots.len()];
    let mut params: Vec<Option<Arc<Vec<f32>>>> = vec![None; plan.spans.len()];
    let mut grads: Vec<Option<Vec<f32>>> = vec![None; plan.spans.len()];
    let mut inputs = vec![mb.input.clone()];
    let mut grad_out: Option<Tensor> = None;
    let mut loss = 0.0;
    let mut bytes = 0usize;
    let build = |u: usize, params: &[Option<Arc<Vec<f32>>>]| -> Result<Box<dyn Model>> {
        let groups = plan.units[u]
            .iter()
            .map(|&g| {
                let v = params[g].clone().ok_or_else(|| {
                    TrainError::Layout(format!("zero3: unit {u} runs before group {g} is gathered"))
                })?;
                Ok((g, v))
            })
            .collect::<Result<Vec<_>>>()?;
        let m = unit_model(
            step.model,
            step.precision,
            step.kernels,
            step.layout,
            groups,
        )?;
        if m.params().len() != slots.len() {
            return Err(TrainError::Layout(format!(
                "zero3: unit {u}'s model declares {} parameters, the layout {}",
                m.params().len(),
                slots.len()
            )));
        }
        Ok(m)
    };
    for event in plan.schedule() {
        match event {
            Event::Gather(g) => {
                let v = source.gather(plan.spans[g].clone())?;
                bytes += 4 * v.len();
                params[g] = Some(Arc::new(v));
            }
            Event::Free(g) => {
                if let Some(v) = params[g].take() {
                    bytes -= 4 * v.len();
                }
            }
            Event::Forward(u) => {
                let m = build(u, &params)?;
                *peak = (*peak).max(bytes + crate::trainer::vars_bytes(&*m));
                let y = m.unit_forward(step.fx, u, &inputs[u])?.detach();
                inputs.push(y);
            }
            Event::Backward(u) => {
                let m = build(u, &params)?;
                for &g in &plan.units[u] {
                    if grads[g].is_none() {
                        grads[g] = Some(vec![0.0; plan.spans[g].len()]);
                        bytes += 4 * plan.spans[g].len();
                    }
                }
                *peak = (*peak).max(bytes + crate::trainer::vars_bytes(&*m));
                let input = match u {
                    0 => None,
                    _ => Some(Var::from_tensor(&inputs[u])?),
                };
                let x = input.as_ref().map_or(&inputs[0], |v| v.as_tensor());
                let out = m.unit_forward(step.fx, u, x)?;
                let objective = match (u + 1 == n, &grad_out) {
                    (true, _) => {
                        let (sum, _) = cross_entropy_sum(step.fx, &out, &mb.targets)?;
                        loss = scalar(&sum)?;
                        factor.map(|f| sum * f).transpose()?
                    }
                    (false, Some(g)) => Some((out * g)?.sum_all()?),
                    (false, None) => None,
                };
                let Some(objective) = objective else {
                    continue;
                };
                let store = objective.backward()?;
                for (i, (p, slot)) in m.params().iter().zip(slots).enumerate() {
                    let Some(buf) = grads[slot.group].as_mut() else {
                        continue;
                    };
                    // A shared group's other parameters get no gradient from this unit.
                    let Some(gr) = store.get(p.var.as_tensor()) else {
                        continue;
                    };
                    reached[i] = true;
                    let gr = gr
                        .to_dtype(candle_core::DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    let at = slot.offset - plan.spans[slot.group].start;
                    for (o, x) in buf[at..at + slot.len].iter_mut().zip(&gr) {
                        *o += x;
                    }
                }
                if let Some(v) = &input {
                    let g = store.get(v.as_tensor()).ok_or_else(|| {
                        TrainError::Layout(format!("zero3: unit {u}'s input got no gradient"))
                    })?;
                    grad_out = Some(g.clone());
                }
            }
            Event::Scatter(g) => {
                let v = grads[g].take().ok_or_else(|| {
                    TrainError::Layout(format!("zero3: group {g} scattered before its backward"))
                })?;
                let span = plan.spans[g].clone();
                *peak = (*peak).max(bytes + 4 * owned_len(&source.own(), &span));
                bytes -= 4 * v.len();
                source.scatter(v, span)?;
            }
        }
        *peak = (*peak).max(bytes);
    }
    if check_grads && factor.is_some() {
        if let Some(i) = reached.iter().position(|r| !r) {
            return Err(TrainError::NoGradient {
                name: slots[i].name.clone(),
            });
        }
    }
    Ok(loss)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Event::*;

    fn gpt_like(keep: bool) -> UnitPlan {
        // Embeddings (group 0), two blocks, the final norm with the head tied to group 0.
        UnitPlan {
            units: vec![vec![0], vec![1], vec![2], vec![3, 0]],
            spans: vec![0..100, 100..200, 200..300, 300..310],
            elems: vec![100, 100, 100, 10],
            keep_after_forward: keep,
            var_bytes: 4,
        }
    }

    #[test]
    fn the_gpt_schedule_gathers_the_root_once_and_each_block_twice() {
        let p = gpt_like(false);
        assert_eq!(
            p.schedule(),
            [
                Gather(0),
                Forward(0),
                Gather(1),
                Forward(1),
                Free(1),
                Gather(2),
                Forward(2),
                Free(2),
                Gather(3),
                Backward(3),
                Scatter(3),
                Free(3),
                Gather(2),
                Backward(2),
                Scatter(2),
                Free(2),
                Gather(1),
                Backward(1),
                Scatter(1),
                Free(1),
                Backward(0),
                Scatter(0),
                Free(0),
            ]
        );
        // The direct step's traffic: root groups once, blocks twice.
        assert_eq!(p.gathers(), [1, 2, 2, 1]);
        assert_eq!(gpt_like(true).gathers(), [1, 1, 1, 1]);
        // At a block's backward a rank holds group 0's parameters and gradients, the
        // block's parameters and gradients and the block model's variables: 5 x 100
        // elements of 4 bytes (a reduce-scatter's output comes after the variables go).
        assert_eq!(p.peak_bytes(&(0..150)), 4 * 500);
        // Without resharding the forward ends holding the embeddings and both blocks; the
        // last block's backward (after the head's, whose group is gone) adds its
        // gradients, the embeddings' (from the head) and its variables.
        assert_eq!(
            gpt_like(true).peak_bytes(&(0..150)),
            4 * (300 + 100 + 100 + 100)
        );
    }
}
