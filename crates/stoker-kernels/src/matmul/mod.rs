//! bf16 matrix multiply with f32 accumulation on the CPU's bf16 hardware: AMX tiles where
//! present, else the AVX512-BF16 dot product, else a portable loop; chosen at run time.
//!
//! candle multiplies bf16 matrices by widening both to f32, running its f32 GEMM and
//! rounding back, so bf16 buys nothing on a CPU. On this project's Sapphire Rapids
//! machine `vdpbf16ps` peaks at about 105 GFLOP/s per core, below AVX-512 f32 FMA's
//! 195: the dot-product instruction alone cannot make bf16 twice as fast as f32. AMX's
//! `tdpbf16ps` (a 16 x 16 x 32 product per instruction) peaks near 3,500, and is what
//! oneDNN (PyTorch) uses there. All three kernels read the same packed operands (see
//! [`pack`]) and compute 32 x 32 blocks of `C` over the whole inner dimension; the
//! driver runs 32-row bands of `C` in parallel.
//!
//! [`Bf16Matmul`] wraps it as a candle op whose backward is two more such GEMMs;
//! [`linear_bf16`] is `x W^T` for a linear layer.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::elem::Elem;
use crate::error::{shape_err, KernelError};

mod pack;
mod tile;

use std::sync::OnceLock;

use pack::{a_words, b_words, pack_a, pack_b, PackedA, PackedB};
use tile::{Block, BLOCK};

/// Which bf16 GEMM kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// AMX tiles (`tdpbf16ps`, 16 x 16 x 32 per instruction), where the CPU has AMX-BF16
    /// and Linux grants the process the tile state.
    Amx,
    /// AVX512-BF16 `vdpbf16ps` (with AVX512F/BW).
    Avx512Bf16,
    /// Plain Rust over the same packed layout (any CPU).
    Portable,
}

impl Bf16Kernel {
    /// The fastest kernel this CPU and OS support, detected once per process.
    pub fn detect() -> Self {
        Self::supported()[0]
    }

    /// Every kernel this CPU can run, fastest first (always ends with `Portable`).
    pub fn available() -> Vec<Self> {
        Self::supported().to_vec()
    }

    /// [`Bf16Kernel::available`], detected once per process (CPUID, and for AMX a system
    /// call), so the GEMM's per-call check costs a slice search.
    fn supported() -> &'static [Self] {
        static SUPPORTED: OnceLock<Vec<Bf16Kernel>> = OnceLock::new();
        SUPPORTED.get_or_init(|| {
            let mut out = Vec::new();
            #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
            {
                // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
                let cpu = std::arch::x86_64::__cpuid_count(7, 0).edx;
                let has = cpu >> 22 & 1 == 1 && cpu >> 24 & 1 == 1;
                if has && tile::amx::request_permission() {
                    out.push(Bf16Kernel::Amx);
                }
            }
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512bf16")
                {
                    out.push(Bf16Kernel::Avx512Bf16);
                }
            }
            out.push(Bf16Kernel::Portable);
            out
        })
    }
}

/// Whether this CPU has a native bf16 matrix unit or dot product (so a bf16 matmul
/// here is not an emulation through f32).
pub fn bf16_native() -> bool {
    Bf16Kernel::detect() != Bf16Kernel::Portable
}

/// An element a GEMM operand may be stored in: bf16 as is, or f32 rounded to bf16
/// (nearest-even) while packing, so f32 activations need no separate cast.
pub trait Bf16Source: Copy + Send + Sync {
    /// The bf16 bit pattern of the value.
    fn bf16_bits(self) -> u16;
    /// The slice as f32, when that is what it holds (packing has a vector path for it).
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        let _ = s;
        None
    }
}

impl Bf16Source for bf16 {
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        self.to_bits()
    }
}

impl Bf16Source for f32 {
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        crate::fastmath::to_bf16(self).to_bits()
    }
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
}

