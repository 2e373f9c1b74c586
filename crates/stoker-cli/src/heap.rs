//! The binary's allocator: mimalloc (main.rs says why), counted
//! (`stoker_train::heap::Counting`), so a run can set what it really holds beside what it
//! planned.

use mimalloc::MiMalloc;
use stoker_train::heap::Counting;

/// The allocator `main.rs` installs.
pub type CountingMiMalloc = Counting<MiMalloc>;

/// The probe `stoker train` hands to the run: the installed allocator's counts.
pub fn probe() -> stoker_train::run::HeapProbe {
    stoker_train::run::HeapProbe {
        live: || crate::ALLOC.live(),
        peak: || crate::ALLOC.peak(),
        reset_peak: || crate::ALLOC.reset_peak(),
    }
}
