//! Packers: turn source folders and files into stoker's on-disk formats.

mod downscale;
pub mod idx;
pub mod image_folder;
pub mod text;
