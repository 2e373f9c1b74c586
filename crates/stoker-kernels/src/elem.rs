//! The element types the kernels accept (f32, and bf16 computed in f32), and the
//! plumbing from candle's storages to contiguous slices.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result};
use half::bf16;

use crate::error::KernelError;

/// A float the kernels read and write; arithmetic is always f32.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// Whether an f32 intermediate survives a store and load unrounded.
    const EXACT: bool;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    fn storage(v: Vec<Self>) -> CpuStorage;
}

impl Elem for f32 {
    const EXACT: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    fn storage(v: Vec<Self>) -> CpuStorage {
        CpuStorage::F32(v)
    }
}

impl Elem for bf16 {
    const EXACT: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn storage(v: Vec<Self>) -> CpuStorage {
        CpuStorage::BF16(v)
    }
}

/// A contiguous float input.
pub(crate) enum Floats<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
}

/// The contiguous slice `l` views in `s`, or an error naming `op`.
pub(crate) fn floats<'a>(op: &'static str, s: &'a CpuStorage, l: &Layout) -> Result<Floats<'a>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or(KernelError::NotContiguous { op })?;
    match s {
        CpuStorage::F32(v) => Ok(Floats::F32(&v[a..b])),
        CpuStorage::BF16(v) => Ok(Floats::BF16(&v[a..b])),
        other => Err(KernelError::DType {
            op,
            dtype: other.dtype(),
            extra: "",
        }
        .into()),
    }
}

/// Two float inputs of the same dtype.
pub(crate) enum FloatPair<'a> {
    F32(&'a [f32], &'a [f32]),
    BF16(&'a [bf16], &'a [bf16]),
}

/// The contiguous slices of two inputs that must share a dtype.
pub(crate) fn float_pair<'a>(
    op: &'static str,
    (s1, l1): (&'a CpuStorage, &Layout),
    (s2, l2): (&'a CpuStorage, &Layout),
) -> Result<FloatPair<'a>> {
    match (floats(op, s1, l1)?, floats(op, s2, l2)?) {
        (Floats::F32(a), Floats::F32(b)) => Ok(FloatPair::F32(a, b)),
        (Floats::BF16(a), Floats::BF16(b)) => Ok(FloatPair::BF16(a, b)),
        _ => Err(KernelError::DType {
            op,
            dtype: s2.dtype(),
            extra: ", the same for both inputs",
        }
        .into()),
    }
}

/// Target class indices, u32 or i64, widened to i64.
pub(crate) enum Targets<'a> {
    U32(&'a [u32]),
    I64(&'a [i64]),
}

impl Targets<'_> {
    /// Target of row `i`.
    #[inline(always)]
    pub(crate) fn get(&self, i: usize) -> i64 {
        match self {
            Targets::U32(t) => t[i] as i64,
            Targets::I64(t) => t[i],
        }
    }
    /// Number of rows.
    pub(crate) fn len(&self) -> usize {
        match self {
            Targets::U32(t) => t.len(),
            Targets::I64(t) => t.len(),
        }
    }
}

/// The contiguous targets `l` views in `s`.
pub(crate) fn targets<'a>(op: &'static str, s: &'a CpuStorage, l: &Layout) -> Result<Targets<'a>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or(KernelError::NotContiguous { op })?;
    match s {
        CpuStorage::U32(v) => Ok(Targets::U32(&v[a..b])),
        CpuStorage::I64(v) => Ok(Targets::I64(&v[a..b])),
        other => Err(KernelError::DType {
            op,
            dtype: other.dtype(),
            extra: "; targets must be u32 or i64",
        }
        .into()),
    }
}

/// Rows per rayon task for rows of `width` elements: enough rows that a task holds
/// about 16 Ki elements, so tiny rows do not drown in scheduling.
pub(crate) fn rows_per_task(width: usize) -> usize {
    (16 * 1024 / width.max(1)).max(1)
}

/// Whether `d` is a float dtype the kernels take.
pub(crate) fn check_float(op: &'static str, d: DType) -> Result<()> {
    match d {
        DType::F32 | DType::BF16 => Ok(()),
        dtype => Err(KernelError::DType {
            op,
            dtype,
            extra: "",
        }
        .into()),
    }
}
