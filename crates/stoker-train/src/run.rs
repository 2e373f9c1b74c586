//! The training loop: loader -> accumulation windows -> optimizer steps, with metrics,
//! evaluation, checkpoints and a progress bar.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use candle_core::Device;
use indicatif::{ProgressBar, ProgressStyle};
use stoker_data::{Dataset, Loader, LoaderConfig, Sampler, SamplerConfig, SamplerState};

use crate::checkpoint;
use crate::config::{ModelConfig, TrainConfig};
use crate::data::{open_datasets, to_micro_batch, Datasets};
use crate::error::{io_err, Result, TrainError};
use crate::metrics::{MetricsLog, Record};
use crate::models::LossKind;
use crate::trainer::{EvalReport, Trainer};

/// How to run (beyond the config).
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Resume from this checkpoint directory.
    pub resume: Option<PathBuf>,
    /// Show the progress bar.
    pub progress: bool,
    /// Stop after this many steps (an interruption, for resume tests); a checkpoint is
    /// written there.
    pub stop_after: Option<u64>,
}

/// What a run ended with.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// Steps taken.
    pub steps: u64,
    /// Last training loss.
    pub last_loss: f64,
    /// The last evaluation.
    pub eval: Option<EvalReport>,
    /// Loader wait as % of the loop's wall time.
    pub loader_wait_pct: f64,
    /// Mean throughput (targets per second).
    pub throughput: f64,
    /// A text sample (GPT with a vocab and `train.sample_tokens`).
    pub sample: Option<String>,
    /// Trainable parameters.
    pub params: usize,
}

/// Trains as `config` says. Data, model and checkpoint are all checked before the first step.
pub fn run(config: &TrainConfig, opts: &RunOptions) -> Result<RunSummary> {
    let mut trainer = Trainer::new(config)?;
    let context = match &config.model {
        ModelConfig::Gpt(g) => g.context,
        _ => 0,
    };
    let vocab = load_vocab(config, &trainer)?;
    let data = open_datasets(config, &*trainer.model, context.max(1))?;
    let resumed_at = match &opts.resume {
        Some(dir) => Some(checkpoint::load(&mut trainer, dir)?.step),
        None => None,
    };
    let run_dir = &config.run_dir;
    std::fs::create_dir_all(run_dir).map_err(|e| io_err(run_dir, e))?;
    let cfg_text = toml::to_string(config).map_err(|e| TrainError::Layout(e.to_string()))?;
    std::fs::write(run_dir.join("config.toml"), cfg_text).map_err(|e| io_err(run_dir, e))?;
    let mut log = MetricsLog::open(run_dir, resumed_at)?;
    let ckpt_root = run_dir.join("checkpoints");
    let params = trainer.layout.numel();
    let mib = |elems: usize| elems as f64 * 4.0 / (1 << 20) as f64;
    let accounting = format!(
        "{params} parameters in {} tensors; FP32 master {:.2} MiB + gradients {:.2} MiB + optimizer {:.2} MiB (align {}); eval: {}",
        trainer.layout.slots().len(),
        mib(trainer.layout.total_len()),
        mib(trainer.layout.total_len()),
        mib(trainer.optimizer.state().buffers.iter().map(|(_, b)| b.len()).sum()),
        trainer.layout.align(),
        data.eval_note
    );
    tracing::info!("{accounting}");

    let b = &config.batch;
    let d = &config.data;
    let sampler = Sampler::new(
        data.train.len(),
        SamplerConfig {
            shuffle: d.shuffle,
            seed: config.seed,
            drop_last: true,
            ..Default::default()
        },
    )?;
    let lc = LoaderConfig {
        batch_size: b.micro_batch,
        num_workers: d.num_workers,
        prefetch_factor: d.prefetch_factor,
        drop_last: true,
        persistent_workers: d.persistent_workers,
        ..Default::default()
    };
    let mut loader = Loader::new(data.train.clone(), sampler, lc)?;
    let total = opts
        .stop_after
        .unwrap_or(config.train.steps)
        .min(config.train.steps);
    let bar = progress_bar(opts.progress, total, trainer.step);
    bar.println(&accounting);
    let unit = match trainer.loss_kind() {
        LossKind::Token => "tokens/s",
        LossKind::Sample => "samples/s",
    };
    let started = Instant::now();
    let (mut wait, mut window_wait, mut window_t0) =
        (Duration::ZERO, Duration::ZERO, Instant::now());
    let (mut interval_count, mut total_count) = (0usize, 0usize);
    let mut last_loss = f64::NAN;
    let mut last_eval = None;
    let mut window = Vec::with_capacity(b.accumulation_steps);
    let mut state = trainer.sampler_state;
    'outer: while trainer.step < total {
        let mut it = loader.resume(state);
        while let Some(batch) = it.next() {
            let batch = batch?;
            wait += batch.wait();
            window_wait += batch.wait();
            window.push(to_micro_batch(
                &batch,
                &data.input,
                &data.target,
                &Device::Cpu,
            )?);
            drop(batch);
            if window.len() < b.accumulation_steps {
                continue;
            }
            let r = trainer.train_step(&window)?;
            window.clear();
            trainer.sampler_state = it.state();
            last_loss = r.loss;
            interval_count += r.count;
            total_count += r.count;
            let step = trainer.step;
            if let Some(why) = &r.skipped {
                tracing::warn!("step {step}: skipped (fp16 overflow): {why}");
            }
            if step % config.train.log_every == 0 || step == total {
                let dt = window_t0.elapsed().as_secs_f64();
                let rec = Record::Train {
                    step,
                    loss: r.loss,
                    lr: r.lr,
                    grad_norm: r.grad_norm,
                    loss_scale: r.loss_scale,
                    throughput: interval_count as f64 / dt,
                    unit: unit.into(),
                    loader_wait_pct: 100.0 * window_wait.as_secs_f64() / dt,
                    skipped: r.skipped.is_some(),
                    elapsed_s: started.elapsed().as_secs_f64(),
                };
                log.write(&rec)?;
                bar.set_message(format!(
                    "loss {:.4} | {:.0} {unit} | wait {:.1}% | scale {} | lr {:.2e}",
                    r.loss,
                    interval_count as f64 / dt,
                    100.0 * window_wait.as_secs_f64() / dt,
                    r.loss_scale,
                    r.lr
                ));
                (interval_count, window_wait, window_t0) = (0, Duration::ZERO, Instant::now());
            }
            bar.set_position(step);
            let every = |n: u64| n > 0 && step % n == 0;
            if every(config.train.eval_every) || step == config.train.steps {
                let e = evaluate(&trainer, &data, config)?;
                log.write(&Record::Eval {
                    step,
                    loss: e.loss,
                    accuracy: e.accuracy,
                })?;
                bar.println(format!(
                    "step {step}: eval loss {:.4}, accuracy {:.2}%",
                    e.loss,
                    100.0 * e.accuracy
                ));
                last_eval = Some(e);
            }
            if every(config.train.checkpoint_every) || step == total {
                checkpoint::save(&trainer, &ckpt_root, config.seed)?;
            }
            if step >= total {
                break 'outer;
            }
        }
        state = SamplerState {
            epoch: it.state().epoch + 1,
            batches_done: 0,
        };
    }
    bar.finish();
    let elapsed = started.elapsed().as_secs_f64();
    let sample = match (&vocab, config.train.sample_tokens) {
        (Some(v), n) if n > 0 => {
            let toks = trainer.sample(&[0], n, context, config.seed)?;
            Some(
                toks.iter()
                    .map(|&t| v.get(t as usize).map_or("?", |s| s.as_str()))
                    .collect(),
            )
        }
        _ => None,
    };
    Ok(RunSummary {
        steps: trainer.step,
        last_loss,
        eval: last_eval,
        loader_wait_pct: 100.0 * wait.as_secs_f64() / elapsed,
        throughput: total_count as f64 / elapsed,
        sample,
        params,
    })
}

