//! The flat parameter layout: alignment, model -> buffer -> model round trip, grad gathering.

use candle_core::{DType, Device, Tensor};
use stoker_train::layout::FlatLayout;
use stoker_train::params::{Init, ParamBuilder};

#[test]
fn slots_are_aligned_and_sorted_by_name() {
    let mut b = ParamBuilder::new(Device::Cpu, DType::F32, 1);
    b.param("z.weight", &[3, 5], Init::Normal(0.02)).unwrap();
    b.param("a.bias", &[5], Init::Zeros).unwrap();
    let params = b.finish();
    let layout = FlatLayout::of(&params).unwrap();
    let names: Vec<_> = layout.slots().iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["a.bias", "z.weight"]);
    assert_eq!(layout.slots()[1].offset, 16);
    assert_eq!(layout.total_len(), 32);
    assert_eq!(layout.numel(), 20);
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
