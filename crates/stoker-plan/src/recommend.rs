//! The recommendation, in the chapter's order: (a) data rate and loader setting, (b) precision
//! (decided in [`crate::precision`]), (c) the cheapest strategy that fits, tried in the order
//! DDP -> ZeRO-1 -> ZeRO-2 -> ZeRO-3 -> offload, each with the largest micro-batch that fits.

use serde::Serialize;

use crate::comm::communication;
use crate::data::{decide_data, DataDecision};
use crate::hardware::GB;
use crate::loader::LoaderBench;
use crate::memory;
use crate::resolve::Resolved;
pub use crate::row::StrategyRow;
use crate::strategy::{self, Stage, Strategy};
use crate::time::step_time;
use crate::units::{fmt_bytes, fmt_s};

/// The whole recommendation.
#[derive(Clone, Debug, Serialize)]
pub struct Decision {
    /// (a) data.
    pub data: DataDecision,
    /// (b) precision sentence.
    pub precision: String,
    /// (c) index into the rows of the chosen strategy, if any fits.
    pub chosen: Option<usize>,
    /// (c) one line per strategy tried, in order.
    pub path: Vec<String>,
    /// (c) the strategy sentence.
    pub strategy: String,
    /// Warnings (communication-bound ZeRO-3, unmet loader rate, ...).
    pub warnings: Vec<String>,
}

/// Divisors of `n`, largest first (O(sqrt n)).
fn divisors_descending(n: u64) -> Vec<u64> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1u64;
    while d.saturating_mul(d) <= n {
        if n.is_multiple_of(d) {
            small.push(d);
            if d != n / d {
                large.push(n / d);
            }
        }
        d += 1;
    }
    large.into_iter().chain(small.into_iter().rev()).collect()
}

/// Evaluates one strategy: the largest micro-batch dividing the per-device batch that fits
/// (or the pinned one), else micro-batch 1.
pub fn evaluate(r: &Resolved, strategy: Strategy) -> StrategyRow {
    // resolve() guarantees world >= 1 and micro dividing the per-device batch; max(1) keeps
    // hand-built inputs from dividing by zero.
    let world = r.hardware.world_size().max(1);
    let per_rank = r.setup.global_batch / world;
    let est = |m: u64| memory::estimate(&r.model, &r.hardware, &r.setup, strategy, m);
    let micro = match r.setup.micro_batch {
        Some(m) => m,
        None => divisors_descending(per_rank)
            .into_iter()
            .find(|&m| est(m).fits)
            .unwrap_or(1),
    };
    let micro = micro.max(1);
    let accum = (per_rank / micro).max(1);
    let mem = est(micro);
    let comm = communication(&r.model, &r.hardware, &r.setup, strategy, accum);
    let peak = r
        .hardware
        .device_peak_flops(r.setup.precision.compute_dtype())
        .unwrap_or(f64::NAN);
    let time = step_time(
        &r.model,
        &r.hardware,
        &r.setup,
        strategy,
        &comm,
        micro,
        accum,
        peak,
    );
    StrategyRow {
        strategy,
        label: strategy.label(),
        micro_batch: micro,
        accumulation_steps: accum,
        memory: mem,
        comm,
        time,
    }
}

/// Evaluates every strategy of the table (plus a pinned one not in it).
pub fn evaluate_all(r: &Resolved) -> Vec<StrategyRow> {
    let mut list: Vec<Strategy> = strategy::TABLE.to_vec();
    if let Some(p) = r.pinned_strategy {
        if !list.contains(&p) {
            list.push(p);
        }
    }
    list.into_iter().map(|s| evaluate(r, s)).collect()
}

