//! The device check's FP8 products (#30's item 10): cuBLASLt's FP8 products on the GPU
//! against the host build's (the exact product of the decoded operands, summed in f32)
//! on the same bytes, within a tolerance (the tensor cores sum in their own order); then
//! GPT-2 124M's four linear layers' forward products timed in bf16 and in FP8 on the same
//! GPU, with the casts that FP8 adds timed apart. The casts and the scalers' end of step
//! are compared bit for bit in the scenario ([`crate::scenario::fp8_outputs`]).

use half::bf16;
use stoker_precision::{DelayedScalingConfig, TensorRole};

use super::check::median_micros;
use super::Device;
use crate::backend::Backend;
use crate::elem::{Act, E4m3, E5m2, Fp8};
use crate::error::GpuError;
use crate::fp8::Fp8Scalers;
use crate::gemm::{matmul, matmul_fp8, Dims, Mat};
use crate::Host;

/// The largest difference the device's FP8 product may show against the host's, over
/// the largest value: both sum exact products in f32 (the device's partial sums promoted
/// to f32, fast accumulation off) and round once to bf16 (at most 2^-8 of a value, 2^-7
/// of the largest between two roundings).
pub const FP8_PRODUCT_TOLERANCE: f64 = 1e-2;

/// One FP8 product on the GPU against the host build.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Compared {
    /// The product and its types.
    pub name: String,
    /// max |device - host| over max |host| (NaN if either holds a NaN).
    pub rel: f64,
}

/// Three products of a linear layer's step at `m x n x k = 48 x 64 x 96`: the forward
/// (E4M3 x E4M3 into bf16 with a bias), the input gradient's (E5M2 x E4M3 into bf16) and
/// the weight gradient's (E5M2 x E4M3 added into f32), each on the GPU and on the host.
pub fn compare_fp8_products(dev: &Device) -> Result<Vec<Fp8Compared>, GpuError> {
    let on_host = products(&Host)?;
    let on_device = products(dev)?;
    Ok(on_host
        .into_iter()
        .zip(on_device)
        .map(|((name, h), (_, d))| {
            let diff: Vec<f32> = h.iter().zip(&d).map(|(a, b)| a - b).collect();
            Fp8Compared {
                name,
                rel: super::check::max_abs(&diff) / super::check::max_abs(&h),
            }
        })
        .collect())
}

/// The three products on `b`, their outputs as f32.
fn products<B: Backend>(b: &B) -> Result<Vec<(String, Vec<f32>)>, GpuError> {
    let (m, n, k) = (48, 64, 96);
    let roles = [
        TensorRole::Forward,
        TensorRole::Forward,
        TensorRole::Backward,
    ];
    let scalers = Fp8Scalers::new(b, &DelayedScalingConfig::default(), &roles)?;
    let up =
        |len: usize, seed: u64, scale: f32| b.upload(&crate::sample::uniform(len, seed, scale));
    let (x, w, g) = (up(m * k, 1, 3.0)?, up(n * k, 2, 3.0)?, up(m * k, 3, 300.0)?);
    // One step sets the scales from the tensors' amax, as a training run's first does.
    let cast = |s: usize, src: &B::Buf<f32>, rows: usize, record: bool| -> Result<(), GpuError> {
        match s {
            2 => {
                let q = b.zeros::<E5m2>(rows * k)?;
                scalers.quantize(b, s, b.all(src), (rows, k), b.all(&q), None, record)
            }
            _ => {
                let q = b.zeros::<E4m3>(rows * k)?;
                scalers.quantize(b, s, b.all(src), (rows, k), b.all(&q), None, record)
            }
        }
    };
    cast(0, &x, m, true)?;
    cast(1, &w, n, true)?;
    cast(2, &g, m, true)?;
    scalers.end_step(b)?;
    let quantized = |s: usize, src: &B::Buf<f32>, rows: usize| -> Result<_, GpuError> {
        let q = b.zeros::<E4m3>(rows * k)?;
        scalers.quantize(b, s, b.all(src), (rows, k), b.all(&q), None, false)?;
        Ok(q)
    };
    let (xq, wq) = (quantized(0, &x, m)?, quantized(1, &w, n)?);
    let gq = b.zeros::<E5m2>(m * k)?;
    scalers.quantize(b, 2, b.all(&g), (m, k), b.all(&gq), None, false)?;
    // A bias as large as the products' spread, so a dropped or doubled one is far off.
    let bias: Vec<bf16> = crate::sample::uniform(n, 4, 20.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let bias = b.upload(&bias)?;
    let inv = |s| scalers.scale_inv(b, s);
    let widen = |v: Vec<bf16>| v.into_iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let y = b.zeros::<bf16>(m * n)?;
    matmul_fp8(
        b,
        Mat::rows(b.all(&y), n),
        Mat::rows(b.all(&xq), k),
        Mat::t(b.all(&wq), k),
        [inv(0)?, inv(1)?],
        Dims::one(m, n, k),
        Some(b.all(&bias)),
        false,
    )?;
    let forward = widen(b.download(&y)?);
    matmul_fp8(
        b,
        Mat::rows(b.all(&y), n),
        Mat::rows(b.all(&gq), k),
        Mat::t(b.all(&wq), k),
        [inv(2)?, inv(1)?],
        Dims::one(m, n, k),
        None,
        false,
    )?;
    let mixed = widen(b.download(&y)?);
    let dw = b.upload(&crate::sample::uniform(m * n, 5, 1.0))?;
    // The weight gradient's types: E5M2 (the output gradient) x E4M3, added into f32.
    matmul_fp8(
        b,
        Mat::rows(b.all(&dw), n),
        Mat::rows(b.all(&gq), k),
        Mat::t(b.all(&wq), k),
        [inv(2)?, inv(1)?],
        Dims::one(m, n, k),
        None,
        true,
    )?;
    Ok(vec![
        ("E4M3 x E4M3 -> bf16, bias".into(), forward),
        ("E5M2 x E4M3 -> bf16".into(), mixed),
        ("E5M2 x E4M3 += f32".into(), b.download(&dw)?),
    ])
}

/// One linear layer's forward product, timed in bf16 and in FP8.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Timed {
    /// The layer and its shape.
    pub name: String,
    /// Multiply-adds times two.
    pub flops: f64,
    /// The bf16 product's median microseconds (bias in the epilogue).
    pub bf16_micros: f64,
    /// The FP8 product's (bias in the epilogue, bf16 out).
    pub fp8_micros: f64,
    /// The two casts FP8 adds before it (input and weight, amax recorded).
    pub cast_micros: f64,
}

