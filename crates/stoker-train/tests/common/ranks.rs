//! The data-parallel tests' shared pieces: configs of tiny models in every precision and
//! strategy, deterministic micro-batches with masked targets, and N ranks as threads of
//! the in-process backend trained (and evaluated) on the same global batches.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use candle_core::{Device, Tensor};
use stoker_comm::{run_local, Communicator};
use stoker_train::accumulate::MicroBatch;
use stoker_train::config::TrainConfig;
use stoker_train::layout::FlatLayout;
use stoker_train::models::build_model;
use stoker_train::precision::LayerScalers;
use stoker_train::trainer::{EvalReport, StepReport, Trainer};

use super::{floats, ints, rel_l2, token_batch};

pub const STEPS: usize = 5;

/// A config for `model` (a `[model]` table body) in `precision` with `kernels`.
pub fn config(
    model: &str,
    precision: &str,
    kernels: &str,
    optimizer: &str,
    extra: &str,
) -> TrainConfig {
    let text = config_text(model, precision, kernels, optimizer, extra);
    TrainConfig::parse(&text, std::path::Path::new("data_parallel.toml")).unwrap()
}

/// The TOML of [`config`].
pub fn config_text(
    model: &str,
    precision: &str,
    kernels: &str,
    optimizer: &str,
    extra: &str,
) -> String {
    format!(
        r#"
run_dir = "/nonexistent"
seed = 11
precision = "{precision}"
kernels = "{kernels}"
[data]
train = "/nonexistent"
[model]
{model}
[batch]
micro_batch = 2
[optimizer]
{optimizer}
grad_clip = 1.0
[train]
steps = 5
[parallel]
bucket_cap_mb = 0.002
first_bucket_mb = 0.0005
{extra}
"#
    )
}

/// [`config_text`] on the resident step (`step = "resident"`, then `lines`, in place of
/// the kernels key) without the tiny buckets: the resident loop reduces one bucket per
/// block and refuses bucket sizes.
pub fn resident_text(
    model: &str,
    precision: &str,
    optimizer: &str,
    extra: &str,
    lines: &str,
) -> String {
    config_text(model, precision, "direct", optimizer, extra)
        .replace(
            "kernels = \"direct\"",
            &format!("step = \"resident\"{lines}"),
        )
        .replace("bucket_cap_mb = 0.002\nfirst_bucket_mb = 0.0005\n", "")
}

pub const GPT: &str =
    "kind = \"gpt\"\nvocab = 11\ncontext = 6\nd_model = 8\nn_layer = 2\nn_head = 2";
/// A Llama with grouped-query attention (2 query heads per key/value head).
pub const LLAMA: &str = "kind = \"llama\"\nvocab = 11\ncontext = 6\nd_model = 8\nn_layer = 2\nn_head = 2\nn_kv_head = 1\nffn_hidden = 12";
pub const CNN: &str = "kind = \"cnn\"\nin_channels = 1\nimage_size = 8\nchannels1 = 2\nchannels2 = 3\nhidden = 5\nclasses = 4";
pub const MLP: &str = "kind = \"mlp\"\ninput_shape = [6]\nhidden = [7]\nclasses = 3";
pub const ADAMW: &str = "kind = \"adamw\"\nlr = 1e-3\nweight_decay = 0.1";
pub const SGD: &str = "kind = \"sgd\"\nlr = 0.05\nmomentum = 0.9\nweight_decay = 0.01";

/// Global micro-batch `j` of step `s`: two samples, different masking per micro-batch.
pub fn micro_batch(model: &str, s: usize, j: usize) -> MicroBatch {
    let seed = (s * 1000 + j * 7) as u64;
    // A token model (widened or not): six positions over a vocabulary of 11.
    if model.starts_with("kind = \"gpt\"") || model.starts_with("kind = \"llama\"") {
        let masked = [j % 3, (j * 2 + s) % 4];
        token_batch(seed, 2, 6, 11, &masked)
    } else if model == CNN {
        let x = floats(seed, 2 * 64);
        MicroBatch {
            input: Tensor::from_vec(x, (2, 1, 8, 8), &Device::Cpu).unwrap(),
            targets: ints(seed + 1, 2, 4),
        }
    } else {
        let x = floats(seed, 2 * 6);
        let mut targets = ints(seed + 1, 2, 3);
        if j % 3 == 1 {
            targets[0] = stoker_train::loss::IGNORE_INDEX;
        }
        MicroBatch {
            input: Tensor::from_vec(x, (2, 6), &Device::Cpu).unwrap(),
            targets,
        }
    }
}

