//! The bad-input corpus (docs/reliability.md): over 300 broken inputs, generated here
//! from valid ones (nothing binary is committed), each run through the `stoker` command
//! that reads it. Every case must end with a non-zero exit status (not a signal, not a
//! timeout), no panic, and a first error line that names the broken file (or, for a
//! config's values, the key). Formats: `.npy` (truncated at every header byte and along the
//! data, wrong magic and versions, broken header dicts: dtypes, shapes, keys), llm.c and
//! nanoGPT token shards (truncations, magic, version, token counts), sharded checkpoints
//! (missing, truncated and flipped files, forged manifests), training configs (syntax,
//! unknown keys, wrong types and values, missing data) and vocab JSON.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const STOKER: &str = env!("CARGO_BIN_EXE_stoker");

/// One broken input: what to run, and what the error must name.
struct Case {
    what: String,
    args: Vec<String>,
    names: Vec<String>,
}

fn run(args: &[String]) -> Output {
    Command::new("timeout")
        .args(["-k", "5", "30", STOKER])
        .args(args)
        .output()
        .unwrap()
}

fn check(c: &Case) -> Result<(), String> {
    let o = run(&c.args);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    let first = err
        .lines()
        .find(|l| l.contains("rror"))
        .unwrap_or_default()
        .to_string();
    let fail = |why: &str| Err(format!("{}: {why}\n--- stderr\n{err}", c.what));
    match o.status.code() {
        None => return fail("killed by a signal"),
        Some(0) => return fail("exit status 0: the broken input was accepted"),
        Some(124) | Some(137) => return fail("timed out"),
        Some(_) => {}
    }
    if err.contains("panicked") {
        return fail("panicked");
    }
    if !c.names.iter().any(|n| first.contains(n.as_str())) {
        return fail(&format!("the first error line names none of {:?}", c.names));
    }
    Ok(())
}

fn s(x: impl AsRef<std::ffi::OsStr>) -> String {
    x.as_ref().to_string_lossy().to_string()
}

// ---- .npy ----------------------------------------------------------------------------

fn npy_bytes(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.to_string();
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((h.len() as u16).to_le_bytes());
    out.extend(h.as_bytes());
    out.extend(data);
    out
}

fn valid_header(descr: &str, shape: &str) -> String {
    format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}")
}

fn npy_cases(dir: &Path, out: &mut Vec<Case>) {
    let data = vec![0u8; 64 * 8 * 4];
    let valid = npy_bytes(&valid_header("<f4", "(64, 8)"), &data);
    let header_end = valid.len() - data.len();
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    for n in 0..header_end {
        files.push((
            format!("npy truncated at header byte {n}"),
            valid[..n].to_vec(),
        ));
    }
    for k in 1..=40 {
        let n = header_end + k * data.len() / 41;
        files.push((
            format!("npy truncated in the data at {n}"),
            valid[..n].to_vec(),
        ));
    }
    for i in 0..6 {
        let mut v = valid.clone();
        v[i] ^= 0x20;
        files.push((format!("npy magic byte {i} changed"), v));
    }
    for major in [0u8, 4, 9] {
        let mut v = valid.clone();
        v[6] = major;
        files.push((format!("npy version {major}"), v));
    }
    let bad_headers = [
        valid_header("<f9", "(64, 8)"),
        valid_header("|V8", "(64, 8)"),
        valid_header("O", "(64, 8)"),
        valid_header(">c8", "(64, 8)"),
        valid_header("x", "(64, 8)"),
        valid_header("", "(64, 8)"),
        valid_header("<f4", "(99999999999, 8)"),
        valid_header("<f4", "(-1, 8)"),
        valid_header("<f4", "(64, 8, 99999999)"),
        valid_header("<f4", "('a',)"),
        valid_header("<f4", "64"),
        valid_header("<f4", "(18446744073709551615, 2)"),
        "{'descr': '<f4', 'fortran_order': True, 'shape': (64, 8), }".into(),
        "{'fortran_order': False, 'shape': (64, 8), }".into(),
        "{'descr': '<f4', 'fortran_order': False, }".into(),
        "{'descr': '<f4', 'shape': (64, 8), }".into(),
        "{]".into(),
        "not a dict at all".into(),
    ];
    for h in bad_headers {
        files.push((format!("npy header {h:?}"), npy_bytes(&h, &data)));
    }
    for (i, (what, bytes)) in files.into_iter().enumerate() {
        let p = dir.join(format!("npy{i}.npy"));
        std::fs::write(&p, bytes).unwrap();
        out.push(bench_case(what, &p));
    }
}

fn bench_case(what: String, p: &Path) -> Case {
    Case {
        what,
        args: [
            "bench",
            "loader",
            &s(p),
            "--context",
            "8",
            "--seconds",
            "0.05",
            "--max-batches",
            "2",
            "--workers",
            "0",
            "--batch",
            "2",
        ]
        .iter()
        .map(|x| x.to_string())
        .collect(),
        names: vec![s(p.file_name().unwrap())],
    }
}

