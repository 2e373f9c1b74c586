//! Decision (a), data: the samples/s the job consumes at the recommended step time, and the
//! loader setting (from a `stoker bench loader --json` result) that sustains it per device.

use serde::Serialize;

use crate::loader::{self, LoaderBench, LoaderChoice};
use crate::resolve::Resolved;
use crate::row::StrategyRow;
use crate::units::fmt_rate;

/// Decision (a): the data rate and, with a benchmark, the loader setting.
#[derive(Clone, Debug, Serialize)]
pub struct DataDecision {
    /// Samples/s the whole job consumes at the recommended step time.
    pub samples_per_s: f64,
    /// Samples/s per node.
    pub per_node: f64,
    /// Samples/s per device (= per loader, one loader per device).
    pub per_device: f64,
    /// The benchmark point chosen, if a benchmark was given.
    pub loader: Option<LoaderChoice>,
    /// Loader workers per device for the emitted config.
    pub num_workers: u64,
    /// Prefetch factor for the emitted config.
    pub prefetch_factor: u64,
    /// One sentence with the numbers.
    pub reason: String,
}

/// Builds decision (a) from the row whose step time sets the pace.
pub fn decide_data(
    r: &Resolved,
    row: Option<&StrategyRow>,
    bench: Option<&LoaderBench>,
    warnings: &mut Vec<String>,
) -> DataDecision {
    let hw = &r.hardware;
    let step = row.map_or(f64::NAN, |x| x.time.step_s);
    let total = r.setup.global_batch as f64 / step;
    let per_node = total / hw.nodes as f64;
    let per_device = total / hw.world_size() as f64;
    // Without a measurement: the chapter's "start from 4", within the cores each device gets.
    let cores_per_device = hw.host_cores / hw.devices_per_node.max(1);
    let default_workers = if hw.host_cores == 0 {
        4
    } else {
        4.min(cores_per_device.saturating_sub(1)).max(1)
    };
    let mut num_workers = default_workers;
    let mut prefetch_factor = 2;
    let choice = bench.map(|b| loader::pick(b, per_device));
    let reason = match &choice {
        Some(LoaderChoice {
            chosen: Some(p), ..
        }) => {
            num_workers = p.num_workers;
            prefetch_factor = p.prefetch_factor;
            format!(
                "the job consumes {} samples/s ({} per node, {} per device); num_workers {} and \
                 prefetch_factor {} is the cheapest measured setting that delivers it per loader \
                 ({:.1} samples/s, one loader per device)",
                fmt_rate(total),
                fmt_rate(per_node),
                fmt_rate(per_device),
                p.num_workers,
                p.prefetch_factor,
                p.samples_per_s
            )
        }
        Some(c) => {
            let fastest = c.fastest.as_ref();
            if let Some(f) = fastest {
                num_workers = f.num_workers;
                prefetch_factor = f.prefetch_factor;
            }
            let msg = format!(
                "no measured loader setting reaches the {} samples/s each device needs ({} per \
                 node): the fastest, {}, gives {:.1}; the step will wait for data unless the \
                 loader gets faster",
                fmt_rate(per_device),
                fmt_rate(per_node),
                fastest.map_or("none".into(), |f| format!(
                    "num_workers {} prefetch_factor {}",
                    f.num_workers, f.prefetch_factor
                )),
                fastest.map_or(0.0, |f| f.samples_per_s)
            );
            warnings.push(msg.clone());
            msg
        }
        None => format!(
            "the job consumes {} samples/s ({} per node, {} per device, one loader per device); \
             no loader benchmark given, so num_workers {} and prefetch_factor 2 are starting \
             points: measure with `stoker bench loader --json` and pass it as --loader-bench",
            fmt_rate(total),
            fmt_rate(per_node),
            fmt_rate(per_device),
            default_workers
        ),
    };
    if hw.host_cores > 0 && num_workers * hw.devices_per_node > hw.host_cores {
        warnings.push(format!(
            "num_workers {} x {} devices = {} workers exceeds the node's {} cores",
            num_workers,
            hw.devices_per_node,
            num_workers * hw.devices_per_node,
            hw.host_cores
        ));
    }
    DataDecision {
        samples_per_s: total,
        per_node,
        per_device,
        loader: choice,
        num_workers,
        prefetch_factor,
        reason,
    }
}
