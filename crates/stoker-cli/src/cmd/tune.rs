//! `stoker tune loader`: search num_workers / prefetch_factor for a throughput target.

use anyhow::Context;
use stoker_data::autotune::{tune, TuneConfig};
use stoker_train::config::TrainConfig;

use super::dataset_args::{bench_json, trial_row, DatasetArgs, TRIAL_HEADER};

/// Arguments of `stoker tune`.
#[derive(clap::Args)]
pub struct TuneArgs {
    #[command(subcommand)]
    what: TuneWhat,
}

#[derive(clap::Subcommand)]
enum TuneWhat {
    /// Search loader settings; prints the measured curve and a config snippet.
    Loader(LoaderTuneArgs),
}

#[derive(clap::Args)]
struct LoaderTuneArgs {
    #[command(flatten)]
    data: DatasetArgs,
    /// Samples/s the training step consumes (or give --step-ms: batch / step time, or
    /// --from-plan).
    #[arg(long)]
    target_samples_per_s: Option<f64>,
    /// A training config written by `stoker plan --emit-config`: its `[plan]
    /// required_samples_per_s` (the plan's consumption rate per device) is the target.
    #[arg(long, value_name = "FILE")]
    from_plan: Option<std::path::PathBuf>,
    /// With --from-plan: write the chosen num_workers / prefetch_factor /
    /// persistent_workers into that config's `[data]`, so `stoker train` runs with them.
    #[arg(long, requires = "from_plan")]
    write_config: bool,
    /// Margin, fraction (0.1 = 10%): workers' rate over the target, or the share of each
    /// step the consumer may wait where loading runs in series with it (0 workers, or
    /// beside --step-ms's simulated step).
    #[arg(long, default_value_t = 0.1)]
    margin: f64,
    /// Peak RSS allowed for a setting, in MB.
    #[arg(long)]
    memory_budget_mb: Option<f64>,
    /// Most workers tried.
    #[arg(long, default_value_t = 32)]
    max_workers: usize,
    /// Write the measured curve as JSON (readable by `stoker plan --loader-bench`).
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// Takes the workload of the config at `path` (`--from-plan`) into `data`: its micro-batch,
/// window, image size and JPEG decoder where the flags leave them out; a flag or a dataset
/// that disagrees with it is refused, since the target rate is the config's and the loader
/// would be tuned on other work (before, MNIST at batch 256 against a token config's rate).
fn take_workload(
    data: &mut DatasetArgs,
    config: &TrainConfig,
    path: &std::path::Path,
) -> anyhow::Result<()> {
    let at = path.display();
    let micro = config.batch.micro_batch;
    match data.batch {
        Some(b) if b != micro => anyhow::bail!(
            "--batch {b}: {at} trains micro-batches of {micro} (batch.micro_batch), which \
             the plan's rate counts; leave --batch out to tune at it"
        ),
        _ => data.batch = Some(micro),
    }
    if let Some(context) = config.model.context() {
        match data.context {
            Some(c) if c != context => anyhow::bail!(
                "--context {c}: {at} reads windows of {context} tokens (model.context); \
                 leave --context out to tune at it"
            ),
            _ => data.context = Some(context),
        }
    }
    // JPEG records are decoded as the trainer decodes them: at the CNN's image_size, with
    // the config's decoder (before: at 224 with the default decoder, whatever it said).
    if let stoker_train::models::ModelConfig::Cnn(c) = &config.model {
        let size = c.image_size as u32;
        match data.image_size {
            Some(s) if s != size => anyhow::bail!(
                "--image-size {s}: {at} trains images of {size} (model.image_size); leave \
                 --image-size out to tune at it"
            ),
            _ => data.image_size = Some(size),
        }
    }
    data.decoder = config.data.jpeg_decoder.map(|d| d.backend());
    // The same file or prefix, however written (relative to here, as the trainer reads it).
    let place = |p: &std::path::Path| {
        let dir = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => std::path::PathBuf::from("."),
        };
        std::fs::canonicalize(dir)
            .ok()
            .map(|d| d.join(p.file_name().unwrap_or_default()))
    };
    let train = &config.data.train;
    anyhow::ensure!(
        data.dataset == *train || place(&data.dataset).is_some_and(|d| Some(d) == place(train)),
        "{}: {at} trains on {} (data.train); tune the loader on the data the config reads",
        data.dataset.display(),
        train.display()
    );
    Ok(())
}

