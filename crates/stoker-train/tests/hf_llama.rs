//! Hugging Face `LlamaForCausalLM` interop: `hf::export` writes transformers' tensor names,
//! shapes and config for a Llama with grouped-query attention, `hf::import` reads them
//! back bit for bit and `[model] init_from` starts from them; and, where transformers is
//! installed (`make test-hf`: its 4.x and 5.x versions), both ways against transformers
//! itself: its LlamaForCausalLM loads stoker's export and gives stoker's logits, and a
//! model transformers drew and saved imports into stoker with transformers' logits.

mod common;

use std::path::Path;

use common::*;
use stoker_train::config::TrainConfig;
use stoker_train::hf;
use stoker_train::trainer::Trainer;

fn config() -> TrainConfig {
    let text = r#"
run_dir = "/nonexistent"
seed = 3
precision = "fp32"
[data]
train = "/nonexistent"
[model]
kind = "llama"
vocab = 16
context = 16
d_model = 32
n_layer = 2
n_head = 4
n_kv_head = 2
ffn_hidden = 48
rope_theta = 500000.0
[batch]
micro_batch = 2
[optimizer]
kind = "adamw"
lr = 3e-3
[train]
steps = 4
"#;
    TrainConfig::parse(text, Path::new("hf_llama.toml")).unwrap()
}

/// A trainer after 4 steps (so the norms' gains moved from their ones).
fn trained() -> Trainer {
    let mut t = Trainer::new(&config()).unwrap();
    for s in 0..4 {
        t.train_step(&[token_batch(s, 2, 16, 16, &[])]).unwrap();
    }
    t
}

#[test]
fn export_writes_llama_names_shapes_and_config_and_imports_back_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config();
    let t = trained();
    let out = hf::export(
        &c.model,
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
    // LlamaForCausalLM's state dict for this size.
    let mut want = vec![
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".into(),
        "lm_head.weight".into(),
    ];
    for l in 0..2 {
        for p in [
            "input_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "post_attention_layernorm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ] {
            want.push(format!("model.layers.{l}.{p}.weight"));
        }
    }
    want.sort();
    assert_eq!(names, want);
    let shape = |n: &str| st.tensor(n).unwrap().shape().to_vec();
    assert_eq!(shape("model.layers.1.self_attn.k_proj.weight"), [16, 32]);
    assert_eq!(shape("model.layers.0.mlp.down_proj.weight"), [32, 48]);
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "llama");
    assert_eq!(cfg["num_key_value_heads"], 2);
    assert_eq!(cfg["rope_theta"], 500000.0);
    assert_eq!(cfg["rope_parameters"]["rope_theta"], 500000.0);
    assert_eq!(cfg["tie_word_embeddings"], false);
    assert!(cfg["bos_token_id"].is_null(), "{cfg}");
    let back = hf::import(&c.model, t.layout(), &out).unwrap();
    stoker_testkit::assert_bits_eq(&back, t.master(), "export then import");

    // A directory for another size or rotary base is refused naming config.json and the key.
    for (from, to, key) in [
        ("n_kv_head = 2", "n_kv_head = 4", "`num_key_value_heads`"),
        (
            "rope_theta = 500000.0",
            "rope_theta = 10000.0",
            "rope_theta",
        ),
    ] {
        let text = toml::to_string(&c).unwrap().replace(from, to);
        let other = TrainConfig::parse(&text, Path::new("other.toml")).unwrap();
        let e = hf::import(&other.model, t.layout(), &out)
            .unwrap_err()
            .to_string();
        assert!(e.contains("config.json") && e.contains(key), "{e}");
    }
    // A scaled rotary variant written transformers 5's way is refused, naming the key.
    let edited = tmp.path().join("scaled");
    std::fs::create_dir_all(&edited).unwrap();
    std::fs::copy(
        out.join("model.safetensors"),
        edited.join("model.safetensors"),
    )
    .unwrap();
    let mut cfg2 = cfg.clone();
    cfg2["rope_parameters"]["rope_type"] = "llama3".into();
    cfg2["rope_parameters"]["factor"] = 8.0.into();
    std::fs::write(edited.join("config.json"), cfg2.to_string()).unwrap();
    let e = hf::import(&c.model, t.layout(), &edited)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("config.json") && e.contains("`rope_parameters.rope_type` is \"llama3\""),
        "{e}"
    );
    // Sharded as save_pretrained writes a larger model: the same bits.
    let sharded = tmp.path().join("sharded");
    common::hf_layout::rewrite(&out, &sharded, |n| n.to_string(), &[], 3);
    let back = hf::import(&c.model, t.layout(), &sharded).unwrap();
    stoker_testkit::assert_bits_eq(&back, t.master(), "sharded");
    // `[model] init_from` starts training from it.
    let text = toml::to_string(&c).unwrap().replace(
        "n_kv_head = 2",
        &format!("n_kv_head = 2\ninit_from = \"{}\"", out.display()),
    );
    let ft = TrainConfig::parse(&text, Path::new("ft.toml")).unwrap();
    let fine = Trainer::new(&ft).unwrap();
    stoker_testkit::assert_bits_eq(fine.master(), t.master(), "init_from");
}

#[test]
fn transformers_and_stoker_give_the_same_llama_logits_both_ways() {
    let test = "transformers_and_stoker_give_the_same_llama_logits_both_ways";
    let pythons = common::hf_python::hf_pythons_or_skip(test);
    for pythonpath in pythons {
        check_with(&pythonpath);
    }
}

fn check_with(pythonpath: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let c = config();
    let t = trained();
    let out = hf::export(
        &c.model,
        t.layout(),
        t.master(),
        None,
        &tmp.path().join("hf"),
    )
    .unwrap();
    let mb = token_batch(99, 2, 16, 16, &[]);
    let (tp, lp) = common::hf_python::write_tokens_and_logits(tmp.path(), &t, &mb.input);
    let (saved, fresh) = (tmp.path().join("saved"), tmp.path().join("fresh"));
    let args: [&Path; 5] = [&out, &tp, &lp, &saved, &fresh];
    common::hf_python::run_check_script("hf_llama_check.py", &args, pythonpath);
    let back = hf::import(&c.model, t.layout(), &saved).unwrap();
    stoker_testkit::assert_bits_eq(&back, t.master(), "transformers' save_pretrained, imported");
    // The other way: transformers' own random Llama, imported and run by stoker.
    let text = toml::to_string(&c).unwrap().replace(
        "n_kv_head = 2",
        &format!("n_kv_head = 2\ninit_from = \"{}\"", fresh.display()),
    );
    let theirs =
        Trainer::new(&TrainConfig::parse(&text, Path::new("fresh.toml")).unwrap()).unwrap();
    let ours = common::hf_python::logits_of(&theirs, &mb.input);
    let want = read_npy_f32(&fresh.join("logits.npy"));
    assert_eq!(want.len(), ours.len());
    let d = stoker_testkit::max_abs_diff(&ours, &want);
    eprintln!("stoker vs transformers' own Llama ({pythonpath}): max abs logit difference {d:e}");
    assert!(
        d <= 1e-4,
        "stoker's logits of transformers' Llama differ by {d}"
    );
}

/// The values of a little-endian f32 `.npy` file (numpy's format 1.0 or 2.0 header).
fn read_npy_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..6], b"\x93NUMPY", "{}", path.display());
    let (len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
    };
    let header = String::from_utf8_lossy(&bytes[start..start + len]);
    assert!(
        header.contains("'<f4'") && header.contains("False"),
        "{header}"
    );
    bytes[start + len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
