//! Embedding lookup with a scatter-add backward.
//!
//! Forward copies row `ids[i]` of the table `[V, C]` for every id. Backward adds each
//! `dout[i]` into row `ids[i]` of a zeroed `[V, C]` gradient: parallel over column
//! blocks, so two threads never touch the same element and repeated ids need no
//! atomics; within a block, ids are visited in order, so the sums are deterministic.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::elem::{check_float, floats, targets, Elem, Floats, Targets};
use crate::error::{shape_err, KernelError};

/// Rows `ids` (u32 or i64, any shape) of `table` `[V, C]` (f32 or bf16): `[ids.., C]`.
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    check_float("embedding", table.dtype())?;
    let flat = ids.flatten_all()?.contiguous()?;
    let out = table.contiguous()?.apply_op2(&flat, Embedding)?;
    let mut dims = ids.dims().to_vec();
    dims.push(table.dim(1)?);
    out.reshape(dims)
}

/// The embedding forward op; use [`embedding`].
#[derive(Debug, Clone, Copy)]
pub struct Embedding;

/// `(V, C)`, checking the table is 2-D and every id is a row of it.
fn check(op: &'static str, table: &Shape, ids: &Targets) -> Result<(usize, usize)> {
    let (v, c) = match table.dims() {
        &[v, c] if c > 0 => (v, c),
        _ => return Err(shape_err(op, "table must be [V, C] with C > 0", table)),
    };
    for pos in 0..ids.len() {
        let id = ids.get(pos);
        if !(0..v as i64).contains(&id) {
            return Err(KernelError::Index {
                op,
                pos,
                id,
                rows: v,
            }
            .into());
        }
    }
    Ok((v, c))
}

fn fwd<T: Elem>(table: &[T], ids: &Targets, c: usize) -> Vec<T> {
    let mut out = vec![T::from_f32(0.0); ids.len() * c];
    out.par_chunks_mut(c).enumerate().for_each(|(i, row)| {
        let id = ids.get(i) as usize;
        row.copy_from_slice(&table[id * c..(id + 1) * c]);
    });
    out
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let ids = targets(op, s2, l2)?;
        let (_, c) = check(op, l1.shape(), &ids)?;
        let out = match floats(op, s1, l1)? {
            Floats::F32(t) => f32::storage(fwd(t, &ids, c)),
            Floats::BF16(t) => bf16::storage(fwd(t, &ids, c)),
        };
        Ok((out, Shape::from((ids.len(), c))))
    }

    fn bwd(
        &self,
        table: &Tensor,
        ids: &Tensor,
        _out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let back = EmbeddingBackward {
            rows: table.dim(0)?,
        };
        Ok((Some(dout.contiguous()?.apply_op2_no_bwd(ids, &back)?), None))
    }
}

/// Embedding's backward: scatter-add of `dout` `[N, C]` into a zeroed `[rows, C]`.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddingBackward {
    rows: usize,
}

/// Columns per rayon task: at least 16, about an even split over the threads.
fn col_block(c: usize) -> usize {
    c.div_ceil(rayon::current_num_threads().max(1)).max(16)
}

fn bwd<T: Elem>(dout: &[T], ids: &Targets, rows: usize, c: usize) -> Vec<T> {
    let mut grad = vec![0.0f32; rows * c];
    scatter_add(dout, |i| ids.get(i) as usize, c, &mut grad);
    grad.into_iter().map(T::from_f32).collect()
}

/// Adds row `i` of `dout` (`[N, c]`) into row `row_of(i)` of `grad` (`[rows, c]`, f32),
/// parallel over column blocks, ids in order within a block (deterministic).
pub(crate) fn scatter_add<T: Elem>(
    dout: &[T],
    row_of: impl Fn(usize) -> usize + Sync,
    c: usize,
    grad: &mut [f32],
) {
    if c == 0 {
        return;
    }
    let block = col_block(c).max(1);
    let starts: Vec<usize> = (0..c).step_by(block).collect();
    let len = grad.len();
    // Each task owns columns [c0, c0 + w) of every row, w = min(block, c - c0) so that
    // c0 + w <= c: no two tasks write the same element.
    let grad_ptr = SyncPtr(grad.as_mut_ptr());
    starts.par_iter().for_each(|&c0| {
        let w = block.min(c - c0);
        let g = &grad_ptr;
        for (i, src) in dout.chunks_exact(c).enumerate() {
            let id = row_of(i);
            // Checked: a huge id must not wrap around into a valid-looking offset.
            let start = id.checked_mul(c).and_then(|r| r.checked_add(c0));
            let start = match start.and_then(|s| s.checked_add(w)) {
                Some(end) if end <= len => start.expect("checked above"),
                _ => panic!("embedding: id {id} outside the table of {} rows", len / c),
            };
            // SAFETY: `start..start + w` is inside `grad` (checked just above, without
            // overflow), and its columns c0..c0 + w of row `id` are written by this task
            // alone (c0 + w <= c, column blocks are disjoint); `grad` outlives the tasks.
            let dst = unsafe { std::slice::from_raw_parts_mut(g.0.add(start), w) };
            dst.iter_mut()
                .zip(&src[c0..c0 + w])
                .for_each(|(d, &s)| *d += s.to_f32());
        }
    });
}

/// A raw pointer shared by tasks that write disjoint ranges.
struct SyncPtr(*mut f32);
// SAFETY: used only for the disjoint column blocks above.
unsafe impl Sync for SyncPtr {}

impl CustomOp2 for EmbeddingBackward {
    fn name(&self) -> &'static str {
        "embedding-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let ids = targets(op, s2, l2)?;
        let c = match l1.shape().dims() {
            &[n, c] if n == ids.len() && c > 0 => c,
            _ => {
                return Err(shape_err(
                    op,
                    format!("grad must be [{}, C], one row per id", ids.len()),
                    l1.shape(),
                ))
            }
        };
        check(op, &Shape::from((self.rows, c)), &ids)?;
        let out = match floats(op, s1, l1)? {
            Floats::F32(g) => f32::storage(bwd(g, &ids, self.rows, c)),
            Floats::BF16(g) => bf16::storage(bwd(g, &ids, self.rows, c)),
        };
        Ok((out, Shape::from((self.rows, c))))
    }
}

#[cfg(test)]
mod scatter_tests {
    use super::scatter_add;

    #[test]
    fn ids_add_into_their_rows() {
        let dout = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut grad = vec![0f32; 3 * 2];
        scatter_add(&dout, |i| [2, 0, 2][i], 2, &mut grad);
        assert_eq!(grad, [3.0, 4.0, 0.0, 0.0, 6.0, 8.0]);
    }

    /// An id whose offset wraps around `usize` (id x c = 2^64 here) must not pass the
    /// bounds check as offset 0.
    #[test]
    #[should_panic(expected = "outside the table")]
    fn an_id_whose_offset_would_wrap_is_refused() {
        let c = 16;
        let dout = vec![1f32; c];
        let mut grad = vec![0f32; 4 * c];
        scatter_add(&dout, |_| usize::MAX / c + 1, c, &mut grad);
    }

    #[test]
    fn zero_width_rows_are_nothing_to_add() {
        let mut grad: Vec<f32> = Vec::new();
        scatter_add::<f32>(&[], |i| i, 0, &mut grad);
    }
}
