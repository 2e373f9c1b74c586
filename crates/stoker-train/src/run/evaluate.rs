//! The run's evaluation: the first `train.eval_batches` evaluation batches, shared
//! round-robin among the ranks and summed over them, so the numbers are the same at every
//! world size.

use stoker_data::{Dataset, Loader, LoaderConfig, Sampler, SamplerConfig};

use crate::config::TrainConfig;
use crate::data::{to_micro_batch, Datasets};
use crate::error::Result;
use crate::parallel::ParallelDims;
use crate::trainer::{EvalReport, Trainer};

/// The first `train.eval_batches` evaluation batches, shared round-robin among the ranks,
/// summed over them: the same numbers at every world size.
pub(super) fn evaluate(
    trainer: &mut Trainer,
    data: &Datasets,
    config: &TrainConfig,
    dims: &ParallelDims,
) -> Result<EvalReport> {
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
    let mut batches = Vec::new();
    let wanted = config.train.eval_batches.max(1);
    let mut first = None;
    for (i, b) in loader.epoch(0).take(wanted).enumerate() {
        let b = b?;
        let dev = trainer.device();
        if i % dims.world == dims.rank {
            batches
                .push(to_micro_batch(&b, &data.input, &data.target, dev)?.padded_to(micro_batch)?);
        } else if i == 0 {
            first =
                Some(to_micro_batch(&b, &data.input, &data.target, dev)?.padded_to(micro_batch)?);
        }
    }
    // Fewer batches than ranks: under ZeRO-3 (a collective forward per batch) a rank
    // without one still joins, counting nothing; the trainer pads the other shortfalls.
    if let (true, Some(b)) = (batches.is_empty(), first) {
        batches.push(b.masked());
    }
    trainer.evaluate(&batches)
}
