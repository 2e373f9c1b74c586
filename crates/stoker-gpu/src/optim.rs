//! The optimizers as checked calls over a whole flat buffer in one launch: AdamW and SGD
//! (cuda/ops/optim.cuh), each element finding its segment and weight-decay flag in a
//! [`Segments`] table. What the step's update launches (llm.c's one AdamW kernel over all
//! tensors), bit for bit stoker-kernels' scalar twins segment by segment.

use std::ops::Range;

use half::bf16;
use stoker_kernels::{AdamWStep, SgdStep};

use crate::args::{AdamWArgs, StochasticRound};
use crate::backend::{Backend, View};
use crate::call::Call;
use crate::error::{check_len, dim, GpuError};

/// A flat buffer's segments (sorted, disjoint ranges with their weight-decay flags) on a
/// backend, checked against the buffer's length when made.
pub struct Segments<B: Backend> {
    bounds: B::Buf<i64>,
    decay: B::Buf<i32>,
    count: i32,
    end: usize,
}

impl<B: Backend> Segments<B> {
    /// `segments` of a flat buffer of `len` elements: each inside it, sorted and disjoint.
    pub fn new(be: &B, segments: &[(Range<usize>, bool)], len: usize) -> Result<Self, GpuError> {
        const K: &str = "segments";
        // An empty buffer (a rank's shard of a tiny model) has no segment.
        let count = match (segments.len(), len) {
            (0, 0) => 0,
            (n, _) => dim(K, "segments", n)?,
        };
        let mut last = 0;
        for (r, _) in segments {
            if r.start < last || r.start > r.end || r.end > len {
                return Err(GpuError::Shape { kernel: K, what: format!("segment {r:?} after {last} in a buffer of {len}: segments must be sorted, disjoint and inside it") });
            }
            last = r.end;
        }
        let bounds: Vec<i64> = segments
            .iter()
            .flat_map(|(r, _)| [r.start as i64, r.end as i64])
            .collect();
        let decay: Vec<i32> = segments.iter().map(|&(_, d)| d as i32).collect();
        Ok(Segments {
            bounds: be.upload(&bounds)?,
            decay: be.upload(&decay)?,
            count,
            end: len,
        })
    }
}

fn check_whole(
    kernel: &'static str,
    p: &View<f32>,
    g: &View<f32>,
    copy: &Option<View<bf16>>,
    end: usize,
) -> Result<(), GpuError> {
    check_len(kernel, "p", p.len(), end)?;
    check_len(kernel, "g", g.len(), end)?;
    if let Some(c) = copy {
        check_len(kernel, "copy", c.len(), end)?;
    }
    Ok(())
}

/// One AdamW step over every segment of the flat buffer `p` (stoker-kernels'
/// `adamw_update_scalar` per segment, on `g * grad_scale`), the bf16 copy written where
/// `copy` is given: rounded to nearest even, or by `round`.
#[allow(clippy::too_many_arguments)]
pub fn adamw<B: Backend>(
    b: &B,
    p: View<f32>,
    g: View<f32>,
    m: View<f32>,
    v: View<f32>,
    (copy, round): (Option<View<bf16>>, Option<StochasticRound>),
    step: &AdamWStep,
    segs: &Segments<B>,
    grad_scale: f32,
) -> Result<(), GpuError> {
    let call = adamw_call(b, p, g, m, v, (copy, round), step, segs, grad_scale)?;
    // SAFETY: p, g, m, v (and copy when not 0) hold the segments' buffer length; the
    // table holds `count` sorted segments inside it (checked when made, and by
    // `adamw_call`).
    unsafe { b.launch(&call) }
}

/// [`adamw`]'s launch, checked and not run: for a caller that runs it in pieces.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw_call<B: Backend>(
    b: &B,
    p: View<f32>,
    g: View<f32>,
    m: View<f32>,
    v: View<f32>,
    (copy, round): (Option<View<bf16>>, Option<StochasticRound>),
    step: &AdamWStep,
    segs: &Segments<B>,
    grad_scale: f32,
) -> Result<Call, GpuError> {
    const K: &str = "adamw-segments";
    check_whole(K, &p, &g, &copy, segs.end)?;
    check_len(K, "m", m.len(), segs.end)?;
    check_len(K, "v", v.len(), segs.end)?;
    let call = Call::AdamwSegments {
        p: p.addr(),
        g: g.addr(),
        m: m.addr(),
        v: v.addr(),
        copy: copy.map_or(0, |c| c.addr()),
        n: segs.end as i64,
        s: AdamWArgs::from(step).rounded(round),
        bounds: b.addr(&segs.bounds),
        decay: b.addr(&segs.decay),
        segs: segs.count,
        grad_scale,
    };
    Ok(call)
}

/// One SGD step over every segment of `p` (stoker-kernels' `sgd_update_scalar` per
/// segment); `buf`, the momentum buffer, is needed when the momentum is not 0.
#[allow(clippy::too_many_arguments)]
pub fn sgd<B: Backend>(
    b: &B,
    p: View<f32>,
    g: View<f32>,
    buf: Option<View<f32>>,
    copy: Option<View<bf16>>,
    step: &SgdStep,
    segs: &Segments<B>,
    grad_scale: f32,
) -> Result<(), GpuError> {
    let call = sgd_call(b, p, g, buf, copy, step, segs, grad_scale)?;
    // SAFETY: p, g (buf when the momentum reads it, copy when not 0) hold the segments'
    // buffer length; the table holds sorted segments inside it (checked when made, and
    // by `sgd_call`).
    unsafe { b.launch(&call) }
}

/// [`sgd`]'s launch, checked and not run: for a caller that runs it in pieces.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgd_call<B: Backend>(
    b: &B,
    p: View<f32>,
    g: View<f32>,
    buf: Option<View<f32>>,
    copy: Option<View<bf16>>,
    step: &SgdStep,
    segs: &Segments<B>,
    grad_scale: f32,
) -> Result<Call, GpuError> {
    const K: &str = "sgd-segments";
    check_whole(K, &p, &g, &copy, segs.end)?;
    let buf = match (buf, step.momentum != 0.0) {
        (Some(v), _) => {
            check_len(K, "buf", v.len(), segs.end)?;
            v.addr()
        }
        (None, false) => 0,
        (None, true) => {
            return Err(GpuError::Shape {
                kernel: K,
                what: format!("momentum {} needs a momentum buffer", step.momentum),
            })
        }
    };
    let call = Call::SgdSegments {
        p: p.addr(),
        g: g.addr(),
        buf,
        copy: copy.map_or(0, |c| c.addr()),
        n: segs.end as i64,
        s: step.into(),
        bounds: b.addr(&segs.bounds),
        decay: b.addr(&segs.decay),
        segs: segs.count,
        grad_scale,
    };
    Ok(call)
}