/// GPT-2 124M's four linear layers at `b` x 1,024 rows: each forward product in bf16 and
/// in FP8, and FP8's two casts, `reps` timed runs each.
pub fn time_fp8_products(dev: &Device, b: usize, reps: usize) -> Result<Vec<Fp8Timed>, GpuError> {
    let (rows, c) = (b * 1024, 768usize);
    let widest = 4 * c;
    let roles = [TensorRole::Forward, TensorRole::Forward];
    let scalers = Fp8Scalers::new(dev, &DelayedScalingConfig::default(), &roles)?;
    let fill = |len: usize, seed: u64| -> Result<_, GpuError> {
        let x: Vec<bf16> = crate::sample::uniform(len, seed, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        dev.upload(&x)
    };
    let (x, w, bias) = (
        fill(rows * widest, 1)?,
        fill(widest * c, 2)?,
        fill(widest, 3)?,
    );
    let y = dev.zeros::<bf16>(rows * widest)?;
    let (xq, wq) = (
        dev.zeros::<E4m3>(rows * widest)?,
        dev.zeros::<E4m3>(widest * c)?,
    );
    let mut out = Vec::new();
    for (name, inp, outw) in [
        ("qkv", c, 3 * c),
        ("attention out", c, c),
        ("fc", c, 4 * c),
        ("fc out", 4 * c, c),
    ] {
        let v = |buf, len| dev.all(buf).slice(0..len);
        let bf16_micros = median_micros(dev, reps, || {
            matmul(
                dev,
                Mat::rows(v(&y, rows * outw)?, outw),
                Mat::rows(v(&x, rows * inp)?, inp),
                Mat::t(v(&w, outw * inp)?, inp),
                Dims::one(rows, outw, inp),
                Some(v(&bias, outw)?),
                false,
            )
        })?;
        let casts = || -> Result<(), GpuError> {
            cast(dev, &scalers, 0, v(&x, rows * inp)?, (rows, inp), &xq)?;
            cast(dev, &scalers, 1, v(&w, outw * inp)?, (outw, inp), &wq)
        };
        let cast_micros = median_micros(dev, reps, casts)?;
        let fp8_micros = median_micros(dev, reps, || {
            matmul_fp8(
                dev,
                Mat::rows(v(&y, rows * outw)?, outw),
                Mat::rows(dev.all(&xq).slice(0..rows * inp)?, inp),
                Mat::t(dev.all(&wq).slice(0..outw * inp)?, inp),
                [scalers.scale_inv(dev, 0)?, scalers.scale_inv(dev, 1)?],
                Dims::one(rows, outw, inp),
                Some(v(&bias, outw)?),
                false,
            )
        })?;
        out.push(Fp8Timed {
            name: format!("{name} [{rows}, {inp}] x [{inp}, {outw}]"),
            flops: 2.0 * (rows * inp * outw) as f64,
            bf16_micros,
            fp8_micros,
            cast_micros,
        });
    }
    Ok(out)
}

/// Casts `x` (`shape`) with scaler `s` into the first elements of `q`, recording amax.
fn cast<T: Act, Q: Fp8>(
    dev: &Device,
    scalers: &Fp8Scalers<Device>,
    s: usize,
    x: crate::View<'_, T>,
    shape: (usize, usize),
    q: &super::DeviceBuf<Q>,
) -> Result<(), GpuError> {
    let q = dev.all(q).slice(0..shape.0 * shape.1)?;
    scalers.quantize(dev, s, x, shape, q, None, true)
}
