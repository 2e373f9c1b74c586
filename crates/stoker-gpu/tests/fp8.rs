//! FP8 on the backend against the CPU's reference, stoker-precision: the cast (bits), the
//! delayed scalers' scales and histories over many steps of several casts each (bits),
//! and the FP8 product against the exact product of its decoded operands. The device
//! check holds the GPU to the same host build.

mod common;

use common::*;
use half::bf16;
use stoker_gpu::fp8::Fp8Scalers;
use stoker_gpu::gemm::{matmul_fp8, Dims, Mat};
use stoker_gpu::{Act, E4m3, E5m2, Fp8, GpuError, Host, View};
use stoker_precision::fp8::fp8_to_f32;
use stoker_precision::{
    AmaxComputeAlgo, DelayedScaler, DelayedScalingConfig, Fp8Format, RecipeFormat, TensorRole,
};

/// A small deterministic generator (splitmix64), for bit patterns.
struct Bits(u64);

impl Bits {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Values that probe every branch of the cast: zeros, f32 subnormals, FP8's subnormal
/// range and its ties, both formats' largest values and the ties above them, infinities,
/// NaN, and random bit patterns over the whole f32 range and near 1.
fn probes(n: usize, seed: u64) -> Vec<f32> {
    let mut out = vec![
        0.0,
        -0.0,
        f32::from_bits(1),
        f32::MIN_POSITIVE,
        2f32.powi(-10),
        3.0 * 2f32.powi(-10),
        2f32.powi(-17),
        3.0 * 2f32.powi(-17),
        448.0,
        464.0,
        464.1,
        -480.0,
        57344.0,
        61440.0,
        -61439.996,
        1e9,
        f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
    ];
    let mut r = Bits(seed);
    while out.len() < n {
        let b = r.next();
        let x = match b % 3 {
            0 => f32::from_bits(b as u32),
            1 => f32::from_bits((b >> 32) as u32),
            // Near 1: exponents 2^-20 .. 2^20, where scaled tensors live.
            _ => {
                let e = ((b >> 8) % 41) as i32 - 20;
                let m = f32::from_bits(0x3F80_0000 | ((b >> 40) as u32 & 0x7F_FFFF));
                if b & 1 == 0 {
                    m * 2f32.powi(e)
                } else {
                    -m * 2f32.powi(e)
                }
            }
        };
        out.push(x);
    }
    out.truncate(n);
    out
}

fn config(len: usize, algo: AmaxComputeAlgo, margin: f32) -> DelayedScalingConfig {
    DelayedScalingConfig {
        margin,
        format: RecipeFormat::Hybrid,
        amax_history_len: len,
        amax_compute_algo: algo,
    }
}

/// The CPU's cast of `x` with `scaler`'s scale, and its amax recorded.
fn cpu_cast(scaler: &mut DelayedScaler, x: &[f32], record: bool) -> Vec<u8> {
    if record {
        scaler.quantize(x).unwrap().data
    } else {
        stoker_precision::Fp8Tensor::quantize(x, scaler.scale(), scaler.format())
            .unwrap()
            .data
    }
}

/// The backend's cast of `x` (f32 or bf16 widened) by scaler `s`, and its transpose.
fn gpu_cast(
    scalers: &Fp8Scalers<Host>,
    s: usize,
    x: &[f32],
    bf16_input: bool,
    (rows, cols): (usize, usize),
    record: bool,
) -> (Vec<u8>, Vec<u8>) {
    let n = rows * cols;
    let bytes = |v: Vec<E4m3>| v.into_iter().map(|q| q.0).collect::<Vec<u8>>();
    let bytes5 = |v: Vec<E5m2>| v.into_iter().map(|q| q.0).collect::<Vec<u8>>();
    macro_rules! run {
        ($q:ty, $to:expr) => {{
            let (out, out_t) = (zeros::<$q>(n), zeros::<$q>(n));
            if bf16_input {
                let xb = up(&to_bf16(x));
                scalers
                    .quantize(
                        &Host,
                        s,
                        all(&xb),
                        (rows, cols),
                        all(&out),
                        Some(all(&out_t)),
                        record,
                    )
                    .unwrap();
            } else {
                let xb = up(x);
                scalers
                    .quantize(
                        &Host,
                        s,
                        all(&xb),
                        (rows, cols),
                        all(&out),
                        Some(all(&out_t)),
                        record,
                    )
                    .unwrap();
            }
            ($to(down(&out)), $to(down(&out_t)))
        }};
    }
    match scalers.format(s).unwrap() {
        stoker_gpu::Fp8Dtype::E4m3 => run!(E4m3, bytes),
        stoker_gpu::Fp8Dtype::E5m2 => run!(E5m2, bytes5),
    }
}

fn transpose(q: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut t = vec![0u8; q.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = q[r * cols + c];
        }
    }
    t
}

