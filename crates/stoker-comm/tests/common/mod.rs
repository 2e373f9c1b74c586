//! The collective checks every backend runs: each result against a plain sum computed
//! from every rank's input (which each rank can generate), uneven sizes included.
#![allow(dead_code)]

use stoker_comm::{tree_all_reduce, tree_sum, CommExt, Communicator};
use stoker_testkit::{assert_bits_eq, assert_close};

/// Rank `r`'s deterministic input of `len` elements (small integers: sums are exact in
/// any order, so results must be equal, not close).
pub fn ints(r: usize, len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + r * 13 + salt * 3) % 17) as f32 - 8.0)
        .collect()
}

/// Rank `r`'s deterministic input of awkward floats (sums depend on the bracketing).
pub fn floats(r: usize, len: usize, salt: u64) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let mut z = (r as u64) << 40 ^ (i as u64) ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            let u = (z >> 40) as f32 / (1u64 << 24) as f32;
            (u - 0.5) * 10f32.powi((i % 7) as i32 - 3)
        })
        .collect()
}

/// Uneven per-rank counts for `world` ranks (some zero).
pub fn uneven(world: usize, salt: usize) -> Vec<usize> {
    (0..world).map(|r| (r * 5 + salt) % 7).collect()
}

/// Element-wise sum over ranks of `f(rank)`, in f64 (exact for the integer inputs).
fn plain_sum(n: usize, f: impl Fn(usize) -> Vec<f32>) -> Vec<f64> {
    let all: Vec<Vec<f32>> = (0..n).map(f).collect();
    let len = all.first().map_or(0, |v| v.len());
    (0..len)
        .map(|i| all.iter().map(|v| v[i] as f64).sum())
        .collect()
}

fn f32s(v: Vec<f64>) -> Vec<f32> {
    v.into_iter().map(|x| x as f32).collect()
}

