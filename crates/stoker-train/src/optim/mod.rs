//! Optimizers over the flat FP32 buffers of a [`crate::layout::FlatLayout`].
//!
//! They see only (offset, len, decay) segments, never a model: the same code serves a
//! whole buffer or one ZeRO shard of it. An optimizer is built for some [`Pieces`] of
//! the flat buffer (the whole of it, one rank's ZeRO-1/2 shard, or its ZeRO-3 piece of
//! every group): its moments cover them alone, end to end from zero, and its
//! [`OptimState`] records their global offsets, so sharding and resharding are layout
//! operations. Padding between slots is never touched. The arithmetic is stoker-kernels' fused passes ([`stoker_kernels::adamw_update`],
//! [`stoker_kernels::sgd_update`]): torch's order of operations, vectorized and parallel
//! over chunks, with the bf16 copy of the updated weights written in the same pass.

pub mod adamw;
pub mod sgd;

use std::ops::Range;

use half::bf16;
use serde::{Deserialize, Serialize};

use crate::layout::FlatLayout;
use crate::pieces::Pieces;

pub use adamw::{AdamW, AdamWConfig};
pub use sgd::{Sgd, SgdConfig};

/// A stretch of the flat buffer the optimizer updates, and whether it takes weight decay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// First element.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
    /// Apply weight decay to it.
    pub decay: bool,
}

/// Segments of `layout`: weight decay on tensors of rank >= 2 (matrices, conv kernels,
/// embeddings), none on biases and norm gains (GPT-2 / nanoGPT practice). With
/// `decay_all`, every tensor decays (torch's single param group).
pub fn segments(layout: &FlatLayout, decay_all: bool) -> Vec<Segment> {
    layout
        .slots()
        .iter()
        .map(|s| Segment {
            offset: s.offset,
            len: s.len,
            decay: decay_all || s.shape.len() >= 2,
        })
        .collect()
}

/// Optimizer state that a checkpoint saves: the step count and named f32 buffers over
/// one range of the flat layout.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OptimState {
    /// Optimizer steps taken.
    pub step: u64,
    /// The elements of the flat layout the buffers cover (global offsets), end to end.
    pub pieces: Pieces,
    /// Named moment buffers (`exp_avg`, `exp_avg_sq`, `momentum`), `pieces.len()` each.
    pub buffers: Vec<(String, Vec<f32>)>,
}

/// [`OptimState`] borrowed from the optimizer: what a checkpoint writes and what the
/// accounting counts, without a copy of the buffers (a copy is 4 or 8 bytes per
/// parameter on top of the run's peak).
#[derive(Debug, Clone, PartialEq)]
pub struct OptimStateRef<'a> {
    /// Optimizer steps taken.
    pub step: u64,
    /// The elements of the flat layout the buffers cover (global offsets), end to end.
    pub pieces: Pieces,
    /// Named moment buffers, `pieces.len()` each.
    pub buffers: Vec<(&'static str, &'a [f32])>,
}

impl OptimStateRef<'_> {
    /// An owned copy.
    pub fn to_owned(&self) -> OptimState {
        OptimState {
            step: self.step,
            pieces: self.pieces.clone(),
            buffers: self
                .buffers
                .iter()
                .map(|(n, b)| (n.to_string(), b.to_vec()))
                .collect(),
        }
    }
}

/// What an optimizer tells as each segment's update becomes final: the segment's range
/// within the updated slice, its new FP32 values, and their bf16 copy where one is written.
pub type SegmentDone<'a> = &'a mut dyn FnMut(Range<usize>, &[f32], Option<&[bf16]>);

