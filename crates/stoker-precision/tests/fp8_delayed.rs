//! FP8 delayed scaling: scale sequences against the recipe's formula, quantize/dequantize
//! error within the format's spacing.

use stoker_precision::fp8::Fp8Format;
use stoker_precision::{
    AmaxComputeAlgo, DelayedScaler, DelayedScalingConfig, Fp8Tensor, RecipeFormat, TensorRole,
};

/// A recorded amax sequence: magnitudes over 40 binades, with zeros, an inf and a NaN.
fn amax_sequence(n: usize) -> Vec<f32> {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            match i {
                37 | 38 => 0.0,
                111 => f32::INFINITY,
                222 => f32::NAN,
                _ => (((s >> 40) as f32 / (1u64 << 24) as f32) * 40.0 - 20.0).exp2(),
            }
        })
        .collect()
}

/// The recipe written out directly: window = the last `len` recorded amaxes.
fn expected_scales(
    amaxes: &[f32],
    len: usize,
    algo: AmaxComputeAlgo,
    fmt: Fp8Format,
    margin: f32,
) -> Vec<f32> {
    let scaled_max = fmt.max() * (-margin).exp2();
    let mut scale = 1.0f32;
    let mut out = Vec::new();
    for t in 0..amaxes.len() {
        let amax = match algo {
            AmaxComputeAlgo::MostRecent => amaxes[t],
            AmaxComputeAlgo::Max => amaxes[t.saturating_sub(len - 1)..=t]
                .iter()
                .filter(|a| !a.is_nan())
                .fold(0.0f32, |m, &a| m.max(a)),
        };
        if amax.is_finite() && amax > 0.0 {
            scale = scaled_max / amax;
        }
        if scale.is_infinite() {
            scale = f32::MAX;
        }
        out.push(scale);
    }
    out
}

#[test]
fn scale_sequence_follows_the_recipe() {
    let amaxes = amax_sequence(3000);
    for len in [1, 16, 1024] {
        for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
            for (format, role, fmt) in [
                (RecipeFormat::Hybrid, TensorRole::Forward, Fp8Format::E4M3),
                (RecipeFormat::Hybrid, TensorRole::Backward, Fp8Format::E5M2),
                (RecipeFormat::E5M2, TensorRole::Forward, Fp8Format::E5M2),
            ] {
                for margin in [0.0, 2.0] {
                    let cfg = DelayedScalingConfig {
                        margin,
                        format,
                        amax_history_len: len,
                        amax_compute_algo: algo,
                    };
                    let mut s = DelayedScaler::new(&cfg, role).unwrap();
                    assert_eq!(s.format(), fmt);
                    let want = expected_scales(&amaxes, len, algo, fmt, margin);
                    for (t, &a) in amaxes.iter().enumerate() {
                        s.record_amax(a);
                        let got = s.update();
                        assert_eq!(
                            got.to_bits(),
                            want[t].to_bits(),
                            "len {len} {algo:?} {fmt:?} margin {margin} step {t}"
                        );
                        assert_eq!(s.scale_inv(), 1.0 / got);
                    }
                }
            }
        }
    }
}

#[test]
fn scale_landmarks() {
    let cfg = DelayedScalingConfig::default();
    assert_eq!(
        (cfg.amax_history_len, cfg.margin, cfg.format),
        (1024, 0.0, RecipeFormat::Hybrid)
    );
    let mut s = DelayedScaler::new(&cfg, TensorRole::Forward).unwrap();
    assert_eq!(s.scale(), 1.0);
    s.record_amax(2.0);
    assert_eq!(s.update(), 224.0); // 448 / 2
    s.record_amax(0.5); // the window still holds 2.0
    assert_eq!(s.update(), 224.0);
    let mut m = DelayedScaler::new(
        &DelayedScalingConfig {
            margin: 1.0,
            ..cfg.clone()
        },
        TensorRole::Backward,
    )
    .unwrap();
    m.record_amax(57344.0);
    assert_eq!(m.update(), 0.5); // E5M2: 57344 / 57344 / 2^1
                                 // An amax too small for a finite scale gives f32::MAX, as TE.
    let mut tiny = DelayedScaler::new(&cfg, TensorRole::Backward).unwrap();
    tiny.record_amax(1e-45);
    assert_eq!(tiny.update(), f32::MAX);
    // Zero, inf or NaN amax: the previous scale is kept.
    for a in [0.0, f32::INFINITY] {
        let mut k = DelayedScaler::new(
            &DelayedScalingConfig {
                amax_history_len: 1,
                ..cfg.clone()
            },
            TensorRole::Forward,
        )
        .unwrap();
        k.record_amax(a);
        assert_eq!(k.update(), 1.0);
    }
    // The max drops out of the window after `len` steps.
    let mut w = DelayedScaler::new(
        &DelayedScalingConfig {
            amax_history_len: 3,
            ..cfg.clone()
        },
        TensorRole::Forward,
    )
    .unwrap();
    for (a, want) in [(4.0, 112.0), (1.0, 112.0), (1.0, 112.0), (1.0, 448.0)] {
        w.record_amax(a);
        assert_eq!(w.update(), want);
    }
    assert!(DelayedScaler::new(
        &DelayedScalingConfig {
            amax_history_len: 0,
            ..cfg
        },
        TensorRole::Forward
    )
    .is_err());
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            let sign = if s & 1 == 0 { 1.0 } else { -1.0 };
            sign * (u * 24.0 - 16.0).exp2()
        })
        .collect()
}

