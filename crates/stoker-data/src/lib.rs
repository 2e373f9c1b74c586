//! stoker-data: memory-mapped datasets, samplers, the loader, transforms and loader autotune.
#![deny(missing_docs)]

pub mod transform;
