//! One config schema: what `stoker plan --emit-config` writes is a training config the
//! trainer's own parser accepts, that plans again to the same choice, and that trains as
//! is; the docs' example is that schema too.

mod common;

use std::path::{Path, PathBuf};

use stoker_plan::input::PlanInput;
use stoker_plan::Plan;
use stoker_train::config::{StrategyKind, TrainConfig};
use stoker_train::models::ModelConfig;
use stoker_train::planned::{
    emit, forecast, plan_input, to_toml, EmitPlace, GRAPH_ACTIVATION_PASSES,
};
use stoker_train::precision::{Kernels, Precision};
use stoker_train::run::{run, RunOptions};
use stoker_train::TrainError;

fn input(text: &str) -> PlanInput {
    PlanInput::from_toml_str("test.toml", text).unwrap()
}

fn plan_of(input: &PlanInput) -> Plan {
    let r = stoker_plan::resolve::resolve(&PlanInput::default(), None, input).unwrap();
    stoker_plan::plan(r, None)
}

fn place(dir: &Path) -> EmitPlace {
    EmitPlace {
        run_dir: dir.join("run"),
        train_data: dir.join("corpus.bin"),
    }
}

/// Emits the plan of `input` as TOML text.
fn emitted_text(input: &PlanInput, dir: &Path) -> (Plan, String) {
    let plan = plan_of(input);
    let cfg = emit(&plan, input, None, &place(dir)).unwrap();
    let text = to_toml(&cfg, &plan.choice.as_ref().unwrap().summary()).unwrap();
    (plan, text)
}

#[test]
fn three_presets_emit_configs_the_trainer_parses_and_that_plan_again_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        (
            "stoker-gpt",
            "model = { preset = \"stoker-gpt\" }\nhardware = { preset = \"cpu\" }\n\
             training = { global_batch = 16, seq_len = 128 }",
            false,
        ),
        (
            "gpt2-124m",
            "model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"cpu\" }\n\
             training = { global_batch = 8 }",
            false,
        ),
        (
            "gpt2-1.5b",
            "model = { preset = \"gpt2-1.5b\" }\nhardware = { preset = \"h100-80gb\" }",
            true,
        ),
    ];
    for (name, text, accelerator) in cases {
        let planned_with = input(text);
        let (plan, toml_text) = emitted_text(&planned_with, tmp.path());
        let choice = plan.choice.clone().unwrap();
        assert!(
            toml_text.starts_with("# stoker training config emitted by `stoker plan`"),
            "{name}"
        );
        // The trainer's parser: unknown keys are rejected, every value validated. An
        // accelerator's config names its device and candle's CUDA ops, which a CPU build
        // refuses by key; a CUDA build runs it where the plan offloads the optimizer (the
        // only placement its GPU path has) and refuses it by that key otherwise.
        let parsed = TrainConfig::parse(&toml_text, Path::new("emitted.toml"));
        let cfg = if accelerator {
            let want = match (cfg!(feature = "cuda"), choice.parallel.offload_optimizer) {
                (false, _) => Some("device"),
                (true, false) => Some("parallel.offload_optimizer"),
                (true, true) => None,
            };
            match (parsed, want) {
                (Err(TrainError::Config { key, .. }), Some(want)) => {
                    assert_eq!(key, want, "{name}")
                }
                (Ok(c), None) => assert_eq!(c.kernels, Kernels::Composed, "{name}"),
                (other, _) => panic!("{name}: expected the {want:?} error, got {other:?}"),
            }
            let on_cpu = toml_text.replace("device = \"cuda\"", "device = \"cpu\"");
            let c = TrainConfig::parse(&on_cpu, Path::new("emitted.toml")).unwrap();
            assert_eq!(
                c.kernels,
                Kernels::Composed,
                "{name}: a GPU runs candle's CUDA ops"
            );
            c
        } else {
            parsed.unwrap()
        };
        // The plan's decisions are the trainer's keys.
        assert_eq!(
            cfg.batch.micro_batch as u64, choice.data.micro_batch,
            "{name}"
        );
        assert_eq!(
            cfg.batch.accumulation_steps.map(|k| k as u64),
            Some(choice.accumulation.accumulation_steps)
        );
        assert_eq!(
            cfg.batch.world_size.map(|w| w as u64),
            Some(choice.parallel.world_size)
        );
        assert_eq!(
            cfg.batch.global_batch.map(|g| g as u64),
            Some(choice.accumulation.global_batch)
        );
        assert_eq!(cfg.data.num_workers as u64, choice.data.num_workers);
        assert_eq!(cfg.precision, Precision::Bf16, "{name}");
        let ModelConfig::Gpt(g) = &cfg.model else {
            panic!("{name}: not a GPT")
        };
        let arch = plan.inputs.model.arch.as_ref().unwrap();
        assert_eq!(
            (g.n_layer, g.d_model, g.n_head, g.vocab),
            (
                arch.layers as usize,
                arch.hidden as usize,
                arch.heads as usize,
                arch.vocab as usize
            ),
            "{name}"
        );
        assert_eq!(g.context as u64, plan.inputs.setup.seq_len, "{name}");
        let section = cfg.plan.as_ref().unwrap();
        assert_eq!(
            section.required_samples_per_s,
            Some(choice.data.required_samples_per_s)
        );
        // Planned again from the file alone, it makes the same choice with the same
        // predictions as the original plan counting the trainer's FP32 collectives.
        let again = plan_of(&plan_input(&cfg, &PlanInput::default()).unwrap());
        let c2 = again.choice.unwrap();
        let mut fp32 = planned_with.clone();
        fp32.training.reduce_dtype = Some("fp32".into());
        fp32.training.gather_dtype = Some("fp32".into());
        let choice = plan_of(&fp32).choice.unwrap();
        assert_eq!(c2.parallel, choice.parallel, "{name}");
        assert_eq!(c2.accumulation, choice.accumulation, "{name}");
        assert_eq!(c2.precision, choice.precision, "{name}");
        assert_eq!(c2.model.seq_len, choice.model.seq_len, "{name}");
        let rel = |a: f64, b: f64| ((a - b) / b).abs();
        assert!(rel(c2.predicted.peak_bytes, choice.predicted.peak_bytes) < 1e-12);
        if accelerator || cfg.direct_step() {
            assert_eq!(c2.data, choice.data, "{name}");
            assert!(
                rel(c2.predicted.step_s, choice.predicted.step_s) < 1e-12,
                "{name}: {:?} vs {:?}",
                c2.predicted,
                choice.predicted
            );
        } else {
            // A CPU without bf16 hardware runs the emitted bf16 config on candle's graph
            // (its activations through memory: a slower step), which the plan of the file
            // counts and the plan of the bare preset does not.
            eprintln!(
                "{name}: bf16 runs on candle's graph on this CPU (no AMX or AVX512-BF16): \
                 its replanned step is the graph path's"
            );
            assert!(
                c2.predicted.step_s > choice.predicted.step_s,
                "{name}: {:?} vs {:?}",
                c2.predicted,
                choice.predicted
            );
            let rate = c2.data.required_samples_per_s;
            let same = stoker_plan::emit::DataSection {
                required_samples_per_s: rate,
                ..choice.data.clone()
            };
            assert_eq!(c2.data, same, "{name}");
        }
    }
}

