//! stoker-data: memory-mapped datasets, samplers, the loader, transforms and loader autotune.
#![deny(missing_docs)]

pub mod dataset;
pub mod dtype;
pub mod error;
pub mod transform;

pub use dataset::{Dataset, FieldSpec, MappedBytes, SampleContext};
pub use dtype::DType;
pub use error::{DataError, Result};
