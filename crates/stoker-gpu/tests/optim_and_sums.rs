//! The host build of the optimizer and the step's scalars: AdamW is stoker-kernels'
//! scalar AdamW bit for bit (with its bf16 copy-out), the sums are f64's within f32
//! rounding, whatever the number of partial sums.

mod common;

use common::*;
use stoker_gpu::{kernels, Host};
use stoker_kernels::optim::adamw_update_scalar;
use stoker_kernels::AdamWStep;
use stoker_testkit::{assert_bits_eq, assert_close_scalar};

#[test]
fn adamw_is_the_cpu_update_bit_for_bit() {
    let n = 5003;
    let (p0, g) = (uniform(n, 41, 1.0), uniform(n, 42, 0.1));
    let m0 = uniform(n, 43, 0.01);
    let v0: Vec<f32> = uniform(n, 44, 0.001).iter().map(|x| x.abs()).collect();
    let gb = up(&g);
    let run = |s: &AdamWStep, decay: bool, grad_scale: f32, copy: bool| {
        let (p, m, v) = (up(&p0), up(&m0), up(&v0));
        let out = zeros::<half::bf16>(n);
        let c = copy.then(|| all(&out));
        kernels::adamw(
            &Host,
            all(&p),
            all(&gb),
            all(&m),
            all(&v),
            c,
            s,
            decay,
            grad_scale,
        )
        .unwrap();
        (down(&p), down(&m), down(&v), down(&out))
    };
    for (t, decay) in [(1u64, true), (7, false), (1000, true)] {
        let s = AdamWStep::new(3e-4, 0.9, 0.95, 1e-8, 0.1, t);
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        adamw_update_scalar(&s, decay, &mut p, &g, &mut m, &mut v);
        let (hp, hm, hv, copy) = run(&s, decay, 1.0, true);
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
    assert_bits_eq(
        &run(&s, false, 0.25, false).0,
        &p,
        "adamw with a gradient scale",
    );
}

#[test]
fn sums_and_squared_norms_match_f64() {
    let x = uniform(100_003, 51, 1.0);
    let sum64: f64 = x.iter().map(|&v| v as f64).sum();
    let sq64: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let xb = up(&x);
    for warps in [1, 7, 256, 4096] {
        let (out, partials) = (up(&[3.0f32]), zeros::<f32>(warps));
        kernels::sum(
            &Host,
            all(&out),
            all(&xb),
            all(&partials),
            false,
            warps,
            false,
        )
        .unwrap();
        assert_close_scalar(
            down(&out)[0] as f64,
            sum64,
            1e-4,
            &format!("sum, {warps} warps"),
        );
        kernels::sum(
            &Host,
            all(&out),
            all(&xb),
            all(&partials),
            true,
            warps,
            true,
        )
        .unwrap();
        assert_close_scalar(
            down(&out)[0] as f64,
            sum64 + sq64,
            1e-5,
            &format!("sum + squares, {warps} warps"),
        );
    }
}

/// Segments with gaps between them and mixed weight-decay flags.
fn segments() -> Vec<(std::ops::Range<usize>, bool)> {
    vec![
        (0..700, true),
        (700..701, false),
        (705..2000, true),
        (2000..4100, false),
        (4200..5003, true),
    ]
}

#[test]
fn segmented_adamw_is_the_cpu_update_per_segment_bit_for_bit_and_leaves_gaps() {
    use stoker_gpu::optim::{self, Segments};
    let n = 5003;
    let (p0, g) = (uniform(n, 61, 1.0), uniform(n, 62, 0.1));
    let m0 = uniform(n, 63, 0.01);
    let v0: Vec<f32> = uniform(n, 64, 0.001).iter().map(|x| x.abs()).collect();
    let s = AdamWStep::new(3e-4, 0.9, 0.95, 1e-8, 0.1, 9);
    let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
    for (r, decay) in segments() {
        adamw_update_scalar(
            &s,
            decay,
            &mut p[r.clone()],
            &g[r.clone()],
            &mut m[r.clone()],
            &mut v[r],
        );
    }
    let segs = Segments::new(&Host, &segments(), n).unwrap();
    let (hp, hg, hm, hv, copy) = (up(&p0), up(&g), up(&m0), up(&v0), zeros::<half::bf16>(n));
    optim::adamw(
        &Host,
        all(&hp),
        all(&hg),
        all(&hm),
        all(&hv),
        (Some(all(&copy)), None),
        &s,
        &segs,
        1.0,
    )
    .unwrap();
    assert_bits_eq(&down(&hp), &p, "segmented adamw weights (gaps untouched)");
    assert_bits_eq(&down(&hm), &m, "segmented adamw first moment");
    assert_bits_eq(&down(&hv), &v, "segmented adamw second moment");
    let copied: Vec<f32> = segments()
        .iter()
        .flat_map(|(r, _)| r.clone())
        .map(|i| down(&copy)[i].to_f32())
        .collect();
    let want: Vec<f32> = segments()
        .iter()
        .flat_map(|(r, _)| r.clone())
        .map(|i| half::bf16::from_f32(p[i]).to_f32())
        .collect();
    assert_bits_eq(&copied, &want, "segmented adamw bf16 copy");
}

#[test]
fn segmented_sgd_is_the_cpu_update_per_segment_bit_for_bit() {
    use stoker_gpu::optim::{self, Segments};
    use stoker_kernels::optim::sgd_update_scalar;
    use stoker_kernels::SgdStep;
    let n = 5003;
    let (p0, g, b0) = (
        uniform(n, 71, 1.0),
        uniform(n, 72, 0.1),
        uniform(n, 73, 0.05),
    );
    let segs = Segments::new(&Host, &segments(), n).unwrap();
    for (momentum, nesterov, first) in [
        (0.9f32, false, true),
        (0.9, true, false),
        (0.0, false, false),
    ] {
        let s = SgdStep {
            lr: 0.05,
            momentum,
            weight_decay: 0.01,
            nesterov,
            first,
        };
        let (mut p, mut b) = (p0.clone(), b0.clone());
        for (r, decay) in segments() {
            sgd_update_scalar(&s, decay, &mut p[r.clone()], &g[r.clone()], &mut b[r]);
        }
        let (hp, hg, hb) = (up(&p0), up(&g), up(&b0));
        let buf = (momentum != 0.0).then(|| all(&hb));
        optim::sgd(&Host, all(&hp), all(&hg), buf, None, &s, &segs, 1.0).unwrap();
        let what = format!("sgd momentum {momentum} nesterov {nesterov} first {first}");
        assert_bits_eq(&down(&hp), &p, &format!("{what}: weights"));
        assert_bits_eq(&down(&hb), &b, &format!("{what}: momentum buffer"));
    }
    let e = Segments::new(&Host, &[(0..10, true), (5..20, false)], 30)
        .err()
        .unwrap();
    assert!(e.to_string().contains("sorted, disjoint"), "{e}");
    let s = SgdStep {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 0.0,
        nesterov: false,
        first: true,
    };
    let (hp, hg) = (up(&p0), up(&g));
    let e = optim::sgd(&Host, all(&hp), all(&hg), None, None, &s, &segs, 1.0).unwrap_err();
    assert!(e.to_string().contains("needs a momentum buffer"), "{e}");
}
