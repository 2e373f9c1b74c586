//! Precision modes and the forward context models compute under.
//!
//! Following stoker-precision's [`AutocastPolicy`](stoker_precision::AutocastPolicy):
//! matmuls (linear, attention, convolution) run in the compute dtype; softmax, norms and
//! the loss run in f32 ("high"). Master weights and optimizer moments are always FP32 (the
//! flat buffers); only the candle variables hold compute-dtype copies. `fp8` simulates FP8
//! training on CPU: the inputs of every linear layer's matmul (activation and weight) go
//! through quantize-dequantize with Transformer Engine's delayed scaling (E4M3), and the
//! gradient of every linear layer's output through E5M2 in the backward pass (HYBRID).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use serde::{Deserialize, Serialize};
use stoker_precision::{DelayedScaler, DelayedScalingConfig, TensorRole};

use crate::error::{Result, TrainError};

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

/// The resident steps' activation type for `precision`: f32, bf16, f16 under fp16's
/// loss scale, or bf16 around fp8's linear layers (Transformer Engine's arrangement: the
/// products in FP8, everything else in bf16); fp64 has none.
pub(crate) fn resident_activations(precision: Precision) -> Result<stoker_gpu::Dtype> {
    match precision {
        Precision::Fp32 => Ok(stoker_gpu::Dtype::F32),
        Precision::Bf16 | Precision::Fp8 => Ok(stoker_gpu::Dtype::Bf16),
        Precision::Fp16 => Ok(stoker_gpu::Dtype::F16),
        Precision::Fp64 => Err(crate::error::config_err(
            "precision",
            "step = \"resident\" runs fp32, bf16, fp16 or fp8 (fp64 needs the graph)",
        )),
    }
}

impl Precision {
    /// The config's name for it (`fp32`, `bf16`, `fp16`, `fp8`, `fp64`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
            Precision::Fp8 => "fp8",
            Precision::Fp64 => "fp64",
        }
    }

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

/// Per-layer FP8 scalers: activation input (E4M3), weight (E4M3) and the gradient of the
/// layer's output (E5M2, HYBRID recipe).
pub type LayerScalers = [DelayedScaler; 3];

/// Per-linear-layer FP8 scaling state, keyed by the layer name.
pub struct Fp8State {
    config: DelayedScalingConfig,
    layers: RefCell<BTreeMap<String, Arc<Mutex<LayerScalers>>>>,
}

impl Fp8State {
    /// Scalers following `config` (HYBRID: E4M3 forward, E5M2 backward).
    pub fn new(config: DelayedScalingConfig) -> Self {
        Fp8State {
            config,
            layers: RefCell::new(BTreeMap::new()),
        }
    }

    fn layer(&self, name: &str) -> Result<Arc<Mutex<LayerScalers>>> {
        let mut map = self.layers.borrow_mut();
        if let Some(l) = map.get(name) {
            return Ok(l.clone());
        }
        let f = DelayedScaler::new(&self.config, TensorRole::Forward)?;
        let b = DelayedScaler::new(&self.config, TensorRole::Backward)?;
        let l = Arc::new(Mutex::new([f.clone(), f, b]));
        map.insert(name.to_string(), l.clone());
        Ok(l)
    }

    /// Quantize-dequantize `x` (input `slot` 0 = activation, 1 = weight of layer `name`)
    /// with a straight-through gradient: the forward sees FP8 values, the backward passes
    /// the gradient unchanged (as a real FP8 matmul's backward does for its input cast).
    pub fn qdq(&self, name: &str, slot: usize, x: &Tensor) -> Result<Tensor> {
        let layer = self.layer(name)?;
        let mut scalers = layer.lock().expect("fp8 scaler lock");
        let q = qdq_values(&mut scalers[slot], x)?;
        Ok((x + (q - x)?.detach())?)
    }

    /// Identity in the forward pass; in the backward pass the gradient of `y` (the output
    /// of layer `name`) is quantize-dequantized to E5M2 with its delayed scaler, as the
    /// FP8 gradient GEMMs would see it.
    pub fn grad_qdq(&self, name: &str, y: &Tensor) -> Result<Tensor> {
        let op = GradQdq {
            layer: self.layer(name)?,
        };
        Ok(y.contiguous()?.apply_op1(op)?)
    }

