//! The binary's allocator: mimalloc (main.rs says why), counted
//! (`stoker_train::heap::Counting`), so a run can set what it really holds beside what it
//! planned.

use mimalloc::MiMalloc;
use stoker_train::heap::Counting;

/// The allocator `main.rs` installs; a run reads its counts (`RunOptions::heap`).
pub type CountingMiMalloc = Counting<MiMalloc>;
