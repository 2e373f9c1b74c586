//! Gradient buckets: PyTorch DDP's design over the execution-order flat layout.
//!
//! A bucket is a run of whole parameter groups (layers, blocks), formed from the last
//! group backwards because the backward finishes them in that order: the first bucket
//! holds the final layers and is small (`first_bucket_mb`, 1 MiB as in PyTorch) so its
//! all-reduce starts early; the others fill up to `bucket_cap_mb` (25 MiB by default).
//! A group larger than the cap is a bucket of its own. Because the layout is in
//! execution order, every bucket is one contiguous range of the flat buffer.
//!
//! When the last group of a bucket is ready, the bucket's gradients are copied into its
//! own buffer and a non-blocking collective starts (buckets start in plan order on every
//! rank, whatever order their groups finish in, as MPI requires): an all-reduce (DDP), or
//! a reduce-scatter that leaves each rank the sums of the part of the bucket it owns
//! (ZeRO-2, [`BucketOp::ReduceScatter`]). After the backward, [`Buckets::finish`] waits
//! for them in order and copies the sums back. The copies cost two passes over the
//! gradients and one gradient-sized buffer (PyTorch's default too, without
//! `gradient_as_bucket_view`).

use std::collections::HashMap;
use std::ops::Range;
use std::time::{Duration, Instant};

use stoker_comm::{Buffer, Communicator, Element, Pending};

use crate::error::{Result, TrainError};
use stoker_comm::shard::ShardPlan;

/// The collective each bucket runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BucketOp {
    /// Every rank gets the bucket's sums (DDP).
    AllReduce,
    /// Rank `rank` gets the sums of the part of the bucket `shards` gives it (ZeRO-2).
    ReduceScatter {
        /// The ranks' ranges of the flat buffer.
        shards: ShardPlan,
        /// This rank.
        rank: usize,
    },
}

/// One bucket: a contiguous range of the flat buffer and the groups it covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Elements of the flat buffer.
    pub range: Range<usize>,
    /// The groups, last first.
    pub groups: Vec<usize>,
}

/// Buckets over `groups` (`(group, element range)` in buffer order, as
/// [`FlatLayout::group_ranges`](crate::layout::FlatLayout::group_ranges) gives them), in
/// the order they are reduced: the last group first. The first bucket holds at most
/// `first_bytes`, the others at most `cap_bytes`, except a single group larger than that.
pub fn plan(groups: &[(usize, Range<usize>)], cap_bytes: usize, first_bytes: usize) -> Vec<Bucket> {
    let mut out: Vec<Bucket> = Vec::new();
    let mut cur: Option<Bucket> = None;
    for (g, r) in groups.iter().rev() {
        let cap = if out.is_empty() {
            first_bytes
        } else {
            cap_bytes
        };
        match &mut cur {
            Some(b) if (b.range.end - r.start) * 4 <= cap => {
                b.range.start = r.start;
                b.groups.push(*g);
            }
            _ => {
                if let Some(b) = cur.take() {
                    out.push(b);
                }
                cur = Some(Bucket {
                    range: r.clone(),
                    groups: vec![*g],
                });
            }
        }
    }
    out.extend(cur);
    out
}

/// The buckets of one data-parallel rank and their reductions in flight.
pub struct Buckets {
    plan: Vec<Bucket>,
    op: BucketOp,
    bucket_of: HashMap<usize, usize>,
    /// Groups not yet ready, per bucket.
    missing: Vec<usize>,
    in_flight: Vec<Option<Pending>>,
    /// Each bucket's buffer, kept between windows.
    spare: Vec<Option<Vec<f32>>>,
    /// Each bucket's reduce-scatter output, kept between windows.
    spare_out: Vec<Option<Vec<f32>>>,
    /// The next bucket to start: buckets start in plan order.
    next: usize,
}

impl Buckets {
    /// Buckets of `plan` running `op`, with nothing in flight.
    pub fn new(plan: Vec<Bucket>, op: BucketOp) -> Self {
        let mut bucket_of = HashMap::new();
        for (i, b) in plan.iter().enumerate() {
            for &g in &b.groups {
                bucket_of.insert(g, i);
            }
        }
        let n = plan.len();
        Buckets {
            missing: plan.iter().map(|b| b.groups.len()).collect(),
            plan,
            op,
            bucket_of,
            in_flight: (0..n).map(|_| None).collect(),
            spare: (0..n).map(|_| None).collect(),
            spare_out: (0..n).map(|_| None).collect(),
            next: 0,
        }
    }

    /// The plan.
    pub fn plan(&self) -> &[Bucket] {
        &self.plan
    }

    /// Bytes the buckets' buffers hold (they are allocated at first use and kept).
    pub fn buffer_bytes(&self) -> usize {
        let held = |v: &Vec<Option<Vec<f32>>>| -> usize {
            v.iter().flatten().map(|b| 4 * b.capacity()).sum()
        };
        held(&self.spare) + held(&self.spare_out)
    }

