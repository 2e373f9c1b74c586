//! Training configs (syntax, unknown keys, wrong types and values, missing data) and vocab
//! JSON.

use std::path::Path;

use super::checkpoints::config_text;
use super::{s, Case};

/// Training configs through `stoker train`, and vocab JSON files they point to.
pub fn cases(dir: &Path, out: &mut Vec<Case>) {
    let base = config_text(dir, "cfg");
    let mut n = 0;
    let mut case = |what: String, text: String, key: &str, kind: &'static str| {
        n += 1;
        let p = dir.join(format!("cfg{n}.toml"));
        std::fs::write(&p, text).unwrap();
        let mut names = vec![s(p.file_name().unwrap())];
        if !key.is_empty() {
            names.push(key.to_string());
        }
        out.push(Case {
            what,
            args: vec![s("train"), s(&p), s("--no-progress")],
            names,
            kind,
        });
    };
    let edits: Vec<(&str, &str, &str)> = vec![
        ("seed = 1", "seed = 1\nsurprise = 2", "surprise"),
        ("kind = \"gpt\"", "kind = \"gpt\"\nsurprise = 2", "surprise"),
        (
            "micro_batch = 2",
            "micro_batch = 2\nsurprise = 2",
            "surprise",
        ),
        ("lr = 1e-3", "lr = 1e-3\nsurprise = 2", "surprise"),
        ("steps = 2", "steps = 2\nsurprise = 2", "surprise"),
        ("[data]", "[data]\nsurprise = 2", "surprise"),
        ("steps = 2", "steps = \"two\"", "steps"),
        ("lr = 1e-3", "lr = \"fast\"", "lr"),
        ("micro_batch = 2", "micro_batch = -1", "micro_batch"),
        ("micro_batch = 2", "micro_batch = 0", "micro_batch"),
        ("n_head = 2", "n_head = 3", "n_head"),
        ("vocab = 16", "vocab = 0", "vocab"),
        ("context = 8", "context = 0", "context"),
        ("precision = \"fp32\"", "precision = \"fp7\"", "precision"),
        ("kernels = \"direct\"", "kernels = \"magic\"", "kernels"),
        ("global_batch = 4", "global_batch = 5", "global_batch"),
        ("kind = \"adamw\"", "kind = \"adamx\"", "kind"),
        ("kind = \"gpt\"", "kind = \"transformer9000\"", "kind"),
        ("d_model = 16", "d_model = 16.5", "d_model"),
        ("n_layer = 1", "n_layer = \"one\"", "n_layer"),
        (
            "seed = 1",
            "seed = 1\n[parallel]\nstrategy = \"zero4\"",
            "strategy",
        ),
        (
            "seed = 1",
            "seed = 1\n[parallel]\nbackend = \"carrier pigeon\"",
            "backend",
        ),
        (
            "seed = 1",
            "seed = 1\n[parallel]\ntimeout_s = -1",
            "timeout_s",
        ),
        (
            "seed = 1",
            "seed = 1\n[parallel]\nbucket_cap_mb = 0",
            "bucket_cap_mb",
        ),
        (
            "seed = 1",
            "seed = 1\n[parallel]\ndeterministic = 3",
            "deterministic",
        ),
        (
            "seed = 1",
            "seed = 1\n[parallel]\nstrategy = \"zero3\"\ndeterministic = true",
            "deterministic",
        ),
        // After the last top-level key, so that the table holds only what it is given.
        (
            "kernels = \"direct\"",
            "kernels = \"direct\"\n[parallel]\noffload_optimizer = true",
            "parallel.offload_optimizer",
        ),
        // A GPU device: a malformed one, and (this build has no CUDA) a well-formed one
        // with everything else a GPU run needs.
        ("seed = 1", "seed = 1\ndevice = \"cuda:x\"", "`device`"),
        (
            "kernels = \"direct\"",
            "kernels = \"composed\"\ndevice = \"cuda\"\n[parallel]\noffload_optimizer = true",
            "`device`",
        ),
        ("corpus.bin", "no-such-file.bin", "no-such-file.bin"),
        ("[data]\ntrain = ", "[data]\ntrain = 7\nx = ", "train"),
        ("[model]", "[model", ""),
        ("seed = 1", "seed = 1\nseed = 2", "seed"),
        ("run_dir =", "run_dir", ""),
        ("[batch]", "[batch]\n[batch]", "batch"),
    ];
    for (from, to, key) in edits {
        assert!(base.contains(from), "{from}");
        case(
            format!("config: {from:?} -> {to:?}"),
            base.replacen(from, to, 1),
            key,
            // A data file that does not exist is an I/O error, the rest the config's.
            if key == "no-such-file.bin" {
                "io"
            } else {
                "config"
            },
        );
    }
    case("config: empty".into(), String::new(), "", "config");
    case(
        "config: binary".into(),
        "\u{0}\u{1}\u{2}\u{fffd}".into(),
        "",
        "config",
    );
    let missing_train = base.replacen(
        &format!("train = \"{}\"\n", dir.join("corpus.bin").display()),
        "",
        1,
    );
    case(
        "config: no data.train".into(),
        missing_train,
        "train",
        "config",
    );
    // Vocab JSON.
    for (i, (text, key, kind)) in [
        ("not json", "vocab", "format"),
        ("{\"tokens\": 7}", "vocab", "format"),
        ("{\"tokens\": [\"a\", \"b\", \"c\", \"d\", \"e\", \"f\", \"g\", \"h\", \"i\", \"j\", \"k\", \"l\", \"m\", \"n\", \"o\", \"p\", \"q\"]}", "vocab", "config"),
    ]
    .into_iter()
    .enumerate()
    {
        let v = dir.join(format!("vocab{i}.json"));
        std::fs::write(&v, text).unwrap();
        let t = base.replacen(&s(dir.join("corpus.vocab.json")), &s(&v), 1);
        // "vocab" is in the key (`data.vocab`, `model.vocab`) and in the file's name; more
        // tokens than `model.vocab` is the config's fault, not the file's.
        case(format!("vocab json {text:?}"), t, key, kind);
    }
}
