//! Which samples each rank reads, in what order, each epoch.
//!
//! One sampler covers torch's `SequentialSampler`, `RandomSampler` (seeded, re-drawn per epoch
//! like `DistributedSampler.set_epoch`) and `DistributedSampler` (pad-by-repeat or drop_last),
//! plus a world-size-independent partition: global batch `k` holds the same samples whatever
//! the number of ranks (train on 4, debug on 1, same data), Mosaic Streaming's guarantee.

use serde::{Deserialize, Serialize};

use crate::dataset::mix64;
use crate::{DataError, Result};

/// How an epoch's order is split across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Partition {
    /// torch's DistributedSampler: rank `r` takes positions `r, r + world, r + 2 world, ...`.
    Strided,
    /// Global batches of `global_batch` consecutive positions; rank `r` takes the `r`-th
    /// contiguous slice of `global_batch / world` in each. The set of samples in global batch
    /// `k` depends on the seed and epoch only, never on `world`.
    GlobalBatch {
        /// Samples per optimizer step summed over ranks (must be a multiple of `world`).
        global_batch: usize,
    },
}

/// Sampler settings: order, sharding and end-of-epoch handling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerConfig {
    /// Shuffle with a permutation drawn from (seed, epoch).
    pub shuffle: bool,
    /// Base seed; the same on every rank.
    pub seed: u64,
    /// This process's rank in `0..world`.
    pub rank: usize,
    /// Number of data-parallel ranks.
    pub world: usize,
    /// Drop the tail that does not divide evenly instead of padding it by repeating samples.
    pub drop_last: bool,
    /// How the order is split across ranks.
    pub partition: Partition,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            shuffle: false,
            seed: 0,
            rank: 0,
            world: 1,
            drop_last: false,
            partition: Partition::Strided,
        }
    }
}

/// A validated sampler over a dataset of `len` samples.
#[derive(Debug, Clone)]
pub struct Sampler {
    len: usize,
    config: SamplerConfig,
}

impl Sampler {
    /// Checks the config against the dataset length; errors name the field.
    pub fn new(len: usize, config: SamplerConfig) -> Result<Self> {
        let SamplerConfig {
            rank,
            world,
            partition,
            ..
        } = config;
        if world == 0 {
            return Err(DataError::Config {
                field: "world",
                message: "must be at least 1".into(),
            });
        }
        if rank >= world {
            return Err(DataError::Config {
                field: "rank",
                message: format!("{rank} is not below world {world}"),
            });
        }
        if len == 0 {
            return Err(DataError::Config {
                field: "dataset",
                message: "has no samples".into(),
            });
        }
        if let Partition::GlobalBatch { global_batch } = partition {
            if global_batch == 0 || global_batch % world != 0 {
                return Err(DataError::Config {
                    field: "global_batch",
                    message: format!(
                        "{global_batch} is not a positive multiple of world size {world}"
                    ),
                });
            }
        }
        Ok(Sampler { len, config })
    }

    /// The config.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Dataset length.
    pub fn dataset_len(&self) -> usize {
        self.len
    }

    /// The global order of epoch `epoch` before sharding: identity, or a permutation drawn
    /// from (seed, epoch) by Fisher-Yates.
    pub fn global_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.config.shuffle {
            let mut state = mix64(self.config.seed ^ mix64(epoch));
            for i in (1..self.len).rev() {
                state = mix64(state);
                // Multiply-shift maps 64 random bits to 0..=i without modulo bias worth noting
                // at dataset sizes below 2^32.
                let j = ((state as u128 * (i as u128 + 1)) >> 64) as usize;
                order.swap(i, j);
            }
        }
        order
    }

    /// Samples per rank per epoch.
    pub fn rank_len(&self) -> usize {
        let (n, w) = (self.len, self.config.world);
        match self.config.partition {
            Partition::Strided => {
                if self.config.drop_last {
                    n / w
                } else {
                    n.div_ceil(w)
                }
            }
            Partition::GlobalBatch { global_batch } => {
                let steps = if self.config.drop_last {
                    n / global_batch
                } else {
                    n.div_ceil(global_batch)
                };
                steps * global_batch / w
            }
        }
    }

    /// Heap bytes an epoch's indices take at their peak: the global order as it is drawn
    /// and this rank's share of it ([`Self::epoch_indices`]), a `usize` each. At 16
    /// bytes a sample this is what a token dataset of many short windows costs beside
    /// its batch buffers (284,000 windows of 16 tokens: 4.5 MB).
    pub fn index_bytes(&self) -> usize {
        std::mem::size_of::<usize>() * (self.len + self.rank_len())
    }

    /// This rank's sample indices for `epoch`, in the order it reads them.
    pub fn epoch_indices(&self, epoch: u64) -> Vec<usize> {
        let order = self.global_order(epoch);
        let SamplerConfig { rank, world, .. } = self.config;
        let per_rank = self.rank_len();
        match self.config.partition {
            Partition::Strided => {
                let total = per_rank * world;
                let padded = pad_or_truncate(order, total);
                padded.into_iter().skip(rank).step_by(world).collect()
            }
            Partition::GlobalBatch { global_batch } => {
                let steps = per_rank * world / global_batch;
                let padded = pad_or_truncate(order, steps * global_batch);
                let share = global_batch / world;
                let mut out = Vec::with_capacity(per_rank);
                for k in 0..steps {
                    let start = k * global_batch + rank * share;
                    out.extend_from_slice(&padded[start..start + share]);
                }
                out
            }
        }
    }
}

/// Extends `order` by repeating it from the start (as many times as needed), or truncates it.
fn pad_or_truncate(mut order: Vec<usize>, total: usize) -> Vec<usize> {
    let n = order.len();
    if total <= n {
        order.truncate(total);
    } else {
        for i in 0..total - n {
            order.push(order[i % n]);
        }
    }
    order
}

/// Where a loader stands: the epoch and how many of this rank's batches it has delivered.
/// Restoring it continues with exactly the batches that would have come next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SamplerState {
    /// Current epoch.
    pub epoch: u64,
    /// Batches of this epoch already delivered.
    pub batches_done: usize,
}
