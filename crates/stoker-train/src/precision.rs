//! Precision modes and the forward context models compute under.
//!
//! Following stoker-precision's [`AutocastPolicy`](stoker_precision::AutocastPolicy):
//! matmuls (linear, attention, convolution) run in the compute dtype; softmax, norms and
//! the loss run in f32 ("high"). Master weights and optimizer moments are always FP32 (the
//! flat buffers); only the candle variables hold compute-dtype copies. `fp8` simulates FP8
//! training on CPU: the inputs of every linear layer's matmul (activation and weight) go
//! through quantize-dequantize with Transformer Engine's delayed scaling (E4M3, forward).

use std::cell::RefCell;
use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};
use stoker_precision::{DelayedScaler, DelayedScalingConfig, TensorRole};

use crate::error::Result;

/// The `precision` config key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    Fp32,
    /// bf16 matmuls, f32 softmax / norms / loss.
    Bf16,
    /// f16 matmuls with dynamic loss scaling.
    Fp16,
    /// f32 compute with FP8 (E4M3) quantize-dequantize of linear-layer matmul inputs.
    Fp8,
    /// Everything in f64 (gradient checks against finite differences).
    Fp64,
}

impl Precision {
    /// The dtype of the candle variables and of matmuls.
    pub fn compute_dtype(self) -> DType {
        match self {
            Precision::Fp32 | Precision::Fp8 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
            Precision::Fp64 => DType::F64,
        }
    }

    /// The dtype of softmax, norms and the loss (f32, or f64 in gradient checks).
    pub fn high_dtype(self) -> DType {
        if self == Precision::Fp64 {
            DType::F64
        } else {
            DType::F32
        }
    }

    /// Whether the loss must be scaled (f16's narrow exponent range).
    pub fn needs_loss_scaling(self) -> bool {
        self == Precision::Fp16
    }
}

/// Per-linear-layer FP8 scaling state: one delayed scaler for the activation input and
/// one for the weight, keyed by the layer name.
pub struct Fp8State {
    config: DelayedScalingConfig,
    scalers: RefCell<BTreeMap<String, [DelayedScaler; 2]>>,
}

impl Fp8State {
    /// Scalers following `config` (HYBRID: E4M3 in the forward pass).
    pub fn new(config: DelayedScalingConfig) -> Self {
        Fp8State {
            config,
            scalers: RefCell::new(BTreeMap::new()),
        }
    }

    /// Quantize-dequantize `x` (input `slot` 0 = activation, 1 = weight of layer `name`)
    /// with a straight-through gradient: the forward sees FP8 values, the backward passes
    /// the gradient unchanged (as a real FP8 matmul's backward does for its input cast).
    pub fn qdq(&self, name: &str, slot: usize, x: &Tensor) -> Result<Tensor> {
        let mut map = self.scalers.borrow_mut();
        if !map.contains_key(name) {
            let s = DelayedScaler::new(&self.config, TensorRole::Forward)?;
            map.insert(name.to_string(), [s.clone(), s]);
        }
        let scaler = &mut map.get_mut(name).expect("inserted")[slot];
        let dtype = x.dtype();
        let values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let q = scaler.quantize(&values)?.dequantize();
        let q = Tensor::from_vec(q, x.shape(), x.device())?.to_dtype(dtype)?;
        Ok((x + (q - x)?.detach())?)
    }

    /// The scalers' state, for checkpoints.
    pub fn state(&self) -> BTreeMap<String, [DelayedScaler; 2]> {
        self.scalers.borrow().clone()
    }

    /// Restores a saved state.
    pub fn restore(&self, state: BTreeMap<String, [DelayedScaler; 2]>) {
        *self.scalers.borrow_mut() = state;
    }

    /// Ends the step: every scaler takes its new scale from its amax history.
    pub fn update(&self) {
        for pair in self.scalers.borrow_mut().values_mut() {
            for s in pair {
                s.update();
            }
        }
    }
}

/// What a forward pass needs to know about precision.
#[derive(Clone, Copy)]
pub struct Fx<'a> {
    /// Matmul dtype (the variables' dtype).
    pub compute: DType,
    /// Softmax / norm / loss dtype.
    pub high: DType,
    /// FP8 simulation state, in `fp8` mode.
    pub fp8: Option<&'a Fp8State>,
}

impl<'a> Fx<'a> {
    /// The context of `precision` (pass the FP8 state in `fp8` mode).
    pub fn new(precision: Precision, fp8: Option<&'a Fp8State>) -> Self {
        Fx {
            compute: precision.compute_dtype(),
            high: precision.high_dtype(),
            fp8,
        }
    }
}
