//! `stoker bench loader`: loader throughput per setting, with a memcpy baseline from the same run.

use std::time::Instant;

use super::dataset_args::{bench_json, sample_bytes, trial_row, DatasetArgs, TRIAL_HEADER};
use stoker_data::{AnyDataset, Dataset};

/// Arguments of `stoker bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchWhat,
}

#[derive(clap::Subcommand)]
enum BenchWhat {
    /// Measure the data loader: samples/s, MB/s, consumer wait, worker busy, peak RSS.
    Loader(LoaderBenchArgs),
    /// Collective bus bandwidth through stoker's communicator vs the direct MPI call (under mpirun).
    Comm(super::bench_comm::CommBenchArgs),
    /// The data-parallel step of the config's strategy (DDP, ZeRO-1/2/3): step time, exposed communication, overlap, against the plan (1 rank, or under mpirun).
    Ddp(super::bench_ddp::DdpBenchArgs),
    /// stoker's GPU kernels on the GPU against their host build (bit for bit), then each one's time at GPT-2 124M's shapes (a `cuda` build on a GPU).
    GpuKernels(super::bench_gpu::GpuKernelsArgs),
}

#[derive(clap::Args)]
struct LoaderBenchArgs {
    #[command(flatten)]
    data: DatasetArgs,
    /// Worker counts to measure, comma-separated (0 = load in the consumer's thread).
    #[arg(long, default_value = "0,1,2,4", value_delimiter = ',')]
    workers: Vec<usize>,
    /// prefetch_factor values to measure, comma-separated.
    #[arg(long, default_value = "2", value_delimiter = ',')]
    prefetch: Vec<usize>,
    /// Write the results as JSON (the format `stoker plan --loader-bench` reads).
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// Runs `stoker bench`.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let a = match args.what {
        BenchWhat::Loader(a) => a,
        BenchWhat::Comm(a) => return super::bench_comm::run(a),
        BenchWhat::Ddp(a) => return super::bench_ddp::run(a),
        BenchWhat::GpuKernels(a) => return super::bench_gpu::run(a),
    };
    let ds = a.data.open()?;
    let n = ds.len();
    let sb = sample_bytes(&ds);
    println!(
        "dataset {} ({}): {} samples x {} bytes = {:.1} MB; batch {}, {}",
        a.data.dataset.display(),
        ds.kind(),
        n,
        sb,
        (n * sb) as f64 / 1e6,
        a.data.batch(),
        if a.data.sequential {
            "sequential"
        } else {
            "shuffled"
        }
    );
    let baseline = memcpy_baseline(&ds, a.data.batch());
    println!("{TRIAL_HEADER}  x memcpy");
    let mut trials = Vec::new();
    for &w in &a.workers {
        for &p in &a.prefetch {
            if w == 0
                && trials
                    .iter()
                    .any(|t: &stoker_data::measure::Trial| t.num_workers == 0)
            {
                continue; // prefetch is meaningless without workers
            }
            let t = a.data.trial(&ds, w, p)?;
            let ratio = baseline
                .map(|b| format!("{:>8.2}", t.mb_per_s / b))
                .unwrap_or_else(|| "     n/a".into());
            println!("{}  {ratio}", trial_row(&t));
            trials.push(t);
        }
    }
    match baseline {
        Some(b) => println!("baseline: single-thread memcpy of the same bytes in batch-sized chunks, {b:.0} MB/s (same run)"),
        None => println!("baseline: n/a (samples are decoded, not copied)"),
    }
    if let Some(path) = &a.json {
        std::fs::write(
            path,
            serde_json::to_string_pretty(&bench_json(&a.data, &ds, &trials))?,
        )?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// MB/s of copying the dataset's bytes, batch by batch, into one reused buffer: the ceiling
/// for a loader whose samples need no decoding. Best of 3 passes (the first warms the cache).
fn memcpy_baseline(ds: &AnyDataset, batch: usize) -> Option<f64> {
    let AnyDataset::Arrays(a) = ds else {
        return None;
    };
    let arrays = a.arrays();
    let max_chunk = arrays.iter().map(|x| x.row_bytes() * batch).max()?;
    let mut buf = vec![0u8; max_chunk];
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t0 = Instant::now();
        let mut bytes = 0usize;
        for x in arrays {
            let data = x.bytes();
            for chunk in data.chunks(x.row_bytes().max(1) * batch) {
                buf[..chunk.len()].copy_from_slice(chunk);
                std::hint::black_box(&buf);
                bytes += chunk.len();
            }
        }
        best = best.max(bytes as f64 / 1e6 / t0.elapsed().as_secs_f64());
    }
    Some(best)
}