/// Walks the rows in order and builds the recommendation.
pub fn decide(r: &Resolved, rows: &[StrategyRow], bench: Option<&LoaderBench>) -> Decision {
    // Whether a row already stores only checkpoints (no checkpointing hint for it).
    let checkpoints = |row: &StrategyRow| {
        r.setup
            .checkpoints(row.strategy.stage, r.hardware.world_size())
    };
    // Whether the walk considers a row: one of the chapter's strategies, and no offload
    // off an accelerator (whose states are in host memory already).
    let offloads =
        |row: &StrategyRow| row.strategy.offload_optimizer || row.strategy.offload_params;
    let considered = |row: &StrategyRow| {
        strategy::ALL.contains(&row.strategy) && (r.hardware.accelerator || !offloads(row))
    };
    let acc = r.setup.accounting;
    let mut warnings: Vec<String> = r.precision.warnings.clone();
    let mut path = Vec::new();
    let mut chosen = None;
    for (i, row) in rows.iter().enumerate() {
        if !strategy::ALL.contains(&row.strategy) {
            continue;
        }
        if !considered(row) {
            path.push(format!(
                "{}: not considered: offload moves an accelerator's states to host memory, and \
                 on {} they are in host memory already",
                row.label, r.hardware.name
            ));
            continue;
        }
        let d = &row.memory.device;
        let h = &row.memory.host;
        if row.memory.fits {
            path.push(format!(
                "{}: fits: {} of {} usable per device at micro-batch {} x {} accumulation steps{}",
                row.label,
                fmt_bytes(d.total, acc),
                fmt_bytes(d.usable, acc),
                row.micro_batch,
                row.accumulation_steps,
                if h.needed > 0.0 {
                    format!(
                        ", host {} of {} usable per node",
                        fmt_bytes(h.needed, acc),
                        fmt_bytes(h.usable, acc)
                    )
                } else {
                    String::new()
                }
            ));
            chosen = Some(i);
            break;
        }
        let why = if d.total > d.usable {
            format!(
                "needs {} per device at micro-batch {} (model states {}, activations {}), over \
                 the {} usable ({} less the {:.0}% margin)",
                fmt_bytes(d.total, acc),
                row.micro_batch,
                fmt_bytes(d.model_states(), acc),
                fmt_bytes(d.activations, acc),
                fmt_bytes(d.usable, acc),
                fmt_bytes(d.capacity, acc),
                r.setup.safety_margin * 100.0
            )
        } else {
            format!(
                "device fits ({}) but the host needs {} per node, over the {} usable",
                fmt_bytes(d.total, acc),
                fmt_bytes(h.needed, acc),
                fmt_bytes(h.usable, acc)
            )
        };
        path.push(format!("{}: does not fit: {why}", row.label));
    }

    // The row whose timing drives the data rate: the chosen one, else the one nearest to
    // fitting among the rows the walk considered, by its larger shortfall (device or host).
    let shortfall = |row: &StrategyRow| {
        let over = |need: f64, usable: f64| match need > 0.0 {
            true => need / usable,
            false => 0.0,
        };
        let (d, h) = (&row.memory.device, &row.memory.host);
        over(d.total, d.usable).max(over(h.needed, h.usable))
    };
    let timing_row = chosen.map(|i| &rows[i]).or_else(|| {
        rows.iter()
            .filter(|x| considered(x))
            .min_by(|a, b| shortfall(a).total_cmp(&shortfall(b)))
    });
    let strategy_sentence = match chosen {
        Some(i) => {
            let row = &rows[i];
            let t = &row.time;
            format!(
                "{} because it is the first in DDP -> ZeRO-1 -> ZeRO-2 -> ZeRO-3 -> offload that \
                 fits: {} of {} usable per device with micro-batch {} x {} accumulation steps x \
                 {} devices = global batch {}; step {} ({} compute, {} exposed communication{}), \
                 {:.1} samples/s",
                row.label,
                fmt_bytes(row.memory.device.total, acc),
                fmt_bytes(row.memory.device.usable, acc),
                row.micro_batch,
                row.accumulation_steps,
                r.hardware.world_size(),
                r.setup.global_batch,
                fmt_s(t.step_s),
                fmt_s(t.compute_s),
                fmt_s(t.exposed_comm_s),
                [
                    (t.offload_s, "offload"),
                    (t.activation_traffic_s, "activation traffic")
                ]
                .iter()
                .filter(|(s, _)| *s > 0.0)
                .map(|(s, what)| format!(", {} {what}", fmt_s(*s)))
                .collect::<String>(),
                t.samples_per_s
            )
        }
        None => match timing_row {
            None => "no strategy was evaluated".to_string(),
            // The device holds it and the host does not: more devices would not help.
            Some(best) if best.memory.device.total <= best.memory.device.usable => format!(
                "nothing fits: the smallest need, {}, fits the device ({} of {} usable at \
                 micro-batch {}) but needs {} of host memory per node against {} usable; add \
                 host memory or nodes, or offload less",
                best.label,
                fmt_bytes(best.memory.device.total, acc),
                fmt_bytes(best.memory.device.usable, acc),
                best.micro_batch,
                fmt_bytes(best.memory.host.needed, acc),
                fmt_bytes(best.memory.host.usable, acc),
            ),
            Some(best) => format!(
                "nothing fits: the smallest need is {} with {} per device at micro-batch {} \
                 against {} usable; {}",
                best.label,
                fmt_bytes(best.memory.device.total, acc),
                best.micro_batch,
                fmt_bytes(best.memory.device.usable, acc),
                {
                    // More devices shard the model states, never one sequence's activations.
                    let d = &best.memory.device;
                    let alone = d.activations > d.usable;
                    let ways: Vec<&str> = [
                        (!alone).then_some("add devices"),
                        (!checkpoints(best)).then_some("turn on activation checkpointing"),
                    ]
                    .into_iter()
                    .flatten()
                    .collect();
                    let ways = match ways.is_empty() {
                        true => "shorten the sequence".to_string(),
                        false => format!("{}, or shorten the sequence", ways.join(", ")),
                    };
                    match alone {
                        true => format!(
                            "its activations alone take {}: {ways}",
                            fmt_bytes(d.activations, acc)
                        ),
                        false => ways,
                    }
                }
            ),
        },
    };

    if let Some(i) = chosen {
        let c = &rows[i];
        let faster = rows
            .iter()
            .skip(i + 1)
            .filter(|x| x.memory.fits && strategy::ALL.contains(&x.strategy))
            .min_by(|a, b| a.time.step_s.total_cmp(&b.time.step_s));
        if let Some(f) = faster {
            if f.time.step_s < 0.9 * c.time.step_s {
                let why = match f.micro_batch > c.micro_batch {
                    true => format!("its larger micro-batch {}", f.micro_batch),
                    false => "lighter traffic or less work per step".to_string(),
                };
                warnings.push(format!(
                    "{} also fits and is estimated {:.0}% faster ({} vs {} per step, from \
                     {why}); the chapter's order prefers {}",
                    f.label,
                    (1.0 - f.time.step_s / c.time.step_s) * 100.0,
                    fmt_s(f.time.step_s),
                    fmt_s(c.time.step_s),
                    c.label
                ));
            }
        }
    }
    if let Some(p) = r.pinned_strategy {
        if let Some(row) = rows.iter().find(|x| x.strategy == p) {
            let (d, h) = (&row.memory.device, &row.memory.host);
            let device = format!(
                "{} of {} usable per device at micro-batch {}",
                fmt_bytes(d.total, acc),
                fmt_bytes(d.usable, acc),
                row.micro_batch
            );
            // Where the device holds it, the host is what falls short: name it.
            let verdict = match (row.memory.fits, d.total <= d.usable) {
                (true, _) => format!("fits ({device})"),
                (false, true) => format!(
                    "does NOT fit: the device holds it ({device}), but the host needs {} per \
                     node against {} usable",
                    fmt_bytes(h.needed, acc),
                    fmt_bytes(h.usable, acc)
                ),
                (false, false) => format!("does NOT fit ({device})"),
            };
            warnings.push(format!(
                "the configuration asks for {}: it {verdict}",
                row.label
            ));
        }
    }
    let hint_row = chosen.map(|i| &rows[i]).or(timing_row);
    if let (Some(row), false, Some(arch)) = (
        hint_row,
        hint_row.is_some_and(checkpoints),
        r.model.arch.as_ref(),
    ) {
        let d = &row.memory.device;
        // Only worth saying when memory forced something: sharding, offload, accumulation,
        // or nothing fits. A strategy or micro-batch the user pinned is no forcing.
        let forced = chosen.is_none()
            || (chosen != Some(0) && r.pinned_strategy.is_none())
            || (row.accumulation_steps > 1 && r.setup.micro_batch.is_none());
        if forced && d.activations > 0.5 * d.total {
            let with = crate::activation::activations(
                arch,
                row.micro_batch,
                r.setup.seq_len,
                r.setup.precision.activation_bytes(),
                true,
                r.setup.flash_attention,
            );
            warnings.push(format!(
                "activations are {} of the {} {} needs per device; activation checkpointing \
                 would cut them to {} at micro-batch {} for 1/3 more compute \
                 (--activation-checkpointing)",
                fmt_bytes(d.activations, acc),
                fmt_bytes(d.total, acc),
                row.label,
                fmt_bytes(with.total, acc),
                row.micro_batch
            ));
        }
    }
    let world = r.hardware.world_size();
    if world > 1 {
        if let Some(z3) = rows
            .iter()
            .find(|x| x.strategy == Strategy::plain(Stage::Zero3))
        {
            if z3.time.comm_s > z3.time.compute_s {
                warnings.push(format!(
                    "at {} GB/s ring bandwidth ({}) ZeRO-3 moves {} GB per device per step \
                     in {} against {} of compute: its communication exceeds compute, so ZeRO-3 \
                     is communication-bound and slower than DDP would be (the chapter's 10 Gbps \
                     warning)",
                    sig3(z3.comm.bus_bw / GB),
                    if r.hardware.nodes > 1 {
                        format!(
                            "{} Gbit/s between nodes",
                            sig3(r.hardware.inter_node_bw * 8.0 / 1e9)
                        )
                    } else {
                        "inside one node".to_string()
                    },
                    sig3(z3.comm.bytes_per_step / GB),
                    fmt_s(z3.time.comm_s),
                    fmt_s(z3.time.compute_s)
                ));
            }
        }
    }

    let data = decide_data(r, timing_row, bench, &mut warnings);
    Decision {
        data,
        precision: r.precision.reason.clone(),
        chosen,
        path,
        strategy: strategy_sentence,
        warnings,
    }
}

/// `x` with three significant digits (0.0125, 0.1, 12.5, 3200), so that slow links and
/// small models do not print as 0.
fn sig3(x: f64) -> String {
    if !x.is_finite() || x == 0.0 {
        return format!("{x}");
    }
    let decimals = (2 - x.abs().log10().floor() as i32).clamp(0, 12) as usize;
    let s = format!("{x:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::divisors_descending;

    #[test]
    fn divisors_largest_first() {
        assert_eq!(divisors_descending(12), vec![12, 6, 4, 3, 2, 1]);
        assert_eq!(divisors_descending(16), vec![16, 8, 4, 2, 1]);
        assert_eq!(divisors_descending(1), vec![1]);
        assert_eq!(divisors_descending(1_000_000_000).len(), 100);
    }
}