    /// The scalers' state, for checkpoints.
    pub fn state(&self) -> BTreeMap<String, LayerScalers> {
        let map = self.layers.borrow();
        map.iter()
            .map(|(k, v)| (k.clone(), v.lock().expect("fp8 scaler lock").clone()))
            .collect()
    }

    /// Checks a saved state (a checkpoint's) before [`Self::restore`]: every scaler's
    /// ([`DelayedScaler::check`]), the error naming its layer.
    pub fn check_saved(state: &BTreeMap<String, LayerScalers>) -> Result<()> {
        for (layer, scalers) in state {
            for s in scalers {
                s.check().map_err(|source| TrainError::Fp8State {
                    layer: layer.clone(),
                    source,
                })?;
            }
        }
        Ok(())
    }

    /// Restores a saved state.
    pub fn restore(&self, state: BTreeMap<String, LayerScalers>) {
        *self.layers.borrow_mut() = state
            .into_iter()
            .map(|(k, v)| (k, Arc::new(Mutex::new(v))))
            .collect();
    }

    /// Every scaler's amax of the step so far, layer by layer in name order (input,
    /// weight, output gradient): what data-parallel ranks reduce before [`Self::update`].
    pub fn step_amaxes(&self) -> Vec<f32> {
        let map = self.layers.borrow();
        map.values()
            .flat_map(|l| {
                let scalers = l.lock().expect("fp8 scaler lock");
                scalers.iter().map(|s| s.step_amax()).collect::<Vec<_>>()
            })
            .collect()
    }

    /// Folds `amaxes` (in [`Self::step_amaxes`]'s order: the largest over ranks) into the
    /// step's slots, so that every rank's [`Self::update`] takes the same scales.
    pub fn record_amaxes(&self, amaxes: &[f32]) -> Result<()> {
        let map = self.layers.borrow();
        if amaxes.len() != 3 * map.len() {
            return Err(TrainError::Strategy(format!(
                "fp8: {} amax values for {} layers of 3 scalers",
                amaxes.len(),
                map.len()
            )));
        }
        for (layer, three) in map.values().zip(amaxes.chunks(3)) {
            let mut scalers = layer.lock().expect("fp8 scaler lock");
            for (s, &a) in scalers.iter_mut().zip(three) {
                s.record_amax(a);
            }
        }
        Ok(())
    }

    /// Ends the step: every scaler takes its new scale from its amax history.
    pub fn update(&self) {
        for layer in self.layers.borrow().values() {
            for s in layer.lock().expect("fp8 scaler lock").iter_mut() {
                s.update();
            }
        }
    }
}

fn qdq_values(scaler: &mut DelayedScaler, x: &Tensor) -> Result<Tensor> {
    let values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let q = scaler.quantize(&values)?.dequantize();
    Ok(Tensor::from_vec(q, x.shape(), x.device())?.to_dtype(x.dtype())?)
}

/// The custom op behind [`Fp8State::grad_qdq`].
struct GradQdq {
    layer: Arc<Mutex<LayerScalers>>,
}

impl CustomOp1 for GradQdq {
    fn name(&self) -> &'static str {
        "fp8-grad-qdq"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let n = layout.shape().elem_count();
        let o = layout.start_offset();
        match storage {
            CpuStorage::F32(v) if layout.is_contiguous() => Ok((
                CpuStorage::F32(v[o..o + n].to_vec()),
                layout.shape().clone(),
            )),
            _ => candle_core::bail!("fp8-grad-qdq: expects a contiguous f32 tensor"),
        }
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let mut scalers = self.layer.lock().expect("fp8 scaler lock");
        let q = qdq_values(&mut scalers[2], grad)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok(Some(q))
    }
}

/// The `kernels` config key: which implementation of softmax, layer norm, attention,
/// GELU, embedding, cross-entropy and linear layers the models run, and whether a model's
/// training step goes through candle's autograd graph at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Kernels {
    /// The model's own hand-written training step over the flat master and gradient
    /// buffers, where it has one (GPT on a CPU in fp32, and in bf16 where the CPU has bf16
    /// hardware): stoker-kernels' fused kernels called in order, with no autograd graph.
    /// Everything else (other models, fp16, fp8, evaluation, sampling) runs `fused`.
    #[default]
    Direct,
    /// stoker-kernels' fused CPU ops (one pass forward, one backward) on candle's
    /// autograd graph and, where the CPU has bf16 hardware, its bf16 GEMM. Falls back to
    /// `composed` per op on non-CPU devices and in dtypes the fused ops do not take
    /// (f16, f64).
    Fused,
    /// The same maths composed from candle's differentiable primitives: slower, and the
    /// reference the fused ops are tested against.
    Composed,
}