/// What one rank ended with: its final master weights (the whole buffer, gathered under
/// ZeRO-3), its step reports, its evaluation (where one was asked for) and its FP8
/// scalers (fp8).
pub struct RankRun {
    pub master: Vec<f32>,
    pub reports: Vec<StepReport>,
    pub eval: Option<EvalReport>,
    pub fp8: Option<BTreeMap<String, LayerScalers>>,
}

/// Trains `STEPS` steps of global batches of `g` micro-batches on `world` ranks (DDP,
/// `threads` compute threads each); every rank's final master weights and reports.
pub fn train(
    world: usize,
    config: &TrainConfig,
    model: &str,
    g: usize,
    threads: usize,
    batch: impl Fn(&str, usize, usize) -> MicroBatch + Sync,
) -> Vec<(Vec<f32>, Vec<StepReport>)> {
    train_and_evaluate(world, config, model, g, threads, STEPS, 0, batch)
        .into_iter()
        .map(|r| (r.master, r.reports))
        .collect()
}

/// [`train`] for `steps` steps, then an evaluation of `evals` micro-batches (step 99's of
/// `batch`) shared round-robin among the ranks, as `stoker train` shares them: unevenly
/// where `world` does not divide `evals`, and a rank with none passes a masked one.
#[allow(clippy::too_many_arguments)]
pub fn train_and_evaluate(
    world: usize,
    config: &TrainConfig,
    model: &str,
    g: usize,
    threads: usize,
    steps: usize,
    evals: usize,
    batch: impl Fn(&str, usize, usize) -> MicroBatch + Sync,
) -> Vec<RankRun> {
    run_local(world, Duration::from_secs(60), |comm| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let rank = comm.rank();
            let comm: Rc<dyn Communicator> = Rc::new(comm);
            let m =
                build_model(&config.model, config.precision, config.kernels, config.seed).unwrap();
            let layout = FlatLayout::of(m.params()).unwrap();
            let strategy = stoker_train::parallel::for_config(config, &layout, comm).unwrap();
            let mut t = Trainer::with_strategy(config, m, strategy).unwrap();
            let k = g / world;
            let reports = (0..steps)
                .map(|s| {
                    let window: Vec<MicroBatch> = (rank * k..(rank + 1) * k)
                        .map(|j| batch(model, s, j))
                        .collect();
                    t.train_step(&window).unwrap()
                })
                .collect();
            let eval = (evals > 0).then(|| {
                let mut mine: Vec<MicroBatch> = (rank..evals)
                    .step_by(world)
                    .map(|j| batch(model, 99, j))
                    .collect();
                if mine.is_empty() {
                    mine.push(batch(model, 99, 0).masked());
                }
                t.evaluate(&mine).unwrap()
            });
            // Under ZeRO-3 each rank holds a shard: gather the whole buffer.
            RankRun {
                master: t.full_master().unwrap(),
                reports,
                eval,
                fp8: t.fp8().map(|f| f.state()),
            }
        })
    })
}

/// ||a - b|| / ||b|| over the whole buffer, NaN if anything is not finite.
pub fn rel_l2_checked(a: &[f32], b: &[f32]) -> f64 {
    assert!(
        stoker_testkit::max_abs(a).is_finite() && stoker_testkit::max_abs(b).is_finite(),
        "non-finite weights"
    );
    rel_l2(a, b)
}

/// ZeRO-3's variants: resharding after the forward (its default) or not.
pub const ZERO3: [&str; 2] = [
    "strategy = \"zero3\"",
    "strategy = \"full_shard\"\nreshard_after_forward = false",
];

/// Every strategy the equivalence matrix runs besides ZeRO-3's: DDP, ZeRO-1, ZeRO-2
/// reducing every micro-batch (its default) and ZeRO-2 with `no_sync` accumulation.
pub const STRATEGIES: [&str; 4] = [
    "strategy = \"ddp\"",
    "strategy = \"zero1\"",
    "strategy = \"zero2\"",
    "strategy = \"zero2\"\nsync_every_micro_batch = false",
];

/// Every strategy: [`STRATEGIES`] and ZeRO-3's (on the direct step one block at a time,
/// on the graph path the whole model per micro-batch).
pub fn strategies() -> Vec<&'static str> {
    let mut all = STRATEGIES.to_vec();
    all.extend(ZERO3);
    all
}
