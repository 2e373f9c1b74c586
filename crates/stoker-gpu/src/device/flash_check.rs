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

/// The shapes compared: GPT-2's head width with a partial last tile, the demo's, the
/// narrowest, and grouped-query heads (4 query heads a kv head, as Llama 3.2 1B's).
const SHAPES: [(crate::flash::FlashShape, usize); 4] = [
    ((4, 77, 64), 1),
    ((3, 64, 32), 1),
    ((2, 40, 16), 1),
    ((8, 40, 64), 4),
];

/// Runs flash attention at each shape on `dev` and on the host and compares.
pub fn compare_flash(dev: &Device) -> Result<Vec<FlashCompared>, GpuError> {
    let mut out = Vec::new();
    for shape in SHAPES {
        let want = flash_outputs(&Host, shape)?;
        let got = flash_outputs(dev, shape)?;
        for ((name, w), (_, g)) in want.iter().zip(&got) {
            // A NaN on the host's side makes the scale NaN, and so the comparison fails,
            // even where the device has one in the same place.
            let scale = w.iter().map(|x| (*x as f64).abs()).fold(0f64, |m, x| {
                if m.is_nan() || x.is_nan() {
                    f64::NAN
                } else {
                    m.max(x)
                }
            });
            let rel = match scale.is_nan() {
                true => f64::NAN,
                false => super::check::max_abs_diff(w, g) / scale.max(f64::MIN_POSITIVE),
            };
            out.push(FlashCompared {
                name: name.clone(),
                rel,
            });
        }
    }
    Ok(out)
}

/// Flash attention's time at GPT-2 124M's attention (micro-batch `b`, 12 heads of 64,
/// 1,024 positions): the median of `reps` forwards and of `reps` backwards (rowdot, key
/// side, query side), with the tensor-core FLOPs each runs (`flash::product_flops`:
/// whole 16 x 16 blocks, the masked halves of the diagonal's included).
pub struct FlashTime {
    /// `forward` or `backward`.
    pub name: &'static str,
    /// Median microseconds.
    pub micros: f64,
    /// FLOPs on tensor cores.
    pub flops: f64,
}

/// Times flash attention's forward and backward at `(b * 12, 1024, 64)`.
pub fn time_flash(dev: &Device, b: usize, reps: usize) -> Result<Vec<FlashTime>, GpuError> {
    use crate::backend::Backend;
    use crate::flash::{product_flops, FORWARD_PRODUCTS, KEY_SIDE_PRODUCTS, QUERY_SIDE_PRODUCTS};
    use half::bf16;
    let shape = (b * 12, 1024, 64);
    let n = shape.0 * shape.1 * shape.2;
    let rows = shape.0 * shape.1;
    let draw = |seed| -> Result<_, GpuError> {
        let x: Vec<bf16> = crate::sample::uniform(n, seed, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        dev.upload(&x)
    };
    let (q, k, v, dout) = (draw(81)?, draw(82)?, draw(83)?, draw(84)?);
    let (out, dq, dk, dv) = (dev.zeros(n)?, dev.zeros(n)?, dev.zeros(n)?, dev.zeros(n)?);
    let (lse, dsum) = (dev.zeros::<f32>(rows)?, dev.zeros::<f32>(rows)?);
    let x = (dev.all(&q), dev.all(&k), dev.all(&v));
    let forward = || crate::flash::forward(dev, x, (dev.all(&out), dev.all(&lse)), (shape, 1));
    let backward = || {
        crate::flash::backward(
            dev,
            x,
            (dev.all(&out), dev.all(&dout), dev.all(&lse)),
            dev.all(&dsum),
            (dev.all(&dq), dev.all(&dk), dev.all(&dv)),
            (shape, 1),
        )
    };
    Ok(vec![
        FlashTime {
            name: "forward",
            micros: super::check::median_micros(dev, reps, forward)?,
            flops: FORWARD_PRODUCTS * product_flops(shape),
        },
        FlashTime {
            name: "backward",
            micros: super::check::median_micros(dev, reps, backward)?,
            flops: (KEY_SIDE_PRODUCTS + QUERY_SIDE_PRODUCTS) * product_flops(shape),
        },
    ])
}
