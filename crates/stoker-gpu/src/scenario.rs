//! Every kernel once, on seeded inputs, for any backend: what the device check runs on
//! the host and on the GPU and compares bit for bit. bf16 and f16 results are widened to
//! f32 (exactly), so one comparison covers every element type.

use half::{bf16, f16};
use stoker_kernels::AdamWStep;

use crate::backend::Backend;
use crate::elem::Act;
use crate::error::GpuError;
use crate::ids::{Groups, Ids};
use crate::kernels::{self, Stats};
use crate::sample::{ids, uniform};
use crate::{Heads, TokenGroups};

/// The shapes a scenario runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScenarioSize {
    /// Sequences.
    pub b: usize,
    /// Positions.
    pub t: usize,
    /// Heads.
    pub h: usize,
    /// Head width.
    pub d: usize,
    /// Vocabulary (the classifier pads it to a multiple of 64).
    pub v: usize,
}

impl ScenarioSize {
    /// Small enough for a test, odd enough to catch edge handling (rows and widths not
    /// multiples of 32).
    pub const SMALL: ScenarioSize = ScenarioSize {
        b: 2,
        t: 37,
        h: 3,
        d: 16,
        v: 101,
    };
}

/// One named output of a scenario, as f32.
pub type Output = (String, Vec<f32>);

fn widen<T: Act>(x: &[T]) -> Vec<f32> {
    x.iter().map(|&v| crate::elem::to_f32(v)).collect()
}