/// A contiguous matrix of logical shape `rows x cols` (bf16, or f32 rounded to bf16);
/// `transposed` means it is stored as its transpose (`cols x rows`, row-major), as a
/// weight `[out, in]` is for `x W^T`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a, S = bf16> {
    /// The elements, row-major in storage order.
    pub data: &'a [S],
    /// Logical rows.
    pub rows: usize,
    /// Logical columns.
    pub cols: usize,
    /// Stored transposed.
    pub transposed: bool,
}

impl<'a, S> MatRef<'a, S> {
    /// A `rows x cols` matrix stored row-major.
    pub fn new(data: &'a [S], rows: usize, cols: usize) -> Self {
        MatRef {
            data,
            rows,
            cols,
            transposed: false,
        }
    }

    /// A `rows x cols` matrix stored as its transpose (`cols x rows`, row-major).
    pub fn transposed(data: &'a [S], rows: usize, cols: usize) -> Self {
        MatRef {
            data,
            rows,
            cols,
            transposed: true,
        }
    }
}

/// Storage for a GEMM's packed operands, kept by a caller that runs many GEMMs (the GPT's
/// direct step) so that packing reuses it instead of allocating per call: per-call
/// buffers of changing sizes left the allocator holding pages beyond what was live.
/// Sized up front for the largest GEMM a caller will run ([`PackBuffers::for_shapes`]);
/// grows if one is larger.
#[derive(Debug, Default)]
pub struct PackBuffers {
    a: Box<[u32]>,
    b: Box<[u32]>,
}

impl PackBuffers {
    /// Buffers large enough for every `(m, k, n)` GEMM (`A` `m x k`, `B` `k x n`) of
    /// `shapes`: the largest packed `A` and the largest packed `B` among them.
    pub fn for_shapes(shapes: impl IntoIterator<Item = (usize, usize, usize)>) -> Self {
        let (a, b) = Self::words_for(shapes);
        PackBuffers {
            a: vec![0; a].into(),
            b: vec![0; b].into(),
        }
    }

    /// The words [`PackBuffers::for_shapes`] holds for `shapes`: (packed `A`, packed `B`).
    pub fn words_for(shapes: impl IntoIterator<Item = (usize, usize, usize)>) -> (usize, usize) {
        shapes.into_iter().fold((0, 0), |(a, b), (m, k, n)| {
            (a.max(a_words(m, k)), b.max(b_words(k, n)))
        })
    }

    /// Bytes held, counted from the buffers.
    pub fn bytes(&self) -> usize {
        4 * (self.a.len() + self.b.len())
    }

    /// The two buffers, grown first where an `m x k` by `k x n` GEMM needs more.
    fn for_gemm(&mut self, (m, k, n): (usize, usize, usize)) -> (&mut [u32], &mut [u32]) {
        let grow = |buf: &mut Box<[u32]>, words: usize| {
            if buf.len() < words {
                *buf = vec![0; words].into();
            }
        };
        grow(&mut self.a, a_words(m, k));
        grow(&mut self.b, b_words(k, n));
        (&mut self.a, &mut self.b)
    }
}

