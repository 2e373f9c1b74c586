//! Model states alone, from a parameter count (`stoker plan --params N` with nothing else):
//! the bytes of weights, gradients and optimizer states each device holds under DDP and
//! ZeRO-1/2/3 (ZeRO paper, Figure 1) for a few data-parallel sizes, as DeepSpeed's
//! `estimate_zero*_model_states_mem_needs` answer without a hardware or a batch. No
//! activations, buffers or time: those need the architecture, the batch and the hardware.

use crate::ds_estimate::{estimate, Formula};
use crate::memory::model_states_by_kind;
use crate::setup::{state_bytes, Accounting, Optimizer, Precision, StateBytes};
use crate::strategy::{Stage, Strategy};

/// Bytes per device of one strategy's model states with `world` data-parallel devices
/// (the memory model's sharding rule, summed).
pub fn per_device(params: u64, bytes: StateBytes, stage: Stage, world: u64) -> f64 {
    model_states_by_kind(params, bytes, stage, world)
        .iter()
        .sum()
}

/// The table `stoker plan --params N` prints: GiB per device for each strategy at each size,
/// by `accounting` ([`deepspeed_table`] for DeepSpeed's).
pub fn table(
    params: u64,
    precision: Precision,
    optimizer: Optimizer,
    worlds: &[u64],
    accounting: Accounting,
) -> String {
    let formula = match accounting {
        Accounting::Stoker => None,
        Accounting::Deepspeed => Some(Formula::Current),
        Accounting::DeepspeedLegacy => Some(Formula::Legacy),
    };
    if let Some(f) = formula {
        return deepspeed_table(params, worlds, f, accounting);
    }
    let sb = state_bytes(precision, optimizer);
    let gib = (1u64 << 30) as f64;
    let mut out = format!(
        "model states only: {params} parameters, {} with {} ({} + {} + {} bytes per parameter: \
         weights + gradients + optimizer states); no activations, buffers or time (give the \
         architecture, --global-batch and --hardware for those)\n\n",
        precision.name(),
        optimizer.name(),
        sb.weight,
        sb.grad,
        sb.optimizer,
    );
    out += &header("GiB/device", 10, worlds);
    for stage in [Stage::Ddp, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        out += &format!("{:<10}", stage.name());
        for &w in worlds {
            out += &format!("{:>12.2}", per_device(params, sb, stage, w) / gib);
        }
        out.push('\n');
    }
    out
}

/// The column header, its first column `width` wide: one column per data-parallel size.
fn header(first: &str, width: usize, worlds: &[u64]) -> String {
    let mut out = format!("{first:<width$}");
    for w in worlds {
        out += &format!(
            "{:>12}",
            format!("{w} device{}", if *w == 1 { "" } else { "s" })
        );
    }
    out.push('\n');
    out
}

/// `stoker plan --params N --accounting deepspeed[-legacy]`: DeepSpeed's stage 1/2
/// estimator (`estimate_zero2_model_states_mem_needs`), which needs the count alone; its
/// per-GPU figure depends on the job's GPU count only (nodes x GPUs per node), so one
/// column per count; mixed-precision Adam whatever the precision, as DeepSpeed's.
/// DDP has no DeepSpeed estimator, and ZeRO-3's counts the largest layer, which a count
/// does not give: both rows say so instead of a figure.
pub fn deepspeed_table(
    params: u64,
    worlds: &[u64],
    formula: Formula,
    accounting: Accounting,
) -> String {
    let gib = (1u64 << 30) as f64;
    let mut out = format!(
        "model states only: {params} parameters, DeepSpeed's estimator (--accounting {}: \
         estimate_zero2_model_states_mem_needs, GiB per GPU by the job's GPU count, \
         however many nodes hold them; mixed-precision \
         Adam whatever --precision); no activations, buffers or time\n\n",
        accounting.name()
    );
    out += &header("GiB/GPU", 20, worlds);
    for strategy in [
        Strategy::plain(Stage::Zero2),
        Strategy::offload(Stage::Zero2),
    ] {
        let label = match strategy.offload_optimizer {
            true => "zero1/2+offload-opt",
            false => "zero1/2",
        };
        out += &format!("{label:<20}");
        for &w in worlds {
            let gpu =
                estimate(params as f64, 0.0, w, 1, strategy, formula).map_or(f64::NAN, |e| e.gpu);
            out += &format!("{:>12.2}", gpu / gib);
        }
        out.push('\n');
    }
    out += "ddp: DeepSpeed has no estimator for it (--accounting stoker counts it)\n";
    out += "zero3: DeepSpeed's estimator counts the largest layer: a full plan \
            (--model or --layers/--hidden, and --hardware) prints its row\n";
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ZeRO paper's Figure 1: 7.5B parameters, mixed-precision Adam (16 bytes per
    /// parameter), 64 devices: 120 GB, 31.4 GB, 16.6 GB and 1.9 GB per device (10^9 bytes).
    #[test]
    fn the_zero_papers_figure_1() {
        let sb = state_bytes(Precision::Bf16, Optimizer::Adam);
        let gb = |s| per_device(7_500_000_000, sb, s, 64) / 1e9;
        assert_eq!(gb(Stage::Ddp), 120.0);
        assert!((gb(Stage::Zero1) - 31.40625).abs() < 1e-9);
        assert!((gb(Stage::Zero2) - 16.640625).abs() < 1e-9);
        assert!((gb(Stage::Zero3) - 1.875).abs() < 1e-9);
    }

    /// DeepSpeed's docs' t5-3b example on 8 GPUs: 15.93 GiB per GPU with the legacy formula
    /// (4P + 16P/G), 11.29 with today's (2P + 18P/G), 5.31 with optimizer offload (2P).
    #[test]
    fn deepspeed_s_accounting_is_deepspeed_s_table_not_stoker_s() {
        let t5 = 2_851_598_336;
        let row = |text: &str, label: &str| -> Vec<String> {
            let line = text
                .lines()
                .find(|l| l.split_whitespace().next() == Some(label))
                .unwrap();
            line.split_whitespace().skip(1).map(String::from).collect()
        };
        let legacy = table(
            t5,
            Precision::Bf16,
            Optimizer::Adam,
            &[8],
            Accounting::DeepspeedLegacy,
        );
        assert_eq!(row(&legacy, "zero1/2"), ["15.93"]);
        assert_eq!(row(&legacy, "zero1/2+offload-opt"), ["5.31"]);
        let current = table(
            t5,
            Precision::Fp32,
            Optimizer::Sgd,
            &[8],
            Accounting::Deepspeed,
        );
        assert_eq!(row(&current, "zero1/2"), ["11.29"]);
        assert!(
            current.contains("--accounting deepspeed:") && current.contains("zero3: DeepSpeed")
        );
        let ours = table(
            t5,
            Precision::Bf16,
            Optimizer::Adam,
            &[8],
            Accounting::Stoker,
        );
        assert!(!ours.contains("zero1/2"), "{ours}");
    }
}
