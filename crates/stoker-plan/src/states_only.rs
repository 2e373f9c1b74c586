//! Model states alone, from a parameter count (`stoker plan --params N` with nothing else):
//! the bytes of weights, gradients and optimizer states each device holds under DDP and
//! ZeRO-1/2/3 (ZeRO paper, Figure 1) for a few data-parallel sizes, as DeepSpeed's
//! `estimate_zero*_model_states_mem_needs` answer without a hardware or a batch. No
//! activations, buffers or time: those need the architecture, the batch and the hardware.

use crate::memory::model_states_by_kind;
use crate::setup::{state_bytes, Optimizer, Precision, StateBytes};
use crate::strategy::Stage;

/// Bytes per device of one strategy's model states with `world` data-parallel devices
/// (the memory model's sharding rule, summed).
pub fn per_device(params: u64, bytes: StateBytes, stage: Stage, world: u64) -> f64 {
    model_states_by_kind(params, bytes, stage, world)
        .iter()
        .sum()
}

/// The table `stoker plan --params N` prints: GiB per device for each strategy at each size.
pub fn table(params: u64, precision: Precision, optimizer: Optimizer, worlds: &[u64]) -> String {
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
    out += &format!("{:<10}", "GiB/device");
    for w in worlds {
        out += &format!(
            "{:>12}",
            format!("{w} device{}", if *w == 1 { "" } else { "s" })
        );
    }
    out.push('\n');
    for stage in [Stage::Ddp, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        out += &format!("{:<10}", stage.name());
        for &w in worlds {
            out += &format!("{:>12.2}", per_device(params, sb, stage, w) / gib);
        }
        out.push('\n');
    }
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
}
