//! What the kernels' buffers hold: f32, bf16 and f16 activations (computed in f32), i32
//! ids, and FP8 operands of the products (E4M3, E5M2).

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
    // SAFETY: an Elem is one of the sealed plain number types (f32, bf16, f16, i32, i64,
    // and the one-byte FP8 newtypes), with no padding, so a live slice of them reads as
    // size_of_val(data) initialized bytes, borrowed as long as `data` is.
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

/// An E4M3FN value as its bits (FP8 for forward tensors: activations and weights).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct E4m3(pub u8);

/// An E5M2 value as its bits (FP8 for gradients: wider range, one mantissa bit less).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct E5m2(pub u8);

/// Which FP8 format a buffer holds: what cuBLASLt's FP8 products are told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Dtype {
    /// E4M3FN: 3 mantissa bits, largest finite 448, no infinity.
    E4m3,
    /// E5M2: 2 mantissa bits, largest finite 57,344, with infinity.
    E5m2,
}

impl Fp8Dtype {
    /// The format in stoker-precision's terms (its encode and decode are the reference).
    pub fn format(self) -> stoker_precision::Fp8Format {
        match self {
            Fp8Dtype::E4m3 => stoker_precision::Fp8Format::E4M3,
            Fp8Dtype::E5m2 => stoker_precision::Fp8Format::E5M2,
        }
    }

    /// The format of `format`.
    pub fn of(format: stoker_precision::Fp8Format) -> Self {
        match format {
            stoker_precision::Fp8Format::E4M3 => Fp8Dtype::E4m3,
            stoker_precision::Fp8Format::E5M2 => Fp8Dtype::E5m2,
        }
    }
}

/// An FP8 element type: one byte, the format fixed by the type.
pub trait Fp8: Elem {
    /// The format.
    const DTYPE: Fp8Dtype;
}

impl Fp8 for E4m3 {
    const DTYPE: Fp8Dtype = Fp8Dtype::E4m3;
}

impl Fp8 for E5m2 {
    const DTYPE: Fp8Dtype = Fp8Dtype::E5m2;
}

impl Elem for E4m3 {}
impl Elem for E5m2 {}
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
    impl Sealed for super::E4m3 {}
    impl Sealed for super::E5m2 {}
}

// SAFETY: both are one byte (`repr(transparent)` over u8), every bit pattern a value and
// all-zero bits the value 0, so the device may hold and copy them as bytes.
#[cfg(feature = "cuda")]
unsafe impl cudarc::driver::DeviceRepr for E4m3 {}
// SAFETY: as above.
#[cfg(feature = "cuda")]
unsafe impl cudarc::driver::ValidAsZeroBits for E4m3 {}
// SAFETY: as above.
#[cfg(feature = "cuda")]
unsafe impl cudarc::driver::DeviceRepr for E5m2 {}
// SAFETY: as above.
#[cfg(feature = "cuda")]
unsafe impl cudarc::driver::ValidAsZeroBits for E5m2 {}
