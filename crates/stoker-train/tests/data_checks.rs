//! The data a run opens, checked before its first step (stoker_train::data::checks) and
//! split so that class-ordered samples do not skew training or evaluation. Each case here
//! was found by a review: it failed mid-run, after the whole run at its first evaluation,
//! or never.

mod common;

use std::path::Path;

use candle_core::Device;
use stoker_data::npy::write_npy;
use stoker_data::{AnyDataset, DType, Dataset, SampleContext};
use stoker_train::config::TrainConfig;
use stoker_train::data::{open_datasets, Datasets, Subset};
use stoker_train::models::build_meta_model_on;
use stoker_train::TrainError;

/// An MLP config over the arrays at `train` (and `eval`), `extra` inside `[train]`.
fn mlp(dir: &Path, data: &str, classes: usize, extra: &str) -> TrainConfig {
    TrainConfig::parse(&mlp_text(dir, data, classes, extra), Path::new("t.toml")).unwrap()
}

/// [`mlp`]'s text.
fn mlp_text(dir: &Path, data: &str, classes: usize, extra: &str) -> String {
    format!(
        "run_dir = \"{}\"\n[data]\n{data}\ninput_field = \"x\"\ntarget_field = \"y\"\n\
         [model]\nkind = \"mlp\"\ninput_shape = [2]\nhidden = [4]\nclasses = {classes}\n\
         [batch]\nmicro_batch = 4\n[optimizer]\nkind = \"adamw\"\nlr = 1e-3\n\
         [train]\nsteps = 1\n{extra}\n",
        dir.join("run").display()
    )
}

/// `n` samples of 2 floats, labels `labels(i)`, at `dir/name.{x,y}.npy`.
fn arrays(dir: &Path, name: &str, n: usize, labels: impl Fn(usize) -> i64) {
    let x: Vec<f32> = (0..2 * n).map(|i| i as f32).collect();
    let y: Vec<i64> = (0..n).map(labels).collect();
    let px = dir.join(format!("{name}.x.npy"));
    write_npy(&px, DType::F32, &[n, 2], bytemuck::cast_slice(&x)).unwrap();
    let py = dir.join(format!("{name}.y.npy"));
    write_npy(&py, DType::I64, &[n], bytemuck::cast_slice(&y)).unwrap();
}

fn open(config: &TrainConfig) -> stoker_train::Result<Datasets> {
    let p = config.precision;
    let model = build_meta_model_on(&config.model, p, config.kernels, 0, &Device::Cpu)?;
    open_datasets(config, &*model)
}

/// The labels of samples `0..n` of `ds` (field `y`, the second).
fn labels(ds: &Subset<AnyDataset>, n: usize) -> Vec<i64> {
    let mut worker = Default::default();
    (0..n)
        .map(|i| {
            let (mut x, mut y) = ([0u8; 8], [0u8; 8]);
            let ctx = SampleContext {
                seed: 0,
                epoch: 0,
                index: i as u64,
            };
            ds.read_sample(&mut worker, ctx, &mut [&mut x, &mut y])
                .unwrap();
            i64::from_le_bytes(y)
        })
        .collect()
}