// ---- token shards ---------------------------------------------------------------------

fn llmc(magic: i32, version: i32, ntok: i64, tokens: usize) -> Vec<u8> {
    let mut h = [0i32; 256];
    h[0] = magic;
    h[1] = version;
    h[2] = ntok as i32;
    let mut out: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
    out.extend(std::iter::repeat_n(0u8, 2 * tokens));
    out
}

fn token_cases(dir: &Path, out: &mut Vec<Case>) {
    let valid = llmc(20240520, 1, 300, 300);
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    for n in [4usize, 8, 12, 100, 1023, 1024, 1025, 1024 + 599] {
        files.push((format!("llm.c shard truncated at {n}"), valid[..n].to_vec()));
    }
    for (magic, version, ntok, tokens) in [
        (20240520, 0, 300, 300),
        (20240520, 2, 300, 300),
        (20240520, 99, 300, 300),
        (20240520, 1, 1_000_000_000, 300),
        (20240520, 1, -1, 300),
        (20240520, 1, 301, 300),
        (20240520, 1, 299, 300),
        (20240520, 1, 0, 300),
        (20240520, -7, 300, 300),
    ] {
        files.push((
            format!("llm.c header magic {magic} version {version} tokens {ntok} holding {tokens}"),
            llmc(magic, version, ntok, tokens),
        ));
    }
    for n in [1usize, 3, 1001] {
        files.push((format!("nanoGPT shard of odd length {n}"), vec![1u8; n]));
    }
    files.push(("empty token shard".into(), Vec::new()));
    for (i, (what, bytes)) in files.into_iter().enumerate() {
        let p = dir.join(format!("tok{i}.bin"));
        std::fs::write(&p, bytes).unwrap();
        out.push(bench_case(what, &p));
    }
}

// ---- a small run, its data and its checkpoint -----------------------------------------

fn corpus(dir: &Path) -> PathBuf {
    let text: String = (0..6000)
        .map(|i| ["the ", "cat ", "sat ", "on ", "a ", "mat "][(i * 7 + i / 5) % 6])
        .collect();
    std::fs::write(dir.join("text.txt"), text).unwrap();
    let o = Command::new(STOKER)
        .args(["pack", "text"])
        .arg(dir.join("corpus"))
        .arg(dir.join("text.txt"))
        .args(["--tokenizer", "char"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    dir.join("corpus.bin")
}

fn config_text(dir: &Path, run: &str) -> String {
    format!(
        r#"run_dir = "{run}"
seed = 1
precision = "fp32"
kernels = "direct"
[data]
train = "{train}"
vocab = "{vocab}"
[model]
kind = "gpt"
vocab = 16
context = 8
d_model = 16
n_layer = 1
n_head = 2
[batch]
micro_batch = 2
global_batch = 4
[optimizer]
kind = "adamw"
lr = 1e-3
[train]
steps = 2
checkpoint_every = 2
eval_every = 0
"#,
        run = dir.join(run).display(),
        train = dir.join("corpus.bin").display(),
        vocab = dir.join("corpus.vocab.json").display(),
    )
}

fn checkpoint_cases(dir: &Path, out: &mut Vec<Case>) {
    let cfg = dir.join("good.toml");
    std::fs::write(&cfg, config_text(dir, "good")).unwrap();
    let o = run(&[s("train"), s(&cfg), s("--no-progress")]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let good = dir.join("good/checkpoints/step_00000002");
    let mut n = 0;
    let mut case = |what: String, edit: &dyn Fn(&Path), names: &[&str]| {
        n += 1;
        let ck = dir.join(format!("ck{n}"));
        std::fs::create_dir_all(&ck).unwrap();
        for e in std::fs::read_dir(&good).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), ck.join(e.file_name())).unwrap();
        }
        edit(&ck);
        let mut names: Vec<String> = names.iter().map(|x| x.to_string()).collect();
        names.push(format!("ck{n}"));
        out.push(Case {
            what,
            args: vec![s("ckpt"), s("verify"), s(&ck)],
            names,
        });
    };
    let shard = "shard_00000.safetensors";
    for f in ["manifest.json", "COMMITTED", shard] {
        case(
            format!("checkpoint without {f}"),
            &|ck| std::fs::remove_file(ck.join(f)).unwrap(),
            &[f],
        );
    }
    let len = |ck: &Path, f: &str| std::fs::metadata(ck.join(f)).unwrap().len();
    for frac in [0.0, 0.01, 0.5, 0.99] {
        case(
            format!("shard truncated to {frac} of its length"),
            &move |ck| {
                let l = (len(ck, shard) as f64 * frac) as u64;
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(ck.join(shard))
                    .unwrap()
                    .set_len(l)
                    .unwrap();
            },
            &[shard],
        );
        case(
            format!("manifest truncated to {frac} of its length"),
            &move |ck| {
                let l = (len(ck, "manifest.json") as f64 * frac) as u64;
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(ck.join("manifest.json"))
                    .unwrap()
                    .set_len(l)
                    .unwrap();
            },
            &["manifest.json", "COMMITTED"],
        );
    }
    for text in ["", "zz", "00000000", "ffffffff trailing", "\u{0}\u{1}"] {
        case(
            format!("commit marker {text:?}"),
            &move |ck| std::fs::write(ck.join("COMMITTED"), text).unwrap(),
            &["COMMITTED", "manifest.json"],
        );
    }
    for k in 0..20 {
        case(
            format!("shard byte {k}/20 flipped"),
            &move |ck| {
                let mut b = std::fs::read(ck.join(shard)).unwrap();
                let i = (b.len() - 1) * k / 19;
                b[i] ^= 0x41;
                std::fs::write(ck.join(shard), b).unwrap();
            },
            &[shard],
        );
    }
    for k in 0..10 {
        case(
            format!("manifest byte {k}/10 flipped"),
            &move |ck| {
                let mut b = std::fs::read(ck.join("manifest.json")).unwrap();
                let i = (b.len() - 1) * k / 9;
                b[i] ^= 0x01;
                std::fs::write(ck.join("manifest.json"), b).unwrap();
            },
            &["manifest.json"],
        );
    }
    // Forged manifests: edited, with the commit marker recomputed to match.
    let forge = |from: &'static str, to: &'static str| {
        move |ck: &Path| {
            let m = std::fs::read_to_string(ck.join("manifest.json")).unwrap();
            assert!(m.contains(from), "{from} not in the manifest");
            let m = m.replacen(from, to, 1);
            std::fs::write(ck.join("manifest.json"), &m).unwrap();
            std::fs::write(
                ck.join("COMMITTED"),
                format!("{:08x}\n", crc32fast::hash(m.as_bytes())),
            )
            .unwrap();
        }
    };
    for (from, to, names) in [
        ("\"version\": 3", "\"version\": 99", &["manifest.json"][..]),
        (
            "\"format\": \"stoker-checkpoint\"",
            "\"format\": \"x\"",
            &["manifest.json"],
        ),
        ("\"start\": 0", "\"start\": 1", &["manifest.json"]),
        ("\"crc32\": ", "\"crc32\": 1", &[shard]),
        ("\"bytes\": ", "\"bytes\": 9", &[shard, "manifest.json"]),
        ("{", "{\"surprise\": 1,", &["manifest.json"]),
        ("\"layout\"", "\"layuot\"", &["manifest.json"]),
        (
            "\"file\": \"shard_00000",
            "\"file\": \"../../etc/shard_00000",
            &["manifest.json", "shard_00000"],
        ),
    ] {
        case(
            format!("manifest forged: {from} -> {to}"),
            &forge(from, to),
            names,
        );
    }
}

