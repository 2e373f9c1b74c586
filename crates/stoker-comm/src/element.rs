//! The element types collectives move: f32 (gradients, parameters), f64 (loss sums, norm
//! partials) and u64 (counts, flags), as borrowed slices and as owned buffers.
//!
//! The [`Communicator`](crate::Communicator) trait takes these enums so that it stays
//! object-safe; [`Element`] turns a typed slice into one, and
//! [`CommExt`](crate::CommExt) gives the typed calls (`comm.all_reduce(&mut grads)`).

/// The element type of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// 64-bit unsigned integer.
    U64,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::U64 => 8,
        }
    }

    /// Lower-case name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::U64 => "u64",
        }
    }
}

/// A borrowed input buffer.
#[derive(Debug, Clone, Copy)]
pub enum Buf<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f64 elements.
    F64(&'a [f64]),
    /// u64 elements.
    U64(&'a [u64]),
}

/// A borrowed output (or in-place) buffer.
#[derive(Debug)]
pub enum BufMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// f64 elements.
    F64(&'a mut [f64]),
    /// u64 elements.
    U64(&'a mut [u64]),
}

/// An owned buffer, handed to a non-blocking collective and given back when it completes.
#[derive(Debug, Clone, PartialEq)]
pub enum Buffer {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// u64 elements.
    U64(Vec<u64>),
}

macro_rules! dispatch {
    ($v:expr, $x:ident => $e:expr) => {
        match $v {
            Self::F32($x) => $e,
            Self::F64($x) => $e,
            Self::U64($x) => $e,
        }
    };
}

/// The methods every buffer kind shares: dtype, length, emptiness, size in bytes.
macro_rules! common {
    ($t:ident $(<$l:lifetime>)?) => {
        impl $t $(<$l>)? {
            /// Element type.
            pub fn dtype(&self) -> DType {
                match self {
                    $t::F32(_) => DType::F32,
                    $t::F64(_) => DType::F64,
                    $t::U64(_) => DType::U64,
                }
            }

            /// Number of elements.
            pub fn len(&self) -> usize {
                dispatch!(self, x => x.len())
            }

            /// True when empty.
            pub fn is_empty(&self) -> bool {
                self.len() == 0
            }

            /// Size in bytes.
            pub fn bytes(&self) -> usize {
                self.len() * self.dtype().size()
            }
        }
    };
}

common!(Buf<'_>);
common!(BufMut<'_>);
common!(Buffer);

impl Buf<'_> {
    /// A copy as an owned buffer.
    pub fn to_owned(&self) -> Buffer {
        match self {
            Buf::F32(x) => Buffer::F32(x.to_vec()),
            Buf::F64(x) => Buffer::F64(x.to_vec()),
            Buf::U64(x) => Buffer::U64(x.to_vec()),
        }
    }
}

impl BufMut<'_> {
    /// The same memory as an input buffer.
    pub fn as_buf(&self) -> Buf<'_> {
        match self {
            BufMut::F32(x) => Buf::F32(x),
            BufMut::F64(x) => Buf::F64(x),
            BufMut::U64(x) => Buf::U64(x),
        }
    }

    /// Copies `src[range]` (same dtype) into this buffer, which must have the range's length.
    pub(crate) fn copy_from(&mut self, src: &Buffer, start: usize) {
        match (self, src) {
            (BufMut::F32(d), Buffer::F32(s)) => d.copy_from_slice(&s[start..start + d.len()]),
            (BufMut::F64(d), Buffer::F64(s)) => d.copy_from_slice(&s[start..start + d.len()]),
            (BufMut::U64(d), Buffer::U64(s)) => d.copy_from_slice(&s[start..start + d.len()]),
            _ => unreachable!("dtypes are checked before any copy"),
        }
    }
}

impl Buffer {
    /// The whole buffer as an input.
    pub fn as_buf(&self) -> Buf<'_> {
        match self {
            Buffer::F32(x) => Buf::F32(x),
            Buffer::F64(x) => Buf::F64(x),
            Buffer::U64(x) => Buf::U64(x),
        }
    }

    /// The whole buffer as an output.
    pub fn as_buf_mut(&mut self) -> BufMut<'_> {
        match self {
            Buffer::F32(x) => BufMut::F32(x),
            Buffer::F64(x) => BufMut::F64(x),
            Buffer::U64(x) => BufMut::U64(x),
        }
    }

    /// A zeroed buffer of `dtype` and `len` elements.
    pub fn zeros(dtype: DType, len: usize) -> Buffer {
        match dtype {
            DType::F32 => Buffer::F32(vec![0.0; len]),
            DType::F64 => Buffer::F64(vec![0.0; len]),
            DType::U64 => Buffer::U64(vec![0; len]),
        }
    }

    /// `self[i] += other[i]` for every element, `self` on the left (the order fixes the
    /// bits of the result, see [`crate::tree`]). Same dtype and length.
    pub(crate) fn add_assign(&mut self, other: Buf<'_>) {
        match (self, other) {
            (Buffer::F32(a), Buf::F32(b)) => a.iter_mut().zip(b).for_each(|(a, b)| *a += *b),
            (Buffer::F64(a), Buf::F64(b)) => a.iter_mut().zip(b).for_each(|(a, b)| *a += *b),
            (Buffer::U64(a), Buf::U64(b)) => a
                .iter_mut()
                .zip(b)
                .for_each(|(a, b)| *a = a.wrapping_add(*b)),
            _ => unreachable!("dtypes are checked before any reduction"),
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for u64 {}
}

/// An element type collectives can move: f32, f64 or u64.
pub trait Element:
    Copy + Default + Send + Sync + PartialEq + std::fmt::Debug + 'static + sealed::Sealed
{
    /// The runtime tag.
    const DTYPE: DType;
    /// `a + b` (wrapping for integers).
    fn add(a: Self, b: Self) -> Self;
    /// A slice as an input buffer.
    fn buf(s: &[Self]) -> Buf<'_>;
    /// A slice as an output buffer.
    fn buf_mut(s: &mut [Self]) -> BufMut<'_>;
    /// A vector as an owned buffer.
    fn wrap(v: Vec<Self>) -> Buffer;
    /// The vector back, if the buffer holds this type.
    fn unwrap(b: Buffer) -> Option<Vec<Self>>;
}

macro_rules! element {
    ($t:ty, $v:ident, $add:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$v;
            fn add(a: Self, b: Self) -> Self {
                $add(a, b)
            }
            fn buf(s: &[Self]) -> Buf<'_> {
                Buf::$v(s)
            }
            fn buf_mut(s: &mut [Self]) -> BufMut<'_> {
                BufMut::$v(s)
            }
            fn wrap(v: Vec<Self>) -> Buffer {
                Buffer::$v(v)
            }
            fn unwrap(b: Buffer) -> Option<Vec<Self>> {
                match b {
                    Buffer::$v(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}

element!(f32, F32, |a: f32, b: f32| a + b);
element!(f64, F64, |a: f64, b: f64| a + b);
element!(u64, U64, |a: u64, b: u64| a.wrapping_add(b));