fn assert_bytes(got: &[u8], want: &[u8], x: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: element {i} (x = {:e}, bits {:#010x}) cast to {:#04x}, the CPU's is {:#04x}",
            x.get(i).copied().unwrap_or(f32::NAN),
            x.get(i).map_or(0, |v| v.to_bits()),
            got[i],
            want[i]
        );
    }
}

/// Both formats, f32 and bf16 inputs, odd shapes (packs that end mid-row, a last pack
/// cut short), and scales that the scalers' own steps produce (448 / amax and 57,344 /
/// amax of earlier tensors, 1, and the largest float): every byte is the CPU's.
#[test]
fn a_cast_is_stoker_precision_s_bit_for_bit() {
    let shapes = [(1, 1), (3, 7), (37, 45), (64, 129), (200, 333)];
    let cfg = config(4, AmaxComputeAlgo::MostRecent, 0.0);
    let roles = [TensorRole::Forward, TensorRole::Backward];
    let mut checked = 0;
    for bf16_input in [false, true] {
        let scalers = Fp8Scalers::new(&Host, &cfg, &roles).unwrap();
        let mut cpu: Vec<DelayedScaler> = roles
            .iter()
            .map(|r| DelayedScaler::new(&cfg, *r).unwrap())
            .collect();
        // Steps whose amaxes set the next scales: 1 first, then 448 / 3.7e-3, 448 / 911,
        // and 448 / 1e-38 (infinite: the largest float).
        let mut saw_max = false;
        for (step, amax) in [3.7e-3f32, 911.0, 1e-38, 2.5].into_iter().enumerate() {
            saw_max |= cpu[0].scale() == f32::MAX;
            for (k, &(rows, cols)) in shapes.iter().enumerate() {
                let mut x = probes(rows * cols, (step * 10 + k) as u64 + 1);
                if bf16_input {
                    x = from_bf16(&to_bf16(&x));
                }
                for (s, scaler) in cpu.iter_mut().enumerate() {
                    let want = cpu_cast(scaler, &x, false);
                    let (got, got_t) = gpu_cast(&scalers, s, &x, bf16_input, (rows, cols), false);
                    let what = format!(
                        "{:?} scale {:e} bf16 input {bf16_input}, {rows}x{cols}",
                        scaler.format(),
                        scaler.scale()
                    );
                    assert_bytes(&got, &want, &x, &what);
                    assert_eq!(got_t, transpose(&want, rows, cols), "{what}: the transpose");
                    checked += x.len();
                }
            }
            // Record one tensor of amax `amax` per scaler, then end the step on both.
            let x = [amax, -amax / 2.0];
            for (s, scaler) in cpu.iter_mut().enumerate() {
                cpu_cast(scaler, &x, true);
                gpu_cast(&scalers, s, &x, false, (1, 2), true);
                scaler.update();
            }
            scalers.end_step(&Host).unwrap();
            let read = scalers.read(&Host).unwrap();
            for (s, scaler) in cpu.iter().enumerate() {
                assert_eq!(
                    read[s].scale.to_bits(),
                    scaler.scale().to_bits(),
                    "step {step} scaler {s}"
                );
            }
        }
        assert!(saw_max, "no step cast with the largest float as its scale");
    }
    assert!(checked > 1_000_000, "only {checked} casts checked");
}