#[test]
fn a_config_emitted_for_this_cpu_trains_as_is_and_holds_the_planned_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    common::write_token_corpus(&tmp.path().join("corpus.bin"), 12_000);
    let planned_with = input(
        "model = { family = \"gpt2\", layers = 2, hidden = 32, heads = 4, vocab = 24, \
         context = 16 }\nhardware = { preset = \"cpu\" }\ntraining = { global_batch = 8 }",
    );
    let (plan, text) = emitted_text(&planned_with, tmp.path());
    let path = tmp.path().join("emitted.toml");
    std::fs::write(&path, &text).unwrap();
    let mut cfg = TrainConfig::load(&path).unwrap();
    assert_eq!(cfg.parallel.strategy, StrategyKind::Ddp);
    assert_eq!(cfg.train.steps, 1000);
    // As emitted, except that the test keeps the run short and its workers off.
    cfg.train.steps = 200;
    cfg.train.eval_every = 0;
    cfg.train.checkpoint_every = 0;
    let s = run(&cfg, &RunOptions::default()).unwrap();
    assert_eq!(s.steps, 200);
    assert_eq!(
        (s.dims.micro_batch as u64, s.dims.world as u64),
        (
            plan.choice.as_ref().unwrap().data.micro_batch,
            plan.choice.as_ref().unwrap().parallel.world_size
        )
    );
    // It learned: the eval loss is below the uniform guess over 24 tokens.
    let eval = s.eval.as_ref().unwrap().loss;
    assert!(eval.is_finite() && eval < (24f64).ln() - 0.5, "eval {eval}");
    // Its model states are the planned ones, counted from its buffers, and so are the
    // direct step's activations, which the forecast's peak memory adds.
    assert_eq!(s.held.model_states() as f64, s.planned.model_states());
    let f = s.forecast.as_ref().unwrap();
    match stoker_train::run::direct_activation_bytes(&cfg, &s.dims) {
        Some(acts) => {
            assert_eq!(s.activation_bytes, acts);
            assert_eq!(f.activation_bytes, acts as f64);
        }
        // bf16 on a CPU without bf16 hardware: candle's graph, whose activations the
        // forecast takes from the scratch micro-batch the run counts.
        None => assert!(f.activation_bytes > 0.0, "{f:?}"),
    }
    assert!(f.peak_bytes > s.planned.model_states() + f.activation_bytes);
    assert!(s.train_rss_bytes > 0);
}

