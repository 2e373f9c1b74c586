//! The host build's long element-wise launches over the host's threads: an update on
//! the host (the optimizer offloaded, DeepSpeed's CPU Adam runs on every core) and
//! parameter offload's sums of a block's gradients touch every parameter, which one
//! thread does at a few GB/s. A pack kernel ([`crate::ffi::pack_extent`]) whose grid is
//! long enough runs in pieces of [`PIECE`] elements on rayon's pool; each pack writes only
//! its own elements, so the bits are one thread's. Everything else runs on the calling
//! thread.

use rayon::prelude::*;

use crate::call::Call;
use crate::ffi;

/// Elements a piece holds: 1 MiB of f32s, a multiple of the packs' eight.
pub const PIECE: i64 = 1 << 18;

/// Runs `call` on the host: in pieces over the pool where it is a pack kernel of more
/// than one piece, else whole on this thread.
///
/// # Safety
/// [`crate::ffi::run`]'s for `call`.
pub(crate) unsafe fn run(call: &Call) {
    match ffi::pack_extent(call) {
        // SAFETY: this function's contract (`run_pieces` runs one piece on this thread).
        Some(n) => unsafe { run_pieces(call, 0..n) },
        // SAFETY: this function's contract.
        None => unsafe { ffi::run(call) },
    }
}

/// Runs the packs of `call` (a pack kernel, [`ffi::pack_extent`]) that start in `range`
/// (starting on a multiple of eight, inside the grid), in pieces over the pool where it
/// is longer than one.
///
/// # Safety
/// [`crate::ffi::run`]'s for `call`; and nothing else runs packs of `range` meanwhile.
pub(crate) unsafe fn run_pieces(call: &Call, range: std::ops::Range<i64>) {
    let pieces = (range.end - range.start + PIECE - 1) / PIECE;
    if pieces <= 1 {
        // SAFETY: this function's contract; one piece, on this thread.
        return unsafe { ffi::run_packs(call, range.start, range.end) };
    }
    let call = *call;
    (0..pieces).into_par_iter().for_each(|k| {
        let lo = range.start + k * PIECE;
        // SAFETY: `call` is valid (this function's contract); the pieces
        // [lo, lo + PIECE) of `range` do not overlap, each starts on a multiple of
        // eight (`range.start` does, and PIECE is one), and each pack writes only its
        // own elements.
        unsafe { ffi::run_packs(&call, lo, (lo + PIECE).min(range.end)) }
    });
}
