//! Flash attention on the device against the host build (the device check's `kernels`
//! part): the same seeded bf16 inputs through both ([`crate::scenario::flash_outputs`]),
//! each output's largest difference over its largest value. The host build multiplies
//! the fragments out in f32 in k order and the tensor cores in their own, so this is a
//! tolerance ([`tolerance`]), not bits. A fragment layout the device does not
//! share with cuda/mma.h would put whole rows or columns in the wrong place: far beyond
//! it.

use super::Device;
use crate::error::GpuError;
use crate::scenario::flash_outputs;
use crate::Host;

/// The largest difference allowed, over an output's largest value: bf16's rounding of
/// the probabilities and of the output (2^-8) with room for the order of the sums; the
/// gradients, which round the probabilities' gradient too, get twice as much
/// ([`tolerance`]).
pub const FLASH_TOLERANCE: f64 = 1e-2;

/// The tolerance of output `name`: [`FLASH_TOLERANCE`], twice it for dq, dk and dv.
pub fn tolerance(name: &str) -> f64 {
    match ["/dq ", "/dk ", "/dv "].iter().any(|g| name.contains(g)) {
        true => 2.0 * FLASH_TOLERANCE,
        false => FLASH_TOLERANCE,
    }
}

/// One output on both sides.
#[derive(Debug, Clone, PartialEq)]
pub struct FlashCompared {
    /// `flash/out bf16 (B*H x T x D)`.
    pub name: String,
    /// The largest |device - host| over the largest |host| (NaN where either holds one).
    pub rel: f64,
}

/// The shapes compared: GPT-2's head width with a partial last tile, the demo's, and
/// the narrowest.
const SHAPES: [crate::flash::FlashShape; 3] = [(4, 77, 64), (3, 64, 32), (2, 40, 16)];

/// Runs flash attention at each shape on `dev` and on the host and compares.
pub fn compare_flash(dev: &Device) -> Result<Vec<FlashCompared>, GpuError> {
    let mut out = Vec::new();
    for shape in SHAPES {
        let want = flash_outputs(&Host, shape)?;
        let got = flash_outputs(dev, shape)?;
        for ((name, w), (_, g)) in want.iter().zip(&got) {
            let scale = w.iter().fold(0f64, |m, x| m.max((*x as f64).abs()));
            let worst = w.iter().zip(g).fold(0f64, |m, (a, b)| {
                let d = (*a as f64 - *b as f64).abs();
                if m.is_nan() || d.is_nan() {
                    f64::NAN
                } else {
                    m.max(d)
                }
            });
            out.push(FlashCompared {
                name: name.clone(),
                rel: worst / scale.max(f64::MIN_POSITIVE),
            });
        }
    }
    Ok(out)
}
