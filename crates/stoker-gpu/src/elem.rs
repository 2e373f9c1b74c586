//! What the kernels' buffers hold: f32, bf16 and f16 activations (computed in f32), i32
//! ids.

use half::{bf16, f16};

/// An element type a buffer holds.
#[cfg(not(feature = "cuda"))]
pub trait Elem: Copy + Default + Send + Sync + std::fmt::Debug + 'static + sealed::Sealed {}

/// An element type a buffer holds (and, with the `cuda` feature, the device too).
#[cfg(feature = "cuda")]
pub trait Elem:
    Copy
    + Default
    + Send
    + Sync
    + std::fmt::Debug
    + 'static
    + sealed::Sealed
    + cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
{
}

/// `data`'s memory as bytes: what a copy between host and device moves.
pub(crate) fn as_bytes<E: Elem>(data: &[E]) -> &[u8] {
    // SAFETY: an Elem is one of the sealed plain number types (f32, bf16, f16, i32, i64),
    // with no padding, so a live slice of them reads as size_of_val(data) initialized
    // bytes, borrowed as long as `data` is.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

/// An element type the typed kernels store activations in.
pub trait Act: Elem {
    /// Which variant of a typed kernel runs.
    const DTYPE: Dtype;
    /// The value widened to f32 (exact).
    fn to_f32(self) -> f32;
    /// `x` rounded to nearest even.
    fn from_f32(x: f32) -> Self;
}

/// `x` widened to f32.
pub fn to_f32<T: Act>(x: T) -> f32 {
    x.to_f32()
}

/// `x` in `T`, rounded to nearest even.
pub fn from_f32<T: Act>(x: f32) -> T {
    T::from_f32(x)
}

/// The typed kernels' variants (the `_f32` / `_bf16` / `_f16` suffix of their names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// f32 storage.
    F32,
    /// bf16 storage.
    Bf16,
    /// IEEE half storage (fp16 training, under a loss scale).
    F16,
}

impl Dtype {
    /// The kernels' name suffix.
    pub fn suffix(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    /// Bytes one element takes.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }
}

impl Elem for f32 {}
impl Elem for bf16 {}
impl Elem for f16 {}
impl Elem for i32 {}
impl Elem for i64 {}

impl Act for f32 {
    const DTYPE: Dtype = Dtype::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Act for bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Act for f16 {
    const DTYPE: Dtype = Dtype::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

mod sealed {
    /// Only the types the kernels were compiled for.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
}
