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
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    pinned: PinKind,
    pinner: Arc<Pinner>,
}

// SAFETY: HostBuffer owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access is read-only through &[u8].
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes aligned to [`BUFFER_ALIGN`], pinned through `pinner`.
    pub fn new(len: usize, pinner: &Arc<Pinner>) -> Self {
        let size = len.max(1).next_multiple_of(BUFFER_ALIGN);
        let layout =
            Layout::from_size_align(size, BUFFER_ALIGN).expect("buffer size fits a Layout");
        // SAFETY: size is non-zero.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        // SAFETY: ptr..ptr+size is our allocation and lives until drop, which unpins first.
        let pinned = unsafe { pinner.pin(ptr.as_ptr(), size) };
        HostBuffer {
            ptr,
            len,
            pinned,
            pinner: pinner.clone(),
        }
    }

    /// Whether and how the buffer is page-locked.
    pub fn pinned(&self) -> PinKind {
        self.pinned
    }

    fn layout(&self) -> Layout {
        Layout::from_size_align(self.len.max(1).next_multiple_of(BUFFER_ALIGN), BUFFER_ALIGN)
            .unwrap()
    }
}

impl std::ops::Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: len bytes, initialised (zeroed) at allocation.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        let layout = self.layout();
        // SAFETY: the pointer, size and layout are the ones we allocated and pinned with.
        unsafe {
            self.pinner
                .unpin(self.ptr.as_ptr(), layout.size(), self.pinned);
            std::alloc::dealloc(self.ptr.as_ptr(), layout);
        }
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
