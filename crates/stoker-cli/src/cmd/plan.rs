//! `stoker plan`: predict memory, communication and step time per strategy and recommend one.
//! Parses arguments into the planner's raw input and prints; the model lives in stoker-plan.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use stoker_plan::deepspeed::DsConfig;
use stoker_plan::input::{Count, HardwareInput, ModelInput, PlanInput, TrainingInput};
use stoker_plan::loader::LoaderBench;
use stoker_plan::setup::{Accounting, Optimizer, Precision};
use stoker_train::machine::profile::{pick_loader_bench, LoaderSource};

/// Arguments of `stoker plan`. Precedence: --config TOML < --deepspeed JSON < flags.
#[derive(clap::Args)]
pub struct PlanArgs {
    /// A training config (`stoker train`'s, with its hardware in `[plan.hardware]` or given
    /// by flags) or a plan file with [model], [hardware], [training] tables (docs/plan.md).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Existing DeepSpeed ds_config.json: batch keys, ZeRO stage, offload, fp16/bf16.
    #[arg(long, value_name = "FILE")]
    deepspeed: Option<PathBuf>,
    /// `stoker bench loader --json` result, to pick num_workers / prefetch_factor.
    #[arg(long, value_name = "FILE")]
    loader_bench: Option<PathBuf>,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
    /// Write the chosen settings as a training config that `stoker train` runs as is on
    /// the planned hardware (the trainer's schema; planner-only keys in its `[plan]`
    /// table); where this machine's trainer would refuse it, a note says why.
    #[arg(long, value_name = "FILE")]
    emit_config: Option<PathBuf>,
    /// With --emit-config: the run directory of the emitted config (default: the
    /// training config's, else runs/MODEL).
    #[arg(long, value_name = "DIR")]
    run_dir: Option<PathBuf>,
    /// With --emit-config: the training data of the emitted config (default: the
    /// training config's, else data/shakespeare/shakespeare.bin).
    #[arg(long, value_name = "PATH")]
    train_data: Option<PathBuf>,
    /// Alone: measure this machine (GEMM rate per dtype, memory and all-reduce bandwidth,
    /// the loader on a synthetic token shard, the training step of GPTs of several widths)
    /// into its profile ($STOKER_PROFILE, else
    /// ~/.config/stoker/profile.toml), which every later plan of a training config and every
    /// run's forecast on this machine use. With --config: measure the config's own step
    /// and loader too, plan with the figures, keep the step in the profile, and with
    /// --emit-config keep the figures in the emitted [plan].
    #[arg(long)]
    calibrate: bool,
    /// With --calibrate alone: the widths (d_model) of the GPTs whose training steps the
    /// machine's profile measures; plans interpolate between them [default: 64,128,256,512].
    #[arg(long, requires = "calibrate", value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=65536))]
    probe_widths: Vec<u64>,
    /// With --calibrate: ranks that run the step at once on this machine, each on its share
    /// of the cores (default: the devices per node); more where several planned nodes share
    /// this machine, as scripts/cluster.sh's network namespaces do.
    #[arg(long, requires = "calibrate", value_parser = clap::value_parser!(u64).range(1..=4096))]
    calibrate_ranks_at_once: Option<u64>,
    /// List model and hardware presets and exit.
    #[arg(long)]
    list_presets: bool,

    /// Model preset (gpt2-124m, gpt2-1.5b, llama-7b, llama-13b, llama-70b, stoker-gpt, t5-3b).
    #[arg(long, help_heading = "Model")]
    model: Option<String>,
    /// Parameter count (7.5e9, 7.5B, 124M); alone it plans model states only.
    #[arg(long, help_heading = "Model", allow_hyphen_values = true)]
    params: Option<String>,
    /// Architecture family: gpt2 or llama.
    #[arg(long, help_heading = "Model")]
    family: Option<String>,
    /// Transformer blocks.
    #[arg(long, help_heading = "Model", allow_negative_numbers = true)]
    layers: Option<i64>,
    /// Model width.
    #[arg(long, help_heading = "Model", allow_negative_numbers = true)]
    hidden: Option<i64>,
    /// Attention heads.
    #[arg(long, help_heading = "Model", allow_negative_numbers = true)]
    heads: Option<i64>,
    /// Key/value heads (grouped-query attention).
    #[arg(long, help_heading = "Model", allow_negative_numbers = true)]
    kv_heads: Option<i64>,
    /// MLP inner width (default: 4 x hidden for GPT-2; Llama's 2/3 of that rounded up to 256).
    #[arg(long, help_heading = "Model", allow_negative_numbers = true)]
    ffn_hidden: Option<i64>,
    /// Vocabulary size.
    #[arg(long, help_heading = "Model", allow_negative_numbers = true)]
    vocab: Option<i64>,
    /// Architecture context length (learned position table).
    #[arg(long, help_heading = "Model", allow_negative_numbers = true)]
    context: Option<i64>,

