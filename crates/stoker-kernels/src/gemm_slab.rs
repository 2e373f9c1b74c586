//! The f32 gemm crate's per-thread packing slab, made before a run is measured.
//!
//! gemm (under candle's CPU matmul and the direct step's f32 products) packs its left
//! operand into a thread-local slab of one L2 cache's size, made the first time a thread
//! runs a product and kept until the thread ends. Which threads of the rayon pool run a
//! product first depends on work stealing, so left alone the slabs appear at whichever
//! step first lands work on a fresh thread: one scratch micro-batch may see none of them
//! and a later step one more (1 MiB here), which a memory forecast cannot tell apart from
//! a leak. Priming makes each thread's slab, and touches its pages, before the process is
//! measured: the slabs are then part of the process at start, on every run alike.

/// Makes and touches gemm's packing slab on the calling thread and on every thread of
/// the current rayon pool; returns the bytes of slab each thread holds. Idempotent: a
/// thread's slab is made once.
pub fn prime_gemm_slabs() -> usize {
    let touch = || {
        gemm_common::gemm::L2_SLAB.with(|slab| {
            let mut slab = slab.borrow_mut();
            for byte in slab.iter_mut() {
                byte.write(0);
            }
            slab.len()
        })
    };
    rayon::broadcast(|_| touch());
    touch()
}
