//! stoker's GPU kernels, written once (cuda/) and built twice: by the host C++ compiler,
//! so that the CPU runs every kernel (the [`host::Host`] backend, which the tests hold
//! against stoker-kernels), and with the `cuda` feature by nvcc into a fatbin the device
//! backend loads through cudarc. The two builds agree bit for bit by construction
//! (cuda/portable.h says how), so what the CPU checks here the device check only has to
//! confirm.
//!
//! Layers, bottom up: `call` (one launch as data: name, grid, arguments), `backend` (flat
//! buffers, views, launching), `host` (the CPU backend, through `ffi`; `graph_host`, the same with CUDA graphs' capture and replay), `ids` (ids checked
//! before upload), `kernels` (every kernel as a checked call, for any backend; `llama`
//! the Llama's, `optim` the optimizers over segments), `step` (the GPT's and the Llama's
//! training steps over flat buffers), `parallel` (data parallelism on the backend's
//! buffers: collectives, DDP, ZeRO-1, one rank's windows). Beside them: `args` (by-value
//! arguments, `repr(C)`), `elem` (element types), `error`, `token_groups` (the embedding
//! backward's one-writer-per-row index), `sample` (seeded inputs), `scenario` (every
//! kernel once: what the device check compares), `counting` (a backend that runs nothing
//! and counts what a step asks) and `forecast` (that count timed on a GPU's roofline),
//! `efficiency_fit` (the roofline's fractions from a measured step) and `measured` (the
//! fractions measured on GPUs, for the planner), `device` (the GPU backend, feature
//! `cuda`).
#![deny(missing_docs)]

pub mod args;
pub mod backend;
pub mod call;
mod call_bytes;
pub mod collectives;
pub mod counting;
pub mod efficiency_fit;
pub mod elem;
pub mod error;
mod ffi;
pub mod flash;
pub mod forecast;
pub mod fp8;
pub mod gemm;
pub mod graph_host;
pub mod host;
mod host_threads;
pub mod ids;
pub mod kernels;
pub mod llama;
pub mod measured;
pub mod offload_bench;
pub mod optim;
pub mod parallel;
pub mod pinned;
pub mod sample;
pub mod scenario;
pub mod step;
pub mod token_groups;

pub use args::{AdamWArgs, Heads, StochasticRound};
pub use backend::{Backend, View};
pub use elem::{Act, Dtype, E4m3, E5m2, Elem, Fp8, Fp8Dtype};
pub use error::GpuError;
pub use graph_host::{GraphHost, HostGraph};
pub use host::Host;
pub use ids::{Groups, Ids};
pub use pinned::PinnedHostBuf;
/// The model shapes the steps and the forecast take (stoker-kernels' own).
pub use stoker_kernels::{GptDims, LlamaDims};
pub use token_groups::TokenGroups;

#[cfg(feature = "cuda")]
pub mod device;
