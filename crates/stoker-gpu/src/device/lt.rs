//! The device's matrix products through cuBLASLt, as llm.c's `matmul_cublaslt`: a linear
//! layer's bias added in the product's epilogue (one rounding, no second pass over the
//! output), f32 accumulation, and weight gradients accumulated with beta = 1.
//!
//! Each product's shape is planned once: its descriptor, the three layouts and the
//! algorithm cuBLASLt's heuristic picks for the operands' alignments, cached by shape.
//! A shape the heuristic has no algorithm for, or whose planning or launch cuBLASLt
//! refuses, is remembered as such (the first refusal kept for the device check to print),
//! and the caller runs it through cuBLAS instead ([`Lt::gemm`] returns `false`): a run
//! goes on where cuBLASLt cannot serve a shape.

use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::call::{AbTypes, Addr, Gemm};
use crate::elem::{Dtype, Fp8Dtype};
use crate::error::GpuError;

/// The workspace cuBLASLt may use per product: NVIDIA's recommendation for Hopper (llm.c
/// uses the same). Allocated at the first product, so the driver's memory figure of a
/// run counts it.
pub(super) const WORKSPACE_BYTES: usize = 32 << 20;

/// The largest alignment told to the heuristic: cuBLASLt's pointers are 256-byte aligned
/// by default, and a view into a flat buffer may be less.
const MAX_ALIGN: u32 = 256;

/// The epilogue takes a bias this aligned (llm.c checks the same); a less aligned one is
/// added by the `add_bias` kernel after the product.
const BIAS_ALIGN: u64 = 16;

/// `g`'s bias where the epilogue can take it: aligned to [`BIAS_ALIGN`], and for FP8
/// operands only into bf16 (cuBLASLt's FP8 products take no f32 bias; PyTorch's
/// `_scaled_mm` refuses a bias with an f32 output for the same reason). Otherwise the
/// `add_bias` kernel adds it after the product.
pub(super) fn epilogue_bias(g: &Gemm) -> Option<Addr> {
    let fp8_into_other = matches!(g.ab, AbTypes::Fp8 { .. }) && g.c_type != Dtype::Bf16;
    g.bias.filter(|b| b % BIAS_ALIGN == 0 && !fp8_into_other)
}

fn lt_err(what: impl Into<String>) -> impl FnOnce(lt::CublasError) -> GpuError {
    let what = what.into();
    move |e| GpuError::Driver {
        what,
        error: format!("{e:?}"),
    }
}

/// The largest power of two, at most [`MAX_ALIGN`], that divides the address of every
/// batch entry of an operand at `addr`, `stride` elements of `bytes` bytes apart.
fn alignment(addr: Addr, stride: usize, batch: usize, bytes: usize) -> u32 {
    let step = if batch > 1 {
        (stride * bytes) as u64
    } else {
        0
    };
    match addr | step {
        0 => MAX_ALIGN,
        x => (1u32 << x.trailing_zeros().min(31)).min(MAX_ALIGN),
    }
}

/// What an operand holds, in cuBLASLt's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Elems {
    Act(Dtype),
    Fp8(Fp8Dtype),
}

fn data_type(e: Elems) -> sys::cudaDataType {
    match e {
        Elems::Act(Dtype::F32) => sys::cudaDataType_t::CUDA_R_32F,
        Elems::Act(Dtype::Bf16) => sys::cudaDataType_t::CUDA_R_16BF,
        Elems::Act(Dtype::F16) => sys::cudaDataType_t::CUDA_R_16F,
        Elems::Fp8(Fp8Dtype::E4m3) => sys::cudaDataType_t::CUDA_R_8F_E4M3,
        Elems::Fp8(Fp8Dtype::E5m2) => sys::cudaDataType_t::CUDA_R_8F_E5M2,
    }
}

/// `A`'s and `B`'s elements (ours, row-major).
fn operand_elems(ab: AbTypes) -> [Elems; 2] {
    match ab {
        AbTypes::Act(d) => [Elems::Act(d); 2],
        AbTypes::Fp8 { a, b } => [Elems::Fp8(a), Elems::Fp8(b)],
    }
}

/// What a plan depends on: the product's shape and types, whether the epilogue adds a
/// bias, and each operand's alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    mnk: [usize; 3],
    lds: [usize; 3],
    trans: [bool; 2],
    batch: usize,
    strides: [usize; 3],
    ab: AbTypes,
    c_type: Dtype,
    bias: bool,
    align: [u32; 3],
}

