//! Hugging Face GPT-2 interop: `hf::export` writes GPT-2's tensor names, shapes and
//! config, `hf::import` reads them back bit for bit; and, where transformers is
//! installed (`make test-hf`, or a cache from an earlier run; each of its 4.x and 5.x
//! versions), transformers' own
//! GPT2LMHeadModel loads the export and gives stoker's logits within 1e-4, and its
//! save_pretrained output imports back to the same bits.

mod common;

use std::path::Path;

use common::*;
use stoker_train::config::TrainConfig;
use stoker_train::hf;
use stoker_train::models::ModelConfig;
use stoker_train::trainer::Trainer;

fn config() -> TrainConfig {
    let text = r#"
run_dir = "/nonexistent"
seed = 3
precision = "fp32"
kernels = "direct"
[data]
train = "/nonexistent"
[model]
kind = "gpt"
vocab = 16
context = 16
d_model = 32
n_layer = 2
n_head = 4
[batch]
micro_batch = 2
[optimizer]
kind = "adamw"
lr = 3e-3
[train]
steps = 4
"#;
    TrainConfig::parse(text, Path::new("hf.toml")).unwrap()
}

/// A trainer after 4 steps (so gains, biases and embeddings all moved from their init).
fn trained() -> Trainer {
    let mut t = Trainer::new(&config()).unwrap();
    for s in 0..4 {
        t.train_step(&[token_batch(s, 2, 16, 16, &[])]).unwrap();
    }
    t
}

fn gpt(c: &TrainConfig) -> &stoker_train::models::GptConfig {
    match &c.model {
        ModelConfig::Gpt(g) => g,
        _ => unreachable!(),
    }
}

#[test]
fn export_writes_gpt2_names_shapes_and_config_and_imports_back_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config();
    let t = trained();
    let out = hf::gpt2::export(
        gpt(&c),
        t.layout(),
        t.master(),
        None,
        &tmp.path().join("hf"),
    )
    .unwrap();
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    // GPT2LMHeadModel's state dict for this size, less the tied lm_head.
    let mut want = vec![
        "transformer.wte.weight".to_string(),
        "transformer.wpe.weight".into(),
        "transformer.ln_f.weight".into(),
        "transformer.ln_f.bias".into(),
    ];
    for l in 0..2 {
        for p in [
            "ln_1.weight",
            "ln_1.bias",
            "attn.c_attn.weight",
            "attn.c_attn.bias",
            "attn.c_proj.weight",
            "attn.c_proj.bias",
            "ln_2.weight",
            "ln_2.bias",
            "mlp.c_fc.weight",
            "mlp.c_fc.bias",
            "mlp.c_proj.weight",
            "mlp.c_proj.bias",
        ] {
            want.push(format!("transformer.h.{l}.{p}"));
        }
    }
    want.sort();
    assert_eq!(names, want);
    let shape = |n: &str| st.tensor(n).unwrap().shape().to_vec();
    assert_eq!(shape("transformer.h.1.attn.c_attn.weight"), [32, 96]); // Conv1D: [in, out]
    assert_eq!(shape("transformer.h.0.mlp.c_proj.weight"), [128, 32]);
    assert_eq!(shape("transformer.wpe.weight"), [16, 32]);
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "gpt2");
    assert_eq!(cfg["activation_function"], "gelu_new");
    assert_eq!(cfg["n_embd"], 32);
    // A character vocabulary has no end-of-text token: null, not GPT-2's 50256 (which
    // transformers would warn lies outside a vocabulary of 16).
    assert!(
        cfg["bos_token_id"].is_null() && cfg["eos_token_id"].is_null(),
        "{cfg}"
    );
    let bpe = hf::gpt2::export(
        gpt(&c),
        t.layout(),
        t.master(),
        Some(50_256),
        &tmp.path().join("bpe"),
    )
    .unwrap();
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bpe.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (&cfg["bos_token_id"], &cfg["eos_token_id"]),
        (&50_256.into(), &50_256.into())
    );
    let back = hf::gpt2::import(gpt(&c), t.layout(), &out).unwrap();
    stoker_testkit::assert_bits_eq(&back, t.master(), "export then import");

    // A directory for another size is refused naming config.json and the key.
    let mut other = gpt(&c).clone();
    other.n_head = 2;
    let e = hf::gpt2::import(&other, t.layout(), &out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("config.json") && e.contains("`n_head`"), "{e}");
    // Another attention's scaling, and a weight that is not finite, are refused by name.
    let edit = |name: &str, config: &dyn Fn(&mut serde_json::Value), nan_in: Option<&str>| {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let mut cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        config(&mut cfg);
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let mut bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        if let Some(tensor) = nan_in {
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            let at = 8 + n + header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
            bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        }
        std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
        hf::gpt2::import(gpt(&c), t.layout(), &dir)
            .unwrap_err()
            .to_string()
    };
    let e = edit(
        "inverse",
        &|cfg| cfg["scale_attn_by_inverse_layer_idx"] = true.into(),
        None,
    );
    assert!(
        e.contains("config.json") && e.contains("`scale_attn_by_inverse_layer_idx` is true"),
        "{e}"
    );
    let e = edit("nan", &|_| {}, Some("transformer.ln_f.bias"));
    assert!(
        e.contains("model.safetensors")
            && e.contains("tensor `transformer.ln_f.bias`: element 0 is NaN"),
        "{e}"
    );
    // `[model] init_from` starts training from it.
    let text = toml::to_string(&c).unwrap().replace(
        "n_head = 4",
        &format!("n_head = 4\ninit_from = \"{}\"", out.display()),
    );
    let ft = TrainConfig::parse(&text, Path::new("ft.toml")).unwrap();
    let fine = Trainer::new(&ft).unwrap();
    stoker_testkit::assert_bits_eq(fine.master(), t.master(), "init_from");
}

