//! The forecast's efficiencies measured: a step's parts timed on a device (the device
//! check's profile, CUDA events around each launch) against the forecast of the same
//! work at the figures it assumed. Each fraction is scaled by what its parts forecast
//! over what they took:
//! - the products' fraction of peak, by the dense products (FLOP-bound at GPT sizes);
//! - the tensor-core kernels' fraction of peak, by the kernels that do tensor-core FLOPs
//!   (flash attention's);
//! - the memory fraction, by the other kernels whose bytes, not the launch floor, set
//!   the forecast of every launch.
//!
//! A first-order fit: a part that is partly bound by something else (a product by its
//! bytes, a kernel by its launches) moves its fraction as if it were not. The device check
//! writes what it fits; the planner takes a GPU's measured row ([`crate::measured`]).

use std::collections::BTreeSet;

use crate::counting::Work;
use crate::forecast::{forecast, Efficiencies, GpuFigures};

/// A step's parts as measured, seconds: the dense products, and each kernel by name
/// (its launches summed).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MeasuredParts {
    /// The dense products (one matrix pair each).
    pub products_s: f64,
    /// Each kernel by name (`Call::name`), all its launches.
    pub kernels_s: Vec<(&'static str, f64)>,
}

/// What a fit found: the efficiencies, and each part's measured over forecast time at
/// the figures assumed (None where the step has no such part, or it was not measured:
/// its efficiency is kept).
#[derive(Debug, Clone, PartialEq)]
pub struct Fitted {
    /// The fitted fractions.
    pub efficiencies: Efficiencies,
    /// The dense products' measured / forecast.
    pub products: Option<f64>,
    /// The memory-bound kernels' measured / forecast.
    pub memory: Option<f64>,
    /// The tensor-core kernels' measured / forecast.
    pub tensor_kernels: Option<f64>,
}

/// Fits `figures`' efficiencies to `measured`, the parts of a device's run of `work` (the
/// same step's count, [`crate::counting::CountingBackend`]).
pub fn fit(work: &[Work], figures: &GpuFigures, measured: &MeasuredParts) -> Fitted {
    let f = forecast(work, figures);
    let tensor: BTreeSet<&str> = work
        .iter()
        .filter_map(|w| match w {
            Work::Launch { kernel, flops, .. } if *flops > 0.0 => Some(*kernel),
            _ => None,
        })
        .collect();
    let measured_of = |name: &str| -> Option<f64> {
        measured
            .kernels_s
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, s)| *s)
    };
    let bw = figures.mem_bw * figures.memory_efficiency;
    // (forecast, measured) summed over the kernels `pick` takes that were measured.
    let kernels = |pick: &dyn Fn(&crate::forecast::KernelShare) -> bool| {
        f.kernels
            .iter()
            .filter(|k| pick(k))
            .filter_map(|k| measured_of(k.kernel).map(|m| (k.seconds, m)))
            .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y))
    };
    // Streaming: every launch forecast by its bytes (none at the launch floor, which
    // would hold the time whatever the bandwidth).
    let streaming =
        kernels(&|k| !tensor.contains(k.kernel) && k.seconds <= k.bytes as f64 / bw * (1.0 + 1e-9));
    let tensor_core = kernels(&|k| tensor.contains(k.kernel));
    // measured / forecast where both are positive (a NaN or zero measures nothing).
    let ratio = |(forecast, measured): (f64, f64)| -> Option<f64> {
        let r = measured / forecast;
        (forecast > 0.0 && measured > 0.0 && r.is_finite()).then_some(r)
    };
    let (products, memory, tensor_kernels) = (
        ratio((f.products_s, measured.products_s)),
        ratio(streaming),
        ratio(tensor_core),
    );
    let e = figures.efficiencies();
    // A fraction of a peak is at most 1: a part faster than its roofline (the forecast
    // counting more than it runs) is held at the peak, and its ratio tells.
    let scaled = |e: f64, r: Option<f64>| r.map_or(e, |r| (e / r).min(1.0));
    Fitted {
        efficiencies: Efficiencies {
            product: scaled(e.product, products),
            memory: scaled(e.memory, memory),
            tensor_kernel: scaled(e.tensor_kernel, tensor_kernels),
        },
        products,
        memory,
        tensor_kernels,
    }
}
