//! Where the GPT step finds each parameter group: the seam that lets ZeRO-3 gather a
//! block's parameters just before the step needs them and free them after.
//!
//! The step asks for a group ([`StepParams::group`]) each time it computes with it, and
//! says when it is done with it for a pass ([`StepParams::done`]). A [`GroupView`] is a
//! window of the flat layout: the group's parameters (and, in the backward, its
//! gradient accumulators) as slices that start at flat element `base`, so the step's
//! offsets stay the flat layout's. [`Whole`] serves every group from the whole flat
//! buffers (one rank, DDP, ZeRO-1/2); a ZeRO-3 source serves each group from a buffer
//! that holds only that group, gathered from the ranks' shards.
//!
//! The order of calls for one micro-batch, with `L` blocks (groups `1..=L`) and the
//! final norm as group `L + 1`:
//! - forward: group 0 (embeddings), then each block `1..=L`, then `L + 1`, then 0 again
//!   (the head is tied to the token embedding); `done(g, Forward)` after each use;
//! - backward: 0 (the head's weight and its gradient), `L + 1`, the blocks from `L` down
//!   to 1, then 0 (the embeddings' gradients); `done(g, Backward)` when the group's
//!   gradients are final, once per group: `L + 1`, `L`, ..., 1, 0.

use std::ops::Range;

use crate::error::KernelError;
use crate::gpt::GroupReady;

/// Which pass asks for a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The forward: parameters are read.
    Forward,
    /// The backward: parameters are read and gradients added.
    Backward,
}

/// One call the step makes on its [`StepParams`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupCall {
    /// [`StepParams::group`].
    Open(usize, Phase),
    /// [`StepParams::done`].
    Done(usize, Phase),
}

/// The calls one micro-batch of the GPT step makes, in order, for a model of `groups`
/// parameter groups (`L + 2`): the order the module doc gives, as data, so that a source
/// can run its schedule without computing (ZeRO tells its per-group workspace before the
/// first step this way). stoker-train's `direct_step` test records the step's own calls
/// against it.
pub fn group_calls(groups: usize) -> Vec<GroupCall> {
    use GroupCall::{Done, Open};
    use Phase::{Backward, Forward};
    let last = groups.saturating_sub(1);
    let mut calls = vec![Open(0, Forward), Done(0, Forward)];
    for g in 1..last {
        calls.extend([Open(g, Forward), Done(g, Forward)]);
    }
    calls.extend([Open(last, Forward), Done(last, Forward)]);
    calls.extend([Open(0, Forward), Done(0, Forward)]);
    calls.extend([
        Open(0, Backward),
        Open(last, Backward),
        Done(last, Backward),
    ]);
    for g in (1..last).rev() {
        calls.extend([Open(g, Backward), Done(g, Backward)]);
    }
    calls.extend([Open(0, Backward), Done(0, Backward)]);
    calls
}

/// Makes `calls` on `source` without computing (views are opened and dropped).
pub fn replay(source: &mut dyn StepParams, calls: &[GroupCall]) -> Result<(), KernelError> {
    for &call in calls {
        match call {
            GroupCall::Open(g, phase) => {
                source.group(g, phase)?;
            }
            GroupCall::Done(g, phase) => source.done(g, phase)?,
        }
    }
    Ok(())
}

/// One group's window of the flat layout.
pub struct GroupView<'a> {
    /// Flat element at which both slices start.
    pub base: usize,
    /// Parameters from `base` on.
    pub params: &'a [f32],
    /// Gradient accumulators from `base` on (may be empty in the forward).
    pub grads: &'a mut [f32],
}

/// Where the step finds its parameters and adds its gradients, group by group.
pub trait StepParams {
    /// Group `group` for `phase`; the view must cover the group's range of the flat
    /// layout (its gradients too in the backward).
    fn group(&mut self, group: usize, phase: Phase) -> Result<GroupView<'_>, KernelError>;
    /// The step is done with `group` for now in `phase`; in the backward, its gradients
    /// are final for this micro-batch.
    fn done(&mut self, group: usize, phase: Phase) -> Result<(), KernelError>;
}

/// Every group from the whole flat buffers; `done` in the backward tells `ready`.
pub struct Whole<'a, 'r> {
    /// The flat parameter buffer.
    pub params: &'a [f32],
    /// The flat gradient buffer.
    pub grads: &'a mut [f32],
    /// Hears of each group whose gradients are final.
    pub ready: GroupReady<'r>,
}

impl StepParams for Whole<'_, '_> {
    fn group(&mut self, _: usize, _: Phase) -> Result<GroupView<'_>, KernelError> {
        Ok(GroupView {
            base: 0,
            params: self.params,
            grads: self.grads,
        })
    }

    fn done(&mut self, group: usize, phase: Phase) -> Result<(), KernelError> {
        if phase == Phase::Backward {
            (self.ready)(group, self.grads);
        }
        Ok(())
    }
}

/// Group `group` from `source` for `phase`, checked to cover its span `range` of the flat
/// layout (each step's `open`).
pub(crate) fn open_group<'s>(
    source: &'s mut dyn StepParams,
    group: usize,
    phase: Phase,
    range: &Range<usize>,
) -> Result<GroupView<'s>, KernelError> {
    let view = source.group(group, phase)?;
    check_view(&view, group, range, phase)?;
    Ok(view)
}

/// Checks that `view` covers `range` (and its gradients do, in the backward), so that
/// a wrong source is an error naming the group instead of an out-of-bounds panic.
pub(crate) fn check_view(
    view: &GroupView<'_>,
    group: usize,
    range: &Range<usize>,
    phase: Phase,
) -> Result<(), KernelError> {
    let covers = |len: usize| view.base <= range.start && view.base + len >= range.end;
    let grads_ok = phase == Phase::Forward || covers(view.grads.len());
    if covers(view.params.len()) && grads_ok {
        return Ok(());
    }
    Err(KernelError::Layout {
        op: "gpt-step",
        msg: format!(
            "group {group} spans flat elements {range:?}, its view starts at {} with {} \
             parameters and {} gradients ({phase:?})",
            view.base,
            view.params.len(),
            view.grads.len()
        ),
    })
}