    /// Hardware preset (a100-80gb, h100-80gb, h200-141gb, cpu).
    #[arg(long, help_heading = "Hardware")]
    hardware: Option<String>,
    /// Nodes.
    #[arg(long, help_heading = "Hardware", allow_negative_numbers = true)]
    nodes: Option<i64>,
    /// Devices per node.
    #[arg(long, help_heading = "Hardware", allow_negative_numbers = true)]
    devices_per_node: Option<i64>,
    /// Memory per device, GiB.
    #[arg(long, help_heading = "Hardware", allow_negative_numbers = true)]
    memory_gib: Option<f64>,
    /// Host memory per node, GiB.
    #[arg(long, help_heading = "Hardware", allow_negative_numbers = true)]
    host_memory_gib: Option<f64>,
    /// Host CPU cores per node.
    #[arg(long, help_heading = "Hardware", allow_negative_numbers = true)]
    host_cores: Option<i64>,
    /// Peak dense TFLOP/s for a dtype, e.g. bf16=989 (repeatable).
    #[arg(long, help_heading = "Hardware", value_name = "DTYPE=TFLOPS")]
    peak_tflops: Vec<String>,
    /// Intra-node ring bus bandwidth, GB/s.
    #[arg(long, help_heading = "Hardware", allow_negative_numbers = true)]
    intra_node_gbyte_s: Option<f64>,
    /// Inter-node bandwidth per node, Gbit/s (e.g. 10 for a 10 Gbps network).
    #[arg(long, help_heading = "Hardware", allow_negative_numbers = true)]
    inter_node_gbit_s: Option<f64>,
    /// What a CPU node's cores push through its network stack, Gbit/s (TCP: CPU-bound;
    /// the part of ZeRO-3's collectives that cannot hide behind compute).
    #[arg(long, help_heading = "Hardware", allow_negative_numbers = true)]
    host_net_gbit_s: Option<f64>,
    /// Host<->device (PCIe) bandwidth per device, GB/s.
    #[arg(long, help_heading = "Hardware", allow_negative_numbers = true)]
    host_link_gbyte_s: Option<f64>,
    /// Host memory bandwidth per node, GB/s.
    #[arg(long, help_heading = "Hardware", allow_negative_numbers = true)]
    host_mem_gbyte_s: Option<f64>,
    /// One device's memory bandwidth (a GPU's HBM), GB/s: the resident step's forecast.
    #[arg(long, help_heading = "Hardware", allow_negative_numbers = true)]
    device_mem_gbyte_s: Option<f64>,

    /// Sequences per optimizer step over all devices.
    #[arg(long, help_heading = "Training", allow_negative_numbers = true)]
    global_batch: Option<i64>,
    /// Tokens per sequence.
    #[arg(long, help_heading = "Training", allow_negative_numbers = true)]
    seq_len: Option<i64>,
    /// Pin the micro-batch per device.
    #[arg(long, help_heading = "Training", allow_negative_numbers = true)]
    micro_batch: Option<i64>,
    /// Pin the accumulation steps.
    #[arg(long, help_heading = "Training", allow_negative_numbers = true)]
    accumulation_steps: Option<i64>,
    /// fp32, fp16, bf16, bf16-pure or fp8; or auto: chosen for the hardware (decision
    /// (b)), over a training config's own `precision` (default: the config's, else auto).
    #[arg(long, help_heading = "Training")]
    precision: Option<String>,
    /// adam or sgd.
    #[arg(long, help_heading = "Training")]
    optimizer: Option<String>,
    /// Full activation checkpointing (--activation-checkpointing[=true|false]).
    #[arg(long, help_heading = "Training", num_args = 0..=1, default_missing_value = "true")]
    activation_checkpointing: Option<bool>,
    /// Fused attention without the s x s matrix (default true).
    #[arg(long, help_heading = "Training", num_args = 0..=1, default_missing_value = "true")]
    flash_attention: Option<bool>,
    /// Assumed model FLOP utilization, 0..1.
    #[arg(long, help_heading = "Training", allow_negative_numbers = true)]
    mfu: Option<f64>,
    /// Fragmentation allowance, fraction (default 0.05).
    #[arg(long, help_heading = "Training", allow_negative_numbers = true)]
    fragmentation: Option<f64>,
    /// Safety margin, fraction of capacity (default 0.10).
    #[arg(long, help_heading = "Training", allow_negative_numbers = true)]
    safety_margin: Option<f64>,
    /// Gradient bucket, MiB (default 25, as PyTorch's bucket_cap_mb).
    #[arg(long, help_heading = "Training", allow_negative_numbers = true)]
    bucket_mb: Option<f64>,
    /// stoker (ZeRO paper's 16 bytes/param), deepspeed (2P + 18P/G) or deepspeed-legacy (4P + 16P/G).
    #[arg(long, help_heading = "Training")]
    accounting: Option<String>,
    /// Check a specific strategy too: ddp, zero1, zero2, zero3.
    #[arg(long, help_heading = "Training")]
    strategy: Option<String>,
    /// With --strategy: optimizer offloaded to host memory.
    #[arg(long, help_heading = "Training", num_args = 0..=1, default_missing_value = "true")]
    offload_optimizer: Option<bool>,
    /// dtype of the gradient collectives: fp32, bf16, fp16 (default: the precision's).
    #[arg(long, help_heading = "Training")]
    reduce_dtype: Option<String>,
    /// dtype of the parameter all-gathers (default: the precision's weights).
    #[arg(long, help_heading = "Training")]
    gather_dtype: Option<String>,
    /// With --strategy zero3: parameters offloaded too.
    #[arg(long, help_heading = "Training", num_args = 0..=1, default_missing_value = "true")]
    offload_params: Option<bool>,
}

