//! Read-only memory maps of dataset files that say which file shrank, instead of a bare
//! SIGBUS.
//!
//! Reading a mapped page that lies past the end of a file the kernel has since truncated
//! raises SIGBUS, which kills the process without a word (exit 135; PyTorch over
//! `np.memmap` does the same). Every mapping stoker reads data through is a [`Mapped`]: it
//! registers its address range and path in a fixed table, and a SIGBUS handler (installed
//! once, with the first mapping) looks the faulting address up there, writes `stoker:
//! PATH changed while it was being read: ...` to stderr and ends the process with status
//! [`SHRUNK_EXIT`] (74, `EX_IOERR`). Past [`SLOTS`] mappings at once the others are not
//! named: a fault while any of them lives ends with the same status and says so without a
//! name. A fault outside every mapping otherwise gets the default action, as before.
//! Checkpoints are written to a temporary directory and renamed, so ending the process
//! there leaves the last one intact.
//!
//! A signal handler can only reach process-wide state, so the table is the one global in
//! stoker: fixed-size atomics, read by the handler without locks or allocation (it only
//! loads atomics and calls `write(2)`, `_exit(2)`, `signal(2)` and `raise(3)`, which are
//! async-signal-safe). Each slot carries a sequence number, odd while a registration or a
//! drop rewrites it, so that the handler only ever uses a consistent snapshot of one
//! registration.

use std::fs::File;
use std::ops::Deref;
use std::path::Path;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::Once;

use memmap2::Mmap;

use crate::error::{DataError, Result};

/// The exit status when a mapped file changed under a reader (`EX_IOERR`).
pub const SHRUNK_EXIT: i32 = 74;

/// Mappings that can be registered at once (a run over FineWeb-100B's llm.c shards maps
/// about 1,000); more are still mapped and still end the process with [`SHRUNK_EXIT`],
/// only not named (`UNNAMED`).
pub const SLOTS: usize = 4096;

/// One registered mapping: its address range and its path's bytes. `start == 0` is free;
/// `claimed` is taken by a registration while it fills the other fields. `seq` is odd while
/// the owner of `claimed` rewrites the fields (a seqlock: the handler retries nothing, it
/// skips a slot whose `seq` is odd or changed while it read the fields).
struct Slot {
    claimed: AtomicUsize,
    seq: AtomicUsize,
    start: AtomicUsize,
    len: AtomicUsize,
    path: AtomicPtr<u8>,
    path_len: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    claimed: AtomicUsize::new(0),
    seq: AtomicUsize::new(0),
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    path: AtomicPtr::new(std::ptr::null_mut()),
    path_len: AtomicUsize::new(0),
};

static TABLE: [Slot; SLOTS] = [FREE; SLOTS];
static HANDLER: Once = Once::new();
/// Live mappings the full table could not name: while there are any, a fault outside
/// every named mapping is taken for one of them (a truncated file is the usual cause of a
/// SIGBUS the kernel raises), said without a name.
static UNNAMED: AtomicUsize = AtomicUsize::new(0);

/// A read-only mapping of a whole file, named to the SIGBUS handler while it lives.
pub struct Mapped {
    map: Mmap,
    slot: Option<usize>,
    /// Counted in `UNNAMED` (the table was full when it was made).
    unnamed: bool,
    /// The path's bytes the table points at (freed only after the slot is cleared).
    _path: Box<[u8]>,
}

impl std::fmt::Debug for Mapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mapped({} bytes)", self.map.len())
    }
}

/// Opens `path` for mapping, once its type is known to be a regular file: opening a FIFO
/// blocks until a writer comes (a run stuck before its first step, deaf to one SIGTERM),
/// and a directory, a socket or a device does not map.
pub fn open_file(path: &Path) -> Result<File> {
    let kind = std::fs::metadata(path)
        .map_err(|e| DataError::io(path, e))?
        .file_type();
    if kind.is_dir() {
        return Err(DataError::format(
            path,
            "path",
            "a directory, expected a file",
        ));
    }
    if !kind.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let what = match () {
            _ if kind.is_fifo() => "a FIFO (named pipe)",
            _ if kind.is_socket() => "a socket",
            _ if kind.is_block_device() || kind.is_char_device() => "a device",
            _ => "not a regular file",
        };
        return Err(DataError::format(
            path,
            "path",
            format!("{what}, expected a regular file (datasets are memory-mapped)"),
        ));
    }
    File::open(path).map_err(|e| DataError::io(path, e))
}

impl Mapped {
    /// Maps `file` (opened from `path` by [`open_file`], which refuses what is not a
    /// regular file) read-only.
    pub fn map(file: &File, path: &Path) -> Result<Self> {
        // SAFETY: a read-only mapping that `Mapped` owns, so no slice of it outlives the
        // mapping (`Deref` borrows `self`). What no check can rule out is another process
        // changing the file: a truncation ends in the SIGBUS handler below, which names the
        // file; datasets must not be rewritten in place while stoker reads them.
        let map = unsafe { Mmap::map(file) }.map_err(|e| DataError::io(path, e))?;
        HANDLER.call_once(install_handler);
        let path_bytes: Box<[u8]> = path.as_os_str().as_encoded_bytes().into();
        let slot = match map.len() {
            0 => None,
            len => register(map.as_ptr() as usize, len, &path_bytes),
        };
        let unnamed = slot.is_none() && !map.is_empty();
        if unnamed {
            UNNAMED.fetch_add(1, Ordering::SeqCst);
        }
        Ok(Mapped {
            map,
            slot,
            unnamed,
            _path: path_bytes,
        })
    }
}

