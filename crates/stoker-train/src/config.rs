//! The typed training config (`stoker train CONFIG.toml`): one struct per table, unknown
//! keys rejected, every default in one place, and [`TrainConfig::validate`] checking
//! everything that can be checked before any work (errors name the dotted key).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{config_err, Result, TrainError};
use crate::loss_scale::LossScaleConfig;
use crate::models::ModelConfig;
use crate::optim::{AdamWConfig, SgdConfig};
use crate::precision::{Kernels, Precision};
use crate::schedule::Schedule;

/// The whole config file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Directory for metrics, checkpoints and plots.
    pub run_dir: PathBuf,
    /// Seed of parameter initialization and data order.
    #[serde(default)]
    pub seed: u64,
    /// `fp32`, `bf16`, `fp16` or `fp8`.
    #[serde(default)]
    pub precision: Precision,
    /// How a training step runs: `handwritten` (the model's own step over flat buffers,
    /// no autograd graph, where it has one), `graph` (candle's autograd) or `resident`
    /// (the GPU step's code on the CPU, [`StepKind::Resident`]). Unset: from
    /// `kernels` as it was before this key (`direct`, the default, is `handwritten`;
    /// `fused` and `composed` are `graph`). Always set once parsed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<StepKind>,
    /// The ops the graph runs: `fused` (stoker-kernels' custom ops) or `composed`
    /// (candle's primitives); see [`Kernels`]. `direct` is the older name of `step =
    /// "handwritten"`, accepted and reported as renamed. Once parsed, [`Kernels::Direct`]
    /// exactly where the step is handwritten, and then left out of a written config (the
    /// `step` says it).
    #[serde(default, skip_serializing_if = "Kernels::is_direct")]
    pub kernels: Kernels,
    /// `cpu` (default), or `cuda` / `cuda:N` in a build with the `cuda` feature: the
    /// model on a GPU, its optimizer offloaded to the host ([`crate::device`]).
    #[serde(default = "default_device")]
    pub device: String,
    /// What the resident step recomputes in its backward instead of keeping (`none`, the
    /// default, `attention`, `mlp` or `attention+mlp`: [`Recompute`]).
    #[serde(default, skip_serializing_if = "Recompute::is_none")]
    pub recompute: Recompute,
    /// The resident loop's micro-batches replayed as CUDA graphs: each captured on its
    /// second run and then launched from the host as one (stoker-gpu's
    /// `StepOptions::graph_micro_batches`). For small models, whose step is mostly launch
    /// overhead. On the CPU the host build records and replays alike, for the tests.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cuda_graphs: bool,
    /// The resident step's attention on tensor cores, keeping no scores
    /// (FlashAttention-2's algorithm; stoker-gpu's `StepOptions::flash_attention`): each
    /// block keeps its rows' log-sum-exp instead of its `[B, H, T, T]` probabilities. bf16,
    /// heads 16, 32 or 64 wide.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub flash_attention: bool,
    /// Data source and loader knobs.
    pub data: DataConfig,
    /// The model.
    pub model: ModelConfig,
    /// Batch arithmetic.
    pub batch: BatchConfig,
    /// Optimizer, schedule and clipping.
    pub optimizer: OptimizerConfig,
    /// Steps, evaluation and checkpoint cadence.
    pub train: LoopConfig,
    /// Data parallelism: strategy, backend, buckets, determinism, timeouts.
    #[serde(default)]
    pub parallel: ParallelConfig,
    /// `[loss_scale]`: the fp16 loss scaler's settings and what an overflow at its floor
    /// does ([`LossScaleConfig`]); unset, torch's `GradScaler`. fp16 only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<LossScaleConfig>,
    /// `[plan]`: keys only `stoker plan` reads (hardware, utilization) and the predictions
    /// it wrote (docs/plan.md). Accepted and not acted on here, so an emitted config runs
    /// as is and plans again alike.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<stoker_plan::emit::PlanSection>,
    /// What parsing has to tell the user: keys accepted under an older name.
    #[serde(skip)]
    pub notes: Vec<String>,
}

/// The `recompute` key: activations the resident step recomputes in its backward
/// instead of keeping between the forward and the backward.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation.
    #[default]
    None,
    /// Attention's probabilities `[B, H, T, T]`: one buffer for every block, each block's
    /// recomputed in its backward from its q and k (the same bits; Megatron-LM's
    /// selective recomputation). `step = "resident"` only.
    Attention,
    /// The MLP's activation (the GPT's GELU output `[N, 4C]`, the Llama's SwiGLU product
    /// `[N, F]`): one buffer for every block, each block's recomputed in its backward
    /// from the kept pre-activations (the same bits; llm.c's default). `step =
    /// "resident"` only.
    Mlp,
    /// Both of the above.
    #[serde(rename = "attention+mlp")]
    AttentionAndMlp,
}

impl Recompute {
    /// The key's value as a config writes it.
    pub fn name(&self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Attention => "attention",
            Recompute::Mlp => "mlp",
            Recompute::AttentionAndMlp => "attention+mlp",
        }
    }

    /// The most a step can recompute: attention's probabilities and the MLP's
    /// activation, or with flash attention (which keeps no probabilities) the MLP's
    /// alone.
    pub fn most(flash_attention: bool) -> Recompute {
        match flash_attention {
            true => Recompute::Mlp,
            false => Recompute::AttentionAndMlp,
        }
    }

    /// Whether nothing is recomputed (the default, left out of a written config).
    pub fn is_none(&self) -> bool {
        *self == Recompute::None
    }

    /// Whether attention's probabilities are recomputed.
    pub fn attention(&self) -> bool {
        matches!(self, Recompute::Attention | Recompute::AttentionAndMlp)
    }

    /// Whether the MLP's activation is recomputed.
    pub fn mlp(&self) -> bool {
        matches!(self, Recompute::Mlp | Recompute::AttentionAndMlp)
    }
}

/// The `step` key: how a training step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepKind {
    /// The model's hand-written step over the flat buffers, no autograd graph (llm.c's
    /// design), where it has one (the GPT on a CPU in fp32, and in bf16 where the CPU has
    /// bf16 hardware); elsewhere the graph with stoker-kernels' fused ops.
    Handwritten,
    /// Candle's autograd graph, with the ops `kernels` names.
    Graph,
    /// The GPU-resident step's code (stoker-gpu: the GPT's and the Llama's, fp32 or bf16
    /// activations) run by its host build on a CPU, inside the whole training loop: the
    /// twin of what a GPU runs, slower than `handwritten`, for checking the GPU path
    /// end to end (docs/gpu.md). Not yet wired to `device = "cuda"`.
    Resident,
}

fn default_device() -> String {
    "cpu".into()
}