/// Computes every 32 x 32 block of one 32-row band of `C` with `kernel`.
fn band<T: Elem>(
    kernel: Bf16Kernel,
    (a, b): (&PackedA, &PackedB),
    rb: usize,
    c: &mut [T],
    n: usize,
    bias: Option<&[f32]>,
    accumulate: bool,
) {
    debug_assert_eq!(a.pairs, b.pairs);
    // A kernel this CPU cannot run is refused here, not trusted from the caller (the
    // detection is cached: a search of at most three entries).
    assert!(
        Bf16Kernel::supported().contains(&kernel),
        "bf16 GEMM: the {kernel:?} kernel is not supported on this CPU"
    );
    let rows = c.len() / n;
    let mut block: Block = [0.0; BLOCK * BLOCK];
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    let tiles = match kernel {
        Bf16Kernel::Amx => Some(tile::amx::Tiles::configure().expect("AMX supported (asserted)")),
        _ => None,
    };
    for q in 0..b.panels / 2 {
        match kernel {
            #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
            Bf16Kernel::Amx => tiles
                .as_ref()
                .expect("configured")
                .block(a, b, rb, q, &mut block),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: asserted at the top of this function: the CPU supports the
            // AVX512-BF16 kernel (AVX512F, AVX512BW and AVX512-BF16 detected).
            Bf16Kernel::Avx512Bf16 => unsafe { tile::block_avx512(a, b, rb, q, &mut block) },
            _ => tile::block_portable(a, b, rb, q, &mut block),
        }
        let (c0, cols) = (q * BLOCK, BLOCK.min(n - q * BLOCK));
        for r in 0..rows {
            let src = &block[r * BLOCK..r * BLOCK + cols];
            let dst = &mut c[r * n + c0..r * n + c0 + cols];
            match bias {
                _ if accumulate => dst
                    .iter_mut()
                    .zip(src)
                    .enumerate()
                    .for_each(|(j, (d, &v))| {
                        let b = bias.map_or(0.0, |b| b[c0 + j]);
                        *d = T::from_f32(d.to_f32() + v + b)
                    }),
                Some(bias) => dst
                    .iter_mut()
                    .zip(src.iter().zip(&bias[c0..c0 + cols]))
                    .for_each(|(d, (&v, &b))| *d = T::from_f32(v + b)),
                None => dst
                    .iter_mut()
                    .zip(src)
                    .for_each(|(d, &v)| *d = T::from_f32(v)),
            }
        }
    }
}

/// `C = A . B` in f32 (`A` `m x k`, `B` `k x n`, either stored transposed or not), bf16
/// products accumulated in f32 by `kernel`, which must be one of [`Bf16Kernel::available`].
pub fn gemm_bf16_with<SA: Bf16Source, SB: Bf16Source>(
    kernel: Bf16Kernel,
    a: &MatRef<SA>,
    b: &MatRef<SB>,
) -> std::result::Result<Vec<f32>, KernelError> {
    gemm_into(kernel, a, b, None)
}

/// The GEMM, writing `C` in `T`; with `bias` (`n` values) added to every row in f32
/// before each element's single rounding.
pub(crate) fn gemm_into<T: Elem, SA: Bf16Source, SB: Bf16Source>(
    kernel: Bf16Kernel,
    a: &MatRef<SA>,
    b: &MatRef<SB>,
    bias: Option<&[f32]>,
) -> std::result::Result<Vec<T>, KernelError> {
    let mut c = vec![T::from_f32(0.0); a.rows * b.cols];
    gemm_write(
        kernel,
        a,
        b,
        bias,
        &mut c,
        false,
        &mut PackBuffers::default(),
    )?;
    Ok(c)
}