fn evaluate(trainer: &Trainer, data: &Datasets, config: &TrainConfig) -> Result<EvalReport> {
    let sampler = Sampler::new(data.eval.len(), SamplerConfig::default())?;
    let lc = LoaderConfig {
        batch_size: config.batch.micro_batch,
        ..Default::default()
    };
    let mut loader = Loader::new(data.eval.clone(), sampler, lc)?;
    let mut batches = Vec::new();
    for b in loader.epoch(0).take(config.train.eval_batches.max(1)) {
        batches.push(to_micro_batch(
            &b?,
            &data.input,
            &data.target,
            &Device::Cpu,
        )?);
    }
    trainer.evaluate(&batches)
}

fn load_vocab(config: &TrainConfig, trainer: &Trainer) -> Result<Option<Vec<String>>> {
    let Some(path) = &config.data.vocab else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path).map_err(|e| io_err(path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| TrainError::Data {
        what: path.display().to_string(),
        message: e.to_string(),
    })?;
    let tokens: Vec<String> = v["tokens"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|t| t.as_str().unwrap_or("?").to_string())
                .collect()
        })
        .unwrap_or_default();
    if let ModelConfig::Gpt(g) = &config.model {
        if tokens.len() > g.vocab {
            return Err(crate::error::config_err(
                "model.vocab",
                format!(
                    "{} < {} tokens in {} (data.vocab)",
                    g.vocab,
                    tokens.len(),
                    path.display()
                ),
            ));
        }
    }
    let _ = trainer;
    Ok(Some(tokens))
}

fn progress_bar(show: bool, total: u64, start: u64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total).with_position(start);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .expect("valid template"),
    );
    bar
}
