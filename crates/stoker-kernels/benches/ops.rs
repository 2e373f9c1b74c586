//! Fused vs composed forward and forward+backward times, ratios from the same run.
//!
//! Run: `cargo bench -p stoker-kernels --bench ops` (env `ROUNDS`, default 7: each op
//! is timed fused, composed, fused, composed, ... and the median of each reported, so a
//! shared machine's drift hits both alike). Shapes are the reference GPT's (826,368
//! parameters, batch 16, context 128, width 128, 4 heads of 32, MLP width 512, vocab 65;
//! attention and embedding differentiate k, v and the table too).
//! Backward is seeded with ones (`Tensor::backward` on a non-scalar), the same for both.
//! PyTorch figures for the same shapes: `scripts/bench/ops_torch.py`.

use std::hint::black_box;
use std::time::Instant;

use candle_core::{Device, Result, Tensor, Var};
use candle_nn::Optimizer;
use stoker_kernels::optim::adamw_update_scalar;
use stoker_kernels::{adamw_update, reference, AdamWStep};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median milliseconds of each closure, timed interleaved over `rounds`.
fn interleaved(rounds: usize, fs: &mut [&mut dyn FnMut()]) -> Vec<f64> {
    let mut times = vec![Vec::new(); fs.len()];
    for f in fs.iter_mut() {
        f(); // warm-up: first touch of pages, rayon pool
    }
    for _ in 0..rounds {
        for (f, t) in fs.iter_mut().zip(&mut times) {
            let start = Instant::now();
            f();
            t.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.into_iter().map(median).collect()
}

fn randn(shape: &[usize]) -> Var {
    Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()).unwrap()
}

/// Times `fused` and `composed` forward only and forward+backward, prints one row each.
fn op(
    rounds: usize,
    name: &str,
    x: &Var,
    fused: &dyn Fn(&Tensor) -> Result<Tensor>,
    composed: &dyn Fn(&Tensor) -> Result<Tensor>,
) {
    let run = |f: &dyn Fn(&Tensor) -> Result<Tensor>, bwd: bool| {
        let y = f(x.as_tensor()).unwrap();
        if bwd {
            black_box(y.backward().unwrap());
        }
        black_box(y);
    };
    let t = interleaved(
        rounds,
        &mut [
            &mut || run(fused, false),
            &mut || run(composed, false),
            &mut || run(fused, true),
            &mut || run(composed, true),
        ],
    );
    println!(
        "{name:<34} fwd {:>8.2} / {:>8.2} ms ({:>5.1}x)   fwd+bwd {:>8.2} / {:>8.2} ms ({:>5.1}x)",
        t[0],
        t[1],
        t[1] / t[0],
        t[2],
        t[3],
        t[3] / t[2]
    );
}

fn main() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    println!(
        "stoker-kernels ops: fused / composed (speedup), median of {rounds}, {} rayon threads",
        rayon::current_num_threads()
    );

    let x = randn(&[16, 128, 512]);
    op(
        rounds,
        "gelu [16,128,512]",
        &x,
        &|x| stoker_kernels::gelu(x),
        &|x| reference::gelu(x),
    );

    let x = randn(&[16, 4, 128, 128]);
    op(
        rounds,
        "softmax [16,4,128,128]",
        &x,
        &|x| stoker_kernels::softmax_last_dim(x),
        &|x| reference::softmax_last_dim(x),
    );

    let x = randn(&[16, 128, 128]);
    let (w, b) = (randn(&[128]), randn(&[128]));
    op(
        rounds,
        "layer norm [16,128,128]",
        &x,
        &|x| stoker_kernels::layer_norm(x, w.as_tensor(), b.as_tensor(), 1e-5),
        &|x| reference::layer_norm(x, w.as_tensor(), b.as_tensor(), 1e-5),
    );

    let x = randn(&[2048, 65]);
    let t: Vec<i64> = (0..2048).map(|i| (i * 7 % 65) as i64).collect();
    let t = Tensor::new(t.as_slice(), &Device::Cpu).unwrap();
    op(
        rounds,
        "cross-entropy [2048,65]",
        &x,
        &|x| stoker_kernels::cross_entropy_sum(x, &t, -100),
        &|x| reference::cross_entropy_sum(x, &t, -100),
    );

    let (k, v) = (randn(&[16, 4, 128, 32]), randn(&[16, 4, 128, 32]));
    op(
        rounds,
        "causal attention [16,4,128,32]",
        &randn(&[16, 4, 128, 32]),
        &|q| stoker_kernels::causal_attention(q, k.as_tensor(), v.as_tensor()),
        &|q| reference::causal_attention(q, k.as_tensor(), v.as_tensor()),
    );

    // The GPT's own layout: straight from the QKV projection (f32: per-head GEMMs).
    op(
        rounds,
        "causal attention qkv [16,128,3x128]",
        &randn(&[16, 128, 384]),
        &|qkv| stoker_kernels::causal_attention_qkv(qkv, 4),
        &|qkv| reference::causal_attention_qkv(qkv, 4),
    );

    let ids: Vec<u32> = (0..16 * 128).map(|i| (i * 31 % 65) as u32).collect();
    let ids = Tensor::from_vec(ids, (16, 128), &Device::Cpu).unwrap();
    op(
        rounds,
        "embedding [65,128] x [16,128]",
        &randn(&[65, 128]),
        &|t| stoker_kernels::embedding(t, &ids),
        &|t| reference::embedding(t, &ids),
    );

    adamw(rounds, 826_368);
}