/// Records in class order (as `stoker pack images` writes them): the held-out samples are a
/// seeded draw holding every class, the training samples too, and a partial evaluation of
/// a class-ordered evaluation set reads a draw of it. Before, the tail held out the last
/// class alone (0% accuracy on it, never trained on), and 2 evaluation batches read class
/// 0 alone (100%).
#[test]
fn class_ordered_samples_are_split_and_evaluated_by_a_seeded_draw() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    arrays(d, "sorted", 40, |i| (i / 20) as i64);
    let train = format!(
        "train = \"{}\"\neval_fraction = 0.5",
        d.join("sorted").display()
    );
    let data = open(&mlp(d, &train, 2, "")).unwrap();
    assert_eq!((data.train.len(), data.eval.len()), (20, 20));
    for (ds, what) in [(&data.train, "train"), (&data.eval, "eval")] {
        let l = labels(ds, 20);
        let ones = l.iter().filter(|&&v| v == 1).count();
        assert!((5..=15).contains(&ones), "{what}: {l:?}");
    }
    // Every sample once, in one split or the other.
    let (mut seen, mut worker) = (vec![0; 40], Default::default());
    for ds in [&data.train, &data.eval] {
        for i in 0..20 {
            let (mut x, mut y) = ([0u8; 8], [0u8; 8]);
            let ctx = SampleContext {
                seed: 0,
                epoch: 0,
                index: i,
            };
            ds.read_sample(&mut worker, ctx, &mut [&mut x, &mut y])
                .unwrap();
            seen[f32::from_le_bytes(x[..4].try_into().unwrap()) as usize / 2] += 1;
        }
    }
    assert_eq!(seen, vec![1; 40]);
    // Two batches of 4 of a 40-sample evaluation set in class order: a draw.
    let both = format!(
        "train = \"{0}\"\neval = \"{0}\"",
        d.join("sorted").display()
    );
    let data = open(&mlp(d, &both, 2, "eval_batches = 2")).unwrap();
    let l = labels(&data.eval, 8);
    assert!(l.contains(&0) && l.contains(&1), "{l:?}");
    // The whole set evaluated: in its own order.
    let data = open(&mlp(d, &both, 2, "eval_batches = 10")).unwrap();
    assert_eq!(
        labels(&data.eval, 40),
        (0..40).map(|i| i / 20).collect::<Vec<_>>()
    );
}

/// Refused at open, naming the file, the key and what was expected: an empty evaluation
/// set (before: after the whole run, "dataset: has no samples"); a class id past
/// `model.classes` in the evaluation set (before: after the whole run, naming no file);
/// evaluation records whose class list is not the training records'.
#[test]
fn evaluation_data_that_cannot_be_evaluated_is_refused_at_open() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    arrays(d, "train", 40, |i| (i % 4) as i64);
    arrays(d, "empty", 0, |_| 0);
    arrays(d, "seven", 12, |i| if i == 9 { 7 } else { 0 });
    let with = |eval: &str| {
        format!(
            "train = \"{}\"\neval = \"{}\"",
            d.join("train").display(),
            d.join(eval).display()
        )
    };
    let err = |c: &TrainConfig| open(c).map(|_| ()).unwrap_err().to_string();
    let e = err(&mlp(d, &with("empty"), 4, ""));
    assert!(
        e.contains("empty (data.eval)") && e.contains("holds no samples"),
        "{e}"
    );
    let e = err(&mlp(d, &with("seven"), 4, ""));
    assert!(
        e.contains("seven (data.eval) field `y`")
            && e.contains("class id 7 at sample 9 is outside 0..4 (model.classes)"),
        "{e}"
    );
    // In the training set too, before the step that would read it.
    let seven = format!("train = \"{}\"", d.join("seven").display());
    let e = err(&mlp(d, &seven, 4, ""));
    assert!(
        e.contains("(data.train)") && e.contains("class id 7 at sample 9"),
        "{e}"
    );
    // Class lists beside the arrays (as `stoker pack images` writes them).
    let names = |p: &str, n: &[&str]| {
        std::fs::write(
            d.join(format!("{p}.classes.json")),
            serde_json::to_string(n).unwrap(),
        )
        .unwrap()
    };
    names("train", &["ant", "bee", "cat", "dog"]);
    names("seven", &["ant", "cat", "dog"]);
    arrays(d, "seven", 12, |_| 0);
    let e = err(&mlp(d, &with("seven"), 4, ""));
    assert!(
        e.contains("seven.classes.json (data.eval)") && e.contains("a label is a position"),
        "{e}"
    );
    match open(&mlp(d, &with("train"), 3, "")) {
        Err(TrainError::Config { key, message }) => {
            assert_eq!(key, "model.classes");
            assert!(message.contains("names 4 classes"), "{message}");
        }
        other => panic!(
            "expected model.classes refused, got {:?}",
            other.map(|_| ())
        ),
    }
}

