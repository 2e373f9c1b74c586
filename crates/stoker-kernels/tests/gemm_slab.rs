//! gemm's per-thread packing slab: a fresh thread makes one the first time it runs a
//! product, and after `prime_gemm_slabs` no thread of the pool makes another.
//!
//! One test in its own binary, counted by this binary's allocator, so that nothing else
//! allocates while it counts.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use stoker_kernels::gemm_slab::prime_gemm_slabs;

/// The system allocator with a count of live bytes.
struct Live(AtomicUsize);

// SAFETY: every call forwards to the system allocator unchanged; only a counter is added.
unsafe impl GlobalAlloc for Live {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.0.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        self.0.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Live = Live(AtomicUsize::new(0));

/// Runs one 64x64x64 f32 product on every thread of the current pool, each on its own
/// thread (no nested parallelism), and returns the heap bytes that stayed.
fn product_on_every_thread() -> usize {
    let n = 64;
    let (a, b) = (vec![1.0f32; n * n], vec![0.5f32; n * n]);
    let mut outs: Vec<Vec<f32>> = (0..rayon::current_num_threads())
        .map(|_| vec![0.0f32; n * n])
        .collect();
    let dsts: Vec<usize> = outs.iter_mut().map(|o| o.as_mut_ptr() as usize).collect();
    let before = ALLOC.0.load(Ordering::SeqCst);
    rayon::broadcast(|ctx| {
        let dst = dsts[ctx.index()] as *mut f32;
        // SAFETY: each thread writes its own n x n output, which outlives the broadcast;
        // the operands are n x n column-major with the strides given.
        unsafe {
            gemm::gemm(
                n,
                n,
                n,
                dst,
                n as isize,
                1,
                false,
                a.as_ptr(),
                n as isize,
                1,
                b.as_ptr(),
                n as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    });
    let stayed = ALLOC.0.load(Ordering::SeqCst).saturating_sub(before);
    assert!(outs.iter().all(|o| o.iter().all(|&x| x == 32.0)));
    stayed
}

#[test]
fn after_priming_no_thread_of_the_pool_makes_a_slab() {
    let threads = 3;
    let pool = || {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    };
    // gemm's process-wide state (its cache sizes), made by a first product anywhere. The
    // pool is kept to the end: a pool dropped ends its threads, and each frees its slab
    // whenever it gets there, perhaps while a count below is under way.
    let warm = pool();
    warm.install(product_on_every_thread);
    let fresh = pool();
    let slab = fresh.install(|| {
        let stayed = product_on_every_thread();
        (stayed, prime_gemm_slabs())
    });
    // A fresh pool's threads each made a slab of the size priming reports, with the
    // thread's own bookkeeping for its thread-locals (a few hundred bytes).
    let (stayed, each) = slab;
    assert!(
        (threads * each..threads * (each + 4096)).contains(&stayed),
        "{stayed} bytes stayed for {threads} slabs of {each} bytes"
    );
    assert!(each >= 1 << 12, "an L2 cache of {each} bytes");
    let primed = pool();
    let stayed = primed.install(|| {
        prime_gemm_slabs();
        product_on_every_thread()
    });
    assert_eq!(stayed, 0, "a primed pool made {stayed} bytes of slab");
}
