//! The planner's inputs through `stoker plan`: plan configs (TOML syntax, unknown keys and
//! presets, wrong types, zero and negative sizes, batch arithmetic that does not add up),
//! DeepSpeed `ds_config.json` files (malformed, batch keys that contradict each other or the
//! world size, impossible stages and offload devices) and `stoker bench loader --json`
//! results. Every one is a `config` error naming the file or the key; a file that does not
//! exist is `io`.

use std::path::Path;

use super::{s, Case};

const PLAN: &str = r#"[model]
preset = "gpt2-124m"
[hardware]
preset = "a100-80gb"
nodes = 1
devices_per_node = 8
[training]
global_batch = 64
seq_len = 1024
"#;

const DEEPSPEED: &str = r#"{
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "zero_optimization": {"stage": 2, "reduce_bucket_size": 50000000},
  "bf16": {"enabled": true}
}"#;

const LOADER: &str = r#"{"dataset": "x", "sample_bytes": 100, "points": [
  {"num_workers": 0, "prefetch_factor": 2, "samples_per_s": 1000.0},
  {"num_workers": 2, "prefetch_factor": 2, "samples_per_s": 1800.0}
]}"#;

fn plan_config_cases(dir: &Path, out: &mut Vec<Case>) {
    let edits: Vec<(&str, &str, &str)> = vec![
        ("nodes = 1", "nodes = 1\nsurprise = 1", "surprise"),
        ("[training]", "[trainnig]", "trainnig"),
        (
            "seq_len = 1024",
            "seq_len = 1024\nglobal_batch = 3",
            "global_batch",
        ),
        ("nodes = 1", "nodes = -2", "nodes"),
        ("nodes = 1", "nodes = 0", "nodes"),
        ("nodes = 1", "nodes = \"one\"", "nodes"),
        ("nodes = 1", "nodes = 1.5", "nodes"),
        (
            "devices_per_node = 8",
            "devices_per_node = 0",
            "devices_per_node",
        ),
        ("global_batch = 64", "global_batch = 0", "global_batch"),
        ("global_batch = 64", "global_batch = 12", "global_batch"),
        (
            "global_batch = 64",
            "global_batch = 99999999999999999999",
            "global_batch",
        ),
        ("seq_len = 1024", "seq_len = -1", "seq_len"),
        ("preset = \"gpt2-124m\"", "preset = \"gpt9\"", "gpt9"),
        ("preset = \"a100-80gb\"", "preset = \"abacus\"", "abacus"),
        ("preset = \"gpt2-124m\"", "params = \"seven\"", "params"),
        ("preset = \"gpt2-124m\"", "params = \"-7B\"", "params"),
        (
            "seq_len = 1024",
            "seq_len = 1024\nprecision = \"fp9\"",
            "precision",
        ),
        (
            "seq_len = 1024",
            "seq_len = 1024\noptimizer = \"lion\"",
            "optimizer",
        ),
        ("seq_len = 1024", "seq_len = 1024\nmfu = 1.5", "mfu"),
        ("seq_len = 1024", "seq_len = 1024\nmfu = -0.1", "mfu"),
        (
            "seq_len = 1024",
            "seq_len = 1024\nstrategy = \"zero9\"",
            "strategy",
        ),
        (
            "seq_len = 1024",
            "seq_len = 1024\naccounting = \"vibes\"",
            "accounting",
        ),
        (
            "seq_len = 1024",
            "seq_len = 1024\nmicro_batch = 0",
            "micro_batch",
        ),
        (
            "seq_len = 1024",
            "seq_len = 1024\nmicro_batch = 3",
            "micro_batch",
        ),
        (
            "[hardware]",
            "[hardware]\npeak_tflops = { bf16 = -1 }",
            "peak_tflops",
        ),
        (
            "[hardware]",
            "[hardware]\ninter_node_gbit_s = 0",
            "inter_node_gbit_s",
        ),
        ("[model]", "[model", ""),
        ("nodes = 1", "nodes = 1\nnodes = 2", "nodes"),
    ];
    let mut n = 0;
    let mut case = |what: String, text: String, key: &str| {
        n += 1;
        let p = dir.join(format!("plan{n}.toml"));
        std::fs::write(&p, text).unwrap();
        let mut names = vec![s(p.file_name().unwrap())];
        if !key.is_empty() {
            names.push(key.to_string());
        }
        out.push(Case {
            what,
            args: vec![s("plan"), s("--config"), s(&p)],
            names,
            kind: "config",
        });
    };
    for (from, to, key) in edits {
        assert!(PLAN.contains(from), "{from}");
        case(
            format!("plan config: {from:?} -> {to:?}"),
            PLAN.replacen(from, to, 1),
            key,
        );
    }
    case(
        "plan config: binary".into(),
        "\u{0}\u{1}\u{fffd}".into(),
        "",
    );
    case("plan config: a JSON file".into(), DEEPSPEED.into(), "");
    for cut in [10usize, 40, 80] {
        case(format!("plan config cut at {cut}"), PLAN[..cut].into(), "");
    }
}