/// A token evaluation shard is checked at open: an id past `model.vocab` (before: after
/// the whole run), or past `data.vocab`'s tokens where the file holds fewer (before:
/// accepted below `model.vocab`, and decoded as no character), and a shard packed with another vocabulary than `data.vocab` (before:
/// evaluated silently, its ids read as other characters). An empty vocabulary and text
/// sampling without one are refused by key.
#[test]
fn a_token_evaluation_shard_is_checked_against_the_model_and_the_vocabulary() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    common::write_token_corpus(&d.join("corpus.bin"), 12_000);
    let gpt = |eval: &str, extra: &str| {
        let text = common::gpt_config(d, "fp32", 1, extra).replace(
            "[model]",
            &format!("eval = \"{}\"\n[model]", d.join(eval).display()),
        );
        TrainConfig::parse(&text, Path::new("t.toml"))
    };
    // Another shard: ids up to 30 with its own vocabulary beside it.
    let ids: Vec<u16> = (0..4000).map(|i| (i % 31) as u16).collect();
    stoker_data::tokens::write_tokens(d.join("other.bin"), &ids, stoker_data::TokenFormat::Llmc)
        .unwrap();
    let e = open(&gpt("other.bin", "").unwrap())
        .map(|_| ())
        .unwrap_err();
    assert!(
        e.to_string().contains("data.eval")
            && e.to_string()
                .contains("is outside the vocabulary of 17 (data.vocab)"),
        "{e}"
    );
    let ids: Vec<u16> = (0..4000).map(|i| (i % 20) as u16).collect();
    stoker_data::tokens::write_tokens(d.join("other.bin"), &ids, stoker_data::TokenFormat::Llmc)
        .unwrap();
    let tokens: Vec<String> = ('a'..='t').map(String::from).collect();
    let json = serde_json::json!({"kind": "char", "tokens": tokens});
    std::fs::write(d.join("other.vocab.json"), json.to_string()).unwrap();
    let e = open(&gpt("other.bin", "").unwrap())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("other.bin (data.eval)") && e.contains("packed with the vocabulary"),
        "{e}"
    );
    // `stoker pack docs`' layout: PREFIX_train_000001.bin beside PREFIX.vocab.json (before:
    // not looked for, and the shard evaluated through the wrong characters).
    std::fs::copy(d.join("other.bin"), d.join("docs_train_000001.bin")).unwrap();
    std::fs::copy(d.join("other.vocab.json"), d.join("docs.vocab.json")).unwrap();
    let e = open(&gpt("docs_train_000001.bin", "").unwrap())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("docs_train_000001.bin (data.eval)")
            && e.contains("docs.vocab.json, which differs from data.vocab"),
        "{e}"
    );
    // Without data.vocab, the training shard's own vocabulary stands for it (before: the
    // evaluation shard was read through another silently).
    let without = common::gpt_config(d, "fp32", 1, "")
        .replace(
            &format!("vocab = \"{}\"\n", d.join("corpus.vocab.json").display()),
            "",
        )
        .replace(
            "[model]",
            &format!(
                "eval = \"{}\"\n[model]",
                d.join("docs_train_000001.bin").display()
            ),
        );
    let e = open(&TrainConfig::parse(&without, Path::new("t.toml")).unwrap())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("docs_train_000001.bin (data.eval)")
            && e.contains("differs from the training shards' vocabulary"),
        "{e}"
    );
    // The same vocabulary beside it, and ids inside its 17 tokens: evaluated.
    std::fs::copy(d.join("corpus.vocab.json"), d.join("other.vocab.json")).unwrap();
    let ids: Vec<u16> = (0..4000).map(|i| (i % 17) as u16).collect();
    stoker_data::tokens::write_tokens(d.join("other.bin"), &ids, stoker_data::TokenFormat::Llmc)
        .unwrap();
    open(&gpt("other.bin", "").unwrap()).unwrap();
    // The vocabulary is read at open (so `--dry-run` checks it too), by its key: missing,
    // or more tokens than model.vocab (before: checked by the run alone, after open).
    let vocab_line = format!("vocab = \"{}\"", d.join("corpus.vocab.json").display());
    let other_vocab = |to: &str| {
        let text = common::gpt_config(d, "fp32", 1, "").replace(
            &vocab_line,
            &format!("vocab = \"{}\"", d.join(to).display()),
        );
        TrainConfig::parse(&text, Path::new("t.toml")).unwrap()
    };
    match open(&other_vocab("typo.vocab.json")).map(|_| ()) {
        Err(e @ TrainError::Dataset { .. }) => {
            let e = e.to_string();
            assert!(
                e.contains("data.vocab") && e.contains("typo.vocab.json"),
                "{e}"
            );
        }
        other => panic!("expected data.vocab refused, got {other:?}"),
    }
    let wide: Vec<String> = (0..30).map(|i| format!("t{i}")).collect();
    let json = serde_json::json!({"kind": "char", "tokens": wide});
    std::fs::write(d.join("wide.vocab.json"), json.to_string()).unwrap();
    match open(&other_vocab("wide.vocab.json")).map(|_| ()) {
        Err(TrainError::Config { key, message }) => {
            assert_eq!(key, "model.vocab");
            assert!(message.contains("24 < 30 tokens"), "{message}");
        }
        other => panic!("expected model.vocab refused, got {other:?}"),
    }
    // Sampling prints through the vocabulary; an empty one is refused.
    let no_vocab = common::gpt_config(d, "fp32", 1, "sample_tokens = 5").replace(
        &format!("vocab = \"{}\"\n", d.join("corpus.vocab.json").display()),
        "",
    );
    match TrainConfig::parse(&no_vocab, Path::new("t.toml")) {
        Err(TrainError::Config { key, .. }) => assert_eq!(key, "train.sample_tokens"),
        other => panic!("expected train.sample_tokens refused, got {other:?}"),
    }
    std::fs::write(d.join("corpus.vocab.json"), "{\"tokens\": []}").unwrap();
    let e = stoker_train::data::load_vocab(&gpt("other.bin", "").unwrap()).unwrap_err();
    match e {
        TrainError::Config { key, .. } => assert_eq!(key, "data.vocab"),
        other => panic!("expected data.vocab refused, got {other:?}"),
    }
}

