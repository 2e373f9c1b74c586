//! The host build of the optimizer and the step's scalars: AdamW is stoker-kernels'
//! scalar AdamW bit for bit (with its bf16 copy-out), the sums are f64's within f32
//! rounding, whatever the number of partial sums.

mod common;

use common::*;
use stoker_gpu::host;
use stoker_kernels::optim::adamw_update_scalar;
use stoker_kernels::AdamWStep;
use stoker_testkit::{assert_bits_eq, assert_close_scalar};

#[test]
fn adamw_is_the_cpu_update_bit_for_bit() {
    let n = 5003;
    let (p0, g) = (uniform(n, 41, 1.0), uniform(n, 42, 0.1));
    let (m0, v0) = (
        uniform(n, 43, 0.01),
        uniform(n, 44, 0.001)
            .iter()
            .map(|x| x.abs())
            .collect::<Vec<_>>(),
    );
    for (t, decay) in [(1u64, true), (7, false), (1000, true)] {
        let s = AdamWStep::new(3e-4, 0.9, 0.95, 1e-8, 0.1, t);
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        adamw_update_scalar(&s, decay, &mut p, &g, &mut m, &mut v);
        let (mut hp, mut hm, mut hv) = (p0.clone(), m0.clone(), v0.clone());
        let mut copy = vec![half::bf16::ZERO; n];
        host::adamw(
            &mut hp,
            &g,
            &mut hm,
            &mut hv,
            Some(&mut copy),
            &s,
            decay,
            1.0,
        )
        .unwrap();
        assert_bits_eq(&hp, &p, &format!("adamw weights, step {t}"));
        assert_bits_eq(&hm, &m, "adamw first moment");
        assert_bits_eq(&hv, &v, "adamw second moment");
        assert_bits_eq(
            &from_bf16(&copy),
            &from_bf16(&to_bf16(&p)),
            "adamw bf16 copy",
        );
    }
    // A gradient scale (unscaling, clipping) is the update of the scaled gradient.
    let s = AdamWStep::new(1e-3, 0.9, 0.999, 1e-8, 0.0, 3);
    let scaled: Vec<f32> = g.iter().map(|x| x * 0.25).collect();
    let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
    adamw_update_scalar(&s, false, &mut p, &scaled, &mut m, &mut v);
    let (mut hp, mut hm, mut hv) = (p0.clone(), m0.clone(), v0.clone());
    host::adamw(&mut hp, &g, &mut hm, &mut hv, None, &s, false, 0.25).unwrap();
    assert_bits_eq(&hp, &p, "adamw with a gradient scale");
}

#[test]
fn sums_and_squared_norms_match_f64() {
    let x = uniform(100_003, 51, 1.0);
    let sum64: f64 = x.iter().map(|&v| v as f64).sum();
    let sq64: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    for warps in [1, 7, 256, 4096] {
        let s = host::sum(&x, false, warps).unwrap();
        assert_close_scalar(s as f64, sum64, 1e-4, &format!("sum, {warps} warps"));
        let q = host::sum(&x, true, warps).unwrap();
        assert_close_scalar(
            q as f64,
            sq64,
            1e-6,
            &format!("sum of squares, {warps} warps"),
        );
    }
}