#[test]
fn a_training_config_is_planned_as_it_stands() {
    let tmp = tempfile::tempdir().unwrap();
    let text = common::gpt_config(tmp.path(), "fp32", 10, "")
        + "\n[parallel]\nstrategy = \"zero2\"\n[plan]\nmfu = 0.3\n[plan.hardware]\npreset = \"cpu\"\ndevices_per_node = 2\n";
    let cfg = TrainConfig::parse(&text, Path::new("t.toml")).unwrap();
    let input = plan_input(&cfg, &PlanInput::default()).unwrap();
    let m = &input.model;
    assert_eq!(
        (m.layers, m.hidden, m.heads, m.vocab, m.context),
        (Some(2), Some(32), Some(4), Some(24), Some(16))
    );
    let t = &input.training;
    assert_eq!(t.precision.as_deref(), Some("fp32"));
    assert_eq!(t.strategy.as_deref(), Some("zero2"));
    assert_eq!(t.mfu, Some(0.3));
    // micro 4 x accumulation 2 x the hardware's 2 devices.
    assert_eq!(
        (t.micro_batch, t.accumulation_steps, t.global_batch),
        (Some(4), Some(2), Some(16))
    );
    let plan = plan_of(&input);
    assert!(plan
        .decision
        .warnings
        .iter()
        .any(|w| w.contains("the configuration asks for zero2")));

    // A world size the hardware does not have is an error naming the key.
    let bad = text.replace("[batch]\n", "[batch]\nworld_size = 4\n");
    let cfg = TrainConfig::parse(&bad, Path::new("t.toml")).unwrap();
    match plan_input(&cfg, &PlanInput::default()) {
        Err(TrainError::Config { key, message }) => {
            assert_eq!(key, "batch.world_size");
            assert!(message.contains("has 2 devices"), "{message}");
        }
        other => panic!("expected a batch.world_size error, got {other:?}"),
    }
}

#[test]
fn a_plan_for_shorter_sequences_trains_windows_that_long() {
    let tmp = tempfile::tempdir().unwrap();
    let planned_with = input(
        "model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"cpu\" }\n\
         training = { global_batch = 8, seq_len = 256 }",
    );
    let (_, text) = emitted_text(&planned_with, tmp.path());
    let cfg = TrainConfig::parse(&text, Path::new("emitted.toml")).unwrap();
    let ModelConfig::Gpt(g) = &cfg.model else {
        panic!("not a GPT")
    };
    assert_eq!(g.context, 256);
}

/// A Llama preset's plan emits a Llama (grouped-query heads, SwiGLU width, untied head)
/// that the trainer parses, and that plans again alike.
/// The planner's default MLP width for a Llama without `ffn_hidden` is the trainer's
/// (before: GPT's 4 x hidden, 31% more parameters at Llama-2-7B's shape).
#[test]
fn the_planner_s_default_llama_mlp_is_the_trainer_s() {
    use stoker_kernels::llama::LlamaDims;
    use stoker_plan::model::Family;
    for d in (8..=8192).step_by(8) {
        assert_eq!(
            Family::Llama.default_ffn_hidden(d as u64),
            LlamaDims::default_ffn_hidden(d) as u64,
            "d_model {d}"
        );
    }
    let plan = plan_of(&input(
        "[model]\nfamily = \"llama\"\nlayers = 32\nhidden = 4096\nheads = 32\nvocab = 32000\n\
         [hardware]\npreset = \"cpu\"\n[training]\nglobal_batch = 2\nseq_len = 64\n",
    ));
    assert_eq!(
        plan.inputs.model.params, 6_738_415_616,
        "Llama-2-7B's shape"
    );
}