/// `[data]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Training data: a token shard (`.bin`) or an array prefix (`data/mnist/train`).
    pub train: PathBuf,
    /// Evaluation data (array prefix); token shards without it hold out their last
    /// `eval_fraction` of windows.
    #[serde(default)]
    pub eval: Option<PathBuf>,
    /// Fraction of token windows held out for evaluation when `eval` is absent.
    #[serde(default = "default_eval_fraction")]
    pub eval_fraction: f64,
    /// Name of the input field (`input` for tokens, `image` for arrays).
    #[serde(default)]
    pub input_field: Option<String>,
    /// Name of the target field (`target` for tokens, `label` for arrays).
    #[serde(default)]
    pub target_field: Option<String>,
    /// Token vocabulary (`*.vocab.json`), to check the model's vocab and print samples.
    #[serde(default)]
    pub vocab: Option<PathBuf>,
    /// Shuffle the training order each epoch.
    #[serde(default = "yes")]
    pub shuffle: bool,
    /// Loader worker threads (0: load in the training thread).
    #[serde(default)]
    pub num_workers: usize,
    /// Batches in flight per worker.
    #[serde(default = "default_prefetch")]
    pub prefetch_factor: usize,
    /// Keep workers alive across epochs.
    #[serde(default)]
    pub persistent_workers: bool,
    /// The JPEG decoder of image records (`stoker pack images`): libjpeg-turbo by default;
    /// `"zune"` for a photo that libjpeg-turbo warns about and zune-jpeg's strict mode
    /// accepts. Refused for data that is not image records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jpeg_decoder: Option<JpegDecoder>,
}

/// `data.jpeg_decoder`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum JpegDecoder {
    /// libjpeg-turbo (the default): DCT-domain scaling, any warning an error.
    #[serde(rename = "libjpeg-turbo")]
    LibjpegTurbo,
    /// zune-jpeg (pure Rust, strict mode), always at full scale.
    #[serde(rename = "zune")]
    Zune,
}

impl JpegDecoder {
    /// The loader's backend this key names.
    pub fn backend(self) -> stoker_data::transform::JpegBackend {
        match self {
            JpegDecoder::LibjpegTurbo => stoker_data::transform::JpegBackend::LibjpegTurbo,
            JpegDecoder::Zune => stoker_data::transform::JpegBackend::Zune,
        }
    }
}

impl DataConfig {
    /// The training loader these keys configure, for batches of `micro_batch` samples
    /// (whole batches only): what a run trains with and the calibration measures.
    pub fn train_loader(&self, micro_batch: usize) -> stoker_data::LoaderConfig {
        stoker_data::LoaderConfig {
            batch_size: micro_batch,
            num_workers: self.num_workers,
            prefetch_factor: self.prefetch_factor,
            drop_last: true,
            persistent_workers: self.persistent_workers,
            ..Default::default()
        }
    }
}

fn default_eval_fraction() -> f64 {
    0.1
}
fn default_prefetch() -> usize {
    2
}
fn yes() -> bool {
    true
}

/// `[batch]`: DeepSpeed's rule `global_batch = micro_batch x accumulation_steps x
/// world_size`. Give `global_batch` to keep it fixed across world sizes (the accumulation
/// steps follow from the launcher's world size), or `accumulation_steps`; with both, the
/// product is checked. [`ParallelDims`](crate::parallel::ParallelDims) resolves them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchConfig {
    /// Samples per forward/backward on each rank.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step on each rank (default: from `global_batch`, else 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accumulation_steps: Option<usize>,
    /// Data-parallel ranks; checked against the launcher's (default: the launcher's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<usize>,
    /// Samples per optimizer step over all ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_batch: Option<usize>,
}

impl BatchConfig {
    /// `(accumulation_steps, global_batch)` at `world` ranks, or an error naming the key
    /// that does not fit.
    pub fn resolve(&self, world: usize) -> Result<(usize, usize)> {
        let b = self;
        let m = b.micro_batch;
        let per_step = m * world;
        match (b.accumulation_steps, b.global_batch) {
            (None, None) => Ok((1, per_step)),
            (Some(k), None) => Ok((k, per_step * k)),
            (None, Some(g)) => {
                if g % per_step != 0 || g == 0 {
                    let fits: Vec<String> = (1..=g.min(64))
                        .filter(|w| g % (m * w) == 0)
                        .map(|w| w.to_string())
                        .collect();
                    return Err(config_err(
                    "batch.global_batch",
                    format!(
                        "{g} is not divisible by micro_batch {m} x world_size {world} = {per_step}, \
                         so no whole number of accumulation steps fits (world sizes that fit: {})",
                        if fits.is_empty() { "none".into() } else { fits.join(", ") }
                    ),
                ));
                }
                Ok((g / per_step, g))
            }
            (Some(k), Some(g)) => {
                let product = per_step * k;
                if g != product {
                    let hint = if g % per_step == 0 {
                        format!("; accumulation_steps = {} would fit", g / per_step)
                    } else {
                        format!("; {g} is not divisible by micro_batch x world_size = {per_step}")
                    };
                    return Err(config_err(
                    "batch.global_batch",
                    format!(
                        "{g} != micro_batch {m} x accumulation_steps {k} x world_size {world} = {product}{hint}"
                    ),
                ));
                }
                Ok((k, g))
            }
        }
    }
}

/// `[parallel] strategy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum StrategyKind {
    /// One rank (refused at a world size above 1).
    None,
    /// Data parallelism: whole model per rank, gradients all-reduced (PyTorch DDP).
    #[default]
    Ddp,
    /// ZeRO stage 1: optimizer states sharded over the ranks (DeepSpeed `stage: 1`).
    Zero1,
    /// ZeRO stage 2: optimizer states and gradients sharded (DeepSpeed `stage: 2`,
    /// FSDP `SHARD_GRAD_OP`, also accepted under that name).
    #[serde(alias = "shard_grad_op")]
    Zero2,
    /// ZeRO stage 3 (DeepSpeed `stage: 3`, FSDP `FULL_SHARD`, also accepted under that
    /// name): parameters sharded too, each block gathered as the direct step needs it.
    #[serde(alias = "full_shard")]
    Zero3,
}

impl StrategyKind {
    /// The name `parallel.strategy` gives it.
    pub fn name(self) -> &'static str {
        match self {
            StrategyKind::None => "none",
            StrategyKind::Ddp => "ddp",
            StrategyKind::Zero1 => "zero1",
            StrategyKind::Zero2 => "zero2",
            StrategyKind::Zero3 => "zero3",
        }
    }

    /// The planner's stage for this strategy (one rank's `none` is DDP's arithmetic).
    pub fn stage(self) -> stoker_plan::strategy::Stage {
        use stoker_plan::strategy::Stage;
        match self {
            StrategyKind::None | StrategyKind::Ddp => Stage::Ddp,
            StrategyKind::Zero1 => Stage::Zero1,
            StrategyKind::Zero2 => Stage::Zero2,
            StrategyKind::Zero3 => Stage::Zero3,
        }
    }
}

/// `[parallel] backend`: which communicator connects the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// MPI when started by `mpirun` / `srun`, otherwise one rank.
    #[default]
    Auto,
    /// MPI; an error outside a launcher.
    Mpi,
    /// `batch.world_size` ranks as threads of this process.
    Local,
}