#[test]
fn transformers_loads_the_export_with_stokers_logits_and_its_save_imports_back() {
    let test = "transformers_loads_the_export_with_stokers_logits_and_its_save_imports_back";
    let pythons = common::hf_python::hf_pythons_or_skip(test);
    for pythonpath in pythons {
        check_gpt2_with(&pythonpath);
    }
}

/// The GPT's export, loaded by the transformers under `pythonpath`.
fn check_gpt2_with(pythonpath: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let c = config();
    let t = trained();
    let out = hf::gpt2::export(
        gpt(&c),
        t.layout(),
        t.master(),
        None,
        &tmp.path().join("hf"),
    )
    .unwrap();
    // stoker's logits over two sequences of the full context.
    let mb = token_batch(99, 2, 16, 16, &[]);
    let (tp, lp) = common::hf_python::write_tokens_and_logits(tmp.path(), &t, &mb.input);
    let saved = tmp.path().join("saved");
    common::hf_python::run_check_script("hf_gpt2_check.py", &[&out, &tp, &lp, &saved], pythonpath);
    let back = hf::gpt2::import(gpt(&c), t.layout(), &saved).unwrap();
    stoker_testkit::assert_bits_eq(&back, t.master(), "transformers' save_pretrained, imported");
}

/// The hub's own GPT-2 (`openai-community/gpt2`) names its tensors without
/// `transformer.` and keeps each block's causal-mask buffer `h.L.attn.bias`; a checkpoint
/// past `save_pretrained`'s shard size comes as shards and an index. Each imports to the
/// export's bits (before: "tensor `transformer.wte.weight` not found", and "model.safetensors:
/// No such file"); a tensor in no shard, or a missing shard, is named.
#[test]
fn the_hub_s_gpt2_layouts_import_as_the_export() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config();
    let t = trained();
    let out = hf::gpt2::export(
        gpt(&c),
        t.layout(),
        t.master(),
        None,
        &tmp.path().join("hf"),
    )
    .unwrap();
    let hub = |n: &str| n.strip_prefix("transformer.").unwrap_or(n).to_string();
    let masks: Vec<(String, Vec<usize>, Vec<f32>)> = (0..2)
        .map(|l| {
            (
                format!("h.{l}.attn.bias"),
                vec![1, 1, 16, 16],
                vec![1.0; 256],
            )
        })
        .collect();
    for (name, shards) in [("hub", 1), ("hub-sharded", 3)] {
        let dir = tmp.path().join(name);
        common::hf_layout::rewrite(&out, &dir, hub, &masks, shards);
        let back = hf::gpt2::import(gpt(&c), t.layout(), &dir).unwrap();
        stoker_testkit::assert_bits_eq(&back, t.master(), name);
    }
    let kept = |n: &str| n.to_string();
    let dir = tmp.path().join("sharded");
    common::hf_layout::rewrite(&out, &dir, kept, &[], 2);
    let back = hf::gpt2::import(gpt(&c), t.layout(), &dir).unwrap();
    stoker_testkit::assert_bits_eq(&back, t.master(), "sharded, prefixed");
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let e = hf::gpt2::import(gpt(&c), t.layout(), &dir)
        .unwrap_err()
        .to_string();
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
    let index = dir.join("model.safetensors.index.json");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
    json["weight_map"]
        .as_object_mut()
        .unwrap()
        .remove("transformer.wpe.weight");
    std::fs::write(&index, json.to_string()).unwrap();
    let e = hf::gpt2::import(gpt(&c), t.layout(), &dir)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.safetensors.index.json")
            && e.contains("tensor `transformer.wpe.weight` is in no shard's weight_map"),
        "{e}"
    );
    // Both forms present (a stale index, its shards gone): the single file, as
    // transformers reads it first.
    std::fs::copy(out.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let back = hf::gpt2::import(gpt(&c), t.layout(), &dir).unwrap();
    stoker_testkit::assert_bits_eq(&back, t.master(), "the single file before the index");
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::copy(out.join("config.json"), empty.join("config.json")).unwrap();
    let e = hf::gpt2::import(gpt(&c), t.layout(), &empty)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("neither model.safetensors nor model.safetensors.index.json"),
        "{e}"
    );
}