/// Runs every kernel of element type `T` at size `s` on `b` and returns its outputs,
/// named `kernel/buffer <dtype>`.
pub fn outputs<B: Backend, T: Act>(b: &B, s: ScenarioSize) -> Result<Vec<Output>, GpuError> {
    let tag = T::DTYPE.suffix();
    let (c, n) = (s.h * s.d, s.b * s.t);
    let vp = s.v.div_ceil(64) * 64;
    let act = |len: usize, seed: u64, scale: f32| -> Result<B::Buf<T>, GpuError> {
        let x: Vec<T> = uniform(len, seed, scale)
            .into_iter()
            .map(crate::elem::from_f32::<T>)
            .collect();
        b.upload(&x)
    };
    let mut out: Vec<Output> = Vec::new();
    let mut keep = |name: &str, v: Vec<f32>| out.push((format!("{name} {tag}"), v));
    let get = |buf: &B::Buf<T>| -> Result<Vec<f32>, GpuError> { Ok(widen(&b.download(buf)?)) };

    // Embedding.
    let tok = ids(n, 1, s.v);
    let tokens = Ids::new(b, "tokens", &tok, s.v, None)?;
    let (wte, wpe, x) = (
        act(s.v * c, 2, 1.0)?,
        act(s.t * c, 3, 1.0)?,
        b.zeros::<T>(n * c)?,
    );
    kernels::encoder_forward(
        b,
        b.all(&x),
        &tokens,
        b.all(&wte),
        Some(b.all(&wpe)),
        s.t,
        c,
    )?;
    keep("encoder-forward/out", get(&x)?);
    let dout = act(n * c, 4, 1.0)?;
    let (dwte, dwpe) = (b.zeros::<f32>(s.v * c)?, b.zeros::<f32>(s.t * c)?);
    kernels::encoder_backward_wpe(b, b.all(&dwpe), b.all(&dout), s.b, s.t, c)?;
    let groups = Groups::new(b, &TokenGroups::new(&tok, s.v)?, s.v)?;
    kernels::encoder_backward_wte(b, b.all(&dwte), b.all(&dout), &groups, c)?;
    keep("encoder-backward/dwpe", b.download(&dwpe)?);
    keep("encoder-backward/dwte", b.download(&dwte)?);

    // Layer norm with the fused residual, and its backward.
    let (a2, w, bias) = (act(n * c, 5, 1.0)?, act(c, 6, 1.0)?, act(c, 7, 0.5)?);
    let (ln, resid) = (b.zeros::<T>(n * c)?, b.zeros::<T>(n * c)?);
    let (mean, rstd) = (b.zeros::<f32>(n)?, b.zeros::<f32>(n)?);
    let stats = Stats {
        mean: b.all(&mean),
        rstd: b.all(&rstd),
    };
    kernels::layernorm_forward(
        b,
        b.all(&ln),
        stats,
        b.all(&x),
        Some((b.all(&resid), b.all(&a2))),
        b.all(&w),
        b.all(&bias),
        1e-5,
    )?;
    keep("layernorm-forward/out", get(&ln)?);
    keep("layernorm-forward/residual", get(&resid)?);
    keep("layernorm-forward/mean", b.download(&mean)?);
    keep("layernorm-forward/rstd", b.download(&rstd)?);
    let warps = 7;
    let (dx, dw, db, partials) = (
        act(n * c, 8, 0.1)?,
        b.zeros::<f32>(c)?,
        b.zeros::<f32>(c)?,
        b.zeros::<f32>(warps * 2 * c)?,
    );
    kernels::layernorm_backward(
        b,
        b.all(&dx),
        b.all(&dw),
        b.all(&db),
        b.all(&partials),
        b.all(&dout),
        b.all(&resid),
        b.all(&w),
        stats,
        warps,
    )?;
    keep("layernorm-backward/dinp", get(&dx)?);
    keep("layernorm-backward/dweight", b.download(&dw)?);
    keep("layernorm-backward/dbias", b.download(&db)?);

    // Rounding an f32 master into the compute copy: values past f16's range and into its
    // subnormals as well as ordinary ones.
    for (what, scale) in [("ordinary", 4.0), ("large", 1e5), ("tiny", 1e-5)] {
        let x = b.upload(&uniform(n * c, 17, scale))?;
        let y = b.zeros::<T>(n * c)?;
        kernels::from_f32(b, b.all(&y), b.all(&x))?;
        keep(&format!("from-f32/{what}"), get(&y)?);
    }

    // GELU.
    let (fc, g) = (act(n * 4 * c, 9, 4.0)?, b.zeros::<T>(n * 4 * c)?);
    kernels::gelu_forward(b, b.all(&g), b.all(&fc))?;
    keep("gelu-forward/out", get(&g)?);
    let dg = act(n * 4 * c, 10, 1.0)?;
    kernels::gelu_backward(b, b.all(&dg), b.all(&fc), b.all(&dg))?;
    keep("gelu-backward/dinp", get(&dg)?);

    // Attention's layouts and softmax.
    let hd = Heads {
        b: s.b as i32,
        t: s.t as i32,
        h: s.h as i32,
        d: s.d as i32,
    };
    let (qkv, heads) = (act(n * 3 * c, 11, 1.0)?, b.zeros::<T>(n * 3 * c)?);
    kernels::qkv_heads(b, b.all(&heads), b.all(&qkv), hd, false)?;
    keep("qkv-heads/forward", get(&heads)?);
    let back = b.zeros::<T>(n * 3 * c)?;
    kernels::qkv_heads(b, b.all(&back), b.all(&heads), hd, true)?;
    keep("qkv-heads/back", get(&back)?);
    let (merged, unmerged) = (b.zeros::<T>(n * c)?, b.zeros::<T>(n * c)?);
    kernels::merged_heads(b, b.all(&merged), b.view(&heads, 0..n * c)?, hd, false)?;
    kernels::merged_heads(b, b.all(&unmerged), b.all(&merged), hd, true)?;
    keep("merged-heads/forward", get(&merged)?);
    keep("merged-heads/back", get(&unmerged)?);
    let bh_tt = s.b * s.h * s.t * s.t;
    let (pre, att) = (act(bh_tt, 12, 3.0)?, b.zeros::<T>(bh_tt)?);
    let scale = 1.0 / (s.d as f32).sqrt();
    kernels::attention_softmax_forward(b, b.all(&att), b.all(&pre), (s.t, s.t), scale)?;
    keep("attention-softmax-forward/att", get(&att)?);
    let datt = act(bh_tt, 13, 1.0)?;
    kernels::attention_softmax_backward(
        b,
        b.all(&datt),
        b.all(&datt),
        b.all(&att),
        (s.t, s.t),
        scale,
    )?;
    keep("attention-softmax-backward/dpre", get(&datt)?);
    // Queries in chunks that do not divide the positions: each row written up to its
    // chunk's width only (the rest stays as it was on both builds).
    let chunk = s.t.div_ceil(3);
    let att_c = b.zeros::<T>(bh_tt)?;
    kernels::attention_softmax_forward(b, b.all(&att_c), b.all(&pre), (s.t, chunk), scale)?;
    keep("attention-softmax-forward/att chunked", get(&att_c)?);
    let datt_c = act(bh_tt, 13, 1.0)?;
    kernels::attention_softmax_backward(
        b,
        b.all(&datt_c),
        b.all(&datt_c),
        b.all(&att_c),
        (s.t, chunk),
        scale,
    )?;
    keep("attention-softmax-backward/dpre chunked", get(&datt_c)?);

    // Bias gradient.
    let (dbias, cp) = (b.zeros::<f32>(3 * c)?, b.zeros::<f32>(5 * 3 * c)?);
    kernels::column_sums_add(b, b.all(&dbias), b.all(&qkv), b.all(&cp), 5)?;
    keep("column-sums/dst", b.download(&dbias)?);

    // The classifier, with ignored rows and a padded vocabulary.
    let mut tg = ids(n, 14, s.v);
    tg[1] = -100;
    let targets = Ids::new(b, "targets", &tg, s.v, Some(-100))?;
    let (logits, losses, hits) = (
        act(n * vp, 15, 5.0)?,
        b.zeros::<f32>(n)?,
        b.zeros::<f32>(n)?,
    );
    kernels::classifier(
        b,
        b.all(&logits),
        b.all(&losses),
        Some(b.all(&hits)),
        &targets,
        s.v,
        Some(1.0 / n as f32),
        -100,
    )?;
    keep("classifier/losses", b.download(&losses)?);
    keep("classifier/hits", b.download(&hits)?);
    keep("classifier/dlogits", get(&logits)?);
    llama_outputs::<B, T>(b, s, &mut keep)?;
    Ok(out)
}

