//! The MPI backend under `mpirun -n 2` and `mpirun -n 4` (oversubscribed on 2 cores):
//! the same checks as the in-process backend, and a rank killed in the middle.
//!
//! Each `mpi_*` test runs this test binary under mpirun with `--ignored --exact` on one
//! of the worker functions below (which are ignored in a plain `cargo test`: they need
//! the launcher), wrapped in `timeout`.

mod common;

use std::process::Command;
use std::time::Duration;

use stoker_comm::mpi::MpiComm;
use stoker_comm::{CommExt, Communicator};

/// Runs worker `name` under `mpirun -n ranks`; None (after saying so loudly) without mpirun.
fn mpirun(ranks: usize, name: &str, env: &[(&str, &str)]) -> Option<std::process::Output> {
    if Command::new("mpirun").arg("--version").output().is_err() {
        stoker_testkit::skip(
            name,
            "mpirun not found (scripts/install-deps.sh installs MPICH)",
        );
        return None;
    }
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("timeout");
    cmd.args(["-k", "5", "120", "mpirun", "-n", &ranks.to_string()])
        .arg(exe)
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Some(cmd.output().unwrap())
}

fn text(o: &std::process::Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
#[ignore = "worker of mpi_collectives_*: runs only under mpirun"]
fn worker_collectives() {
    let comm = MpiComm::init(Duration::from_secs(60)).unwrap();
    common::check_all(&comm);
    // mpirun started every rank on this machine.
    assert_eq!(comm.ranks_on_this_host(), comm.world_size());
    println!(
        "mpi worker rank {} of {} ok",
        comm.rank(),
        comm.world_size()
    );
    comm.finalize(Duration::from_secs(10), 0);
}

fn collectives(ranks: usize) {
    let Some(o) = mpirun(ranks, "worker_collectives", &[]) else {
        return;
    };
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for r in 0..ranks {
        assert!(
            out.contains(&format!("mpi worker rank {r} of {ranks} ok")),
            "rank {r} did not finish: {out}"
        );
    }
}

#[test]
fn mpi_collectives_2_ranks() {
    collectives(2);
}

#[test]
fn mpi_collectives_4_ranks_oversubscribed() {
    collectives(4);
}

#[test]
#[ignore = "worker of mpi_lost_rank: runs only under mpirun"]
fn worker_lost_rank() {
    let mut comm = MpiComm::init(Duration::from_secs(60)).unwrap();
    comm.set_timeout(Duration::from_secs(3));
    stoker_comm::say(&format!(
        "worker rank {} pid {}",
        comm.rank(),
        std::process::id()
    ));
    comm.barrier().unwrap();
    if comm.rank() == 1 {
        // SAFETY: raise(3) takes no pointers and only signals this process (SIGKILL ends it,
        // which is the point of this worker).
        unsafe { libc::raise(libc::SIGKILL) };
    }
    let mut x = vec![1f32; 1 << 16];
    let r = comm.all_reduce(&mut x);
    println!("rank {} all_reduce returned {r:?}", comm.rank());
}

#[test]
fn mpi_lost_rank_ends_the_job_naming_it() {
    let t0 = std::time::Instant::now();
    let Some(o) = mpirun(2, "worker_lost_rank", &[]) else {
        return;
    };
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "took {:?}: {out}",
        t0.elapsed()
    );
    assert!(!out.contains("all_reduce returned Ok"), "{out}");
    assert!(
        out.contains("rank 1") || out.contains("RANK 1"),
        "the lost rank is not named: {out}"
    );
}

#[test]
#[ignore = "worker of mpi_checked_*: runs only under mpirun"]
fn worker_checked_mismatch() {
    use std::rc::Rc;
    // A long timeout: the check must fail at once, not when a wait runs out.
    let comm = Rc::new(MpiComm::init(Duration::from_secs(60)).unwrap());
    let checked = stoker_comm::Checked::new(comm.clone());
    common::check_all(&checked);
    // Rank 0 gathers where the others sum three f64s (ZeRO-3's evaluation at 3 ranks once).
    let e = match checked.rank() {
        0 => {
            let mut out = vec![0f32; 3 * 2];
            checked.all_gather(&[1.0, 2.0], &[2, 2, 2], &mut out)
        }
        _ => checked.all_reduce(&mut [0f64; 3]),
    };
    println!(
        "rank {} of {}: {}",
        checked.rank(),
        checked.world_size(),
        e.unwrap_err()
    );
    drop(checked);
    let comm = Rc::try_unwrap(comm).unwrap_or_else(|_| unreachable!("the only owner"));
    comm.finalize(Duration::from_secs(10), 0);
}

#[test]
fn mpi_checked_collectives_at_3_ranks_fail_at_once_naming_each_rank_s_call() {
    let t0 = std::time::Instant::now();
    let Some(o) = mpirun(3, "worker_checked_mismatch", &[]) else {
        return;
    };
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(
        t0.elapsed() < Duration::from_secs(50),
        "took {:?}: {out}",
        t0.elapsed()
    );
    for r in 0..3 {
        let line = out
            .lines()
            .find(|l| l.contains(&format!("rank {r} of 3: collective call")))
            .unwrap_or_else(|| panic!("rank {r} said nothing: {out}"));
        assert!(
            line.contains("rank 0: all_gather (f32, 6 elements)")
                && line.contains("rank 1: all_reduce (f64, 3 elements)")
                && line.contains("rank 2: all_reduce (f64, 3 elements)"),
            "{line}"
        );
    }
}
