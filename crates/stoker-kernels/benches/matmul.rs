//! bf16 GEMM throughput: stoker's AVX512-BF16 kernel vs candle's f32 and bf16 matmuls,
//! ratios from the same run (interleaved rounds, medians).
//!
//! Run: `cargo bench -p stoker-kernels --bench matmul` (env `ROUNDS`, default 7;
//! `SIZES`, default `1024x1024x1024,2048x128x384,2048x512x128`, each `MxKxN`).

use std::hint::black_box;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use stoker_kernels::matmul::{gemm_bf16_with, Bf16Kernel, MatRef};

/// A named closure to time.
type Timed<'a> = (&'a str, Box<dyn FnMut() + 'a>);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let sizes = std::env::var("SIZES")
        .unwrap_or_else(|_| "1024x1024x1024,2048x128x384,2048x512x128,128x2048x512".into());
    println!(
        "kernels: {:?}, threads: {}, rounds: {rounds}",
        Bf16Kernel::available(),
        rayon::current_num_threads()
    );
    for size in sizes.split(',') {
        let d: Vec<usize> = size.split('x').map(|v| v.parse().expect("MxKxN")).collect();
        let (m, k, n) = (d[0], d[1], d[2]);
        let a32 = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
        let b32 = Tensor::randn(0f32, 1.0, (k, n), &Device::Cpu).unwrap();
        let a16 = a32.to_dtype(DType::BF16).unwrap();
        let b16 = b32.to_dtype(DType::BF16).unwrap();
        let av = a16.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
        let bv = b16.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
        let (am, bm) = (MatRef::new(&av, m, k), MatRef::new(&bv, k, n));
        let mut fs: Vec<Timed> = vec![
            (
                "candle f32",
                Box::new(|| {
                    black_box(a32.matmul(&b32).unwrap());
                }),
            ),
            (
                "candle bf16",
                Box::new(|| {
                    black_box(a16.matmul(&b16).unwrap());
                }),
            ),
            (
                "stoker bf16 op",
                Box::new(|| {
                    black_box(stoker_kernels::matmul_bf16(&a16, &b16).unwrap());
                }),
            ),
        ];
        for k in Bf16Kernel::available() {
            let name: &str = Box::leak(format!("stoker {k:?}").into_boxed_str());
            fs.push((
                name,
                Box::new(move || {
                    black_box(gemm_bf16_with(k, &am, &bm).unwrap());
                }),
            ));
        }
        let mut times = vec![Vec::new(); fs.len()];
        for (_, f) in fs.iter_mut() {
            f();
        }
        for _ in 0..rounds {
            for ((_, f), t) in fs.iter_mut().zip(&mut times) {
                let s = Instant::now();
                f();
                t.push(s.elapsed().as_secs_f64());
            }
        }
        let med: Vec<f64> = times.into_iter().map(median).collect();
        let flop = 2.0 * (m * k * n) as f64;
        println!("{m}x{k}x{n}:");
        for ((name, _), t) in fs.iter().zip(&med) {
            println!(
                "  {name:<16} {:>9.3} ms {:>8.1} GFLOP/s  {:>5.2}x candle f32",
                t * 1e3,
                flop / t / 1e9,
                med[0] / t
            );
        }
    }
}
