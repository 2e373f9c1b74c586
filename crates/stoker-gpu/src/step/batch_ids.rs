//! A micro-batch's ids on the backend, in two sets used in turn: tokens and targets
//! checked against the vocabulary (targets may be the ignore index), the tokens' groups
//! for the embedding backward (training only), and the ignore index. Both sets are made
//! once with room for a step's rows and rewritten in place (a step allocates nothing
//! after it is made).
//!
//! Two sets so that a window's next micro-batch can go up while this one runs (the
//! chapter's `pin_memory=True` with `non_blocking=True`): [`IdSets::prefetch`] starts
//! it into the set after the next beside the launches ([`Backend::start_write`]: on a
//! device, on the copy stream, after the launches of the micro-batch before, the set's
//! last readers). The micro-batch that comes to use a set finds its ids there and waits
//! for their copy alone; any other ids are written in the stream's order, staged
//! (the host prepares them while the launches before run).

use crate::backend::Backend;
use crate::error::{check_len, GpuError};
use crate::ids::{Groups, Ids};
use crate::token_groups::TokenGroups;

use super::TokenBatch;

/// Bytes of a step's id buffers for `n` positions: two sets of tokens, targets and the
/// embedding backward's groups (tokens, starts with one more, positions), i32 each.
pub(crate) fn ids_bytes(n: usize) -> usize {
    2 * 4 * (5 * n + 1)
}

/// How a set's ids reach the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// In the stream's order, staged ([`Backend::write_staged`]).
    InOrder,
    /// Beside the launches ([`Backend::start_write`]), landed when the set is used.
    Beside,
}

/// What a set's buffers hold (or receive, while its writes land).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holds {
    /// Nothing known: made, or a write failed midway.
    Nothing,
    /// The host's copy of the tokens and targets, without their groups (an evaluation's).
    Ids,
    /// The host's copy of the tokens and targets, and the tokens' groups (training's).
    IdsAndGroups,
}

/// One set of a micro-batch's ids. Its buffers are reached through [`BatchIds::tokens`],
/// [`BatchIds::targets`] and [`BatchIds::groups`], for the launches of the micro-batch
/// [`IdSets::take`] gave it to, whose load waited for its writes.
pub(crate) struct BatchIds<B: Backend> {
    /// Writes started beside the launches and not yet waited for (first: they drop, a
    /// device's wait for them, before the buffers they write).
    landing: Vec<B::PendingWrite>,
    tokens: Ids<B>,
    targets: Ids<B>,
    groups: Groups<B>,
    pub(crate) ignore: i32,
    /// The tokens and targets the buffers hold (or receive), as i32 on the host.
    host: (Vec<i32>, Vec<i32>),
    /// A batch's ids converted, to compare with `host` before writing them.
    next: (Vec<i32>, Vec<i32>),
    /// What the buffers hold of `host`.
    holds: Holds,
}

impl<B: Backend> BatchIds<B> {
    /// Room for `n` ids of each kind in `0..vocab`.
    fn with_room(be: &B, n: usize, vocab: usize) -> Result<Self, GpuError> {
        Ok(BatchIds {
            landing: Vec::new(),
            tokens: Ids::zeros(be, n, vocab)?,
            targets: Ids::zeros(be, n, vocab)?,
            groups: Groups::with_room(be, n, vocab)?,
            ignore: -1,
            host: (Vec::with_capacity(n), Vec::with_capacity(n)),
            next: (Vec::with_capacity(n), Vec::with_capacity(n)),
            holds: Holds::Nothing,
        })
    }

    /// The tokens, for the launches of the micro-batch this set was taken for.
    pub(crate) fn tokens(&self) -> &Ids<B> {
        self.debug_landed();
        &self.tokens
    }

    /// The targets, as [`BatchIds::tokens`].
    pub(crate) fn targets(&self) -> &Ids<B> {
        self.debug_landed();
        &self.targets
    }

    /// The tokens' groups, as [`BatchIds::tokens`] (loaded for training only).
    pub(crate) fn groups(&self) -> &Groups<B> {
        self.debug_landed();
        &self.groups
    }

    /// In debug builds, that no write to the set is still landing: its accessors serve
    /// the launches of a micro-batch whose load waited for them.
    fn debug_landed(&self) {
        debug_assert!(
            self.landing.is_empty(),
            "ids used before their writes landed"
        );
    }