    /// The most bytes the buckets hold during a backward (each bucket's copy, and under a
    /// reduce-scatter its output shard), known before the first backward allocates them.
    /// Between steps an all-reduce keeps all of it; a reduce-scatter keeps the outputs.
    pub fn steady_bytes(&self) -> usize {
        self.plan
            .iter()
            .map(|b| {
                let out = match &self.op {
                    BucketOp::AllReduce => 0,
                    BucketOp::ReduceScatter { shards, rank } => {
                        shards.counts_within(&b.range)[*rank]
                    }
                };
                4 * (b.range.len() + out)
            })
            .sum()
    }

    /// Group `group` is ready in `grads`: starts every bucket whose groups are all ready
    /// (in plan order), and lets earlier ones progress.
    pub fn ready(&mut self, comm: &dyn Communicator, group: usize, grads: &[f32]) -> Result<()> {
        let b = *self
            .bucket_of
            .get(&group)
            .ok_or_else(|| TrainError::Layout(format!("group {group} is in no gradient bucket")))?;
        if self.missing[b] == 0 {
            return Err(TrainError::Layout(format!(
                "group {group} reported ready twice in one backward"
            )));
        }
        self.missing[b] -= 1;
        while self.next < self.plan.len() && self.missing[self.next] == 0 {
            let i = self.next;
            let range = self.plan[i].range.clone();
            let mut buf = self.spare[i].take().unwrap_or_default();
            buf.clear();
            buf.extend_from_slice(&grads[range.clone()]);
            self.in_flight[i] = Some(match &self.op {
                BucketOp::AllReduce => comm.start_all_reduce(Buffer::F32(buf))?,
                BucketOp::ReduceScatter { shards, rank } => {
                    let counts = shards.counts_within(&range);
                    let mut out = self.spare_out[i].take().unwrap_or_default();
                    out.resize(counts[*rank], 0.0);
                    comm.start_reduce_scatter(Buffer::F32(buf), &counts, Buffer::F32(out))?
                }
            });
            self.next += 1;
        }
        comm.progress();
        Ok(())
    }

    /// Waits for every bucket (in order), copies the sums into `grads`, and readies the
    /// buckets for the next backward; returns the time spent waiting.
    pub fn finish(&mut self, grads: &mut [f32]) -> Result<Duration> {
        if self.next < self.plan.len() {
            let b = &self.plan[self.next];
            return Err(TrainError::Layout(format!(
                "gradient bucket {} (groups {:?}) never became ready: the backward did not report every group",
                self.next, b.groups
            )));
        }
        let t0 = Instant::now();
        for i in 0..self.plan.len() {
            let p = self.in_flight[i].take().expect("started above");
            let range = &self.plan[i].range;
            match &self.op {
                BucketOp::AllReduce => {
                    let sums = p.wait_vec::<f32>()?;
                    grads[range.clone()].copy_from_slice(&sums);
                    self.spare[i] = Some(sums);
                }
                BucketOp::ReduceScatter { shards, rank } => {
                    let (out, input) = p.wait_with_input()?;
                    let sums = f32_vec(out)?;
                    grads[shards.owned_within(*rank, range)].copy_from_slice(&sums);
                    self.spare_out[i] = Some(sums);
                    self.spare[i] = input.map(f32_vec).transpose()?;
                }
            }
        }
        let waited = t0.elapsed();
        self.next = 0;
        for (m, b) in self.missing.iter_mut().zip(&self.plan) {
            *m = b.groups.len();
        }
        Ok(waited)
    }
}

/// The f32 vector in a collective's result buffer.
fn f32_vec(b: Buffer) -> Result<Vec<f32>> {
    let got = b.dtype();
    f32::unwrap(b).ok_or_else(|| {
        TrainError::Layout(format!(
            "a gradient bucket's collective gave {} back, not f32",
            got.name()
        ))
    })
}

impl Drop for Buckets {
    /// Reductions still in flight when the buckets go (an error ended the step): the job
    /// is ending, so give up on them instead of waiting a timeout for each.
    fn drop(&mut self) {
        for p in self.in_flight.iter_mut().filter_map(Option::take) {
            p.abandon();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_run_last_group_first_and_tile_the_buffer() {
        // Groups of 10, 100, 100, 100 and 5 elements (f32).
        let groups = vec![
            (0, 0..10),
            (1, 10..110),
            (2, 110..210),
            (3, 210..310),
            (4, 310..315),
        ];
        let p = plan(&groups, 800, 100);
        // First bucket <= 100 bytes: group 4 alone (20 bytes; adding group 3 makes 420).
        assert_eq!(
            p[0],
            Bucket {
                range: 310..315,
                groups: vec![4]
            }
        );
        // Then <= 800 bytes: groups 3 and 2 (800 bytes), then 1 and 0 (440 bytes).
        assert_eq!(
            p[1],
            Bucket {
                range: 110..310,
                groups: vec![3, 2]
            }
        );
        assert_eq!(
            p[2],
            Bucket {
                range: 0..110,
                groups: vec![1, 0]
            }
        );
        // A group over the cap is its own bucket.
        let p = plan(&[(0, 0..1000), (1, 1000..1001)], 40, 40);
        assert_eq!(p.len(), 2);
        assert_eq!(p[1].range, 0..1000);
    }
}
