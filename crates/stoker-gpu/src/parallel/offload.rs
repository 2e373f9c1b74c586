//! The optimizer offloaded to the host on the resident loop (DeepSpeed's
//! `offload_optimizer`, ZeRO-Offload; FSDP's optimizer CPU offload): the FP32 master and
//! the optimizer's moments (DDP's whole state, or ZeRO-1's shard) live in host memory and
//! the host build of the same optimizer kernels steps them, so the device holds only the
//! step (compute copy, gradients, activations). The strategy reduces the gradients on the
//! device and takes their norm there (the one value an update reads back anyway); then
//! [`Offloaded::step_on_host`] copies them down, steps, and copies the compute copy up.
//! Per step that moves 4 bytes a parameter down and the compute copy's (2 in bf16 or
//! f16) up, both between device memory and host memory pinned for the backend
//! ([`PinnedHostBuf`], DeepSpeed's `offload_optimizer.pin_memory`): on a device the
//! driver copies registered memory by DMA at the bus's speed, where pageable memory goes
//! through its own staging.
//! [`super::StateAt`] is the choice between this and a state on the backend.

use std::cell::RefCell;
use std::ops::Range;

use half::{bf16, f16};

use crate::backend::{Backend, View};
use crate::elem::{Act, Dtype};
use crate::error::GpuError;
use crate::host::Host;
use crate::pinned::PinnedHostBuf;
use crate::step::optimizer::{self, Optimizer, OptimizerState, Scalars};

/// One rank's optimizer state in host memory.
pub struct Offloaded<B: Backend> {
    opt: OptimizerState<Host>,
    /// The gradients, copied down for the host's optimizer: made by the first update
    /// that copies them (an update over gradients in host memory already needs none).
    grads: RefCell<Option<PinnedHostBuf<B, f32>>>,
    /// The compute copy the host's optimizer writes, in the step's type: made by the
    /// first update (the state does not know the type before).
    copy: RefCell<Option<HostCopy<B>>>,
}

/// The compute copy on the host, in the step's type.
enum HostCopy<B: Backend> {
    F32(PinnedHostBuf<B, f32>),
    Bf16(PinnedHostBuf<B, bf16>),
    F16(PinnedHostBuf<B, f16>),
}

impl<B: Backend> HostCopy<B> {
    /// `len` zeros of `T`, pinned for `be`.
    fn zeros<T: Act>(be: &B, len: usize) -> Result<Self, GpuError> {
        Ok(match T::DTYPE {
            Dtype::F32 => HostCopy::F32(PinnedHostBuf::zeros(be, len)?),
            Dtype::Bf16 => HostCopy::Bf16(PinnedHostBuf::zeros(be, len)?),
            Dtype::F16 => HostCopy::F16(PinnedHostBuf::zeros(be, len)?),
        })
    }

    /// Host bytes it holds.
    fn bytes(&self) -> usize {
        match self {
            HostCopy::F32(b) => b.bytes(),
            HostCopy::Bf16(b) => b.bytes(),
            HostCopy::F16(b) => b.bytes(),
        }
    }

    /// Whether the backend copies it directly ([`PinnedHostBuf::is_direct`]).
    fn is_direct(&self, be: &B) -> bool {
        match self {
            HostCopy::F32(b) => b.is_direct(be),
            HostCopy::Bf16(b) => b.is_direct(be),
            HostCopy::F16(b) => b.is_direct(be),
        }
    }

    /// All of it as `T` (its own type: checked), once no copy uses it
    /// ([`PinnedHostBuf::settled`]).
    fn settled<T: Act>(&self, be: &B) -> Result<View<'_, T>, GpuError> {
        match self {
            HostCopy::F32(b) => b.settled(be)?.cast::<T>(),
            HostCopy::Bf16(b) => b.settled(be)?.cast::<T>(),
            HostCopy::F16(b) => b.settled(be)?.cast::<T>(),
        }
    }

    /// Starts copying elements `r` up into `dst` ([`PinnedHostBuf::start_copy_to`]),
    /// `dst` seen as this copy's type (checked).
    ///
    /// # Safety
    /// [`PinnedHostBuf::start_copy_to`]'s.
    unsafe fn start_copy_to<T: Act>(
        &self,
        be: &B,
        r: &Range<usize>,
        dst: View<T>,
    ) -> Result<B::PendingWrite, GpuError> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match self {
                HostCopy::F32(b) => b.start_copy_to(be, r.clone(), dst.cast()?),
                HostCopy::Bf16(b) => b.start_copy_to(be, r.clone(), dst.cast()?),
                HostCopy::F16(b) => b.start_copy_to(be, r.clone(), dst.cast()?),
            }
        }
    }
}