/// The Llama's kernels at `s` (two kv heads when the head count allows, else one).
fn llama_outputs<B: Backend, T: Act>(
    b: &B,
    s: ScenarioSize,
    keep: &mut impl FnMut(&str, Vec<f32>),
) -> Result<(), GpuError> {
    let (c, n) = (s.h * s.d, s.b * s.t);
    let act = |len: usize, seed: u64, scale: f32| -> Result<B::Buf<T>, GpuError> {
        let x: Vec<T> = uniform(len, seed, scale)
            .into_iter()
            .map(crate::elem::from_f32::<T>)
            .collect();
        b.upload(&x)
    };
    let get = |buf: &B::Buf<T>| -> Result<Vec<f32>, GpuError> { Ok(widen(&b.download(buf)?)) };
    let (x, a2, w) = (act(n * c, 31, 1.0)?, act(n * c, 32, 1.0)?, act(c, 33, 1.0)?);
    let (out, resid, rstd) = (
        b.zeros::<T>(n * c)?,
        b.zeros::<T>(n * c)?,
        b.zeros::<f32>(n)?,
    );
    crate::llama::rmsnorm_forward(
        b,
        b.all(&out),
        b.all(&rstd),
        b.all(&x),
        Some((b.all(&resid), b.all(&a2))),
        b.all(&w),
        1e-5,
    )?;
    keep("rmsnorm-forward/out", get(&out)?);
    keep("rmsnorm-forward/rstd", b.download(&rstd)?);
    let warps = 5;
    let (dx, dw, partials, dout) = (
        act(n * c, 34, 0.1)?,
        b.zeros::<f32>(c)?,
        b.zeros::<f32>(warps * c)?,
        act(n * c, 35, 1.0)?,
    );
    crate::llama::rmsnorm_backward(
        b,
        b.all(&dx),
        b.all(&dw),
        b.all(&partials),
        b.all(&dout),
        b.all(&resid),
        b.all(&w),
        b.all(&rstd),
        warps,
    )?;
    keep("rmsnorm-backward/dinp", get(&dx)?);
    keep("rmsnorm-backward/dweight", b.download(&dw)?);
    let (cos, sin) = stoker_kernels::rope::tables(s.t, s.d, 10_000.0);
    let (cb, sb, q) = (b.upload(&cos)?, b.upload(&sin)?, act(n * c, 36, 1.0)?);
    crate::llama::rope(b, b.all(&q), b.all(&cb), b.all(&sb), s.t, s.h, s.d, false)?;
    keep("rope/forward", get(&q)?);
    crate::llama::rope(b, b.all(&q), b.all(&cb), b.all(&sb), s.t, s.h, s.d, true)?;
    keep("rope/back", get(&q)?);
    let (gate, upv, y) = (
        act(n * 4 * c, 37, 5.0)?,
        act(n * 4 * c, 38, 1.0)?,
        b.zeros::<T>(n * 4 * c)?,
    );
    crate::llama::swiglu_forward(b, b.all(&y), b.all(&gate), b.all(&upv))?;
    keep("swiglu-forward/y", get(&y)?);
    let (dg, du, dy) = (
        b.zeros::<T>(n * 4 * c)?,
        b.zeros::<T>(n * 4 * c)?,
        act(n * 4 * c, 39, 1.0)?,
    );
    crate::llama::swiglu_backward(
        b,
        b.all(&dg),
        b.all(&du),
        b.all(&gate),
        b.all(&upv),
        b.all(&dy),
    )?;
    keep("swiglu-backward/dgate", get(&dg)?);
    keep("swiglu-backward/dup", get(&du)?);
    let kv = if s.h.is_multiple_of(2) { 2 } else { 1 };
    let g = Heads {
        b: s.b as i32,
        t: s.t as i32,
        h: s.h as i32,
        d: s.d as i32,
    };
    let (kvs, heads) = (act(n * kv * s.d, 40, 1.0)?, b.zeros::<T>(n * c)?);
    crate::llama::kv_heads(b, b.all(&heads), b.all(&kvs), g, kv, false)?;
    keep("kv-heads/forward", get(&heads)?);
    let back = b.zeros::<T>(n * kv * s.d)?;
    crate::llama::kv_heads(b, b.all(&back), b.all(&heads), g, kv, true)?;
    keep("kv-heads/back", get(&back)?);
    Ok(())
}

