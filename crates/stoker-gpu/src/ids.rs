//! Token ids and targets on a backend, checked against their limit on the host before
//! they were uploaded: the only way a kernel that indexes with them gets them, so that
//! no kernel reads outside a table.

use crate::backend::Backend;
use crate::error::GpuError;
use crate::token_groups::TokenGroups;

/// Every id in `0..limit` or equal to `skip`; the error names `what` and the first that
/// is not.
fn check_ids(
    what: &'static str,
    ids: &[i32],
    limit: usize,
    skip: Option<i32>,
) -> Result<(), GpuError> {
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
    Ok(())
}

/// Where a rewrite's checked ids go: a view and the ids for it (written staged, or
/// started beside the launches).
pub(crate) type PutIds<'a> = &'a mut dyn FnMut(crate::View<i32>, &[i32]) -> Result<(), GpuError>;

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
        check_ids(what, ids, limit, skip)?;
        Ok(Ids {
            buf: b.upload(ids)?,
            limit,
            skip,
        })
    }

    /// `n` zeros in `0..limit`: a buffer [`Ids::rewrite`] fills batch after batch.
    pub fn zeros(b: &B, n: usize, limit: usize) -> Result<Self, GpuError> {
        Ok(Ids {
            buf: b.zeros(n)?,
            limit,
            skip: None,
        })
    }

    /// Checks `ids` (as many as this holds) as [`Ids::new`] does and writes them in place,
    /// staged ([`Backend::write_staged`]: the host does not wait for the launches before).
    pub fn rewrite(
        &mut self,
        b: &B,
        what: &'static str,
        ids: &[i32],
        skip: Option<i32>,
    ) -> Result<(), GpuError> {
        self.rewrite_with(b, what, (ids, skip), &mut |v, data| b.write_staged(v, data))
    }

    /// [`Ids::rewrite`], each write handed to `put` (staged, or started beside the
    /// launches) once the ids are checked.
    pub(crate) fn rewrite_with(
        &mut self,
        b: &B,
        what: &'static str,
        (ids, skip): (&[i32], Option<i32>),
        put: PutIds<'_>,
    ) -> Result<(), GpuError> {
        crate::error::check_len("ids", what, ids.len(), self.len())?;
        check_ids(what, ids, self.limit, skip)?;
        put(b.all(&self.buf), ids)?;
        self.skip = skip;
        Ok(())
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

/// A batch's [`TokenGroups`] on a backend: buffers for `positions` positions and as many
/// groups, the groups past the batch's distinct tokens empty (their starts all equal the
/// position count). The embedding's backward runs over every group, empty ones doing
/// nothing, so its launch does not depend on the batch (a graph replays it unchanged).
pub struct Groups<B: Backend> {
    pub(crate) tokens: B::Buf<i32>,
    pub(crate) starts: B::Buf<i32>,
    pub(crate) positions: B::Buf<i32>,
    pub(crate) limit: usize,
    /// The starts padded to `positions + 1`, reused from batch to batch.
    padded: Vec<i32>,
}

impl<B: Backend> Groups<B> {
    /// Uploads `g`, grouped from ids in `0..limit`.
    pub fn new(b: &B, g: &TokenGroups, limit: usize) -> Result<Self, GpuError> {
        check_groups(g, limit)?;
        let mut padded = Vec::new();
        pad_starts(g, &mut padded);
        let mut tokens = g.tokens().to_vec();
        tokens.resize(g.positions().len(), 0);
        Ok(Groups {
            tokens: b.upload(&tokens)?,
            starts: b.upload(&padded)?,
            positions: b.upload(g.positions())?,
            limit,
            padded,
        })
    }

    /// Room for the groups of `n` positions of ids in `0..limit` (none in use yet: every
    /// group empty).
    pub fn with_room(b: &B, n: usize, limit: usize) -> Result<Self, GpuError> {
        let n32 = i32::try_from(n).map_err(|_| GpuError::Shape {
            kernel: "groups",
            what: format!("{n} positions exceed the kernels' 32-bit sizes"),
        })?;
        Ok(Groups {
            tokens: b.zeros(n)?,
            starts: b.upload(&vec![n32; n + 1])?,
            positions: b.zeros(n)?,
            limit,
            padded: Vec::with_capacity(n + 1),
        })
    }

    /// Writes `g` (of as many positions as this has room for) in place, staged.
    pub fn rewrite(&mut self, b: &B, g: &TokenGroups) -> Result<(), GpuError> {
        self.rewrite_with(b, g, &mut |v, data| b.write_staged(v, data))
    }

    /// [`Groups::rewrite`], each write handed to `put` (staged, or started beside the
    /// launches) once the groups are checked.
    pub(crate) fn rewrite_with(
        &mut self,
        b: &B,
        g: &TokenGroups,
        put: PutIds<'_>,
    ) -> Result<(), GpuError> {
        check_groups(g, self.limit)?;
        crate::error::check_len("groups", "positions", g.positions().len(), self.positions())?;
        let u = g.tokens().len();
        pad_starts(g, &mut self.padded);
        put(b.view(&self.tokens, 0..u)?, g.tokens())?;
        put(b.all(&self.starts), &self.padded)?;
        put(b.all(&self.positions), g.positions())
    }

    /// Positions grouped (the batch's token count).
    pub fn positions(&self) -> usize {
        B::len(&self.positions)
    }
}

/// `g`'s starts into `out`, then the position count again for every group past its
/// distinct tokens: as many groups as positions, the padding empty.
fn pad_starts(g: &TokenGroups, out: &mut Vec<i32>) {
    let n = g.positions().len();
    out.clear();
    out.extend_from_slice(g.starts());
    out.resize(n + 1, n as i32);
}

/// Every group's token below `limit`.
fn check_groups(g: &TokenGroups, limit: usize) -> Result<(), GpuError> {
    if let Some(&t) = g.tokens().iter().find(|&&t| t as usize >= limit) {
        return Err(GpuError::OutOfRange {
            kernel: "groups",
            buffer: "tokens",
            index: 0,
            value: t as i64,
            limit,
        });
    }
    Ok(())
}
