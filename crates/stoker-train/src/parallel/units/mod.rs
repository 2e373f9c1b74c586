//! ZeRO-3 on the candle-graph path, unit by unit: FSDP with a wrap policy per layer or
//! block ([`crate::models::Model::units`]) and activation checkpointing at the units' boundaries. A rank
//! gathers one unit's parameter groups at a time, runs that unit and drops them; each
//! group's gradients are reduce-scattered into the rank's shard as soon as the backward is
//! done with the group.
//!
//! Candle's autograd keeps every tensor a forward used until the backward, gathered
//! weights included, so a unit's parameters cannot be freed under a graph that lives on.
//! The forward therefore runs each unit with no graph outliving it and keeps only the
//! unit's input (its checkpoint); the backward gathers each unit again, last unit first,
//! reruns its forward from the checkpoint with the graph, and backpropagates the
//! gradient of its output into its parameters and its input. That is one more forward
//! per micro-batch (about 4/3 of the compute, as activation checkpointing costs) for one
//! unit's parameters, gradients and graph at a time instead of the whole model's.
//!
//! Groups that several units read (the GPT's token embedding, which its tied head reads
//! too) stay gathered from their first use to their last, and their gradients are summed
//! over those units before their reduce-scatter: FSDP's root unit. With
//! `reshard_after_forward = false` a unit's groups stay gathered from its forward to its
//! backward (one gather each, the whole model's parameters at the forward's end).
//!
//! The schedule ([`plan::UnitPlan::schedule`]) is data: [`step::micro_batch`] runs it,
//! and [`plan::UnitPlan::peak_bytes`] replays it with sizes alone, so the workspace is predicted
//! before the first step; the planner counts its gathers ([`plan::UnitPlan::gathers`]).
//!
//! Evaluation and sampling run the forward alone the same way ([`step::forward`]), on
//! either path (a GPT on the direct step too): no rank ever holds the whole model.
//!
//! [`plan`] holds the units and their schedule; [`step`] runs one micro-batch of it.

pub mod plan;
pub mod step;

pub use plan::{Event, UnitPlan};
pub use step::{evaluate, forward, micro_batch, Collective, Scratch, SpanSource, UnitStep};