/// The element-type-free kernels: AdamW (with its bf16 copy) and the sums.
pub fn f32_outputs<B: Backend>(b: &B) -> Result<Vec<Output>, GpuError> {
    let n = 10_007;
    let (p, g, m) = (
        b.upload(&uniform(n, 21, 1.0))?,
        b.upload(&uniform(n, 22, 0.1))?,
        b.upload(&uniform(n, 23, 0.01))?,
    );
    let v = b.upload(
        &uniform(n, 24, 0.001)
            .iter()
            .map(|x| x.abs())
            .collect::<Vec<_>>(),
    )?;
    let copy = b.zeros::<bf16>(n)?;
    let step = AdamWStep::new(3e-4, 0.9, 0.95, 1e-8, 0.1, 5);
    kernels::adamw(
        b,
        b.all(&p),
        b.all(&g),
        b.all(&m),
        b.all(&v),
        Some(b.all(&copy)),
        &step,
        true,
        0.5,
    )?;
    let (sum, partials) = (b.zeros::<f32>(1)?, b.zeros::<f32>(300)?);
    kernels::sum(
        b,
        b.all(&sum),
        b.all(&g),
        b.all(&partials),
        true,
        300,
        false,
    )?;
    // The segmented optimizers over the same buffers' copies, gaps between segments.
    let segments = [(0..3000, true), (3000..3001, false), (3100..n, true)];
    let segs = crate::optim::Segments::new(b, &segments, n)?;
    let (p2, m2, v2) = (
        b.upload(&uniform(n, 21, 1.0))?,
        b.upload(&uniform(n, 23, 0.01))?,
        b.upload(
            &uniform(n, 24, 0.001)
                .iter()
                .map(|x| x.abs())
                .collect::<Vec<_>>(),
        )?,
    );
    // Its bf16 copy rounded stochastically (counters from an offset past 2^32, so both
    // halves of the index reach the hash).
    let copy2 = b.zeros::<bf16>(n)?;
    let round = crate::args::StochasticRound {
        seed: 0x5eed_0000_0001,
        offset: (1 << 32) + 12_345,
    };
    crate::optim::adamw(
        b,
        b.all(&p2),
        b.all(&g),
        b.all(&m2),
        b.all(&v2),
        (Some(b.all(&copy2)), Some(round)),
        &step,
        &segs,
        0.5,
    )?;
    let (p3, buf) = (
        b.upload(&uniform(n, 25, 1.0))?,
        b.upload(&uniform(n, 26, 0.05))?,
    );
    let sgd = stoker_kernels::SgdStep {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 0.01,
        nesterov: true,
        first: false,
    };
    crate::optim::sgd(
        b,
        b.all(&p3),
        b.all(&g),
        Some(b.all(&buf)),
        None,
        &sgd,
        &segs,
        0.5,
    )?;
    Ok(vec![
        ("adamw/p".into(), b.download(&p)?),
        ("adamw/m".into(), b.download(&m)?),
        ("adamw/v".into(), b.download(&v)?),
        ("adamw/copy".into(), widen(&b.download(&copy)?)),
        ("sum/squares".into(), b.download(&sum)?),
        ("adamw-segments/p".into(), b.download(&p2)?),
        (
            "adamw-segments/stochastic-copy".into(),
            widen(&b.download(&copy2)?),
        ),
        ("sgd-segments/p".into(), b.download(&p3)?),
        ("sgd-segments/buf".into(), b.download(&buf)?),
    ])
}

