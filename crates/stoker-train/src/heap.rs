//! A global allocator that counts: any allocator behind a count of the bytes live on the
//! heap and their peak, so a run can set what it really holds beside what it planned
//! ([`HeapCount`], `RunOptions::heap`). RSS alone cannot tell: an allocator keeps freed
//! pages for reuse, so the resident set overstates what is in use. The `stoker` binary
//! wraps glibc's malloc (kept from returning memory, [`crate::malloc_tuning`]) in it, or
//! mimalloc with its `mimalloc` feature; tests wrap the system allocator.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, Ordering};

/// `A`, counted.
pub struct Counting<A> {
    inner: A,
    /// Bytes allocated and not yet freed.
    live: AtomicU64,
    /// The largest `live` since the last [`Counting::reset_peak`].
    peak: AtomicU64,
}

impl<A> Counting<A> {
    /// `inner` with both counts at zero (a `static`'s initializer).
    pub const fn new(inner: A) -> Self {
        Counting {
            inner,
            live: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    /// Bytes live on the heap now.
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    /// The largest number of live bytes since the last [`Counting::reset_peak`].
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Restarts the peak from the bytes live now.
    pub fn reset_peak(&self) {
        self.peak.store(self.live(), Ordering::Relaxed);
    }

    fn grew(&self, bytes: usize) {
        let now = self.live.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn shrank(&self, bytes: usize) {
        self.live.fetch_sub(bytes as u64, Ordering::Relaxed);
    }
}

/// Reads of a counting global allocator, as a run takes them (the library installs none;
/// the `stoker` binary and the tests do).
pub trait HeapCount: Sync {
    /// Bytes live on the heap now.
    fn live(&self) -> u64;
    /// The largest number of live bytes since the last [`HeapCount::reset_peak`].
    fn peak(&self) -> u64;
    /// Restarts the peak from the bytes live now.
    fn reset_peak(&self);
}

impl<A: Sync> HeapCount for Counting<A> {
    fn live(&self) -> u64 {
        Counting::live(self)
    }

    fn peak(&self) -> u64 {
        Counting::peak(self)
    }

    fn reset_peak(&self) {
        Counting::reset_peak(self)
    }
}

impl std::fmt::Debug for dyn HeapCount + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HeapCount {{ live: {}, peak: {} }}",
            self.live(),
            self.peak()
        )
    }
}

// SAFETY: every method forwards to `inner` with the caller's own arguments, so each
// inherits GlobalAlloc's contract from `inner`'s implementation unchanged; the counting
// touches only two atomics and allocates nothing.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Counting<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires (non-zero size).
        let p = unsafe { self.inner.alloc(layout) };
        if !p.is_null() {
            self.grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for alloc.
        let p = unsafe { self.inner.alloc_zeroed(layout) };
        if !p.is_null() {
            self.grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller passes a block this allocator (so `inner`) returned, with its
        // layout, as GlobalAlloc::dealloc requires.
        unsafe { self.inner.dealloc(ptr, layout) };
        self.shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's block, layout and new size, as GlobalAlloc::realloc requires.
        let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            self.grew(new_size);
            self.shrank(layout.size());
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_live_bytes_and_their_peak() {
        let c = Counting::new(std::alloc::System);
        let l = Layout::from_size_align(1000, 8).unwrap();
        // SAFETY: a non-zero layout; each block is freed once with its own layout.
        unsafe {
            let a = c.alloc(l);
            let b = c.alloc_zeroed(l);
            assert_eq!((c.live(), c.peak()), (2000, 2000));
            c.dealloc(a, l);
            let b = c.realloc(b, l, 3000);
            // A moving realloc holds both blocks for a moment: counted so.
            assert_eq!((c.live(), c.peak()), (3000, 4000));
            c.reset_peak();
            c.dealloc(b, Layout::from_size_align(3000, 8).unwrap());
            assert_eq!((c.live(), c.peak()), (0, 3000));
        }
    }
}
