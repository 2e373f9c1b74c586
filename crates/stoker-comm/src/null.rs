//! A communicator that moves no data: one rank of a pretended group whose non-blocking
//! collectives complete at once and hand their buffers back untouched. It lets code that
//! schedules collectives run its schedule alone, to count the buffers the schedule holds
//! before any peer exists (the trainer tells ZeRO's per-group workspace this way before
//! its first step). Blocking collectives have nothing to pretend and fail.

use std::time::Duration;

use crate::communicator::{Communicator, Pending, DEFAULT_TIMEOUT};
use crate::element::{Buf, BufMut, Buffer};
use crate::error::{CommError, Result};
use crate::stats::CommStats;

/// Rank `rank` of a pretended group of `world` ranks.
#[derive(Debug, Clone, Copy)]
pub struct NullComm {
    rank: usize,
    world: usize,
}

impl NullComm {
    /// Rank `rank` of `world` (`rank < world`).
    pub fn new(rank: usize, world: usize) -> Result<Self> {
        if rank >= world {
            return Err(CommError::Argument {
                op: "null",
                rank,
                detail: format!("rank {rank} of a world of {world}"),
            });
        }
        Ok(NullComm { rank, world })
    }

    fn refuse(&self, op: &'static str) -> CommError {
        CommError::Unsupported {
            op,
            rank: self.rank,
            detail: "the null communicator moves no data; only non-blocking collectives run".into(),
        }
    }
}

impl Communicator for NullComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn backend(&self) -> &'static str {
        "null"
    }

    fn timeout(&self) -> Duration {
        DEFAULT_TIMEOUT
    }

    fn all_reduce_buf(&self, _buf: BufMut<'_>) -> Result<()> {
        Err(self.refuse("all_reduce"))
    }

    fn reduce_scatter_buf(
        &self,
        _input: Buf<'_>,
        _counts: &[usize],
        _output: BufMut<'_>,
    ) -> Result<()> {
        Err(self.refuse("reduce_scatter"))
    }

    fn all_gather_buf(
        &self,
        _input: Buf<'_>,
        _counts: &[usize],
        _output: BufMut<'_>,
    ) -> Result<()> {
        Err(self.refuse("all_gather"))
    }

    fn broadcast_buf(&self, _buf: BufMut<'_>, _root: usize) -> Result<()> {
        Err(self.refuse("broadcast"))
    }

    fn barrier(&self) -> Result<()> {
        Err(self.refuse("barrier"))
    }

    fn send_recv_buf(&self, _peer: usize, _send: Buf<'_>, _recv: BufMut<'_>) -> Result<()> {
        Err(self.refuse("send_recv"))
    }

    fn start_all_reduce(&self, buf: Buffer) -> Result<Pending> {
        Ok(Pending::ready(buf, None))
    }

    fn start_reduce_scatter(
        &self,
        input: Buffer,
        _counts: &[usize],
        output: Buffer,
    ) -> Result<Pending> {
        Ok(Pending::ready(output, Some(input)))
    }

    fn start_all_gather(
        &self,
        input: Buffer,
        _counts: &[usize],
        output: Buffer,
    ) -> Result<Pending> {
        Ok(Pending::ready(output, Some(input)))
    }

    fn stats(&self) -> CommStats {
        CommStats::default()
    }

    fn abort(&self, code: i32, message: &str) -> ! {
        panic!(
            "rank {} of a null group aborted (code {code}): {message}",
            self.rank
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_blocking_collectives_give_their_buffers_back_and_blocking_ones_fail() {
        let c = NullComm::new(1, 2).unwrap();
        let p = c
            .start_all_gather(Buffer::F32(vec![1.0]), &[1, 1], Buffer::F32(vec![0.0; 2]))
            .unwrap();
        let (out, input) = p.wait_with_input().unwrap();
        assert!(matches!(out, Buffer::F32(v) if v == vec![0.0; 2]));
        assert!(matches!(input, Some(Buffer::F32(v)) if v == vec![1.0]));
        let mut x = [1f32];
        let err = crate::CommExt::all_reduce(&c, &mut x).unwrap_err();
        assert!(err.to_string().contains("moves no data"), "{err}");
        assert!(NullComm::new(2, 2).is_err());
    }
}
