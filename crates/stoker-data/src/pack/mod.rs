//! Packers: turn source folders and files into stoker's on-disk formats.

pub mod image_folder;
