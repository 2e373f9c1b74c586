//! The device check: every kernel on the GPU against the host build, bit for bit, then
//! each kernel's time at GPT-2 124M's shapes. What `stoker bench gpu-kernels` prints on
//! a lent GPU (scripts/gpu/device-check.sh, part `kernels`).

use half::bf16;
use stoker_kernels::AdamWStep;

use super::Device;
use crate::backend::Backend;
use crate::error::GpuError;
use crate::ids::Ids;
use crate::kernels::{self, Stats};
use crate::scenario::{all_outputs, ScenarioSize};
use crate::step::token_step::ResidentStep;
use crate::step::{GptGpuStep, LlamaGpuStep, TokenBatch};
use crate::{Heads, Host};

/// One output compared: how many elements differ in their bits, and by how much.
#[derive(Debug, Clone, PartialEq)]
pub struct Compared {
    /// `kernel/buffer dtype`.
    pub name: String,
    /// Elements.
    pub elements: usize,
    /// Elements whose bits differ.
    pub differing: usize,
    /// The largest absolute difference (NaN if either side holds one the other does not).
    pub max_abs_diff: f64,
}

/// Runs the scenario at `s` on the GPU and on the host and compares every output.
pub fn compare_with_host(dev: &Device, s: ScenarioSize) -> Result<Vec<Compared>, GpuError> {
    let want = all_outputs(&Host, s)?;
    let got = all_outputs(dev, s)?;
    Ok(want
        .iter()
        .zip(&got)
        .map(|((name, w), (_, g))| {
            // Two NaNs count as equal: x86 and the GPU give NaNs different bits.
            let differing = w
                .iter()
                .zip(g)
                .filter(|(a, b)| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()))
                .count();
            Compared {
                name: name.clone(),
                elements: w.len().max(g.len()),
                differing: differing + w.len().abs_diff(g.len()),
                max_abs_diff: max_abs_diff(w, g),
            }
        })
        .collect())
}

/// The largest |w - g| over two outputs: NaN where one side holds a NaN the other does
/// not (a NaN never passes as small); equal bits, an inf or a NaN on both sides
/// included, differ by nothing.
pub(super) fn max_abs_diff(w: &[f32], g: &[f32]) -> f64 {
    w.iter().zip(g).fold(0f64, |m, (a, b)| {
        let d = (*a as f64 - *b as f64).abs();
        if a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()) {
            m
        } else if m.is_nan() || d.is_nan() {
            f64::NAN
        } else if d > m {
            d
        } else {
            m
        }
    })
}

/// One kernel's time: the median of `reps` launches, and the bytes it must move at
/// least (its effective bandwidth's numerator).
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    /// The kernel and its shape.
    pub name: String,
    /// Median microseconds per launch.
    pub micros: f64,
    /// Bytes read and written, counting each buffer once.
    pub bytes: f64,
}

/// The shapes of GPT-2 124M's step: micro-batch `b` of 1,024 positions, d_model 768, 12
/// heads, the vocabulary padded to 50,304.
pub const GPT2: ScenarioSize = ScenarioSize {
    b: 16,
    t: 1024,
    h: 12,
    d: 64,
    v: 50_257,
};

