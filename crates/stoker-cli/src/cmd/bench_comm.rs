//! `stoker bench comm` (under `mpirun -n N`): bus bandwidth of all_reduce, reduce_scatter
//! and all_gather from 4 KiB to 256 MiB through stoker's communicator, against the same
//! MPI call made directly (blocking, in place where MPI allows) in the same run, with
//! nccl-tests' definitions: algbw = bytes / time; all_reduce busbw = algbw x 2(n-1)/n;
//! reduce_scatter and all_gather busbw = algbw x (n-1)/n (bytes = the whole buffer: the
//! input of reduce_scatter, the output of all_gather). Each size alternates the two
//! variants rep by rep and reports rank 0's median time. A third column times the
//! non-blocking form (start, then wait), which DDP's gradient buckets use.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use stoker_comm::mpi::MpiComm;
use stoker_comm::{Buffer, CommExt, Communicator, Op};

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
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Also write the table as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The largest buffer `--max-mib` takes: 64 GiB, beyond any host's collective buffers.
const MAX_MIB: usize = 1 << 16;

/// One row of the table.
#[derive(serde::Serialize)]
struct Row {
    op: &'static str,
    bytes: usize,
    stoker_busbw_gbs: f64,
    stoker_nonblocking_busbw_gbs: f64,
    direct_busbw_gbs: f64,
    ratio: f64,
    nonblocking_ratio: f64,
    reps: usize,
}

