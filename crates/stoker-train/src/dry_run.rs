//! `stoker train CONFIG --dry-run`: everything a run checks before its first step, and the
//! plan it will be measured against, without training. The config is validated, the batch
//! resolved for the world size, the model declared (its flat layout counted, no values
//! drawn), the datasets opened and checked against the model, and the per-rank bytes
//! predicted by the same function the run's end compares with its buffers
//! ([`crate::run::predicted`]).

use crate::config::TrainConfig;
use crate::data::open_datasets;
use crate::error::Result;
use crate::layout::FlatLayout;
use crate::parallel::ParallelDims;
use crate::run::predicted;
use crate::trainer::build_meta_model_on;
use stoker_plan::trainer::TrainerPrediction;

/// What a dry run found.
#[derive(Debug, Clone)]
pub struct DryRun {
    /// Batch and parallel degrees at the requested world size.
    pub dims: ParallelDims,
    /// Trainable parameters.
    pub params: usize,
    /// Training samples (windows, images or rows) after the eval split.
    pub train_samples: usize,
    /// Evaluation samples.
    pub eval_samples: usize,
    /// What each rank will hold and send (the run prints the same beside what it counted).
    pub planned: TrainerPrediction,
}

/// Checks `config` for a run on `world` ranks and predicts its per-rank bytes.
pub fn dry_run(config: &TrainConfig, world: usize) -> Result<DryRun> {
    config.validate()?;
    let dims = ParallelDims::resolve(config, world, 0, "dry run")?;
    // Declared without values: the layout and the data checks need the model's shapes
    // alone, so a dry run of a model no machine can hold costs nothing.
    let (p, k, seed) = (config.precision, config.kernels, config.seed);
    let model = build_meta_model_on(&config.model, p, k, seed, &candle_core::Device::Cpu)?;
    let layout = FlatLayout::of(model.params())?;
    let data = open_datasets(config, &*model)?;
    Ok(DryRun {
        planned: predicted(config, &dims, &layout),
        params: layout.numel(),
        train_samples: stoker_data::Dataset::len(&*data.train),
        eval_samples: stoker_data::Dataset::len(&*data.eval),
        dims,
    })
}
