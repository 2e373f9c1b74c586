//! Efficiencies measured on GPUs by the device check (`stoker bench gpu-kernels --step
//! --fit-out FILE`, which `scripts/gpu/kernels-check.sh` runs), one row per planner
//! preset: the planner's resident-step forecast uses a GPU's row where it has one, and
//! the assumed fractions ([`Efficiencies::ASSUMED`]) where not. A session that runs the
//! device check adds the row it wrote, with its date and GPU.

use crate::forecast::Efficiencies;

/// One GPU's measured efficiencies.
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredGpu {
    /// The planner's hardware preset (`h100-80gb`).
    pub preset: &'static str,
    /// The GPU as its driver named it.
    pub gpu: &'static str,
    /// When it was measured (YYYY-MM-DD).
    pub date: &'static str,
    /// The fractions fitted.
    pub efficiencies: Efficiencies,
}

/// Every GPU measured so far. None yet: no device run has been lent to this project
/// (docs/gpu.md, "What is not verified").
pub const MEASURED: &[MeasuredGpu] = &[];

/// `preset`'s row in `table`, if it has one (case-insensitive).
pub fn measured_in<'t>(table: &'t [MeasuredGpu], preset: &str) -> Option<&'t MeasuredGpu> {
    table.iter().find(|m| m.preset.eq_ignore_ascii_case(preset))
}
