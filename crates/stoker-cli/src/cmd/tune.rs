//! `stoker tune loader`: search num_workers / prefetch_factor for a throughput target.

use stoker_data::autotune::{tune, TuneConfig};

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
    /// A config written by `stoker plan --emit-config`: its `[data] required_samples_per_s`
    /// (the plan's consumption rate per device) is the target.
    #[arg(long, value_name = "FILE")]
    from_plan: Option<std::path::PathBuf>,
    /// Headroom over the target a setting must reach, fraction (0.1 = 10%).
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

/// Runs `stoker tune`.
pub fn run(args: TuneArgs) -> anyhow::Result<()> {
    let TuneWhat::Loader(a) = args.what;
    let target = match (a.target_samples_per_s, a.data.step_ms, &a.from_plan) {
        (Some(t), _, _) => Some(t),
        (None, Some(ms), _) => Some(a.data.batch as f64 / (ms / 1e3)),
        (None, None, Some(plan)) => Some(planned_rate(plan)?),
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
        ..TuneConfig::default()
    };
    println!(
        "tuning the loader on {} (batch {}), target {}",
        a.data.dataset.display(),
        a.data.batch,
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
    let workers = if c.num_workers > 0 {
        format!(
            "num_workers = {}\nprefetch_factor = {}\npersistent_workers = true",
            c.num_workers, c.prefetch_factor
        )
    } else {
        "num_workers = 0".into()
    };
    println!(
        "[data]\nbatch_size = {}\n{workers}\npin_memory = {}",
        c.batch_size, a.data.pin_memory
    );
    if let Some(path) = &a.json {
        std::fs::write(
            path,
            serde_json::to_string_pretty(&bench_json(&a.data, &ds, &result.trials))?,
        )?;
        println!("\nwrote {}", path.display());
    }
    Ok(())
}

/// The per-device consumption rate in a config written by `stoker plan --emit-config`.
fn planned_rate(path: &std::path::Path) -> anyhow::Result<f64> {
    use anyhow::Context;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let plan: stoker_plan::emit::TrainingConfig = toml::from_str(&text).with_context(|| {
        format!(
            "{}: not a config written by stoker plan --emit-config",
            path.display()
        )
    })?;
    let rate = plan.data.required_samples_per_s;
    anyhow::ensure!(
        rate.is_finite() && rate > 0.0,
        "{}: data.required_samples_per_s = {rate}: expected a positive number",
        path.display()
    );
    Ok(rate)
}
