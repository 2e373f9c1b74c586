//! stoker-data: memory-mapped datasets, samplers, the loader, transforms and loader autotune.
#![deny(missing_docs)]

pub mod array_dataset;
pub mod autotune;
pub mod batch;
pub mod dataset;
pub mod dtype;
pub mod error;
pub mod image_folder;
pub mod loader;
pub mod mapped;
pub mod measure;
pub mod npy;
pub mod open;
pub mod pack;
pub mod paths;
pub mod pin;
pub mod pool;
pub mod records;
pub mod sampler;
pub mod stats;
pub mod tokens;
pub mod transform;

pub use array_dataset::ArrayDataset;
pub use batch::{Batch, BatchField};
pub use dataset::{Dataset, FieldSpec, MappedBytes, SampleContext};
pub use dtype::DType;
pub use error::{DataError, Result};
pub use image_folder::ImageRecordDataset;
pub use loader::{EpochIter, Loader, LoaderConfig};
pub use npy::NpyArray;
pub use open::{dataset_files, open_dataset, AnyDataset, OpenOptions};
pub use records::{RecordShard, RecordWriter};
pub use sampler::{Partition, Sampler, SamplerConfig, SamplerState};
pub use stats::LoaderStats;
pub use tokens::{TokenFormat, TokenShard, TokenWindows};
