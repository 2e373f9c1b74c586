//! The host backend runs long pack launches (the optimizers over every parameter, the
//! sum of a block's gradients) in pieces over rayon's pool: each pack writes only its
//! own elements, so the pieces must give one thread's bits. Lengths past several pieces
//! and not a multiple of a pack, segments that start inside a piece, the bf16 copy
//! rounded stochastically; against the same launches on a pool of one thread, and the
//! plain sum and AdamW against stoker-kernels.

mod common;

use common::*;
use half::bf16;
use stoker_gpu::step::optimizer::{self, Optimizer, OptimizerState, Scalars};
use stoker_gpu::{kernels, Host};
use stoker_kernels::optim::{adamw_update_scalar, sgd_update_scalar};
use stoker_kernels::{AdamWStep, SgdStep};
use stoker_testkit::assert_bits_eq;

/// Longer than three pieces of 2^18, and not a multiple of eight.
const N: usize = 3 * (1 << 18) + 12_345;

fn one_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(f)
}

#[test]
fn the_pool_has_threads_to_split_over() {
    // Otherwise the tests below compare one thread with itself.
    assert!(
        rayon::current_num_threads() >= 2,
        "rayon's pool has {} thread(s): the pieces would not run at once",
        rayon::current_num_threads()
    );
}

#[test]
fn a_long_sum_over_threads_is_the_elementwise_sum() {
    let (a, b) = (uniform(N, 1, 1.0), uniform(N, 2, 1.0));
    let sum = up(&a);
    kernels::add_into(&Host, all(&sum), all(&up(&b))).unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_bits_eq(&down(&sum), &want, "add_into over threads");
}

/// Segments: decayed, not, decayed, the bounds inside pieces.
fn segments() -> Vec<(std::ops::Range<usize>, bool)> {
    vec![
        (0..100_001, true),
        (100_001..400_003, false),
        (400_003..N, true),
    ]
}

/// One AdamW update of a bf16 model on the host: master, moments, the bf16 copy.
fn adamw_once(round: bool) -> Vec<Vec<f32>> {
    let (p0, g) = (uniform(N, 3, 1.0), uniform(N, 4, 0.1));
    let mut opt = OptimizerState::new(&Host, Optimizer::AdamW, &p0, &segments()).unwrap();
    if round {
        opt = opt.with_stochastic_rounding(7, (N, 0)).unwrap();
    }
    let copy = zeros::<bf16>(N);
    let s = Scalars::AdamW(AdamWStep::new(3e-4, 0.9, 0.95, 1e-8, 0.1, 2));
    optimizer::apply(&Host, &opt, all(&copy), all(&up(&g)), &s, 0.5).unwrap();
    let mut out = vec![opt.master(&Host).unwrap()];
    out.extend(opt.moments(&Host).unwrap().into_iter().map(|(_, m)| m));
    out.push(from_bf16(&down(&copy)));
    out
}

#[test]
fn adamw_over_threads_gives_one_threads_bits() {
    for round in [false, true] {
        let threads = adamw_once(round);
        let one = one_thread(|| adamw_once(round));
        for (k, (a, b)) in threads.iter().zip(&one).enumerate() {
            assert_bits_eq(
                a,
                b,
                &format!("adamw output {k}, stochastic rounding {round}"),
            );
        }
    }
    // And the update is stoker-kernels' scalar AdamW, segment by segment.
    let (mut p, g) = (uniform(N, 3, 1.0), uniform(N, 4, 0.1));
    let scaled: Vec<f32> = g.iter().map(|x| x * 0.5).collect();
    let s = AdamWStep::new(3e-4, 0.9, 0.95, 1e-8, 0.1, 2);
    let (mut m, mut v) = (vec![0.0; N], vec![0.0; N]);
    for (r, decay) in segments() {
        adamw_update_scalar(
            &s,
            decay,
            &mut p[r.clone()],
            &scaled[r.clone()],
            &mut m[r.clone()],
            &mut v[r],
        );
    }
    assert_bits_eq(
        &adamw_once(false)[0],
        &p,
        "adamw over threads against the CPU",
    );
}

/// One SGD update with momentum (its first: the buffer seeded) then a second.
fn sgd_twice() -> Vec<Vec<f32>> {
    let (p0, g) = (uniform(N, 5, 1.0), uniform(N, 6, 0.1));
    let opt =
        OptimizerState::new(&Host, Optimizer::Sgd { momentum: true }, &p0, &segments()).unwrap();
    let params = zeros::<f32>(N);
    let grads = up(&g);
    for first in [true, false] {
        let s = Scalars::Sgd(SgdStep {
            lr: 0.01,
            momentum: 0.9,
            weight_decay: 0.01,
            nesterov: true,
            first,
        });
        optimizer::apply(&Host, &opt, all(&params), all(&grads), &s, 1.0).unwrap();
    }
    let mut out = vec![opt.master(&Host).unwrap(), down(&params)];
    out.extend(opt.moments(&Host).unwrap().into_iter().map(|(_, m)| m));
    out
}

#[test]
fn sgd_over_threads_gives_one_threads_bits_and_the_cpus() {
    let threads = sgd_twice();
    let one = one_thread(sgd_twice);
    for (k, (a, b)) in threads.iter().zip(&one).enumerate() {
        assert_bits_eq(a, b, &format!("sgd output {k}"));
    }
    let (mut p, g) = (uniform(N, 5, 1.0), uniform(N, 6, 0.1));
    let mut buf = vec![0.0; N];
    for first in [true, false] {
        let s = SgdStep {
            lr: 0.01,
            momentum: 0.9,
            weight_decay: 0.01,
            nesterov: true,
            first,
        };
        for (r, decay) in segments() {
            sgd_update_scalar(&s, decay, &mut p[r.clone()], &g[r.clone()], &mut buf[r]);
        }
    }
    assert_bits_eq(&threads[0], &p, "sgd over threads against the CPU");
}
