//! The data-parallel strategies the planner compares, and the order it tries them in.

use serde::Serialize;

use crate::error::{PlanError, Result};

/// What is sharded across the data-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// DDP (FSDP NO_SHARD): everything replicated.
    Ddp,
    /// ZeRO-1: optimizer states sharded.
    Zero1,
    /// ZeRO-2 (FSDP SHARD_GRAD_OP): optimizer states and gradients sharded.
    Zero2,
    /// ZeRO-3 (FSDP FULL_SHARD): optimizer states, gradients and parameters sharded.
    Zero3,
}

impl Stage {
    /// The config name: `ddp`, `zero1`, `zero2`, `zero3`.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Ddp => "ddp",
            Stage::Zero1 => "zero1",
            Stage::Zero2 => "zero2",
            Stage::Zero3 => "zero3",
        }
    }
}

/// A stage plus what it offloads to host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Strategy {
    /// What is sharded.
    pub stage: Stage,
    /// Optimizer states (and the fp32 master copy) live in host memory; the CPU steps them.
    pub offload_optimizer: bool,
    /// Parameter shards live in host memory (ZeRO-3 only).
    pub offload_params: bool,
}

impl Strategy {
    /// A strategy without offload.
    pub const fn plain(stage: Stage) -> Self {
        Strategy {
            stage,
            offload_optimizer: false,
            offload_params: false,
        }
    }

    /// A strategy with the optimizer offloaded.
    pub const fn offload(stage: Stage) -> Self {
        Strategy {
            stage,
            offload_optimizer: true,
            offload_params: false,
        }
    }

    /// Builds and checks a strategy: parameter offload needs ZeRO-3 and optimizer offload.
    pub fn new(stage: Stage, offload_optimizer: bool, offload_params: bool) -> Result<Self> {
        if offload_params && stage != Stage::Zero3 {
            return Err(PlanError::Unsupported(format!(
                "offloading parameters needs ZeRO-3 (stage 3), not {}",
                stage.name()
            )));
        }
        if offload_params && !offload_optimizer {
            return Err(PlanError::Unsupported(
                "offloading parameters without offloading the optimizer is not modelled; \
                 offload the optimizer too"
                    .into(),
            ));
        }
        Ok(Strategy {
            stage,
            offload_optimizer,
            offload_params,
        })
    }

    /// Label such as `zero3+offload-opt+params`.
    pub fn label(&self) -> String {
        let mut s = self.stage.name().to_string();
        if self.offload_optimizer {
            s.push_str("+offload-opt");
        }
        if self.offload_params {
            s.push_str("+params");
        }
        s
    }
}

/// Every row of the report's table: the decision order [`ALL`] plus DDP with its optimizer
/// offloaded, shown for completeness but never recommended (ZeRO-1 with offload moves the same
/// bytes and needs 1/N of its host memory).
pub const TABLE: [Strategy; 9] = [
    ALL[0],
    ALL[1],
    ALL[2],
    ALL[3],
    Strategy::offload(Stage::Ddp),
    ALL[4],
    ALL[5],
    ALL[6],
    ALL[7],
];

/// The strategies the recommendation tries, in the chapter's order: DDP, ZeRO-1, ZeRO-2,
/// ZeRO-3, then offload from least to most.
pub const ALL: [Strategy; 8] = [
    Strategy::plain(Stage::Ddp),
    Strategy::plain(Stage::Zero1),
    Strategy::plain(Stage::Zero2),
    Strategy::plain(Stage::Zero3),
    Strategy::offload(Stage::Zero1),
    Strategy::offload(Stage::Zero2),
    Strategy::offload(Stage::Zero3),
    Strategy {
        stage: Stage::Zero3,
        offload_optimizer: true,
        offload_params: true,
    },
];