/// `[parallel]`: how the ranks work together.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelConfig {
    /// `ddp` (default), `zero1`, `zero2` (alias `shard_grad_op`), `zero3` (alias
    /// `full_shard`) or `none`.
    pub strategy: StrategyKind,
    /// `auto` (default), `mpi` or `local`.
    pub backend: BackendKind,
    /// Bit-identical weights at every power-of-two world size (a fixed reduction tree;
    /// no overlap of communication with the backward).
    pub deterministic: bool,
    /// Gradient bucket size in MiB (PyTorch's `bucket_cap_mb`).
    pub bucket_cap_mb: f64,
    /// The first (last layers') bucket's size in MiB, small so its all-reduce starts early.
    pub first_bucket_mb: f64,
    /// Reduce after every micro-batch instead of only the window's last. DDP: default
    /// false (only to measure the chapter's 4.3.1 advice; same result, more traffic).
    /// ZeRO-2: default true (DeepSpeed's: the running gradient sum is shard-sized);
    /// false keeps full local gradients until the last micro-batch (FSDP's `no_sync`).
    /// ZeRO-1 reduces once per window: true is refused there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_every_micro_batch: Option<bool>,
    /// ZeRO-3: free each block's gathered parameters after its forward and gather them
    /// again for its backward (default true, FSDP's `reshard_after_forward`); false keeps
    /// them from the forward to the backward: less traffic, ZeRO-2's parameter memory.
    pub reshard_after_forward: bool,
    /// Keep optimizer states in host memory and step them there (DeepSpeed
    /// `offload_optimizer`, FSDP `CPUOffload`): for accelerator runs only.
    pub offload_optimizer: bool,
    /// Keep the blocks' parameters in host memory too, each block's brought up just
    /// before it runs and its gradients taken down after its backward (FSDP's
    /// `CPUOffload(offload_params=True)`, DeepSpeed's `offload_param`): the resident
    /// loop on one GPU, or under `zero3` on any number (each rank's shard in host
    /// memory), with `offload_optimizer`.
    pub offload_params: bool,
    /// Seconds any collective may wait before the job ends naming it.
    pub timeout_s: f64,
    /// Compute threads per rank (0: this host's cores divided by its ranks).
    pub threads_per_rank: usize,
    /// Check before every collective that every rank calls the same one, failing at once
    /// naming each rank's call where they differ instead of waiting for `timeout_s`
    /// (PyTorch's `TORCH_DISTRIBUTED_DEBUG=DETAIL`; one small all-gather per collective).
    pub check_collectives: bool,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            strategy: StrategyKind::Ddp,
            backend: BackendKind::Auto,
            deterministic: false,
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
            sync_every_micro_batch: None,
            reshard_after_forward: true,
            offload_optimizer: false,
            offload_params: false,
            timeout_s: 60.0,
            threads_per_rank: 0,
            check_collectives: false,
        }
    }
}

/// Which optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// AdamW.
    Adamw,
    /// SGD with momentum.
    Sgd,
}

/// `[optimizer]`: one flat table (weight decay follows `kind`: decoupled for AdamW,
/// L2 for SGD; applied to tensors of rank >= 2 only).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// `adamw` or `sgd`.
    pub kind: OptimizerKind,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate of the cosine decay.
    #[serde(default)]
    pub min_lr: f64,
    /// Linear warmup steps.
    #[serde(default)]
    pub warmup_steps: u64,
    /// Step where the cosine reaches `min_lr` (0: `train.steps`).
    #[serde(default)]
    pub decay_steps: u64,
    /// AdamW first-moment decay.
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    /// AdamW second-moment decay.
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    /// AdamW denominator epsilon.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Weight decay.
    #[serde(default)]
    pub weight_decay: f64,
    /// SGD momentum.
    #[serde(default = "default_momentum")]
    pub momentum: f64,
    /// SGD Nesterov momentum.
    #[serde(default)]
    pub nesterov: bool,
    /// Clip the global gradient norm to this (0 disables).
    #[serde(default)]
    pub grad_clip: f64,
}

fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_eps() -> f64 {
    1e-8
}
fn default_momentum() -> f64 {
    0.9
}

impl OptimizerConfig {
    /// The AdamW hyper-parameters.
    pub fn adamw(&self) -> AdamWConfig {
        AdamWConfig {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
        }
    }

    /// The SGD hyper-parameters.
    pub fn sgd(&self) -> SgdConfig {
        SgdConfig {
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            nesterov: self.nesterov,
        }
    }
}

/// `[train]`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoopConfig {
    /// Optimizer steps to run.
    pub steps: u64,
    /// Evaluate every this many steps (0: only at the end).
    #[serde(default)]
    pub eval_every: u64,
    /// Micro-batches per evaluation.
    #[serde(default = "default_eval_batches")]
    pub eval_batches: usize,
    /// Checkpoint every this many steps (0: only at the end).
    #[serde(default)]
    pub checkpoint_every: u64,
    /// Keep this many of the newest checkpoints, removing older ones after each save
    /// (0: keep all).
    #[serde(default)]
    pub keep_checkpoints: usize,
    /// Append a metrics line every this many steps.
    #[serde(default = "default_log_every")]
    pub log_every: u64,
    /// Tokens to sample after training (GPT with a vocab).
    #[serde(default)]
    pub sample_tokens: usize,
}

fn default_eval_batches() -> usize {
    20
}
fn default_log_every() -> u64 {
    10
}

impl TrainConfig {
    /// Whether training steps run the model's direct step: the GPT's, where `kernels` and
    /// the precision allow it (every other model has none and runs candle's graph).
    pub fn direct_step(&self) -> bool {
        self.direct_step_at(self.precision)
    }

    /// [`TrainConfig::direct_step`] were the run in `precision` instead (a plan may
    /// change it).
    pub fn direct_step_at(&self, precision: Precision) -> bool {
        matches!(self.model, ModelConfig::Gpt(_) | ModelConfig::Llama(_))
            && match self.resident_step() {
                true => crate::precision::resident_activations(precision).is_ok(),
                false => self.kernels.direct_step(precision),
            }
    }

    /// How the resident steps of this config are made as far as memory goes:
    /// `recompute`, and on the loop `parallel.offload_params` (what a strategy's step
    /// needs beyond it, ZeRO-2's gradient slots and ZeRO-3's shard, stoker-gpu's
    /// `Strategy::step_options` adds for each rank).
    pub fn resident_options(&self) -> stoker_gpu::step::options::StepOptions {
        stoker_gpu::step::options::StepOptions {
            offload_params: self.resident_loop() && self.parallel.offload_params,
            recompute_attention: self.recompute.attention(),
            recompute_mlp: self.recompute.mlp(),
            graph_micro_batches: self.cuda_graphs,
            flash_attention: self.flash_attention,
            fp8_linears: self.precision == Precision::Fp8,
            ..Default::default()
        }
    }

    /// Whether the direct step is the GPU-resident step's host build (`step =
    /// "resident"`).
    pub fn resident_step(&self) -> bool {
        self.step == Some(StepKind::Resident)
    }