/// A matrix layout descriptor, destroyed with the plan.
struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    /// `rows x cols` column-major with leading dimension `ld`, `batch` of them `stride`
    /// elements apart.
    fn new(
        ty: Elems,
        (rows, cols, ld): (usize, usize, usize),
        batch: usize,
        stride: usize,
    ) -> Result<Self, GpuError> {
        let err = || lt_err(format!("a cuBLASLt layout {rows}x{cols} (ld {ld})"));
        let handle = lt::create_matrix_layout(data_type(ty), rows as u64, cols as u64, ld as i64)
            .map_err(err())?;
        let layout = Layout(handle);
        if batch > 1 {
            let count = i32::try_from(batch).map_err(|_| GpuError::Shape {
                kernel: "matmul",
                what: format!("a batch of {batch} exceeds cuBLASLt's 32-bit count"),
            })?;
            let offset = stride as i64;
            // SAFETY: `handle` is a live layout; each value is the attribute's documented
            // type (int32 count, int64 stride) and outlives the call, which copies it.
            unsafe {
                lt::set_matrix_layout_attribute(
                    handle,
                    sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                    (&count as *const i32).cast(),
                    std::mem::size_of::<i32>(),
                )
                .map_err(err())?;
                lt::set_matrix_layout_attribute(
                    handle,
                    sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    (&offset as *const i64).cast(),
                    std::mem::size_of::<i64>(),
                )
                .map_err(err())?;
            }
        }
        Ok(layout)
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `new` and is destroyed once; a failure here
        // leaks a host-side descriptor, nothing else.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

/// A matmul descriptor, destroyed with the plan.
struct Desc(sys::cublasLtMatmulDesc_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: as for `Layout`.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

/// A heuristic preference, dropped once the plan's algorithm is chosen.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: as for `Layout`.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

/// One shape's descriptor, layouts (cuBLASLt's A, B and C = D) and algorithm.
struct Plan {
    desc: Desc,
    a: Layout,
    b: Layout,
    c: Layout,
    algo: sys::cublasLtMatmulAlgo_t,
}

/// cuBLASLt's handle, its workspace and the plans made so far.
pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: OnceCell<CudaSlice<u8>>,
    /// `None`: the heuristic had no algorithm for that shape, or cuBLASLt refused it
    /// (cuBLAS runs it).
    plans: RefCell<HashMap<Key, Option<Plan>>>,
    /// The first refusal, if cuBLASLt refused a shape.
    refused: RefCell<Option<String>>,
}

// SAFETY: the handle and the descriptors are host objects that cuBLASLt lets any thread
// use while the context is current (`Device` binds it before each product); `Lt` is
// used through `&self` by one thread at a time (its `RefCell` keeps it `!Sync`).
unsafe impl Send for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        self.plans.get_mut().clear();
        // Destroying the handle synchronizes with the device: its context must be current.
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: the handle was created in `new`, every plan using it is gone, and it is
        // destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

impl Lt {
    /// A cuBLASLt handle for products on `stream`.
    pub(super) fn new(stream: Arc<CudaStream>) -> Result<Self, GpuError> {
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| GpuError::Driver {
                what: "making the context current for cuBLASLt".into(),
                error: e.to_string(),
            })?;
        let handle = lt::create_handle().map_err(lt_err("creating a cuBLASLt handle"))?;
        Ok(Lt {
            handle,
            stream,
            workspace: OnceCell::new(),
            plans: RefCell::new(HashMap::new()),
            refused: RefCell::new(None),
        })
    }

    /// Shapes planned so far, how many of them run through cuBLAS (no algorithm, or
    /// refused), and the first refusal.
    pub(super) fn planned(&self) -> (usize, usize, Option<String>) {
        let plans = self.plans.borrow();
        let without = plans.values().filter(|p| p.is_none()).count();
        (plans.len(), without, self.refused.borrow().clone())
    }

    /// Keeps `e` as the first refusal (if it is).
    fn refuse(&self, e: GpuError) {
        self.refused
            .borrow_mut()
            .get_or_insert_with(|| e.to_string());
    }

    /// Allocates the workspace where it is not yet (before a graph capture, which must
    /// not allocate).
    pub(super) fn ensure_workspace(&self) -> Result<(), GpuError> {
        self.workspace().map(|_| ())
    }

    fn workspace(&self) -> Result<u64, GpuError> {
        if self.workspace.get().is_none() {
            // SAFETY: cuBLASLt writes the workspace before it reads it; nothing else does.
            let buf = unsafe { self.stream.alloc::<u8>(WORKSPACE_BYTES) }.map_err(|e| {
                GpuError::Driver {
                    what: format!("allocating cuBLASLt's {WORKSPACE_BYTES}-byte workspace"),
                    error: e.to_string(),
                }
            })?;
            let _ = self.workspace.set(buf);
        }
        let buf = self.workspace.get().expect("set above");
        let (ptr, _record) = buf.device_ptr(&self.stream);
        Ok(ptr)
    }

    /// Runs `g` with `bias` (its bias, or none) in the epilogue; `Ok(false)` when
    /// cuBLASLt does not serve its shape (nothing was launched).
    ///
    /// # Safety
    /// As [`crate::Backend::gemm`]: every operand's extent lies in a live buffer of this
    /// stream's context, which is current on this thread; `bias` holds `g.n` elements of
    /// `g.c_type`, aligned to [`BIAS_ALIGN`] bytes ([`epilogue_bias`]).
    pub(super) unsafe fn gemm(&self, g: &Gemm, bias: Option<Addr>) -> Result<bool, GpuError> {
        let key = Key {
            mnk: [g.m, g.n, g.k],
            lds: [g.a.ld, g.b.ld, g.ldc],
            trans: [g.a.trans, g.b.trans],
            batch: g.batch,
            strides: g.strides,
            ab: g.ab,
            c_type: g.c_type,
            bias: bias.is_some(),
            align: [
                alignment(g.a.addr, g.strides[0], g.batch, g.ab.bytes()[0]),
                alignment(g.b.addr, g.strides[1], g.batch, g.ab.bytes()[1]),
                alignment(g.c, g.strides[2], g.batch, g.c_type.bytes()),
            ],
        };
        let workspace = self.workspace()?;
        let mut plans = self.plans.borrow_mut();
        let slot = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(self.plan(&key, bias, g.scale_inv).unwrap_or_else(|err| {
                    self.refuse(err);
                    None
                }))
            }
        };
        let Some(plan) = slot.as_ref() else {
            return Ok(false);
        };
        let what = || {
            format!(
                "cuBLASLt product {}x{}x{} (batch {})",
                g.m, g.n, g.k, g.batch
            )
        };
        if let Some(b) = bias {
            // SAFETY: the descriptor is live; the value is a device pointer, the
            // attribute's type, and cuBLASLt copies it.
            let set = unsafe {
                lt::set_matmul_desc_attribute(
                    plan.desc.0,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (&b as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
            if let Err(e) = set {
                self.refuse(lt_err(what())(e));
                *slot = None;
                return Ok(false);
            }
        }
        if let AbTypes::Fp8 { .. } = g.ab {
            // cuBLASLt's A is our B: its scale is our B's scale_inv.
            use sys::cublasLtMatmulDescAttributes_t as D;
            for (attr, ptr) in [
                (D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, g.scale_inv[1]),
                (D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, g.scale_inv[0]),
            ] {
                // SAFETY: the descriptor is live; the value is a device pointer to one
                // f32 (matmul_fp8 checked it), the attribute's type; cuBLASLt copies it.
                let set = unsafe {
                    lt::set_matmul_desc_attribute(
                        plan.desc.0,
                        attr,
                        (&ptr as *const u64).cast(),
                        std::mem::size_of::<u64>(),
                    )
                };
                if let Err(e) = set {
                    self.refuse(lt_err(what())(e));
                    *slot = None;
                    return Ok(false);
                }
            }
        }
        let (alpha, beta) = (1f32, if g.accumulate { 1f32 } else { 0f32 });
        // Row-major C = A B is column-major C^T = B^T A^T: cuBLASLt's A is our B.
        // SAFETY: the caller's contract for the operands; the plan's layouts describe
        // them (made from this key); alpha and beta are read before the call returns; the
        // workspace holds WORKSPACE_BYTES, the size the plan's algorithm was chosen for.
        let launched = unsafe {
            lt::matmul(
                self.handle,
                plan.desc.0,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                g.b.addr as usize as *const c_void,
                plan.a.0,
                g.a.addr as usize as *const c_void,
                plan.b.0,
                g.c as usize as *const c_void,
                plan.c.0,
                g.c as usize as *mut c_void,
                plan.c.0,
                &plan.algo,
                workspace as usize as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as _,
            )
        }
        .map_err(lt_err(what()));
        match launched {
            Ok(()) => Ok(true),
            // Refused before anything ran (a status, not a fault): cuBLAS runs it, now and
            // from now on.
            Err(e) => {
                self.refuse(e);
                *slot = None;
                Ok(false)
            }
        }
    }

    /// The descriptor, layouts and the heuristic's first algorithm for `key` (with the
    /// first call's bias pointer set, as llm.c does, and for FP8 its scale pointers, as
    /// Transformer Engine does); `None` if it has none.
    fn plan(
        &self,
        key: &Key,
        bias: Option<u64>,
        scale_inv: [Addr; 2],
    ) -> Result<Option<Plan>, GpuError> {
        let [m, n, k] = key.mnk;
        let [lda, ldb, ldc] = key.lds;
        let [ta, tb] = key.trans;
        let [elems_a, elems_b] = operand_elems(key.ab);
        let c_type = Elems::Act(key.c_type);
        let what = || {
            format!(
                "planning a cuBLASLt product {m}x{n}x{k} (batch {})",
                key.batch
            )
        };
        let desc = Desc(
            lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType_t::CUDA_R_32F,
            )
            .map_err(lt_err(what()))?,
        );
        let set_desc = |attr, value: *const c_void, size: usize| {
            // SAFETY: the descriptor is live; each value below is its attribute's type.
            unsafe { lt::set_matmul_desc_attribute(desc.0, attr, value, size) }
                .map_err(lt_err(what()))
        };
        use sys::cublasLtMatmulDescAttributes_t as D;
        // cuBLASLt's A is our B (transposed when ours is stored transposed), its B our A.
        let (op_a, op_b) = (tb as i32, ta as i32);
        set_desc(
            D::CUBLASLT_MATMUL_DESC_TRANSA,
            (&op_a as *const i32).cast(),
            4,
        )?;
        set_desc(
            D::CUBLASLT_MATMUL_DESC_TRANSB,
            (&op_b as *const i32).cast(),
            4,
        )?;
        let epilogue = if key.bias {
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS
        } else {
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT
        };
        set_desc(
            D::CUBLASLT_MATMUL_DESC_EPILOGUE,
            (&epilogue as *const sys::cublasLtEpilogue_t).cast(),
            std::mem::size_of::<sys::cublasLtEpilogue_t>(),
        )?;
        if let Some(b) = bias {
            set_desc(
                D::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                (&b as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )?;
        }
        if let AbTypes::Fp8 { .. } = key.ab {
            // Per-tensor scaling: cuBLASLt's A is our B. Fast accumulation stays off (its
            // default): the tensor cores' partial sums are promoted to f32, Transformer
            // Engine's choice for the gradients' products.
            let [ours_a, ours_b] = scale_inv;
            set_desc(
                D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                (&ours_b as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )?;
            set_desc(
                D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                (&ours_a as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )?;
        }
        // Stored column-major: our B (k x n row-major) is n x k, or k x n when transposed.
        let a_shape = if tb { (k, n, ldb) } else { (n, k, ldb) };
        let b_shape = if ta { (m, k, lda) } else { (k, m, lda) };
        let [sa, sb, sc] = key.strides;
        let a = Layout::new(elems_b, a_shape, key.batch, sb)?;
        let b = Layout::new(elems_a, b_shape, key.batch, sa)?;
        let c = Layout::new(c_type, (n, m, ldc), key.batch, sc)?;
        let pref = Pref(lt::create_matmul_pref().map_err(lt_err(what()))?);
        let [align_a, align_b, align_c] = key.align;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        let prefs: [(P, u64, usize); 5] = [
            (
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                WORKSPACE_BYTES as u64,
                8,
            ),
            (
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                align_b as u64,
                4,
            ),
            (
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                align_a as u64,
                4,
            ),
            (
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                align_c as u64,
                4,
            ),
            (
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                align_c as u64,
                4,
            ),
        ];
        for (attr, value, size) in prefs {
            let (v64, v32) = (value, value as u32);
            let ptr: *const c_void = if size == 8 {
                (&v64 as *const u64).cast()
            } else {
                (&v32 as *const u32).cast()
            };
            // SAFETY: the preference is live; the workspace size is a uint64 and the
            // alignments uint32, as cuBLASLt documents; the value outlives the call.
            unsafe { lt::set_matmul_pref_attribute(pref.0, attr, ptr, size) }
                .map_err(lt_err(what()))?;
        }
        // SAFETY: every descriptor is live; C and D share one layout (products in place).
        match unsafe {
            lt::get_matmul_algo_heuristic(self.handle, desc.0, a.0, b.0, c.0, c.0, pref.0)
        } {
            Ok(h) => Ok(Some(Plan {
                desc,
                a,
                b,
                c,
                algo: h.algo,
            })),
            Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => Ok(None),
            Err(e) => Err(lt_err(what())(e)),
        }
    }
}