/// The CPU ranks a calibration plans on this host: `--devices-per-node`, else the config's
/// `[plan.hardware] devices_per_node`, else its `batch.world_size` (one host), else 1.
fn ranks_per_host(cfg: &stoker_train::config::TrainConfig, flag: Option<i64>) -> usize {
    let configured = cfg.plan.as_ref().and_then(|p| p.hardware.devices_per_node);
    flag.or(configured)
        .and_then(|n| usize::try_from(n).ok())
        .or(cfg.batch.world_size)
        .unwrap_or(1)
        .max(1)
}

fn peaks(items: &[String]) -> anyhow::Result<Option<BTreeMap<String, f64>>> {
    if items.is_empty() {
        return Ok(None);
    }
    let mut out = BTreeMap::new();
    for item in items {
        let (k, v) = item.split_once('=').with_context(|| {
            format!("--peak-tflops {item:?}: expected DTYPE=TFLOPS, e.g. bf16=989")
        })?;
        let v: f64 = v
            .trim()
            .parse()
            .with_context(|| format!("--peak-tflops {item:?}: {v:?} is not a number"))?;
        out.insert(k.trim().to_string(), v);
    }
    Ok(Some(out))
}

impl PlanArgs {
    /// `--precision auto`: decision (b) picks, whatever a config or plan file says.
    fn auto_precision(&self) -> bool {
        self.precision
            .as_deref()
            .is_some_and(|p| p.eq_ignore_ascii_case("auto"))
    }

    fn to_input(&self) -> anyhow::Result<PlanInput> {
        Ok(PlanInput {
            model: ModelInput {
                preset: self.model.clone(),
                params: self.params.clone().map(Count::Text),
                family: self.family.clone(),
                layers: self.layers,
                hidden: self.hidden,
                heads: self.heads,
                kv_heads: self.kv_heads,
                ffn_hidden: self.ffn_hidden,
                vocab: self.vocab,
                context: self.context,
                tied_embeddings: None,
            },
            hardware: HardwareInput {
                preset: self.hardware.clone(),
                nodes: self.nodes,
                devices_per_node: self.devices_per_node,
                memory_gib: self.memory_gib,
                host_memory_gib: self.host_memory_gib,
                host_cores: self.host_cores,
                peak_tflops: peaks(&self.peak_tflops)?,
                // What this machine emulates comes from its profile (or the `cpu`
                // preset's plan of it), not a flag.
                emulated: None,
                intra_node_gbyte_s: self.intra_node_gbyte_s,
                inter_node_gbit_s: self.inter_node_gbit_s,
                host_net_gbit_s: self.host_net_gbit_s,
                host_link_gbyte_s: self.host_link_gbyte_s,
                host_mem_gbyte_s: self.host_mem_gbyte_s,
                device_mem_gbyte_s: self.device_mem_gbyte_s,
            },
            training: TrainingInput {
                global_batch: self.global_batch,
                seq_len: self.seq_len,
                micro_batch: self.micro_batch,
                accumulation_steps: self.accumulation_steps,
                // `auto` goes on as it is: the planner reads it as no request, over a
                // file's or a training config's precision (`Precision::requested`).
                precision: self.precision.clone(),
                optimizer: self.optimizer.clone(),
                activation_checkpointing: self.activation_checkpointing,
                // Set by a training config's kernels (`--config`), not a flag.
                zero3_checkpoints_units: None,
                flash_attention: self.flash_attention,
                mfu: self.mfu,
                // Set by a training config's kernels (`--config`), not a flag.
                forecast_mfu: None,
                // Set by a training config's kernels (`--config`), not a flag.
                activation_passes: None,
                fragmentation: self.fragmentation,
                safety_margin: self.safety_margin,
                bucket_mb: self.bucket_mb,
                accounting: self.accounting.clone(),
                strategy: self.strategy.clone(),
                offload_optimizer: self.offload_optimizer,
                offload_params: self.offload_params,
                reduce_dtype: self.reduce_dtype.clone(),
                gather_dtype: self.gather_dtype.clone(),
            },
        })
    }
}

