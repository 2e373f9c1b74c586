//! Bad input fails before any work with a message naming the key, the field, the step or
//! the parameter.

mod common;

use std::path::Path;

use candle_core::{Device, Tensor};
use common::*;
use stoker_train::accumulate::MicroBatch;
use stoker_train::config::TrainConfig;
use stoker_train::run::{run, RunOptions};
use stoker_train::trainer::Trainer;
use stoker_train::TrainError;

fn base(dir: &Path) -> String {
    gpt_config(dir, "fp32", 2, "")
}

fn parse(text: &str) -> Result<TrainConfig, TrainError> {
    TrainConfig::parse(text, Path::new("bad.toml"))
}

#[test]
fn unknown_key_is_rejected_naming_it() {
    let t = base(Path::new("/tmp")).replace("n_head = 4", "n_head = 4\nn_heads = 4");
    let err = parse(&t).unwrap_err().to_string();
    assert!(err.contains("n_heads"), "{err}");
    let t = base(Path::new("/tmp")).replace("grad_clip = 1.0", "grad_clip = 1.0\nclip = 2");
    let err = parse(&t).unwrap_err().to_string();
    assert!(err.contains("clip"), "{err}");
}

/// A value of the wrong type or range is named on one line, with the line it is on, in
/// `[model]` too (whose tagged table lost the key before: the error pointed at the
/// table's header alone).
#[test]
fn a_bad_value_is_named_on_one_line() {
    for (from, to, want) in [
        (
            "micro_batch = 4",
            "micro_batch = \"x\"",
            "(`micro_batch = \"x\"`): invalid type: string \"x\", expected usize",
        ),
        (
            "n_head = 4",
            "n_head = -1",
            "(`[model]`): model.n_head: invalid value: integer `-1`, expected usize",
        ),
    ] {
        let t = base(Path::new("/tmp")).replace(from, to);
        let err = parse(&t).unwrap_err().to_string();
        assert!(
            err.starts_with("config bad.toml: line ") && err.ends_with(want),
            "{err}"
        );
        assert!(!err.contains('\n'), "{err}");
    }
}

