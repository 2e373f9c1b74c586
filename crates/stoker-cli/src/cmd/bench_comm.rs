//! `stoker bench comm` (under `mpirun -n N`): bus bandwidth of all_reduce, reduce_scatter
//! and all_gather from 4 KiB to 256 MiB through stoker's communicator, against the same
//! MPI call made directly (blocking, in place where MPI allows) in the same run, with
//! nccl-tests' definitions: algbw = bytes / time; all_reduce busbw = algbw x 2(n-1)/n;
//! reduce_scatter and all_gather busbw = algbw x (n-1)/n (bytes = the whole buffer: the
//! input of reduce_scatter, the output of all_gather). Each size alternates the two
//! variants rep by rep and reports rank 0's median time.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use stoker_comm::mpi::MpiComm;
use stoker_comm::{CommExt, Communicator, Op};

/// Arguments of `stoker bench comm`.
#[derive(clap::Args)]
pub struct CommBenchArgs {
    /// Smallest buffer, KiB (sizes grow by 4x).
    #[arg(long, default_value_t = 4)]
    min_kib: usize,
    /// Largest buffer, MiB.
    #[arg(long, default_value_t = 256)]
    max_mib: usize,
    /// Time budget per collective and size, seconds (at least 3 reps each).
    #[arg(long, default_value_t = 0.4)]
    seconds: f64,
    /// Also write the table as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One row of the table.
#[derive(serde::Serialize)]
struct Row {
    op: &'static str,
    bytes: usize,
    stoker_busbw_gbs: f64,
    direct_busbw_gbs: f64,
    ratio: f64,
    reps: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs `stoker bench comm`.
pub fn run(a: CommBenchArgs) -> anyhow::Result<()> {
    let launched = stoker_comm::mpi::launched_world();
    if !matches!(launched, Some((_, n)) if n > 1) {
        anyhow::bail!("stoker bench comm measures collectives between ranks: run it under `mpirun -n 2 stoker bench comm`");
    }
    let comm = MpiComm::init(Duration::from_secs(120)).context("starting MPI")?;
    // An error on one rank ends the job (the others would wait in a collective).
    if let Err(e) = measure(&comm, &a) {
        comm.abort(1, &format!("error: {e:#}"));
    }
    comm.finalize(Duration::from_secs(10), 0);
    Ok(())
}

fn measure(comm: &MpiComm, a: &CommBenchArgs) -> anyhow::Result<()> {
    let (n, rank) = (comm.world_size(), comm.rank());
    let mut sizes = Vec::new();
    let mut s = a.min_kib * 1024;
    while s <= a.max_mib << 20 {
        sizes.push(s);
        s *= 4;
    }
    let mut rows = Vec::new();
    if rank == 0 {
        println!("{n} ranks, MPI backend; busbw in GB/s (1e9 bytes/s), nccl-tests definitions; ratio = stoker / direct MPI call");
        println!(
            "{:<15} {:>10} {:>12} {:>12} {:>7} {:>6}",
            "collective", "bytes", "stoker", "direct MPI", "ratio", "reps"
        );
    }
    for op in [Op::AllReduce, Op::ReduceScatter, Op::AllGather] {
        for &bytes in &sizes {
            let len = bytes / 4 / n * n; // divisible into equal segments
            let seg = len / n;
            let counts = vec![seg; n];
            let mut full = vec![1f32; len];
            let mut part = vec![1f32; seg];
            let mut run = |direct: bool| -> anyhow::Result<f64> {
                comm.barrier()?;
                let t0 = Instant::now();
                match (op, direct) {
                    (Op::AllReduce, false) => comm.all_reduce(&mut full)?,
                    (Op::AllReduce, true) => comm.all_reduce_direct(&mut full)?,
                    (Op::ReduceScatter, false) => comm.reduce_scatter(&full, &counts, &mut part)?,
                    (Op::ReduceScatter, true) => comm.reduce_scatter_direct(&full, &mut part)?,
                    (_, false) => comm.all_gather(&part, &counts, &mut full)?,
                    (_, true) => comm.all_gather_direct(&part, &mut full)?,
                }
                // All-reduces of ones grow without bound: keep the values small.
                if op == Op::AllReduce {
                    full[0] = 1.0;
                }
                Ok(t0.elapsed().as_secs_f64())
            };
            // Warm up, then size the reps from rank 0's estimate (every rank must agree).
            let est = (run(false)? + run(true)?) / 2.0;
            let mut reps = [((a.seconds / 2.0 / est.max(1e-7)) as u64).clamp(3, 2000)];
            comm.broadcast(&mut reps, 0)?;
            let (mut ts, mut td) = (Vec::new(), Vec::new());
            for _ in 0..reps[0] {
                ts.push(run(false)?);
                td.push(run(true)?);
            }
            let factor = match op {
                Op::AllReduce => 2.0 * (n - 1) as f64 / n as f64,
                _ => (n - 1) as f64 / n as f64,
            };
            let busbw = |t: f64| (len * 4) as f64 / t * factor / 1e9;
            let (bs, bd) = (busbw(median(ts)), busbw(median(td)));
            let row = Row {
                op: op.name(),
                bytes: len * 4,
                stoker_busbw_gbs: bs,
                direct_busbw_gbs: bd,
                ratio: bs / bd,
                reps: reps[0] as usize,
            };
            if rank == 0 {
                println!(
                    "{:<15} {:>10} {:>12.3} {:>12.3} {:>7.3} {:>6}",
                    row.op, row.bytes, bs, bd, row.ratio, row.reps
                );
            }
            rows.push(row);
        }
    }
    if rank == 0 {
        let from_1mib: Vec<f64> = rows
            .iter()
            .filter(|r| r.bytes >= 1 << 20)
            .map(|r| r.ratio)
            .collect();
        let worst = from_1mib.iter().cloned().fold(f64::INFINITY, f64::min);
        let mean = from_1mib.iter().sum::<f64>() / from_1mib.len().max(1) as f64;
        println!("from 1 MiB: stoker / direct busbw ratio mean {mean:.3}, lowest {worst:.3} (goal >= 0.95)");
        if let Some(path) = &a.json {
            std::fs::write(path, serde_json::to_string_pretty(&rows)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}
