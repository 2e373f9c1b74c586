//! The parallel degrees, checked once before any work (torchtitan's `ParallelDims`): the
//! world size against the launcher's, the batch arithmetic
//! `global_batch = micro_batch x accumulation_steps x world_size`, and the strategy
//! against both. Every error names its config key and shows the numbers.

use crate::config::{StrategyKind, TrainConfig};
use crate::error::{config_err, Result};

/// The resolved degrees of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    /// Ranks.
    pub world: usize,
    /// This rank.
    pub rank: usize,
    /// Samples per forward/backward on each rank.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step on each rank.
    pub accumulation_steps: usize,
    /// Samples per optimizer step over all ranks.
    pub global_batch: usize,
    /// The strategy.
    pub strategy: StrategyKind,
    /// Deterministic reduction order.
    pub deterministic: bool,
}

impl ParallelDims {
    /// The degrees of `config` for rank `rank` of the `world` ranks that `launcher`
    /// started (`mpirun`, `srun`, threads, ...).
    pub fn resolve(
        config: &TrainConfig,
        world: usize,
        rank: usize,
        launcher: &str,
    ) -> Result<Self> {
        let b = &config.batch;
        let p = &config.parallel;
        if let Some(w) = b.world_size {
            if w != world {
                return Err(config_err(
                    "batch.world_size",
                    format!(
                        "{w}, but {launcher} started {world} rank(s): launch `mpirun -n {w} stoker train ...`, \
                         set parallel.backend = \"local\" to run {w} ranks as threads, or drop the key to take the launcher's"
                    ),
                ));
            }
        }
        let (k, global) = b.resolve(world)?;
        if p.strategy == StrategyKind::None && world > 1 {
            return Err(config_err(
                "parallel.strategy",
                format!("\"none\" runs one rank, and {launcher} started {world}: use \"ddp\""),
            ));
        }
        if p.deterministic && world > 1 {
            if !world.is_power_of_two() {
                return Err(config_err(
                    "parallel.deterministic",
                    format!(
                        "world size {world}: the deterministic reduction tree combines ranks in pairs and needs a power of two (1, 2, 4, 8, ...)"
                    ),
                ));
            }
            if !k.is_power_of_two() {
                return Err(config_err(
                    "batch.accumulation_steps",
                    format!(
                        "{k} at world size {world}: in deterministic mode each rank's micro-batches must form a whole subtree of the global batch's tree, so the accumulation steps must be a power of two (global_batch {global} = micro_batch {} x accumulation_steps x {world})",
                        b.micro_batch
                    ),
                ));
            }
        }
        Ok(ParallelDims {
            world,
            rank,
            micro_batch: b.micro_batch,
            accumulation_steps: k,
            global_batch: global,
            strategy: p.strategy,
            deterministic: p.deterministic,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::config::BatchConfig;

    fn batch(m: usize, k: Option<usize>, g: Option<usize>) -> BatchConfig {
        BatchConfig {
            micro_batch: m,
            accumulation_steps: k,
            world_size: None,
            global_batch: g,
        }
    }

    #[test]
    fn the_global_batch_fixes_the_accumulation_steps_at_each_world_size() {
        let b = batch(4, None, Some(32));
        assert_eq!(b.resolve(1).unwrap(), (8, 32));
        assert_eq!(b.resolve(2).unwrap(), (4, 32));
        assert_eq!(b.resolve(8).unwrap(), (1, 32));
        let e = b.resolve(3).unwrap_err().to_string();
        assert!(
            e.contains("batch.global_batch") && e.contains("world sizes that fit: 1, 2, 4, 8"),
            "{e}"
        );
        assert_eq!(batch(4, Some(2), None).resolve(2).unwrap(), (2, 16));
        let e = batch(4, Some(2), Some(12))
            .resolve(1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("12 != micro_batch 4 x accumulation_steps 2 x world_size 1 = 8; accumulation_steps = 3 would fit"), "{e}");
    }
}
