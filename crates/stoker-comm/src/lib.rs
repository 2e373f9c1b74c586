//! stoker-comm: collective communication for data-parallel training.
//!
//! One trait, [`Communicator`] (rank, world size, all_reduce, reduce_scatter,
//! all_gather, broadcast, barrier, send_recv, and non-blocking forms returning a
//! [`Pending`] handle), and three backends behind it:
//!
//! - [`local`]: N ranks as N threads of one process (tests, single-machine runs without
//!   a launcher);
//! - [`mpi`] (feature `mpi`, default): the system's MPI, launched by `mpirun -n N` or
//!   Slurm's `srun`;
//! - [`nccl`] (feature `cuda`): NVIDIA's NCCL through cudarc, bootstrapped through MPI.
//!
//! [`checked::Checked`] wraps any of them and checks before every collective that every
//! rank is calling the same one, failing at once where they differ instead of hanging.
//!
//! Every wait is bounded by the communicator's timeout and its error names the
//! collective, the rank and the bytes ([`CommError`]). [`tree`] builds a sum all-reduce
//! whose bits are fixed by the rank order alone, the cross-rank half of the trainer's
//! deterministic mode. Each backend counts what it moves ([`CommStats`]).
//!
//! ```
//! use stoker_comm::{run_local, CommExt, Communicator, DEFAULT_TIMEOUT};
//!
//! let sums = run_local(3, DEFAULT_TIMEOUT, |comm| {
//!     let mut x = vec![comm.rank() as f32 + 1.0; 4];
//!     comm.all_reduce(&mut x).unwrap();
//!     x
//! });
//! assert!(sums.iter().all(|x| x == &vec![6.0; 4]));
//! ```
#![deny(missing_docs)]

pub mod checked;
pub mod communicator;
pub mod element;
pub mod error;
pub mod local;
pub mod nccl;
pub mod null;
pub mod shard;
pub mod stats;
pub mod tree;

#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(not(feature = "mpi"))]
pub mod mpi {
    //! The MPI backend is not compiled in (build with `--features mpi`).
    use crate::error::{CommError, Result};

    /// Stand-in for the MPI communicator of a build without MPI.
    pub enum MpiComm {}

    impl MpiComm {
        /// Always fails: this build has no MPI.
        pub fn init(_timeout: std::time::Duration) -> Result<MpiComm> {
            Err(CommError::NotCompiled {
                backend: "mpi",
                feature: "mpi",
            })
        }
    }

    pub use crate::launch::{host_name, launched_world, local_ranks};

    /// Without MPI there is no job to abort: ends this process.
    pub fn abort_world(code: i32) -> ! {
        std::process::exit(code)
    }

    impl crate::Communicator for MpiComm {
        fn rank(&self) -> usize {
            match *self {}
        }
        fn world_size(&self) -> usize {
            match *self {}
        }
        fn backend(&self) -> &'static str {
            match *self {}
        }
        fn timeout(&self) -> std::time::Duration {
            match *self {}
        }
        fn all_reduce_buf(&self, _: crate::BufMut<'_>) -> Result<()> {
            match *self {}
        }
        fn reduce_scatter_buf(
            &self,
            _: crate::Buf<'_>,
            _: &[usize],
            _: crate::BufMut<'_>,
        ) -> Result<()> {
            match *self {}
        }
        fn all_gather_buf(
            &self,
            _: crate::Buf<'_>,
            _: &[usize],
            _: crate::BufMut<'_>,
        ) -> Result<()> {
            match *self {}
        }
        fn broadcast_buf(&self, _: crate::BufMut<'_>, _: usize) -> Result<()> {
            match *self {}
        }
        fn barrier(&self) -> Result<()> {
            match *self {}
        }
        fn send_recv_buf(&self, _: usize, _: crate::Buf<'_>, _: crate::BufMut<'_>) -> Result<()> {
            match *self {}
        }
        fn start_all_reduce(&self, _: crate::Buffer) -> Result<crate::Pending> {
            match *self {}
        }
        fn start_reduce_scatter(
            &self,
            _: crate::Buffer,
            _: &[usize],
            _: crate::Buffer,
        ) -> Result<crate::Pending> {
            match *self {}
        }
        fn start_all_gather(
            &self,
            _: crate::Buffer,
            _: &[usize],
            _: crate::Buffer,
        ) -> Result<crate::Pending> {
            match *self {}
        }
        fn stats(&self) -> crate::CommStats {
            match *self {}
        }
        fn abort(&self, _: i32, _: &str) -> ! {
            match *self {}
        }
    }

    impl MpiComm {
        /// Never called: no value of this type exists.
        pub fn finalize(self, _grace: std::time::Duration, _code: i32) {
            match self {}
        }
        /// Never called: no value of this type exists.
        pub fn set_timeout(&mut self, _t: std::time::Duration) {
            match *self {}
        }
    }
}

mod launch;
mod say;

pub use say::say;

pub use checked::Checked;
pub use communicator::{CommExt, Communicator, Pending, PendingOp, DEFAULT_TIMEOUT};
pub use element::{Buf, BufMut, Buffer, DType, Element};
pub use error::{CommError, Result};
pub use local::{local_group, run_local, LocalComm};
pub use null::NullComm;
pub use stats::{CommStats, Op, OpStats};
pub use tree::{tree_all_reduce, tree_sum, tree_supports};