/// `stoker plan --params N` (or a plan file with `[model] params` alone): the model states
/// of N parameters per strategy and world size, from `input`'s count, precision,
/// optimizer, accounting and device counts.
fn print_states_only(input: &PlanInput, count: &Count) -> anyhow::Result<()> {
    let params = count.resolve("model.params")?;
    let t = &input.training;
    let precision = Precision::requested("training.precision", t.precision.as_deref())?
        .unwrap_or(Precision::Bf16);
    let optimizer = Optimizer::from_key(t.optimizer.as_deref())?;
    let worlds: Vec<u64> = match (input.hardware.nodes, input.hardware.devices_per_node) {
        (None, None) => vec![1, 8, 64],
        (n, d) => {
            let n = n.unwrap_or(1);
            let d = d.unwrap_or(1);
            anyhow::ensure!(
                n > 0 && d > 0 && n <= 1_000_000 && d <= 1_000_000,
                "hardware.nodes {n} x hardware.devices_per_node {d}: expected positive \
                 counts up to 10^6"
            );
            vec![(n * d) as u64]
        }
    };
    let accounting = Accounting::from_key(t.accounting.as_deref())?;
    print!(
        "{}",
        stoker_plan::states_only::table(params, precision, optimizer, &worlds, accounting)
    );
    Ok(())
}

