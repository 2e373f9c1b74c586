//! What a checkpoint saves of one rank and loads back into it: a view, not the trainer
//! (PyTorch DCP's `Stateful`: a component gives its `state_dict` and takes one back). The
//! checkpoint decides what each rank writes and reads; whatever holds the state (the
//! trainer) hands it over and takes it back through [`Stateful`].

use std::collections::BTreeMap;

use stoker_data::SamplerState;
use stoker_precision::ScalerState;

use crate::error::Result;
use crate::layout::FlatLayout;
use crate::optim::{OptimState, OptimStateRef};
use crate::pieces::Pieces;
use crate::precision::LayerScalers;

/// One rank's state, borrowed for a save.
pub struct RankState<'a> {
    /// Optimizer steps taken (skipped ones included).
    pub step: u64,
    /// Where the training loader stands.
    pub sampler: SamplerState,
    /// The flat layout of the parameters.
    pub layout: &'a FlatLayout,
    /// The parts of the flat buffer this rank holds: the whole buffer, or under ZeRO-3
    /// its piece of every group.
    pub held: &'a Pieces,
    /// The FP32 parameters of `held`, end to end.
    pub master: &'a [f32],
    /// The optimizer's moments over its own pieces.
    pub optimizer: OptimStateRef<'a>,
    /// The dynamic loss scaler's state (fp16).
    pub scaler: Option<ScalerState>,
    /// The FP8 delayed scalers' state (fp8).
    pub fp8: Option<BTreeMap<String, LayerScalers>>,
    /// The data-parallel strategy's name, for the manifest.
    pub strategy: &'static str,
}

/// One rank's state as a checkpoint read it, to load.
pub struct LoadedState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Where the training loader stood.
    pub sampler: SamplerState,
    /// The FP32 parameters of the pieces [`RankState::held`] names, end to end.
    pub master: Vec<f32>,
    /// The optimizer's moments over its own pieces.
    pub optimizer: OptimState,
    /// The dynamic loss scaler's state, where the checkpoint has one.
    pub scaler: Option<ScalerState>,
    /// The FP8 delayed scalers' state, where the checkpoint has one.
    pub fp8: Option<BTreeMap<String, LayerScalers>>,
}

/// Something a checkpoint saves and loads: it hands over a view of its state and takes a
/// loaded one back.
pub trait Stateful {
    /// The state to save, borrowed.
    fn state(&self) -> RankState<'_>;
    /// Takes `loaded` as its state (a checkpoint checked it against [`Stateful::state`]'s
    /// layout, pieces, optimizer and scaler first).
    fn load_state(&mut self, loaded: LoadedState) -> Result<()>;
}