    /// Whether training steps run the resident loop (`step = "resident"` under one rank,
    /// DDP, ZeRO-1, -2 or -3; deterministic mode under one rank, DDP or ZeRO-1): the step,
    /// the FP32 master, the optimizer and the reductions on the step's backend. The rest
    /// of `step = "resident"` (deterministic ZeRO-2, DDP's reduction per micro-batch,
    /// `no_sync` under ZeRO-2) runs the same step's host build through the
    /// CPU trainer's own master and optimizer, on the CPU only.
    pub fn resident_loop(&self) -> bool {
        self.resident_step() && self.not_on_resident_loop().is_none()
    }

    /// The first key (and why) that keeps `step = "resident"` off its loop: the rules of
    /// [`TrainConfig::resident_loop`], in one place.
    fn not_on_resident_loop(&self) -> Option<(&'static str, String)> {
        let p = &self.parallel;
        let per_block = matches!(p.strategy, StrategyKind::Zero2 | StrategyKind::Zero3);
        if per_block && p.sync_every_micro_batch == Some(false) {
            return Some((
                "parallel.sync_every_micro_batch",
                "false keeps whole local gradients until the last micro-batch, which ZeRO-2 \
                 and ZeRO-3 on the resident loop do not hold: they reduce each block's after \
                 every micro-batch (use \"zero1\" for one reduction per window)"
                    .into(),
            ));
        }
        if p.strategy == StrategyKind::Zero3 && !p.reshard_after_forward {
            return Some((
                "parallel.reshard_after_forward",
                "false keeps each block's gathered parameters from its forward to its backward, \
                 which the resident loop's two parameter slots do not hold: it gathers each \
                 block again for its backward (FSDP's default, true)"
                    .into(),
            ));
        }
        let whole_gradients = matches!(
            p.strategy,
            StrategyKind::None | StrategyKind::Ddp | StrategyKind::Zero1
        );
        if p.deterministic && !whole_gradients {
            return Some((
                "parallel.deterministic",
                "the resident loop's deterministic mode runs one rank, \"ddp\" or \"zero1\": \
                 ZeRO-2 and ZeRO-3 reduce each block's gradient as the backward goes, and its \
                 trees need each micro-batch's whole"
                    .into(),
            ));
        }
        if p.deterministic && p.offload_params {
            return Some((
                "parallel.deterministic",
                "the resident loop's deterministic mode sums whole gradients on the step's \
                 backend; with parallel.offload_params they are gathered on the host"
                    .into(),
            ));
        }
        if p.sync_every_micro_batch == Some(true) && !per_block {
            return Some((
                "parallel.sync_every_micro_batch",
                "the resident loop reduces once per window (a reduction per micro-batch is \
                 only there to measure the chapter's 4.3.1 advice, on the CPU)"
                    .into(),
            ));
        }
        None
    }

    /// `step = "resident"` on a GPU: only the resident loop, whose optimizer is on the
    /// device; errors name the key that asks for anything else.
    fn check_resident_gpu(&self) -> Result<()> {
        if let Some((key, why)) = self.not_on_resident_loop() {
            return Err(config_err(key, why));
        }
        Ok(())
    }

    /// `step = "resident"`'s requirements: a GPT or Llama, fp32, bf16 or fp16; and
    /// `recompute` only on it.
    fn check_resident(&self) -> Result<()> {
        self.check_cuda_graphs()?;
        self.check_flash_attention()?;
        if !self.resident_step() {
            if !self.recompute.is_none() {
                return Err(config_err(
                    "recompute",
                    "recomputes in the resident step's backward: set step = \"resident\"",
                ));
            }
            return Ok(());
        }
        if !matches!(self.model, ModelConfig::Gpt(_) | ModelConfig::Llama(_)) {
            return Err(config_err(
                "step",
                "\"resident\" runs the GPU step of a GPT or a Llama; this model has none",
            ));
        }
        crate::precision::resident_activations(self.precision)?;
        self.check_resident_fp8()?;
        self.check_resident_buckets()
    }

    /// fp8 on the resident step: the GPT's or the Llama's linear layers in FP8, on its loop
    /// (whose update ends the scalers' steps, each amax the largest over the ranks; the
    /// CPU trainer's update on the step's host build would not), under any strategy.
    fn check_resident_fp8(&self) -> Result<()> {
        if self.precision != Precision::Fp8 {
            return Ok(());
        }

        if let Some((key, why)) = self.not_on_resident_loop() {
            return Err(config_err(
                key,
                format!("fp8 on step = \"resident\" runs on the resident loop: {why}"),
            ));
        }
        // Hopper's FP8 products take widths and rows that are multiples of 16 (the step
        // refuses the rest when it is made; here the keys are named before anything runs).
        let (widths, context): (Vec<(&str, usize)>, usize) = match &self.model {
            ModelConfig::Gpt(g) => (vec![("model.d_model", g.d_model)], g.context),
            ModelConfig::Llama(l) => {
                let d = l.dims();
                (
                    vec![
                        ("model.d_model", d.d_model),
                        ("model.n_kv_head", d.n_kv_head * d.head_dim()),
                        ("model.ffn_hidden", d.ffn_hidden),
                    ],
                    d.context,
                )
            }
            _ => return Ok(()),
        };
        if let Some((key, w)) = widths.into_iter().find(|(_, w)| !w.is_multiple_of(16)) {
            return Err(config_err(
                key,
                format!(
                    "makes a layer {w} wide: fp8 on step = \"resident\" needs widths that are \
                     multiples of 16 (FP8 products on Hopper's tensor cores)"
                ),
            ));
        }
        let rows = self.batch.micro_batch * context;
        if !rows.is_multiple_of(16) {
            return Err(config_err(
                "batch.micro_batch",
                format!(
                    "{} sequences of model.context {context} make rows of {rows}: fp8 on step = \
                     \"resident\" needs micro-batch rows (sequences x positions) that are a \
                     multiple of 16 (FP8 products on Hopper's tensor cores)",
                    self.batch.micro_batch
                ),
            ));
        }
        Ok(())
    }