/// Runs `stoker plan`.
pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    if args.list_presets {
        println!("models:");
        for (name, what) in stoker_plan::model::MODEL_PRESETS {
            println!("  {name:<12} {what}");
        }
        println!("hardware:");
        for (name, what) in stoker_plan::hardware::HARDWARE_PRESETS {
            println!("  {name:<12} {what}");
        }
        return Ok(());
    }
    if args.calibrate && args.config.is_none() {
        let widths: Vec<usize> = match args.probe_widths.is_empty() {
            true => stoker_train::machine::PROBE_WIDTHS.to_vec(),
            false => args.probe_widths.iter().map(|&w| w as usize).collect(),
        };
        return calibrate_machine(&widths, args.json);
    }
    anyhow::ensure!(
        args.probe_widths.is_empty(),
        "--probe-widths: the widths of a machine calibration (`stoker plan --calibrate` \
         without --config); a config's calibration times the config's own step"
    );
    let cli = args.to_input()?;
    // With --json stdout carries the plan alone.
    let say = |text: &str| match args.json {
        true => eprint!("{text}"),
        false => print!("{text}"),
    };
    let ds = args
        .deepspeed
        .as_deref()
        .map(DsConfig::from_file)
        .transpose()?;
    if let (true, Some(p)) = (args.auto_precision(), ds.as_ref().and_then(|d| d.precision)) {
        anyhow::bail!(
            "--precision auto: the DeepSpeed config enables {p}, which would set the \
             precision over the choice; give one or the other"
        );
    }
    let Inputs {
        file,
        base,
        calibrated_loader,
        profile_loader,
        emit_inputs,
    } = plan_inputs(&args, &cli, &say)?;
    anyhow::ensure!(
        base.is_some() || !args.calibrate,
        "--calibrate times the training step of a training config (give one with --config), \
         or alone measures this machine into its profile"
    );
    // `--params` alone (`--help` promises it), or a plan file with `[model] params` alone:
    // model states only. A training config, a DeepSpeed file, a loader benchmark, JSON or
    // an emitted config each ask for the full plan.
    let full = base.is_some()
        || args.deepspeed.is_some()
        || args.loader_bench.is_some()
        || args.emit_config.is_some()
        || args.json;
    if !full {
        let mut merged = file.clone();
        merged.overlay(&cli);
        if let Some(count) = merged.states_only_count() {
            return print_states_only(&merged, count);
        }
    }
    let file_bench = args
        .loader_bench
        .as_deref()
        .map(LoaderBench::from_file)
        .transpose()?;
    let bench =
        pick_loader_bench(file_bench, calibrated_loader, profile_loader).map(|(b, source)| {
            if source == LoaderSource::Profile {
                let rates: Vec<String> = b
                    .points
                    .iter()
                    .map(|p| format!("{} workers {:.0}", p.num_workers, p.samples_per_s))
                    .collect();
                say(&format!(
                    "loader: {}: {} samples/s\n",
                    b.dataset.as_deref().unwrap_or("the profile's"),
                    rates.join(", ")
                ));
            }
            b
        });
    // An error in the merged inputs names the files they came from (later ones win).
    let files: Vec<String> = [&args.config, &args.deepspeed]
        .into_iter()
        .flatten()
        .map(|p| p.display().to_string())
        .collect();
    let resolved = stoker_plan::resolve::resolve(&file, ds.as_ref(), &cli);
    let resolved = if files.is_empty() {
        resolved?
    } else {
        resolved.with_context(|| format!("plan inputs {} < flags", files.join(" < ")))?
    };
    let plan = stoker_plan::plan(resolved, bench.as_ref());
    if args.json {
        println!("{}", plan.to_json());
    } else {
        print!("{}", plan.to_text());
        // A config on the resident loop: its memory on the step's backend, from the
        // sizes its buffers are made with, and on an accelerator its step's forecast
        // (which the rows' compute time already is, where no MFU is given).
        if let Some(cfg) = &base {
            let hw = &plan.inputs.hardware;
            let world = hw.world_size() as usize;
            let device = Some((hw.name.as_str(), hw.device_capacity()));
            if let Some(line) = stoker_train::planned::resident_plan_line(cfg, world, device)? {
                println!("{line}");
            }
            if let Some(line) = stoker_train::planned::resident_forecast_line(cfg, hw)? {
                println!("{line}");
            }
        }
    }
    // What `stoker train` warns of this config on this machine, the plan says too (it may
    // plan on a preset whose CPU has the bf16 instructions this one lacks).
    if let Some(warning) = base.as_ref().and_then(stoker_train::run::slow_precision) {
        say(&format!("warning: {warning}\n"));
    }
    if let Some(path) = &args.emit_config {
        let mut planned_with = match emit_inputs {
            Some(inputs) => inputs?,
            None => file.clone(),
        };
        planned_with.overlay(&cli);
        let runs_here = emit(
            &args,
            &plan,
            &planned_with,
            base.as_ref(),
            ds.as_ref(),
            path,
        )?;
        // Not "runs it as is" beside the note that this machine refuses it.
        match (args.json, runs_here) {
            (true, _) => {}
            (false, true) => println!("wrote {} (stoker train runs it as is)", path.display()),
            (false, false) => println!(
                "wrote {} (stoker train on this machine refuses it, above)",
                path.display()
            ),
        }
    }
    Ok(())
}

/// What a plan is made from: the planner's input (a training config as it stands, on
/// this machine's profile where it applies, or with `--calibrate` its own measured step;
/// a plan file as the planner's own input), the training config itself, the loader
/// benchmarks of a calibration and of the profile, and what an emitted config keeps as
/// its `[plan]` (the inputs less the profile's figures: runs of the file read the profile
/// as it is then).
struct Inputs {
    file: PlanInput,
    base: Option<stoker_train::config::TrainConfig>,
    calibrated_loader: Option<LoaderBench>,
    profile_loader: Option<LoaderBench>,
    emit_inputs: Option<stoker_train::Result<PlanInput>>,
}