/// A token model may read its windows from `.npy` arrays: its targets are a window each,
/// not one class id (the classifier's rule refused them for a while).
#[test]
fn a_token_model_reads_windows_from_arrays() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    common::write_token_corpus(&d.join("corpus.bin"), 12_000);
    let ids: Vec<i64> = (0..64 * 16).map(|i| (i % 20) as i64).collect();
    for f in ["input", "target"] {
        let p = d.join(format!("tok.{f}.npy"));
        write_npy(&p, DType::I64, &[64, 16], bytemuck::cast_slice(&ids)).unwrap();
    }
    let text = common::gpt_config(d, "fp32", 1, "").replace(
        &format!("train = \"{}\"", d.join("corpus.bin").display()),
        &format!(
            "train = \"{}\"\ninput_field = \"input\"\ntarget_field = \"target\"",
            d.join("tok").display()
        ),
    );
    let data = open(&TrainConfig::parse(&text, Path::new("t.toml")).unwrap()).unwrap();
    // Held out as a tail, as a token shard's windows are.
    assert!(
        data.eval_note.starts_with("last 6 of 64 samples"),
        "{}",
        data.eval_note
    );
    // u16 windows (GPT-2's ids, as numpy keeps them) reach the model as the same i64 ids
    // (before: passed by the model's check, refused at the first batch).
    let ids16: Vec<u16> = ids.iter().map(|&i| i as u16).collect();
    for f in ["input", "target"] {
        let p = d.join(format!("tok.{f}.npy"));
        write_npy(&p, DType::U16, &[64, 16], bytemuck::cast_slice(&ids16)).unwrap();
    }
    let data = open(&TrainConfig::parse(&text, Path::new("t.toml")).unwrap()).unwrap();
    let sampler = stoker_data::Sampler::new(data.train.len(), Default::default()).unwrap();
    let config = stoker_data::LoaderConfig {
        batch_size: 4,
        ..Default::default()
    };
    let mut loader = stoker_data::Loader::new(data.train.clone(), sampler, config).unwrap();
    let batch = loader.epoch(0).next().unwrap().unwrap();
    let mb = stoker_train::data::to_micro_batch(&batch, "input", "target", &Device::Cpu).unwrap();
    assert_eq!(mb.input.dims(), &[4, 16]);
    let first: Vec<i64> = mb.input.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(first, ids[..64]);
    assert_eq!(mb.targets, ids[..64]);
    // An id past model.vocab in evaluation arrays: refused at open, naming the file and
    // the sample (before: found by the step after the whole run, naming no file).
    let mut bad = ids16.clone();
    bad[5 * 16 + 3] = 100;
    for f in ["input", "target"] {
        let p = d.join(format!("bad.{f}.npy"));
        write_npy(&p, DType::U16, &[64, 16], bytemuck::cast_slice(&bad)).unwrap();
    }
    let with_eval = text.replace(
        "input_field = \"input\"",
        &format!(
            "eval = \"{}\"\ninput_field = \"input\"",
            d.join("bad").display()
        ),
    );
    let e = open(&TrainConfig::parse(&with_eval, Path::new("t.toml")).unwrap())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("{} (data.eval", d.join("bad.input.npy").display()))
            && e.contains("token id 100 at sample 5, position 3 is outside 0..24 (model.vocab)"),
        "{e}"
    );
    // u8 arrays are pixels, not ids: refused, naming the file.
    let ids8: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
    for f in ["input", "target"] {
        let p = d.join(format!("tok.{f}.npy"));
        write_npy(&p, DType::U8, &[64, 16], &ids8).unwrap();
    }
    let e = open(&TrainConfig::parse(&text, Path::new("t.toml")).unwrap())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tok.input.npy") && e.contains("dtype u8, expected u16, i32, i64"),
        "{e}"
    );
    // Half floats are no model input: refused at open, naming the array's file.
    let half: Vec<u16> = vec![0; 8 * 2];
    arrays(d, "h", 8, |i| (i % 2) as i64);
    write_npy(
        d.join("h.x.npy"),
        DType::F16,
        &[8, 2],
        bytemuck::cast_slice(&half),
    )
    .unwrap();
    // u16 values for a classifier would reach it unscaled (u8 pixels are scaled by 1/255):
    // refused (before: trained, a loss of 2258 on 16-bit MNIST).
    let wide: Vec<u16> = vec![0; 8 * 2];
    arrays(d, "w", 8, |i| (i % 2) as i64);
    write_npy(
        d.join("w.x.npy"),
        DType::U16,
        &[8, 2],
        bytemuck::cast_slice(&wide),
    )
    .unwrap();
    let data_w = format!("train = \"{}\"", d.join("w").display());
    let e = open(&mlp(d, &data_w, 2, ""))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("w.x.npy") && e.contains("dtype u16, expected u8, f32"),
        "{e}"
    );
    let data = format!("train = \"{}\"", d.join("h").display());
    let e = open(&mlp(d, &data, 2, ""))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "{} field `x` (data.input_field)",
            d.join("h.x.npy").display()
        )) && e.contains("dtype f16, expected u8, f32: a classifier's inputs"),
        "{e}"
    );
}

