//! stoker's GPU kernels, written once (cuda/) and built twice: by the host C++ compiler
//! into [`host`], which the CPU runs in tests against stoker-kernels' twins, and with the
//! `cuda` feature by nvcc into a fatbin for the device, loaded through cudarc. The two
//! builds agree bit for bit by construction (cuda/portable.h says how), so what the CPU
//! checks here, the device check then only has to confirm.
//!
//! Modules, one idea each: `args` (by-value kernel arguments, `repr(C)`), `error`
//! (what a call refuses), `ffi` (the host build's C functions), `host` (safe calls over
//! slices), `token_groups` (the embedding backward's one-writer-per-row index).
#![deny(missing_docs)]

pub mod args;
pub mod error;
mod ffi;
pub mod host;
pub mod token_groups;

pub use args::{AdamWArgs, Heads};
pub use error::GpuError;
pub use host::Act;
pub use token_groups::TokenGroups;