/// Times each bf16 kernel at `s` (`reps` launches each, after one warm-up).
pub fn time_kernels(
    dev: &Device,
    s: ScenarioSize,
    reps: usize,
) -> Result<Vec<KernelTime>, GpuError> {
    let (c, n) = (s.h * s.d, s.b * s.t);
    let vp = s.v.div_ceil(64) * 64;
    let e = 2.0; // bf16 bytes
    let z = |len: usize| dev.zeros::<bf16>(len);
    let (x, a2, out, resid) = (z(n * c)?, z(n * c)?, z(n * c)?, z(n * c)?);
    let (w, bias) = (dev.upload(&vec![bf16::ONE; c])?, z(c)?);
    let (mean, rstd) = (dev.upload(&vec![0f32; n])?, dev.upload(&vec![1f32; n])?);
    let stats = Stats {
        mean: dev.all(&mean),
        rstd: dev.all(&rstd),
    };
    let (fc, fc_out) = (z(n * 4 * c)?, z(n * 4 * c)?);
    let (qkv, heads) = (z(n * 3 * c)?, z(n * 3 * c)?);
    let bhtt = s.b * s.h * s.t * s.t;
    let (pre, att) = (z(bhtt)?, z(bhtt)?);
    let logits = z(n * vp)?;
    let losses = dev.zeros::<f32>(n)?;
    let tokens = Ids::new(dev, "tokens", &crate::sample::ids(n, 1, s.v), s.v, None)?;
    let targets = Ids::new(
        dev,
        "targets",
        &crate::sample::ids(n, 2, s.v),
        s.v,
        Some(-1),
    )?;
    let wte = z(vp * c)?;
    let warps = 1024;
    let (dw, db, partials) = (
        dev.zeros::<f32>(c)?,
        dev.zeros::<f32>(c)?,
        dev.zeros::<f32>(warps * 2 * c)?,
    );
    let params = 124_475_904usize;
    let (p, g, m, v) = (
        dev.zeros::<f32>(params)?,
        dev.zeros::<f32>(params)?,
        dev.zeros::<f32>(params)?,
        dev.zeros::<f32>(params)?,
    );
    let copy = dev.zeros::<bf16>(params)?;
    let dbias = dev.zeros::<f32>(3 * c)?;
    let col_partials = dev.zeros::<f32>(64 * 3 * c)?;
    let hd = Heads {
        b: s.b as i32,
        t: s.t as i32,
        h: s.h as i32,
        d: s.d as i32,
    };
    let step = AdamWStep::new(3e-4, 0.9, 0.95, 1e-8, 0.1, 1);
    let nc = (n * c) as f64;
    // The softmax kernels read each row up to its query (a little over half of T x T)
    // and write it up to its chunk's width (5/8 at 4 chunks).
    let chunk = crate::step::attention::query_chunk(s.t);
    let (read, written) = crate::call_bytes::causal_elements(s.t as i64, chunk as i64);
    let square = (s.t * s.t) as f64;
    let (causal_read, chunk_written) = (read as f64 / square, written as f64 / square);
    type Run<'a> = Box<dyn Fn() -> Result<(), GpuError> + 'a>;
    let runs: Vec<(String, f64, Run)> = vec![
        (
            "encoder-forward".into(),
            3.0 * nc * e,
            Box::new(|| {
                kernels::encoder_forward(
                    dev,
                    dev.all(&out),
                    &tokens,
                    dev.all(&wte),
                    Some(dev.all(&x)),
                    s.t,
                    c,
                )
            }),
        ),
        (
            "layernorm-forward (residual fused)".into(),
            4.0 * nc * e,
            Box::new(|| {
                kernels::layernorm_forward(
                    dev,
                    dev.all(&out),
                    stats,
                    dev.all(&x),
                    Some((dev.all(&resid), dev.all(&a2))),
                    dev.all(&w),
                    dev.all(&bias),
                    1e-5,
                )
            }),
        ),
        (
            "layernorm-backward".into(),
            4.0 * nc * e,
            Box::new(|| {
                kernels::layernorm_backward(
                    dev,
                    dev.all(&out),
                    dev.all(&dw),
                    dev.all(&db),
                    dev.all(&partials),
                    dev.all(&x),
                    dev.all(&resid),
                    dev.all(&w),
                    stats,
                    warps,
                )
            }),
        ),
        (
            "gelu-forward".into(),
            8.0 * nc * e,
            Box::new(|| kernels::gelu_forward(dev, dev.all(&fc_out), dev.all(&fc))),
        ),
        (
            "gelu-backward".into(),
            12.0 * nc * e,
            Box::new(|| {
                kernels::gelu_backward(dev, dev.all(&fc_out), dev.all(&fc), dev.all(&fc_out))
            }),
        ),
        (
            "qkv-heads".into(),
            6.0 * nc * e,
            Box::new(|| kernels::qkv_heads(dev, dev.all(&heads), dev.all(&qkv), hd, false)),
        ),
        (
            "attention-softmax-forward".into(),
            (causal_read + chunk_written) * bhtt as f64 * e,
            Box::new(|| {
                kernels::attention_softmax_forward(
                    dev,
                    dev.all(&att),
                    dev.all(&pre),
                    (s.t, chunk),
                    0.125,
                )
            }),
        ),
        (
            "attention-softmax-backward".into(),
            (2.0 * causal_read + chunk_written) * bhtt as f64 * e,
            Box::new(|| {
                kernels::attention_softmax_backward(
                    dev,
                    dev.all(&pre),
                    dev.all(&pre),
                    dev.all(&att),
                    (s.t, chunk),
                    0.125,
                )
            }),
        ),
        (
            "classifier".into(),
            2.0 * (n * vp) as f64 * e,
            Box::new(|| {
                kernels::classifier(
                    dev,
                    dev.all(&logits),
                    dev.all(&losses),
                    None,
                    &targets,
                    s.v,
                    Some(1.0 / n as f32),
                    -1,
                )
            }),
        ),
        (
            "column-sums (qkv bias)".into(),
            3.0 * nc * e,
            Box::new(|| {
                kernels::column_sums_add(
                    dev,
                    dev.all(&dbias),
                    dev.all(&qkv),
                    dev.all(&col_partials),
                    64,
                )
            }),
        ),
        (
            "adamw (124M, bf16 copy)".into(),
            30.0 * params as f64,
            Box::new(|| {
                kernels::adamw(
                    dev,
                    dev.all(&p),
                    dev.all(&g),
                    dev.all(&m),
                    dev.all(&v),
                    Some(dev.all(&copy)),
                    &step,
                    true,
                    1.0,
                )
            }),
        ),
    ];
    let mut out_times = Vec::new();
    for (name, bytes, run) in &runs {
        out_times.push(KernelTime {
            name: name.clone(),
            micros: median_micros(dev, reps, run)?,
            bytes: *bytes,
        });
    }
    Ok(out_times)
}