    /// `batch` (`n` of each id, as made) in this set, grouped when `train`, for the
    /// launches that follow: found there (written beside the launches before), or
    /// checked and written `how`.
    fn load(
        &mut self,
        be: &B,
        op: &'static str,
        (batch, train): (TokenBatch, bool),
        how: How,
    ) -> Result<(), GpuError> {
        let n = self.tokens.len();
        check_len(op, "tokens", batch.tokens.len(), n)?;
        check_len(op, "targets", batch.targets.len(), n)?;
        let ignore = i32::try_from(batch.ignore).map_err(|_| GpuError::Shape {
            kernel: op,
            what: format!("ignore index {} outside i32", batch.ignore),
        })?;
        let to_i32 = |out: &mut Vec<i32>, x: &[i64]| {
            out.clear();
            out.extend(
                x.iter()
                    .map(|&v| v.clamp(i32::MIN as i64, i32::MAX as i64) as i32),
            );
        };
        to_i32(&mut self.next.0, batch.tokens);
        to_i32(&mut self.next.1, batch.targets);
        // The set's last writes land before it is used or rewritten; until they have,
        // it holds nothing known (a failed wait leaves it so).
        let held = std::mem::replace(&mut self.holds, Holds::Nothing);
        crate::backend::wait_writes(be, self.landing.drain(..))?;
        let enough = match held {
            Holds::Nothing => false,
            Holds::Ids => !train,
            Holds::IdsAndGroups => true,
        };
        if enough && self.ignore == ignore && self.next == self.host {
            self.holds = held;
            return Ok(());
        }
        std::mem::swap(&mut self.next, &mut self.host);
        let (tok, tgt) = &self.host;
        let landing = &mut self.landing;
        let mut put = |v: crate::View<i32>, data: &[i32]| -> Result<(), GpuError> {
            match how {
                How::InOrder => be.write_staged(v, data),
                How::Beside => {
                    // SAFETY: the buffers are reached only through this function, which
                    // waits for `landing` first (above), and through the accessors, for
                    // the micro-batch `IdSets::take` loaded here, which waited; they live
                    // as long as the set, whose `landing` drops first.
                    landing.push(unsafe { be.start_write(v, data)? });
                    Ok(())
                }
            }
        };
        self.tokens
            .rewrite_with(be, "tokens", (tok, None), &mut put)?;
        self.targets
            .rewrite_with(be, "targets", (tgt, Some(ignore)), &mut put)?;
        if train {
            let vocab = self.tokens.limit;
            self.groups
                .rewrite_with(be, &TokenGroups::new(tok, vocab)?, &mut put)?;
        }
        self.ignore = ignore;
        self.holds = match train {
            true => Holds::IdsAndGroups,
            false => Holds::Ids,
        };
        Ok(())
    }
}

/// A step's two sets of ids and whose turn it is.
pub(crate) struct IdSets<B: Backend> {
    sets: [BatchIds<B>; 2],
    /// The set the next micro-batch uses.
    turn: usize,
}

impl<B: Backend> IdSets<B> {
    /// Two sets with room for `n` ids of each kind in `0..vocab`.
    pub(crate) fn with_room(be: &B, n: usize, vocab: usize) -> Result<Self, GpuError> {
        Ok(IdSets {
            sets: [
                BatchIds::with_room(be, n, vocab)?,
                BatchIds::with_room(be, n, vocab)?,
            ],
            turn: 0,
        })
    }

    /// Bytes of both sets' buffers.
    pub(crate) fn bytes(&self) -> usize {
        ids_bytes(self.sets[0].tokens.len())
    }

    /// The set the next micro-batch uses (and its index), `batch` in it for the launches
    /// that follow, grouped when `train`; then the turn passes to the other set.
    pub(crate) fn take(
        &mut self,
        be: &B,
        op: &'static str,
        batch: TokenBatch,
        train: bool,
    ) -> Result<(usize, &BatchIds<B>), GpuError> {
        let k = self.turn;
        self.turn = 1 - k;
        self.sets[k].load(be, op, (batch, train), How::InOrder)?;
        Ok((k, &self.sets[k]))
    }

    /// Starts `batch`, the micro-batch after the next one [`IdSets::take`] serves, into
    /// its set beside the launches: called before the next one's launches are queued,
    /// its copy waits only for the launches before (the set's last readers were the
    /// micro-batch before the next).
    pub(crate) fn prefetch(
        &mut self,
        be: &B,
        op: &'static str,
        batch: TokenBatch,
    ) -> Result<(), GpuError> {
        self.sets[1 - self.turn].load(be, op, (batch, true), How::Beside)
    }
}
