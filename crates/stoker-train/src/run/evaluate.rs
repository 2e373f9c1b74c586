//! The run's evaluation: the first `train.eval_batches` evaluation batches, shared
//! round-robin among the ranks and summed over them, so the numbers are the same at every
//! world size. It runs in chunks of [`EVAL_CHUNK`] batches, and before each chunk after the
//! first the ranks agree whether the run was signalled: a preempted job stops within one
//! chunk, not after the whole evaluation.

use stoker_data::{Dataset, Loader, LoaderConfig, Sampler, SamplerConfig};

use crate::accumulate::MicroBatch;
use crate::config::TrainConfig;
use crate::data::{to_micro_batch, Datasets};
use crate::error::Result;
use crate::parallel::ParallelDims;
use crate::trainer::{EvalReport, Trainer};

/// Evaluation batches, counted over every rank, between two agreed checks of the run's
/// stop flag. The chunks' bounds are the same at every world size, and so are their sums.
pub(super) const EVAL_CHUNK: usize = 8;

/// How an evaluation ended.
#[derive(Debug)]
pub(super) enum Evaluated {
    /// Every batch evaluated.
    Done(EvalReport),
    /// Every rank agreed to stop (a signal) after `done` of the `of` batches.
    Stopped { done: usize, of: usize },
}

/// The first `train.eval_batches` evaluation batches, shared round-robin among the ranks,
/// summed over them: the same numbers at every world size. Before each chunk after the
/// first, `stop` (a collective: every rank calls it as often) says whether to stop there.
pub(super) fn evaluate(
    trainer: &mut Trainer,
    data: &Datasets,
    config: &TrainConfig,
    dims: &ParallelDims,
    mut stop: impl FnMut(usize) -> Result<bool>,
) -> Result<Evaluated> {
    // Every sample, the last batch too: a short one is padded to the micro-batch with
    // masked targets, so evaluation runs on the training step's buffers as they are,
    // with no second batch shape to allocate, and counts what the set holds (all 10,000
    // of MNIST's test images, not the 9,984 of whole batches).
    let micro_batch = config.batch.micro_batch;
    let sampler = Sampler::new(
        data.eval.len(),
        SamplerConfig {
            drop_last: false,
            ..SamplerConfig::default()
        },
    )?;
    let lc = LoaderConfig {
        batch_size: micro_batch,
        drop_last: false,
        ..Default::default()
    };
    let mut loader = Loader::new(data.eval.clone(), sampler, lc)?;
    let of = config
        .train
        .eval_batches
        .max(1)
        .min(data.eval.len().div_ceil(micro_batch));
    let mut parts = Vec::new();
    let mut batches = Vec::new();
    let mut first = None;
    let mut it = loader.epoch(0).take(of).enumerate().peekable();
    while let Some((i, b)) = it.next() {
        if i > 0 && i % EVAL_CHUNK == 0 && stop(i)? {
            return Ok(Evaluated::Stopped { done: i, of });
        }
        let b = b?;
        let dev = trainer.device();
        let mb = |b: &stoker_data::Batch| -> Result<MicroBatch> {
            to_micro_batch(b, &data.input, &data.target, dev)?.padded_to(micro_batch)
        };
        if i % dims.world == dims.rank {
            batches.push(mb(&b)?);
        } else if i % EVAL_CHUNK == 0 {
            first = Some(mb(&b)?);
        }
        if (i + 1) % EVAL_CHUNK == 0 || it.peek().is_none() {
            // Fewer batches in a chunk than ranks: under ZeRO-3 (a collective forward per
            // batch) a rank without one still joins, counting nothing; the trainer pads
            // the other shortfalls.
            if let (true, Some(b)) = (batches.is_empty(), first.take()) {
                batches.push(b.masked());
            }
            parts.push(trainer.evaluate(&batches)?);
            batches.clear();
            first = None;
        }
    }
    Ok(Evaluated::Done(combined(parts)))
}

/// The chunks' reports as one: the means over every chunk's targets (one chunk's report
/// as it is).
fn combined(parts: Vec<EvalReport>) -> EvalReport {
    if parts.len() == 1 {
        return parts.into_iter().next().expect("one part");
    }
    let (mut loss, mut accuracy, mut count) = (0f64, 0f64, 0usize);
    for p in &parts {
        loss += p.loss * p.count as f64;
        accuracy += p.accuracy * p.count as f64;
        count += p.count;
    }
    let c = count.max(1) as f64;
    EvalReport {
        loss: loss / c,
        accuracy: accuracy / c,
        count,
    }
}
