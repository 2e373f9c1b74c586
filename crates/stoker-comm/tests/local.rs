//! The in-process backend at world sizes 1-8: every collective against plain sums, and
//! the ways a group can break (a rank gone, a rank late, ranks out of step).

mod common;

use std::time::{Duration, Instant};

use stoker_comm::{run_local, tree_all_reduce, tree_sum, CommError, CommExt, Communicator};

#[test]
fn collectives_match_plain_sums_at_world_sizes_1_to_8() {
    for world in 1..=8 {
        run_local(world, Duration::from_secs(30), |comm| {
            common::check_all(&comm)
        });
    }
}

/// Ranks holding different lengths (rank `r` holds `r` values, rank 2 none at world 3)
/// each get every rank's values, rank order.
#[test]
fn all_gather_varying_gives_every_rank_s_values_whatever_their_lengths() {
    for world in 1..=5 {
        let got = run_local(world, Duration::from_secs(30), |comm| {
            let r = comm.rank() as u64;
            let mine: Vec<u64> = (0..r).map(|i| 100 * r + i).collect();
            comm.all_gather_varying(&mine).unwrap()
        });
        let want: Vec<Vec<u64>> = (0..world as u64)
            .map(|r| (0..r).map(|i| 100 * r + i).collect())
            .collect();
        for g in got {
            assert_eq!(g, want, "world {world}");
        }
    }
}

/// The max of amaxes over ranks: the largest value, element by element; a NaN on any
/// rank (either sign) wins over everything, +inf included; ranks of other lengths, and a
/// value below 0 (-0 included) on any rank, fail on every rank.
#[test]
fn max_of_amaxes_takes_the_largest_value_and_keeps_a_nan_from_any_rank() {
    for world in 1..=5 {
        let got = run_local(world, Duration::from_secs(30), |comm| {
            let r = comm.rank() as f32;
            let nan = if comm.rank() == world - 1 {
                -f32::NAN
            } else {
                0.0
            };
            let inf = if r >= 1.0 { f32::INFINITY } else { r };
            // A positive NaN on the last rank against +inf on the others.
            let nan_or_inf = if comm.rank() == world - 1 {
                f32::NAN
            } else {
                f32::INFINITY
            };
            let mut x = [r, 3.0 / (1.0 + r), 1e-30 * r, inf, nan, nan_or_inf];
            comm.max_of_amaxes(&mut x).unwrap();
            x.map(f32::to_bits)
        });
        let w = (world - 1) as f32;
        let inf = if world > 1 { f32::INFINITY } else { 0.0 };
        for (r, x) in got.iter().enumerate() {
            assert_eq!(
                x[..4],
                [w, 3.0, 1e-30 * w, inf].map(f32::to_bits),
                "world {world} rank {r}"
            );
            assert!(
                f32::from_bits(x[4]).is_nan(),
                "world {world} rank {r}: -NaN kept"
            );
            assert!(
                f32::from_bits(x[5]).is_nan(),
                "world {world} rank {r}: NaN over +inf"
            );
        }
    }
    let errs = run_local(2, Duration::from_secs(30), |comm| {
        let mut x = vec![1.0f32; 1 + comm.rank()];
        comm.max_of_amaxes(&mut x).unwrap_err().to_string()
    });
    for e in errs {
        assert!(e.contains("max of amaxes") && e.contains("holds"), "{e}");
    }
    for negative in [-0.0f32, -1.0] {
        let errs = run_local(3, Duration::from_secs(30), |comm| {
            let mut x = [1.0, if comm.rank() == 2 { negative } else { 0.5 }];
            comm.max_of_amaxes(&mut x).unwrap_err().to_string()
        });
        for e in errs {
            assert!(
                e.contains("rank 2's value 1") && e.contains(">= 0 or NaN"),
                "{e}"
            );
        }
    }
}

#[test]
fn a_rank_that_leaves_is_named_at_once() {
    let t0 = Instant::now();
    let errs = run_local(3, Duration::from_secs(30), |comm| {
        if comm.rank() == 2 {
            return None; // drops its communicator without joining
        }
        Some(comm.all_reduce(&mut [1f32; 4]).unwrap_err())
    });
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "waited for the timeout"
    );
    for e in errs.into_iter().flatten() {
        match &e {
            CommError::RankLost {
                op, lost, bytes, ..
            } => {
                assert_eq!((*op, *lost, *bytes), ("all_reduce", 2, 16), "{e}")
            }
            other => panic!("expected RankLost, got {other}"),
        }
    }
}

