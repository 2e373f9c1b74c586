//! The device check's products: each matrix product of GPT-2 124M's step, through
//! cuBLASLt (the bias in its epilogue) and through cuBLAS (the bias by the `add_bias`
//! kernel), on the same inputs: how far apart their outputs are, and each one's median
//! time. The two libraries sum in different orders, so this is a tolerance, not bits;
//! it is what backs making cuBLASLt the default. The attention products are timed whole
//! (`T x T`), for comparison with PyTorch's, and in the query chunks the step runs
//! (`step::attention`), 5/8 of that work at T = 1,024.

use half::bf16;

use super::{check::median_micros, Device, GemmLibrary};
use crate::backend::Backend;
use crate::error::GpuError;
use crate::gemm::{matmul, Dims, Mat};

/// One product through both libraries.
#[derive(Debug, Clone, PartialEq)]
pub struct GemmCompared {
    /// The product and its shape.
    pub name: String,
    /// Its multiply-adds times two.
    pub flops: f64,
    /// cuBLASLt's median microseconds.
    pub lt_micros: f64,
    /// cuBLAS's median microseconds.
    pub cublas_micros: f64,
    /// max |lt - cublas| over max |cublas| (NaN if either holds a NaN).
    pub rel_diff: f64,
    /// cuBLASLt had an algorithm for it (else both runs went through cuBLAS).
    pub lt_ran: bool,
}

/// The first `len` elements of `buf`.
fn view<'a>(
    dev: &'a Device,
    buf: &'a super::DeviceBuf<bf16>,
    len: usize,
) -> Result<crate::View<'a, bf16>, GpuError> {
    dev.all(buf).slice(0..len)
}

/// The largest absolute value, NaN if any element is NaN (never folded away).
fn max_abs(x: &[f32]) -> f64 {
    x.iter().fold(0f64, |m, v| {
        let a = (*v as f64).abs();
        if m.is_nan() || a.is_nan() {
            f64::NAN
        } else if a > m {
            a
        } else {
            m
        }
    })
}