impl Kernels {
    /// Whether it is `direct`: a config says `step = "handwritten"` instead, so written
    /// configs leave `kernels` out for it.
    pub fn is_direct(&self) -> bool {
        *self == Kernels::Direct
    }

    /// The config's name for it (`direct`, `fused`, `composed`).
    pub fn name(self) -> &'static str {
        match self {
            Kernels::Direct => "direct",
            Kernels::Fused => "fused",
            Kernels::Composed => "composed",
        }
    }

    /// Whether the fused ops run (`direct` and `fused`).
    pub fn fused_ops(self) -> bool {
        self != Kernels::Composed
    }

    /// Whether bf16 runs autocast-style here: fused kernels on a CPU with bf16 hardware
    /// (AMX or AVX512-BF16, [`stoker_kernels::bf16_native`]).
    pub fn bf16_on_hardware(self) -> bool {
        self.fused_ops() && stoker_kernels::bf16_native()
    }

    /// Whether a model's direct training step may run in `precision`: `direct` kernels,
    /// and fp32, or bf16 the autocast way (bf16 hardware). fp16 needs the loss scaler's
    /// scaled backward and fp8 its per-op quantization, which only the graph has.
    pub fn direct_step(self, precision: Precision) -> bool {
        self == Kernels::Direct
            && (precision == Precision::Fp32
                || (precision == Precision::Bf16 && self.bf16_on_hardware()))
    }

    /// The dtype of the model's candle variables (the compute-dtype copies of the FP32
    /// master weights). f32 for bf16 with fused kernels on a CPU with bf16 hardware: the
    /// bf16 GEMM rounds weights to bf16 as it packs them, as autocast casts FP32
    /// parameters per op, and gradients then stay f32 (candle's bf16 gradient additions
    /// are emulated). Otherwise the compute dtype.
    pub fn param_dtype(self, precision: Precision) -> DType {
        if precision == Precision::Bf16 && self.bf16_on_hardware() {
            DType::F32
        } else {
            precision.compute_dtype()
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
    /// Fused or composed ops (`direct` runs the fused ops here).
    pub kernels: Kernels,
}

impl<'a> Fx<'a> {
    /// The context of `precision` (pass the FP8 state in `fp8` mode).
    pub fn new(precision: Precision, fp8: Option<&'a Fp8State>) -> Self {
        Fx {
            compute: precision.compute_dtype(),
            high: precision.high_dtype(),
            fp8,
            kernels: Kernels::default(),
        }
    }

    /// The same context with `kernels`.
    pub fn with_kernels(self, kernels: Kernels) -> Self {
        Fx { kernels, ..self }
    }

    /// The dtype activations are kept in between ops. The compute dtype, except for bf16
    /// with fused kernels on a CPU with bf16 hardware: there activations stay f32 and only
    /// the matmul operands are bf16 (rounded while the GEMM packs them), because candle's
    /// elementwise bf16 arithmetic, including the gradient additions of its backward, is
    /// emulated and costs more than the bf16 matmul saves.
    pub fn activation(&self) -> DType {
        if self.bf16_autocast() {
            self.high
        } else {
            self.compute
        }
    }

    /// Whether this is bf16 compute the autocast way (see [`Kernels::param_dtype`]): f32
    /// tensors, matmul operands rounded to bf16 inside stoker-kernels' bf16 GEMM.
    pub fn bf16_autocast(&self) -> bool {
        self.compute == DType::BF16 && self.kernels.bf16_on_hardware()
    }

    /// Whether the fused op can run on `t`: fused kernels chosen, a CPU tensor, and a
    /// dtype the kernels take (f32 or bf16).
    pub fn fused_for(&self, t: &Tensor) -> bool {
        self.kernels.fused_ops()
            && t.device().is_cpu()
            && matches!(t.dtype(), DType::F32 | DType::BF16)
    }
}