/// What `slot` holds, made by `make` where it holds nothing yet.
fn made<T>(
    slot: &mut Option<T>,
    make: impl FnOnce() -> Result<T, GpuError>,
) -> Result<&T, GpuError> {
    Ok(match slot {
        Some(x) => x,
        None => slot.insert(make()?),
    })
}

impl<B: Backend> Offloaded<B> {
    /// The state of optimizer `kind` over `master` (the whole flat buffer, or a ZeRO-1
    /// shard of it) with its `segments`, in host memory (its copies to and from the
    /// backend through pinned buffers, made by the updates that need them).
    pub fn new(
        kind: Optimizer,
        master: &[f32],
        segments: &[(Range<usize>, bool)],
    ) -> Result<Self, GpuError> {
        Ok(Offloaded {
            opt: OptimizerState::new(&Host, kind, master, segments)?,
            grads: RefCell::new(None),
            copy: RefCell::new(None),
        })
    }

    /// Host bytes of `kind`'s state over `len` elements of the master, and of the
    /// buffers its updates make: with `copies` the gradients copied down (ZeRO-3's shard
    /// in host memory), and with `copies_up` the compute copy of `elem` bytes an element
    /// too (the compute copy on the backend); neither where the update steps host memory
    /// in place (parameter offload). [`Offloaded::host_bytes`] counts the same.
    pub fn planned_host_bytes(
        kind: Optimizer,
        len: usize,
        (copies, copies_up): (bool, Option<usize>),
    ) -> usize {
        let grads = match copies || copies_up.is_some() {
            true => crate::pinned::planned_bytes(len, 4),
            false => 0,
        };
        let copy = copies_up.map_or(0, |elem| crate::pinned::planned_bytes(len, elem));
        kind.state_bytes(len) + grads + copy
    }

    /// Host bytes it holds: the master and moments, and the buffers its updates made.
    pub fn host_bytes(&self) -> usize {
        let grads = self.grads.borrow().as_ref().map_or(0, |g| g.bytes());
        let copy = self.copy.borrow().as_ref().map_or(0, HostCopy::bytes);
        self.opt.bytes() + grads + copy
    }

    /// This state with the bf16 compute copy rounded stochastically under `seed`, its
    /// master being elements `base..` of a flat buffer of `total` (as
    /// [`OptimizerState::with_stochastic_rounding`]).
    pub fn with_stochastic_rounding(
        mut self,
        seed: u64,
        (total, base): (usize, usize),
    ) -> Result<Self, GpuError> {
        self.opt = self.opt.with_stochastic_rounding(seed, (total, base))?;
        Ok(self)
    }

    /// The optimizer state, in host memory.
    pub fn optimizer(&self) -> &OptimizerState<Host> {
        &self.opt
    }

    /// The optimizer's step on the host over `grads` (on `be`, as long as the master)
    /// times `mult`: the gradients copied down, the host build of the optimizer's kernels,
    /// the compute copy `params` (on `be`, as long) copied up, pipelined in pieces
    /// ([`PIPELINE_PIECES`]): while the host steps one piece, the next pieces' gradients
    /// come down and the last pieces' compute copy goes up on the copy streams
    /// (ZeRO-Offload's overlap of the CPU's step with the transfers).
    pub fn step_on_host<T: Act>(
        &self,
        be: &B,
        grads: View<f32>,
        params: View<T>,
        scalars: &Scalars,
        mult: f32,
    ) -> Result<(), GpuError> {
        crate::error::check_len("offload", "params", params.len(), self.opt.len())?;
        let mut slot = self.copy.borrow_mut();
        let copy = made(&mut slot, || HostCopy::zeros::<T>(be, self.opt.len()))?;
        // The last update's copies up from it were waited for on the device, not here.
        let host_copy: View<T> = copy.settled(be)?;
        if !copy.is_direct(be) {
            // Unregistered memory: pieces in flight would each take pinned staging of
            // their own; the whole buffer goes up at once instead, as before the pipeline.
            self.pipeline(be, grads, host_copy, (scalars, mult), |_| Ok(()))?;
            return Host.copy_to(host_copy, be, params);
        }
        let mut writes = Vec::new();
        let stepped = self.pipeline(be, grads, host_copy, (scalars, mult), |r| {
            let dst = params.slice(r.clone())?;
            // SAFETY: nothing queued on `be` until the waits below touches `params` (the
            // pieces' launches run on the host over the pinned buffers), and the waits
            // order every later launch after these copies; `params`' buffer is the
            // caller's, alive through this call; the pinned copy lives in `self`, and the
            // later pieces write other elements of it.
            writes.push(unsafe { copy.start_copy_to(be, r, dst)? });
            Ok(())
        });
        // Waited for even after an error, so that the pieces started land on every
        // backend alike (the state is then a half-stepped one: the run ends).
        let waited = crate::backend::wait_writes(be, writes);
        stepped.and(waited)
    }