/// The GEMM into a caller's `C` (`m x n`, row-major): `C = A . B + bias`, or with
/// `accumulate` `C += A . B + bias`, each element rounded once; the operands packed into
/// `packs`.
pub(crate) fn gemm_write<T: Elem, SA: Bf16Source, SB: Bf16Source>(
    kernel: Bf16Kernel,
    a: &MatRef<SA>,
    b: &MatRef<SB>,
    bias: Option<&[f32]>,
    c: &mut [T],
    accumulate: bool,
    packs: &mut PackBuffers,
) -> std::result::Result<(), KernelError> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k || a.data.len() != m * k || b.data.len() != k * n || c.len() != m * n {
        return Err(KernelError::Shape {
            op: "bf16-matmul",
            msg: format!(
                "A is {m} x {k} ({} elements), B is {} x {n} ({} elements), C has {} elements",
                a.data.len(),
                b.rows,
                b.data.len(),
                c.len()
            ),
            shape: Shape::from((m, k)),
        });
    }
    if bias.is_some_and(|v| v.len() != n) {
        return Err(KernelError::Shape {
            op: "bf16-matmul",
            msg: format!("bias must have {n} values"),
            shape: Shape::from(bias.map_or(0, |v| v.len())),
        });
    }
    if !Bf16Kernel::supported().contains(&kernel) {
        return Err(KernelError::Unsupported {
            op: "bf16-matmul",
            what: format!("{kernel:?} kernel on this CPU"),
        });
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        // An empty sum: C is the bias (or keeps its value plus the bias).
        for row in c.chunks_exact_mut(n) {
            for (j, d) in row.iter_mut().enumerate() {
                let base = if accumulate { d.to_f32() } else { 0.0 };
                *d = T::from_f32(base + bias.map_or(0.0, |b| b[j]));
            }
        }
        return Ok(());
    }
    let (wa, wb) = packs.for_gemm((m, k, n));
    let (pa, pb) = rayon::join(|| pack_a(a, wa), || pack_b(b, wb));
    c.par_chunks_mut(BLOCK * n)
        .enumerate()
        .for_each(|(rb, c)| band(kernel, (&pa, &pb), rb, c, n, bias, accumulate));
    Ok(())
}

/// [`gemm_bf16_with`] on the detected kernel.
pub fn gemm_bf16<SA: Bf16Source, SB: Bf16Source>(
    a: &MatRef<SA>,
    b: &MatRef<SB>,
) -> std::result::Result<Vec<f32>, KernelError> {
    gemm_bf16_with(Bf16Kernel::detect(), a, b)
}

/// `op(A) . op(B)` on 2-D bf16 tensors as a differentiable candle op, where `op`
/// transposes an operand stored transposed: `a_t` means `a` holds `A^T` (`k x m`),
/// `b_t` that `b` holds `B^T` (`n x k`). Output bf16 `m x n`, rounded once from f32.
#[derive(Debug, Clone, Copy)]
pub struct Bf16Matmul {
    /// `a` stores `A` transposed.
    pub a_t: bool,
    /// `b` stores `B` transposed.
    pub b_t: bool,
}

fn bf16_slice<'a>(op: &'static str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [bf16]> {
    let (lo, hi) = l
        .contiguous_offsets()
        .ok_or(KernelError::NotContiguous { op })?;
    match s {
        CpuStorage::BF16(v) => Ok(&v[lo..hi]),
        other => Err(KernelError::DType {
            op,
            dtype: candle_core::backend::BackendStorage::dtype(other),
            extra: "; this op is bf16 only",
        }
        .into()),
    }
}

impl CustomOp2 for Bf16Matmul {
    fn name(&self) -> &'static str {
        "bf16-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (&[r1, c1], &[r2, c2]) = (l1.dims(), l2.dims()) else {
            return Err(shape_err(op, "both operands must be 2-D", l1.shape()));
        };
        let (m, k) = if self.a_t { (c1, r1) } else { (r1, c1) };
        let (kb, n) = if self.b_t { (c2, r2) } else { (r2, c2) };
        if kb != k {
            return Err(shape_err(
                op,
                format!("inner dimensions differ: A is {m} x {k}, B is {kb} x {n}"),
                l2.shape(),
            ));
        }
        let a = MatRef {
            data: bf16_slice(op, s1, l1)?,
            rows: m,
            cols: k,
            transposed: self.a_t,
        };
        let b = MatRef {
            data: bf16_slice(op, s2, l2)?,
            rows: k,
            cols: n,
            transposed: self.b_t,
        };
        let c: Vec<bf16> = gemm_into(Bf16Kernel::detect(), &a, &b, None)?;
        Ok((CpuStorage::BF16(c), Shape::from((m, n))))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.contiguous()?;
        let mm = |x: &Tensor, x_t: bool, y: &Tensor, y_t: bool| {
            x.apply_op2_no_bwd(y, &Bf16Matmul { a_t: x_t, b_t: y_t })
        };
        // dA = G op(B)^T, stored as A is; dB = op(A)^T G, stored as B is.
        let da = if self.a_t {
            mm(b, self.b_t, &g, true)?
        } else {
            mm(&g, false, b, !self.b_t)?
        };
        let db = if self.b_t {
            mm(&g, true, a, self.a_t)?
        } else {
            mm(a, !self.a_t, &g, false)?
        };
        Ok((Some(da), Some(db)))
    }
}