/// Many steps of several casts each (micro-batches), amaxes from tiny to infinite, zero
/// tensors (the scale stays), NaN elements (ignored by the amax), both amax rules,
/// history windows of 1, 3 and 16 (the ring wraps), a margin, casts recorded or not:
/// every scale, `scale_inv` and history entry is the CPU's `DelayedScaler`'s, bit for bit.
#[test]
fn scalers_follow_delayed_scaler_bit_for_bit() {
    let roles = [
        TensorRole::Forward,
        TensorRole::Forward,
        TensorRole::Backward,
        TensorRole::Backward,
        TensorRole::Forward,
    ];
    let mut r = Bits(7);
    for (len, algo, margin) in [
        (1, AmaxComputeAlgo::Max, 0.0),
        (3, AmaxComputeAlgo::Max, 0.0),
        (16, AmaxComputeAlgo::Max, 1.5),
        (3, AmaxComputeAlgo::MostRecent, 0.0),
        (16, AmaxComputeAlgo::MostRecent, 2.0),
    ] {
        let cfg = config(len, algo, margin);
        let scalers = Fp8Scalers::new(&Host, &cfg, &roles).unwrap();
        let mut cpu: Vec<DelayedScaler> = roles
            .iter()
            .map(|role| DelayedScaler::new(&cfg, *role).unwrap())
            .collect();
        for step in 0..40 {
            for (s, scaler) in cpu.iter_mut().enumerate() {
                let casts = (r.next() % 4) as usize; // 0 to 3 micro-batches
                for _ in 0..casts {
                    let (rows, cols) =
                        (1 + (r.next() % 40) as usize, 1 + (r.next() % 300) as usize);
                    let e = (r.next() % 60) as i32 - 40;
                    let mut x: Vec<f32> = uniform(rows * cols, r.next(), 1.0)
                        .into_iter()
                        .map(|v| v * 2f32.powi(e))
                        .collect();
                    match r.next() % 10 {
                        0 => x.iter_mut().for_each(|v| *v = 0.0),
                        // NaN first and last in the cast's order, or nearly everywhere.
                        1 => {
                            let last = x.len() - 1;
                            x[0] = f32::NAN;
                            x[last] = f32::NAN;
                        }
                        3 => x.iter_mut().skip(1).for_each(|v| *v = f32::NAN),
                        2 => x[rows * cols / 2] = f32::INFINITY,
                        _ => {}
                    }
                    let record = !r.next().is_multiple_of(5);
                    let want = cpu_cast(scaler, &x, record);
                    let (got, _) = gpu_cast(&scalers, s, &x, false, (rows, cols), record);
                    assert_bytes(
                        &got,
                        &want,
                        &x,
                        &format!("len {len} {algo:?}, step {step}, scaler {s}"),
                    );
                }
                scaler.update();
            }
            scalers.end_step(&Host).unwrap();
            for (s, (got, want)) in scalers.read(&Host).unwrap().iter().zip(&cpu).enumerate() {
                let what = format!("len {len} {algo:?} margin {margin}, step {step}, scaler {s}");
                assert_eq!(
                    got.scale.to_bits(),
                    want.scale().to_bits(),
                    "{what}: scale {} against {}",
                    got.scale,
                    want.scale()
                );
                assert_eq!(
                    got.scale_inv.to_bits(),
                    want.scale_inv().to_bits(),
                    "{what}: scale_inv"
                );
                let bits = |h: &[f32]| h.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
                assert_eq!(bits(&got.history), bits(&want.history()), "{what}: history");
            }
        }
    }
}

