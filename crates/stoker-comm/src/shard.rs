//! ZeRO-1/2's split of the flat buffer (and every checkpoint's), for the CPU trainer
//! and the resident path alike: rank `r` owns one
//! contiguous range, rank order, each boundary a multiple of the layout's alignment (a
//! cache line), the last rank's range ending at the buffer's end (it may be shorter, or
//! empty on a tiny model). Ranges of the execution-order layout, so a rank's shard is a
//! run of consecutive blocks, cut wherever the boundary falls (inside a tensor too: the
//! optimizers work on segments). ZeRO-3 splits each group instead (stoker-train's
//! `GroupShards`).

use std::ops::Range;

/// The flat layouts' alignment, and so the shards' boundaries: 16 f32 elements, 64 bytes,
/// one cache line.
pub const DEFAULT_ALIGN: usize = 16;

/// One parameter group's split over the ranks, as one rank's collectives over it need
/// it: the group's span of the flat buffer, each rank's element count in it (rank order,
/// the counts of an all-gather or reduce-scatter of the group) and where this rank's
/// piece lies in its own buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSplit {
    /// The group's span of the flat buffer.
    pub span: Range<usize>,
    /// Elements of the span each rank owns, rank order.
    pub counts: Vec<usize>,
    /// This rank's piece as a range of its own buffer (empty if it owns none).
    pub local: Range<usize>,
}

/// Which elements of a flat buffer of `len` elements each of `world` ranks owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    len: usize,
    ranges: Vec<Range<usize>>,
}

impl ShardPlan {
    /// The split of `len` elements over `world` ranks (at least 1), boundaries at
    /// multiples of `align` elements (at least 1).
    pub fn new(len: usize, world: usize, align: usize) -> Self {
        let (world, align) = (world.max(1), align.max(1));
        let per = len.div_ceil(world).div_ceil(align) * align;
        let ranges = (0..world)
            .map(|r| (r * per).min(len)..((r + 1) * per).min(len))
            .collect();
        ShardPlan { len, ranges }
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.ranges.len()
    }

    /// Elements of the whole buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The range rank `rank` owns.
    pub fn range(&self, rank: usize) -> Range<usize> {
        self.ranges[rank].clone()
    }

    /// Each of `spans` (the groups) as rank `rank`'s collectives over it see it.
    pub fn group_splits(&self, rank: usize, spans: &[Range<usize>]) -> Vec<GroupSplit> {
        spans
            .iter()
            .map(|span| GroupSplit {
                span: span.clone(),
                counts: self.counts_within(span),
                local: self.local_within(rank, span),
            })
            .collect()
    }

    /// Every rank's range, rank order.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// Elements per rank: the counts of a reduce-scatter or all-gather of the whole buffer.
    pub fn counts(&self) -> Vec<usize> {
        self.ranges.iter().map(|r| r.len()).collect()
    }

    /// Elements of `part` each rank owns: the counts of a reduce-scatter of that part
    /// (a bucket), whose pieces are in rank order because the ranges are.
    pub fn counts_within(&self, part: &Range<usize>) -> Vec<usize> {
        self.ranges
            .iter()
            .map(|r| r.end.min(part.end).saturating_sub(r.start.max(part.start)))
            .collect()
    }

    /// The part of `part` that rank `rank` owns (possibly empty).
    pub fn owned_within(&self, rank: usize, part: &Range<usize>) -> Range<usize> {
        let r = &self.ranges[rank];
        let start = r.start.max(part.start);
        start..r.end.min(part.end).max(start)
    }

    /// [`ShardPlan::owned_within`] as a range of `rank`'s own shard (empty if it owns none
    /// of `part`): where a collective over `part` reads or adds this rank's elements.
    pub fn local_within(&self, rank: usize, part: &Range<usize>) -> Range<usize> {
        let owned = self.owned_within(rank, part);
        let base = self.ranges[rank].start;
        match owned.is_empty() {
            true => 0..0,
            false => owned.start - base..owned.end - base,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_tile_the_buffer_in_rank_order_at_aligned_boundaries() {
        for (len, world) in [(0, 1), (5, 4), (100, 1), (100, 3), (1000, 8), (4096, 4)] {
            let p = ShardPlan::new(len, world, 16);
            assert_eq!(p.world(), world);
            assert_eq!(p.counts().iter().sum::<usize>(), len, "{len} over {world}");
            let mut at = 0;
            for r in p.ranges() {
                assert_eq!(r.start, at);
                assert!(r.start % 16 == 0 || r.start == len);
                at = r.end;
            }
            assert_eq!(at, len);
        }
        let p = ShardPlan::new(100, 3, 16);
        assert_eq!(p.ranges(), &[0..48, 48..96, 96..100]);
        assert_eq!(p.counts_within(&(40..60)), vec![8, 12, 0]);
        assert_eq!(p.owned_within(1, &(40..60)), 48..60);
        assert_eq!(p.owned_within(2, &(40..60)).len(), 0);
        assert_eq!(
            p.counts_within(&(0..100)).iter().sum::<usize>(),
            100,
            "whole buffer"
        );
    }
}
