//! Image transforms: JPEG decode (libjpeg-turbo, scaled in the DCT domain when the crop allows,
//! or zune-jpeg), random-resized-crop or resize + center crop, horizontal flip,
//! normalize with mean/std, output f32 or bf16 in CHW.
//!
//! ```no_run
//! use stoker_data::transform::{ImagePipeline, ImageScratch, ImageTransformConfig};
//! use stoker_data::SampleContext;
//! # fn main() -> stoker_data::Result<()> {
//! let pipeline = ImagePipeline::new(ImageTransformConfig::default())?; // RRC 224, f32
//! let mut scratch = ImageScratch::default(); // one per worker
//! let mut out = vec![0u8; pipeline.output_bytes()];
//! let jpeg = std::fs::read("cat.jpg").unwrap();
//! let seed = SampleContext { seed: 0, epoch: 3, index: 17 }.sample_seed();
//! pipeline.apply(&jpeg, seed, &mut scratch, &mut out)?;
//! # Ok(()) }
//! ```
//!
//! Randomness per sample derives from one seed (from seed, epoch and index), so a batch is
//! bit-identical whatever the number of workers.

pub mod config;
pub mod crop;
pub mod decode;
mod normalize;
pub mod pipeline;
pub(crate) mod resize;
pub mod rng;
mod scans;
pub(crate) mod structure;
mod turbo;
mod zune;

pub use config::{ImageTransformConfig, JpegBackend, TransformMode, IMAGENET_MEAN, IMAGENET_STD};
pub use crop::{dct_reduction, CropBox};
pub use decode::{decode_jpeg, Decoded, JpegDecoder, JpegHeader};
pub use pipeline::{ImagePipeline, ImageScratch};
pub use rng::SampleRng;
