//! stoker-train: the trainer.
//!
//! Models are written with differentiable candle ops only ([`ops`]); every trainable
//! parameter lives in one flat FP32 master buffer described by a [`layout::FlatLayout`];
//! optimizers, clipping and loss scaling work on flat buffers; gradient accumulation
//! normalizes token losses by the target tokens of the whole window ([`accumulate`]).
//!
//! Modules, one idea each (and no module cycles: `tests/module_cycles.rs` checks it):
//!
//! - [`accumulate`]: gradient accumulation, normalized by the window's valid targets;
//! - [`check`]: every parameter reached by a gradient;
//! - [`checkpoint`]: sharded checkpoints that load at any world size and strategy;
//! - [`clip`]: global-norm gradient clipping;
//! - [`config`]: the training config, one typed schema with its defaults;
//! - [`data`]: the configured datasets, checked against the model, as micro-batches;
//! - [`device`]: where a rank computes (its device, its compute threads);
//! - [`dry_run`]: a run's checks, plan and memory forecast, without training;
//! - [`error`]: the crate's typed errors;
//! - [`grad_sum`]: a window's running gradient sum (in place, or the deterministic tree);
//! - [`heap`]: the binary's heap count, as the run reads it;
//! - [`hf`]: Hugging Face GPT-2 export and import;
//! - [`layout`]: the flat buffer table every parameter and gradient lives in;
//! - [`loss`]: cross-entropy over valid targets;
//! - [`loss_scale`]: the fp16 loss scaler's settings (`[loss_scale]`);
//! - [`machine`]: this machine measured (`--calibrate`) and its profile;
//! - [`malloc_tuning`]: glibc's malloc kept from returning memory every step;
//! - [`memory`]: the bytes a rank holds, by kind;
//! - [`metrics`]: the run's `metrics.jsonl`;
//! - [`model_files`]: synced writes and errors shared by checkpoints and exports;
//! - [`models`]: the GPT, CNN and MLP, their config and their one factory;
//! - [`offload`]: a GPU model's optimizer on the host;
//! - [`ops`]: the differentiable ops models are written with;
//! - [`optim`]: AdamW and SGD over flat buffers;
//! - [`parallel`]: the data-parallel strategies (DDP, ZeRO-1/2/3) behind one seam;
//! - [`params`]: declaring and initializing parameters;
//! - [`pieces`]: the parts of the flat buffer a rank keeps;
//! - [`planned`]: the joint between the planner and the trainer (predictions, forecast);
//! - [`precision`]: precision modes, kernel choice and the forward context;
//! - [`report`]: the run's plots;
//! - [`run`]: a run, set up, trained, checked and summarized;
//! - [`schedule`]: the learning-rate schedule;
//! - [`trainer`]: one rank's training state and its step, on one step path;
//! - [`vars`]: copies between a model's variables and the flat buffers.
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
pub mod loss_scale;
pub mod machine;
pub mod malloc_tuning;
pub mod memory;
pub mod metrics;
pub mod model_files;
pub mod models;
pub mod offload;
pub mod ops;
pub mod optim;
pub mod parallel;
pub mod params;
pub mod pieces;
pub mod planned;
pub mod precision;
pub mod report;
pub mod resident_forecast;
pub mod run;
pub mod schedule;
pub mod trainer;
pub mod vars;

pub use error::{Result, TrainError};
