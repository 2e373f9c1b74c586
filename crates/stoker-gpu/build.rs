//! Compiles stoker's GPU kernels (cuda/) twice: always for the host with the system C++
//! compiler (the CPU runs every kernel's body, lane by lane, in tests), and with the
//! `cuda` feature for the device with nvcc, into a fatbin the crate embeds.
//!
//! Both builds keep multiplies and adds apart (`-ffp-contract=off`, `--fmad=false`) so
//! that their results agree bit for bit (cuda/portable.h).

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let cuda = Path::new("cuda");
    // The whole folder: cargo scans a directory for changes, so a kernel file added to
    // cuda/ops rebuilds both builds without a list here to keep in step.
    println!("cargo:rerun-if-changed=cuda");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file(cuda.join("host.cpp"))
        .flag("-ffp-contract=off")
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(3)
        .compile("stoker_gpu_host");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        device(cuda);
    }
}

/// nvcc -> $OUT_DIR/kernels.fatbin: SASS for the compute capability in
/// `CUDA_COMPUTE_CAP` (default 90, the H100 / H200) and PTX for newer ones.
fn device(cuda: &Path) {
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let fatbin = out.join("kernels.fatbin");
    let status = Command::new(&nvcc)
        .args(["-std=c++17", "-O3", "--fmad=false", "-fatbin"])
        .arg(format!("-gencode=arch=compute_{cap},code=sm_{cap}"))
        .arg(format!("-gencode=arch=compute_{cap},code=compute_{cap}"))
        .arg(cuda.join("kernels.cu"))
        .arg("-o")
        .arg(&fatbin)
        .status()
        .unwrap_or_else(|e| {
            panic!("stoker-gpu: cannot run {nvcc} ({e}); put nvcc on PATH (scripts/check-cuda.sh)")
        });
    assert!(
        status.success(),
        "stoker-gpu: {nvcc} failed on cuda/kernels.cu"
    );
}
