//! What one rank keeps of the flat buffer: ranges of it in buffer order, kept end to end
//! in the rank's own buffer (its "local" buffer). The whole buffer (one rank, DDP), one
//! contiguous shard (ZeRO-1/2's [`crate::parallel::ShardPlan`]) or one piece of every
//! parameter group (ZeRO-3's [`crate::parallel::GroupShards`]) are all `Pieces`, so the
//! trainer, the optimizer and the checkpoint map between the flat buffer and a rank's
//! buffer one way.

use std::ops::Range;

/// Ranges of a flat buffer, ascending and disjoint, none empty, adjacent ones merged; the
/// local buffer holds them end to end.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Pieces {
    ranges: Vec<Range<usize>>,
    /// Where each range starts in the local buffer.
    starts: Vec<usize>,
}

impl Pieces {
    /// `ranges` (ascending and disjoint; empty ones dropped, adjacent ones merged).
    ///
    /// # Panics
    /// If the ranges overlap or are out of order: every caller builds them from a split
    /// ([`Pieces::try_new`] checks ranges read from a file).
    pub fn new(ranges: impl IntoIterator<Item = Range<usize>>) -> Self {
        match Self::try_new(ranges) {
            Ok(p) => p,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Pieces::new`], or what is wrong with `ranges`.
    pub fn try_new(ranges: impl IntoIterator<Item = Range<usize>>) -> Result<Self, String> {
        let mut merged: Vec<Range<usize>> = Vec::new();
        for r in ranges.into_iter() {
            if r.start > r.end {
                return Err(format!("range {r:?} ends before it starts"));
            }
            if r.is_empty() {
                continue;
            }
            match merged.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                Some(last) if last.end > r.start => {
                    return Err(format!("pieces {last:?} and {r:?} out of order"))
                }
                _ => merged.push(r),
            }
        }
        let mut at = 0;
        let starts = merged
            .iter()
            .map(|r| {
                let s = at;
                at += r.len();
                s
            })
            .collect();
        Ok(Pieces {
            ranges: merged,
            starts,
        })
    }

    /// The one range `r`.
    pub fn one(r: Range<usize>) -> Self {
        Self::new([r])
    }

    /// The ranges, ascending.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// Elements kept: the local buffer's length.
    pub fn len(&self) -> usize {
        self.ranges.iter().map(|r| r.len()).sum()
    }

    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Whether these are the whole of a buffer of `len` elements.
    pub fn is_whole(&self, len: usize) -> bool {
        match self.ranges.as_slice() {
            [] => len == 0,
            [r] => *r == (0..len),
            _ => false,
        }
    }

    /// The local buffer of these pieces of `full` (the whole flat buffer).
    pub fn take<T: Copy>(&self, full: &[T]) -> Vec<T> {
        let mut out = Vec::with_capacity(self.len());
        for r in &self.ranges {
            out.extend_from_slice(&full[r.clone()]);
        }
        out
    }

    /// Writes the local buffer `local` back into its places in `full`.
    pub fn put<T: Copy>(&self, local: &[T], full: &mut [T]) {
        for (r, s) in self.ranges.iter().zip(&self.starts) {
            full[r.clone()].copy_from_slice(&local[*s..*s + r.len()]);
        }
    }

    /// The kept elements of `part` (a range of the flat buffer) as a range of the local
    /// buffer: contiguous there, because every piece strictly between the first and the
    /// last one `part` touches lies wholly inside it. Empty if none is kept.
    pub fn local(&self, part: &Range<usize>) -> Range<usize> {
        let mut found: Option<Range<usize>> = None;
        for (r, s) in self.ranges.iter().zip(&self.starts) {
            let (start, end) = (r.start.max(part.start), r.end.min(part.end));
            if start < end {
                let here = s + start - r.start..s + end - r.start;
                found = Some(match found {
                    Some(f) => f.start..here.end,
                    None => here,
                });
            }
        }
        found.unwrap_or(0..0)
    }

    /// Elements of `part` kept.
    pub fn owned_len(&self, part: &Range<usize>) -> usize {
        self.ranges
            .iter()
            .map(|r| r.end.min(part.end).saturating_sub(r.start.max(part.start)))
            .sum()
    }

    /// Whether every element of `other` is kept here.
    pub fn contains(&self, other: &Pieces) -> bool {
        other.ranges.iter().all(|o| self.owned_len(o) == o.len())
    }

    /// Where `other`'s elements lie in this local buffer, if all are kept and they lie
    /// end to end there (the same pieces, or one range of them).
    pub fn local_of(&self, other: &Pieces) -> Option<Range<usize>> {
        let (Some(first), Some(last)) = (other.ranges.first(), other.ranges.last()) else {
            return Some(0..0);
        };
        let local = self.local(&(first.start..last.end));
        (self.contains(other) && local.len() == other.len()).then_some(local)
    }

    /// Each range with its start in the local buffer.
    pub fn with_starts(&self) -> impl Iterator<Item = (&Range<usize>, usize)> {
        self.ranges.iter().zip(self.starts.iter().copied())
    }
}

impl From<Range<usize>> for Pieces {
    fn from(r: Range<usize>) -> Self {
        Pieces::one(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_map_the_flat_buffer_to_the_local_one_and_back() {
        let p = Pieces::new([2..4, 4..6, 8..8, 10..13]);
        assert_eq!(p.ranges(), &[2..6, 10..13]);
        assert_eq!(p.len(), 7);
        let full: Vec<u32> = (0..16).collect();
        let local = p.take(&full);
        assert_eq!(local, vec![2, 3, 4, 5, 10, 11, 12]);
        let mut back = vec![0u32; 16];
        p.put(&local, &mut back);
        for (i, v) in back.iter().enumerate() {
            let kept = (2..6).contains(&i) || (10..13).contains(&i);
            assert_eq!(*v, if kept { i as u32 } else { 0 });
        }
        assert_eq!(p.local(&(0..3)), 0..1);
        assert_eq!(p.local(&(5..12)), 3..6);
        assert_eq!(p.local(&(6..10)), 0..0);
        assert_eq!(p.owned_len(&(5..12)), 3);
        assert!(p.contains(&Pieces::new([3..5, 11..13])));
        assert!(!p.contains(&Pieces::one(5..7)));
        assert_eq!(p.local_of(&p), Some(0..7));
        assert_eq!(p.local_of(&Pieces::one(3..5)), Some(1..3));
        assert_eq!(p.local_of(&Pieces::new([5..6, 10..11])), Some(3..5));
        assert_eq!(p.local_of(&Pieces::new([4..5, 11..12])), None);
        assert_eq!(p.local_of(&Pieces::one(12..14)), None);
        assert!(Pieces::one(0..5).is_whole(5));
        assert!(!p.is_whole(16));
    }

    #[test]
    #[should_panic(expected = "out of order")]
    fn overlapping_pieces_are_refused() {
        Pieces::new([0..4, 3..6]);
    }
}