fn f32s(b: Buffer) -> Vec<f32> {
    match b {
        Buffer::F32(v) => v,
        _ => unreachable!("f32 in, f32 out"),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs `stoker bench comm`.
pub fn run(a: CommBenchArgs) -> anyhow::Result<()> {
    // Checked before MPI starts, on every rank alike: sizes grow by 4x from the smallest,
    // which must therefore be above 0 (0 never grew, and the list filled memory).
    anyhow::ensure!(
        a.min_kib >= 1,
        "--min-kib {}: expected at least 1 KiB",
        a.min_kib
    );
    anyhow::ensure!(
        (1..=MAX_MIB).contains(&a.max_mib),
        "--max-mib {}: expected 1 to {MAX_MIB} MiB",
        a.max_mib
    );
    anyhow::ensure!(
        a.min_kib <= a.max_mib * 1024,
        "--min-kib {} is above --max-mib {} ({} KiB): no size to measure",
        a.min_kib,
        a.max_mib,
        a.max_mib * 1024
    );
    anyhow::ensure!(
        a.seconds.is_finite() && a.seconds > 0.0,
        "--seconds {}: expected a positive number",
        a.seconds
    );
    let launched = stoker_comm::mpi::launched_world();
    if !matches!(launched, Some((_, n)) if n > 1) {
        anyhow::bail!("stoker bench comm measures collectives between ranks: run it under `mpirun -n 2 stoker bench comm`");
    }
    let comm = MpiComm::init(Duration::from_secs(120)).context("starting MPI")?;
    // An error on one rank ends the job (the others would wait in a collective).
    if let Err(e) = measure(&comm, &a) {
        let kind = crate::error_kind::ErrorKind::of(&e).name();
        comm.abort(
            1,
            &format!("error[{kind}]: {}", crate::error_text::chain_text(&e)),
        );
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
            "{:<15} {:>10} {:>9} {:>12} {:>11} {:>7} {:>9} {:>6}",
            "collective",
            "bytes",
            "stoker",
            "non-blocking",
            "direct MPI",
            "ratio",
            "nb ratio",
            "reps"
        );
    }
    for op in [Op::AllReduce, Op::ReduceScatter, Op::AllGather] {
        for &bytes in &sizes {
            let len = bytes / 4 / n * n; // divisible into equal segments
            let seg = len / n;
            let counts = vec![seg; n];
            let mut full = vec![1f32; len];
            let mut part = vec![1f32; seg];
            // 0: stoker blocking, 1: stoker non-blocking (start + wait), 2: direct MPI.
            let mut run = |variant: u8| -> anyhow::Result<f64> {
                comm.barrier()?;
                let t0 = Instant::now();
                match (op, variant) {
                    (Op::AllReduce, 0) => comm.all_reduce(&mut full)?,
                    (Op::AllReduce, 1) => {
                        let b = std::mem::take(&mut full);
                        full = comm.start_all_reduce(Buffer::F32(b))?.wait_vec()?;
                    }
                    (Op::AllReduce, _) => comm.all_reduce_direct(&mut full)?,
                    (Op::ReduceScatter, 0) => comm.reduce_scatter(&full, &counts, &mut part)?,
                    (Op::ReduceScatter, 1) => {
                        let (i, o) = (std::mem::take(&mut full), std::mem::take(&mut part));
                        let p =
                            comm.start_reduce_scatter(Buffer::F32(i), &counts, Buffer::F32(o))?;
                        let (o, i) = p.wait_with_input()?;
                        part = f32s(o);
                        full = f32s(i.expect("MPI gives the input back"));
                    }
                    (Op::ReduceScatter, _) => comm.reduce_scatter_direct(&full, &mut part)?,
                    (_, 0) => comm.all_gather(&part, &counts, &mut full)?,
                    (_, 1) => {
                        let (i, o) = (std::mem::take(&mut part), std::mem::take(&mut full));
                        let p = comm.start_all_gather(Buffer::F32(i), &counts, Buffer::F32(o))?;
                        let (o, i) = p.wait_with_input()?;
                        full = f32s(o);
                        part = f32s(i.expect("MPI gives the input back"));
                    }
                    (_, _) => comm.all_gather_direct(&part, &mut full)?,
                }
                // All-reduces of ones grow without bound: keep the values small.
                if op == Op::AllReduce {
                    full[0] = 1.0;
                }
                Ok(t0.elapsed().as_secs_f64())
            };
            // Warm up, then size the reps from rank 0's estimate (every rank must agree).
            let est = (run(0)? + run(1)? + run(2)?) / 3.0;
            let mut reps = [((a.seconds / 3.0 / est.max(1e-7)) as u64).clamp(5, 2000)];
            comm.broadcast(&mut reps, 0)?;
            let (mut ts, mut tn, mut td) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..reps[0] {
                ts.push(run(0)?);
                tn.push(run(1)?);
                td.push(run(2)?);
            }
            let factor = match op {
                Op::AllReduce => 2.0 * (n - 1) as f64 / n as f64,
                _ => (n - 1) as f64 / n as f64,
            };
            let busbw = |t: f64| (len * 4) as f64 / t * factor / 1e9;
            let (bs, bn, bd) = (busbw(median(ts)), busbw(median(tn)), busbw(median(td)));
            let row = Row {
                op: op.name(),
                bytes: len * 4,
                stoker_busbw_gbs: bs,
                stoker_nonblocking_busbw_gbs: bn,
                direct_busbw_gbs: bd,
                ratio: bs / bd,
                nonblocking_ratio: bn / bd,
                reps: reps[0] as usize,
            };
            if rank == 0 {
                println!(
                    "{:<15} {:>10} {:>9.3} {:>12.3} {:>11.3} {:>7.3} {:>9.3} {:>6}",
                    row.op, row.bytes, bs, bn, bd, row.ratio, row.nonblocking_ratio, row.reps
                );
            }
            rows.push(row);
        }
    }
    if rank == 0 {
        let summary = |f: fn(&Row) -> f64| {
            let v: Vec<f64> = rows.iter().filter(|r| r.bytes >= 1 << 20).map(f).collect();
            let worst = v.iter().cloned().fold(f64::INFINITY, f64::min);
            (v.iter().sum::<f64>() / v.len().max(1) as f64, worst)
        };
        let (m, w) = summary(|r| r.ratio);
        let (mn, wn) = summary(|r| r.nonblocking_ratio);
        println!(
            "from 1 MiB: stoker / direct busbw ratio mean {m:.3}, lowest {w:.3} (goal >= 0.95); non-blocking mean {mn:.3}, lowest {wn:.3}"
        );
        if let Some(path) = &a.json {
            std::fs::write(path, serde_json::to_string_pretty(&rows)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}