/// AdamW over `n` parameters: fused (with and without the bf16 copy-out), the scalar
/// loop, and candle-nn's AdamW (composed tensor ops).
fn adamw(rounds: usize, n: usize) {
    let p0 = Tensor::randn(0f32, 1.0, n, &Device::Cpu).unwrap();
    let g = Tensor::randn(0f32, 1e-2, n, &Device::Cpu).unwrap();
    let gv = g.to_vec1::<f32>().unwrap();
    let var = Var::from_tensor(&p0).unwrap();
    let grads = (var.as_tensor() * &g)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let params = candle_nn::ParamsAdamW {
        lr: 1e-3,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut candle_opt = candle_nn::AdamW::new(vec![var], params).unwrap();
    let p = p0.to_vec1::<f32>().unwrap();
    // (params, exp_avg, exp_avg_sq, step) per contender, so none disturbs another.
    let fresh = || (p.clone(), vec![0.0f32; n], vec![0.0f32; n], 0u64);
    let (mut a, mut b, mut c) = (fresh(), fresh(), fresh());
    let mut out = vec![half::bf16::ZERO; n];
    let s = |t: u64| AdamWStep::new(1e-3, 0.9, 0.999, 1e-8, 0.1, t);
    let times = interleaved(
        rounds,
        &mut [
            &mut || {
                a.3 += 1;
                adamw_update(&s(a.3), true, &mut a.0, &gv, &mut a.1, &mut a.2, None).unwrap()
            },
            &mut || {
                b.3 += 1;
                adamw_update(
                    &s(b.3),
                    true,
                    &mut b.0,
                    &gv,
                    &mut b.1,
                    &mut b.2,
                    Some(&mut out),
                )
                .unwrap()
            },
            &mut || {
                c.3 += 1;
                adamw_update_scalar(&s(c.3), true, &mut c.0, &gv, &mut c.1, &mut c.2)
            },
            &mut || candle_opt.step(&grads).unwrap(),
        ],
    );
    println!(
        "adamw {n} params                    fused {:.2} ms, fused+bf16 copy {:.2} ms, scalar loop {:.2} ms ({:.1}x), candle-nn AdamW {:.2} ms ({:.1}x)",
        times[0],
        times[1],
        times[2],
        times[2] / times[0],
        times[3],
        times[3] / times[0]
    );
}