/// Scalers on 2 and 3 ranks (the in-process backend through host memory), each rank
/// casting its own tensors: after [`Fp8Scalers::end_step_over`] every rank holds, bit for
/// bit, the scales and histories of one `DelayedScaler` that recorded every rank's casts
/// (a step where one rank casts nothing included), over 12 steps.
#[test]
fn scalers_over_several_ranks_take_the_largest_amax_of_all_bit_for_bit() {
    use stoker_comm::Communicator;
    use stoker_gpu::parallel::ThroughHost;
    let roles = [
        TensorRole::Forward,
        TensorRole::Backward,
        TensorRole::Forward,
    ];
    let cfg = config(4, AmaxComputeAlgo::Max, 0.0);
    // Rank `rank`'s cast by scaler `s` at `step` (None: it casts nothing).
    let tensor = |step: usize, s: usize, rank: usize| -> Option<(Vec<f32>, usize, usize)> {
        let mut r = Bits((step * 100 + s * 10 + rank) as u64);
        if r.next().is_multiple_of(6) {
            return None;
        }
        let (rows, cols) = (1 + (r.next() % 20) as usize, 1 + (r.next() % 90) as usize);
        let e = (r.next() % 30) as i32 - 15;
        let x = uniform(rows * cols, r.next(), 1.0)
            .into_iter()
            .map(|v| v * 2f32.powi(e))
            .collect();
        Some((x, rows, cols))
    };
    for world in [2, 3] {
        let mut cpu: Vec<DelayedScaler> = roles
            .iter()
            .map(|role| DelayedScaler::new(&cfg, *role).unwrap())
            .collect();
        let mut want = Vec::new();
        for step in 0..12 {
            for (s, scaler) in cpu.iter_mut().enumerate() {
                for rank in 0..world {
                    if let Some((x, _, _)) = tensor(step, s, rank) {
                        scaler.quantize(&x).unwrap();
                    }
                }
                scaler.update();
            }
            want.push(
                cpu.iter()
                    .flat_map(|c| std::iter::once(c.scale()).chain(c.history()))
                    .map(f32::to_bits)
                    .collect::<Vec<u32>>(),
            );
        }
        let got = stoker_comm::run_local(world, std::time::Duration::from_secs(30), |comm| {
            let rank = comm.rank();
            let coll = ThroughHost(&comm);
            let scalers = Fp8Scalers::new(&Host, &cfg, &roles).unwrap();
            (0..12)
                .map(|step| {
                    for s in 0..roles.len() {
                        if let Some((x, rows, cols)) = tensor(step, s, rank) {
                            gpu_cast(&scalers, s, &x, false, (rows, cols), true);
                        }
                    }
                    scalers.end_step_over(&Host, &coll).unwrap();
                    scalers
                        .read(&Host)
                        .unwrap()
                        .iter()
                        .flat_map(|v| std::iter::once(v.scale).chain(v.history.clone()))
                        .map(f32::to_bits)
                        .collect::<Vec<u32>>()
                })
                .collect::<Vec<_>>()
        });
        for (rank, steps) in got.iter().enumerate() {
            for (step, (g, w)) in steps.iter().zip(&want).enumerate() {
                assert_eq!(
                    g, w,
                    "world {world} rank {rank} step {step}: scales, histories"
                );
            }
        }
        // Each rank alone would scale otherwise: the check above tells the two apart.
        let amax = |step: usize, s: usize, r: usize| {
            tensor(step, s, r).map_or(0.0, |(x, _, _)| stoker_precision::convert::amax(&x))
        };
        let exercised = (0..12)
            .flat_map(|step| (0..roles.len()).map(move |s| (step, s)))
            .filter(|&(step, s)| (1..world).any(|r| amax(step, s, r) > amax(step, s, 0)))
            .count();
        assert!(
            exercised > 0,
            "world {world}: rank 0's amax is always the largest"
        );
    }
}

/// Decoded FP8 bytes.
fn decode(q: &[u8], f: Fp8Format) -> Vec<f64> {
    q.iter().map(|&b| fp8_to_f32(b, f) as f64).collect()
}

