//! Where each block's parameters lie in the flat buffer, as runs of consecutive elements:
//! what a data-parallel reduction may start on once the backward has finished the block
//! (DDP's buckets, one per block, as torch's DDP and llm.c overlap them with the rest of
//! the backward). Computed once when a step is made.

use std::ops::Range;

/// `(start, len)` pieces merged into sorted runs of consecutive elements.
pub fn merge_runs(mut pieces: Vec<(usize, usize)>) -> Vec<Range<usize>> {
    pieces.sort_unstable();
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (start, len) in pieces.into_iter().filter(|&(_, len)| len > 0) {
        match runs.last_mut() {
            Some(r) if r.end == start => r.end += len,
            _ => runs.push(start..start + len),
        }
    }
    runs
}

/// The runs of `0..end` that no block's runs cover (the embeddings, the final norm, the
/// head): reduced after the backward's last kernel.
pub fn outside_blocks(blocks: &[Vec<Range<usize>>], end: usize) -> Vec<Range<usize>> {
    let pieces = blocks
        .iter()
        .flatten()
        .map(|r| (r.start, r.len()))
        .collect();
    let mut at = 0;
    let mut rest = Vec::new();
    for r in merge_runs(pieces) {
        if r.start > at {
            rest.push(at..r.start);
        }
        at = at.max(r.end);
    }
    if at < end {
        rest.push(at..end);
    }
    rest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_and_the_rest_is_their_complement() {
        assert_eq!(
            merge_runs(vec![(10, 5), (0, 4), (4, 6), (20, 0)]),
            vec![0..15]
        );
        assert_eq!(merge_runs(vec![(3, 2), (8, 1)]), vec![3..5, 8..9]);
        let blocks = vec![vec![2..5], vec![5..7, 9..10]];
        assert_eq!(outside_blocks(&blocks, 12), vec![0..2, 7..9, 10..12]);
        assert_eq!(outside_blocks(&[], 3), vec![0..3]);
    }
}