/// The loader's knobs are refused at parse by their config keys (before: "invalid config:
/// prefetch_factor", the loader's own field name, mid-setup), and a classifier's target
/// field must hold one class id per sample (before: "256 targets for 4 rows of logits").
#[test]
fn loader_keys_and_a_classifier_s_target_are_refused_by_key() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    arrays(d, "a", 40, |i| (i % 2) as i64);
    let data = format!(
        "train = \"{}\"\neval_fraction = 0.25",
        d.join("a").display()
    );
    for (knobs, key) in [
        (
            "num_workers = 2\nprefetch_factor = 0",
            "data.prefetch_factor",
        ),
        ("persistent_workers = true", "data.persistent_workers"),
        ("num_workers = 5000", "data.num_workers"),
    ] {
        let text = mlp_text(d, &data, 2, "").replace("[data]\n", &format!("[data]\n{knobs}\n"));
        match TrainConfig::parse(&text, Path::new("t.toml")) {
            Err(TrainError::Config { key: k, .. }) => assert_eq!(k, key),
            other => panic!("expected {key} refused, got {other:?}"),
        }
    }
    // `z` (2 ids a sample) named as the target.
    let z: Vec<i64> = (0..80).map(|i| i % 2).collect();
    write_npy(
        d.join("a.z.npy"),
        DType::I64,
        &[40, 2],
        bytemuck::cast_slice(&z),
    )
    .unwrap();
    let text = mlp_text(d, &data, 2, "").replace("target_field = \"y\"", "target_field = \"z\"");
    let c = TrainConfig::parse(&text, Path::new("t.toml")).unwrap();
    let e = open(&c).map(|_| ()).unwrap_err().to_string();
    assert!(
        e.contains("field `z`")
            && e.contains("shape [2] per sample")
            && e.contains("data.target_field"),
        "{e}"
    );
}

