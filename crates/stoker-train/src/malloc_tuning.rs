//! glibc malloc set up for training steps that allocate their tensors afresh every step
//! (candle's graph path: every activation, gradient and cast is a new buffer).
//!
//! glibc's defaults return freed memory to the kernel: blocks from 128 KiB up are their own
//! `mmap` (the threshold then rises with what is freed), and the heap's top is trimmed
//! whenever 128 KiB of it is free. A step that allocates the same tensors again then faults
//! every page in again (a third of a CPU step, docs/benchmarks.md). mimalloc (the binary's
//! allocator before, still a feature) keeps freed pages, but per thread and size class, so
//! the resident set of a graph-path step rose well above the bytes live at its peak
//! (docs/benchmarks.md, `make bench-allocator`).
//!
//! [`keep_freed_memory`] asks glibc to keep what the process frees and to reuse it for
//! any size: blocks up to 32 MiB (the largest threshold glibc takes on a 64-bit machine)
//! come from the heap, the heap is never trimmed below 2 GiB of free top, and all threads
//! share one arena, so memory freed on one thread serves the next allocation on any. The
//! resident set then stays at the step's live peak plus glibc's fragmentation, and steps
//! reuse warm pages (measured in docs/benchmarks.md, "Allocator").

/// What [`keep_freed_memory`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MallocTuning {
    /// The settings are in force.
    Set,
    /// `GLIBC_TUNABLES` names malloc settings of its own, which stay.
    UserTunables,
    /// Not glibc (another C library or operating system): nothing to set.
    NotGlibc,
    /// glibc refused a setting (named).
    Refused(&'static str),
}

/// Sets glibc malloc to keep and reuse freed memory (see the module docs), unless the
/// environment's `GLIBC_TUNABLES` sets malloc itself. Call it first thing in `main`, while
/// the process has one thread: the arena limit binds the arenas created after it.
pub fn keep_freed_memory() -> MallocTuning {
    let user = std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc."));
    if user {
        return MallocTuning::UserTunables;
    }
    set_glibc()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_glibc() -> MallocTuning {
    const MIB: libc::c_int = 1 << 20;
    let settings: [(&'static str, libc::c_int, libc::c_int); 4] = [
        (
            "M_MMAP_THRESHOLD = 32 MiB",
            libc::M_MMAP_THRESHOLD,
            32 * MIB,
        ),
        (
            "M_TRIM_THRESHOLD = 2 GiB",
            libc::M_TRIM_THRESHOLD,
            libc::c_int::MAX,
        ),
        ("M_TOP_PAD = 0", libc::M_TOP_PAD, 0),
        ("M_ARENA_MAX = 1", libc::M_ARENA_MAX, 1),
    ];
    for (name, param, value) in settings {
        // SAFETY: mallopt takes two integers and touches only glibc's own malloc state,
        // which it locks; no memory of ours is passed.
        if unsafe { libc::mallopt(param, value) } != 1 {
            return MallocTuning::Refused(name);
        }
    }
    MallocTuning::Set
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_glibc() -> MallocTuning {
    MallocTuning::NotGlibc
}