/// `y = (a w^T) sa sb + bias` (a linear layer's forward: E4M3 x E4M3 into bf16, and a
/// gradient's E5M2 x E4M3), and `dW += dy^T x` into f32: within f32's accumulation of
/// the exact product of the decoded operands and one rounding to the output's type.
#[test]
fn an_fp8_product_is_the_decoded_operands_product() {
    let (m, n, k) = (24, 48, 48);
    let sa_sb = [0.125f32, 3.0];
    let scales = up(&sa_sb);
    let cfg = config(1, AmaxComputeAlgo::Max, 0.0);
    // Operands cast by the scalers from random values (scale 1: values within range).
    let scalers = Fp8Scalers::new(
        &Host,
        &cfg,
        &[
            TensorRole::Forward,
            TensorRole::Forward,
            TensorRole::Backward,
        ],
    )
    .unwrap();
    let xa = up(&uniform(m * k, 1, 40.0));
    let xw = up(&uniform(n * k, 2, 40.0));
    let xg = up(&uniform(m * k, 3, 4000.0));
    let (qa, qw, qg) = (
        zeros::<E4m3>(m * k),
        zeros::<E4m3>(n * k),
        zeros::<E5m2>(m * k),
    );
    scalers
        .quantize(&Host, 0, all(&xa), (m, k), all(&qa), None, false)
        .unwrap();
    scalers
        .quantize(&Host, 1, all(&xw), (n, k), all(&qw), None, false)
        .unwrap();
    scalers
        .quantize(&Host, 2, all(&xg), (m, k), all(&qg), None, false)
        .unwrap();
    let a4 = decode(
        &down(&qa).iter().map(|q| q.0).collect::<Vec<_>>(),
        Fp8Format::E4M3,
    );
    let a5 = decode(
        &down(&qg).iter().map(|q| q.0).collect::<Vec<_>>(),
        Fp8Format::E5M2,
    );
    let w4 = decode(
        &down(&qw).iter().map(|q| q.0).collect::<Vec<_>>(),
        Fp8Format::E4M3,
    );
    let bias = to_bf16(&uniform(n, 4, 50.0));
    let biasb = up(&bias);
    let factor = (sa_sb[0] * sa_sb[1]) as f64;
    let (s0, s1) = (
        stoker_gpu::Backend::view(&Host, &scales, 0..1).unwrap(),
        stoker_gpu::Backend::view(&Host, &scales, 1..2).unwrap(),
    );
    let exact = |a: &[f64], i: usize, j: usize| -> f64 {
        (0..k).map(|l| a[i * k + l] * w4[j * k + l]).sum::<f64>() * factor
    };
    // bf16 out with the bias, E4M3 x E4M3 and E5M2 x E4M3.
    for e5 in [false, true] {
        let yb = zeros::<bf16>(m * n);
        let (a, what) = if e5 {
            matmul_fp8(
                &Host,
                Mat::rows(all(&yb), n),
                Mat::rows(all(&qg), k),
                Mat::t(all(&qw), k),
                [s0, s1],
                Dims::one(m, n, k),
                Some(all(&biasb)),
                false,
            )
            .unwrap();
            (&a5, "E5M2 x E4M3")
        } else {
            matmul_fp8(
                &Host,
                Mat::rows(all(&yb), n),
                Mat::rows(all(&qa), k),
                Mat::t(all(&qw), k),
                [s0, s1],
                Dims::one(m, n, k),
                Some(all(&biasb)),
                false,
            )
            .unwrap();
            (&a4, "E4M3 x E4M3")
        };
        let y = down(&yb);
        for i in 0..m {
            for j in 0..n {
                let want = exact(a, i, j) + bias[j].to_f64();
                let got = y[i * n + j].to_f64();
                let tol = want.abs().max(1.0) * (2f64.powi(-8) + 1e-5);
                assert!(
                    (got - want).abs() <= tol,
                    "{what} y[{i}][{j}] = {got}, want {want} within {tol}"
                );
            }
        }
    }
    // f32 out, accumulated twice: dW += the product.
    let start = uniform(m * n, 5, 1.0);
    let cb = up(&start);
    for _ in 0..2 {
        matmul_fp8(
            &Host,
            Mat::rows(all(&cb), n),
            Mat::rows(all(&qa), k),
            Mat::t(all(&qw), k),
            [s0, s1],
            Dims::one(m, n, k),
            None,
            true,
        )
        .unwrap();
    }
    let c = down(&cb);
    for i in 0..m {
        for j in 0..n {
            let want = start[i * n + j] as f64 + 2.0 * exact(&a4, i, j);
            let got = c[i * n + j] as f64;
            let tol = want.abs().max(1.0) * 1e-5;
            assert!(
                (got - want).abs() <= tol,
                "f32 += y[{i}][{j}] = {got}, want {want} within {tol}"
            );
        }
    }
}