/// A textured `w` x `h` JPEG.
fn photo(w: u16, h: u16) -> Vec<u8> {
    let px: Vec<u8> = (0..w as usize * h as usize * 3)
        .map(|i| ((i * 37) % 251) as u8)
        .collect();
    let mut out = Vec::new();
    jpeg_encoder::Encoder::new(&mut out, 90)
        .encode(&px, w, h, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    out
}

/// `data.jpeg_decoder` reaches the loader: a photo cut mid-scan (an end marker appended,
/// so `pack images` passes it) fails with libjpeg-turbo, naming the photo, and decodes with
/// `"zune"`, whose strict mode accepts it. The key is refused for data without JPEGs
/// (before it existed, libjpeg-turbo's hint named a Rust enum no config could set).
#[test]
fn the_jpeg_decoder_key_picks_the_decoder_of_image_records() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let src = d.join("photos");
    for class in ["a", "b"] {
        std::fs::create_dir_all(src.join(class)).unwrap();
    }
    std::fs::write(src.join("a/whole.jpg"), photo(64, 48)).unwrap();
    let whole = photo(200, 150);
    let cut = [&whole[..whole.len() / 2], &[0xFF, 0xD9][..]].concat();
    std::fs::write(src.join("b/cut.jpg"), cut).unwrap();
    let prefix = d.join("packed");
    stoker_data::pack::image_folder::pack_image_folder(&src, &prefix).unwrap();
    let cnn = |decoder: &str| {
        let text = format!(
            "run_dir = \"{}\"\n[data]\ntrain = \"{p}\"\neval = \"{p}\"\n{decoder}\n\
             [model]\nkind = \"cnn\"\nin_channels = 3\nimage_size = 8\nchannels1 = 2\n\
             channels2 = 2\nhidden = 4\nclasses = 2\n[batch]\nmicro_batch = 1\n\
             [optimizer]\nkind = \"adamw\"\nlr = 1e-3\n[train]\nsteps = 1\n",
            d.join("run").display(),
            p = prefix.display()
        );
        TrainConfig::parse(&text, Path::new("t.toml")).unwrap()
    };
    let read_cut = |data: &Datasets| {
        let f = data.train.fields();
        let (mut x, mut y) = (
            vec![0u8; f[0].sample_bytes()],
            vec![0u8; f[1].sample_bytes()],
        );
        let ctx = SampleContext {
            seed: 0,
            epoch: 0,
            index: 1,
        };
        data.train
            .read_sample(&mut Default::default(), ctx, &mut [&mut x, &mut y])
            .map(|_| i64::from_le_bytes(y.try_into().unwrap()))
    };
    for decoder in ["", "jpeg_decoder = \"libjpeg-turbo\""] {
        let e = read_cut(&open(&cnn(decoder)).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("{}: record 1 of", src.join("b/cut.jpg").display()))
                && e.contains("premature end")
                && e.contains("data.jpeg_decoder = \"zune\""),
            "{decoder}: {e}"
        );
    }
    let zune = open(&cnn("jpeg_decoder = \"zune\"")).unwrap();
    assert_eq!(read_cut(&zune).unwrap(), 1);
    // Arrays hold no JPEGs.
    arrays(d, "a", 8, |i| (i % 2) as i64);
    let data = format!(
        "train = \"{}\"\njpeg_decoder = \"zune\"",
        d.join("a").display()
    );
    match open(&mlp(d, &data, 2, "")) {
        Err(TrainError::Config { key, message }) => {
            assert_eq!(key, "data.jpeg_decoder");
            assert!(message.contains("is not image records"), "{message}");
        }
        other => panic!(
            "expected data.jpeg_decoder refused, got {:?}",
            other.map(|_| ())
        ),
    }
}

/// A relative data path that is not there says where relative paths are read from (a
/// launcher may start the run in another directory than the user's shell).
#[test]
fn a_missing_relative_path_names_the_working_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let cwd = std::env::current_dir().unwrap();
    for train in [
        "no/such/prefix",
        "no/such/shard.bin",
        "no/such/p_train_*.bin",
    ] {
        let err = open(&mlp(d, &format!("train = \"{train}\""), 2, ""))
            .map(|_| ())
            .unwrap_err();
        // Named by kind, not recognised by its text: a missing file, or a path or
        // pattern that names none.
        assert!(
            matches!(
                &err,
                TrainError::Dataset {
                    source: stoker_data::DataError::NotFound { .. }
                        | stoker_data::DataError::Io { .. },
                    ..
                }
            ),
            "{err:?}"
        );
        let e = err.to_string();
        assert!(
            e.contains("data.train")
                && e.contains("no/such")
                && e.contains(&format!(
                    "relative paths are read from the working directory {}",
                    cwd.display()
                )),
            "{e}"
        );
    }
}