#[test]
fn a_llama_plan_emits_a_llama_config() {
    let tmp = tempfile::tempdir().unwrap();
    for (preset, nodes, want) in [
        ("llama-7b", 1, (4096, 32, 32, 32, 11008, 32000, 1024)),
        ("llama-70b", 8, (8192, 80, 64, 8, 28672, 32000, 1024)),
    ] {
        let planned_with = input(&format!(
            "model = {{ preset = \"{preset}\" }}\n\
             hardware = {{ preset = \"h100-80gb\", nodes = {nodes}, devices_per_node = 8 }}\n\
             training = {{ global_batch = 64, seq_len = 1024 }}"
        ));
        let (plan, text) = emitted_text(&planned_with, tmp.path());
        // An accelerator's config names its device, which this CPU build refuses by key
        // (three_presets_... above): read it as the CPU's.
        let on_cpu = text.replace("device = \"cuda\"", "device = \"cpu\"");
        let cfg = TrainConfig::parse(&on_cpu, Path::new("emitted.toml")).unwrap();
        let ModelConfig::Llama(l) = &cfg.model else {
            panic!("{preset}: not a Llama: {text}")
        };
        let d = l.dims();
        assert_eq!(
            (
                d.d_model,
                d.n_layer,
                d.n_head,
                d.n_kv_head,
                d.ffn_hidden,
                d.vocab,
                d.context
            ),
            want,
            "{preset}"
        );
        let again =
            plan_of(&stoker_train::planned::plan_input(&cfg, &PlanInput::default()).unwrap());
        assert_eq!(
            again.choice.as_ref().map(|c| c.parallel.strategy),
            plan.choice.as_ref().map(|c| c.parallel.strategy),
            "{preset}"
        );
    }
}

#[test]
fn what_the_trainer_cannot_build_is_refused_by_key() {
    let tmp = tempfile::tempdir().unwrap();
    let refused = |text: &str| {
        let planned_with = input(text);
        let plan = plan_of(&planned_with);
        match emit(&plan, &planned_with, None, &place(tmp.path())) {
            Err(TrainError::Config { key, .. }) => key,
            other => panic!("{text}: expected a config error, got {other:?}"),
        }
    };
    assert_eq!(
        refused(
            "model = { family = \"llama\", layers = 2, hidden = 64, heads = 4, vocab = 100, \
             context = 32, tied_embeddings = true }\nhardware = { preset = \"cpu\" }\n\
             training = { global_batch = 8 }"
        ),
        "model.tied_embeddings"
    );
    assert_eq!(
        refused("model = { params = \"7.5B\" }\nhardware = { preset = \"h100-80gb\" }\ntraining = { global_batch = 64, seq_len = 1024 }"),
        "model"
    );
    assert_eq!(
        refused(
            "model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"h100-80gb\" }\n\
             training = { precision = \"bf16-pure\" }"
        ),
        "precision"
    );
    assert_eq!(
        refused(
            "model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"h100-80gb\" }\n\
             training = { activation_checkpointing = true }"
        ),
        "model.activation_checkpointing"
    );
}

#[test]
fn the_docs_example_of_an_emitted_config_is_the_trainers_schema() {
    let docs = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/plan.md"));
    let text = std::fs::read_to_string(&docs).unwrap();
    let block = text
        .split("```toml\n")
        .find(|b| b.starts_with("# stoker training config emitted by"))
        .expect("docs/plan.md shows an emitted config")
        .split("```")
        .next()
        .unwrap();
    let cfg = TrainConfig::parse(block, &docs).unwrap();
    assert_eq!(cfg.parallel.strategy, StrategyKind::Ddp);
    let b = cfg.batch;
    assert_eq!(
        b.micro_batch * b.accumulation_steps.unwrap() * b.world_size.unwrap(),
        b.global_batch.unwrap()
    );
    assert!(cfg.plan.unwrap().required_samples_per_s.unwrap() > 0.0);
}

