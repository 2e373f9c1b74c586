//! Communication errors: each names the collective, the rank and the bytes involved, so a
//! hung or broken job says where it stopped.

use std::time::Duration;

/// What went wrong in a collective.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A wait ran past the communicator's timeout.
    #[error(
        "{op} of {bytes} bytes timed out after {:.1} s on rank {rank} of {world}: {detail}",
        after.as_secs_f64()
    )]
    Timeout {
        /// The collective (`all_reduce`, `reduce_scatter`, ...).
        op: &'static str,
        /// The rank that waited.
        rank: usize,
        /// World size.
        world: usize,
        /// Bytes of this rank's buffer.
        bytes: usize,
        /// How long it waited.
        after: Duration,
        /// Which ranks are missing or gone, where the backend can tell.
        detail: String,
    },
    /// A peer left the group (its process died or its communicator was dropped).
    #[error("{op} of {bytes} bytes on rank {rank}: rank {lost} is gone ({detail})")]
    RankLost {
        /// The collective.
        op: &'static str,
        /// The rank that noticed.
        rank: usize,
        /// The lost rank.
        lost: usize,
        /// Bytes of this rank's buffer.
        bytes: usize,
        /// How it was noticed.
        detail: String,
    },
    /// Ranks called different collectives, or the same one with different sizes.
    #[error("collective call {call} on rank {rank}: {detail}")]
    Mismatch {
        /// The rank that noticed.
        rank: usize,
        /// The call's sequence number on this communicator.
        call: u64,
        /// What differed.
        detail: String,
    },
    /// Arguments that do not fit (lengths, counts, root, dtype).
    #[error("{op} on rank {rank}: {detail}")]
    Argument {
        /// The collective.
        op: &'static str,
        /// The calling rank.
        rank: usize,
        /// What is wrong and what was expected.
        detail: String,
    },
    /// The backend library reported an error.
    #[error("{op} on rank {rank}: {backend} error {code}: {message}")]
    Backend {
        /// The collective.
        op: &'static str,
        /// The calling rank.
        rank: usize,
        /// `mpi` or `nccl`.
        backend: &'static str,
        /// The library's error code.
        code: i32,
        /// The library's message.
        message: String,
    },
    /// The backend was not compiled in.
    #[error("the {backend} backend is not compiled in: rebuild with `--features {feature}`")]
    NotCompiled {
        /// `mpi` or `nccl`.
        backend: &'static str,
        /// The cargo feature that enables it.
        feature: &'static str,
    },
    /// Starting the backend failed (launcher, environment, library).
    #[error("starting the {backend} backend: {message}")]
    Launch {
        /// The backend.
        backend: &'static str,
        /// What failed and how to fix it.
        message: String,
    },
    /// The operation is not available for this world size or configuration.
    #[error("{op} on rank {rank}: {detail}")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// The calling rank.
        rank: usize,
        /// Why, and what would work.
        detail: String,
    },
}

/// `Result` with [`CommError`].
pub type Result<T> = std::result::Result<T, CommError>;
