//! Reusable, aligned (optionally page-locked) host buffers for batches.
//!
//! Fresh pages cost about 1 GB/s on first touch here (REFERENCES.md), several times slower
//! than copying into warm ones, so the loader recycles batch buffers: when a [`Batch`] is
//! dropped its storage goes back to the pool, and steady state allocates nothing.
//! `pin_memory` page-locks each buffer once, when it is created (see [`crate::pin`]).
//!
//! [`Batch`]: crate::loader::Batch

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::pin::{PinKind, Pinner};
use crate::MappedBytes;

/// Alignment of every buffer: a page, so buffers can be page-locked and DMA'd.
pub const BUFFER_ALIGN: usize = 4096;

/// A zero-initialised, page-aligned heap buffer, page-locked when asked and allowed.
///
/// Invariant (established by [`HostBuffer::new`], the only constructor; the fields are
/// private and never change): `ptr` is an `alloc_zeroed` allocation of `layout`, owned by
/// this value alone, and `len <= layout.size()`.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
    pinned: PinKind,
    pinner: Arc<Pinner>,
}

// The impls below also vouch for the fields other than `ptr`: each must be Send + Sync on
// its own (a compile error otherwise).
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<(usize, Layout, PinKind, Arc<Pinner>)>();
};

// SAFETY: HostBuffer owns its allocation exclusively, like a Box<[u8]> (type invariant), so
// it may move to another thread; its other fields are Send on their own (checked above).
unsafe impl Send for HostBuffer {}
// SAFETY: `&HostBuffer` reaches the bytes only as `&[u8]` (no interior mutability), and its
// other fields are Sync on their own (checked above).
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes aligned to [`BUFFER_ALIGN`], pinned through `pinner`.
    pub fn new(len: usize, pinner: &Arc<Pinner>) -> Self {
        // Checked: a wrapped rounding would allocate less than `len` (or nothing).
        let size = len
            .max(1)
            .checked_next_multiple_of(BUFFER_ALIGN)
            .expect("buffer size fits a usize");
        let layout =
            Layout::from_size_align(size, BUFFER_ALIGN).expect("buffer size fits a Layout");
        assert!(len <= layout.size() && layout.size() > 0);
        // SAFETY: `layout` has a non-zero size (asserted just above).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        let mut buf = HostBuffer {
            ptr,
            len,
            layout,
            pinned: PinKind::None,
            pinner: pinner.clone(),
        };
        // Dropped on a panic from here on: unpinning `PinKind::None` is a no-op.
        buf.pinned = pinner.pin(buf.allocation());
        buf
    }

    /// Whether and how the buffer is page-locked.
    pub fn pinned(&self) -> PinKind {
        self.pinned
    }

    /// The whole allocation (`layout.size()` bytes, at least `len`), for pinning.
    fn allocation(&mut self) -> &mut [u8] {
        // SAFETY: by the type invariant `ptr` is a live zeroed (so initialised) allocation of
        // `layout.size()` bytes owned by `self`, borrowed mutably here.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl std::ops::Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: by the type invariant `ptr` is a live, zeroed (so initialised) allocation
        // of `layout.size() >= len` bytes owned by `self`, borrowed shared here.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        let (pinner, pinned, layout) = (self.pinner.clone(), self.pinned, self.layout);
        pinner.unpin(self.allocation(), pinned);
        // SAFETY: `ptr` was allocated with exactly `layout` (type invariant) and is freed
        // once, here; no borrow of it outlives `&mut self`.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// Everything one batch owns besides its data bytes, recycled with them.
pub struct BatchStorage {
    /// The data of every non-mapped field, each at a 64-byte-aligned offset.
    pub data: HostBuffer,
    /// Dataset indices of the batch's samples.
    pub indices: Vec<usize>,
    /// Per field: the zero-copy view when the field was not copied.
    pub mapped: Vec<Option<MappedBytes>>,
}

/// A pool of [`BatchStorage`] of one size, counting how many it ever allocated.
pub struct BufferPool {
    free: Mutex<Vec<BatchStorage>>,
    bytes: usize,
    pinner: Arc<Pinner>,
    allocated: AtomicUsize,
}

impl BufferPool {
    /// A pool of buffers of `bytes` bytes each.
    pub fn new(bytes: usize, pin: bool) -> Arc<Self> {
        Arc::new(BufferPool {
            free: Mutex::new(Vec::new()),
            bytes,
            pinner: Pinner::new(pin),
            allocated: AtomicUsize::new(0),
        })
    }

    /// A free buffer, or a new one when none is free.
    pub fn take(self: &Arc<Self>) -> PooledStorage {
        let reused = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let storage = reused.unwrap_or_else(|| {
            self.allocated.fetch_add(1, Ordering::Relaxed);
            BatchStorage {
                data: HostBuffer::new(self.bytes, &self.pinner),
                indices: Vec::new(),
                mapped: Vec::new(),
            }
        });
        PooledStorage {
            storage: Some(storage),
            pool: self.clone(),
        }
    }

    /// Buffers allocated over the pool's life: constant once the loader reaches steady state.
    pub fn allocated(&self) -> usize {
        self.allocated.load(Ordering::Relaxed)
    }

    /// Bytes of one buffer.
    pub fn buffer_bytes(&self) -> usize {
        self.bytes
    }

    /// The pinner, which says whether buffers go through CUDA.
    pub fn pinner(&self) -> &Pinner {
        &self.pinner
    }
}

/// A [`BatchStorage`] on loan; it returns to its pool when dropped.
pub struct PooledStorage {
    storage: Option<BatchStorage>,
    pool: Arc<BufferPool>,
}

impl std::ops::Deref for PooledStorage {
    type Target = BatchStorage;
    fn deref(&self) -> &BatchStorage {
        self.storage.as_ref().expect("present until drop")
    }
}

impl std::ops::DerefMut for PooledStorage {
    fn deref_mut(&mut self) -> &mut BatchStorage {
        self.storage.as_mut().expect("present until drop")
    }
}

impl Drop for PooledStorage {
    fn drop(&mut self) {
        if let Some(mut s) = self.storage.take() {
            s.mapped.iter_mut().for_each(|m| *m = None);
            self.pool
                .free
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The buffer's own unsafe paths (allocation, both slices, dealloc) on odd sizes, across
    /// threads, and recycled through the pool; `make miri` runs this under Miri.
    #[test]
    fn host_buffers_allocate_read_write_and_free_soundly() {
        let pinner = Pinner::new(false);
        for len in [0usize, 1, 4095, 4096, 4097, 3 * 4096 + 5] {
            let mut b = HostBuffer::new(len, &pinner);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0), "zeroed");
            assert_eq!(b.as_ptr() as usize % BUFFER_ALIGN, 0);
            for (i, x) in b.iter_mut().enumerate() {
                *x = i as u8;
            }
            let moved = std::thread::spawn(move || {
                let sum: u64 = b.iter().map(|&x| u64::from(x)).sum();
                (b, sum)
            })
            .join()
            .unwrap();
            let expect: u64 = (0..len).map(|i| u64::from(i as u8)).sum();
            assert_eq!(moved.1, expect);
            assert_eq!(moved.0.pinned(), PinKind::None);
        }
        let pool = BufferPool::new(100, false);
        for _ in 0..3 {
            let mut s = pool.take();
            s.data[99] = 7;
        }
        assert_eq!(pool.allocated(), 1, "a returned buffer is reused");
    }
}
