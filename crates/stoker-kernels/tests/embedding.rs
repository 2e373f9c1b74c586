//! Fused embedding (scatter-add backward) against candle's composed embedding, an f64
//! direct sum, and bf16.
mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::*;
use stoker_kernels::{embedding, reference};

/// (V, C, ids): one row, odd widths with repeated ids, a long row, 2-D ids.
fn cases() -> Vec<(usize, usize, Tensor)> {
    let cpu = &Device::Cpu;
    vec![
        (1, 1, Tensor::new(&[0u32], cpu).unwrap()),
        (7, 7, Tensor::new(&[3u32, 3, 6, 0, 3], cpu).unwrap()),
        (
            17,
            33,
            Tensor::new(&[[1i64, 16, 1], [2, 2, 9]], cpu).unwrap(),
        ),
        (5, 4099, Tensor::new(&[4u32, 0, 4, 4], cpu).unwrap()),
    ]
}

/// f32 fused vs composed: forward exact (a copy), dtable within 1e-6 absolute.
#[test]
fn embedding_matches_composed_f32() {
    for (i, (v, c, ids)) in cases().into_iter().enumerate() {
        let table = var(&[v, c], i as u64, 1.0);
        let yf = embedding(table.as_tensor(), &ids).unwrap();
        let yc = reference::embedding(table.as_tensor(), &ids).unwrap();
        assert_eq!(yf.dims(), yc.dims());
        assert_eq!(max_abs(&yf, &yc), 0.0, "{v}x{c} fwd");
        let gf = weighted_sum(&yf, 11).unwrap().backward().unwrap();
        let gc = weighted_sum(&yc, 11).unwrap().backward().unwrap();
        let (gf, gc) = (
            gf.get(table.as_tensor()).unwrap(),
            gc.get(table.as_tensor()).unwrap(),
        );
        assert!(max_abs(gf, gc) <= 1e-6, "{v}x{c} bwd {}", max_abs(gf, gc));
    }
}

/// dtable vs the gradient summed directly in f64 (the op is linear, so this is the
/// exact derivative): within 1e-6 of max(1, |grad|).
#[test]
fn embedding_backward_matches_f64_sum() {
    for (i, (v, c, ids)) in cases().into_iter().enumerate() {
        let table = var(&[v, c], 20 + i as u64, 1.0);
        let y = embedding(table.as_tensor(), &ids).unwrap();
        let g = weighted_sum(&y, 12).unwrap().backward().unwrap();
        let idv = ids
            .flatten_all()
            .unwrap()
            .to_dtype(DType::I64)
            .unwrap()
            .to_vec1::<i64>()
            .unwrap();
        let r = values(idv.len() * c, 12, 1.0);
        let mut want = vec![0.0f64; v * c];
        for (p, &id) in idv.iter().enumerate() {
            for j in 0..c {
                want[id as usize * c + j] += r[p * c + j] as f64;
            }
        }
        let err = max_rel_f64(g.get(table.as_tensor()).unwrap(), &want);
        assert!(err <= 1e-6, "{v}x{c} {err}");
    }
}

/// bf16 vs f32 on the same table: forward exact, dtable within 2^-7 of max(1, |grad|)
/// (bf16 incoming gradients, summed in f32, rounded once).
#[test]
fn embedding_bf16_matches_f32() {
    for (i, (v, c, ids)) in cases().into_iter().enumerate() {
        let t16 = Var::from_tensor(
            &var(&[v, c], 30 + i as u64, 1.0)
                .to_dtype(DType::BF16)
                .unwrap(),
        )
        .unwrap();
        let t32 = Var::from_tensor(&t16.to_dtype(DType::F32).unwrap()).unwrap();
        let y16 = embedding(t16.as_tensor(), &ids).unwrap();
        let y32 = embedding(t32.as_tensor(), &ids).unwrap();
        assert_eq!(max_abs(&y16, &y32), 0.0);
        let g16 = weighted_sum(&y16, 13).unwrap().backward().unwrap();
        let g32 = weighted_sum(&y32, 13).unwrap().backward().unwrap();
        let (g16, g32) = (
            g16.get(t16.as_tensor()).unwrap(),
            g32.get(t32.as_tensor()).unwrap(),
        );
        assert!(
            max_abs(g16, g32) <= max_mag(g32).max(1.0) / 128.0,
            "{v}x{c}"
        );
    }
}

/// An id outside the table is an error naming the op and the position.
#[test]
fn embedding_rejects_bad_ids() {
    let table = var(&[3, 2], 1, 1.0);
    let ids = Tensor::new(&[0u32, 3], &Device::Cpu).unwrap();
    let e = embedding(table.as_tensor(), &ids).unwrap_err().to_string();
    assert!(e.contains("embedding") && e.contains("position 1"), "{e}");
}