/// `x W^T` for a linear layer: `x` `[.., in]`, `w` `[out, in]`, both bf16; differentiable
/// in both. One 2-D GEMM over all leading dimensions.
pub fn linear_bf16(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let op = "bf16-linear";
    for t in [x, w] {
        if t.dtype() != DType::BF16 {
            return Err(KernelError::DType {
                op,
                dtype: t.dtype(),
                extra: "; this op is bf16 only",
            }
            .into());
        }
    }
    let dims = x.dims().to_vec();
    let Some((&k, lead)) = dims.split_last() else {
        return Err(shape_err(
            op,
            "x must have at least one dimension",
            x.shape(),
        ));
    };
    let (out, win) = w.dims2()?;
    if win != k {
        return Err(shape_err(
            op,
            format!("x has {k} features, the weight expects {win}"),
            x.shape(),
        ));
    }
    let x2 = x.contiguous()?.reshape(((), k))?;
    let y = x2.apply_op2(
        &w.contiguous()?,
        Bf16Matmul {
            a_t: false,
            b_t: true,
        },
    )?;
    let mut shape = lead.to_vec();
    shape.push(out);
    y.reshape(shape)
}

/// `a . b` for 2-D bf16 tensors, differentiable.
pub fn matmul_bf16(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.contiguous()?.apply_op2(
        &b.contiguous()?,
        Bf16Matmul {
            a_t: false,
            b_t: false,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `gemm_write` into a caller's buffer: overwrite and accumulate, with and without a
    /// bias, on every kernel this CPU runs, against an f64 reference of the same
    /// bf16-rounded operands (odd sizes: partial blocks, panels and pairs).
    #[test]
    fn gemm_write_overwrites_and_accumulates() {
        let (m, k, n) = (37, 19, 21);
        let val = |i: usize, s: usize| (((i * 7919 + s * 104_729) % 211) as f32 - 105.0) / 64.0;
        let a: Vec<f32> = (0..m * k).map(|i| val(i, 1)).collect();
        let b: Vec<f32> = (0..k * n).map(|i| val(i, 2)).collect();
        let bias: Vec<f32> = (0..n).map(|i| val(i, 3)).collect();
        let c0: Vec<f32> = (0..m * n).map(|i| val(i, 4)).collect();
        let r = |v: f32| half::bf16::from_f32(v).to_f64();
        // Buffers reused from call to call, and holding stale words: padding must not
        // read them.
        let mut packs = PackBuffers::for_shapes([(64, 64, 64)]);
        packs.a.fill(0x3F80_3F80);
        packs.b.fill(0x3F80_3F80);
        for kernel in Bf16Kernel::available() {
            for (accumulate, with_bias) in
                [(false, false), (false, true), (true, false), (true, true)]
            {
                let mut c = c0.clone();
                let bias = with_bias.then_some(&bias[..]);
                gemm_write(
                    kernel,
                    &MatRef::new(&a, m, k),
                    &MatRef::new(&b, k, n),
                    bias,
                    &mut c,
                    accumulate,
                    &mut packs,
                )
                .unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let dot: f64 = (0..k).map(|p| r(a[i * k + p]) * r(b[p * n + j])).sum();
                        let base = if accumulate {
                            c0[i * n + j] as f64
                        } else {
                            0.0
                        };
                        let want = base + dot + bias.map_or(0.0, |v| v[j] as f64);
                        let got = c[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{kernel:?} accumulate {accumulate} bias {with_bias} ({i}, {j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