/// An FP8 product with no bias, not accumulating: what the refusals below vary.
fn plain<TA: Fp8, TB: Fp8, O: Act>(
    c: Mat<O>,
    a: Mat<TA>,
    b: Mat<TB>,
    scale_inv: [View<f32>; 2],
    d: Dims,
) -> Result<(), GpuError> {
    matmul_fp8(&Host, c, a, b, scale_inv, d, None, false)
}

/// What Hopper's FP8 products cannot run is refused on every backend, naming why: A
/// stored transposed, B not, a shared dimension or leading dimension not a multiple of
/// 16, E5M2 on both sides, an f16 output, a batch.
#[test]
fn fp8_products_refuse_what_hopper_cannot_run() {
    let (m, n, k) = (16, 16, 32);
    let scales = up(&[1.0f32, 1.0]);
    let s = |i: usize| stoker_gpu::Backend::view(&Host, &scales, i..i + 1).unwrap();
    let (a4, b4, a5, b5) = (
        zeros::<E4m3>(m * k),
        zeros::<E4m3>(n * k),
        zeros::<E5m2>(m * k),
        zeros::<E5m2>(n * k),
    );
    let (y, y16) = (zeros::<bf16>(m * n), zeros::<half::f16>(m * n));
    let refused = |r: Result<(), GpuError>, says: &str| match r {
        Err(GpuError::Shape {
            kernel: "matmul-fp8",
            what,
        }) => {
            assert!(
                what.contains(says),
                "the refusal {what:?} should say {says:?}"
            )
        }
        other => panic!("expected a refusal saying {says:?}, got {other:?}"),
    };
    let one = Dims::one(m, n, k);
    refused(
        plain(
            Mat::rows(all(&y), n),
            Mat::t(all(&a4), m),
            Mat::t(all(&b4), k),
            [s(0), s(1)],
            one,
        ),
        "A as stored and B transposed",
    );
    refused(
        plain(
            Mat::rows(all(&y), n),
            Mat::rows(all(&a4), k),
            Mat::rows(all(&b4), n),
            [s(0), s(1)],
            one,
        ),
        "A as stored and B transposed",
    );
    refused(
        plain(
            Mat::rows(all(&y), n),
            Mat::rows(all(&a4), k),
            Mat::t(all(&b4), k),
            [s(0), s(1)],
            Dims::one(m, n, 24),
        ),
        "multiples of 16",
    );
    refused(
        plain(
            Mat::rows(all(&y), n),
            Mat::rows(all(&a5), k),
            Mat::t(all(&b5), k),
            [s(0), s(1)],
            one,
        ),
        "E5M2 x E5M2",
    );
    refused(
        plain(
            Mat::rows(all(&y16), n),
            Mat::rows(all(&a4), k),
            Mat::t(all(&b4), k),
            [s(0), s(1)],
            one,
        ),
        "bf16 or f32",
    );
    let batched = Dims {
        batch: 2,
        strides: [0, 0, 0],
        ..Dims::one(m / 2, n, k)
    };
    refused(
        plain(
            Mat::rows(all(&y), n),
            Mat::rows(all(&a4), k),
            Mat::t(all(&b4), k),
            [s(0), s(1)],
            batched,
        ),
        "one product",
    );
}
