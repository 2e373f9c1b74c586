//! The window's scalar collectives every multi-rank strategy shares: the loss sum and
//! target count summed over ranks (in the fixed tree in deterministic mode, so the bits
//! do not depend on the world size), a flag any rank raised (fp16 overflow), the
//! gradient norm's sum of squares from the part each rank holds, and the largest of
//! values over ranks (fp8's amax, Transformer Engine's amax all-reduce).

use stoker_comm::{tree_all_reduce, CommExt, Communicator};

use crate::error::Result;

/// Sums `x` over ranks in place; `deterministic` uses the balanced tree over ranks.
pub fn sum_scalars(comm: &dyn Communicator, deterministic: bool, x: &mut [f64]) -> Result<()> {
    match deterministic {
        true => tree_all_reduce(comm, x)?,
        false => comm.all_reduce(x)?,
    }
    Ok(())
}

/// Whether `flag` holds on any rank.
pub fn any_rank(comm: &dyn Communicator, flag: bool) -> Result<bool> {
    Ok(comm.sum(flag as u64)? > 0)
}

/// The sum of squares of a gradient split over the ranks, each holding `part`.
pub fn sharded_sum_of_squares(comm: &dyn Communicator, part: &[f32]) -> Result<f64> {
    let mut x = [stoker_kernels::flat::sum_of_squares(part)];
    comm.all_reduce(&mut x)?;
    Ok(x[0])
}

/// Replaces `x` (amaxes: >= 0 or NaN) by its largest value over ranks, element by
/// element, NaN where any rank has one ([`CommExt::max_of_amaxes`]: exact, so the same
/// bits at every world size).
pub fn max_over_ranks(comm: &dyn Communicator, x: &mut [f32]) -> Result<()> {
    comm.max_of_amaxes(x)?;
    Ok(())
}