/// Every output of every kernel at `s`: f32, bf16, then the f32-only kernels.
pub fn all_outputs<B: Backend>(b: &B, s: ScenarioSize) -> Result<Vec<Output>, GpuError> {
    let mut out = outputs::<B, f32>(b, s)?;
    out.extend(outputs::<B, bf16>(b, s)?);
    out.extend(outputs::<B, f16>(b, s)?);
    out.extend(f32_outputs(b)?);
    out.extend(fp8_outputs(b)?);
    Ok(out)
}

/// FP8 delayed scaling's kernels ([`crate::fp8`]): casts of f32, bf16 and f16 tensors to
/// both formats with their transposes (odd shapes, values past both formats' largest,
/// NaN, and infinity in the f16 cast, which records nothing), over three steps whose amaxes set the next scales, and each step's
/// scales and histories. The bytes are widened to f32 as their integer values, so any
/// byte that differs shows.
pub fn fp8_outputs<B: Backend>(b: &B) -> Result<Vec<Output>, GpuError> {
    use crate::elem::{E4m3, E5m2};
    use stoker_precision::{AmaxComputeAlgo, DelayedScalingConfig, TensorRole};
    let cfg = DelayedScalingConfig {
        amax_history_len: 2,
        amax_compute_algo: AmaxComputeAlgo::Max,
        ..Default::default()
    };
    let roles = [TensorRole::Forward, TensorRole::Backward];
    let scalers = crate::fp8::Fp8Scalers::new(b, &cfg, &roles)?;
    let (rows, cols) = (37, 45);
    let n = rows * cols;
    let mut out: Vec<Output> = Vec::new();
    for step in 0..3u64 {
        // Values near the formats' ranges: a spread of 2^-20 to 2^20 scaled by the step.
        let mut x: Vec<f32> = uniform(n, 40 + step, 1.0)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 2f32.powi((i % 41) as i32 - 20))
            .collect();
        x[n - 1] = f32::NAN;
        x[n - 2] = -f32::NAN;
        x[7] = 6.0e4;
        x[11] = -470.0;
        let (q4, t4, q5, t5) = (
            b.zeros::<E4m3>(n)?,
            b.zeros::<E4m3>(n)?,
            b.zeros::<E5m2>(n)?,
            b.zeros::<E5m2>(n)?,
        );
        let x32 = b.upload(&x)?;
        let x16: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let xb = b.upload(&x16)?;
        // The f16 cast records nothing: it may hold infinity (past 65,504, and one).
        let mut xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        xh[3] = f16::INFINITY;
        let xh = b.upload(&xh)?;
        let bytes4 = |buf: &B::Buf<E4m3>| -> Result<Vec<f32>, GpuError> {
            Ok(b.download(buf)?.iter().map(|q| q.0 as f32).collect())
        };
        let bytes5 = |buf: &B::Buf<E5m2>| -> Result<Vec<f32>, GpuError> {
            Ok(b.download(buf)?.iter().map(|q| q.0 as f32).collect())
        };
        let shape = (rows, cols);
        scalers.quantize(b, 0, b.all(&x32), shape, b.all(&q4), Some(b.all(&t4)), true)?;
        scalers.quantize(b, 1, b.all(&xb), shape, b.all(&q5), Some(b.all(&t5)), true)?;
        out.push((format!("fp8-quantize/e4m3 f32 step {step}"), bytes4(&q4)?));
        out.push((format!("fp8-quantize/e4m3-t f32 step {step}"), bytes4(&t4)?));
        out.push((format!("fp8-quantize/e5m2 bf16 step {step}"), bytes5(&q5)?));
        out.push((
            format!("fp8-quantize/e5m2-t bf16 step {step}"),
            bytes5(&t5)?,
        ));
        scalers.quantize(b, 0, b.all(&xh), shape, b.all(&q4), None, false)?;
        out.push((format!("fp8-quantize/e4m3 f16 step {step}"), bytes4(&q4)?));
        // The transpose alone (what a backward casts again), into a cleared buffer.
        b.zero(b.all(&t4))?;
        scalers.quantize_transposed(b, 0, b.all(&x32), shape, b.all(&t4))?;
        out.push((
            format!("fp8-quantize/e4m3-t alone f32 step {step}"),
            bytes4(&t4)?,
        ));
        scalers.end_step(b)?;
        let state: Vec<f32> = scalers
            .read(b)?
            .into_iter()
            .flat_map(|v| [vec![v.scale, v.scale_inv], v.history].concat())
            .collect();
        out.push((format!("fp8-scale-update/state step {step}"), state));
    }
    Ok(out)
}

