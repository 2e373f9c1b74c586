//! stoker-plan: the memory / communication / time model behind `stoker plan`.
//!
//! Given a model, the hardware and a training setup, it predicts per-device memory for DDP,
//! ZeRO-1/2/3 with and without offload, the communication and step time of each, and
//! recommends (in the chapter's order: data, precision, strategy) the cheapest strategy
//! that fits; [`emit::PlanChoice`] is what it chose, which `stoker plan --emit-config`
//! writes as a training config in the trainer's own schema.
//!
//! Modules, one idea each: `input` (raw TOML and flag inputs), `resolve` (validated model,
//! hardware and setup), `model`, `hardware`, `setup`, `deepspeed` (reading a ds_config) and `deepspeed_fp16` (its loss-scaler keys);
//! the estimates `activation`, `memory`, `comm`, `time`, `states_only`, `ds_estimate`,
//! `trainer` (the trainer's own buffer count); the decisions `data` (a), `precision` (b),
//! `strategy` and `recommend` (c), each strategy's result a `row`, `loader` (a loader
//! benchmark); the output `report`, `units` (formatting), `emit` (the chosen settings for
//! the trainer), `error`.
//!
//! ```
//! use stoker_plan::{input::PlanInput, plan, resolve::resolve};
//! let cli: PlanInput = toml::from_str(r#"
//!     model = { preset = "gpt2-124m" }
//!     hardware = { preset = "a100-80gb" }
//! "#).unwrap();
//! let r = resolve(&PlanInput::default(), None, &cli).unwrap();
//! let p = plan(r, None);
//! assert_eq!(p.decision.chosen.map(|i| p.strategies[i].label.as_str()), Some("ddp"));
//! ```
#![deny(missing_docs)]

pub mod activation;
pub mod comm;
pub mod data;
pub mod deepspeed;
pub mod deepspeed_fp16;
pub mod ds_estimate;
pub mod emit;
pub mod error;
pub mod hardware;
pub mod input;
pub mod loader;
pub mod memory;
pub mod model;
pub mod precision;
pub mod recommend;
pub mod report;
pub mod resolve;
pub mod row;
pub mod setup;
pub mod states_only;
pub mod strategy;
pub mod time;
pub mod trainer;
pub mod units;

pub use error::{PlanError, Result};
pub use report::Plan;

use ds_estimate::Formula;
use emit::{
    AccumulationSection, DataSection, ModelSection, OptimizerSection, ParallelSection, PlanChoice,
    PrecisionSection, PredictionSection,
};
use loader::LoaderBench;
use resolve::Resolved;
use setup::Accounting;

/// Plans for validated inputs, with an optional loader benchmark.
pub fn plan(r: Resolved, bench: Option<&LoaderBench>) -> Plan {
    let rows = recommend::evaluate_all(&r);
    let decision = recommend::decide(&r, &rows, bench);
    let choice = decision.chosen.map(|i| {
        let row = &rows[i];
        PlanChoice {
            model: ModelSection {
                name: r.model.name.clone(),
                params: r.model.params,
                seq_len: r.setup.seq_len,
                activation_checkpointing: r.setup.activation_checkpointing,
            },
            data: DataSection {
                num_workers: decision.data.num_workers,
                prefetch_factor: decision.data.prefetch_factor,
                // Pinned buffers only help a host-to-accelerator copy.
                pin_memory: r.hardware.accelerator,
                micro_batch: row.micro_batch,
                required_samples_per_s: decision.data.per_device,
            },
            precision: PrecisionSection {
                precision: r.setup.precision,
                loss_scaling: if r.precision.loss_scaling {
                    "dynamic"
                } else {
                    "none"
                }
                .into(),
            },
            accumulation: AccumulationSection {
                accumulation_steps: row.accumulation_steps,
                global_batch: r.setup.global_batch,
            },
            parallel: ParallelSection {
                strategy: row.strategy.stage,
                offload_optimizer: row.strategy.offload_optimizer,
                offload_params: row.strategy.offload_params,
                world_size: r.hardware.world_size(),
                devices_per_node: r.hardware.devices_per_node,
            },
            optimizer: OptimizerSection {
                name: r.setup.optimizer.name().into(),
            },
            predicted: PredictionSection {
                step_s: row.time.step_s,
                peak_bytes: row.memory.device.total,
            },
        }
    });
    let deepspeed_estimator = match r.setup.accounting {
        Accounting::Stoker => None,
        Accounting::Deepspeed => Some(report::deepspeed_lines(&r, Formula::Current)),
        Accounting::DeepspeedLegacy => Some(report::deepspeed_lines(&r, Formula::Legacy)),
    };
    Plan {
        inputs: r,
        strategies: rows,
        decision,
        choice,
        deepspeed_estimator,
    }
}
