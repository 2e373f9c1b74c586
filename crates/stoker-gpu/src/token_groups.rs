//! A batch's token positions grouped by token: what the embedding's backward needs to
//! give each row of the table's gradient exactly one writer (no atomics, the same bits
//! on every run). Built on the host from the batch's ids, which the loader holds there
//! anyway, and copied up with the batch.

use crate::error::GpuError;

/// The distinct tokens of a batch in ascending order, and for each the positions (flat
/// `b * T + t`, ascending) where it occurs: `positions[starts[u]..starts[u + 1]]` are
/// the positions of `tokens()[u]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenGroups {
    uniq: Vec<i32>,
    starts: Vec<i32>,
    positions: Vec<i32>,
}

impl TokenGroups {
    /// Groups `ids`, each of which must lie in `0..vocab`.
    pub fn new(ids: &[i32], vocab: usize) -> Result<Self, GpuError> {
        const KERNEL: &str = "token-groups";
        crate::error::dim(KERNEL, "the batch's token count", ids.len())?;
        for (index, &t) in ids.iter().enumerate() {
            if t < 0 || t as usize >= vocab {
                return Err(GpuError::OutOfRange {
                    kernel: KERNEL,
                    buffer: "tokens",
                    index,
                    value: t as i64,
                    limit: vocab,
                });
            }
        }
        let mut pairs: Vec<(i32, i32)> = ids
            .iter()
            .enumerate()
            .map(|(p, &t)| (t, p as i32))
            .collect();
        pairs.sort_unstable();
        let mut uniq = Vec::new();
        let mut starts = Vec::new();
        for (i, &(t, _)) in pairs.iter().enumerate() {
            if uniq.last() != Some(&t) {
                uniq.push(t);
                starts.push(i as i32);
            }
        }
        starts.push(pairs.len() as i32);
        let positions = pairs.into_iter().map(|(_, p)| p).collect();
        Ok(TokenGroups {
            uniq,
            starts,
            positions,
        })
    }

    /// The distinct tokens, ascending.
    pub fn tokens(&self) -> &[i32] {
        &self.uniq
    }

    /// Where each token's positions start in [`Self::positions`], and one past the end.
    pub fn starts(&self) -> &[i32] {
        &self.starts
    }

    /// The positions, grouped by token.
    pub fn positions(&self) -> &[i32] {
        &self.positions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_positions_by_token_in_order() {
        let g = TokenGroups::new(&[5, 2, 5, 0, 2, 5], 6).unwrap();
        assert_eq!(g.tokens(), &[0, 2, 5]);
        assert_eq!(g.starts(), &[0, 1, 3, 6]);
        assert_eq!(g.positions(), &[3, 1, 4, 0, 2, 5]);
    }

    #[test]
    fn refuses_a_token_outside_the_vocabulary() {
        let e = TokenGroups::new(&[1, 7], 6).unwrap_err();
        assert!(
            e.to_string().contains("`tokens`[1] = 7 is outside 0..6"),
            "{e}"
        );
    }
}
