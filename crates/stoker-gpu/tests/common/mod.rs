//! Shared by the host-build tests: seeded inputs, candle's CPU, and the conversions
//! between the kernels' slices and candle tensors.
#![allow(dead_code, unused_imports)]

use candle_core::{Device, Tensor, Var};
use half::bf16;

pub use stoker_gpu::sample::{ids, uniform};

/// A CPU variable of `shape` holding `x`.
pub fn var(x: &[f32], shape: &[usize]) -> Var {
    Var::from_tensor(&Tensor::from_slice(x, shape, &Device::Cpu).unwrap()).unwrap()
}

/// A tensor's elements as f32.
pub fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// f32 to bf16, round to nearest even.
pub fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// bf16 to f32.
pub fn from_bf16(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

use stoker_gpu::host::HostBuf;
use stoker_gpu::{Backend, Elem, Host, View};

/// A host buffer holding `x`.
pub fn up<E: Elem>(x: &[E]) -> HostBuf<E> {
    Host.upload(x).unwrap()
}

/// A host buffer of `n` zeros.
pub fn zeros<E: Elem>(n: usize) -> HostBuf<E> {
    Host.zeros(n).unwrap()
}

/// The whole of a host buffer.
pub fn all<E: Elem>(b: &HostBuf<E>) -> View<'_, E> {
    Host.all(b)
}

/// A host buffer's elements.
pub fn down<E: Elem>(b: &HostBuf<E>) -> Vec<E> {
    Host.download(b).unwrap()
}

/// Ids on the host, checked against `0..limit` (`skip` excepted).
pub fn ids_on_host(x: &[i32], limit: usize, skip: Option<i32>) -> stoker_gpu::Ids<Host> {
    stoker_gpu::Ids::new(&Host, "ids", x, limit, skip).unwrap()
}