/// The [`Inputs`] of `args` with the command line's `cli`; `say` prints what the
/// calibration and the profile contribute.
fn plan_inputs(args: &PlanArgs, cli: &PlanInput, say: &dyn Fn(&str)) -> anyhow::Result<Inputs> {
    let mut emit_inputs = None;
    let mut profile_loader = None;
    let (file, base, calibrated_loader) = match &args.config {
        Some(p) if is_training_config(p)? => {
            let mut cfg = stoker_train::config::TrainConfig::load(p)?;
            let mut loader = None;
            let ranks = ranks_per_host(&cfg, args.devices_per_node);
            if args.auto_precision() {
                let choice = auto_precision(&cfg, cli, ranks)
                    .with_context(|| format!("choosing the precision of {}", p.display()))?;
                let said = cfg.precision.name();
                cfg.precision = stoker_train::planned::train_precision(choice.precision)?;
                say(&format!(
                    "--precision auto: planned in {} (the config says {said}): decision (b) \
                     below\n",
                    cfg.precision.name()
                ));
                if !cfg.precision.needs_loss_scaling() {
                    // fp16's scaler settings, which another precision refuses.
                    cfg.loss_scale = None;
                }
                cfg.validate().with_context(|| {
                    format!(
                        "--precision auto chose {} for {} (the config says {said}), which \
                         the config refuses: give its precision instead",
                        cfg.precision.name(),
                        p.display()
                    )
                })?;
            }
            let input = if args.calibrate {
                // This machine's figures, not another device's with them laid over.
                let named = cli
                    .hardware
                    .preset
                    .clone()
                    .or_else(|| cfg.plan.as_ref().and_then(|s| s.hardware.preset.clone()));
                if let Some(p) = named.filter(|p| !stoker_plan::hardware::is_cpu_preset(p)) {
                    anyhow::bail!(
                        "--calibrate measures this machine, and the plan names the `{p}` \
                         preset: give one or the other"
                    );
                }
                let at_once = args.calibrate_ranks_at_once.map_or(ranks, |n| n as usize);
                crate::candle_threads::share_cores_with_candle(
                    stoker_train::machine::rank_threads(&cfg, at_once),
                );
                let c = stoker_train::machine::calibrate(&cfg, ranks, at_once)?;
                say(&c.to_text());
                say(&record_in_profile(&cfg, &c, p)?);
                loader = c.loader_bench();
                stoker_train::machine::calibrated_input(&cfg, &c, cli)
            } else {
                let (planned, line, loader, on_preset) = on_this_machine(&cfg, cli, ranks)?;
                if let Some(line) = line {
                    say(&format!("{line}\n"));
                }
                profile_loader = loader;
                if on_preset {
                    say(
                        "no machine profile and no [plan.hardware]: planned on the `cpu` \
                         preset, as a run's forecast is (`stoker plan --calibrate` measures \
                         this machine into its profile)\n",
                    );
                }
                if planned != cfg {
                    // The profile's preset, without its figures.
                    let mut bare = cfg.clone();
                    let section = bare.plan.get_or_insert_with(Default::default);
                    section.hardware.preset.get_or_insert_with(|| "cpu".into());
                    emit_inputs = Some(stoker_train::planned::plan_input(&bare, cli));
                }
                stoker_train::planned::plan_input(&planned, cli)
            }
            .with_context(|| format!("planning the training config {}", p.display()))?;
            (input, Some(cfg), loader)
        }
        Some(p) => (PlanInput::from_toml_file(p)?, None, None),
        None => (PlanInput::default(), None, None),
    };
    Ok(Inputs {
        file,
        base,
        calibrated_loader,
        profile_loader,
        emit_inputs,
    })
}

/// `stoker plan --calibrate` alone: measures this machine (its figures and the probe
/// GPTs' steps) into its profile, which later plans of training configs use.
fn calibrate_machine(widths: &[usize], json: bool) -> anyhow::Result<()> {
    let path = crate::machine_profile::path().with_context(|| {
        format!(
            "{}=off: there is no profile to write (name a file in it)",
            crate::machine_profile::PROFILE_ENV
        )
    })?;
    let threads = rayon::current_num_threads();
    let say = |text: String| match json {
        true => eprintln!("{text}"),
        false => println!("{text}"),
    };
    say(format!(
        "calibrating this machine ({threads} threads): GEMM rates, memory and all-reduce \
         bandwidth, then the training step of GPTs and Llamas {widths:?} wide, 2 blocks, \
         context 128, micro-batch {:?}",
        stoker_train::machine::PROBE_MICRO_BATCHES
    ));
    let mut profile = stoker_train::machine::probe_machine(threads, widths, &path, |p| {
        say(format!(
            "  {:<5} {:>4} {:<6} d_model {:>4}, micro-batch {:>2}: {:>8.1} ms, MFU {:.3} ({} thread(s) x {} rank(s) at once)",
            p.at.model,
            p.at.precision,
            p.at.path,
            p.at.d_model,
            p.at.micro_batch,
            1e3 * p.step_s,
            p.mfu,
            p.at.threads_per_rank,
            p.at.ranks_at_once
        ))
    })?;
    say(profile.figures.to_text().trim_end().to_string());
    // The steps of configs calibrated on this machine stay, at the new GEMM rates.
    match crate::machine_profile::this_machines(profile.figures.cores) {
        Ok(Some(old)) => {
            let kept = profile.keep_config_steps(&old);
            if kept > 0 {
                say(format!(
                    "kept {kept} step(s) of configs calibrated on this machine, their MFUs at \
                     the new GEMM rates"
                ));
            }
        }
        Ok(None) => {}
        Err(why) => say(format!("replacing the profile there: {why}")),
    }
    profile.save()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&profile)?);
    }
    say(format!(
        "wrote {} ({} steps): later plans of training configs on this machine use it \
         (`stoker plan --config`, every `stoker train`'s forecast)",
        path.display(),
        profile.steps.len()
    ));
    Ok(())
}

