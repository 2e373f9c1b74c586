//! One rank: nothing to meet. The strategy of a run without a launcher (`strategy =
//! "none"`), and the reference every data-parallel run is held against.

use super::{Pieces, Strategy, StrategyBytes, SyncStats};
use crate::error::Result;
use crate::grad_sum::SumOrder;

/// The one-rank strategy.
#[derive(Debug, Clone)]
pub struct Single {
    order: SumOrder,
}

impl Single {
    /// One rank summing its micro-batches in `order` (the tree in deterministic mode, so
    /// that its bits equal a deterministic data-parallel run's).
    pub fn new(order: SumOrder) -> Self {
        Single { order }
    }
}

impl StrategyBytes for Single {}

impl Strategy for Single {
    fn name(&self) -> &'static str {
        "none"
    }

    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn sum_order(&self) -> SumOrder {
        self.order
    }

    fn start(&mut self, _master: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn begin_window(&mut self, _len: usize) -> Result<()> {
        Ok(())
    }

    fn begin_micro_batch(&mut self, _micro: usize, _len: usize) -> Result<bool> {
        Ok(false)
    }

    fn group_ready(&mut self, _group: usize, _grads: &[f32]) -> Result<()> {
        Ok(())
    }

    fn finish_micro_batch(&mut self, _grads: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn finish_window(&mut self, _grads: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn sum_scalars(&mut self, _x: &mut [f64]) -> Result<()> {
        Ok(())
    }

    fn any_rank(&mut self, flag: bool) -> Result<bool> {
        Ok(flag)
    }

    fn sum_of_squares(&mut self, grads: &[f32]) -> Result<f64> {
        Ok(stoker_kernels::flat::sum_of_squares(grads))
    }

    fn max_over_ranks(&mut self, _x: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn update_range(&self, len: usize) -> Pieces {
        Pieces::one(0..len)
    }

    fn after_update(&mut self, _master: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn stats(&self) -> SyncStats {
        SyncStats::default()
    }
}
