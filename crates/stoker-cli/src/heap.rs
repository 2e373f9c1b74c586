//! The binary's allocator: mimalloc (main.rs says why), counted
//! (`stoker_train::heap::Counting`), so a run can set what it really holds beside what it
//! planned.

use mimalloc::MiMalloc;
use stoker_train::heap::Counting;

/// The allocator `main.rs` installs; a run reads its counts (`RunOptions::heap`).
pub type CountingMiMalloc = Counting<MiMalloc>;

/// Keeps the kernel from backing this process's memory with transparent huge pages,
/// unless `MIMALLOC_ALLOW_THP` is set (mimalloc's own switch, which it then reads itself).
///
/// mimalloc asks for huge pages on its arenas (`madvise(MADV_HUGEPAGE)`), and the kernel
/// then makes each 2 MiB range resident whole as soon as any byte of it is touched, however
/// little of it is live: the GPTs' resident set grew 18-35 MiB beyond their heap (20-30%
/// of the demo's), which no count of buffers can forecast. Their step time was the same
/// within run-to-run noise with and without (docs/plan.md). It is the whole process's
/// setting (`PR_SET_THP_DISABLE`), inherited by child processes, of which stoker starts
/// none; a failure leaves the kernel's default.
pub fn no_transparent_huge_pages() {
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_some() {
        return;
    }
    // Transparent huge pages and prctl are Linux's; elsewhere there is nothing to turn off.
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes integer arguments only; no memory is passed.
    let _ = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
}
