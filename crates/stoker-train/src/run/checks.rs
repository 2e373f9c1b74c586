//! The run's checks across ranks: every rank holds the same weights before a checkpoint
//! (data parallelism trusts the reductions to give every rank the same bits), and the
//! weights' CRC-32 at the end, the same at every world size and strategy.

use stoker_comm::Communicator;

use crate::error::{Result, TrainError};
use crate::trainer::Trainer;

/// Fails on every rank unless all ranks hold the same weights (a CRC-32 of the FP32
/// master buffer each): data parallelism trusts the reduction to give every rank the same
/// bits, and a checkpoint written by rank 0 stands for all of them.
pub(super) fn same_weights_everywhere(
    comm: &dyn Communicator,
    trainer: &Trainer,
    step: u64,
) -> Result<()> {
    let n = comm.world_size();
    if n == 1 || trainer.shards_params() {
        // ZeRO-3's ranks hold different shards by design; each writes its own.
        return Ok(());
    }
    let mine = crc32fast::hash(bytemuck::cast_slice(trainer.master())) as u64;
    let mut all = vec![0u64; n];
    stoker_comm::CommExt::all_gather(comm, &[mine], &vec![1; n], &mut all)?;
    if all.iter().any(|&c| c != all[0]) {
        return Err(TrainError::Mismatch(format!(
            "after step {step} the ranks' weights differ (CRC-32 by rank: {:?}): the gradient reductions gave ranks different bits",
            all.iter().map(|c| format!("{c:08x}")).collect::<Vec<_>>()
        )));
    }
    Ok(())
}

/// CRC-32 of the whole FP32 master's bytes, the same at every world size and strategy.
/// Under ZeRO-3 each rank hashes each of its pieces and the pieces' CRCs are combined in
/// buffer order, so no rank gathers the whole buffer for it (4 bytes per parameter on
/// its peak).
pub(super) fn weights_crc32(comm: &dyn Communicator, trainer: &Trainer) -> Result<u32> {
    if !trainer.shards_params() {
        return Ok(crc32fast::hash(bytemuck::cast_slice(trainer.master())));
    }
    // [start, crc, bytes] of each piece.
    let mine: Vec<u64> = trainer
        .held()
        .with_starts()
        .flat_map(|(r, at)| {
            let values = &trainer.master()[at..at + r.len()];
            [
                r.start as u64,
                crc32fast::hash(bytemuck::cast_slice(values)) as u64,
                4 * r.len() as u64,
            ]
        })
        .collect();
    let all = stoker_comm::CommExt::all_gather_varying(comm, &mine)?;
    let mut parts: Vec<&[u64]> = all.iter().flat_map(|p| p.chunks(3)).collect();
    parts.sort_by_key(|p| p[0]);
    Ok(combine_crcs(parts.iter().map(|p| (p[1] as u32, p[2]))))
}

/// The CRC-32 of consecutive byte ranges' concatenation from each range's CRC-32 and
/// length, in order.
pub fn combine_crcs(parts: impl IntoIterator<Item = (u32, u64)>) -> u32 {
    let mut whole = crc32fast::Hasher::new();
    for (crc, len) in parts {
        whole.combine(&crc32fast::Hasher::new_with_initial_len(crc, len));
    }
    whole.finalize()
}

#[cfg(test)]
mod tests {
    use super::combine_crcs;

    #[test]
    fn combined_crcs_of_consecutive_parts_are_the_whole_s_crc() {
        let bytes: Vec<u8> = (0..10_007u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let whole = crc32fast::hash(&bytes);
        for cuts in [
            vec![],
            vec![0],
            vec![1],
            vec![4000],
            vec![3, 3, 9000],
            vec![10_007],
        ] {
            let mut parts = Vec::new();
            let mut at = 0;
            for &c in cuts.iter().chain([&bytes.len()]) {
                parts.push((crc32fast::hash(&bytes[at..c]), (c - at) as u64));
                at = c;
            }
            assert_eq!(combine_crcs(parts), whole, "cuts {cuts:?}");
        }
    }
}
