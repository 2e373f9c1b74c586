//! A step's micro-batches replayed as captured graphs (CUDA graphs; `StepOptions::
//! graph_micro_batches`): one launch from the host for a micro-batch's forward, loss and
//! backward instead of one per kernel, which is what a small model's step is made of.
//!
//! A graph replays its launches with the arguments they had when it was captured. So
//! what changes from micro-batch to micro-batch must reach the kernels through device
//! memory: the ids are written before each replay into the set of id buffers the graph
//! reads (`step::batch_ids`), and the embedding's backward runs over as many token groups as the batch has
//! positions (`Groups`), not over its distinct tokens. The rest that a launch takes by
//! value is the graph's key: the gradient's scale (a window's loss scale over its target
//! capacity: constant for a run at one shape, changed by fp16's dynamic scale), whether
//! the loss adds to the window's sum, the ignore index, and which of the two sets of id
//! buffers it reads. A key's first micro-batch runs
//! eagerly (cuBLASLt's plans and workspace are made then, outside any capture), its
//! second is captured and replayed, and every later one is replayed.

use std::cell::RefCell;

use crate::backend::Backend;
use crate::error::GpuError;

/// What a captured micro-batch took by value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GraphKey {
    /// The logits' gradient scale, as bits.
    pub(crate) grad_scale: u32,
    /// Whether the micro-batch's loss adds to the step's loss sum.
    pub(crate) add_loss: bool,
    /// The targets' ignore index.
    pub(crate) ignore: i32,
    /// Which of the step's two sets of id buffers it read (`step::batch_ids`).
    pub(crate) ids_set: usize,
}

/// Keys kept at once: the first micro-batch of a window and the rest, on either set of
/// ids, under up to two loss scales (fp16's scale moves rarely; the least recently used
/// key goes first, and is captured again if it returns).
const KEPT: usize = 8;

/// A step's graphs by key: `None` where the key has run once, eagerly.
pub(crate) struct MicroBatchGraphs<G> {
    entries: RefCell<Vec<(GraphKey, Option<G>)>>,
}

impl<G> Default for MicroBatchGraphs<G> {
    fn default() -> Self {
        MicroBatchGraphs {
            entries: RefCell::new(Vec::new()),
        }
    }
}

impl<G> MicroBatchGraphs<G> {
    /// Runs `body` (a micro-batch's launches, with what they take by value in `key`):
    /// eagerly the first time `key` comes, captured and replayed the second, replayed
    /// after.
    ///
    /// # Safety
    /// Every buffer `body` launches on lives as long as these graphs (the step's own
    /// buffers, which it allocates once and drops with its graphs).
    pub(crate) unsafe fn run<B: Backend<Graph = G>>(
        &self,
        be: &B,
        key: GraphKey,
        body: impl FnOnce() -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        let mut entries = self.entries.borrow_mut();
        // Most recently used last: the first is the one a new key evicts.
        if let Some(at) = entries.iter().position(|(k, _)| *k == key) {
            let used = entries.remove(at);
            entries.push(used);
        }
        let Some(at) = entries.iter().position(|(k, _)| *k == key) else {
            body()?;
            if entries.len() == KEPT {
                entries.remove(0);
            }
            entries.push((key, None));
            return Ok(());
        };
        let slot = &mut entries[at].1;
        let graph = match slot.take() {
            Some(g) => slot.insert(g),
            None => {
                be.begin_capture()?;
                let ran = body();
                // The capture ends whatever the body did: the backend is never left in it.
                let graph = be.end_capture();
                ran?;
                slot.insert(graph?)
            }
        };
        // SAFETY: the caller's contract: the buffers the capture touched outlive it.
        unsafe { be.replay(graph) }
    }

    /// Keys captured so far.
    pub(crate) fn captured(&self) -> usize {
        self.entries
            .borrow()
            .iter()
            .filter(|(_, g)| g.is_some())
            .count()
    }
}