/// Bytes of the distinct mappings among `maps` (one file shared by several readers counts
/// once).
pub(crate) fn distinct_bytes<'m>(
    maps: impl IntoIterator<Item = &'m std::sync::Arc<Mapped>>,
) -> u64 {
    let mut seen: Vec<*const Mapped> = Vec::new();
    let mut bytes = 0;
    for m in maps {
        let id = std::sync::Arc::as_ptr(m);
        if !seen.contains(&id) {
            seen.push(id);
            bytes += m.len() as u64;
        }
    }
    bytes
}

impl Deref for Mapped {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        if self.unnamed {
            UNNAMED.fetch_sub(1, Ordering::SeqCst);
        }
        if let Some(i) = self.slot {
            let s = &TABLE[i];
            // Unnamed before unmapped (`map` and `_path` drop after this body): the handler
            // never matches an unmapped range nor reads a freed path.
            s.seq.fetch_add(1, Ordering::SeqCst);
            s.start.store(0, Ordering::SeqCst);
            s.len.store(0, Ordering::SeqCst);
            s.path.store(std::ptr::null_mut(), Ordering::SeqCst);
            s.path_len.store(0, Ordering::SeqCst);
            s.seq.fetch_add(1, Ordering::SeqCst);
            s.claimed.store(0, Ordering::SeqCst);
        }
    }
}

fn register(start: usize, len: usize, path: &[u8]) -> Option<usize> {
    let i = (0..SLOTS).find(|&i| {
        TABLE[i]
            .claimed
            .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    })?;
    let s = &TABLE[i];
    s.seq.fetch_add(1, Ordering::SeqCst);
    s.path_len.store(path.len(), Ordering::SeqCst);
    s.path.store(path.as_ptr() as *mut u8, Ordering::SeqCst);
    s.len.store(len, Ordering::SeqCst);
    s.start.store(start, Ordering::SeqCst);
    s.seq.fetch_add(1, Ordering::SeqCst);
    Some(i)
}

fn install_handler() {
    // SAFETY: `action` is a zeroed (valid all-zero C struct) sigaction whose handler has the
    // SA_SIGINFO signature; `on_sigbus` only loads atomics and calls write(2), signal(2),
    // raise(3) and _exit(2), all async-signal-safe, and never allocates, locks or panics.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
    }
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // A positive si_code is a fault the kernel raised (BUS_ADRERR for a truncated file), for
    // which `si_addr` is the faulting address; a SIGBUS sent with kill(2) or sigqueue(2)
    // (si_code <= 0) carries no address and matches no mapping.
    let addr = if info.is_null() {
        0
    } else {
        // SAFETY: `info` is non-null (checked just above) and points at the siginfo the
        // kernel passes an SA_SIGINFO handler; both fields read are plain integers of it.
        unsafe {
            match (*info).si_code > 0 {
                true => (*info).si_addr() as usize,
                false => 0,
            }
        }
    };
    for s in &TABLE {
        let seq = s.seq.load(Ordering::SeqCst);
        let start = s.start.load(Ordering::SeqCst);
        let len = s.len.load(Ordering::SeqCst);
        let path = s.path.load(Ordering::SeqCst);
        let path_len = s.path_len.load(Ordering::SeqCst);
        // Only a stable snapshot of one registration counts: not being rewritten (even
        // `seq`) and not rewritten while read (`seq` unchanged).
        if seq % 2 == 1 || s.seq.load(Ordering::SeqCst) != seq {
            continue;
        }
        if start == 0 || addr < start || addr - start >= len {
            continue;
        }
        write_err(b"stoker: ");
        if !path.is_null() {
            // SAFETY: `start..start + len`, `path` and `path_len` come from one registration
            // (the `seq` check above), and that range holds the faulting address (checked
            // above): it is the live mapping this thread was reading, which cannot be dropped
            // while the read is in progress, and its path bytes (`Mapped::_path`, `path_len`
            // long) are freed only after its `Drop` cleared the slot.
            write_err(unsafe { std::slice::from_raw_parts(path, path_len) });
        }
        write_err(
            b" changed while it was being read (it was truncated or replaced; SIGBUS at byte ",
        );
        write_num(addr - start);
        write_err(b" of the ");
        write_num(len);
        write_err(b" mapped): a dataset must not be modified while stoker reads it\n");
        // SAFETY: _exit(2) has no preconditions and is async-signal-safe; it ends the process
        // at once, which is all a handler can do for a fault it cannot recover from.
        unsafe { libc::_exit(SHRUNK_EXIT) };
    }
    // A fault the kernel raised (an address) while mappings the full table could not name
    // are live: said without the name.
    if addr != 0 && UNNAMED.load(Ordering::SeqCst) > 0 {
        write_err(b"stoker: a mapped file changed while it was being read (it was truncated or replaced; SIGBUS at address ");
        write_num(addr);
        write_err(b", outside the ");
        write_num(SLOTS);
        write_err(b" mappings stoker names, so not named here): a dataset must not be modified while stoker reads it\n");
        // SAFETY: as above: _exit(2) has no preconditions and is async-signal-safe.
        unsafe { libc::_exit(SHRUNK_EXIT) };
    }
    // Not one of ours: the default action (the process ends with SIGBUS, as before). A
    // fault recurs when the handler returns; a sent SIGBUS would not, so it is raised again
    // (blocked while the handler runs, it is delivered on return).
    // SAFETY: signal(2) with SIG_DFL and raise(3) take no pointers and are
    // async-signal-safe.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

fn write_err(bytes: &[u8]) {
    // SAFETY: write(2) reads at most `bytes.len()` bytes from `bytes.as_ptr()`, a live slice
    // for the whole call; it is async-signal-safe.
    unsafe {
        libc::write(2, bytes.as_ptr() as *const libc::c_void, bytes.len());
    }
}

/// Writes `n` in decimal without allocating.
fn write_num(mut n: usize) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    write_err(&buf[i..]);
}
