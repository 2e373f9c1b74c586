//! The Pythons with torch and transformers that the Hugging Face tests check against:
//! `STOKER_HF_PYTHONPATH` where set (one PYTHONPATH), else each transformers version
//! scripts/install-hf.sh has put in the cache (`make test-hf` installs the 4.x and 5.x
//! pins beside one torch).

use std::path::PathBuf;
use std::process::Command;

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
