//! The plan as a whole, and its two renderings: a text report (tables, decision path,
//! chosen settings) and JSON for tools.

use std::fmt::Write;

use serde::Serialize;

use crate::ds_estimate::{self, DsEstimate, Formula};
use crate::emit::PlanChoice;
use crate::hardware::{GB, GIB};
use crate::recommend::{Decision, StrategyRow};
use crate::resolve::Resolved;
use crate::setup::Accounting;
use crate::strategy::Strategy;
pub use crate::units::group;

/// One line of DeepSpeed's own estimator table (model states only).
#[derive(Clone, Debug, Serialize)]
pub struct DsLine {
    /// The strategy.
    pub strategy: String,
    /// DeepSpeed's figures, bytes.
    pub estimate: DsEstimate,
}

/// Everything `stoker plan` computed.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    /// The validated inputs.
    pub inputs: Resolved,
    /// One row per strategy.
    pub strategies: Vec<StrategyRow>,
    /// The recommendation.
    pub decision: Decision,
    /// The settings chosen (absent when nothing fits); `stoker plan --emit-config` writes
    /// them into the trainer's config.
    pub choice: Option<PlanChoice>,
    /// DeepSpeed's estimator lines, when its accounting was asked for.
    pub deepspeed_estimator: Option<Vec<DsLine>>,
}

/// DeepSpeed's estimator for ZeRO-2 and ZeRO-3 variants of this model and cluster.
pub fn deepspeed_lines(r: &Resolved, formula: Formula) -> Vec<DsLine> {
    let p = r.model.params as f64;
    let largest = r.model.largest_layer.unwrap_or(0) as f64;
    [
        Strategy::offload(crate::strategy::Stage::Zero2),
        Strategy::plain(crate::strategy::Stage::Zero2),
        crate::strategy::ALL[7],
        Strategy::offload(crate::strategy::Stage::Zero3),
        Strategy::plain(crate::strategy::Stage::Zero3),
    ]
    .into_iter()
    .filter_map(|s| {
        ds_estimate::estimate(
            p,
            largest,
            r.hardware.devices_per_node,
            r.hardware.nodes,
            s,
            formula,
        )
        .map(|estimate| DsLine {
            strategy: s.label(),
            estimate,
        })
    })
    .collect()
}

impl Plan {
    /// The plan as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// The plan as a text report.
    pub fn to_text(&self) -> String {
        let r = &self.inputs;
        let acc = r.setup.accounting;
        let (unit, div) = match acc {
            Accounting::Stoker => ("GB", GB),
            _ => ("GiB", GIB),
        };
        let mut o = String::new();
        let m = &r.model;
        let hw = &r.hardware;
        let _ = writeln!(
            o,
            "model     {}: {} parameters{}",
            m.name,
            group(m.params),
            m.arch.as_ref().map_or(String::new(), |a| format!(
                " ({} layers, hidden {}, {} heads, vocab {})",
                a.layers, a.hidden, a.heads, a.vocab
            ))
        );
        let _ = writeln!(
            o,
            "hardware  {}: {} node(s) x {} device(s), {:.1} GiB each, ring {:.1} GB/s",
            hw.name,
            hw.nodes,
            hw.devices_per_node,
            hw.device_capacity() / GIB,
            hw.ring_bus_bw() / GB
        );
        let s = &r.setup;
        let _ = writeln!(
            o,
            "training  global batch {} x {} tokens, {}, {}, checkpointing {}, MFU {:.0}%, \
             accounting {}",
            s.global_batch,
            s.seq_len,
            s.precision.name(),
            s.optimizer.name(),
            // stoker's ZeRO-3 recomputes its units only where it shards (more than one
            // device); see Setup::checkpoints.
            match (
                s.activation_checkpointing,
                s.zero3_checkpoints_units && hw.world_size() > 1,
            ) {
                (true, _) => "on",
                (false, true) => "ZeRO-3 units",
                (false, false) => "off",
            },
            s.mfu * 100.0,
            acc.name()
        );
        for n in &r.notes {
            let _ = writeln!(o, "note      {n}");
        }
        let _ = writeln!(
            o,
            "\nMemory per device ({unit}; margin {:.0}%, fragmentation {:.0}%):",
            s.safety_margin * 100.0,
            s.fragmentation * 100.0
        );
        let _ = writeln!(
            o,
            "{:<24} {:>11} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>4}",
            "strategy",
            "micro x acc",
            "params",
            "grads",
            "optim",
            "activ",
            "other",
            "total",
            "usable",
            "host/nd",
            "fits",
        );
        for row in &self.strategies {
            let d = &row.memory.device;
            let _ = writeln!(
                o,
                "{:<24} {:>11} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.1} {:>4}",
                row.label,
                format!("{} x {}", row.micro_batch, row.accumulation_steps),
                d.params / div,
                d.grads / div,
                d.optimizer / div,
                d.activations / div,
                (d.buckets + d.runtime + d.fragmentation) / div,
                d.total / div,
                d.usable / div,
                row.memory.host.needed / div,
                if row.memory.fits { "yes" } else { "no" }
            );
        }
        let _ = writeln!(o, "\nCommunication and time per step:");
        let _ = writeln!(
            o,
            "{:<24} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}",
            "strategy",
            "sync GB",
            "step GB",
            "comm s",
            "compute s",
            "offload s",
            "step s",
            "samples/s"
        );
        for row in &self.strategies {
            let t = &row.time;
            let _ = writeln!(
                o,
                "{:<24} {:>10.2} {:>10.2} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>12.1}",
                row.label,
                row.comm.bytes_per_sync / GB,
                row.comm.bytes_per_step / GB,
                t.comm_s,
                t.compute_s,
                t.offload_s,
                t.step_s,
                t.samples_per_s
            );
        }
        let _ = writeln!(
            o,
            "(step s overlaps reductions with backward; without overlap add comm s in full)"
        );
        if let Some(row) = self.strategies.first() {
            if row.time.activation_traffic_s > 0.0 {
                let _ = writeln!(
                    o,
                    "(step s includes activation traffic: {} host-memory passes over each \
                     micro-batch's activations, {:.3} s per step for {})",
                    self.inputs.setup.activation_passes, row.time.activation_traffic_s, row.label
                );
            }
        }
        if let Some(lines) = &self.deepspeed_estimator {
            let _ = writeln!(o, "\nDeepSpeed's estimator (model states only, GiB):");
            let _ = writeln!(o, "  per CPU  |  per GPU |   Options");
            for l in lines {
                let _ = writeln!(
                    o,
                    " {:7.2}GB | {:6.2}GB | {}",
                    l.estimate.cpu_per_node / GIB,
                    l.estimate.gpu / GIB,
                    l.strategy
                );
            }
        }
        let d = &self.decision;
        let _ = writeln!(o, "\nDecision path:");
        let _ = writeln!(o, "(a) data: {}", d.data.reason);
        let _ = writeln!(o, "(b) precision: {}", d.precision);
        for p in &d.path {
            let _ = writeln!(o, "(c)   {p}");
        }
        let _ = writeln!(o, "(c) strategy: {}", d.strategy);
        for w in &d.warnings {
            let _ = writeln!(o, "warning: {w}");
        }
        if let Some(c) = &self.choice {
            let _ = writeln!(o, "\nChosen: {}", c.summary());
        }
        o
    }
}
