//! The flat buffers one rank keeps between steps: its parameters (the FP32 master and the
//! bf16 copy the optimizer writes) and its gradient sum, each as the [`Pieces`] of the
//! flat buffer it holds (the whole buffer, or under ZeRO its shard).

use half::bf16;

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::grad_sum::{GradSum, SumOrder};
use crate::layout::FlatLayout;
use crate::models::Model;
use crate::parallel::Strategy;
use crate::pieces::Pieces;

/// The parameters a rank keeps.
pub(super) struct ParamBuffers {
    /// The flat layout of every parameter and gradient buffer.
    pub layout: FlatLayout,
    /// FP32 master weights: the pieces `held` of the flat buffer, end to end.
    pub master: Vec<f32>,
    /// The parts of the flat buffer `master` holds.
    pub held: Pieces,
    /// The bf16 copy of `master` the optimizer writes in its pass, where the model's
    /// variables are bf16 (bf16 precision on a CPU without bf16 hardware).
    pub bf16_copy: Option<Vec<bf16>>,
}

impl ParamBuffers {
    /// `master` (the pieces `held` of `layout`'s buffer), with a bf16 copy where `bf16`.
    pub fn new(layout: FlatLayout, master: Vec<f32>, held: Pieces, bf16: bool) -> Self {
        let keep = held.len();
        ParamBuffers {
            layout,
            master,
            held,
            bf16_copy: bf16.then(|| vec![bf16::ZERO; keep]),
        }
    }

    /// The initial FP32 parameters of the pieces `held` of `layout`: imported
    /// (`init_from`), drawn alone by a rank of a model declared without values (ZeRO-3:
    /// every rank draws the same values from the same config, so nothing is broadcast),
    /// or the model's own, made the same on every rank by `strategy`'s start (a
    /// collective).
    pub fn initial(
        config: &TrainConfig,
        model: &dyn Model,
        layout: &FlatLayout,
        held: &Pieces,
        strategy: &mut dyn Strategy,
    ) -> Result<Vec<f32>> {
        let len = layout.total_len();
        let sharded = !held.is_whole(len);
        let meta = model.params().is_meta();
        let mut master = match &config.model {
            m if m.init_from().is_some() => {
                crate::hf::import(m, layout, m.init_from().expect("checked"))?
            }
            _ if meta && sharded => return model.params().init_pieces(layout, held),
            _ if meta => {
                return Err(TrainError::Strategy(format!(
                    "a model declared without values needs a strategy that shards the parameters (ZeRO-3), not {}",
                    strategy.name()
                )))
            }
            _ => layout.flatten(model.params())?,
        };
        strategy.start(&mut master)?;
        Ok(match sharded {
            true => held.take(&master),
            false => master,
        })
    }

    /// Whether the rank holds a shard of the parameters (ZeRO-3).
    pub fn sharded(&self) -> bool {
        !self.held.is_whole(self.layout.total_len())
    }

    /// Bytes of the master and its bf16 copy.
    pub fn bytes(&self) -> usize {
        4 * self.master.len() + 2 * self.bf16_copy.as_ref().map_or(0, Vec::len)
    }
}

/// The gradients a rank keeps.
pub(super) struct GradBuffers {
    /// The window's gradient sum: the pieces `held` of the flat buffer, end to end.
    pub buf: Vec<f32>,
    /// The parts of the flat buffer `buf` holds: the parameters' pieces, except where the
    /// strategy reduces the direct step's gradients group by group into this rank's shard.
    pub held: Pieces,
    /// The running sum of a window's micro-batch gradients.
    pub sum: GradSum,
}

impl GradBuffers {
    /// Zeroed gradients of the pieces `held`, summed in `order`.
    pub fn new(held: Pieces, order: SumOrder) -> Self {
        GradBuffers {
            buf: vec![0.0; held.len()],
            sum: GradSum::new(order, held.len()),
            held,
        }
    }
}
