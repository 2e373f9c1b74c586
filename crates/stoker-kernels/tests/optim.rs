//! Fused AdamW and SGD against their scalar twins (stoker-train's loops): bit-identical.
mod common;

use common::values;
use half::bf16;
use stoker_kernels::optim::{adamw_update_scalar, sgd_update_scalar};
use stoker_kernels::{adamw_update, sgd_update, AdamWStep, SgdStep};

/// One element, odd, not a vector multiple, and more than two rayon chunks plus a tail.
const LENS: &[usize] = &[1, 7, 4099, 2 * 16 * 1024 + 3];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Five AdamW steps, with and without decay: params and both moments are bit-identical
/// to the scalar loop (tolerance 0), and the bf16 copy is the rounded updated params.
#[test]
fn adamw_fused_is_bit_identical_to_scalar() {
    for (i, &n) in LENS.iter().enumerate() {
        for decay in [true, false] {
            let mut p = values(n, i as u64, 1.0);
            let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
            let (mut p2, mut m2, mut v2) = (p.clone(), m.clone(), v.clone());
            let mut out = vec![bf16::ZERO; n];
            for t in 1..=5u64 {
                let g = values(n, 1000 * t + i as u64, 0.1);
                let s = AdamWStep::new(1e-2 / t as f32, 0.9, 0.999, 1e-8, 0.1, t);
                adamw_update(&s, decay, &mut p, &g, &mut m, &mut v, Some(&mut out)).unwrap();
                adamw_update_scalar(&s, decay, &mut p2, &g, &mut m2, &mut v2);
            }
            assert_eq!(bits(&p), bits(&p2), "n={n} decay={decay} params");
            assert_eq!(bits(&m), bits(&m2), "n={n} exp_avg");
            assert_eq!(bits(&v), bits(&v2), "n={n} exp_avg_sq");
            assert!(
                out.iter().zip(&p).all(|(o, &p)| *o == bf16::from_f32(p)),
                "n={n} bf16"
            );
        }
    }
}

/// One step by hand (torch.optim.AdamW's formula): p = 1, g = 0.5, lr = 0.1, wd = 0.01:
/// p = 0.999 - 0.1 * 0.5 / (0.5 + 1e-8), within 1e-6.
#[test]
fn adamw_first_step_by_hand() {
    let (mut p, mut m, mut v) = ([1.0f32], [0.0f32], [0.0f32]);
    let s = AdamWStep::new(0.1, 0.9, 0.999, 1e-8, 0.01, 1);
    adamw_update(&s, true, &mut p, &[0.5], &mut m, &mut v, None).unwrap();
    let want = 0.999 - 0.1 * 0.5 / (0.5 + 1e-8);
    assert!((p[0] as f64 - want).abs() <= 1e-6, "{}", p[0]);
}

/// Four SGD steps for momentum 0 / 0.9, Nesterov on/off, decay on/off: bit-identical to
/// the scalar loop, bf16 copy rounded from the updated params.
#[test]
fn sgd_fused_is_bit_identical_to_scalar() {
    for (i, &n) in LENS.iter().enumerate() {
        for (momentum, nesterov, decay) in [
            (0.0, false, true),
            (0.9, false, true),
            (0.9, true, false),
            (0.9, true, true),
        ] {
            let mut p = values(n, 50 + i as u64, 1.0);
            let mut buf = if momentum == 0.0 {
                Vec::new()
            } else {
                vec![0.0; n]
            };
            let (mut p2, mut buf2) = (p.clone(), vec![0.0; n]);
            let mut out = vec![bf16::ZERO; n];
            for t in 0..4u64 {
                let g = values(n, 2000 * t + i as u64, 0.1);
                let s = SgdStep {
                    lr: 0.05,
                    momentum,
                    weight_decay: 1e-3,
                    nesterov,
                    first: t == 0,
                };
                sgd_update(&s, decay, &mut p, &g, &mut buf, Some(&mut out)).unwrap();
                sgd_update_scalar(&s, decay, &mut p2, &g, &mut buf2);
            }
            let what = format!("n={n} momentum={momentum} nesterov={nesterov} decay={decay}");
            assert_eq!(bits(&p), bits(&p2), "{what}");
            if momentum != 0.0 {
                assert_eq!(bits(&buf), bits(&buf2), "{what} momentum");
            }
            assert!(
                out.iter().zip(&p).all(|(o, &p)| *o == bf16::from_f32(p)),
                "{what} bf16"
            );
        }
    }
}

/// Mismatched buffers are an error naming the op and the buffer, not a panic.
#[test]
fn optim_rejects_mismatched_lengths() {
    let s = AdamWStep::new(0.1, 0.9, 0.999, 1e-8, 0.0, 1);
    let e = adamw_update(
        &s,
        true,
        &mut [0.0; 3],
        &[0.0; 3],
        &mut [0.0; 2],
        &mut [0.0; 3],
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("adamw: exp_avg has 2"), "{e}");
    let s = SgdStep {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
        nesterov: false,
        first: true,
    };
    let e = sgd_update(&s, true, &mut [0.0; 3], &[0.0; 3], &mut [], None).unwrap_err();
    assert!(e.to_string().contains("sgd: momentum_buf has 0"), "{e}");
}