// ---- configs and vocab ----------------------------------------------------------------

fn config_cases(dir: &Path, out: &mut Vec<Case>) {
    let base = config_text(dir, "cfg");
    let mut n = 0;
    let mut case = |what: String, text: String, key: &str| {
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
        (
            "seed = 1",
            "seed = 1\n[parallel]\noffload_optimizer = true",
            "offload_optimizer",
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
        );
    }
    case("config: empty".into(), String::new(), "");
    case(
        "config: binary".into(),
        "\u{0}\u{1}\u{2}\u{fffd}".into(),
        "",
    );
    let missing_train = base.replacen(
        &format!("train = \"{}\"\n", dir.join("corpus.bin").display()),
        "",
        1,
    );
    case("config: no data.train".into(), missing_train, "train");
    // Vocab JSON.
    for (i, (text, key)) in [
        ("not json", "vocab"),
        ("{\"tokens\": 7}", "vocab"),
        ("{\"tokens\": [\"a\", \"b\", \"c\", \"d\", \"e\", \"f\", \"g\", \"h\", \"i\", \"j\", \"k\", \"l\", \"m\", \"n\", \"o\", \"p\", \"q\"]}", "vocab"),
    ]
    .into_iter()
    .enumerate()
    {
        let v = dir.join(format!("vocab{i}.json"));
        std::fs::write(&v, text).unwrap();
        let t = base.replacen(&s(dir.join("corpus.vocab.json")), &s(&v), 1);
        // "vocab" is in the key (`data.vocab`, `model.vocab`) and in the file's name.
        case(format!("vocab json {text:?}"), t, key);
    }
}

#[test]
fn every_case_of_the_bad_input_corpus_fails_cleanly_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    corpus(dir);
    let mut cases = Vec::new();
    npy_cases(dir, &mut cases);
    token_cases(dir, &mut cases);
    checkpoint_cases(dir, &mut cases);
    config_cases(dir, &mut cases);
    let failures: Vec<String> = cases.iter().filter_map(|c| check(c).err()).collect();
    eprintln!(
        "bad-input corpus: {} cases, {} failed cleanly naming the file or key",
        cases.len(),
        cases.len() - failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} cases:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n\n")
    );
    assert!(cases.len() >= 300, "only {} cases", cases.len());
}