/// Runs `stoker tune`.
pub fn run(args: TuneArgs) -> anyhow::Result<()> {
    let TuneWhat::Loader(mut a) = args.what;
    // The planned config, read (and checked) once, before any measuring: its data, batch
    // and window are what the loader is tuned on.
    let planned = a.from_plan.as_deref().map(read_config).transpose()?;
    if let Some(p) = &planned {
        take_workload(&mut a.data, &p.config, &p.path)?;
    }
    // Every flag checked before the first trial, each error naming its flag.
    a.data.budget()?;
    if let Some(ms) = a.data.step_ms {
        anyhow::ensure!(
            ms > 0.0 && ms.is_finite(),
            "--step-ms {ms}: expected a positive number of milliseconds"
        );
    }
    if let Some(mb) = a.memory_budget_mb {
        anyhow::ensure!(
            mb > 0.0 && mb.is_finite(),
            "--memory-budget-mb {mb}: expected a positive number"
        );
    }
    // Beside a simulated step a trial's rate stays a little under the target: a margin of
    // 0 could never be met.
    if let (Some(ms), true) = (a.data.step_ms, a.margin == 0.0) {
        anyhow::bail!(
            "--margin 0 with --step-ms {ms}: a trial beside the simulated step always waits \
             a little for data; give a margin above 0"
        );
    }
    // --step-ms is the target and the step each trial simulates: another target beside
    // it would be judged against trials capped at the step's rate, and never be met.
    let others = [
        (a.target_samples_per_s.is_some(), "--target-samples-per-s"),
        (planned.is_some(), "--from-plan"),
    ];
    if let (Some(ms), Some((_, flag))) = (a.data.step_ms, others.iter().find(|(on, _)| *on)) {
        anyhow::bail!(
            "--step-ms {ms} with {flag}: both set the target (--step-ms as batch / step, \
             simulated in every trial); give one"
        );
    }
    let target = match (a.target_samples_per_s, a.data.step_ms, &planned) {
        (Some(t), _, _) => Some(t),
        (None, Some(ms), _) => Some(a.data.batch() as f64 / (ms / 1e3)),
        (None, None, Some(p)) => Some(planned_rate(&p.config, &p.path)?),
        (None, None, None) => None,
    };
    if let Some(t) = target {
        anyhow::ensure!(
            t > 0.0 && t.is_finite(),
            "--target-samples-per-s {t}: expected a positive number"
        );
    }
    let ds = a.data.open()?;
    let config = TuneConfig {
        max_workers: a.max_workers,
        margin: a.margin,
        memory_budget_bytes: a.memory_budget_mb.map(|mb| (mb * 1e6) as u64),
        target_samples_per_s: target,
        simulated_step: a.data.step_ms.is_some(),
        ..TuneConfig::default()
    };
    println!(
        "tuning the loader on {} (batch {}), target {}",
        a.data.dataset.display(),
        a.data.batch(),
        target.map_or("none (fastest)".into(), |t| format!("{t:.0} samples/s"))
    );
    println!("{TRIAL_HEADER}");
    let result = tune(&config, |w, p| {
        let t = a
            .data
            .trial(&ds, w, p)
            .map_err(|e| stoker_data::DataError::Worker {
                worker: w,
                message: e.to_string(),
            })?;
        println!("{}", trial_row(&t));
        Ok(t)
    })?;
    println!();
    for r in &result.reasons {
        println!("- {r}");
    }
    let c = &result.chosen;
    println!(
        "\nchosen ({:.0} samples/s, consumer wait {:.1}%):\n",
        c.samples_per_s, c.consumer_wait_pct
    );
    // With 0 workers there is nothing to prefetch or keep alive (as in torch).
    let persistent = c.num_workers > 0;
    let workers = if persistent {
        format!(
            "num_workers = {}\nprefetch_factor = {}\npersistent_workers = true",
            c.num_workers, c.prefetch_factor
        )
    } else {
        "num_workers = 0".into()
    };
    // The trainer's [data] keys; the batch is [batch] micro_batch, and pinning is an
    // accelerator's ([plan] pin_memory).
    println!("[data]\n{workers}");
    if let (true, Some(p)) = (a.write_config, planned) {
        let keys = super::tune_write::LoaderKeys {
            num_workers: c.num_workers,
            prefetch_factor: c.prefetch_factor,
        };
        let note = format!(" ({:.0} samples/s measured)", c.samples_per_s);
        let text = super::tune_write::with_loader_keys(&p.text, &keys, &note)
            .with_context(|| format!("{}: cannot set its [data] loader keys", p.path.display()))?;
        // What is written must be what `stoker train` reads, with the chosen keys.
        let mut expected = p.config.data.clone();
        expected.num_workers = c.num_workers;
        expected.persistent_workers = persistent;
        if persistent {
            expected.prefetch_factor = c.prefetch_factor.max(1);
        }
        let written = stoker_train::config::TrainConfig::parse(&text, &p.path)?;
        anyhow::ensure!(
            written.data == expected,
            "{}: the edited [data] reads back as {:?}, not {expected:?}; left as it was",
            p.path.display(),
            written.data
        );
        std::fs::write(&p.path, text)?;
        println!("\nwrote the loader settings into {}", p.path.display());
    }
    if let Some(path) = &a.json {
        std::fs::write(
            path,
            serde_json::to_string_pretty(&bench_json(&a.data, &ds, &result.trials))?,
        )?;
        println!("\nwrote {}", path.display());
    }
    Ok(())
}

/// A planned training config: where it is, its text (for its comment header) and what
/// the trainer's own parser makes of it.
struct PlannedConfig {
    path: std::path::PathBuf,
    text: String,
    config: stoker_train::config::TrainConfig,
}

fn read_config(path: &std::path::Path) -> anyhow::Result<PlannedConfig> {
    use anyhow::Context;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let config = stoker_train::config::TrainConfig::parse(&text, path)?;
    Ok(PlannedConfig {
        path: path.to_path_buf(),
        text,
        config,
    })
}

/// The per-device consumption rate a plan wrote into a training config's `[plan]`.
fn planned_rate(
    cfg: &stoker_train::config::TrainConfig,
    path: &std::path::Path,
) -> anyhow::Result<f64> {
    let rate = cfg
        .plan
        .as_ref()
        .and_then(|p| p.required_samples_per_s)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{}: no [plan] required_samples_per_s (write the config with `stoker plan \
                 --emit-config`, or give --target-samples-per-s)",
                path.display()
            )
        })?;
    anyhow::ensure!(
        rate.is_finite() && rate > 0.0,
        "{}: plan.required_samples_per_s = {rate}: expected a positive number",
        path.display()
    );
    Ok(rate)
}