#[test]
fn quantize_dequantize_error_within_half_spacing() {
    for fmt in [Fp8Format::E4M3, Fp8Format::E5M2] {
        let x = values(200_000, 7);
        // Every input is checked: a NaN must fail here, not vanish from the amax.
        let mut amax = 0f32;
        for v in &x {
            assert!(v.is_finite(), "input {v}");
            if v.abs() > amax {
                amax = v.abs();
            }
        }
        assert!(amax.is_finite() && amax > 0.0, "amax {amax}");
        let scale = fmt.max() / amax;
        let q = Fp8Tensor::quantize(&x, scale, fmt).unwrap();
        assert_eq!((q.scale, q.scale_inv, q.format), (scale, 1.0 / scale, fmt));
        let back = q.dequantize();
        for (a, b) in x.iter().zip(&back) {
            let scaled = a * scale;
            // Half a spacing of the FP8 grid at the scaled value, back in x's units, plus the
            // f32 rounding of the two multiplications.
            let bound = fmt.spacing(scaled) / 2.0 / scale + a.abs() * 2.0 * f32::EPSILON;
            assert!(
                (a - b).abs() <= bound,
                "{fmt:?}: {a:e} -> {b:e}, bound {bound:e}"
            );
        }
    }
}

#[test]
fn delayed_quantize_uses_previous_scale_and_records_amax() {
    let cfg = DelayedScalingConfig {
        amax_history_len: 4,
        ..Default::default()
    };
    let mut s = DelayedScaler::new(&cfg, TensorRole::Forward).unwrap();
    let x = [3.0f32, -7.0, 0.25];
    let q1 = s.quantize(&x).unwrap();
    assert_eq!(q1.scale, 1.0); // first step: initial scale
    assert_eq!(s.update(), 64.0); // 448 / 7
    let q2 = s.quantize(&x).unwrap();
    assert_eq!(q2.scale, 64.0);
    assert_eq!(q2.dequantize(), vec![3.0, -7.0, 0.25]);
    // A value beyond the delayed scale's range saturates at max / scale.
    let q3 = s.quantize(&[100.0]).unwrap();
    assert_eq!(q3.dequantize(), vec![7.0]);
    assert_eq!(s.history(), vec![0.0, 0.0, 7.0, 100.0]);
}

/// A scaler rebuilt from another's scale and history (`with_state`: what a checkpoint of
/// the GPU step's scalers holds) goes on exactly as the original does; a history of the
/// wrong length or a scale that is not finite and positive is refused.
#[test]
fn a_scaler_rebuilt_from_its_state_goes_on_as_the_original() {
    for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
        let cfg = DelayedScalingConfig {
            amax_history_len: 5,
            amax_compute_algo: algo,
            ..Default::default()
        };
        let mut original = DelayedScaler::new(&cfg, TensorRole::Backward).unwrap();
        let amaxes = amax_sequence(40);
        for &a in &amaxes[..7] {
            original.record_amax(a);
            original.update();
        }
        original.record_amax(3.25);
        let mut rebuilt = DelayedScaler::with_state(
            &cfg,
            TensorRole::Backward,
            original.scale(),
            &original.history(),
        )
        .unwrap();
        for (k, &a) in amaxes[7..].iter().enumerate() {
            let what = format!("{algo:?}, step {k} after the rebuild");
            assert_eq!(rebuilt.history(), original.history(), "{what}: history");
            assert_eq!(
                rebuilt.scale().to_bits(),
                original.scale().to_bits(),
                "{what}: scale"
            );
            assert_eq!(
                rebuilt.scale_inv().to_bits(),
                original.scale_inv().to_bits(),
                "{what}"
            );
            original.update();
            rebuilt.update();
            original.record_amax(a);
            rebuilt.record_amax(a);
        }
        assert!(DelayedScaler::with_state(&cfg, TensorRole::Forward, 1.0, &[0.0; 4]).is_err());
        for bad in [0.0, -1.0, f32::INFINITY, f32::NAN] {
            assert!(DelayedScaler::with_state(&cfg, TensorRole::Forward, bad, &[0.0; 5]).is_err());
        }
    }
}
