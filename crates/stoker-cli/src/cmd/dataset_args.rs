//! Command-line options shared by the commands that open a dataset and run the loader.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use stoker_data::measure::{measure_loader, Trial, TrialBudget};
use stoker_data::transform::{ImageTransformConfig, TransformMode};
use stoker_data::Dataset;
use stoker_data::{
    open_dataset, AnyDataset, DType, LoaderConfig, OpenOptions, Sampler, SamplerConfig,
};

/// Which dataset, how to read it, and how long each measurement runs.
#[derive(clap::Args, Debug, Clone)]
pub struct DatasetArgs {
    /// X.npy, X.bin (token shard), PREFIX of PREFIX.FIELD.npy arrays, or PREFIX of JPEG records.
    pub dataset: PathBuf,
    /// Samples per batch [default: 256; with `tune loader --from-plan`, the config's
    /// micro_batch].
    #[arg(long)]
    pub batch: Option<usize>,
    /// Read in dataset order instead of a seeded shuffle.
    #[arg(long)]
    pub sequential: bool,
    /// Page-lock batch buffers.
    #[arg(long)]
    pub pin_memory: bool,
    /// Tokens per window (token shards) [default: 256; with `tune loader --from-plan`,
    /// the config's model.context].
    #[arg(long)]
    pub context: Option<usize>,
    /// Output side of the image transform (JPEG records) [default: 224; with `tune loader
    /// --from-plan`, the config's model.image_size].
    #[arg(long)]
    pub image_size: Option<u32>,
    /// Image output dtype: f32 or bf16 (JPEG records).
    #[arg(long, default_value = "f32")]
    pub image_dtype: String,
    /// Eval-mode image transform (resize + center crop) instead of train augmentation.
    #[arg(long)]
    pub eval_transform: bool,
    /// Seconds each measurement runs (after one warm-up batch).
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// At most this many batches per measurement.
    #[arg(long, default_value_t = 1_000_000)]
    pub max_batches: usize,
    /// Simulated training step in ms: the consumer sleeps this long per batch.
    #[arg(long)]
    pub step_ms: Option<f64>,
    /// The JPEG decoder (a config's `data.jpeg_decoder`, with `tune loader --from-plan`);
    /// `None`: the transform's default.
    #[arg(skip)]
    pub decoder: Option<stoker_data::transform::JpegBackend>,
}

/// `--batch` and `--context` where not given.
const DEFAULT_BATCH_AND_CONTEXT: usize = 256;

impl DatasetArgs {
    /// Samples per batch.
    pub fn batch(&self) -> usize {
        self.batch.unwrap_or(DEFAULT_BATCH_AND_CONTEXT)
    }

    /// Tokens per window.
    pub fn context(&self) -> usize {
        self.context.unwrap_or(DEFAULT_BATCH_AND_CONTEXT)
    }

    /// Opens the dataset with these options, and checks that it holds a whole batch and
    /// that a measurement reads at least one.
    pub fn open(&self) -> anyhow::Result<Arc<AnyDataset>> {
        anyhow::ensure!(
            self.max_batches >= 1,
            "--max-batches 0: expected at least 1 batch per measurement"
        );
        let dtype = match self.image_dtype.as_str() {
            "f32" => DType::F32,
            "bf16" => DType::BF16,
            other => anyhow::bail!("--image-dtype {other}: expected f32 or bf16"),
        };
        let defaults = ImageTransformConfig::default();
        let image = ImageTransformConfig {
            size: self.image_size.unwrap_or(defaults.size),
            decoder: self.decoder.unwrap_or(defaults.decoder),
            dtype,
            mode: if self.eval_transform {
                TransformMode::Eval
            } else {
                TransformMode::Train
            },
            ..defaults
        };
        let opts = OpenOptions {
            context: self.context(),
            image,
            ..OpenOptions::default()
        };
        let ds = open_dataset(&self.dataset, &opts)?;
        // A batch larger than the data: the loader's buffers would be sized for it (an
        // abort in the allocator at 10^9), and a batch of 200,000 over 158,000 samples
        // would time partial batches.
        anyhow::ensure!(
            (1..=ds.len()).contains(&self.batch()),
            "--batch {}: expected 1 to the {} samples of {}",
            self.batch(),
            ds.len(),
            self.dataset.display()
        );
        Ok(Arc::new(ds))
    }

    /// The sampler for this dataset (single rank).
    pub fn sampler(&self, len: usize) -> anyhow::Result<Sampler> {
        Ok(Sampler::new(
            len,
            SamplerConfig {
                shuffle: !self.sequential,
                seed: 0,
                ..SamplerConfig::default()
            },
        )?)
    }

    /// What each measurement may take (`--seconds`, `--max-batches`, `--step-ms`),
    /// checked: an error names the flag.
    pub fn budget(&self) -> anyhow::Result<TrialBudget> {
        // try_from_secs_f64 refuses NaN, infinities, negatives and overflow.
        let min_time = Duration::try_from_secs_f64(self.seconds)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "--seconds {}: expected a positive, finite number",
                    self.seconds
                )
            })?;
        let step = self
            .step_ms
            .map(|ms| {
                Duration::try_from_secs_f64(ms / 1e3).map_err(|_| {
                    anyhow::anyhow!("--step-ms {ms}: expected a finite number >= 0 of milliseconds")
                })
            })
            .transpose()?;
        Ok(TrialBudget {
            min_time,
            max_batches: self.max_batches,
            step,
        })
    }

    /// Runs one timed trial with `workers` and `prefetch`.
    pub fn trial(
        &self,
        ds: &Arc<AnyDataset>,
        workers: usize,
        prefetch: usize,
    ) -> anyhow::Result<Trial> {
        let budget = self.budget()?;
        let config = LoaderConfig {
            batch_size: self.batch(),
            num_workers: workers,
            prefetch_factor: prefetch,
            persistent_workers: workers > 0,
            pin_memory: self.pin_memory,
            timeout_s: Some(120.0),
            ..LoaderConfig::default()
        };
        Ok(measure_loader(
            ds.clone(),
            self.sampler(ds.len())?,
            config,
            budget,
        )?)
    }
}

/// Bytes of one sample over all fields.
pub fn sample_bytes(ds: &AnyDataset) -> usize {
    ds.fields().iter().map(|f| f.sample_bytes()).sum()
}

/// A loader benchmark file as `stoker plan --loader-bench` reads it.
pub fn bench_json(
    args: &DatasetArgs,
    ds: &AnyDataset,
    trials: &[Trial],
) -> stoker_plan::loader::LoaderBench {
    stoker_plan::loader::LoaderBench {
        dataset: Some(args.dataset.display().to_string()),
        sample_bytes: Some(sample_bytes(ds) as u64),
        points: trials
            .iter()
            .map(stoker_train::machine::bench_point)
            .collect(),
    }
}

/// One table row of a trial.
pub fn trial_row(t: &Trial) -> String {
    format!(
        "{:>7} {:>8} {:>12.0} {:>10.1} {:>9.1}% {:>10.1}% {:>9.0}",
        t.num_workers,
        t.prefetch_factor,
        t.samples_per_s,
        t.mb_per_s,
        t.consumer_wait_pct,
        t.worker_busy_pct,
        t.peak_rss_bytes as f64 / 1e6
    )
}

/// The header matching [`trial_row`].
pub const TRIAL_HEADER: &str =
    "workers prefetch    samples/s       MB/s  cons.wait  worker busy  peakRSS MB";
