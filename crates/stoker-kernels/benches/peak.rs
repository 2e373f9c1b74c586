//! Peak arithmetic throughput of one core with operands in registers: AVX-512 f32 FMA,
//! AVX512-BF16 `vdpbf16ps` and AMX `tdpbf16ps`, so the bf16 GEMM's design rests on a
//! measured ceiling (docs/benchmarks.md, "bf16 GEMM"). Ratios are to the f32 FMA peak
//! measured in the same run.
//!
//! Run: `cargo bench -p stoker-kernels --bench peak` (single-threaded; `ITERS`, default 20M).

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::time::Instant;

    #[target_feature(enable = "avx512f,fma")]
    unsafe fn fma(n: usize) -> f32 {
        let mut acc = [_mm512_setzero_ps(); 16];
        let (a, b) = (_mm512_set1_ps(1.0), _mm512_set1_ps(1e-9));
        for _ in 0..n {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(a, b, *v);
            }
        }
        acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn dpbf16(n: usize) -> f32 {
        let mut acc = [_mm512_setzero_ps(); 16];
        let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3f80_3f80));
        let b: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x0001_0001));
        for _ in 0..n {
            for v in acc.iter_mut() {
                *v = _mm512_dpbf16_ps(*v, a, b);
            }
        }
        acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }

    #[repr(C, align(64))]
    struct Config([u8; 64]);

    /// `n` rounds of four `tdpbf16ps` (16 x 16 x 32 each) on tiles already loaded.
    unsafe fn amx(n: usize) {
        let mut cfg = Config([0; 64]);
        cfg.0[0] = 1;
        for t in 0..8 {
            cfg.0[16 + 2 * t] = 64;
            cfg.0[48 + t] = 16;
        }
        let data = [0u16; 16 * 32];
        asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr());
        asm!(
            "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
            "tileloadd tmm4, [{p} + {s}*1]", "tileloadd tmm5, [{p} + {s}*1]",
            "tileloadd tmm6, [{p} + {s}*1]", "tileloadd tmm7, [{p} + {s}*1]",
            p = in(reg) data.as_ptr(), s = in(reg) 64usize,
        );
        for _ in 0..n {
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
            );
        }
        asm!("tilerelease");
    }

    fn gflops(flop: f64, f: impl FnOnce()) -> f64 {
        let t = Instant::now();
        f();
        flop / t.elapsed().as_secs_f64() / 1e9
    }

    pub fn main() {
        let n: usize = std::env::var("ITERS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(20_000_000);
        if !std::arch::is_x86_feature_detected!("avx512f") {
            println!("no AVX-512F: nothing to measure");
            return;
        }
        // SAFETY: AVX-512F (and FMA, present on every AVX-512 CPU) detected above.
        let f32_peak = gflops((n * 16 * 32) as f64, || {
            std::hint::black_box(unsafe { fma(n) });
        });
        println!("AVX-512 f32 FMA       {f32_peak:8.1} GFLOP/s per core  1.00x");
        if std::arch::is_x86_feature_detected!("avx512bf16") {
            // SAFETY: AVX512-BF16 detected.
            let g = gflops((n * 16 * 64) as f64, || {
                std::hint::black_box(unsafe { dpbf16(n) });
            });
            println!(
                "AVX512-BF16 vdpbf16ps {g:8.1} GFLOP/s per core  {:.2}x",
                g / f32_peak
            );
        }
        if stoker_kernels::Bf16Kernel::available().contains(&stoker_kernels::Bf16Kernel::Amx) {
            let m = n / 10;
            // SAFETY: AMX detected and permitted by the OS (Bf16Kernel::available).
            let g = gflops((m * 4 * 16 * 16 * 32 * 2) as f64, || unsafe { amx(m) });
            println!(
                "AMX tdpbf16ps         {g:8.1} GFLOP/s per core  {:.2}x",
                g / f32_peak
            );
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::main();
}