    /// The optimizer's step over gradients and a compute copy that are host memory
    /// already (`grads`, `params`: parameter offload's whole copy and sum), times `mult`:
    /// nothing to copy either way.
    pub fn step_in_host_memory<T: Act>(
        &self,
        grads: View<f32>,
        params: View<T>,
        scalars: &Scalars,
        mult: f32,
    ) -> Result<(), GpuError> {
        optimizer::apply(&Host, &self.opt, params, grads, scalars, mult)
    }

    /// [`Self::step_on_host`] writing the compute copy `host_params` where it lives, in
    /// host memory (ZeRO-3's shard with the parameters offloaded): nothing goes back up.
    pub(crate) fn step_into_host<T: Act>(
        &self,
        be: &B,
        grads: View<f32>,
        host_params: View<T>,
        scalars: &Scalars,
        mult: f32,
    ) -> Result<(), GpuError> {
        self.pipeline(be, grads, host_params, (scalars, mult), |_| Ok(()))
    }

    /// The gradients `grads` (on `be`) down in pieces into the pinned host copy, all
    /// started at once on the copy stream, and the optimizer stepping each piece of
    /// `host_params` as soon as its gradients are down, `after(piece)` following it.
    fn pipeline<T: Act>(
        &self,
        be: &B,
        grads: View<f32>,
        host_params: View<T>,
        (scalars, mult): (&Scalars, f32),
        after: impl FnMut(&Range<usize>) -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        crate::error::check_len("offload", "grads", grads.len(), self.opt.len())?;
        let mut slot = self.grads.borrow_mut();
        let pinned = made(&mut slot, || PinnedHostBuf::zeros(be, self.opt.len()))?;
        let host_grads = pinned.settled(be)?;
        let pieces = pipeline_pieces(self.opt.len());
        let direct = pinned.is_direct(be);
        let mut reads = Vec::with_capacity(pieces.len());
        if direct {
            for r in &pieces {
                // SAFETY: the host queues no launch that writes `grads` before every read
                // is finished below (or dropped on an error, which waits for its copy);
                // the pinned piece is touched only by its finish, and lives in `self`.
                reads.push(unsafe {
                    pinned.start_read_into(be, grads.slice(r.clone())?, r.clone())?
                });
            }
        } else {
            // Unregistered memory: pieces in flight would each take pinned memory of
            // their own; the whole gradient comes down at once instead.
            Host.copy_from(host_grads, be, grads)?;
        }
        let mut reads = reads.into_iter();
        optimizer::apply_on_host_in_pieces(
            &self.opt,
            host_params,
            host_grads,
            (scalars, mult),
            &pieces,
            |r| match reads.next() {
                Some(read) => pinned.finish_read_into(be, read, grads.slice(r.clone())?, r.clone()),
                None if !direct => Ok(()),
                None => Err(GpuError::Shape {
                    kernel: "offload",
                    what: format!("no read for piece {r:?}"),
                }),
            },
            after,
        )
    }
}

/// How many pieces the offloaded optimizer's update is pipelined in: enough that the
/// transfers of the first and last pieces, which nothing hides, are small.
pub const PIPELINE_PIECES: usize = 8;

