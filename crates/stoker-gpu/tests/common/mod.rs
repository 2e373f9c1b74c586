//! Shared by the host-build tests: seeded inputs, candle's CPU, and the conversions
//! between the kernels' slices and candle tensors.
#![allow(dead_code, unused_imports)]

use candle_core::{Device, Tensor, Var};
use half::bf16;

pub use stoker_gpu::sample::{ids, uniform};

/// A CPU variable of `shape` holding `x`.
pub fn var(x: &[f32], shape: &[usize]) -> Var {
    Var::from_tensor(&Tensor::from_slice(x, shape, &Device::Cpu).unwrap()).unwrap()
}

/// A tensor's elements as f32.
pub fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// f32 to bf16, round to nearest even.
pub fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// bf16 to f32.
pub fn from_bf16(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

use stoker_gpu::host::HostBuf;
use stoker_gpu::{Backend, Elem, Host, View};

/// A host buffer holding `x`.
pub fn up<E: Elem>(x: &[E]) -> HostBuf<E> {
    Host.upload(x).unwrap()
}

/// A host buffer of `n` zeros.
pub fn zeros<E: Elem>(n: usize) -> HostBuf<E> {
    Host.zeros(n).unwrap()
}

/// The whole of a host buffer.
pub fn all<E: Elem>(b: &HostBuf<E>) -> View<'_, E> {
    Host.all(b)
}

/// A host buffer's elements.
pub fn down<E: Elem>(b: &HostBuf<E>) -> Vec<E> {
    Host.download(b).unwrap()
}

/// Ids on the host, checked against `0..limit` (`skip` excepted).
pub fn ids_on_host(x: &[i32], limit: usize, skip: Option<i32>) -> stoker_gpu::Ids<Host> {
    stoker_gpu::Ids::new(&Host, "ids", x, limit, skip).unwrap()
}

/// `c[i, j] = sum_k a[i, k] b[j, k]` (`a` `[m, k]`, `b` `[n, k]`), or with `b` `[k, n]`
/// when not `bt`; per matrix of a batch.
pub fn matmul(
    a: &[f32],
    b: &[f32],
    batch: usize,
    (m, k, n): (usize, usize, usize),
    bt: bool,
    at: bool,
) -> Vec<f32> {
    let mut c = vec![0.0f32; batch * m * n];
    for z in 0..batch {
        let (a, b) = (
            &a[z * m * k..(z + 1) * m * k],
            &b[z * k * n..(z + 1) * k * n],
        );
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for l in 0..k {
                    let av = if at { a[l * m + i] } else { a[i * k + l] };
                    let bv = if bt { b[j * k + l] } else { b[l * n + j] };
                    s += av as f64 * bv as f64;
                }
                c[z * m * n + i * n + j] = s as f32;
            }
        }
    }
    c
}

/// `steps` training steps of a CPU step over `params` (in place) on one batch: forward
/// and backward, stoker-train's clipping rule at `clip`, stoker-kernels' AdamW per
/// segment with `adam(t)`. Returns each step's summed loss.
#[allow(clippy::too_many_arguments)]
pub fn cpu_train(
    step: &mut dyn stoker_kernels::TokenStep,
    params: &mut [f32],
    batch: stoker_kernels::GptBatch,
    scale: f32,
    clip: f64,
    segs: &[(std::ops::Range<usize>, bool)],
    adam: impl Fn(u64) -> stoker_kernels::AdamWStep,
    steps: u64,
) -> Vec<f64> {
    let n = params.len();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    let mut losses = Vec::new();
    for t in 1..=steps {
        let mut g = vec![0f32; n];
        losses.push(
            step.forward_backward(params, batch, scale, &mut g, &mut |_, _| {})
                .unwrap(),
        );
        let norm = g.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
        if let Some(coef) = stoker_kernels::flat::clip_coefficient(norm, clip) {
            g.iter_mut().for_each(|x| *x *= coef as f32);
        }
        for (r, decay) in segs {
            let r = r.clone();
            stoker_kernels::optim::adamw_update_scalar(
                &adam(t),
                *decay,
                &mut params[r.clone()],
                &g[r.clone()],
                &mut m[r.clone()],
                &mut v[r],
            );
        }
    }
    losses
}

/// [`stoker_testkit::assert_close`] parameter by parameter (`ranges`: each name and
/// range of the flat buffers), each labelled by `label(name)`.
pub fn assert_close_each(
    got: &[f32],
    want: &[f32],
    ranges: &[(String, std::ops::Range<usize>)],
    rel: f64,
    label: impl Fn(&str) -> String,
) {
    for (name, r) in ranges {
        stoker_testkit::assert_close(&got[r.clone()], &want[r.clone()], rel, &label(name));
    }
}

/// Each parameter's gradient within relative L2 `max` of the f32 reference: what bf16
/// activations allow.
pub fn assert_rel_l2_each(
    got: &[f32],
    want: &[f32],
    ranges: &[(String, std::ops::Range<usize>)],
    max: f64,
) {
    for (name, r) in ranges {
        let e = stoker_testkit::rel_l2(&got[r.clone()], &want[r.clone()]);
        assert!(
            e < max,
            "gradient of {name}: relative L2 error {e} with bf16 activations"
        );
    }
}

/// What a step did over micro-batches `data` on the host build: each micro-batch's summed
/// loss (the gradients accumulating from zero, scaled by 0.5), the gradients after the
/// last, and an evaluation of the second micro-batch.
pub type StepRun = (Vec<f64>, Vec<f32>, (f64, usize, usize));

/// Runs `step` (its parameters loaded from `params`) over `data` (two micro-batches at
/// least): the [`StepRun`] two steps of one model are compared by.
pub fn run_micro_batches<S: stoker_gpu::parallel::Trainable<stoker_gpu::Host>>(
    step: &S,
    params: &[f32],
    data: &[(Vec<i64>, Vec<i64>)],
) -> StepRun {
    use stoker_gpu::sample::batch;
    use stoker_gpu::step::buffers::BlockHooks;
    use stoker_gpu::Host;
    step.load(&Host, params).unwrap();
    step.zero_grads(&Host).unwrap();
    let losses = data
        .iter()
        .map(|m| {
            step.queue_micro_batch(&Host, (batch(m), 0.5), false, BlockHooks::default())
                .unwrap();
            step.loss_sum(&Host).unwrap()
        })
        .collect();
    let eval = step
        .evaluate(&Host, batch(&data[1]), BlockHooks::default())
        .unwrap();
    (losses, step.buffers().grads(&Host).unwrap(), eval)
}
