//! ZeRO-3's split of the flat buffer: every parameter group (the embeddings, a block, the
//! final norm) split over the ranks in rank order, so each rank owns about 1/N of every
//! group, as FSDP shards each unit's flat parameter and DeepSpeed each parameter. A
//! group's all-gather and reduce-scatter then move the same bytes in every direction of
//! every link. Split contiguously instead (ZeRO-1/2's [`super::ShardPlan`]), each group
//! of a model with more groups than ranks belongs to one rank, its gather is a one-way
//! send and takes up to twice the ring's time on a bandwidth-bound link (measured: ZeRO-3
//! at 100 Mbit/s, communication 1.43x its bytes' link time).
//!
//! A rank keeps its pieces end to end in its own buffer ([`Pieces`]), group order.

use std::ops::Range;

use super::Pieces;
use stoker_comm::shard::GroupSplit;

/// Which elements of each group each rank owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupShards {
    len: usize,
    spans: Vec<Range<usize>>,
    /// Each group's elements by rank, rank order (consecutive ranges of the group).
    counts: Vec<Vec<usize>>,
}

impl GroupShards {
    /// The split of the groups `spans` (ascending, tiling `0..len` of the flat buffer)
    /// over `world` ranks, in rank order within each group, boundaries at multiples of
    /// `align` elements from the group's start (the layout aligns every group's start).
    /// A group of `u` alignment units gives `u / world` to every rank and one more to
    /// `u % world` of them, taken in turn across the groups, so that no rank holds more
    /// than one unit above another in all.
    pub fn new(spans: Vec<Range<usize>>, world: usize, align: usize) -> Self {
        let (world, align) = (world.max(1), align.max(1));
        let len = spans.last().map_or(0, |s| s.end);
        // The rank the next group's first extra unit goes to.
        let mut next = 0;
        let mut counts = Vec::with_capacity(spans.len());
        for s in &spans {
            let units = s.len().div_ceil(align);
            let (base, extra) = (units / world, units % world);
            let mut left = s.len();
            let group: Vec<usize> = (0..world)
                .map(|r| {
                    let gets_extra = (r + world - next) % world < extra;
                    let n = ((base + usize::from(gets_extra)) * align).min(left);
                    left -= n;
                    n
                })
                .collect();
            next = (next + extra) % world;
            counts.push(group);
        }
        GroupShards { len, spans, counts }
    }

    /// Elements of the whole buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What rank `rank` owns: one piece of every group (none of a group too small to
    /// reach it).
    pub fn held(&self, rank: usize) -> Pieces {
        Pieces::new((0..self.spans.len()).map(|g| self.range(g, rank)))
    }

    /// Rank `rank`'s range of group `g` (of the flat buffer).
    fn range(&self, g: usize, rank: usize) -> Range<usize> {
        let start = self.spans[g].start + self.counts[g][..rank].iter().sum::<usize>();
        start..start + self.counts[g][rank]
    }

    /// Every group as rank `rank`'s collectives over it see it.
    pub fn group_splits(&self, rank: usize) -> Vec<GroupSplit> {
        let mut at = 0;
        self.spans
            .iter()
            .zip(&self.counts)
            .map(|(s, counts)| {
                let n = counts[rank];
                let local = at..at + n;
                at += n;
                GroupSplit {
                    span: s.clone(),
                    counts: counts.clone(),
                    local,
                }
            })
            .collect()
    }

    /// The group whose span is `span`, if one is.
    pub fn group_of(&self, span: &Range<usize>) -> Option<usize> {
        let g = self.spans.partition_point(|s| s.start < span.start);
        (self.spans.get(g) == Some(span)).then_some(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_group_is_split_over_every_rank_and_the_pieces_tile_the_buffer() {
        let spans = vec![0..64, 64..96, 96..400, 400..416];
        let g = GroupShards::new(spans.clone(), 2, 16);
        assert_eq!(g.held(0).ranges(), &[0..32, 64..80, 96..256]);
        // The last group's one unit goes to rank 1: rank 0 had the extra one before.
        assert_eq!(g.held(1).ranges(), &[32..64, 80..96, 256..416]);
        // Every element owned by exactly one rank.
        let mut owner = vec![0usize; 416];
        for rank in 0..2 {
            for r in g.held(rank).ranges() {
                for o in &mut owner[r.clone()] {
                    *o += 1;
                }
            }
        }
        assert!(owner.iter().all(|&n| n == 1));
        // The splits: counts in rank order, this rank's pieces end to end.
        let s1 = g.group_splits(1);
        assert_eq!(s1[2].counts, vec![160, 144]);
        assert_eq!(s1[2].local, 48..192);
        assert_eq!(s1[3].local, 192..208);
        let held = g.held(1);
        for s in &s1 {
            assert_eq!(held.local(&s.span), s.local);
        }
        assert_eq!(g.group_of(&(96..400)), Some(2));
        assert_eq!(g.group_of(&(96..300)), None);
        // Balanced: the extra units go round, so the ranks' totals differ by at most one.
        let g = GroupShards::new(spans, 4, 16);
        let held: Vec<usize> = (0..4).map(|r| g.held(r).len()).collect();
        assert_eq!(held, vec![112, 112, 96, 96]);
        assert_eq!(g.group_splits(0)[2].counts, vec![80, 64, 80, 80]);
    }
}
