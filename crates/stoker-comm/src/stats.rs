//! What a communicator has moved: calls and bytes per collective, counted by the
//! communicator itself so that a run can hold its traffic against the planner's.
//!
//! `bytes` is the payload of this rank's buffer; `bus_bytes` is what this rank sends
//! under the ring algorithms that nccl-tests' bus bandwidth assumes: all_reduce
//! `2 (n-1)/n x B`, reduce_scatter `(n-1)/n x B` of the input, all_gather `(n-1)/n x B` of
//! the output, broadcast `B`, send_recv `B`. MPI may pick other algorithms; the model is
//! the one the ZeRO paper's "2P / 3P per step" counts in.

use std::cell::RefCell;

/// The collectives a communicator offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Sum over ranks, result on every rank.
    AllReduce,
    /// Sum over ranks, rank r keeps segment r.
    ReduceScatter,
    /// Every rank's segment, concatenated, on every rank.
    AllGather,
    /// The root's buffer on every rank.
    Broadcast,
    /// Every rank waits for all.
    Barrier,
    /// One exchange with one peer.
    SendRecv,
}

impl Op {
    /// The collective's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
            Op::SendRecv => "send_recv",
        }
    }

    /// Bytes this rank sends for a buffer of `bytes` (the full input of reduce_scatter,
    /// the full output of all_gather) at world size `n`, under the ring model.
    pub fn bus_bytes(self, bytes: usize, n: usize) -> u64 {
        if n <= 1 {
            return 0;
        }
        let b = bytes as u64;
        let n = n as u64;
        match self {
            Op::AllReduce => 2 * (n - 1) * b / n,
            Op::ReduceScatter | Op::AllGather => (n - 1) * b / n,
            Op::Broadcast | Op::SendRecv => b,
            Op::Barrier => 0,
        }
    }

    const ALL: [Op; 6] = [
        Op::AllReduce,
        Op::ReduceScatter,
        Op::AllGather,
        Op::Broadcast,
        Op::Barrier,
        Op::SendRecv,
    ];

    fn index(self) -> usize {
        Op::ALL.iter().position(|&o| o == self).expect("listed")
    }
}

/// Calls and bytes of one collective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpStats {
    /// Calls started.
    pub calls: u64,
    /// Payload bytes (see the module doc for which buffer).
    pub bytes: u64,
    /// Bytes this rank sent under the ring model.
    pub bus_bytes: u64,
}

/// Calls and bytes per collective since the communicator was made (or last reset).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommStats {
    ops: [OpStats; 6],
}

impl CommStats {
    /// The counters of `op`.
    pub fn op(&self, op: Op) -> OpStats {
        self.ops[op.index()]
    }

    /// Calls of every collective but barriers.
    pub fn calls(&self) -> u64 {
        Op::ALL
            .iter()
            .filter(|&&o| o != Op::Barrier)
            .map(|&o| self.op(o).calls)
            .sum()
    }

    /// Bytes sent under the ring model, over every collective.
    pub fn bus_bytes(&self) -> u64 {
        self.ops.iter().map(|o| o.bus_bytes).sum()
    }

    /// The counters since `earlier` (a snapshot of the same communicator).
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let mut out = self.clone();
        for (o, e) in out.ops.iter_mut().zip(&earlier.ops) {
            o.calls -= e.calls;
            o.bytes -= e.bytes;
            o.bus_bytes -= e.bus_bytes;
        }
        out
    }

    /// The counters of `self` and `other` added (two sets of calls on one communicator).
    pub fn plus(&self, other: &CommStats) -> CommStats {
        let mut out = self.clone();
        for (o, e) in out.ops.iter_mut().zip(&other.ops) {
            o.calls += e.calls;
            o.bytes += e.bytes;
            o.bus_bytes += e.bus_bytes;
        }
        out
    }

    /// `(op, counters)` for every collective called at least once.
    pub fn nonzero(&self) -> Vec<(Op, OpStats)> {
        Op::ALL
            .iter()
            .map(|&o| (o, self.op(o)))
            .filter(|(_, s)| s.calls > 0)
            .collect()
    }
}

/// The counters a backend keeps (one thread uses a communicator, so a `RefCell`).
#[derive(Debug, Default)]
pub struct StatsCell(RefCell<CommStats>);

impl StatsCell {
    /// Counts one call of `op` over `bytes` at world size `n`.
    pub fn count(&self, op: Op, bytes: usize, n: usize) {
        let mut s = self.0.borrow_mut();
        let o = &mut s.ops[op.index()];
        o.calls += 1;
        o.bytes += bytes as u64;
        o.bus_bytes += op.bus_bytes(bytes, n);
    }

    /// A snapshot.
    pub fn snapshot(&self) -> CommStats {
        self.0.borrow().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_model_bytes() {
        assert_eq!(Op::AllReduce.bus_bytes(1000, 4), 1500);
        assert_eq!(Op::ReduceScatter.bus_bytes(1000, 4), 750);
        assert_eq!(Op::AllGather.bus_bytes(1000, 2), 500);
        assert_eq!(Op::AllReduce.bus_bytes(1000, 1), 0);
        let s = StatsCell::default();
        s.count(Op::AllReduce, 1000, 2);
        let a = s.snapshot();
        s.count(Op::AllReduce, 1000, 2);
        s.count(Op::Barrier, 0, 2);
        let d = s.snapshot().since(&a);
        assert_eq!(d.op(Op::AllReduce).calls, 1);
        assert_eq!(d.calls(), 1);
        assert_eq!(d.bus_bytes(), 1000);
    }
}
