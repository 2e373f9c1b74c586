//! What the kernels' safe calls refuse, before any C runs: a wrong length, a token or
//! target outside the vocabulary (which the kernel would read out of bounds), a zero or
//! oversized dimension; each error names the kernel and the buffer.

use stoker_gpu::{host, GpuError, Heads};

fn message(e: GpuError) -> String {
    e.to_string()
}

#[test]
fn out_of_range_ids_and_targets_are_refused_naming_the_index() {
    let (wte, wpe) = (vec![0.0f32; 6 * 4], vec![0.0f32; 3 * 4]);
    let mut out = vec![0.0f32; 3 * 4];
    let e = host::encoder_forward(&mut out, &[0, 6, 1], &wte, &wpe, 3, 4).unwrap_err();
    assert_eq!(
        message(e),
        "encoder-forward: `tokens`[1] = 6 is outside 0..6"
    );
    let mut logits = vec![0.0f32; 2 * 8];
    let mut losses = vec![0.0f32; 2];
    let e = host::classifier(&mut logits, &mut losses, &[-100, 5], 5, 1.0, -100).unwrap_err();
    assert_eq!(message(e), "classifier: `targets`[1] = 5 is outside 0..5");
    let e = host::classifier(&mut logits, &mut losses, &[-1, 0], 5, 1.0, -100).unwrap_err();
    assert_eq!(message(e), "classifier: `targets`[0] = -1 is outside 0..5");
}

#[test]
fn wrong_lengths_and_dimensions_are_refused_naming_the_buffer() {
    let mut out = vec![0.0f32; 5];
    let e = host::gelu_forward(&mut out, &[0.0; 4]).unwrap_err();
    assert_eq!(
        message(e),
        "gelu-forward: `out` holds 5 elements, expected 4"
    );
    let (mut dx, mut dw, mut db) = (vec![0.0f32; 12], vec![0.0f32; 4], vec![0.0f32; 3]);
    let e = host::layernorm_backward(
        &mut dx, &mut dw, &mut db, &[0.0; 12], &[0.0; 12], &[1.0; 4], &[0.0; 3], &[1.0; 3], 2,
    )
    .unwrap_err();
    assert_eq!(
        message(e),
        "layernorm-backward: `dbias` holds 3 elements, expected 4"
    );
    let g = Heads {
        b: 1,
        t: 0,
        h: 2,
        d: 4,
    };
    let e = host::qkv_heads(&mut [0.0f32; 0], &[], g, false).unwrap_err();
    assert_eq!(message(e), "qkv-heads: t = 0 must be in 1..=2^31-1");
    let mut att = vec![0.0f32; 10];
    let e = host::attention_softmax_forward(&mut att, &[0.0; 10], 3, 1.0).unwrap_err();
    assert_eq!(
        message(e),
        "attention-softmax-forward: `pre` holds 10 elements, expected 9"
    );
}