#[test]
fn calibration_measures_this_machine_and_plans_its_own_step_back() {
    let tmp = tempfile::tempdir().unwrap();
    let text = common::gpt_config(tmp.path(), "bf16", 10, "");
    let cfg = TrainConfig::parse(&text, Path::new("t.toml")).unwrap();
    common::write_token_corpus(&tmp.path().join("corpus.bin"), 12_000);
    let c = stoker_train::machine::calibrate(&cfg, 1, 1).unwrap();
    // The loader, measured on the config's training set at its settings: one point of a
    // loader benchmark the plan can read.
    let t = c
        .loader
        .as_ref()
        .unwrap_or_else(|| panic!("{}", c.loader_note));
    assert_eq!(
        (t.num_workers, t.prefetch_factor, t.batch_size),
        (
            cfg.data.num_workers,
            cfg.data.prefetch_factor,
            cfg.batch.micro_batch
        )
    );
    let bench = c.loader_bench().unwrap();
    assert_eq!(bench.points.len(), 1);
    assert_eq!(bench.points[0].samples_per_s, t.samples_per_s);
    for (what, v) in [
        ("loader", t.samples_per_s),
        ("fp32", c.machine.fp32_tflops),
        ("bf16", c.machine.bf16_tflops),
        ("memory", c.machine.host_mem_gbyte_s),
        ("all-reduce", c.machine.allreduce_gbyte_s),
        ("step", c.step_s),
    ] {
        assert!(v.is_finite() && v > 0.0, "{what}: {v}");
    }
    assert!(c.mfu > 0.0 && c.mfu <= 1.0, "mfu {}", c.mfu);
    assert!(c.machine.cores >= 1);
    // Planned with the calibration, the config's own step takes what was measured (the
    // MFU is that ratio).
    let input = stoker_train::machine::calibrated_input(&cfg, &c, &PlanInput::default()).unwrap();
    let hw = &input.hardware;
    assert_eq!(
        hw.peak_tflops.as_ref().unwrap()["bf16"],
        c.machine.bf16_tflops
    );
    assert_eq!(hw.intra_node_gbyte_s, Some(c.machine.allreduce_gbyte_s));
    assert_eq!(input.training.mfu, Some(c.mfu));
    assert_plans_the_step_back(&input, &c);
    // Calibrated as one of 2 ranks on this host, the step runs on each rank's share of
    // the cores, and planned for 2 ranks on one host (each with half the GEMM rate) each
    // rank's compute per micro-batch is again what was measured.
    let c2 = stoker_train::machine::calibrate(&cfg, 2, 2).unwrap();
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or((c.machine.cores / 2).max(1));
    assert_eq!((c2.ranks_per_host, c2.threads_per_rank), (2, threads));
    let mut on_two = cfg.clone();
    on_two.batch.world_size = Some(2);
    let input =
        stoker_train::machine::calibrated_input(&on_two, &c2, &PlanInput::default()).unwrap();
    assert_eq!(input.hardware.devices_per_node, Some(2));
    assert_plans_the_step_back(&input, &c2);
    // Two ranks at once on this machine for a plan of one device per host (two planned
    // hosts sharing this machine, as scripts/cluster.sh's namespaces do): the MFU is at a
    // whole host's rate, and the plan gives the step timed under that contention back.
    let c3 = stoker_train::machine::calibrate(&cfg, 1, 2).unwrap();
    assert_eq!((c3.ranks_per_host, c3.ranks_at_once), (1, 2));
    assert_eq!(c3.threads_per_rank, threads);
    let input = stoker_train::machine::calibrated_input(&cfg, &c3, &PlanInput::default()).unwrap();
    assert_plans_the_step_back(&input, &c3);
    // Without its data the calibration still measures the machine and says why the
    // loader was not measured, naming the file.
    std::fs::remove_file(tmp.path().join("corpus.bin")).unwrap();
    let c = stoker_train::machine::calibrate(&cfg, 1, 1).unwrap();
    assert!(c.loader.is_none() && c.loader_bench().is_none());
    assert!(c.loader_note.contains("corpus.bin"), "{}", c.loader_note);
}

/// The calibrated plan `input` gives each rank's compute per micro-batch as `c` measured
/// the step (the MFU is that ratio), unless the MFU hit its bound of 1.
fn assert_plans_the_step_back(input: &PlanInput, c: &stoker_train::machine::Calibration) {
    let plan = plan_of(input);
    let row = plan
        .strategies
        .iter()
        .find(|r| Some(r.strategy) == plan.inputs.pinned_strategy)
        .unwrap();
    // One micro-batch per rank in the calibration; the config accumulates.
    let per_micro = row.time.compute_s / row.accumulation_steps as f64;
    if c.mfu < 1.0 {
        assert!(
            ((per_micro - c.step_s) / c.step_s).abs() < 1e-9,
            "{per_micro} vs {}",
            c.step_s
        );
    }
}

/// The plan of `cfg` at `world` ranks, and its pinned strategy's row.
fn pinned_row(cfg: &TrainConfig, world: usize) -> (Plan, stoker_plan::recommend::StrategyRow) {
    let mut cfg = cfg.clone();
    cfg.batch.world_size = Some(world);
    let text = "[hardware]\npreset = \"cpu\"\n";
    let plan = plan_of(&plan_input(&cfg, &input(text)).unwrap());
    let row = plan
        .strategies
        .iter()
        .find(|r| Some(r.strategy) == plan.inputs.pinned_strategy)
        .unwrap()
        .clone();
    (plan, row)
}

