//! stoker-train: the trainer.
//!
//! Models are written with differentiable candle ops only ([`ops`]); every trainable
//! parameter lives in one flat FP32 master buffer described by a [`layout::FlatLayout`];
//! optimizers, clipping and loss scaling work on flat buffers; gradient accumulation
//! normalizes token losses by the target tokens of the whole window ([`accumulate`]).
#![deny(missing_docs)]

pub mod accumulate;
pub mod check;
pub mod checkpoint;
pub mod clip;
pub mod config;
pub mod data;
pub mod error;
pub mod layout;
pub mod loss;
pub mod metrics;
pub mod models;
pub mod ops;
pub mod optim;
pub mod params;
pub mod precision;
pub mod report;
pub mod run;
pub mod schedule;
pub mod trainer;

pub use error::{Result, TrainError};
