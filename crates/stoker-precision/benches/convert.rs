//! Bulk conversion throughput, side by side with memcpy and candle's `to_dtype` in the same run.
//!
//! Run: `cargo bench -p stoker-precision --bench convert` (env `N` = elements, default 16M;
//! `REPS` = repetitions, best one reported, default 11).
//!
//! Baseline: `memcpy src` copies the f32 source (4 bytes/element: what every conversion here
//! reads), `memcpy dst` as many bytes as the conversion writes (2 or 1 per element). On a
//! shared machine the memory bandwidth drifts, so every conversion is timed interleaved with
//! its own memcpy-src baseline (conversion, memcpy, conversion, memcpy, ...): the ratio
//! compares the best of each from the same window. All buffers are allocated and touched before
//! timing, except candle's `to_dtype`, which allocates its output on every call (as a training
//! step would); "ours, fresh Vec" measures ours under that same condition.

use std::hint::black_box;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use stoker_precision::convert;
use stoker_precision::fp8::{Fp8Format, Saturation};

fn time<F: FnMut()>(f: &mut F) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

struct Bench {
    n: usize,
    reps: usize,
    src: Vec<f32>,
    copy: Vec<f32>,
    rows: Vec<(String, f64, f64)>,
}

impl Bench {
    /// Best time of `op` and of memcpy-src, interleaved; records Gelem/s of both.
    fn run(&mut self, name: &str, mut op: impl FnMut(&[f32])) {
        let (src, copy) = (&self.src, &mut self.copy);
        let mut op = || op(black_box(src));
        let mut memcpy = || copy.copy_from_slice(black_box(src));
        op();
        memcpy();
        let (mut best_op, mut best_cp) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..self.reps {
            best_op = best_op.min(time(&mut op));
            best_cp = best_cp.min(time(&mut memcpy));
        }
        let g = |s: f64| self.n as f64 / s / 1e9;
        self.rows.push((name.to_string(), g(best_op), g(best_cp)));
    }
}

fn main() {
    let n: usize = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16 << 20);
    let reps: usize = std::env::var("REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(11);
    let mut s = 0x9E37_79B9u64;
    let src: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 200.0
        })
        .collect();
    let mut f32_dst = vec![0f32; n];
    let mut u16_dst = vec![0u16; n];
    let mut u8_dst = vec![0u8; n];
    let mut bf_dst = vec![bf16::ZERO; n];
    let mut h_dst = vec![f16::ZERO; n];
    let u16_src = vec![1u16; n];
    let u8_src = vec![1u8; n];
    let bf_src = vec![bf16::ONE; n];
    let threads = rayon::current_num_threads();
    let t = Tensor::from_vec(src.clone(), n, &Device::Cpu).unwrap();
    let mut b = Bench {
        n,
        reps,
        src,
        copy: vec![0f32; n],
        rows: Vec::new(),
    };

    b.run("memcpy src (f32, 4 B/elem)", |s| f32_dst.copy_from_slice(s));
    b.run("memcpy dst (2 B/elem)", |_| {
        u16_dst.copy_from_slice(black_box(&u16_src))
    });
    b.run("memcpy dst (1 B/elem)", |_| {
        u8_dst.copy_from_slice(black_box(&u8_src))
    });
    b.run("f32->bf16 ours", |s| {
        convert::f32_to_bf16(s, &mut bf_dst).unwrap()
    });
    b.run(&format!("f32->bf16 ours par ({threads} thr)"), |s| {
        convert::par_f32_to_bf16(s, &mut bf_dst).unwrap()
    });
    b.run("f32->bf16 ours, fresh Vec", |s| {
        let mut v = vec![bf16::ZERO; s.len()];
        convert::f32_to_bf16(s, &mut v).unwrap();
        black_box(v);
    });
    b.run("f32->bf16 half scalar loop", |s| {
        for (d, &x) in bf_dst.iter_mut().zip(s) {
            *d = bf16::from_f32(x);
        }
    });
    b.run("candle to_dtype f32->bf16", |_| {
        black_box(t.to_dtype(DType::BF16).unwrap());
    });
    b.run("f32->f16 ours (half slice, F16C)", |s| {
        convert::f32_to_f16(s, &mut h_dst).unwrap()
    });
    b.run(&format!("f32->f16 ours par ({threads} thr)"), |s| {
        convert::par_f32_to_f16(s, &mut h_dst).unwrap()
    });
    b.run("candle to_dtype f32->f16", |_| {
        black_box(t.to_dtype(DType::F16).unwrap());
    });
    for (fmt, name) in [(Fp8Format::E4M3, "e4m3"), (Fp8Format::E5M2, "e5m2")] {
        b.run(&format!("f32->{name} saturating ours"), |s| {
            convert::f32_to_fp8(s, &mut u8_dst, fmt, Saturation::Saturate).unwrap()
        });
    }
    b.run(
        &format!("f32->e4m3 saturating ours par ({threads} thr)"),
        |s| convert::par_f32_to_fp8(s, &mut u8_dst, Fp8Format::E4M3, Saturation::Saturate).unwrap(),
    );
    b.run("f32->e4m3 float8 crate loop", |s| {
        for (d, &x) in u8_dst.iter_mut().zip(s) {
            *d = float8::F8E4M3::from_f32(x).to_bits();
        }
    });
    b.run("candle to_dtype f32->f8e4m3", |_| {
        black_box(t.to_dtype(DType::F8E4M3).unwrap());
    });
    b.run("bf16->f32 ours", |_| {
        convert::bf16_to_f32(black_box(&bf_src), &mut f32_dst).unwrap()
    });
    b.run("e4m3->f32 ours", |_| {
        convert::fp8_to_f32(black_box(&u8_src), &mut f32_dst, Fp8Format::E4M3).unwrap()
    });

    println!(
        "n = {n} elements, best of {reps} (interleaved with memcpy src), rayon threads {threads}"
    );
    println!(
        "{:<42} {:>9} {:>13} {:>8}",
        "conversion", "Gelem/s", "memcpy Gel/s", "ratio"
    );
    for (name, g, m) in &b.rows {
        println!("{name:<42} {g:>9.3} {m:>13.3} {:>8.2}", g / m);
    }
}
