//! Offload's work on the host, on one thread (the baseline) and over rayon's pool (what
//! the host backend runs long launches on), with the ratio of the two measured in the
//! same run (docs/benchmarks.md):
//! - parameter offload, per block: a GPT-2 124M block's gradients (7,087,872 f32s) added
//!   into the host's sum;
//! - the offloaded optimizer, per step: one AdamW update of GPT-2 124M's 124,475,904
//!   parameters with a bf16 compute copy.
//!
//!   cargo run --release -p stoker-gpu --example offload_host_add [REPS]

fn main() -> Result<(), stoker_gpu::GpuError> {
    let reps = std::env::args()
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(5);
    println!(
        "offload's host work, median of {reps}, one thread against rayon's {} threads:",
        rayon::current_num_threads()
    );
    let row = |what: &str, w: stoker_gpu::offload_bench::HostWork| {
        println!(
            "  {what:<52} {:>9.0} us {:>9.0} us  {:.2}x",
            w.one_thread_us,
            w.pool_us,
            w.pool_us / w.one_thread_us
        )
    };
    let block = 7_087_872;
    row(
        "a GPT-2 block's gradients added into the sum",
        stoker_gpu::offload_bench::time_host_add(block, reps * 3)?,
    );
    row(
        "AdamW over GPT-2 124M (bf16 copy)",
        stoker_gpu::offload_bench::time_host_adamw(124_475_904, reps)?,
    );
    Ok(())
}