/// An optimizer over one range of a flat buffer.
pub trait Optimizer: Send {
    /// One update of `params` from `grads` at learning rate `lr`: both are the
    /// optimizer's range of the flat buffers (`range().len()` elements, the range's
    /// first element first); with `bf16_out` (the same range of the bf16 copy) the
    /// updated elements are also written there in bf16. The step count advances once
    /// per call.
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32, bf16_out: Option<&mut [bf16]>) {
        self.step_each(params, grads, lr, bf16_out, &mut |_, _, _| {});
    }
    /// [`Optimizer::step`], calling `done` as each segment (a parameter) is updated, so
    /// that a caller can ship its values while the rest still steps: an offloaded model's
    /// upload overlaps the optimizer ([`crate::offload`]).
    fn step_each(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        bf16_out: Option<&mut [bf16]>,
        done: SegmentDone<'_>,
    );
    /// The elements of the flat layout it updates (global offsets), end to end in the
    /// slices [`Optimizer::step`] takes.
    fn pieces(&self) -> &Pieces;
    /// Bytes its state buffers hold.
    fn state_bytes(&self) -> usize;
    /// The state to checkpoint, borrowed.
    fn state_ref(&self) -> OptimStateRef<'_>;
    /// An owned copy of the state (for [`Optimizer::restore`] into another optimizer).
    fn state(&self) -> OptimState {
        self.state_ref().to_owned()
    }
    /// Restores a saved state over the same range; errors name the buffer that does not fit.
    fn restore(&mut self, state: OptimState) -> Result<(), String>;
    /// The scalars of its next update at `lr`, for that update run elsewhere (the
    /// resident path's optimizer on the step's backend, stoker-gpu's). Nothing is counted
    /// until [`Optimizer::count_update`] says the update ran (an fp16 overflow skips it).
    fn next_scalars(&self, lr: f32) -> stoker_gpu::step::optimizer::Scalars;
    /// Counts one update run elsewhere with [`Optimizer::next_scalars`]' scalars, as
    /// [`Optimizer::step`] counts its own; its buffers stay as they are.
    fn count_update(&mut self);
}

/// The parts of `segments` (global offsets) inside `pieces`, rebased to the pieces laid
/// end to end from element 0: what an optimizer over those pieces updates.
pub fn segments_in(segments: &[Segment], pieces: &Pieces) -> Vec<Segment> {
    pieces
        .with_starts()
        .flat_map(|(range, at)| {
            segments.iter().filter_map(move |s| {
                clip(s, range).map(|r| Segment {
                    offset: at + r.start - range.start,
                    len: r.len(),
                    decay: s.decay,
                })
            })
        })
        .collect()
}

/// Checks that `state` covers `pieces` and holds exactly `names`, each of
/// `pieces.len()` elements, and returns them in order.
pub(crate) fn take_buffers(
    state: OptimState,
    names: &[&str],
    pieces: &Pieces,
) -> Result<Vec<Vec<f32>>, String> {
    if state.pieces != *pieces {
        return Err(format!(
            "optimizer state covers elements {:?}, this optimizer {:?}",
            state.pieces.ranges(),
            pieces.ranges()
        ));
    }
    let len = pieces.len();
    let mut out = Vec::new();
    for name in names {
        let (_, buf) = state
            .buffers
            .iter()
            .find(|(n, _)| n == name)
            .ok_or_else(|| format!("optimizer buffer `{name}` missing"))?;
        if buf.len() != len {
            return Err(format!(
                "optimizer buffer `{name}` has {} elements, the layout needs {len}",
                buf.len()
            ));
        }
        out.push(buf.clone());
    }
    Ok(out)
}

/// The part of `seg` inside `range`, if any.
pub(crate) fn clip(seg: &Segment, range: &Range<usize>) -> Option<Range<usize>> {
    let start = seg.offset.max(range.start);
    let end = (seg.offset + seg.len).min(range.end);
    (start < end).then_some(start..end)
}

/// The stretch `r` of an optional bf16 output buffer.
pub(crate) fn out_segment<'a>(
    out: &'a mut Option<&mut [bf16]>,
    r: &Range<usize>,
) -> Option<&'a mut [bf16]> {
    out.as_deref_mut().map(|o| &mut o[r.clone()])
}

/// Tells `done` that the segment `r` of `params` (and of `bf16_out`) is final.
pub(crate) fn tell(
    done: SegmentDone<'_>,
    r: &Range<usize>,
    params: &[f32],
    bf16_out: &Option<&mut [bf16]>,
) {
    done(
        r.clone(),
        &params[r.clone()],
        bf16_out.as_deref().map(|o| &o[r.clone()]),
    );
}

/// The range a segment covers, from zero.
pub(crate) fn span(seg: &Segment) -> Range<usize> {
    seg.offset..seg.offset + seg.len
}
