//! The binary's allocator: mimalloc (main.rs says why), with a count of the bytes live on
//! the heap and their peak, so a run can set what it really holds beside what it planned
//! (`stoker_train::run::HeapProbe`). RSS alone cannot tell: mimalloc keeps freed pages
//! for reuse, per thread, so the resident set overstates what is in use.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, Ordering};

use mimalloc::MiMalloc;

/// Bytes allocated and not yet freed.
static LIVE: AtomicU64 = AtomicU64::new(0);
/// Largest `LIVE` since the last [`reset_peak`].
static PEAK: AtomicU64 = AtomicU64::new(0);

/// mimalloc, counted.
pub struct CountingMiMalloc;

fn grew(bytes: usize) {
    let now = LIVE.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

fn shrank(bytes: usize) {
    LIVE.fetch_sub(bytes as u64, Ordering::Relaxed);
}

// SAFETY: every method forwards to mimalloc with the caller's own arguments, so each
// inherits GlobalAlloc's contract unchanged; the counting touches only two atomics.
unsafe impl GlobalAlloc for CountingMiMalloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires (non-zero size).
        let p = unsafe { MiMalloc.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for alloc.
        let p = unsafe { MiMalloc.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller passes a block this allocator (so mimalloc) returned, with
        // its layout, as GlobalAlloc::dealloc requires.
        unsafe { MiMalloc.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's block, layout and new size, as GlobalAlloc::realloc requires.
        let p = unsafe { MiMalloc.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            grew(new_size);
            shrank(layout.size());
        }
        p
    }
}

/// Bytes live on the heap now.
pub fn live() -> u64 {
    LIVE.load(Ordering::Relaxed)
}

/// The largest number of live bytes since the last [`reset_peak`].
pub fn peak() -> u64 {
    PEAK.load(Ordering::Relaxed)
}

/// Restarts the peak from the bytes live now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// The probe `stoker train` hands to the run.
pub fn probe() -> stoker_train::run::HeapProbe {
    stoker_train::run::HeapProbe {
        live,
        peak,
        reset_peak,
    }
}