/// Flash attention's forward and backward ([`crate::flash`]) at `(B*H, T, D)`, `group`
/// query heads a kv head, on seeded bf16 inputs: the output, each row's log-sum-exp and
/// the three gradients, as f32. Not part of [`all_outputs`]: the tensor cores sum in
/// their own order, so the device check compares these within a tolerance, not bit for
/// bit.
pub fn flash_outputs<B: Backend>(
    b: &B,
    (shape, group): (crate::flash::FlashShape, usize),
) -> Result<Vec<Output>, GpuError> {
    let (bh, t, d) = shape;
    let (n, nkv) = (bh * t * d, bh / group.max(1) * t * d);
    let draw = |len, seed, scale| -> Result<B::Buf<bf16>, GpuError> {
        let x: Vec<bf16> = uniform(len, seed, scale)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        b.upload(&x)
    };
    let (q, k) = (draw(n, 71, 1.5)?, draw(nkv, 72, 1.5)?);
    let (v, dout) = (draw(nkv, 73, 1.0)?, draw(n, 74, 1.0)?);
    let (out, dq, dk, dv) = (b.zeros(n)?, b.zeros(n)?, b.zeros(nkv)?, b.zeros(nkv)?);
    let (lse, dsum) = (b.zeros::<f32>(bh * t)?, b.zeros::<f32>(bh * t)?);
    let x = (b.all(&q), b.all(&k), b.all(&v));
    crate::flash::forward(b, x, (b.all(&out), b.all(&lse)), (shape, group))?;
    crate::flash::backward(
        b,
        x,
        (b.all(&out), b.all(&dout), b.all(&lse)),
        b.all(&dsum),
        (b.all(&dq), b.all(&dk), b.all(&dv)),
        (shape, group),
    )?;
    let name = |what: &str| format!("flash/{what} bf16 ({bh} x {t} x {d}, groups of {group})");
    Ok(vec![
        (name("out"), widen(&b.download(&out)?)),
        (name("lse"), b.download(&lse)?),
        (name("dq"), widen(&b.download(&dq)?)),
        (name("dk"), widen(&b.download(&dk)?)),
        (name("dv"), widen(&b.download(&dv)?)),
    ])
}
