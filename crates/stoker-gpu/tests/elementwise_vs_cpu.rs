//! The host build of the element kernels against stoker-kernels' CPU ops: GELU (the same
//! polynomial, so bit for bit, f32 and bf16), the embedding and its gradients, the bias
//! gradient's column sums.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use stoker_gpu::{kernels, Groups, Host, TokenGroups};
use stoker_testkit::{assert_bits_eq, assert_close};

#[test]
fn gelu_is_stoker_kernels_gelu_bit_for_bit() {
    let x = uniform(4099, 1, 6.0);
    let dy = uniform(4099, 2, 1.0);
    let xv = var(&x, &[x.len()]);
    let y = stoker_kernels::gelu(xv.as_tensor()).unwrap();
    let dyt = Tensor::from_slice(&dy, x.len(), &Device::Cpu).unwrap();
    let grads = (&y * &dyt).unwrap().sum_all().unwrap().backward().unwrap();
    let want_dx = values(grads.get(xv.as_tensor()).unwrap());

    let (xb, out, g) = (up(&x), zeros::<f32>(x.len()), up(&dy));
    kernels::gelu_forward(&Host, all(&out), all(&xb)).unwrap();
    assert_bits_eq(&down(&out), &values(&y), "gelu forward f32");
    kernels::gelu_backward(&Host, all(&g), all(&xb), all(&g)).unwrap();
    // Equal values (tolerance 0): candle's gradient store adds into zeros, which turns
    // the kernel's -0.0 into +0.0, so the bits differ there only.
    assert_close(&down(&g), &want_dx, 0.0, "gelu backward f32");

    // bf16 storage: widened, computed in f32, rounded to nearest even on both sides.
    let x16 = to_bf16(&x);
    let y16 =
        stoker_kernels::gelu(&Tensor::from_slice(&x16, x.len(), &Device::Cpu).unwrap()).unwrap();
    let (xb16, out16) = (up(&x16), zeros::<half::bf16>(x.len()));
    kernels::gelu_forward(&Host, all(&out16), all(&xb16)).unwrap();
    assert_bits_eq(
        &from_bf16(&down(&out16)),
        &values(&y16),
        "gelu forward bf16",
    );
}

#[test]
fn embedding_and_its_gradients_match_the_cpu_ops() {
    let (b, t, c, v) = (3, 17, 40, 23);
    let wte = uniform(v * c, 3, 1.0);
    let wpe = uniform(t * c, 4, 1.0);
    let tokens = ids(b * t, 5, v);
    let dout = uniform(b * t * c, 6, 1.0);

    let wte_v = var(&wte, &[v, c]);
    let wpe_v = var(&wpe, &[t, c]);
    let idt = Tensor::from_vec(
        tokens.iter().map(|&i| i as u32).collect::<Vec<_>>(),
        (b, t),
        &Device::Cpu,
    )
    .unwrap();
    let emb = stoker_kernels::embedding(wte_v.as_tensor(), &idt).unwrap();
    let y = emb.broadcast_add(wpe_v.as_tensor()).unwrap();
    let dyt = Tensor::from_slice(&dout, (b, t, c), &Device::Cpu).unwrap();
    let grads = (&y * &dyt).unwrap().sum_all().unwrap().backward().unwrap();

    let (wteb, wpeb, doutb) = (up(&wte), up(&wpe), up(&dout));
    let out = zeros::<f32>(b * t * c);
    kernels::encoder_forward(
        &Host,
        all(&out),
        &ids_on_host(&tokens, v, None),
        all(&wteb),
        Some(all(&wpeb)),
        t,
        c,
    )
    .unwrap();
    assert_bits_eq(&down(&out), &values(&y), "encoder forward");
    // Without positions (the Llama): the token's row itself.
    kernels::encoder_forward(
        &Host,
        all(&out),
        &ids_on_host(&tokens, v, None),
        all(&wteb),
        None,
        t,
        c,
    )
    .unwrap();
    assert_bits_eq(&down(&out), &values(&emb), "embedding without positions");

    let dwpe = zeros::<f32>(t * c);
    kernels::encoder_backward_wpe(&Host, all(&dwpe), all(&doutb), b, t, c).unwrap();
    assert_close(
        &down(&dwpe),
        &values(grads.get(wpe_v.as_tensor()).unwrap()),
        1e-6,
        "dwpe",
    );
    let dwte = zeros::<f32>(v * c);
    let groups = Groups::new(&Host, &TokenGroups::new(&tokens, v).unwrap(), v).unwrap();
    kernels::encoder_backward_wte(&Host, all(&dwte), all(&doutb), &groups, c).unwrap();
    assert_close(
        &down(&dwte),
        &values(grads.get(wte_v.as_tensor()).unwrap()),
        1e-6,
        "dwte",
    );
}

#[test]
fn column_sums_are_the_bias_gradient() {
    let (rows, cols) = (301, 37);
    let x = uniform(rows * cols, 7, 1.0);
    let want: Vec<f32> = (0..cols)
        .map(|c| (0..rows).map(|r| x[r * cols + c] as f64).sum::<f64>() as f32 + 0.5)
        .collect();
    let xb = up(&x);
    for parts in [1, 4, 64, 400] {
        let (got, partials) = (up(&vec![0.5f32; cols]), zeros::<f32>(parts * cols));
        kernels::column_sums_add(&Host, all(&got), all(&xb), all(&partials), parts).unwrap();
        assert_close(
            &down(&got),
            &want,
            1e-5,
            &format!("column sums, {parts} parts"),
        );
    }
}
