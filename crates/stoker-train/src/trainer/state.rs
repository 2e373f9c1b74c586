//! The trainer as a checkpoint sees it ([`Stateful`]): its step, loader position, the
//! parameters it holds, the optimizer's moments and the scalers' state, handed over for a
//! save and taken back from a load.

use crate::checkpoint::{LoadedState, RankState, Stateful};
use crate::error::Result;

use super::Trainer;

impl Stateful for Trainer {
    fn state(&self) -> RankState<'_> {
        assert!(
            !self.host_behind(),
            "Stateful::state on the resident path lags the loop: call Trainer::sync_host first"
        );
        RankState {
            step: self.step,
            sampler: self.sampler_state,
            layout: &self.params.layout,
            held: &self.params.held,
            master: &self.params.master,
            optimizer: self.optimizer.state_ref(),
            scaler: self.scaler.as_ref().map(|s| s.state().clone()),
            fp8: self.fp8.as_ref().map(|f| f.state()),
            strategy: self.strategy.name(),
        }
    }

    fn load_state(&mut self, loaded: LoadedState) -> Result<()> {
        // Checked before anything changes (a load that fails changes nothing).
        if let Some(saved) = &loaded.fp8 {
            crate::precision::Fp8State::check_saved(saved)?;
        }
        self.optimizer
            .restore(loaded.optimizer)
            .map_err(crate::error::TrainError::Layout)?;
        self.path.host_changed();
        if let (Some(s), Some(saved)) = (&mut self.scaler, loaded.scaler) {
            // The scale and its counters go on from the checkpoint; the settings are the
            // config's, which a resume may have changed ([`ScalerState::under`]).
            let ours = s.state().config.clone();
            let changed = saved.config != ours;
            let saved_scale = saved.scale;
            let carried = saved.under(ours)?;
            if changed && self.strategy.rank() == 0 {
                tracing::warn!(
                    "loss_scale: the config's scaler settings differ from the checkpoint's; \
                     the run goes on under the config's, from the checkpoint's counters, \
                     at a scale of {} (the checkpoint's: {})",
                    stoker_precision::ShownScale(carried.scale),
                    stoker_precision::ShownScale(saved_scale)
                );
            }
            s.restore(carried)?;
        }
        if let (Some(f), Some(saved)) = (&self.fp8, loaded.fp8) {
            f.restore(saved);
        }
        self.set_held_master(loaded.master)?;
        self.step = loaded.step;
        self.sampler_state = loaded.sampler;
        Ok(())
    }
}