/// Keeps a config's calibrated step in this machine's profile, moved to the profile's
/// GEMM rates; where there is no profile of this machine (none, another machine's, or one
/// that does not read), a new one starts with the calibration's figures, and the line
/// says what it replaced. Returns the line that says so.
fn record_in_profile(
    cfg: &stoker_train::config::TrainConfig,
    c: &stoker_train::machine::Calibration,
    config_path: &std::path::Path,
) -> anyhow::Result<String> {
    let Some(path) = crate::machine_profile::path() else {
        return Ok(String::new());
    };
    let Some(point) = c.step_point(cfg, &config_path.display().to_string()) else {
        return Ok(String::new());
    };
    let (old, replaced) = match crate::machine_profile::this_machines(c.machine.cores) {
        Ok(old) => (old, String::new()),
        Err(why) => (None, format!(" (replacing the one there: {why})")),
    };
    let mut profile = old.unwrap_or_else(|| {
        stoker_train::machine::profile::MachineProfile::new(c.machine.clone(), &path)
    });
    profile.record(point.moved(&c.machine, &profile.figures));
    profile.save()?;
    Ok(format!(
        "  recorded this step in this machine's profile {} ({} steps){replaced}\n",
        path.display(),
        profile.steps.len()
    ))
}

/// `cfg` with what this machine's plan adds: its profile's figures, or with no profile
/// and no hardware anywhere (a CPU config) the `cpu` preset, as its run's forecast plans
/// it; the `cpu` preset, however named, marked with what this CPU emulates. Also the
/// profile's line and loader benchmark, and whether the default preset was taken.
fn on_this_machine(
    cfg: &stoker_train::config::TrainConfig,
    cli: &PlanInput,
    ranks: usize,
) -> anyhow::Result<(
    stoker_train::config::TrainConfig,
    Option<String>,
    Option<LoaderBench>,
    bool,
)> {
    let mut planned = cfg.clone();
    let (line, loader) = apply_profile(&mut planned, cli, ranks)?;
    let bare = |h: &HardwareInput| *h == HardwareInput::default();
    let unset = planned.plan.as_ref().is_none_or(|s| bare(&s.hardware));
    let on_preset = planned == *cfg && unset && bare(&cli.hardware) && cfg.device == "cpu";
    if on_preset {
        let section = planned.plan.get_or_insert_with(Default::default);
        section.hardware.preset = Some("cpu".into());
    }
    // The `cpu` preset planning a CPU config is this machine's plan (as its run's forecast
    // is): its bf16 is this CPU's, emulated where it lacks the instructions, whether the
    // preset came from the profile, the config's [plan], the command line or the default
    // (before: only the default, so the config a plan emitted planned bf16 again).
    let section_hw = planned.plan.as_ref().map(|s| &s.hardware);
    let preset = cli
        .hardware
        .preset
        .clone()
        .or(section_hw.and_then(|h| h.preset.clone()));
    let given = cli.hardware.emulated.is_some() || section_hw.is_some_and(|h| h.emulated.is_some());
    let cpu = preset
        .as_deref()
        .is_some_and(stoker_plan::hardware::is_cpu_preset);
    if cfg.device == "cpu" && cpu && !given {
        let section = planned.plan.get_or_insert_with(Default::default);
        // The command line's preset laid on the section's (whose figures go where it names
        // another device), so that the command line's overlay keeps the mark.
        section.hardware.overlay(&HardwareInput {
            preset,
            ..Default::default()
        });
        section.hardware.emulated = stoker_train::machine::emulated_dtypes();
    }
    Ok((planned, line, loader, on_preset))
}

/// Decision (b) for `cfg` on the hardware it is planned on (`--precision auto`): the
/// precision the planner picks with none requested, and why.
fn auto_precision(
    cfg: &stoker_train::config::TrainConfig,
    cli: &PlanInput,
    ranks: usize,
) -> anyhow::Result<stoker_plan::precision::PrecisionChoice> {
    use stoker_train::precision::Precision;
    // The hardware is found at the config's precision, or where a machine profile has
    // no step in that one, at one it measured: the choice needs the device, not a step.
    let mut failed = None;
    for precision in [cfg.precision, Precision::Fp32, Precision::Bf16] {
        let mut probe = cfg.clone();
        probe.precision = precision;
        let (planned, ..) = on_this_machine(&probe, cli, ranks)?;
        let mut hardware = planned.plan.map(|s| s.hardware).unwrap_or_default();
        hardware.overlay(&cli.hardware);
        match stoker_plan::resolve::resolve_hardware(&hardware) {
            Ok(hw) => return Ok(stoker_plan::precision::choose(&hw, None)),
            Err(e) => failed = Some(e),
        }
    }
    Err(failed.expect("three tries").into())
}

