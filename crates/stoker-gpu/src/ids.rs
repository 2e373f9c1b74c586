//! Token ids and targets on a backend, checked against their limit on the host before
//! they were uploaded: the only way a kernel that indexes with them gets them, so that
//! no kernel reads outside a table.

use crate::backend::Backend;
use crate::error::GpuError;
use crate::token_groups::TokenGroups;

/// Ids in `0..limit` (or equal to `skip`), on a backend.
pub struct Ids<B: Backend> {
    pub(crate) buf: B::Buf<i32>,
    pub(crate) limit: usize,
    pub(crate) skip: Option<i32>,
}

impl<B: Backend> Ids<B> {
    /// Checks every id against `0..limit` (`skip`, the ignore index, excepted) and
    /// uploads them; the error names `what` and the first id out of range.
    pub fn new(
        b: &B,
        what: &'static str,
        ids: &[i32],
        limit: usize,
        skip: Option<i32>,
    ) -> Result<Self, GpuError> {
        if let Some((index, &t)) = ids
            .iter()
            .enumerate()
            .find(|&(_, &t)| Some(t) != skip && (t < 0 || t as usize >= limit))
        {
            return Err(GpuError::OutOfRange {
                kernel: "ids",
                buffer: what,
                index,
                value: t as i64,
                limit,
            });
        }
        Ok(Ids {
            buf: b.upload(ids)?,
            limit,
            skip,
        })
    }

    /// How many ids.
    pub fn len(&self) -> usize {
        B::len(&self.buf)
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A batch's [`TokenGroups`] on a backend.
pub struct Groups<B: Backend> {
    pub(crate) tokens: B::Buf<i32>,
    pub(crate) starts: B::Buf<i32>,
    pub(crate) positions: B::Buf<i32>,
    pub(crate) limit: usize,
}

impl<B: Backend> Groups<B> {
    /// Uploads `g`, grouped from ids in `0..limit`.
    pub fn new(b: &B, g: &TokenGroups, limit: usize) -> Result<Self, GpuError> {
        if let Some(&t) = g.tokens().iter().find(|&&t| t as usize >= limit) {
            return Err(GpuError::OutOfRange {
                kernel: "groups",
                buffer: "tokens",
                index: 0,
                value: t as i64,
                limit,
            });
        }
        Ok(Groups {
            tokens: b.upload(g.tokens())?,
            starts: b.upload(g.starts())?,
            positions: b.upload(g.positions())?,
            limit,
        })
    }

    /// Positions grouped (the batch's token count).
    pub fn positions(&self) -> usize {
        B::len(&self.positions)
    }
}