/// Shards barely longer than the context leave each its tail in no window (a window never
/// spans shards): the run and `--dry-run` say how many tokens that leaves out (before:
/// silently, 40% of a review's set).
#[test]
fn tokens_in_no_window_are_counted_in_a_note() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    common::write_token_corpus(&d.join("corpus.bin"), 12_000);
    let ids: Vec<u16> = (0..28).map(|i| (i % 20) as u16).collect();
    for k in 1..=40 {
        let shard = d.join(format!("p_train_{k:06}.bin"));
        stoker_data::tokens::write_tokens(shard, &ids, stoker_data::TokenFormat::Llmc).unwrap();
    }
    let pattern = d.join("p_train_*.bin");
    let text = common::gpt_config(d, "fp32", 1, "").replace(
        &format!("train = \"{}\"", d.join("corpus.bin").display()),
        &format!("train = \"{}\"", pattern.display()),
    );
    let data = open(&TrainConfig::parse(&text, Path::new("t.toml")).unwrap()).unwrap();
    // 28 tokens a shard: one window of 16 (+1), 12 tokens left in each.
    assert_eq!(
        data.notes,
        [format!(
            "data.train {}: 480 of its 1120 tokens (43%) are in no window of context 16: a \
             window never spans its 40 shard(s), so each leaves its tail; pack with a larger \
             --shard-tokens, or use a shorter model.context",
            pattern.display()
        )]
    );
    // One long shard leaves less than a window: no note.
    let whole = open(
        &TrainConfig::parse(&common::gpt_config(d, "fp32", 1, ""), Path::new("t.toml")).unwrap(),
    )
    .unwrap();
    assert!(whole.notes.is_empty(), "{:?}", whole.notes);
}

/// Evaluation files that training also reads are said, before training: the same shard,
/// or a training pattern that also matches the evaluation shard (before: evaluated
/// silently on text the model trains on). A shard named in capitals (`T.BIN`) opens as
/// one (before: "not found").
#[test]
fn evaluation_files_that_training_reads_too_are_noted() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    common::write_token_corpus(&d.join("corpus.bin"), 12_000);
    std::fs::copy(d.join("corpus.bin"), d.join("ds_train_000001.bin")).unwrap();
    std::fs::copy(d.join("corpus.bin"), d.join("ds_val_000000.bin")).unwrap();
    std::fs::copy(d.join("corpus.bin"), d.join("T.BIN")).unwrap();
    let with = |train: &str, eval: Option<&str>| {
        let mut text = common::gpt_config(d, "fp32", 1, "").replace(
            &format!("train = \"{}\"", d.join("corpus.bin").display()),
            &format!("train = \"{}\"", d.join(train).display()),
        );
        if let Some(e) = eval {
            text = text.replace(
                "[model]",
                &format!("eval = \"{}\"\n[model]", d.join(e).display()),
            );
        }
        open(&TrainConfig::parse(&text, Path::new("t.toml")).unwrap())
            .unwrap()
            .notes
    };
    let shared = |notes: &[String]| notes.iter().find(|n| n.contains("also trains on")).cloned();
    let same = shared(&with("corpus.bin", Some("corpus.bin"))).expect("the same shard");
    assert!(
        same.contains("1 file(s)") && same.contains("corpus.bin"),
        "{same}"
    );
    let glob = shared(&with("ds_*.bin", Some("ds_val_000000.bin"))).expect("a wide pattern");
    assert!(
        glob.contains("ds_val_000000.bin") && glob.contains("a narrower pattern"),
        "{glob}"
    );
    assert_eq!(
        shared(&with("ds_train_*.bin", Some("ds_val_000000.bin"))),
        None
    );
    assert_eq!(shared(&with("corpus.bin", None)), None, "a held-out tail");
    assert_eq!(shared(&with("T.BIN", Some("ds_val_000000.bin"))), None);
}