/// The median of `reps` timings of `run` on the device's stream (CUDA events), after one
/// untimed run.
pub(super) fn median_micros(
    dev: &Device,
    reps: usize,
    run: impl Fn() -> Result<(), GpuError>,
) -> Result<f64, GpuError> {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let ev = || {
        dev.ctx
            .new_event(flags)
            .map_err(super::driver("creating an event"))
    };
    run()?;
    dev.synchronize()?;
    let mut times = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let (start, end) = (ev()?, ev()?);
        start
            .record(dev.stream())
            .map_err(super::driver("recording an event"))?;
        run()?;
        end.record(dev.stream())
            .map_err(super::driver("recording an event"))?;
        end.synchronize()
            .map_err(super::driver("waiting for an event"))?;
        times.push(
            start
                .elapsed_ms(&end)
                .map_err(super::driver("reading an event"))? as f64
                * 1e3,
        );
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// A step on the GPU against the same step on the host, one model and element type:
/// the summed losses' relative difference and the worst parameter's gradient error (its
/// largest absolute difference over its largest absolute value on the host).
#[derive(Debug, Clone, PartialEq)]
pub struct StepCompared {
    /// `gpt f32`, `llama bf16`, ...
    pub what: String,
    /// |loss_gpu - loss_host| / |loss_host|.
    pub loss_rel: f64,
    /// The worst parameter and its relative gradient error.
    pub worst: (String, f64),
}

/// One step's (loss, gradients) on each backend, compared parameter by parameter.
fn compared(
    what: String,
    ranges: &crate::sample::Ranges,
    host: (f64, Vec<f32>),
    gpu: (f64, Vec<f32>),
) -> StepCompared {
    let worst = ranges
        .iter()
        .map(|(name, r)| {
            let (h, d) = (&host.1[r.clone()], &gpu.1[r.clone()]);
            let diff: Vec<f32> = h.iter().zip(d).map(|(x, y)| x - y).collect();
            (
                name.clone(),
                max_abs(&diff) / max_abs(h).max(f64::MIN_POSITIVE),
            )
        })
        .fold((String::new(), 0f64), |w, x| {
            if x.1.is_nan() || x.1 > w.1 {
                x
            } else {
                w
            }
        });
    StepCompared {
        what,
        loss_rel: (gpu.0 - host.0).abs() / host.0.abs(),
        worst,
    }
}

/// The largest absolute value, NaN if any is NaN (a NaN must not fold away).
pub(super) fn max_abs(x: &[f32]) -> f64 {
    x.iter().fold(0f64, |m, &v| {
        if m.is_nan() || v.is_nan() {
            f64::NAN
        } else {
            m.max((v as f64).abs())
        }
    })
}

/// The tests' small batch: 3 sequences of 11 positions over `vocab`.
fn small_batch(vocab: usize) -> (Vec<i64>, Vec<i64>) {
    let draw = |seed| {
        crate::sample::ids(33, seed, vocab)
            .iter()
            .map(|&x| x as i64)
            .collect()
    };
    (draw(1), draw(2))
}

/// One step's (loss, gradients) on its backend.
fn run_once<B: Backend + Send, S: ResidentStep<B>>(
    be: &B,
    s: &S,
    params: &[f32],
    batch: TokenBatch,
    scale: f32,
) -> Result<(f64, Vec<f32>), GpuError> {
    s.load(be, params)?;
    let loss = s.run(be, batch, scale)?;
    let mut grads = vec![0f32; params.len()];
    s.gradients_into(be, &mut grads)?;
    Ok((loss, grads))
}

/// The tests' small GPT and Llama (grouped-query: 4 heads over 2), their steps on the GPU
/// and on the host backend, f32, bf16 and f16. The matrix products differ (cuBLAS
/// against the host's), so this is a tolerance, not bits: f32 should land near 1e-5,
/// bf16 near 1e-2, f16 near 1e-3.
pub fn compare_step(dev: &Device) -> Result<Vec<StepCompared>, GpuError> {
    fn gpt<A: crate::Act>(dev: &Device, what: &str) -> Result<StepCompared, GpuError> {
        let dims = stoker_kernels::GptDims {
            vocab: 71,
            context: 16,
            d_model: 32,
            n_layer: 2,
            n_head: 4,
        };
        let g = crate::sample::gpt(&dims, 100, 0.2);
        let (tokens, targets) = small_batch(dims.vocab);
        let batch = TokenBatch {
            tokens: &tokens,
            targets: &targets,
            ignore: -1,
        };
        let host = GptGpuStep::<Host, A>::new(&Host, dims, g.offsets.clone(), 1e-5, 3, 11)?;
        let gpu = GptGpuStep::<Device, A>::new(dev, dims, g.offsets.clone(), 1e-5, 3, 11)?;
        let scale = 1.0 / 33.0;
        Ok(compared(
            what.into(),
            &g.ranges,
            run_once(&Host, &host, &g.params, batch, scale)?,
            run_once(dev, &gpu, &g.params, batch, scale)?,
        ))
    }
    fn llama<A: crate::Act>(dev: &Device, what: &str) -> Result<StepCompared, GpuError> {
        let dims = crate::sample::SMALL_LLAMA;
        let g = crate::sample::llama(&dims, 200, 0.2);
        let (tokens, targets) = small_batch(dims.vocab);
        let batch = TokenBatch {
            tokens: &tokens,
            targets: &targets,
            ignore: -1,
        };
        let host =
            LlamaGpuStep::<Host, A>::new(&Host, dims, g.offsets.clone(), 1e-5, 10_000.0, 3, 11)?;
        let gpu =
            LlamaGpuStep::<Device, A>::new(dev, dims, g.offsets.clone(), 1e-5, 10_000.0, 3, 11)?;
        let scale = 1.0 / 32.0;
        Ok(compared(
            what.into(),
            &g.ranges,
            run_once(&Host, &host, &g.params, batch, scale)?,
            run_once(dev, &gpu, &g.params, batch, scale)?,
        ))
    }
    Ok(vec![
        gpt::<f32>(dev, "gpt f32")?,
        gpt::<bf16>(dev, "gpt bf16")?,
        gpt::<half::f16>(dev, "gpt f16")?,
        llama::<f32>(dev, "llama f32")?,
        llama::<bf16>(dev, "llama bf16")?,
        llama::<half::f16>(dev, "llama f16")?,
    ])
}

/// What [`time_step`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct StepTimes {
    /// Median milliseconds of a forward alone (the evaluation pass: the forward and the
    /// classifier's loss, no gradient), so that the backward's share shows.
    pub forward_ms: f64,
    /// Median milliseconds of a forward + backward.
    pub forward_backward_ms: f64,
    /// Median milliseconds of a whole step (with the update).
    pub step_ms: f64,
    /// Parameters.
    pub params: usize,
    /// Bytes the step's and the optimizer's buffers should take (their own count).
    pub planned_bytes: usize,
    /// Device memory the driver reports gone since before the step was made.
    pub measured_bytes: usize,
    /// One more step (micro-batch and update) with CUDA events around each launch:
    /// each part's GPU time ([`super::profile`]), the longest first.
    pub profile: Vec<super::profile::MeasuredShare>,
    /// That step's wall time, in milliseconds (the events' own cost included): what the
    /// parts' sum leaves of it is the GPU waiting between launches.
    pub profiled_ms: f64,
}

