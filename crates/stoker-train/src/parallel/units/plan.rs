//! A model's units over its flat layout and their schedule for one micro-batch: which
//! groups are gathered, run, reduce-scattered and freed when, as data
//! ([`UnitPlan::schedule`]), with the gathers it makes and the most bytes it holds counted
//! from it alone.

use std::ops::Range;
use std::sync::Arc;

use crate::error::{Result, TrainError};
use crate::layout::FlatLayout;
use crate::models::Model;
use crate::models::ModelConfig;
use crate::params::ParamBuilder;
use crate::pieces::Pieces;
use crate::precision::{Kernels, Precision};

/// One step of the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Start all-gathering group `g`'s parameters, one unit ahead of its use, so that the
    /// collective proceeds while the current unit computes (FSDP's forward and backward
    /// prefetch); its buffer, and the rank's piece it sends, are held from here.
    Prefetch(usize),
    /// Have group `g`'s parameters: complete its prefetch, or all-gather it now.
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
    /// One micro-batch's events, built once from the above.
    schedule: Vec<Event>,
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
        let spans = layout.group_spans()?;
        let mut elems = vec![0; spans.len()];
        for s in layout.slots() {
            elems[s.group] += s.len;
        }
        let units: Vec<Vec<usize>> = (0..model.units()).map(|u| model.unit_groups(u)).collect();
        if units.is_empty() {
            return Err(TrainError::Units("zero3: a model without units".into()));
        }
        for g in units.iter().flatten() {
            if *g >= spans.len() {
                return Err(TrainError::Units(format!(
                    "zero3: a unit reads group {g}, the layout has {}",
                    spans.len()
                )));
            }
        }
        // A group no unit reads would never be gathered nor get a gradient.
        if let Some(g) = (0..spans.len()).find(|g| !units.iter().any(|u| u.contains(g))) {
            return Err(TrainError::Units(format!(
                "zero3: no unit of the model reads parameter group {g}"
            )));
        }
        Ok(Self::new(
            units,
            spans,
            elems,
            !reshard_after_forward,
            var_bytes,
        ))
    }

    /// The plan of `units` over groups of `spans` and `elems`, its schedule built.
    fn new(
        units: Vec<Vec<usize>>,
        spans: Vec<Range<usize>>,
        elems: Vec<usize>,
        keep_after_forward: bool,
        var_bytes: usize,
    ) -> Self {
        let mut plan = UnitPlan {
            units,
            spans,
            elems,
            keep_after_forward,
            var_bytes,
            schedule: Vec::new(),
        };
        plan.schedule = plan.build_schedule();
        plan
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
        let cpu = candle_core::Device::Cpu;
        let model = unit_model(config, precision, kernels, layout, Vec::new(), &cpu)?;
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
    pub fn schedule(&self) -> &[Event] {
        &self.schedule
    }

    fn build_schedule(&self) -> Vec<Event> {
        #[derive(Clone, Copy, PartialEq)]
        enum State {
            Gone,
            Started,
            Held,
        }
        let n = self.units.len();
        let mut state = vec![State::Gone; self.spans.len()];
        let mut events = Vec::new();
        // Unit `u`'s groups in hand before it runs.
        let gather = |u: usize, state: &mut Vec<State>, events: &mut Vec<Event>| {
            for &g in &self.units[u] {
                if state[g] != State::Held {
                    events.push(Event::Gather(g));
                    state[g] = State::Held;
                }
            }
        };
        // Unit `next`'s groups started while the current unit runs.
        let prefetch = |next: usize, state: &mut Vec<State>, events: &mut Vec<Event>| {
            for &g in &self.units[next] {
                if state[g] == State::Gone {
                    events.push(Event::Prefetch(g));
                    state[g] = State::Started;
                }
            }
        };
        // The last unit's forward is its backward's rerun: it runs once.
        for u in 0..n - 1 {
            gather(u, &mut state, &mut events);
            prefetch(u + 1, &mut state, &mut events);
            events.push(Event::Forward(u));
            if !self.keep_after_forward {
                for &g in &self.units[u] {
                    if !self.shared(g) {
                        events.push(Event::Free(g));
                        state[g] = State::Gone;
                    }
                }
            }
        }
        for u in (0..n).rev() {
            gather(u, &mut state, &mut events);
            if u > 0 {
                prefetch(u - 1, &mut state, &mut events);
            }
            events.push(Event::Backward(u));
            for &g in &self.units[u] {
                if self.last_backward_user(g) == Some(u) {
                    events.push(Event::Scatter(g));
                    events.push(Event::Free(g));
                    state[g] = State::Gone;
                }
            }
        }
        events
    }

    /// How many times each group is all-gathered per micro-batch.
    pub fn gathers(&self) -> Vec<u64> {
        let mut n = vec![0; self.spans.len()];
        for &e in self.schedule() {
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
    /// buffer: gathered and prefetched groups and gradient buffers (FP32), a unit model's variables while
    /// it runs, a reduce-scatter's output; what [`super::step::micro_batch`] counts as it
    /// runs, predicted here from the schedule and the sizes alone.
    pub fn peak_bytes(&self, own: &Pieces) -> usize {
        let local = |g: usize| own.owned_len(&self.spans[g]);
        let (mut held, mut peak) = (0usize, 0usize);
        let mut grads = vec![false; self.spans.len()];
        let mut started = vec![false; self.spans.len()];
        for &e in self.schedule() {
            match e {
                // The gathered buffer, and the rank's piece it sends until it completes.
                Event::Prefetch(g) => {
                    started[g] = true;
                    held += 4 * (self.spans[g].len() + local(g));
                }
                Event::Gather(g) if std::mem::take(&mut started[g]) => held -= 4 * local(g),
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

/// A model of `config` on `device` whose groups `groups` (group number, values from the
/// group's span start) are real and every other parameter an empty placeholder.
pub(super) fn unit_model(
    config: &ModelConfig,
    precision: Precision,
    kernels: Kernels,
    layout: &FlatLayout,
    groups: Vec<(usize, Arc<Vec<f32>>)>,
    device: &candle_core::Device,
) -> Result<Box<dyn Model>> {
    let b = ParamBuilder::from_groups(
        device.clone(),
        kernels.param_dtype(precision),
        layout.clone(),
        groups,
    );
    crate::models::factory::model_with_builder(config, b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Event::*;

    fn gpt_like(keep: bool) -> UnitPlan {
        // Embeddings (group 0), two blocks, the final norm with the head tied to group 0.
        UnitPlan::new(
            vec![vec![0], vec![1], vec![2], vec![3, 0]],
            vec![0..100, 100..200, 200..300, 300..310],
            vec![100, 100, 100, 10],
            keep,
            4,
        )
    }

    #[test]
    fn the_gpt_schedule_gathers_the_root_once_and_each_block_twice() {
        let p = gpt_like(false);
        assert_eq!(
            p.schedule(),
            [
                Gather(0),
                Prefetch(1),
                Forward(0),
                Gather(1),
                Prefetch(2),
                Forward(1),
                Free(1),
                Gather(2),
                Prefetch(3),
                Forward(2),
                Free(2),
                Gather(3),
                Prefetch(2),
                Backward(3),
                Scatter(3),
                Free(3),
                Gather(2),
                Prefetch(1),
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
        // At the last block's backward a rank holds group 0's parameters and gradients,
        // the block's parameters and gradients, the first block's prefetched parameters
        // with the piece of them it sends (its half, 50) and the block model's variables:
        // 650 elements of 4 bytes (a reduce-scatter's output comes after the variables go).
        assert_eq!(p.peak_bytes(&(0..150).into()), 4 * 650);
        // Without resharding the forward ends holding the embeddings and both blocks; the
        // last block's backward (after the head's, whose group is gone) adds its
        // gradients, the embeddings' (from the head) and its variables.
        assert_eq!(
            gpt_like(true).peak_bytes(&(0..150).into()),
            4 * (300 + 100 + 100 + 100)
        );
    }
}
