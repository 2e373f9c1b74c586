//! The NCCL backend (feature `cuda`): NVIDIA's collectives through cudarc, bootstrapped
//! the way llm.c does it: MPI starts the ranks, rank 0 creates NCCL's unique id and
//! broadcasts it over MPI, every rank joins with `ncclCommInitRank` on its own GPU.
//!
//! stoker's trainer keeps its flat buffers in host memory today, so this backend takes
//! host buffers, stages them through device memory on one CUDA stream, runs the NCCL
//! collective and copies the result back; a non-blocking call completes before it
//! returns. NCCL needs equal segments for reduce-scatter and all-gather: uneven counts are
//! padded to the largest. Waits are CUDA stream synchronizations, bounded by NCCL's own
//! watchdog rather than the communicator's timeout (the one backend where that is so).
//! Compiled by the cuda check; run only where a GPU is lent (nothing here has one).
//!
//! Without the feature, [`NcclComm::init`] says it is not compiled in.

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Arc;
    use std::time::Duration;

    use cudarc::driver::{CudaContext, CudaStream, DeviceRepr, ValidAsZeroBits};
    use cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};

    use crate::communicator::{check_args, CommExt, Communicator, Pending};
    use crate::element::{Buf, BufMut, Buffer, Element};
    use crate::error::{CommError, Result};
    use crate::mpi::MpiComm;
    use crate::stats::{CommStats, Op, StatsCell};

    /// One rank's NCCL communicator, on top of the MPI world that started it.
    pub struct NcclComm {
        comm: Comm,
        stream: Arc<CudaStream>,
        mpi: MpiComm,
        stats: StatsCell,
    }

    fn nccl_err(op: Op, rank: usize, e: impl std::fmt::Debug) -> CommError {
        CommError::Backend {
            op: op.name(),
            rank,
            backend: "nccl",
            code: -1,
            message: format!("{e:?}"),
        }
    }

    impl NcclComm {
        /// Joins every MPI rank of `mpi` in an NCCL communicator on GPU `device`
        /// (usually the rank's index on its host).
        pub fn init(mpi: MpiComm, device: usize) -> Result<NcclComm> {
            let (rank, world) = (mpi.rank(), mpi.world_size());
            let launch = |what: &str, e: &dyn std::fmt::Debug| CommError::Launch {
                backend: "nccl",
                message: format!("{what} on rank {rank} (GPU {device}): {e:?}"),
            };
            let ctx =
                CudaContext::new(device).map_err(|e| launch("creating the CUDA context", &e))?;
            let stream = ctx.default_stream();
            let id = match rank {
                0 => Id::new().map_err(|e| launch("creating NCCL's unique id", &e))?,
                _ => Id::uninit([0; 128]),
            };
            // The 128-byte id travels over MPI as 16 u64 words.
            let mut words = [0u64; 16];
            for (w, c) in words.iter_mut().zip(id.internal().chunks(8)) {
                let mut b = [0u8; 8];
                for (d, s) in b.iter_mut().zip(c) {
                    *d = *s as u8;
                }
                *w = u64::from_le_bytes(b);
            }
            mpi.broadcast(&mut words, 0)?;
            let mut internal = [0 as std::ffi::c_char; 128];
            for (i, w) in words.iter().enumerate() {
                for (j, b) in w.to_le_bytes().into_iter().enumerate() {
                    internal[i * 8 + j] = b as std::ffi::c_char;
                }
            }
            let comm = Comm::from_rank(stream.clone(), rank, world, Id::uninit(internal))
                .map_err(|e| launch("ncclCommInitRank", &e))?;
            Ok(NcclComm {
                comm,
                stream,
                mpi,
                stats: StatsCell::default(),
            })
        }

        /// `f(device input, device output)` on staged copies of `input` into `out`.
        fn staged<T>(
            &self,
            op: Op,
            input: &[T],
            out_len: usize,
            f: impl FnOnce(
                &Comm,
                &cudarc::driver::CudaSlice<T>,
                &mut cudarc::driver::CudaSlice<T>,
            ) -> std::result::Result<(), cudarc::nccl::result::NcclError>,
        ) -> Result<Vec<T>>
        where
            T: DeviceRepr + ValidAsZeroBits + NcclType + Default + Clone,
        {
            let rank = self.rank();
            let d_in = self
                .stream
                .clone_htod(input)
                .map_err(|e| nccl_err(op, rank, e))?;
            let mut d_out = self
                .stream
                .alloc_zeros::<T>(out_len.max(1))
                .map_err(|e| nccl_err(op, rank, e))?;
            f(&self.comm, &d_in, &mut d_out).map_err(|e| nccl_err(op, rank, e))?;
            let mut host = self
                .stream
                .clone_dtoh(&d_out)
                .map_err(|e| nccl_err(op, rank, e))?;
            host.truncate(out_len);
            Ok(host)
        }

        fn all_reduce_t<T>(&self, x: &mut [T]) -> Result<()>
        where
            T: Element + DeviceRepr + ValidAsZeroBits + NcclType,
        {
            let n = x.len();
            let out = self.staged(Op::AllReduce, x, n, |c, i, o| {
                c.all_reduce(i, o, &ReduceOp::Sum).map(|_| ())
            })?;
            x.copy_from_slice(&out);
            Ok(())
        }

        fn reduce_scatter_t<T>(&self, input: &[T], counts: &[usize], out: &mut [T]) -> Result<()>
        where
            T: Element + DeviceRepr + ValidAsZeroBits + NcclType,
        {
            let max = counts.iter().copied().max().unwrap_or(0);
            let mut padded = vec![T::default(); max * counts.len()];
            let mut at = 0;
            for (r, &c) in counts.iter().enumerate() {
                padded[r * max..r * max + c].copy_from_slice(&input[at..at + c]);
                at += c;
            }
            let got = self.staged(Op::ReduceScatter, &padded, max, |c, i, o| {
                c.reduce_scatter(i, o, &ReduceOp::Sum).map(|_| ())
            })?;
            out.copy_from_slice(&got[..counts[self.rank()]]);
            Ok(())
        }

        fn all_gather_t<T>(&self, input: &[T], counts: &[usize], out: &mut [T]) -> Result<()>
        where
            T: Element + DeviceRepr + ValidAsZeroBits + NcclType,
        {
            let max = counts.iter().copied().max().unwrap_or(0);
            let mut padded = vec![T::default(); max];
            padded[..input.len()].copy_from_slice(input);
            let got = self.staged(Op::AllGather, &padded, max * counts.len(), |c, i, o| {
                c.all_gather(i, o).map(|_| ())
            })?;
            let mut at = 0;
            for (r, &c) in counts.iter().enumerate() {
                out[at..at + c].copy_from_slice(&got[r * max..r * max + c]);
                at += c;
            }
            Ok(())
        }

        fn broadcast_t<T>(&self, x: &mut [T], root: usize) -> Result<()>
        where
            T: Element + DeviceRepr + ValidAsZeroBits + NcclType,
        {
            let n = x.len();
            let out = self.staged(Op::Broadcast, x, n, |c, i, o| {
                c.broadcast(Some(i), o, root as i32).map(|_| ())
            })?;
            x.copy_from_slice(&out);
            Ok(())
        }
    }

    macro_rules! each_type {
        ($buf:expr, $x:ident => $body:expr) => {
            match $buf {
                BufMut::F32($x) => $body,
                BufMut::F64($x) => $body,
                BufMut::U64($x) => $body,
            }
        };
    }

    impl Communicator for NcclComm {
        fn rank(&self) -> usize {
            self.mpi.rank()
        }

        fn world_size(&self) -> usize {
            self.mpi.world_size()
        }

        fn ranks_on_this_host(&self) -> usize {
            self.mpi.ranks_on_this_host()
        }

        fn backend(&self) -> &'static str {
            "nccl"
        }

        fn timeout(&self) -> Duration {
            self.mpi.timeout()
        }

        fn all_reduce_buf(&self, buf: BufMut<'_>) -> Result<()> {
            self.stats
                .count(Op::AllReduce, buf.bytes(), self.world_size());
            each_type!(buf, x => self.all_reduce_t(x))
        }

        fn reduce_scatter_buf(
            &self,
            input: Buf<'_>,
            counts: &[usize],
            output: BufMut<'_>,
        ) -> Result<()> {
            check_args(
                Op::ReduceScatter,
                self.rank(),
                self.world_size(),
                Some(counts),
                Some(input),
                Some(&output),
            )?;
            self.stats
                .count(Op::ReduceScatter, input.bytes(), self.world_size());
            match (input, output) {
                (Buf::F32(i), BufMut::F32(o)) => self.reduce_scatter_t(i, counts, o),
                (Buf::F64(i), BufMut::F64(o)) => self.reduce_scatter_t(i, counts, o),
                (Buf::U64(i), BufMut::U64(o)) => self.reduce_scatter_t(i, counts, o),
                _ => unreachable!("dtypes checked"),
            }
        }

        fn all_gather_buf(
            &self,
            input: Buf<'_>,
            counts: &[usize],
            output: BufMut<'_>,
        ) -> Result<()> {
            check_args(
                Op::AllGather,
                self.rank(),
                self.world_size(),
                Some(counts),
                Some(input),
                Some(&output),
            )?;
            self.stats
                .count(Op::AllGather, output.bytes(), self.world_size());
            match (input, output) {
                (Buf::F32(i), BufMut::F32(o)) => self.all_gather_t(i, counts, o),
                (Buf::F64(i), BufMut::F64(o)) => self.all_gather_t(i, counts, o),
                (Buf::U64(i), BufMut::U64(o)) => self.all_gather_t(i, counts, o),
                _ => unreachable!("dtypes checked"),
            }
        }

        fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
            self.stats
                .count(Op::Broadcast, buf.bytes(), self.world_size());
            each_type!(buf, x => self.broadcast_t(x, root))
        }

        fn barrier(&self) -> Result<()> {
            self.mpi.barrier()
        }

        fn send_recv_buf(&self, peer: usize, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
            // Point-to-point exchanges are small (the deterministic tree's halves of the
            // host-resident gradient): MPI carries them.
            self.mpi.send_recv_buf(peer, send, recv)
        }

        fn start_all_reduce(&self, mut buf: Buffer) -> Result<Pending> {
            self.all_reduce_buf(buf.as_buf_mut())?;
            Ok(Pending::ready(buf, None))
        }

        fn start_reduce_scatter(
            &self,
            input: Buffer,
            counts: &[usize],
            mut out: Buffer,
        ) -> Result<Pending> {
            self.reduce_scatter_buf(input.as_buf(), counts, out.as_buf_mut())?;
            Ok(Pending::ready(out, Some(input)))
        }

        fn start_all_gather(
            &self,
            input: Buffer,
            counts: &[usize],
            mut out: Buffer,
        ) -> Result<Pending> {
            self.all_gather_buf(input.as_buf(), counts, out.as_buf_mut())?;
            Ok(Pending::ready(out, Some(input)))
        }

        fn stats(&self) -> CommStats {
            self.stats.snapshot()
        }

        fn abort(&self, code: i32, message: &str) -> ! {
            self.mpi.abort(code, message)
        }
    }
}

#[cfg(feature = "cuda")]
pub use imp::NcclComm;

/// Stand-in for the NCCL communicator of a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub enum NcclComm {}

#[cfg(not(feature = "cuda"))]
impl NcclComm {
    /// Always fails: this build has no NCCL.
    pub fn init<M>(_mpi: M, _device: usize) -> crate::Result<NcclComm> {
        Err(crate::CommError::NotCompiled {
            backend: "nccl",
            feature: "cuda",
        })
    }
}