/// The demo's GPT (configs/shakespeare-gpt.toml): vocabulary 96, context 128, 4 layers,
/// d_model 128, 4 heads; 0.82M parameters, a step made mostly of launches.
pub const DEMO_GPT: stoker_kernels::GptDims = stoker_kernels::GptDims {
    vocab: 96,
    context: 128,
    d_model: 128,
    n_layer: 4,
    n_head: 4,
};

/// GPT-2 124M's sizes: vocabulary 50,257 (padded to 50,304), context 1,024, 12 layers,
/// d_model 768, 12 heads.
pub const GPT2_124M: stoker_kernels::GptDims = stoker_kernels::GptDims {
    vocab: 50_257,
    context: 1024,
    d_model: 768,
    n_layer: 12,
    n_head: 12,
};

/// The bf16 step of a GPT of `dims` ([`GPT2_124M`], [`DEMO_GPT`]) at micro-batch `b` x
/// its context, after two warm-up steps: the median milliseconds of `reps` forward +
/// backward passes and of `reps` whole steps (with the gradient norm, clipping at 1.0 and
/// AdamW), the parameter count (for MFU: 6N + 6LCT FLOPs per token), and one more step
/// profiled launch by launch; the step made with `opts` (attention recomputed, say).
pub fn time_step(
    dev: &Device,
    dims: stoker_kernels::GptDims,
    b: usize,
    reps: usize,
    opts: crate::step::options::StepOptions,
) -> Result<StepTimes, GpuError> {
    let t = dims.context;
    let g = crate::sample::gpt(&dims, 7, 0.02);
    let free_before = dev.free_bytes()?;
    let step =
        GptGpuStep::<Device, bf16>::with_options(dev, dims, g.offsets.clone(), 1e-5, (b, t), opts)?;
    step.buffers().load_params(dev, &g.params)?;
    let segments: Vec<(std::ops::Range<usize>, bool)> =
        crate::sample::segments(&stoker_kernels::gpt_params(&dims), &g.ranges);
    let opt = crate::step::optimizer::OptimizerState::adamw(dev, &g.params, &segments)?;
    let tokens: Vec<i64> = crate::sample::ids(b * t, 3, dims.vocab)
        .iter()
        .map(|&x| x as i64)
        .collect();
    let targets: Vec<i64> = crate::sample::ids(b * t, 4, dims.vocab)
        .iter()
        .map(|&x| x as i64)
        .collect();
    let batch = TokenBatch {
        tokens: &tokens,
        targets: &targets,
        ignore: -1,
    };
    // The median milliseconds of `run(i)` over `reps` runs after two warm-up runs.
    let median = |mut run: Box<dyn FnMut(u64) -> Result<(), GpuError> + '_>| {
        let mut times = Vec::new();
        for i in 0..reps as u64 + 2 {
            let t0 = std::time::Instant::now();
            run(i)?;
            if i >= 2 {
                times.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        times.sort_by(f64::total_cmp);
        Ok::<f64, GpuError>(times[times.len() / 2])
    };
    let forward_backward = || -> Result<(), GpuError> {
        step.buffers().zero_grads(dev)?;
        step.forward_backward(dev, batch, 1.0 / (b * t) as f32)?; // ends on the loss read
        Ok(())
    };
    let forward_backward_ms = median(Box::new(|_| forward_backward()))?;
    let whole_step = |i: u64| -> Result<(), GpuError> {
        forward_backward()?;
        let adam = AdamWStep::new(3e-4, 0.9, 0.95, 1e-8, 0.1, i + 1);
        let scalars = crate::step::optimizer::Scalars::AdamW(adam);
        step.update(dev, &opt, &scalars, 1.0, Some(1.0))?; // ends on the norm read
        dev.synchronize()
    };
    let step_ms = median(Box::new(&whole_step))?;
    // One more, each launch between CUDA events: where the step's time goes.
    dev.start_profile();
    let t0 = std::time::Instant::now();
    let profiled = whole_step(reps as u64 + 2);
    let profiled_ms = t0.elapsed().as_secs_f64() * 1e3;
    let profile = dev.take_profile();
    profiled?;
    let profile = profile?;
    // The forward alone: evaluation ends on reading its sums.
    let forward_ms = median(Box::new(|_| step.evaluate(dev, batch).map(|_| ())))?;
    // Measured after the steps: cuBLAS's workspace and the ids' small buffers count too.
    let measured_bytes = free_before.saturating_sub(dev.free_bytes()?);
    Ok(StepTimes {
        forward_ms,
        forward_backward_ms,
        step_ms,
        params: g.params.len(),
        planned_bytes: step.buffers().bytes() + opt.bytes() + step.fp8_bytes(),
        measured_bytes,
        profile,
        profiled_ms,
    })
}
