//! Page-locking batch buffers (`pin_memory`).
//!
//! A GPU's copy engine can only DMA from page-locked host memory; from pageable memory the driver
//! first copies into its own staging buffer. With the `cuda` feature and a CUDA driver present,
//! buffers are registered with `cuMemHostRegister` (through cudarc), which is what
//! `torch.Tensor.pin_memory()` achieves. Without either, `mlock` still keeps the pages resident
//! (no page faults while the step reads them), and if even that is refused (RLIMIT_MEMLOCK) the
//! buffers stay pageable and a warning says so.

use std::sync::Arc;

/// How a buffer ended up pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinKind {
    /// Registered with the CUDA driver: DMA-able.
    Cuda,
    /// Locked in RAM with `mlock`.
    Mlock,
    /// Pageable (pinning not requested, or refused).
    None,
}

/// Pins and unpins buffers for one pool, holding the CUDA context when there is one.
pub struct Pinner {
    requested: bool,
    #[cfg(feature = "cuda")]
    cuda: Option<Arc<cudarc::driver::CudaContext>>,
}

impl std::fmt::Debug for Pinner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Pinner(requested: {}, cuda: {})",
            self.requested,
            self.has_cuda()
        )
    }
}

impl Pinner {
    /// A pinner; with `pin` and the `cuda` feature it opens device 0's context, falling back to
    /// `mlock` (with a warning) when no driver or device is found.
    pub fn new(pin: bool) -> Arc<Self> {
        Arc::new(Pinner {
            requested: pin,
            #[cfg(feature = "cuda")]
            cuda: if pin { open_cuda() } else { None },
        })
    }

    /// True when buffers are registered with CUDA.
    pub fn has_cuda(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.cuda.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// Pins `buf` (page-aligned memory the caller owns); undo it with [`unpin`](Self::unpin)
    /// before the memory is freed ([`HostBuffer`](crate::pool::HostBuffer) does both). A
    /// range freed while pinned is not unsafe, only still locked (mlock) or registered
    /// (CUDA) until the process ends.
    pub fn pin(&self, buf: &mut [u8]) -> PinKind {
        if !self.requested {
            return PinKind::None;
        }
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        #[cfg(feature = "cuda")]
        if let Some(ctx) = &self.cuda {
            use cudarc::driver::sys;
            if ctx.bind_to_thread().is_ok() {
                // SAFETY: `ptr..ptr + len` is exactly the live, exclusively borrowed `buf`;
                // registering only pins its pages (an invalid range is an error code).
                let r = unsafe {
                    sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE)
                };
                if r == sys::cudaError_enum::CUDA_SUCCESS {
                    return PinKind::Cuda;
                }
                tracing::warn!(
                    "pin_memory: cuMemHostRegister of {len} bytes failed ({r:?}); trying mlock"
                );
            }
        }
        // SAFETY: mlock only changes the residency of `ptr..ptr + len`, exactly the live
        // `buf`; it reads and writes no memory.
        if unsafe { libc::mlock(ptr as *const libc::c_void, len) } == 0 {
            PinKind::Mlock
        } else {
            tracing::warn!(
                "pin_memory: mlock of {len} bytes failed (RLIMIT_MEMLOCK?); using pageable memory"
            );
            PinKind::None
        }
    }

    /// Undoes [`pin`](Self::pin) of the same `buf`, which returned `kind`.
    pub fn unpin(&self, buf: &mut [u8], kind: PinKind) {
        match kind {
            PinKind::None => {}
            // SAFETY: munlock only changes the residency of exactly the live `buf`'s range; it
            // reads and writes no memory.
            PinKind::Mlock => unsafe {
                libc::munlock(buf.as_ptr().cast(), buf.len());
            },
            PinKind::Cuda => {
                #[cfg(feature = "cuda")]
                if let Some(ctx) = &self.cuda {
                    let _ = ctx.bind_to_thread();
                    // SAFETY: the pointer is the start of the live `buf`; unregistering a
                    // range that is not registered is an error code, not a fault.
                    unsafe { cudarc::driver::sys::cuMemHostUnregister(buf.as_mut_ptr().cast()) };
                }
            }
        }
    }
}

/// Device 0's context, or None (with a warning) when there is no driver or device. cudarc
/// panics when it cannot load libcuda, so the library's presence is checked first.
#[cfg(feature = "cuda")]
fn open_cuda() -> Option<Arc<cudarc::driver::CudaContext>> {
    let present = [c"libcuda.so.1", c"libcuda.so"].iter().any(|name| {
        // SAFETY: `name` is a NUL-terminated C string literal; dlopen returns a handle or
        // null (libcuda's initializers are the driver's own; cudarc loads it the same way).
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY) };
        if !h.is_null() {
            // SAFETY: `h` is the non-null handle just returned by dlopen, closed once.
            unsafe { libc::dlclose(h) };
        }
        !h.is_null()
    });
    if !present {
        tracing::warn!("pin_memory: CUDA driver library (libcuda.so) not found; using mlock");
        return None;
    }
    match cudarc::driver::CudaContext::new(0) {
        Ok(ctx) => Some(ctx),
        Err(e) => {
            tracing::warn!("pin_memory: no CUDA device ({e:?}); using mlock");
            None
        }
    }
}
