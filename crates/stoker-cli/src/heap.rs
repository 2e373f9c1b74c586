//! The binary's allocator: glibc's malloc told to keep and reuse freed memory
//! (`stoker_train::malloc_tuning`), or mimalloc with the `mimalloc` feature (to compare the
//! two, scripts/bench/allocator.sh), counted (`stoker_train::heap::Counting`), so a run can
//! set what it really holds beside what it planned.

use stoker_train::heap::Counting;

/// The allocator under the count.
#[cfg(feature = "mimalloc")]
pub use mimalloc::MiMalloc as Allocator;
/// The allocator under the count.
#[cfg(not(feature = "mimalloc"))]
pub use std::alloc::System as Allocator;

/// The allocator `main.rs` installs; a run reads its counts (`RunOptions::heap`).
pub type CountingAllocator = Counting<Allocator>;

/// Sets glibc's malloc to keep freed memory for reuse (nothing with mimalloc, which keeps
/// its own). main.rs calls it first, while the process has one thread.
pub fn keep_freed_memory() -> stoker_train::malloc_tuning::MallocTuning {
    #[cfg(not(feature = "mimalloc"))]
    return stoker_train::malloc_tuning::keep_freed_memory();
    #[cfg(feature = "mimalloc")]
    return stoker_train::malloc_tuning::MallocTuning::NotGlibc;
}

/// Keeps the kernel from backing this process's memory with transparent huge pages,
/// unless `STOKER_ALLOW_THP` (or mimalloc's own `MIMALLOC_ALLOW_THP`) is set.
///
/// With huge pages the kernel makes each 2 MiB range resident whole as soon as any byte of
/// it is touched, however little of it is live: under mimalloc (which asks for them on its
/// arenas, `madvise(MADV_HUGEPAGE)`) the GPTs' resident set grew 18-35 MiB beyond their
/// heap (20-30% of the demo's), which no count of buffers can forecast; glibc's heap gets
/// them too where the system's setting is `always`. Step time was the same within
/// run-to-run noise with and without (docs/plan.md). It is the whole process's setting
/// (`PR_SET_THP_DISABLE`), inherited by child processes, of which stoker starts none; a
/// failure leaves the kernel's default.
pub fn no_transparent_huge_pages() {
    if ["STOKER_ALLOW_THP", "MIMALLOC_ALLOW_THP"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
    {
        return;
    }
    // Transparent huge pages and prctl are Linux's; elsewhere there is nothing to turn off.
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes integer arguments only; no memory is passed.
    let _ = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
}
