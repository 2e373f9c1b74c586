//! A sum all-reduce whose bits do not depend on the backend, the world size or timing.
//!
//! Floating-point addition is commutative but not associative: the bits of a sum depend
//! on its bracketing, and MPI chooses the bracketing by message size and rank count. This
//! all-reduce fixes it: the value of every element is the balanced binary tree over ranks
//! in rank order, neighbours first, each addition `lower + higher`:
//! `((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))`. That is the top of the tree the
//! trainer's deterministic mode builds over a global batch's micro-batches (each rank
//! holds one subtree), so 1, 2 and 4 ranks produce the same bits.
//!
//! The algorithm is recursive halving (a reduce-scatter: at distance 1, 2, 4, ... each
//! pair exchanges halves of its current segment and adds) followed by recursive
//! doubling (the all-gather, in reverse). Every rank sends `2 (n-1)/n` of the buffer, as
//! a ring all-reduce does. World sizes must be powers of two.

use crate::communicator::{CommExt, Communicator};
use crate::element::Element;
use crate::error::{CommError, Result};

/// Whether [`tree_all_reduce`] can serve `world` ranks.
pub fn tree_supports(world: usize) -> bool {
    world.is_power_of_two()
}

/// Sums `buf` over ranks in place with the fixed tree of the module doc; every rank ends
/// with identical bits.
pub fn tree_all_reduce<T: Element>(
    comm: &(impl Communicator + ?Sized),
    buf: &mut [T],
) -> Result<()> {
    let (n, r) = (comm.world_size(), comm.rank());
    if n == 1 {
        return Ok(());
    }
    if !tree_supports(n) {
        return Err(CommError::Unsupported {
            op: "tree_all_reduce",
            rank: r,
            detail: format!(
                "world size {n}: the deterministic reduction tree needs a power of two (1, 2, 4, 8, ...)"
            ),
        });
    }
    // Reduce-scatter by recursive halving, neighbours first.
    let (mut lo, mut hi) = (0usize, buf.len());
    let mut segments = Vec::new();
    let mut scratch: Vec<T> = Vec::with_capacity(buf.len().div_ceil(2));
    let mut d = 1;
    while d < n {
        let partner = r ^ d;
        let lower = r & d == 0;
        let mid = lo + (hi - lo) / 2;
        let (keep, give) = if lower {
            (lo..mid, mid..hi)
        } else {
            (mid..hi, lo..mid)
        };
        scratch.clear();
        scratch.resize(keep.len(), T::default());
        comm.send_recv(partner, &buf[give], &mut scratch)?;
        for (x, &y) in buf[keep.clone()].iter_mut().zip(&scratch) {
            *x = if lower { T::add(*x, y) } else { T::add(y, *x) };
        }
        segments.push((lo, hi));
        (lo, hi) = (keep.start, keep.end);
        d <<= 1;
    }
    // All-gather by recursive doubling: undo the halvings in reverse order.
    while let Some((plo, phi)) = segments.pop() {
        d >>= 1;
        let partner = r ^ d;
        // The lower rank of the pair kept the front half, the higher one the back half.
        let (mine, theirs) = if r & d == 0 {
            (lo..hi, hi..phi)
        } else {
            (lo..hi, plo..lo)
        };
        scratch.clear();
        scratch.resize(theirs.len(), T::default());
        let send: Vec<T> = buf[mine].to_vec();
        comm.send_recv(partner, &send, &mut scratch)?;
        buf[theirs].copy_from_slice(&scratch);
        (lo, hi) = (plo, phi);
    }
    Ok(())
}

/// The same tree over values held in one place (`leaves[i]` = rank or micro-batch `i`),
/// the reference [`tree_all_reduce`] is tested against and the shape the trainer's local
/// accumulation follows. `leaves.len()` must be a power of two.
pub fn tree_sum<T: Element>(leaves: &[Vec<T>]) -> Vec<T> {
    assert!(
        leaves.len().is_power_of_two(),
        "tree_sum over {} leaves: a power of two expected",
        leaves.len()
    );
    let mut level: Vec<Vec<T>> = leaves.to_vec();
    while level.len() > 1 {
        level = level
            .chunks(2)
            .map(|p| {
                p[0].iter()
                    .zip(&p[1])
                    .map(|(&a, &b)| T::add(a, b))
                    .collect()
            })
            .collect();
    }
    level.pop().unwrap_or_default()
}