    /// The resident loop reduces one bucket per block, as the backward finishes it:
    /// `bucket_cap_mb` and `first_bucket_mb` size the CPU trainer's buckets, and set on
    /// the loop they would be ignored (they were, silently).
    fn check_resident_buckets(&self) -> Result<()> {
        if !self.resident_loop() {
            return Ok(());
        }
        let (p, d) = (&self.parallel, ParallelConfig::default());
        for (key, v, default) in [
            ("parallel.bucket_cap_mb", p.bucket_cap_mb, d.bucket_cap_mb),
            (
                "parallel.first_bucket_mb",
                p.first_bucket_mb,
                d.first_bucket_mb,
            ),
        ] {
            if v != default {
                return Err(config_err(
                    key,
                    format!(
                        "{v}: the resident loop reduces one bucket per block, each as soon as \
                         the backward has finished it (docs/gpu.md, \"Data parallelism on the \
                         backend\"); this key sizes the CPU trainer's buckets: leave it unset"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `cuda_graphs` only on the resident loop, and not where blocks move between a
    /// micro-batch's launches (ZeRO-2's and ZeRO-3's slots, the parameters offloaded).
    fn check_cuda_graphs(&self) -> Result<()> {
        if !self.cuda_graphs {
            return Ok(());
        }
        if !self.resident_loop() {
            let why = match self.not_on_resident_loop() {
                Some((key, why)) if self.resident_step() => format!(
                    "replays the resident loop's micro-batches, and {key} keeps this run off \
                     the loop: {why}"
                ),
                _ => "replays the resident loop's micro-batches: set step = \"resident\"".into(),
            };
            return Err(config_err("cuda_graphs", why));
        }
        let p = &self.parallel;
        if p.offload_params || matches!(p.strategy, StrategyKind::Zero2 | StrategyKind::Zero3) {
            return Err(config_err(
                "cuda_graphs",
                "a graph replays fixed launches, and with parallel.offload_params, zero2 or \
                 zero3 each micro-batch moves blocks' parameters or gradients between its \
                 launches: use ddp, zero1 or none, without offload_params",
            ));
        }
        Ok(())
    }

    /// `flash_attention` only on the resident step, in bf16, with heads it is built for
    /// and without `recompute` of attention (stoker-gpu's own refusal, named here).
    fn check_flash_attention(&self) -> Result<()> {
        if !self.flash_attention {
            return Ok(());
        }
        if !self.resident_step() {
            return Err(config_err(
                "flash_attention",
                "runs in the resident step's attention: set step = \"resident\"",
            ));
        }
        let head_width = match &self.model {
            ModelConfig::Gpt(g) => g.d_model / g.n_head.max(1),
            ModelConfig::Llama(l) => l.dims().head_dim(),
            _ => 0,
        };
        let dtype = crate::precision::resident_activations(self.precision)?;
        match self.resident_options().flash_refusal(dtype, head_width) {
            Some(why) => Err(config_err("flash_attention", why)),
            None => Ok(()),
        }
    }

    /// Whether a direct step multiplies bf16 operands (on the bf16 GEMM, which keeps
    /// packing buffers) rather than f32 ones.
    pub fn direct_bf16_operands(&self) -> bool {
        self.precision == Precision::Bf16
    }

    /// Parses a TOML file (unknown keys rejected, naming the key) and validates it.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| crate::error::io_err(path, e))?;
        Self::parse(&text, path)
    }

    /// Parses TOML text (`path` only labels errors) and validates it.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let mut c: TrainConfig = toml::from_str(text).map_err(|e| TrainError::ConfigParse {
            path: path.to_path_buf(),
            message: stoker_plan::error::toml_error_line(text, &e),
        })?;
        let direct_given = toml::from_str::<toml::Table>(text)
            .ok()
            .and_then(|t| {
                t.get("kernels")
                    .and_then(|k| k.as_str().map(|k| k == "direct"))
            })
            .unwrap_or(false);
        c.resolve_step(direct_given)?;
        c.validate()?;
        Ok(c)
    }

    /// Settles `step` and `kernels` together (see [`TrainConfig::step`]); `direct_given`:
    /// the file said `kernels = "direct"`, the older name of `step = "handwritten"`.
    pub(crate) fn resolve_step(&mut self, direct_given: bool) -> Result<()> {
        let step =
            match (self.step, self.kernels, direct_given) {
                (Some(StepKind::Graph), Kernels::Direct, true) => return Err(config_err(
                    "kernels",
                    "\"direct\" is the older name of step = \"handwritten\", and step = \"graph\" \
                     is given: for the graph, kernels = \"fused\" or \"composed\"",
                )),
                (Some(s @ (StepKind::Handwritten | StepKind::Resident)), Kernels::Composed, _) => {
                    let name = match s {
                        StepKind::Handwritten => "handwritten",
                        _ => "resident",
                    };
                    return Err(config_err(
                        "kernels",
                        format!(
                            "\"composed\" names candle's primitives on the graph, and step = \
                             \"{name}\" runs no graph: use step = \"graph\" with it"
                        ),
                    ));
                }
                (Some(step), _, _) => step,
                (None, Kernels::Direct, given) => {
                    if given {
                        self.notes.push(
                        "kernels = \"direct\" is now step = \"handwritten\" (the older key still \
                         works)"
                            .into(),
                    );
                    }
                    StepKind::Handwritten
                }
                (None, _, _) => StepKind::Graph,
            };
        self.step = Some(step);
        self.kernels = match (step, self.kernels) {
            (StepKind::Handwritten | StepKind::Resident, _) => Kernels::Direct,
            (StepKind::Graph, Kernels::Direct) => Kernels::Fused,
            (StepKind::Graph, k) => k,
        };
        Ok(())
    }

    /// The schedule with `decay_steps` defaulted to `train.steps`.
    pub fn schedule(&self) -> Schedule {
        let o = &self.optimizer;
        Schedule {
            lr: o.lr,
            min_lr: o.min_lr,
            warmup_steps: o.warmup_steps,
            decay_steps: if o.decay_steps == 0 {
                self.train.steps
            } else {
                o.decay_steps
            },
        }
    }

    /// What a model on a GPU needs: a build with CUDA; on candle's graph, candle's CUDA
    /// ops (`kernels = "composed"`: the direct step and the fused ops are stoker's CPU
    /// kernels), a precision whose arithmetic stays on the device (fp8's quantization
    /// does not), and the optimizer on the host; on the resident step, its loop
    /// ([`TrainConfig::resident_loop`]) with the optimizer on the device.
    fn check_gpu(&self) -> Result<()> {
        if !cfg!(feature = "cuda") {
            return Err(crate::device::not_compiled());
        }
        self.check_gpu_keys()
    }

    /// The keys [`TrainConfig::check_gpu`] checks beyond the build.
    fn check_gpu_keys(&self) -> Result<()> {
        if self.resident_step() {
            return self.check_resident_gpu();
        }
        if self.kernels != Kernels::Composed {
            return Err(config_err(
                "kernels",
                format!(
                    "{:?} runs stoker's CPU kernels; a model on `{}` runs candle's CUDA ops: set kernels = \"composed\"",
                    self.kernels, self.device
                ),
            ));
        }
        if self.precision == Precision::Fp8 {
            return Err(config_err(
                "precision",
                format!(
                    "fp8's delayed-scaling quantization runs on the host, not on `{}`: use bf16, fp16 or fp32",
                    self.device
                ),
            ));
        }
        if !self.parallel.offload_optimizer {
            return Err(config_err(
                "parallel.offload_optimizer",
                format!(
                    "false, but on `{}` the optimizer states and step live on the host (DeepSpeed's \
                     offload_optimizer, FSDP's CPUOffload): set it true (an optimizer on the GPU is not built)",
                    self.device
                ),
            ));
        }
        Ok(())
    }

    /// `parallel.offload_params`: the resident loop on one GPU, or under ZeRO-3 on any
    /// number, with its optimizer offloaded; whatever else asks for it refused naming
    /// the key.
    fn check_offload_params(&self, gpu: bool) -> Result<()> {
        let why = if !gpu {
            Some(
                "device is \"cpu\": the parameters already live in host memory (offloading \
                 moves an accelerator's parameters to the host)"
                    .to_string(),
            )
        } else if !self.resident_loop() {
            Some("runs on the resident loop only: set step = \"resident\"".to_string())
        } else if !self.parallel.offload_optimizer {
            Some(
                "needs parallel.offload_optimizer = true: the update runs on the host, where \
                 the parameters are"
                    .to_string(),
            )
        } else if !(self.parallel.strategy == StrategyKind::Zero3
            || matches!(
                self.parallel.strategy,
                StrategyKind::None | StrategyKind::Ddp
            ) && self.batch.world_size.is_none_or(|w| w <= 1))
        {
            Some(
                "runs on one rank (strategy \"none\", or \"ddp\" on one), or under \"zero3\" \
                 on any number (each rank's shard in host memory: FSDP's FULL_SHARD with \
                 CPUOffload, DeepSpeed's stage 3 offload_param); \"zero1\", \"zero2\" and \
                 \"ddp\" on several ranks keep every rank's whole copy of the parameters, \
                 which is not built offloaded (FSDP's SHARD_GRAD_OP keeps each unit gathered \
                 from its forward to its backward, which the loop's two slots do not)"
                    .to_string(),
            )
        } else {
            None
        };
        match why {
            Some(why) => Err(config_err("parallel.offload_params", why)),
            None => Ok(()),
        }
    }

    /// `[loss_scale]`: fp16's alone, and its settings a valid scaler's.
    fn check_loss_scale(&self) -> Result<()> {
        let Some(ls) = &self.loss_scale else {
            return Ok(());
        };
        if !self.precision.needs_loss_scaling() {
            return Err(config_err(
                "loss_scale",
                format!(
                    "only fp16 scales its loss, and precision is \"{}\": leave the \
                     [loss_scale] table out",
                    self.precision.name()
                ),
            ));
        }
        ls.scaler(self.deepspeed_wrapper()).map(|_| ())
    }

    /// Which of DeepSpeed's optimizer wrappers would run this config's fp16 scaler (its
    /// strategy: ZeRO or not; its optimizer: AdamW fused, SGD not), which `[loss_scale]`'s
    /// `deepspeed` preset follows.
    pub fn deepspeed_wrapper(&self) -> crate::loss_scale::DeepspeedWrapper {
        let zero = matches!(
            self.parallel.strategy,
            StrategyKind::Zero1 | StrategyKind::Zero2 | StrategyKind::Zero3
        );
        let unfused = self.optimizer.kind == OptimizerKind::Sgd;
        crate::loss_scale::DeepspeedWrapper::of(zero, unfused)
    }

    /// The fp16 loss scaler's settings: `[loss_scale]`'s, or torch's `GradScaler`.
    pub fn loss_scaler(&self) -> Result<stoker_precision::ScalerConfig> {
        self.loss_scale
            .clone()
            .unwrap_or_default()
            .scaler(self.deepspeed_wrapper())
    }

    /// Whether an fp16 overflow with the scale at its floor stops the run
    /// ([`LossScaleConfig::stop_at_min_scale`]).
    pub fn stops_at_min_scale(&self) -> bool {
        self.loss_scale
            .as_ref()
            .is_some_and(|ls| ls.stops_at_min_scale(self.deepspeed_wrapper()))
    }

    /// What ZeRO-3 cannot serve: deterministic mode, FSDP's `no_sync`.
    fn check_zero3(&self) -> Result<()> {
        let p = &self.parallel;
        if p.deterministic {
            return Err(config_err(
                "parallel.deterministic",
                "not built for \"zero3\": its per-micro-batch reduce-scatters sum in MPI's order; \
                 use \"zero2\" or \"ddp\" for bit-identical runs",
            ));
        }
        if p.sync_every_micro_batch == Some(false) {
            return Err(config_err(
                "parallel.sync_every_micro_batch",
                "false is FSDP's no_sync, which under \"zero3\" keeps full unsharded gradients \
                 through the window: not built; leave it unset",
            ));
        }
        Ok(())
    }

    /// Checks everything that does not need the data; errors name the key.
    pub fn validate(&self) -> Result<()> {
        self.check_resident()?;
        self.check_loss_scale()?;
        // Sampling decodes ids through the vocabulary, and only a token model samples:
        // left unchecked it was skipped without a word.
        if self.train.sample_tokens > 0 {
            if self.model.vocab().is_none() {
                return Err(config_err(
                    "train.sample_tokens",
                    "a classifier (cnn, mlp) samples no text: leave it out or set it to 0",
                ));
            }
            if self.data.vocab.is_none() {
                return Err(config_err(
                    "train.sample_tokens",
                    "sampling prints text through the vocabulary: give data.vocab (the \
                     PREFIX.vocab.json `stoker pack` wrote), or leave sample_tokens out",
                ));
            }
        }
        let b = &self.batch;
        if b.micro_batch == 0 {
            return Err(config_err("batch.micro_batch", "must be at least 1"));
        }
        // The loader's knobs, checked at parse by their config keys (the loader names its
        // own fields, `prefetch_factor`, where `data.prefetch_factor` is what to fix).
        if let Err(stoker_data::DataError::Config { field, message }) =
            self.data.train_loader(b.micro_batch).validate()
        {
            return Err(config_err(format!("data.{field}"), message));
        }
        for (key, v) in [
            ("batch.accumulation_steps", b.accumulation_steps),
            ("batch.world_size", b.world_size),
            ("batch.global_batch", b.global_batch),
        ] {
            if v == Some(0) {
                return Err(config_err(key, "must be at least 1"));
            }
        }
        let p = &self.parallel;
        for (key, v) in [
            ("parallel.bucket_cap_mb", p.bucket_cap_mb),
            ("parallel.first_bucket_mb", p.first_bucket_mb),
            ("parallel.timeout_s", p.timeout_s),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                return Err(config_err(key, format!("{v}: must be positive")));
            }
        }
        if p.deterministic && p.sync_every_micro_batch == Some(true) {
            return Err(config_err(
                "parallel.sync_every_micro_batch",
                "cannot be combined with parallel.deterministic (its reduction waits for the whole window)",
            ));
        }
        if p.strategy == StrategyKind::Zero1 && p.sync_every_micro_batch == Some(true) {
            // Accepted and ignored before: the same bytes sent with it as without.
            return Err(config_err(
                "parallel.sync_every_micro_batch",
                "true under \"zero1\", which reduces once per window (DeepSpeed's stage 1: \
                 whole local gradients until the window's last micro-batch, then one \
                 reduce-scatter); a reduction per micro-batch is \"ddp\"'s (the chapter's \
                 4.3.1 measurement) or \"zero2\"'s: leave it unset or change the strategy",
            ));
        }
        if p.strategy == StrategyKind::Zero3 {
            self.check_zero3()?;
        }
        let gpu = crate::device::TrainDevice::parse(&self.device)?.is_cuda();
        if p.offload_params {
            self.check_offload_params(gpu)?;
        }
        if p.offload_optimizer && !gpu {
            return Err(config_err(
                "parallel.offload_optimizer",
                "device is \"cpu\": the optimizer states already live in host memory and the CPU \
                 already steps them, so there is nothing to offload (offloading moves an \
                 accelerator's optimizer states to the host)",
            ));
        }
        // The full check needs the launcher's world size (ParallelDims::resolve, before
        // any work); here: whatever the file alone decides.
        match (b.world_size, b.accumulation_steps, b.global_batch) {
            (Some(w), _, _) => {
                // The file's own world size: the launcher's may differ, and is not yet known.
                let fix = match self.parallel.backend {
                    BackendKind::Local => {
                        "the ranks backend = \"local\" runs as threads: set it to a size that fits"
                    }
                    _ => "drop that key to take the launcher's",
                };
                b.resolve(w).map_err(|e| match e {
                    TrainError::Config { key, message } => config_err(
                        key,
                        format!(
                            "{message} (the world size is this file's batch.world_size = {w}; \
                             {fix})"
                        ),
                    ),
                    other => other,
                })?;
            }
            (None, Some(k), Some(g)) if g % (b.micro_batch * k) != 0 => {
                return Err(config_err(
                    "batch.global_batch",
                    format!(
                        "{g} is not divisible by micro_batch {} x accumulation_steps {k} = {}: no world size fits",
                        b.micro_batch,
                        b.micro_batch * k
                    ),
                ));
            }
            _ => {}
        }
        if gpu {
            self.check_gpu()?;
        }
        if self.precision == Precision::Fp64 {
            return Err(config_err(
                "precision",
                "fp64 is for gradient checks only; use fp32, bf16, fp16 or fp8",
            ));
        }
        self.model
            .validate()
            .map_err(|(k, m)| config_err(format!("model.{k}"), m))?;
        if !(0.0..1.0).contains(&self.data.eval_fraction) {
            return Err(config_err(
                "data.eval_fraction",
                format!("{}: expected 0 <= f < 1", self.data.eval_fraction),
            ));
        }
        let o = &self.optimizer;
        if !(o.lr > 0.0 && o.lr.is_finite()) {
            return Err(config_err(
                "optimizer.lr",
                format!("{}: must be positive", o.lr),
            ));
        }
        if !(0.0..=o.lr).contains(&o.min_lr) {
            return Err(config_err(
                "optimizer.min_lr",
                format!("{}: expected 0 <= min_lr <= lr {}", o.min_lr, o.lr),
            ));
        }
        for (k, v) in [("beta1", o.beta1), ("beta2", o.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(config_err(
                    format!("optimizer.{k}"),
                    format!("{v}: expected 0 <= beta < 1"),
                ));
            }
        }
        // PyTorch's optimizers refuse these too; NaN would otherwise turn clipping off
        // without a word, or surface later as a non-finite weight.
        for (k, v, what) in [
            ("eps", o.eps, "0 <= eps"),
            ("weight_decay", o.weight_decay, "0 <= weight_decay"),
            (
                "grad_clip",
                o.grad_clip,
                "0 <= grad_clip (0 turns clipping off)",
            ),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(config_err(
                    format!("optimizer.{k}"),
                    format!("{v}: expected a finite {what}"),
                ));
            }
        }
        if !(0.0..1.0).contains(&o.momentum) {
            return Err(config_err(
                "optimizer.momentum",
                format!(
                    "{}: expected 0 <= momentum < 1 (at 1 or more the velocity grows without bound)",
                    o.momentum
                ),
            ));
        }
        if o.kind == OptimizerKind::Sgd && o.nesterov && o.momentum == 0.0 {
            return Err(config_err(
                "optimizer.nesterov",
                "Nesterov momentum needs optimizer.momentum > 0",
            ));
        }
        if self.train.steps == 0 {
            return Err(config_err("train.steps", "must be at least 1"));
        }
        if self.train.log_every == 0 {
            return Err(config_err("train.log_every", "must be at least 1"));
        }
        if self.train.eval_batches == 0 {
            return Err(config_err(
                "train.eval_batches",
                "must be at least 1 (every run evaluates at its end)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A valid CPU config (the GPU keys are then set by hand: a CPU build refuses
    /// `device = "cuda"` before it looks at them).
    fn cpu_config() -> TrainConfig {
        let text = r#"
run_dir = "/tmp/r"
precision = "bf16"
kernels = "composed"
[data]
train = "/tmp/t.bin"
[model]
kind = "mlp"
input_shape = [4]
hidden = [8]
classes = 3
[batch]
micro_batch = 2
[optimizer]
kind = "adamw"
lr = 1e-3
[train]
steps = 1
"#;
        TrainConfig::parse(text, Path::new("gpu.toml")).unwrap()
    }

    fn key_of(r: Result<()>) -> String {
        match r {
            Err(TrainError::Config { key, .. }) => key,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    /// A file whose own `batch.world_size` does not divide its global batch says that the
    /// size is the file's (under a launcher of another size, the listed sizes read as if
    /// the launched one were refused).
    #[test]
    fn a_file_s_own_world_size_is_named_when_the_batch_does_not_fit_it() {
        let mut c = cpu_config();
        c.batch.micro_batch = 2;
        c.batch.global_batch = Some(6);
        c.batch.world_size = Some(2);
        match c.validate() {
            Err(TrainError::Config { key, message }) => {
                assert_eq!(key, "batch.global_batch");
                assert!(
                    message.contains("world sizes that fit: 1, 3")
                        && message.contains("this file's batch.world_size = 2"),
                    "{message}"
                );
            }
            other => panic!("expected batch.global_batch refused, got {other:?}"),
        }
    }

    #[test]
    fn optimizer_keys_out_of_range_are_refused_by_name() {
        let c = cpu_config();
        c.validate().unwrap();
        let refused = |set: fn(&mut OptimizerConfig)| {
            let mut k = c.clone();
            set(&mut k.optimizer);
            key_of(k.validate())
        };
        assert_eq!(refused(|o| o.grad_clip = f64::NAN), "optimizer.grad_clip");
        assert_eq!(refused(|o| o.grad_clip = -1.0), "optimizer.grad_clip");
        assert_eq!(refused(|o| o.weight_decay = -5.0), "optimizer.weight_decay");
        assert_eq!(
            refused(|o| o.weight_decay = f64::NAN),
            "optimizer.weight_decay"
        );
        assert_eq!(refused(|o| o.eps = f64::NAN), "optimizer.eps");
        assert_eq!(refused(|o| o.eps = f64::INFINITY), "optimizer.eps");
        assert_eq!(refused(|o| o.momentum = f64::NAN), "optimizer.momentum");
        assert_eq!(refused(|o| o.momentum = 1.0), "optimizer.momentum");
        let nesterov = |o: &mut OptimizerConfig| {
            o.kind = OptimizerKind::Sgd;
            o.nesterov = true;
            o.momentum = 0.0;
        };
        assert_eq!(refused(nesterov), "optimizer.nesterov");
        let mut k = c.clone();
        k.train.eval_batches = 0;
        assert_eq!(key_of(k.validate()), "train.eval_batches");
        let mut k = c.clone();
        (k.step, k.kernels) = (Some(StepKind::Resident), Kernels::Composed);
        match k.resolve_step(false) {
            Err(TrainError::Config { key, message }) => {
                assert_eq!(key, "kernels");
                assert!(
                    message.contains("step = \"resident\" runs no graph"),
                    "{message}"
                );
            }
            other => panic!("expected the kernels key refused, got {other:?}"),
        }
        // Zero is each one's off (clipping, decay) and PyTorch's accepted floor.
        let mut k = c.clone();
        (
            k.optimizer.grad_clip,
            k.optimizer.weight_decay,
            k.optimizer.eps,
        ) = (0.0, 0.0, 0.0);
        k.validate().unwrap();
    }

    #[test]
    fn a_gpu_config_needs_composed_kernels_a_device_precision_and_offload() {
        let mut c = cpu_config();
        c.device = "cuda:1".into();
        c.parallel.offload_optimizer = true;
        c.check_gpu_keys().unwrap();
        for p in [Precision::Fp32, Precision::Fp16] {
            c.precision = p;
            c.check_gpu_keys().unwrap();
        }
        let mut k = c.clone();
        k.kernels = Kernels::Fused;
        assert_eq!(key_of(k.check_gpu_keys()), "kernels");
        let mut p = c.clone();
        p.precision = Precision::Fp8;
        assert_eq!(key_of(p.check_gpu_keys()), "precision");
        let mut o = c.clone();
        o.parallel.offload_optimizer = false;
        assert_eq!(key_of(o.check_gpu_keys()), "parallel.offload_optimizer");
        // This build's answer to the whole check.
        match cfg!(feature = "cuda") {
            true => c.check_gpu().unwrap(),
            false => assert_eq!(key_of(c.check_gpu()), "device"),
        }
        // The resident step on a GPU: its loop, with the optimizer on the device.
        let mut r = cpu_config();
        r.device = "cuda".into();
        r.step = Some(StepKind::Resident);
        r.kernels = Kernels::Direct;
        r.check_gpu_keys().unwrap();
        assert!(r.resident_loop());
        for (key, change) in [
            (
                "parallel.sync_every_micro_batch",
                (|c: &mut TrainConfig| {
                    c.parallel.strategy = StrategyKind::Zero2;
                    c.parallel.sync_every_micro_batch = Some(false);
                }) as fn(&mut TrainConfig),
            ),
            ("parallel.sync_every_micro_batch", |c| {
                c.parallel.strategy = StrategyKind::Zero3;
                c.parallel.sync_every_micro_batch = Some(false);
            }),
            ("parallel.reshard_after_forward", |c| {
                c.parallel.strategy = StrategyKind::Zero3;
                c.parallel.reshard_after_forward = false;
            }),
            ("parallel.deterministic", |c| {
                c.parallel.strategy = StrategyKind::Zero2;
                c.parallel.deterministic = true
            }),
            ("parallel.sync_every_micro_batch", |c| {
                c.parallel.sync_every_micro_batch = Some(true)
            }),
        ] {
            let mut bad = r.clone();
            change(&mut bad);
            assert_eq!(key_of(bad.check_gpu_keys()), key);
        }
        let zeros = [
            StrategyKind::Zero1,
            StrategyKind::Zero2,
            StrategyKind::Zero3,
        ];
        for kind in [StrategyKind::None].into_iter().chain(zeros) {
            let mut ok = r.clone();
            ok.parallel.strategy = kind;
            ok.check_gpu_keys().unwrap();
            assert!(ok.resident_loop(), "{kind:?} on the loop");
        }
        // Deterministic mode under one rank, DDP or ZeRO-1: its trees run on the loop.
        for kind in [StrategyKind::None, StrategyKind::Ddp, StrategyKind::Zero1] {
            let mut det = r.clone();
            det.parallel.strategy = kind;
            det.parallel.deterministic = true;
            det.check_gpu_keys().unwrap();
            assert!(det.resident_loop(), "deterministic {kind:?} on the loop");
        }
        for kind in [StrategyKind::Zero2, StrategyKind::Zero3] {
            let mut sync = r.clone();
            sync.parallel.strategy = kind;
            sync.parallel.sync_every_micro_batch = Some(true);
            sync.check_gpu_keys().unwrap();
        }
        // The optimizer offloaded to the host: one rank, DDP, ZeRO-1, -2 or -3.
        for kind in [StrategyKind::None, StrategyKind::Ddp]
            .into_iter()
            .chain(zeros)
        {
            let mut ok = r.clone();
            ok.parallel.strategy = kind;
            ok.parallel.offload_optimizer = true;
            ok.check_gpu_keys().unwrap();
        }
        // Offload on a CPU is refused whatever the build.
        let mut cpu = cpu_config();
        cpu.parallel.offload_optimizer = true;
        assert_eq!(key_of(cpu.validate()), "parallel.offload_optimizer");
    }

    #[test]
    fn parameter_offload_is_the_resident_loop_on_one_gpu_with_its_optimizer_offloaded() {
        let mut r = cpu_config();
        r.device = "cuda".into();
        r.step = Some(StepKind::Resident);
        r.kernels = Kernels::Direct;
        r.parallel.offload_optimizer = true;
        r.parallel.offload_params = true;
        for kind in [StrategyKind::None, StrategyKind::Ddp] {
            let mut ok = r.clone();
            ok.parallel.strategy = kind;
            ok.check_offload_params(true).unwrap();
        }
        // ZeRO-3 on any number of ranks: each rank's shard in host memory.
        for world in [None, Some(1), Some(4)] {
            let mut ok = r.clone();
            ok.parallel.strategy = StrategyKind::Zero3;
            ok.batch.world_size = world;
            ok.check_offload_params(true).unwrap();
        }
        assert_eq!(
            key_of(r.check_offload_params(false)),
            "parallel.offload_params",
            "on a CPU"
        );
        for change in [
            (|c: &mut TrainConfig| c.parallel.strategy = StrategyKind::Zero1)
                as fn(&mut TrainConfig),
            |c| c.parallel.strategy = StrategyKind::Zero2,
            |c| {
                c.parallel.strategy = StrategyKind::Zero3;
                c.parallel.offload_optimizer = false;
            },
            |c| c.parallel.offload_optimizer = false,
            |c| c.step = None,
            |c| c.batch.world_size = Some(2),
        ] {
            let mut bad = r.clone();
            change(&mut bad);
            assert_eq!(
                key_of(bad.check_offload_params(true)),
                "parallel.offload_params"
            );
        }
        let mut cpu = cpu_config();
        cpu.parallel.offload_params = true;
        assert_eq!(key_of(cpu.validate()), "parallel.offload_params");
    }
}
