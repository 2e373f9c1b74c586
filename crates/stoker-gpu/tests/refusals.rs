//! What the kernels' checked calls refuse, before anything runs: a wrong length, a token
//! or target outside the vocabulary (which a kernel would read out of bounds), a zero
//! dimension, a view past its buffer; each error names the kernel and the buffer.

mod common;

use common::*;
use stoker_gpu::{kernels, Backend, Heads, Host, Ids};

#[test]
fn out_of_range_ids_and_targets_are_refused_naming_the_index() {
    let e = Ids::new(&Host, "tokens", &[0, 6, 1], 6, None)
        .err()
        .unwrap();
    assert_eq!(e.to_string(), "ids: `tokens`[1] = 6 is outside 0..6");
    let e = Ids::new(&Host, "targets", &[-100, 5], 5, Some(-100))
        .err()
        .unwrap();
    assert_eq!(e.to_string(), "ids: `targets`[1] = 5 is outside 0..5");
    let e = Ids::new(&Host, "targets", &[-1, 0], 5, Some(-100))
        .err()
        .unwrap();
    assert_eq!(e.to_string(), "ids: `targets`[0] = -1 is outside 0..5");
    // Targets checked against a larger vocabulary than the classifier's.
    let (logits, losses) = (zeros::<f32>(2 * 8), zeros::<f32>(2));
    let t = ids_on_host(&[0, 6], 7, Some(-100));
    let e = kernels::classifier(
        &Host,
        all(&logits),
        all(&losses),
        None,
        &t,
        5,
        Some(1.0),
        -100,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("classifier: v = 5 with rows of 8, targets checked against 7"),
        "{e}"
    );
}

#[test]
fn wrong_lengths_and_dimensions_are_refused_naming_the_buffer() {
    let (out, inp) = (zeros::<f32>(5), zeros::<f32>(4));
    let e = kernels::gelu_forward(&Host, all(&out), all(&inp)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "gelu-forward: `out` holds 5 elements, expected 4"
    );
    let (x, dw, db, p) = (
        zeros::<f32>(12),
        zeros::<f32>(4),
        zeros::<f32>(3),
        zeros::<f32>(16),
    );
    let (w, st) = (up(&[1.0f32; 4]), zeros::<f32>(3));
    let stats = kernels::Stats {
        mean: all(&st),
        rstd: all(&st),
    };
    let e = kernels::layernorm_backward(
        &Host,
        all(&x),
        all(&dw),
        all(&db),
        all(&p),
        all(&x),
        all(&x),
        all(&w),
        stats,
        2,
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "layernorm-backward: `dbias` holds 3 elements, expected 4"
    );
    let g = Heads {
        b: 1,
        t: 0,
        h: 2,
        d: 4,
    };
    let e = kernels::qkv_heads(&Host, all(&inp), all(&inp), g, false).unwrap_err();
    assert_eq!(e.to_string(), "qkv-heads: t = 0 must be in 1..=2^31-1");
    let (att, pre) = (zeros::<f32>(10), zeros::<f32>(10));
    let e =
        kernels::attention_softmax_forward(&Host, all(&att), all(&pre), (3, 3), 1.0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "attention-softmax-forward: `pre` holds 10 elements, expected 9"
    );
    let e =
        kernels::attention_softmax_forward(&Host, all(&att), all(&pre), (3, 4), 1.0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "attention-softmax-forward: query chunks of 4 rows for 3 positions (1 to 3)"
    );
    let e = Host.view(&att, 4..11).unwrap_err();
    assert_eq!(e.to_string(), "view: elements 4..11 of a buffer of 10");
}

#[test]
fn a_copy_between_overlapping_views_is_refused() {
    let b = up(&[1.0f32, 2.0, 3.0, 4.0]);
    let (a, c) = (Host.view(&b, 0..3).unwrap(), Host.view(&b, 1..4).unwrap());
    let e = Host.copy(a, c).unwrap_err();
    assert_eq!(e.to_string(), "copy: the views overlap (3 and 3 elements)");
    let (lo, hi) = (Host.view(&b, 0..2).unwrap(), Host.view(&b, 2..4).unwrap());
    Host.copy(lo, hi).unwrap();
    assert_eq!(down(&b), [3.0, 4.0, 3.0, 4.0]);
}
