//! stoker-train: the trainer.
//!
//! Models are written with differentiable candle ops only ([`ops`]); every trainable
//! parameter lives in one flat FP32 master buffer described by a [`layout::FlatLayout`];
//! optimizers, clipping and loss scaling work on flat buffers; gradient accumulation
//! normalizes token losses by the target tokens of the whole window ([`accumulate`]).
//!
//! Modules, one idea each: [`params`] (declaring and initializing parameters), [`layout`]
//! (the flat buffer table), [`optim`] (AdamW, SGD), [`schedule`], [`clip`], [`loss`],
//! [`accumulate`], [`models`], [`ops`], [`precision`], [`check`], [`config`], [`data`],
//! [`trainer`], [`checkpoint`], [`metrics`], [`run`] (the loop), [`report`] (plots),
//! [`device`] (where the model runs) and [`offload`] (a GPU model's optimizer on the host).
//!
//! ```
//! use candle_core::{DType, Device};
//! use stoker_train::layout::FlatLayout;
//! use stoker_train::optim::{segments, AdamW, AdamWConfig, Optimizer};
//! use stoker_train::params::{Init, ParamBuilder};
//!
//! let mut b = ParamBuilder::new(Device::Cpu, DType::BF16, 0);
//! b.param("fc.weight", &[4, 3], Init::Normal(0.02)).unwrap();
//! b.param("fc.bias", &[4], Init::Zeros).unwrap();
//! let params = b.finish();
//! let layout = FlatLayout::of(&params).unwrap(); // fc.bias at 0, fc.weight at 16
//! let mut master = layout.flatten(&params).unwrap(); // FP32 master copy
//! let grads = vec![0.1f32; layout.total_len()];
//! let mut opt = AdamW::new(AdamWConfig::default(), &segments(&layout, false), 0..master.len());
//! opt.step(&mut master, &grads, 1e-3, None);
//! layout.unflatten(&master, &params).unwrap(); // refresh the bf16 variables
//! assert_eq!(layout.slots()[1].offset, 16);
//! ```
#![deny(missing_docs)]

pub mod accumulate;
pub mod calibrate;
pub mod check;
pub mod checkpoint;
pub mod clip;
pub mod config;
pub mod data;
pub mod device;
pub mod dry_run;
pub mod error;
pub mod grad_sum;
pub mod heap;
pub mod hf;
pub mod layout;
pub mod loss;
pub mod malloc_tuning;
pub mod memory;
pub mod metrics;
pub mod models;
pub mod offload;
pub mod ops;
pub mod optim;
pub mod parallel;
pub mod params;
pub mod pieces;
pub mod planned;
pub mod precision;
pub mod profile;
pub mod report;
pub mod run;
pub mod schedule;
pub mod trainer;

pub use error::{Result, TrainError};