/// Each product of GPT-2 124M's step (micro-batch `b` x 1,024, d_model 768, 12 heads,
/// the vocabulary padded to 50,304) through both libraries, `reps` timed runs each. The
/// device's library is cuBLASLt again afterwards.
pub fn compare_gemm_libraries(
    dev: &Device,
    b: usize,
    reps: usize,
) -> Result<Vec<GemmCompared>, GpuError> {
    let (t, c, h, v, vp) = (1024usize, 768usize, 12usize, 50_257usize, 50_304usize);
    let (n, d, bh) = (b * t, c / h, b * h);
    let fill = |len: usize, seed: u64| -> Result<_, GpuError> {
        let x: Vec<bf16> = crate::sample::uniform(len, seed, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        dev.upload(&x)
    };
    let x = fill(n * 4 * c, 1)?; // inputs: up to [n, 4C]
    let w = fill(vp.max(n) * c, 2)?; // weights (the tied head [Vp, C]), or dy [n, C]
    let bias = fill(4 * c, 3)?;
    let y = dev.zeros::<bf16>(n * vp)?; // outputs: up to the logits
    let att = fill(bh * t * t, 4)?; // [B*H, T, T]
    let dw = dev.zeros::<f32>(4 * c * c)?; // a weight's f32 gradient
    type Run<'a> = Box<dyn Fn() -> Result<(), GpuError> + 'a>;
    // The step's query chunks at T: each one's product over the keys up to its last query.
    use crate::step::attention::{chunks, scores_by_query_chunk, weighted_by_query_chunk};
    let chunked_flops: f64 = chunks(t)
        .map(|(r0, rows)| 2.0 * (bh * rows * (r0 + rows) * d) as f64)
        .sum();
    let query_chunks = chunks(t).count();
    // Each product: its name, FLOPs, how many of `y`'s elements it writes (0: it writes
    // the f32 `dw`), and the product.
    let (x, w, y, bias) = (&x, &w, &y, &bias);
    // A linear layer's forward: [n, out] = [n, inp] W^T + bias.
    let linear = |name: &str, inp: usize, out: usize| -> (String, f64, usize, Run<'_>) {
        let run: Run = Box::new(move || {
            matmul(
                dev,
                Mat::rows(view(dev, y, n * out)?, out),
                Mat::rows(view(dev, x, n * inp)?, inp),
                Mat::t(view(dev, w, out * inp)?, inp),
                Dims::one(n, out, inp),
                Some(view(dev, bias, out)?),
                false,
            )
        });
        (name.into(), 2.0 * (n * inp * out) as f64, n * out, run)
    };
    let products: Vec<(String, f64, usize, Run)> = vec![
        linear("qkv, bias", c, 3 * c),
        linear("attention out, bias", c, c),
        linear("fc, bias", c, 4 * c),
        linear("fc out, bias", 4 * c, c),
        (
            "head (tied, rows of 50,304)".into(),
            2.0 * (n * v * c) as f64,
            n * vp,
            Box::new(|| {
                matmul(
                    dev,
                    Mat::rows(view(dev, y, n * vp)?, vp),
                    Mat::rows(view(dev, x, n * c)?, c),
                    Mat::t(view(dev, w, v * c)?, c),
                    Dims::one(n, v, c),
                    None,
                    false,
                )
            }),
        ),
        // fc out's backward: dx [n, 4C] = dy [n, C] W [C, 4C] (`x` holds dy, `w` W).
        (
            "fc out backward dx = dy W".into(),
            2.0 * (n * 4 * c * c) as f64,
            n * 4 * c,
            Box::new(|| {
                matmul(
                    dev,
                    Mat::rows(view(dev, y, n * 4 * c)?, 4 * c),
                    Mat::rows(view(dev, x, n * c)?, c),
                    Mat::rows(view(dev, w, c * 4 * c)?, 4 * c),
                    Dims::one(n, 4 * c, c),
                    None,
                    false,
                )
            }),
        ),
        // fc's weight gradient: dW [4C, C] += dy^T [4C, n] x [n, C] (`x` holds dy, `w` x).
        (
            "fc backward dW += dy^T x (f32)".into(),
            2.0 * (n * 4 * c * c) as f64,
            0,
            Box::new(|| {
                matmul(
                    dev,
                    Mat::rows(dev.all(&dw), c),
                    Mat::t(view(dev, x, n * 4 * c)?, 4 * c),
                    Mat::rows(view(dev, w, n * c)?, c),
                    Dims::one(4 * c, c, n),
                    None,
                    true,
                )
            }),
        ),
        (
            "attention q k^T, whole T x T (batched)".into(),
            2.0 * (bh * t * t * d) as f64,
            bh * t * t,
            Box::new(|| {
                let dims = Dims {
                    m: t,
                    n: t,
                    k: d,
                    batch: bh,
                    strides: [t * d, t * d, t * t],
                };
                matmul(
                    dev,
                    Mat::rows(view(dev, y, bh * t * t)?, t),
                    Mat::rows(view(dev, x, bh * t * d)?, d),
                    Mat::t(view(dev, w, bh * t * d)?, d),
                    dims,
                    None,
                    false,
                )
            }),
        ),
        (
            "attention att v, whole T x T (batched)".into(),
            2.0 * (bh * t * t * d) as f64,
            bh * t * d,
            Box::new(|| {
                let dims = Dims {
                    m: t,
                    n: d,
                    k: t,
                    batch: bh,
                    strides: [t * t, t * d, t * d],
                };
                matmul(
                    dev,
                    Mat::rows(view(dev, y, bh * t * d)?, d),
                    Mat::rows(dev.all(&att), t),
                    Mat::rows(view(dev, x, bh * t * d)?, d),
                    dims,
                    None,
                    false,
                )
            }),
        ),
        // What the step runs instead: the same two products by query chunk, each over
        // the keys up to the chunk's last query.
        (
            format!("attention q k^T, {query_chunks} query chunks"),
            chunked_flops,
            bh * t * t,
            Box::new(|| {
                let (y, q, k) = (
                    view(dev, y, bh * t * t)?,
                    view(dev, x, bh * t * d)?,
                    view(dev, w, bh * t * d)?,
                );
                scores_by_query_chunk(dev, y, q, k, (bh, t, d))
            }),
        ),
        (
            format!("attention att v, {query_chunks} query chunks"),
            chunked_flops,
            bh * t * d,
            Box::new(|| {
                let (y, v) = (view(dev, y, bh * t * d)?, view(dev, x, bh * t * d)?);
                weighted_by_query_chunk(dev, y, dev.all(&att), v, (bh, t, d))
            }),
        ),
    ];
    let outcome = (|| {
        let mut out = Vec::new();
        for (name, flops, written, run) in &products {
            // The output of one run from zeroed outputs, per library.
            let (mut outputs, mut micros, mut lt_ran) = (Vec::new(), Vec::new(), false);
            for library in [GemmLibrary::CublasLt, GemmLibrary::Cublas] {
                dev.set_gemm_library(library);
                dev.zero(dev.all(y))?;
                dev.zero(dev.all(&dw))?;
                // Each product's shapes are new to cuBLASLt here: it served them all
                // where none joined the ones it does not serve.
                let (_, without, _) = dev.gemm_plans();
                run()?;
                if library == GemmLibrary::CublasLt {
                    lt_ran = dev.gemm_plans().1 == without;
                }
                let got: Vec<f32> = match written {
                    0 => dev.read(dev.all(&dw))?,
                    &len => dev
                        .read(view(dev, y, len)?)?
                        .iter()
                        .map(|v| v.to_f32())
                        .collect(),
                };
                outputs.push(got);
                micros.push(median_micros(dev, reps, run)?);
            }
            let diff: Vec<f32> = outputs[0]
                .iter()
                .zip(&outputs[1])
                .map(|(a, b)| a - b)
                .collect();
            out.push(GemmCompared {
                name: name.clone(),
                flops: *flops,
                lt_micros: micros[0],
                cublas_micros: micros[1],
                rel_diff: max_abs(&diff) / max_abs(&outputs[1]),
                lt_ran,
            });
        }
        Ok(out)
    })();
    dev.set_gemm_library(GemmLibrary::CublasLt);
    outcome
}