#[test]
fn batch_arithmetic_that_does_not_divide_names_the_key_and_numbers() {
    let with = |extra: &str| {
        base(Path::new("/tmp")).replace(
            "accumulation_steps = 2",
            &format!("accumulation_steps = 2\n{extra}"),
        )
    };
    // With the world size in the file, the whole product is checked when parsing.
    let err = parse(&with("world_size = 1\nglobal_batch = 10"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("batch.global_batch")
            && err.contains("10 != micro_batch 4 x accumulation_steps 2 x world_size 1 = 8"),
        "{err}"
    );
    assert!(err.contains("not divisible"), "{err}");
    let err = parse(&with("world_size = 1\nglobal_batch = 12"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("accumulation_steps = 3 would fit"), "{err}");
    // Without it, what no world size can fix is refused when parsing...
    let err = parse(&with("global_batch = 10")).unwrap_err().to_string();
    assert!(
        err.contains("10 is not divisible by micro_batch 4 x accumulation_steps 2 = 8"),
        "{err}"
    );
    // ... and the rest once the launcher's world size is known, before any work (the
    // data files of this config do not exist: they are never opened).
    let config = parse(&with("global_batch = 16")).unwrap();
    let err = run(&config, &RunOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("batch.global_batch")
            && err.contains("16 != micro_batch 4 x accumulation_steps 2 x world_size 1 = 8; accumulation_steps = 4 would fit"),
        "{err}"
    );
    let config = parse(&with("world_size = 2")).unwrap();
    let err = run(&config, &RunOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("batch.world_size") && err.contains("mpirun -n 2"),
        "{err}"
    );
}

#[test]
fn precision_or_device_that_cannot_run_names_the_key() {
    let t = base(Path::new("/tmp")).replace("precision = \"fp32\"", "precision = \"fp4\"");
    assert!(parse(&t).unwrap_err().to_string().contains("fp4"));
    let t = base(Path::new("/tmp")).replace(
        "precision = \"fp32\"",
        "precision = \"fp16\"\ndevice = \"cuda\"",
    );
    let err = parse(&t).unwrap_err().to_string();
    assert!(err.contains("`device`") && err.contains("CUDA"), "{err}");
    let t = base(Path::new("/tmp")).replace("n_head = 4", "n_head = 5");
    assert!(parse(&t).unwrap_err().to_string().contains("model.n_head"));
}

/// A Llama's sizes that cannot build name their key: heads of odd width (rotary
/// embeddings turn pairs), key/value heads that do not divide the query heads, a rotary
/// base or epsilon that is not a positive number, and an unknown key.
#[test]
fn llama_sizes_that_cannot_build_name_the_key() {
    let llama = |extra: &str| {
        base(Path::new("/tmp")).replace("kind = \"gpt\"", &format!("kind = \"llama\"\n{extra}"))
    };
    assert!(
        parse(&llama("n_kv_head = 2")).is_ok(),
        "the base Llama parses"
    );
    for (extra, from, to, key) in [
        ("n_kv_head = 3", "", "", "model.n_kv_head"),
        ("n_kv_head = 0", "", "", "model.n_kv_head"),
        ("rope_theta = -1.0", "", "", "model.rope_theta"),
        ("norm_eps = 0.0", "", "", "model.norm_eps"),
        ("ffn_hidden = 0", "", "", "model.ffn_hidden"),
        ("", "n_head = 4", "n_head = 32", "model.n_head"),
        ("rotary = true", "", "", "rotary"),
    ] {
        let mut t = llama(extra);
        if !from.is_empty() {
            t = t.replace(from, to);
        }
        let err = match parse(&t) {
            Ok(_) => panic!("{extra}{to}: the config parsed"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(key), "{extra}{to}: {err}");
    }
}

#[test]
fn dataset_that_does_not_fit_the_model_fails_before_training() {
    let tmp = tempfile::tempdir().unwrap();
    // 28x28 images for a CNN configured for 8x8.
    write_npy(
        &tmp.path().join("train.image.npy"),
        "|u1",
        &[16, 1, 28, 28],
        &vec![0u8; 16 * 784],
    );
    write_npy(
        &tmp.path().join("train.label.npy"),
        "<i8",
        &[16],
        bytemuck::cast_slice(&[1i64; 16]),
    );
    let text = format!(
        r#"run_dir = "{run}"
[data]
train = "{data}"
eval_fraction = 0.25
[model]
kind = "cnn"
in_channels = 1
image_size = 8
channels1 = 2
channels2 = 2
hidden = 4
classes = 10
[batch]
micro_batch = 4
[optimizer]
kind = "sgd"
lr = 0.1
[train]
steps = 1
"#,
        run = tmp.path().join("run").display(),
        data = tmp.path().join("train").display()
    );
    let c = parse(&text).unwrap();
    let err = run(&c, &RunOptions::default()).unwrap_err().to_string();
    assert!(
        err.contains("`image`") && err.contains("[1, 28, 28]") && err.contains("model.image_size"),
        "{err}"
    );
    assert!(
        !tmp.path().join("run/metrics.jsonl").exists(),
        "no work before the check"
    );

    // A vocab larger than the model's.
    let dir = tmp.path().join("tok");
    std::fs::create_dir_all(&dir).unwrap();
    write_token_corpus(&dir.join("corpus.bin"), 2000);
    let c = parse(&gpt_config(&dir, "fp32", 1, "").replace("vocab = 24", "vocab = 10")).unwrap();
    let err = run(&c, &RunOptions::default()).unwrap_err().to_string();
    assert!(err.contains("model.vocab"), "{err}");
}

#[test]
fn nan_loss_stops_with_step_and_first_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let text = base(dir.path()).replace(
        "kind = \"gpt\"\nvocab = 24\ncontext = 16\nd_model = 32\nn_layer = 2\nn_head = 4",
        "kind = \"mlp\"\ninput_shape = [6]\nhidden = [7]\nclasses = 3",
    );
    let c = parse(&text).unwrap();
    let mut t = Trainer::new(&c).unwrap();
    let good = MicroBatch {
        input: Tensor::from_vec(floats(1, 12), (2, 6), &Device::Cpu).unwrap(),
        targets: vec![0, 2],
    };
    t.train_step(&[good]).unwrap();
    let mut x = floats(2, 12);
    x[3] = f32::NAN;
    let bad = MicroBatch {
        input: Tensor::from_vec(x, (2, 6), &Device::Cpu).unwrap(),
        targets: vec![1, 1],
    };
    let err = t.train_step(&[bad]).unwrap_err();
    match &err {
        TrainError::NonFinite { step, what, param } => {
            assert_eq!(
                *step, 2,
                "the second step, counted from 1 as the metrics count"
            );
            // ReLU maps the NaN input to 0 in the forward pass, so the loss stays finite;
            // the first layer's weight gradient (x^T g) carries the NaN.
            assert_eq!(what, "gradient");
            assert_eq!(param, "layers.0.weight");
        }
        e => panic!("{e}"),
    }
    assert!(
        err.to_string().contains("step 2: non-finite gradient"),
        "{err}"
    );
}
