//! The flat parameter layout: alignment, model -> buffer -> model round trip, grad gathering.

use candle_core::{DType, Device, Tensor};
use stoker_train::layout::FlatLayout;
use stoker_train::params::{Init, ParamBuilder};

#[test]
fn slots_are_aligned_in_declaration_order_with_contiguous_groups() {
    let mut b = ParamBuilder::new(Device::Cpu, DType::F32, 1);
    b.param("z.weight", &[3, 5], Init::Normal(0.02)).unwrap();
    b.set_group(1).unwrap();
    b.param("a.bias", &[5], Init::Zeros).unwrap();
    b.param("a.weight", &[2], Init::Zeros).unwrap();
    assert!(b
        .set_group(0)
        .unwrap_err()
        .to_string()
        .contains("execution order"));
    let params = b.finish();
    let layout = FlatLayout::of(&params).unwrap();
    let names: Vec<_> = layout.slots().iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["z.weight", "a.bias", "a.weight"]);
    assert_eq!(layout.slots()[1].offset, 16);
    assert_eq!(layout.total_len(), 48);
    assert_eq!(layout.numel(), 22);
    // Groups tile the buffer, padding included.
    assert_eq!(layout.group_ranges(), vec![(0, 0..16), (1, 16..48)]);
}

#[test]
fn the_gpt_layout_runs_embeddings_blocks_final_norm() {
    use stoker_train::models::{Gpt, GptConfig, Model};
    let c = GptConfig {
        vocab: 11,
        context: 6,
        d_model: 8,
        n_layer: 12,
        n_head: 2,
        init_from: None,
    };
    let gpt = Gpt::new(c, &Device::Cpu, DType::F32, 0).unwrap();
    let layout = FlatLayout::of(gpt.params()).unwrap();
    let names: Vec<_> = layout.slots().iter().map(|s| s.name.as_str()).collect();
    assert_eq!(&names[..3], ["wte.weight", "wpe.weight", "h.0.ln_1.weight"]);
    // h.2 after h.1, not after h.10 (name order would put h.10 first).
    let at = |n: &str| names.iter().position(|&x| x == n).unwrap();
    assert!(at("h.1.mlp.proj.bias") < at("h.2.ln_1.weight"));
    assert!(at("h.9.mlp.proj.bias") < at("h.10.ln_1.weight"));
    assert_eq!(names.last(), Some(&"ln_f.bias"));
    let groups = layout.group_ranges();
    assert_eq!(groups.len(), 14);
    assert!(groups.iter().enumerate().all(|(i, (g, _))| *g == i));
}

#[test]
fn round_trip_is_bit_exact() {
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let mut b = ParamBuilder::new(Device::Cpu, dtype, 7);
        b.param("w", &[4, 6], Init::Normal(1.0)).unwrap();
        b.param("b", &[6], Init::Uniform(0.5)).unwrap();
        let params = b.finish();
        let layout = FlatLayout::of(&params).unwrap();
        let buf = layout.flatten(&params).unwrap();
        let before: Vec<Vec<u8>> = params.iter().map(|p| bytes(p.var.as_tensor())).collect();
        // Scribble, then restore from the buffer.
        for p in params.iter() {
            p.var.set(&p.var.as_tensor().zeros_like().unwrap()).unwrap();
        }
        layout.unflatten(&buf, &params).unwrap();
        let after: Vec<Vec<u8>> = params.iter().map(|p| bytes(p.var.as_tensor())).collect();
        assert_eq!(before, after, "{dtype:?}");
        assert_eq!(layout.flatten(&params).unwrap(), buf);
    }
}

fn bytes(t: &Tensor) -> Vec<u8> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => bytemuck::cast_slice(&t.to_vec1::<f32>().unwrap()).to_vec(),
        DType::F64 => bytemuck::cast_slice(&t.to_vec1::<f64>().unwrap()).to_vec(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()
            .unwrap()
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        d => panic!("{d:?}"),
    }
}

#[test]
fn gathers_gradients_and_names_a_missing_one() {
    let mut b = ParamBuilder::new(Device::Cpu, DType::F32, 3);
    let w = b.param("w", &[2, 2], Init::Ones).unwrap();
    let _unused = b.param("unused", &[3], Init::Ones).unwrap();
    let params = b.finish();
    let layout = FlatLayout::of(&params).unwrap();
    let loss = w.as_tensor().sqr().unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let mut out = vec![0f32; layout.total_len()];
    let err = layout.gather_grads(&grads, &params, &mut out).unwrap_err();
    assert!(err.to_string().contains("`unused`"), "{err}");
}

#[test]
fn a_buffer_remaps_by_name_between_orders_and_names_what_does_not_fit() {
    use stoker_train::layout::ParamSpec;
    let a = FlatLayout::new(
        &[ParamSpec::new("w", &[3, 5]), ParamSpec::new("b", &[5])],
        16,
    )
    .unwrap();
    let b = FlatLayout::new(
        &[ParamSpec::new("b", &[5]), ParamSpec::new("w", &[3, 5])],
        8,
    )
    .unwrap();
    let buf: Vec<f32> = (0..a.total_len()).map(|i| i as f32).collect();
    let r = b.remap_from(&a, &buf).unwrap();
    assert_eq!(&r[..5], &buf[16..21]); // b
    assert_eq!(&r[8..23], &buf[..15]); // w
    assert_eq!(
        a.remap_from(&b, &r).unwrap()[..21],
        {
            let mut want = buf[..21].to_vec();
            want[15] = 0.0; // padding comes back zero
            want
        }[..]
    );
    let c = FlatLayout::new(
        &[ParamSpec::new("w", &[5, 3]), ParamSpec::new("b", &[5])],
        16,
    )
    .unwrap();
    let e = c.remap_from(&a, &buf).unwrap_err().to_string();
    assert!(e.contains("`w`") && e.contains("[3, 5]"), "{e}");
}