/// Every collective on `comm`, checked against plain sums.
pub fn check_all(comm: &dyn Communicator) {
    let (n, me) = (comm.world_size(), comm.rank());
    let what = |s: &str| format!("{} rank {me}/{n}: {s}", comm.backend());
    // all_reduce: f32 / f64 / u64, lengths 0, 1, 7 and 100_003.
    for (salt, len) in [0usize, 1, 7, 100_003].into_iter().enumerate() {
        let mut x = ints(me, len, salt);
        comm.all_reduce(&mut x).unwrap();
        let want = f32s(plain_sum(n, |r| ints(r, len, salt)));
        assert_bits_eq(&x, &want, &what(&format!("all_reduce f32 x {len}")));
        let mut d: Vec<f64> = ints(me, len, salt)
            .iter()
            .map(|&v| v as f64 * 0.5)
            .collect();
        comm.all_reduce(&mut d).unwrap();
        let want_d: Vec<f64> = want.iter().map(|&v| v as f64 * 0.5).collect();
        assert_bits_eq(&d, &want_d, &what("all_reduce f64"));
        let mut u: Vec<u64> = (0..len)
            .map(|i| (i * (me + 1)) as u64 + (1 << 40))
            .collect();
        comm.all_reduce(&mut u).unwrap();
        let want_u: Vec<u64> = (0..len)
            .map(|i| (0..n).map(|r| (i * (r + 1)) as u64 + (1 << 40)).sum())
            .collect(); // O(len x n): fine
        assert_eq!(u, want_u, "{}", what("all_reduce u64"));
    }
    // Floats whose sum depends on the order: close to the f64 sum.
    let len = 4099;
    let mut x = floats(me, len, 1);
    comm.all_reduce(&mut x).unwrap();
    let want = plain_sum(n, |r| floats(r, len, 1));
    let got: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    assert_close(&got, &want, 1e-6, &what("all_reduce of awkward floats"));
    // reduce_scatter and all_gather with uneven counts.
    for salt in 0..3 {
        let counts = uneven(n, salt);
        let total: usize = counts.iter().sum();
        let input = ints(me, total, salt);
        let mut out = vec![0f32; counts[me]];
        comm.reduce_scatter(&input, &counts, &mut out).unwrap();
        let start: usize = counts[..me].iter().sum();
        let want = f32s(plain_sum(n, |r| ints(r, total, salt)))[start..start + counts[me]].to_vec();
        assert_bits_eq(
            &out,
            &want,
            &what(&format!("reduce_scatter counts {counts:?}")),
        );
        let mine = ints(me, counts[me], salt + 10);
        let mut all = vec![0f32; total];
        comm.all_gather(&mine, &counts, &mut all).unwrap();
        let want: Vec<f32> = (0..n).flat_map(|r| ints(r, counts[r], salt + 10)).collect();
        assert_bits_eq(&all, &want, &what(&format!("all_gather counts {counts:?}")));
    }
    // broadcast from every root.
    for root in 0..n {
        let mut b: Vec<u64> = (0..33).map(|i| (i + me * 100) as u64).collect();
        comm.broadcast(&mut b, root).unwrap();
        let want: Vec<u64> = (0..33).map(|i| (i + root * 100) as u64).collect();
        assert_eq!(b, want, "{}", what(&format!("broadcast from {root}")));
    }
    comm.barrier().unwrap();
    // send_recv between pairs (0,1), (2,3), ...; an odd last rank has no partner.
    let peer = me ^ 1;
    if peer < n {
        let mut r = vec![0f64; 5];
        comm.send_recv(peer, &[me as f64; 5], &mut r).unwrap();
        assert_eq!(r, vec![peer as f64; 5], "{}", what("send_recv"));
    }
    // Non-blocking: three in flight, waited out of order.
    let a = comm
        .start_all_reduce(stoker_comm::Buffer::F32(ints(me, 1000, 4)))
        .unwrap();
    let counts = uneven(n, 5);
    let total: usize = counts.iter().sum();
    let b = comm
        .start_reduce_scatter(
            stoker_comm::Buffer::F32(ints(me, total, 6)),
            &counts,
            stoker_comm::Buffer::F32(vec![f32::NAN; counts[me]]),
        )
        .unwrap();
    let c = comm
        .start_all_gather(
            stoker_comm::Buffer::F64(vec![me as f64; counts[me]]),
            &counts,
            stoker_comm::Buffer::F64(vec![f64::NAN; total]),
        )
        .unwrap();
    comm.progress();
    let c = c.wait_vec::<f64>().unwrap();
    let b = b.wait_vec::<f32>().unwrap();
    let a = a.wait_vec::<f32>().unwrap();
    let want_a = f32s(plain_sum(n, |r| ints(r, 1000, 4)));
    assert_bits_eq(&a, &want_a, &what("start_all_reduce"));
    let start: usize = counts[..me].iter().sum();
    let want_b = f32s(plain_sum(n, |r| ints(r, total, 6)))[start..start + counts[me]].to_vec();
    assert_bits_eq(&b, &want_b, &what("start_reduce_scatter"));
    let want_c: Vec<f64> = (0..n).flat_map(|r| vec![r as f64; counts[r]]).collect();
    assert_bits_eq(&c, &want_c, &what("start_all_gather"));
    // Non-blocking with equal counts (MPI's block forms).
    let even = vec![3usize; n];
    let b = comm
        .start_reduce_scatter(
            stoker_comm::Buffer::F32(ints(me, 3 * n, 7)),
            &even,
            stoker_comm::Buffer::F32(vec![f32::NAN; 3]),
        )
        .unwrap()
        .wait_vec::<f32>()
        .unwrap();
    let want_b = f32s(plain_sum(n, |r| ints(r, 3 * n, 7)))[3 * me..3 * me + 3].to_vec();
    assert_bits_eq(&b, &want_b, &what("start_reduce_scatter, equal counts"));
    let c = comm
        .start_all_gather(
            stoker_comm::Buffer::U64(vec![me as u64 + 1; 3]),
            &even,
            stoker_comm::Buffer::U64(vec![0; 3 * n]),
        )
        .unwrap()
        .wait_vec::<u64>()
        .unwrap();
    let want_c: Vec<u64> = (0..n).flat_map(|r| vec![r as u64 + 1; 3]).collect();
    assert_eq!(c, want_c, "{}", what("start_all_gather, equal counts"));
    // The deterministic tree: bit-identical to tree_sum over every rank's input, for
    // lengths below, at and above the world size.
    if n.is_power_of_two() {
        for len in [0, 1, 3, n, 1001] {
            let leaves: Vec<Vec<f32>> = (0..n).map(|r| floats(r, len, 9)).collect();
            let mut x = leaves[me].clone();
            tree_all_reduce(comm, &mut x).unwrap();
            assert_bits_eq(
                &x,
                &tree_sum(&leaves),
                &what(&format!("tree_all_reduce x {len}")),
            );
        }
    } else {
        let mut x = vec![1f32];
        let e = tree_all_reduce(comm, &mut x).unwrap_err().to_string();
        assert!(e.contains("power of two"), "{e}");
    }
    // Argument errors name the collective.
    let e = comm
        .all_gather(&[1f32; 3], &vec![1; n], &mut vec![0f32; n])
        .unwrap_err()
        .to_string();
    assert!(e.contains("all_gather") && e.contains("counts"), "{e}");
}
