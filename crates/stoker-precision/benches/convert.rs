//! Bulk conversion throughput, side by side with memcpy and candle's `to_dtype` in the same run.
//!
//! Run: `cargo bench -p stoker-precision --bench convert` (env `N` = elements, default 16M;
//! `REPS` = repetitions, best one reported, default 11).
//!
//! Baselines: `memcpy src` copies the f32 source (4 bytes/element: what a conversion reads);
//! `memcpy dst` copies as many bytes as the conversion writes (2 or 1 per element). Ratios are
//! elements/s over the memcpy-src elements/s (the better of its two measurements, first and
//! last, so a busy machine shows up as drift rather than as flattering ratios). All buffers are allocated and touched before
//! timing, except candle's `to_dtype`, which allocates its output on every call (as a training
//! step would); "ours, fresh Vec" measures ours under that same condition.

use std::hint::black_box;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use stoker_precision::convert;
use stoker_precision::fp8::{Fp8Format, Saturation};

fn best<F: FnMut()>(reps: usize, mut f: F) -> f64 {
    f(); // warm up
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
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
    let threads = rayon::current_num_threads();

    let mut rows: Vec<(String, f64)> = Vec::new();
    let mut run = |name: &str, secs: f64| rows.push((name.to_string(), n as f64 / secs / 1e9));

    run(
        "memcpy src (f32, 4 B/elem)",
        best(reps, || f32_dst.copy_from_slice(black_box(&src))),
    );
    run(
        "memcpy dst (2 B/elem)",
        best(reps, || u16_dst.copy_from_slice(black_box(&u16_src))),
    );
    run(
        "memcpy dst (1 B/elem)",
        best(reps, || u8_dst.copy_from_slice(black_box(&u8_src))),
    );

    run(
        "f32->bf16 ours",
        best(reps, || {
            convert::f32_to_bf16(black_box(&src), &mut bf_dst).unwrap()
        }),
    );
    run(
        &format!("f32->bf16 ours par ({threads} thr)"),
        best(reps, || {
            convert::par_f32_to_bf16(black_box(&src), &mut bf_dst).unwrap()
        }),
    );
    run(
        "f32->bf16 ours, fresh Vec",
        best(reps, || {
            let mut v = vec![bf16::ZERO; n];
            convert::f32_to_bf16(black_box(&src), &mut v).unwrap();
            black_box(v);
        }),
    );
    run(
        "f32->bf16 half scalar loop",
        best(reps, || {
            for (d, &x) in bf_dst.iter_mut().zip(black_box(&src)) {
                *d = bf16::from_f32(x);
            }
        }),
    );
    run(
        "f32->f16 ours (half slice, F16C)",
        best(reps, || {
            convert::f32_to_f16(black_box(&src), &mut h_dst).unwrap()
        }),
    );
    run(
        &format!("f32->f16 ours par ({threads} thr)"),
        best(reps, || {
            convert::par_f32_to_f16(black_box(&src), &mut h_dst).unwrap()
        }),
    );
    for (fmt, name) in [(Fp8Format::E4M3, "e4m3"), (Fp8Format::E5M2, "e5m2")] {
        run(
            &format!("f32->{name} sat ours"),
            best(reps, || {
                convert::f32_to_fp8(black_box(&src), &mut u8_dst, fmt, Saturation::Saturate)
                    .unwrap()
            }),
        );
    }
    run(
        &format!("f32->e4m3 sat ours par ({threads} thr)"),
        best(reps, || {
            convert::par_f32_to_fp8(
                black_box(&src),
                &mut u8_dst,
                Fp8Format::E4M3,
                Saturation::Saturate,
            )
            .unwrap()
        }),
    );
    run(
        "f32->e4m3 float8 crate loop",
        best(reps, || {
            for (d, &x) in u8_dst.iter_mut().zip(black_box(&src)) {
                *d = float8::F8E4M3::from_f32(x).to_bits();
            }
        }),
    );
    run(
        "bf16->f32 ours",
        best(reps, || {
            convert::bf16_to_f32(black_box(&bf_dst), &mut f32_dst).unwrap()
        }),
    );
    run(
        "e4m3->f32 ours",
        best(reps, || {
            convert::fp8_to_f32(black_box(&u8_dst), &mut f32_dst, Fp8Format::E4M3).unwrap()
        }),
    );

    let t = Tensor::from_vec(src.clone(), n, &Device::Cpu).unwrap();
    run(
        "candle to_dtype f32->bf16",
        best(reps, || {
            black_box(t.to_dtype(DType::BF16).unwrap());
        }),
    );
    run(
        "candle to_dtype f32->f16",
        best(reps, || {
            black_box(t.to_dtype(DType::F16).unwrap());
        }),
    );
    run(
        "candle to_dtype f32->f8e4m3",
        best(reps.min(3), || {
            black_box(t.to_dtype(DType::F8E4M3).unwrap());
        }),
    );

    run(
        "memcpy src again (drift check)",
        best(reps, || f32_dst.copy_from_slice(black_box(&src))),
    );

    let memcpy = rows[0].1.max(rows[rows.len() - 1].1);
    println!("n = {n} elements, best of {reps}, rayon threads {threads}");
    println!(
        "{:<40} {:>10} {:>12}",
        "conversion", "Gelem/s", "x memcpy src"
    );
    for (name, g) in &rows {
        println!("{name:<40} {g:>10.3} {:>12.2}", g / memcpy);
    }
}