/// [`PIPELINE_PIECES`] ranges covering `0..len` in order, each starting on a multiple of
/// eight (the last may be shorter; fewer where `len` is small).
fn pipeline_pieces(len: usize) -> Vec<Range<usize>> {
    let size = len.div_ceil(PIPELINE_PIECES).div_ceil(8).max(1) * 8;
    (0..len)
        .step_by(size)
        .map(|lo| lo..(lo + size).min(len))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pipelines_pieces_cover_the_buffer_in_order_on_packs() {
        for len in [0usize, 1, 7, 8, 9, 63, 64, 65, 1000, 12_345, 1 << 20] {
            let pieces = pipeline_pieces(len);
            assert!(pieces.len() <= PIPELINE_PIECES, "{len}: {pieces:?}");
            let mut next = 0;
            for r in &pieces {
                assert_eq!(r.start, next, "{len}: {pieces:?}");
                assert_eq!(r.start % 8, 0, "{len}: {pieces:?}");
                assert!(r.end > r.start, "{len}: {pieces:?}");
                next = r.end;
            }
            assert_eq!(next, len, "{len}: {pieces:?}");
        }
        assert_eq!(pipeline_pieces(1000).len(), PIPELINE_PIECES);
    }

    /// The master, moments and compute copy after one update of a fresh state, whole
    /// (`apply`) or in `pieces`.
    fn updated<T: Act>(
        kind: Optimizer,
        round: bool,
        pieces: Option<&[Range<usize>]>,
    ) -> Vec<Vec<u32>> {
        let n = 1003;
        let master: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-2)
            .collect();
        let grads: Vec<f32> = (0..n)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) * 1e-3)
            .collect();
        // Segment bounds inside packs and inside pieces.
        let segments = [(0..13, true), (13..500, false), (500..n, true)];
        let mut opt = OptimizerState::new(&Host, kind, &master, &segments).unwrap();
        if round {
            opt = opt.with_stochastic_rounding(7, (5000, 1234)).unwrap();
        }
        let params = Host.zeros::<T>(n).unwrap();
        let g = Host.upload(&grads).unwrap();
        let s = match kind {
            Optimizer::AdamW => Scalars::AdamW(stoker_kernels::AdamWStep::new(
                1e-3, 0.9, 0.95, 1e-8, 0.1, 3,
            )),
            Optimizer::Sgd { .. } => Scalars::Sgd(stoker_kernels::SgdStep {
                lr: 0.01,
                momentum: 0.9,
                weight_decay: 0.01,
                nesterov: false,
                first: true,
            }),
        };
        match pieces {
            None => optimizer::apply(&Host, &opt, Host.all(&params), Host.all(&g), &s, 0.5),
            Some(p) => optimizer::apply_on_host_in_pieces(
                &opt,
                Host.all(&params),
                Host.all(&g),
                (&s, 0.5),
                p,
                |_| Ok(()),
                |_| Ok(()),
            ),
        }
        .unwrap();
        let mut out = vec![opt.master(&Host).unwrap()];
        out.extend(opt.moments(&Host).unwrap().into_iter().map(|(_, m)| m));
        out.push(
            Host.download(&params)
                .unwrap()
                .into_iter()
                .map(T::to_f32)
                .collect(),
        );
        out.into_iter()
            .map(|v| v.iter().map(|x| x.to_bits()).collect())
            .collect()
    }

    #[test]
    fn an_update_in_pieces_is_the_whole_updates_bits() {
        let own = pipeline_pieces(1003);
        let odd = [0..8, 8..504, 504..1003];
        for pieces in [&own[..], &odd[..]] {
            for round in [false, true] {
                assert_eq!(
                    updated::<half::bf16>(Optimizer::AdamW, round, Some(pieces)),
                    updated::<half::bf16>(Optimizer::AdamW, round, None),
                    "adamw bf16, rounding {round}, {pieces:?}"
                );
            }
            assert_eq!(
                updated::<f32>(Optimizer::AdamW, false, Some(pieces)),
                updated::<f32>(Optimizer::AdamW, false, None),
                "adamw f32, {pieces:?}"
            );
            assert_eq!(
                updated::<half::f16>(Optimizer::Sgd { momentum: true }, false, Some(pieces)),
                updated::<half::f16>(Optimizer::Sgd { momentum: true }, false, None),
                "sgd f16, {pieces:?}"
            );
        }
    }

    #[test]
    fn an_update_in_pieces_refuses_pieces_that_do_not_tile_the_buffer() {
        let master: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let opt = OptimizerState::new(&Host, Optimizer::AdamW, &master, &[(0..64, true)]).unwrap();
        let (params, grads) = (
            Host.zeros::<f32>(64).unwrap(),
            Host.zeros::<f32>(64).unwrap(),
        );
        let s = Scalars::AdamW(stoker_kernels::AdamWStep::new(
            1e-3, 0.9, 0.95, 1e-8, 0.0, 1,
        ));
        for pieces in [
            vec![0..16, 16..32],
            vec![0..30, 30..64],
            vec![8..40, 40..64],
            vec![0..40, 32..64],
        ] {
            let got = optimizer::apply_on_host_in_pieces(
                &opt,
                Host.all(&params),
                Host.all(&grads),
                (&s, 1.0),
                &pieces,
                |_| Ok(()),
                |_| Ok(()),
            );
            assert!(
                matches!(got, Err(GpuError::Shape { .. } | GpuError::Length { .. })),
                "{pieces:?}: {got:?}"
            );
        }
    }
}
