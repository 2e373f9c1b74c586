//! Parameter offload's host side per block: a GPT-2 124M block's gradients (7,087,872
//! f32s) added into the host's sum by `add_into`'s host build on one thread (the
//! baseline) and over the host's threads, as the offload does; the ratio of the two,
//! measured in the same run (docs/benchmarks.md).
//!   cargo run --release -p stoker-gpu --example offload_host_add [REPS]

fn main() -> Result<(), stoker_gpu::GpuError> {
    let reps = std::env::args()
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(15);
    let elems = 7_087_872;
    let (one, threads) = stoker_gpu::copy_bench::time_host_add(elems, reps)?;
    let gbs = |us: f64| (elems * 12) as f64 / (us * 1e-6) / 1e9;
    println!(
        "add a GPT-2 block's gradients ({elems} f32) into the host's sum, median of {reps}, {} threads:",
        rayon::current_num_threads()
    );
    println!("  one thread   {:>8.0} us  {:>5.1} GB/s", one, gbs(one));
    println!(
        "  threads      {:>8.0} us  {:>5.1} GB/s  {:.2}x of one thread's time",
        threads,
        gbs(threads),
        threads / one
    );
    Ok(())
}