fn deepspeed_cases(dir: &Path, out: &mut Vec<Case>) {
    let edits: Vec<(&str, &str)> = vec![
        ("\"train_batch_size\": 64", "\"train_batch_size\": 63"),
        ("\"train_batch_size\": 64", "\"train_batch_size\": 0"),
        ("\"train_batch_size\": 64", "\"train_batch_size\": -64"),
        ("\"train_batch_size\": 64", "\"train_batch_size\": \"many\""),
        ("\"train_batch_size\": 64", "\"train_batch_size\": 1e30"),
        (
            "\"gradient_accumulation_steps\": 2",
            "\"gradient_accumulation_steps\": 3",
        ),
        (
            "\"train_micro_batch_size_per_gpu\": 4",
            "\"train_micro_batch_size_per_gpu\": 5",
        ),
        ("\"stage\": 2", "\"stage\": 4"),
        ("\"stage\": 2", "\"stage\": -1"),
        ("\"stage\": 2", "\"stage\": \"two\""),
        (
            "\"stage\": 2,",
            "\"stage\": 2, \"offload_param\": {\"device\": \"cpu\"},",
        ),
        (
            "\"stage\": 2,",
            "\"stage\": 2, \"offload_optimizer\": {\"device\": \"tape\"},",
        ),
        (
            "\"stage\": 2,",
            "\"stage\": 0, \"offload_optimizer\": {\"device\": \"cpu\"},",
        ),
        (
            "\"reduce_bucket_size\": 50000000",
            "\"reduce_bucket_size\": 0",
        ),
        (
            "\"reduce_bucket_size\": 50000000",
            "\"reduce_bucket_size\": \"big\"",
        ),
        ("{\"stage\": 2, \"reduce_bucket_size\": 50000000}", "[2]"),
        (
            "\"bf16\": {\"enabled\": true}",
            "\"bf16\": {\"enabled\": \"yes\"}",
        ),
        (
            "\"bf16\": {\"enabled\": true}",
            "\"bf16\": {\"enabled\": true}, \"fp16\": {\"enabled\": true}",
        ),
        ("\"bf16\": {\"enabled\": true}", "\"bf16\": 3"),
        ("\"train_batch_size\": 64,", "\"train_batch_size\": 64,,"),
    ];
    let mut n = 0;
    let mut case = |what: String, text: String| {
        n += 1;
        let p = dir.join(format!("ds{n}.json"));
        std::fs::write(&p, text).unwrap();
        out.push(Case {
            what,
            args: vec![
                s("plan"),
                s("--model"),
                s("gpt2-124m"),
                s("--hardware"),
                s("a100-80gb"),
                s("--deepspeed"),
                s(&p),
            ],
            names: vec![s(p.file_name().unwrap())],
            kind: "config",
        });
    };
    for (from, to) in edits {
        assert!(DEEPSPEED.contains(from), "{from}");
        case(
            format!("DeepSpeed: {from} -> {to}"),
            DEEPSPEED.replacen(from, to, 1),
        );
    }
    for cut in [0usize, 1, 30, 100] {
        case(
            format!("DeepSpeed JSON cut at {cut}"),
            DEEPSPEED[..cut].into(),
        );
    }
    case("DeepSpeed JSON: a list".into(), "[1, 2]".into());
    case("DeepSpeed JSON: a TOML file".into(), PLAN.into());
}

fn loader_bench_cases(dir: &Path, out: &mut Vec<Case>) {
    let edits: Vec<(&str, &str)> = vec![
        ("\"samples_per_s\": 1000.0", "\"samples_per_s\": -1.0"),
        ("\"samples_per_s\": 1000.0", "\"samples_per_s\": \"fast\""),
        ("\"num_workers\": 0,", "\"num_workers\": -1,"),
        ("\"num_workers\": 0,", ""),
        ("\"points\": [", "\"points\": 7, \"x\": ["),
    ];
    let mut n = 0;
    let mut case = |what: String, text: String| {
        n += 1;
        let p = dir.join(format!("loaderbench{n}.json"));
        std::fs::write(&p, text).unwrap();
        out.push(Case {
            what,
            args: vec![
                s("plan"),
                s("--model"),
                s("gpt2-124m"),
                s("--hardware"),
                s("a100-80gb"),
                s("--global-batch"),
                s("64"),
                s("--seq-len"),
                s("1024"),
                s("--loader-bench"),
                s(&p),
            ],
            names: vec![s(p.file_name().unwrap())],
            kind: "config",
        });
    };
    for (from, to) in edits {
        assert!(LOADER.contains(from), "{from}");
        case(
            format!("loader bench: {from} -> {to}"),
            LOADER.replacen(from, to, 1),
        );
    }
    case("loader bench: no points".into(), "{\"points\": []}".into());
    case("loader bench: empty".into(), String::new());
    case("loader bench: cut".into(), LOADER[..60].into());
}

/// Plan configs, DeepSpeed configs and loader benchmarks.
pub fn cases(dir: &Path, out: &mut Vec<Case>) {
    plan_config_cases(dir, out);
    deepspeed_cases(dir, out);
    loader_bench_cases(dir, out);
    out.push(Case {
        what: "plan config that does not exist".into(),
        args: vec![s("plan"), s("--config"), s(dir.join("no-such-plan.toml"))],
        names: vec![s("no-such-plan.toml")],
        kind: "io",
    });
}