#[test]
fn a_late_rank_times_out_naming_the_collective_rank_bytes_and_missing_ranks() {
    let errs = run_local(2, Duration::from_millis(200), |comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(600));
            return None;
        }
        Some(
            comm.reduce_scatter(&[0f32; 10], &[5, 5], &mut [0f32; 5])
                .unwrap_err(),
        )
    });
    let e = errs[0].as_ref().unwrap();
    let msg = e.to_string();
    assert!(matches!(e, CommError::Timeout { .. }), "{msg}");
    for part in ["reduce_scatter", "40 bytes", "rank 0 of 2", "[1]"] {
        assert!(msg.contains(part), "`{part}` missing from: {msg}");
    }
}

#[test]
fn ranks_out_of_step_fail_instead_of_hanging() {
    let errs = run_local(2, Duration::from_secs(30), |comm| match comm.rank() {
        0 => comm.all_reduce(&mut [0f32; 4]).unwrap_err(),
        _ => comm.broadcast(&mut [0f32; 4], 0).unwrap_err(),
    });
    for e in &errs {
        let msg = e.to_string();
        assert!(matches!(e, CommError::Mismatch { .. }), "{msg}");
        assert!(
            msg.contains("all_reduce") && msg.contains("broadcast"),
            "{msg}"
        );
    }
    let errs = run_local(2, Duration::from_secs(30), |comm| {
        let n = 4 + comm.rank();
        comm.all_reduce(&mut vec![0f64; n]).unwrap_err()
    });
    assert!(errs.iter().all(|e| matches!(e, CommError::Mismatch { .. })));
}

#[test]
fn stats_count_calls_and_ring_bytes() {
    let stats = run_local(4, Duration::from_secs(30), |comm| {
        comm.all_reduce(&mut [0f32; 1000]).unwrap();
        comm.all_gather(&[0f32; 250], &[250; 4], &mut [0f32; 1000])
            .unwrap();
        comm.stats()
    });
    for s in stats {
        assert_eq!(s.op(stoker_comm::Op::AllReduce).bus_bytes, 2 * 3 * 4000 / 4);
        assert_eq!(s.op(stoker_comm::Op::AllGather).bus_bytes, 3 * 4000 / 4);
        assert_eq!(s.calls(), 2);
    }
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// The tree all-reduce is bit-identical to the tree over all ranks' buffers for
        /// any length and power-of-two world size; MPI-style sums are close to f64.
        #[test]
        fn tree_all_reduce_is_the_fixed_tree(len in 0usize..300, log_world in 0u32..4, salt in any::<u64>()) {
            let world = 1usize << log_world;
            let leaves: Vec<Vec<f32>> = (0..world).map(|r| common::floats(r, len, salt)).collect();
            let want = tree_sum(&leaves);
            let got = run_local(world, Duration::from_secs(30), |comm| {
                let mut x = leaves[comm.rank()].clone();
                tree_all_reduce(&comm, &mut x).unwrap();
                x
            });
            for g in got {
                stoker_testkit::assert_bits_eq(&g, &want, "tree_all_reduce");
            }
        }

        #[test]
        fn reduce_scatter_then_all_gather_is_all_reduce(counts in proptest::collection::vec(0usize..9, 1..6), salt in any::<u64>()) {
            let world = counts.len();
            let total: usize = counts.iter().sum();
            let got = run_local(world, Duration::from_secs(30), |comm| {
                let x = common::floats(comm.rank(), total, salt);
                let mut mine = vec![0f32; counts[comm.rank()]];
                comm.reduce_scatter(&x, &counts, &mut mine).unwrap();
                let mut all = vec![0f32; total];
                comm.all_gather(&mine, &counts, &mut all).unwrap();
                let mut ar = x.clone();
                comm.all_reduce(&mut ar).unwrap();
                (all, ar)
            });
            for (all, ar) in got {
                stoker_testkit::assert_bits_eq(&all, &ar, "reduce_scatter + all_gather vs all_reduce");
            }
        }
    }
}
