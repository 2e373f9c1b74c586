//! A small training run, its data and its checkpoint; the checkpoint broken every way
//! (missing, truncated and flipped files, forged manifests).

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{run, s, Case, STOKER};

/// A small text packed to `corpus.bin` + `corpus.vocab.json`, the data of every run here.
pub fn corpus(dir: &Path) -> PathBuf {
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

/// A valid training config over [`corpus`]'s data, writing to `dir/run`.
pub fn config_text(dir: &Path, run: &str) -> String {
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

/// A checkpoint broken in every way `stoker ckpt verify` must catch.
pub fn cases(dir: &Path, out: &mut Vec<Case>) {
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
            kind: "checkpoint",
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
