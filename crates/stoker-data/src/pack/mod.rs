//! Packers: turn source folders and files into stoker's on-disk formats.

pub mod doc_sources;
pub mod docs;
mod downscale;
pub mod gpt2_bpe;
pub mod idx;
pub mod image_folder;
mod json_nonfinite;
mod json_surrogates;
pub mod shard_writer;
pub mod text;