/// Plans `cfg` on this machine's profile where it applies and the command line names no
/// other hardware or figures (which would win over part of it). Returns the line that
/// says what the plan rests on, and the profile's loader rates for the config where it
/// applied.
fn apply_profile(
    cfg: &mut stoker_train::config::TrainConfig,
    cli: &PlanInput,
    ranks: usize,
) -> anyhow::Result<(Option<String>, Option<LoaderBench>)> {
    let Some(profile) = crate::machine_profile::load()? else {
        return Ok((None, None));
    };
    let on = profile.plan_config(cfg, cli, ranks);
    Ok((Some(on.line), on.loader))
}

/// Whether `path` is a training config (it has the trainer's required `run_dir`) rather
/// than a plan file.
fn is_training_config(path: &std::path::Path) -> anyhow::Result<bool> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(match text.parse::<toml::Table>() {
        Ok(t) => t.contains_key("run_dir"),
        // Let the plan file's parser report the syntax error with line and column.
        Err(_) => false,
    })
}

/// Writes the plan's choice as a training config in the trainer's schema, then reads it
/// back with the trainer's own parser: a config `stoker train` would refuse here (an
/// accelerator's `device`) is written with a note saying why. Returns whether this
/// machine's trainer reads it.
fn emit(
    args: &PlanArgs,
    plan: &stoker_plan::Plan,
    planned_with: &PlanInput,
    base: Option<&stoker_train::config::TrainConfig>,
    ds: Option<&DsConfig>,
    path: &std::path::Path,
) -> anyhow::Result<bool> {
    use stoker_train::planned::{self, EmitPlace};
    let place = EmitPlace {
        run_dir: args
            .run_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("runs/{}", plan.inputs.model.name))),
        train_data: args
            .train_data
            .clone()
            .unwrap_or_else(|| PathBuf::from("data/shakespeare/shakespeare.bin")),
    };
    let mut cfg =
        planned::emit(plan, planned_with, base, &place).context("no training config emitted")?;
    // A DeepSpeed config's fp16 scaler, where the plan kept fp16 (emit leaves the table
    // out elsewhere).
    if let Some((d, s)) = ds.and_then(|d| d.fp16_scaler.as_ref().map(|s| (d, s))) {
        if cfg.precision.needs_loss_scaling() {
            use stoker_train::loss_scale::{DeepspeedWrapper, LossScaleConfig};
            let own = cfg.loss_scale.as_ref();
            // The wrapper DeepSpeed would run for the emitted strategy and the file's
            // optimizer (a torch or client optimizer is not fused at stage 0).
            let zero = cfg.deepspeed_wrapper() == DeepspeedWrapper::Zero;
            let unfused = !d.fused_optimizer();
            let wrapper = DeepspeedWrapper::of(zero, unfused);
            cfg.loss_scale = Some(LossScaleConfig::from_deepspeed(s, own, wrapper));
            // The scaler follows the emitted strategy; say so where the file's stage
            // would have run the other one (a fixed scale is the same under both).
            let stage = d.stage.unwrap_or(0);
            let asked = DeepspeedWrapper::of(stage > 0, unfused);
            let fixed = s.loss_scale.is_some_and(|x| x > 0.0);
            if asked != wrapper && !fixed {
                eprintln!(
                    "note: the DeepSpeed file's fp16 scaler is emitted as {} for the plan's {}, \
                     not as its stage {stage}'s {} (hysteresis and the stop at the floor follow \
                     the scaler: docs/training.md, \"fp16's loss scaler\")",
                    wrapper.scaler_name(),
                    cfg.parallel.strategy.name(),
                    asked.scaler_name()
                );
            }
        }
    }
    if let Some(d) = &args.run_dir {
        cfg.run_dir = d.clone();
    }
    if let Some(d) = &args.train_data {
        cfg.data.train = d.clone();
    }
    let summary = plan
        .choice
        .as_ref()
        .map(|c| c.summary())
        .unwrap_or_default();
    let text = planned::to_toml(&cfg, &summary)?;
    let read = stoker_train::config::TrainConfig::parse(&text, path);
    if let Err(e) = &read {
        eprintln!(
            "note: `stoker train` on this machine refuses {}: {e}",
            path.display()
        );
    }
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(read.is_ok())
}
