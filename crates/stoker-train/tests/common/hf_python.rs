//! The Pythons with torch and transformers that the Hugging Face tests check against:
//! `STOKER_HF_PYTHONPATH` where set (one PYTHONPATH), else each transformers version
//! scripts/install-hf.sh has put in the cache (`make test-hf` installs the 4.x and 5.x
//! pins beside one torch).

use std::path::{Path, PathBuf};
use std::process::Command;

use stoker_train::trainer::Trainer;

/// The transformers versions `make test-hf` installs: the last 4.x and the current 5.x.
pub const TRANSFORMERS: [&str; 2] = ["4.57.1", "5.25.0"];
/// The torch they share.
pub const TORCH: &str = "2.15.0";

/// Every PYTHONPATH here under which `import torch, transformers` works.
pub fn hf_pythons() -> Vec<String> {
    let candidates: Vec<String> = match std::env::var("STOKER_HF_PYTHONPATH") {
        Ok(p) => vec![p],
        Err(_) => {
            let Some(cache) = std::env::var_os("STOKER_CACHE_DIR")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/stoker"))
                })
            else {
                return vec![];
            };
            TRANSFORMERS
                .iter()
                .map(|v| {
                    format!(
                        "{}:{}",
                        cache.join(format!("hf-transformers-{v}")).display(),
                        cache.join(format!("hf-torch-{TORCH}")).display()
                    )
                })
                .collect()
        }
    };
    candidates
        .into_iter()
        .filter(|p| {
            Command::new("python3")
                .args(["-c", "import torch, transformers"])
                .env("PYTHONPATH", p)
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .collect()
}

/// [`hf_pythons`], or an empty list after saying loudly that `test` cannot run here.
pub fn hf_pythons_or_skip(test: &str) -> Vec<String> {
    let pythons = hf_pythons();
    if pythons.is_empty() {
        stoker_testkit::skip(
            test,
            "torch + transformers not installed (run `make test-hf` or scripts/install-hf.sh; ~4 GB with torch's CUDA libraries)",
        );
    }
    pythons
}

/// `trainer`'s logits for the token ids `input` `(B, T)`, flattened.
pub fn logits_of(trainer: &Trainer, input: &candle_core::Tensor) -> Vec<f32> {
    trainer.sync_vars().unwrap();
    let logits = trainer.model().forward(&trainer.fx(), input).unwrap();
    logits.flatten_all().unwrap().to_vec1().unwrap()
}

/// Writes `input`'s token ids and `trainer`'s logits for them into `dir` as
/// `tokens.npy` (`<i8`, `[B, T]`) and `logits.npy` (`<f4`, `[B T, V]`), the check
/// scripts' inputs.
pub fn write_tokens_and_logits(
    dir: &Path,
    trainer: &Trainer,
    input: &candle_core::Tensor,
) -> (PathBuf, PathBuf) {
    let (b, t) = input.dims2().unwrap();
    let logits = logits_of(trainer, input);
    let tokens: Vec<i64> = input.flatten_all().unwrap().to_vec1().unwrap();
    let (tp, lp) = (dir.join("tokens.npy"), dir.join("logits.npy"));
    stoker_testkit::write_npy(&tp, "<i8", &[b, t], bytemuck::cast_slice(&tokens));
    let vocab = logits.len() / (b * t);
    stoker_testkit::write_npy(&lp, "<f4", &[b * t, vocab], bytemuck::cast_slice(&logits));
    (tp, lp)
}

/// Runs `scripts/ref/SCRIPT` with `args` under the Python at `pythonpath` (5 minutes at
/// most), prints what it said, and fails the test where it failed.
pub fn run_check_script(script: &str, args: &[&Path], pythonpath: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../scripts/ref")
        .join(script);
    let o = Command::new("timeout")
        .args(["300", "python3"])
        .arg(path)
        .args(args)
        .env("PYTHONPATH", pythonpath)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    eprintln!("{text}");
    assert!(o.status.success(), "transformers check failed: {text}");
}