#[test]
fn candle_s_graph_path_is_planned_with_its_activation_traffic() {
    let tmp = tempfile::tempdir().unwrap();
    let direct = common::gpt_config(tmp.path(), "fp32", 10, "");
    let fused = "precision = \"fp32\"\nkernels = \"fused\"";
    let graph = direct.replacen("precision = \"fp32\"", fused, 1);
    let parse = |t: &str| TrainConfig::parse(t, Path::new("t.toml")).unwrap();
    let (d, g) = (parse(&direct), parse(&graph));
    assert!(d.direct_step() && !g.direct_step());
    // One micro-batch's activations (4 sequences of 16 tokens, fp32) by the planner's
    // formula, moved GRAPH_ACTIVATION_PASSES times at the preset's host bandwidth, twice
    // per step (2 accumulation steps); the direct step pays none of it.
    let (plan, row_d) = pinned_row(&d, 1);
    let arch = plan.inputs.model.arch.clone().unwrap();
    let acts = stoker_plan::activation::activations(&arch, 4, 16, 4.0, false, true).total;
    let host_bw = stoker_plan::hardware::preset("cpu").unwrap().host_mem_bw;
    let per_step = 2.0 * GRAPH_ACTIVATION_PASSES * acts / host_bw;
    let (_, row_g) = pinned_row(&g, 1);
    assert_eq!(row_d.time.activation_traffic_s, 0.0);
    let rel = |a: f64, b: f64| ((a - b) / b).abs();
    assert!(rel(row_g.time.activation_traffic_s, per_step) < 1e-12);
    assert!(rel(row_g.time.step_s - row_d.time.step_s, per_step) < 1e-9);
    assert_eq!(row_g.time.compute_s, row_d.time.compute_s);
    // The run's forecast is that row's step.
    let step = |c: &TrainConfig, w| forecast(c, w, w, None).unwrap().step_s.unwrap();
    assert!(rel(step(&g, 1), row_g.time.step_s) < 1e-12);
    // In bf16 the same: candle's CPU ops widen each element to f32.
    let bf16 = parse(&graph.replacen("precision = \"fp32\"", "precision = \"bf16\"", 1));
    let (_, row_bf16) = pinned_row(&bf16, 1);
    assert!(rel(row_bf16.time.activation_traffic_s, per_step) < 1e-12);
    // The path is the precision planned: `--precision fp16` puts an fp32 direct-step
    // config on candle's graph.
    let fp16 = input("[hardware]\npreset = \"cpu\"\n[training]\nprecision = \"fp16\"\n");
    let t = plan_input(&d, &fp16).unwrap().training;
    assert_eq!(
        (t.activation_passes, t.zero3_checkpoints_units),
        (Some(GRAPH_ACTIVATION_PASSES), Some(true))
    );
    let cpu = input("[hardware]\npreset = \"cpu\"\n");
    let t = plan_input(&d, &cpu).unwrap().training;
    assert_eq!(
        (t.activation_passes, t.zero3_checkpoints_units),
        (None, None)
    );
    // A calibrated MFU (`[plan] mfu`, measured on the config's own step, kernels and
    // all) covers the graph's traffic already: nothing is added.
    let mfu = "\n[plan]\nmfu = 0.3\n";
    let (gm, dm) = (
        parse(&(graph.clone() + mfu)),
        parse(&(direct.clone() + mfu)),
    );
    assert_eq!(step(&gm, 1), step(&dm, 1));
    // ZeRO-3 over 2 ranks on the graph runs each unit's forward again in the backward:
    // 4/3 of the compute and of the traffic; its direct step recomputes nothing.
    let zero3 = "\n[parallel]\nstrategy = \"zero3\"\n";
    let (g3, d3) = (parse(&(graph + zero3)), parse(&(direct + zero3)));
    let ((_, r_g3), (_, r_d3)) = (pinned_row(&g3, 2), pinned_row(&d3, 2));
    assert!(rel(r_g3.time.compute_s, 4.0 / 3.0 * r_d3.time.compute_s) < 1e-12);
    assert!(rel(r_g3.time.activation_traffic_s, 4.0 / 3.0 * per_step) < 1e-12);
    assert_eq!(r_d3.time.activation_traffic_s, 0.0);
    // On one rank every strategy is the one-rank trainer: no recomputation.
    let (_, r_g3_one) = pinned_row(&g3, 1);
    assert_eq!(r_g3_one.time.compute_s, row_g.time.compute_s);
    // Only the ZeRO-3 row recomputes: the same plan's DDP row is the direct step's
    // compute, and its activations are all stored.
    let (plan3, _) = pinned_row(&g3, 2);
    let (plan_d, _) = pinned_row(&d, 2);
    let row = |p: &Plan, label: &str| {
        p.strategies
            .iter()
            .find(|r| r.label == label)
            .unwrap()
            .clone()
    };
    let (ddp_g, ddp_d) = (row(&plan3, "ddp"), row(&plan_d, "ddp"));
    assert_eq!(ddp_g.time.compute_s, ddp_d.time.compute_s);
    assert_eq!(
        ddp_g.memory.device.activations,
        ddp_d.memory.device.activations
    );
    assert!(row(&plan3, "zero3").memory.device.activations < ddp_g.memory.device.activations);
    // The ranks are the hardware's where the config does not say (`--devices-per-node 2`).
    let two = input("[hardware]\npreset = \"cpu\"\ndevices_per_node = 2\n");
    assert_eq!(g3.batch.world_size, None);
    let plan_two = plan_of(&plan_input(&g3, &two).unwrap());
    let z3_two = row(&plan_two, "zero3");
    assert!(rel(z3_two.time.compute_s, r_g3.time.compute_s) < 1e-12);
    // An accelerator's activations are in its own memory: no host traffic.
    let h100 = input("[hardware]\npreset = \"h100-80gb\"\n");
    let plan = plan_of(&plan_input(&g, &h100).unwrap());
    assert!(plan
        .strategies
        .iter()
        .all(|r| r.time.activation_traffic_s == 0.0));
    // Where memory leaves only the graph's ZeRO-3 (its units checkpointed), the plan
    // chooses it and emits it; a plan told to recompute everywhere is still refused,
    // naming the key.
    let emit_from = |base: &TrainConfig, flags: &PlanInput| {
        let input = plan_input(base, flags).unwrap();
        emit(&plan_of(&input), &input, Some(base), &place(tmp.path()))
    };
    let others = ["ddp", "zero1", "zero2"].map(|l| row(&plan_two, l).memory.device.total);
    let least_other = others.iter().copied().fold(f64::INFINITY, f64::min);
    let d3 = &z3_two.memory.device;
    assert!(d3.total < least_other, "{} vs {least_other}", d3.total);
    let gib = (d3.total + least_other) / 2.0 / (d3.usable / d3.capacity) / (1u64 << 30) as f64;
    // A CPU's memory is the host's, shared by its two ranks.
    let gib = 2.0 * gib;
    let tight = input(&format!(
        "[hardware]\npreset = \"cpu\"\ndevices_per_node = 2\nmemory_gib = {gib}\n"
    ));
    let emitted = emit_from(&g3, &tight).unwrap();
    assert_eq!(
        (emitted.parallel.strategy, emitted.batch.world_size),
        (StrategyKind::Zero3, Some(2))
    );
    let mut recompute = two.clone();
    recompute.training.activation_checkpointing = Some(true);
    match emit_from(&g3, &recompute) {
        Err(TrainError::Config { key, .. }) => assert_eq!(key, "model.activation_checkpointing"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_run_s_forecast_plans_its_ranks_on_the_hosts_they_share() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::parse(
        &common::gpt_config(tmp.path(), "fp32", 10, ""),
        Path::new("t.toml"),
    )
    .unwrap();
    let step = |world, per_host| {
        forecast(&cfg, world, per_host, None)
            .unwrap()
            .step_s
            .unwrap()
    };
    let planned = |world, hardware: &str| {
        let mut c = cfg.clone();
        c.batch.world_size = Some(world);
        let plan = plan_of(&plan_input(&c, &input(hardware)).unwrap());
        let row = plan
            .strategies
            .iter()
            .find(|r| Some(r.strategy) == plan.inputs.pinned_strategy);
        row.unwrap().time.step_s
    };
    // Two ranks on one host share its cores; on two hosts each has a host's peak (and the
    // ring crosses the network).
    let one_host = planned(
        2,
        "[hardware]\npreset = \"cpu\"\nnodes = 1\ndevices_per_node = 2\n",
    );
    let two_hosts = planned(
        2,
        "[hardware]\npreset = \"cpu\"\nnodes = 2\ndevices_per_node = 1\n",
    );
    assert_eq!(step(2, 2), one_host);
    assert_eq!(step(2, 1), two_hosts);
    assert_ne!(one_host, two_hosts);
    // Ranks spread unevenly (2 + 1) are planned as one host.
    let three = planned(
        3,
        "[hardware]\npreset = \"cpu\"\nnodes = 1\ndevices_per_node = 3\n",
    );
    assert_eq!(step(3, 2), three);
    // A config emitted for one host (`[plan.hardware]` nodes = 1) run on two is planned
    // on the two.
    let mut emitted_for_one = cfg.clone();
    let one = input("[hardware]\npreset = \"cpu\"\nnodes = 1\ndevices_per_node = 2\n");
    emitted_for_one.plan = Some(stoker_plan::emit::PlanSection {
        hardware: one.hardware,
        ..Default::default()
    });
    let on_two = forecast(&emitted_for_one, 2, 1, None)
        .unwrap()
        .step_s
        .unwrap();
    assert_eq!(on_two, two_hosts);
    // A config emitted for one device (`devices_per_node = 1`, what `stoker plan
    // --emit-config` writes for one rank) run by 2 ranks on one host is planned as the
    // one host of 2 ranks (it used to get no planner row at all).
    let mut emitted_for_one_rank = cfg.clone();
    let single = input("[hardware]\npreset = \"cpu\"\ndevices_per_node = 1\n");
    emitted_for_one_rank.plan = Some(stoker_plan::emit::PlanSection {
        hardware: single.hardware,
        ..Default::default()
    });
    let f = forecast(&emitted_for_one_rank, 2, 2, None).unwrap();
    assert_eq!(f.no_planner_row, None);
    assert_eq!(f.step_s, Some(one_host));
    // The preset's figures alone, not this machine's (the run's end says how to measure
    // them where the step misses); an MFU in `[plan]` (a calibration's) is measured.
    assert!(!f.measured_figures);
    let mut calibrated = cfg.clone();
    calibrated.plan = Some(stoker_plan::emit::PlanSection {
        mfu: Some(0.3),
        ..Default::default()
    });
    let f = forecast(&calibrated, 1, 1, None).unwrap();
    assert!(
        f.measured_figures && f.hardware.contains("[plan]'s figures"),
        "{f:?}"
    );
}

/// A plan whose loader benchmark says 0 workers sustain the step emits a config the
/// trainer runs: a base config's `persistent_workers = true` goes with its workers (as
/// torch's DataLoader refuses persistent workers without workers).
#[test]
fn a_plan_that_picks_no_loader_workers_emits_no_persistent_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let mut base = TrainConfig::parse(
        &common::gpt_config(tmp.path(), "fp32", 10, ""),
        Path::new("t.toml"),
    )
    .unwrap();
    base.data.num_workers = 2;
    base.data.persistent_workers = true;
    let point = |workers: u64, samples_per_s: f64| stoker_plan::loader::BenchPoint {
        num_workers: workers,
        prefetch_factor: 2,
        batch_size: Some(4),
        samples_per_s,
        mb_per_s: None,
        consumer_wait_pct: None,
        peak_rss_bytes: None,
    };
    let bench = stoker_plan::loader::LoaderBench {
        dataset: None,
        sample_bytes: None,
        points: vec![point(0, 1e7), point(2, 2e7)],
    };
    let input = plan_input(&base, &input("[hardware]\npreset = \"cpu\"\n")).unwrap();
    let resolved = stoker_plan::resolve::resolve(&PlanInput::default(), None, &input).unwrap();
    let plan = stoker_plan::plan(resolved, Some(&bench));
    let cfg = emit(&plan, &input, Some(&base), &place(tmp.path())).unwrap();
    assert_eq!(
        (cfg.data.num_workers, cfg.data.persistent_workers),
        (0, false)
    );
    let text = to_toml(&cfg, "test").unwrap();
    let back = TrainConfig::parse(&text, Path::new("emitted.toml")).unwrap();
    assert_eq!(back.data.num_workers, 0);
}

/// A base config's `[loss_scale]` table goes into the emitted config where the plan keeps
/// fp16, and is left out where it picks another precision (which would refuse it): both
/// emitted configs parse.
#[test]
fn an_fp16_base_config_s_loss_scale_follows_the_planned_precision() {
    let tmp = tempfile::tempdir().unwrap();
    let table = "[loss_scale]\npreset = \"deepspeed\"\nhysteresis = 3";
    let base = TrainConfig::parse(
        &common::gpt_config(tmp.path(), "fp16", 10, table),
        Path::new("t.toml"),
    )
    .unwrap();
    for (precision, kept) in [("fp16", true), ("bf16", false), ("fp32", false)] {
        let planned = input(&format!(
            "[hardware]\npreset = \"cpu\"\n[training]\nprecision = \"{precision}\"\n"
        ));
        let input = plan_input(&base, &planned).unwrap();
        let plan = plan_of(&input);
        let cfg = emit(&plan, &input, Some(&base), &place(tmp.path())).unwrap();
        let text = to_toml(&cfg, "test").unwrap();
        let back = TrainConfig::parse(&text, Path::new("emitted.toml"))
            .unwrap_or_else(|e| panic!("{precision}: {e}\n{text}"));
        assert_eq!(back.precision.name(), precision);
        match kept {
            true => assert_eq!(back.loss_scale, base.loss_scale, "{precision}"),
            false => assert_eq!(back.loss_scale, None, "{precision}"),
        }
    }
}
