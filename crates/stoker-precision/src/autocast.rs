//! The autocast policy as data: which operations run in the low-precision compute dtype and
//! which stay in f32, following torch's autocast op lists (CUDA lists, which fp16 and bf16
//! share; `torch.amp` autocast op reference). The trainer asks [`AutocastPolicy::dtype_for`]
//! before each op and casts its inputs accordingly.
//!
//! The table itself is [`AUTOCAST_TABLE`]; the crate docs render it.

use crate::format::Dtype;

/// What autocast does with an op's floating-point inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CastPolicy {
    /// Cast to the low-precision compute dtype (f16/bf16): matmul-like ops, where tensor cores
    /// (or bf16 dot products) pay off and accumulation is f32 inside the kernel.
    LowerPrecision,
    /// Cast to f32: ops whose range or precision f16/bf16 cannot hold (exp, log, softmax,
    /// norms, reductions, losses).
    Float32,
    /// Cast all inputs to the widest input dtype (ops that combine several tensors).
    Promote,
    /// Leave as they come (elementwise ops, views, activations): they run in whatever dtype
    /// their input already has.
    Passthrough,
}

/// Operations the policy knows about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[allow(missing_docs)] // names mirror torch's ops, listed with them in AUTOCAST_TABLE
pub enum Op {
    // Lower precision.
    Matmul,
    Mm,
    Bmm,
    Addmm,
    Addbmm,
    Baddbmm,
    Linear,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    Prelu,
    ScaledDotProductAttention,
    RnnCell,
    LstmCell,
    GruCell,
    // Float32.
    Pow,
    Exp,
    Expm1,
    Log,
    Log2,
    Log10,
    Log1p,
    Reciprocal,
    Rsqrt,
    Sinh,
    Cosh,
    Tan,
    Acos,
    Asin,
    Erfinv,
    Softplus,
    Softmax,
    LogSoftmax,
    Logsumexp,
    LayerNorm,
    RmsNorm,
    GroupNorm,
    Norm,
    Renorm,
    Sum,
    Prod,
    Cumsum,
    Cumprod,
    Dist,
    Cdist,
    Pdist,
    CosineSimilarity,
    CrossEntropy,
    NllLoss,
    MseLoss,
    L1Loss,
    SmoothL1Loss,
    HuberLoss,
    KlDiv,
    BinaryCrossEntropyWithLogits,
    CosineEmbeddingLoss,
    MarginRankingLoss,
    PoissonNllLoss,
    // Promote.
    Cat,
    Stack,
    Addcmul,
    Addcdiv,
    Atan2,
    Dot,
    IndexPut,
    ScatterAdd,
    // Passthrough.
    Add,
    Mul,
    Relu,
    Gelu,
    Silu,
    Tanh,
    Dropout,
    Embedding,
    Reshape,
    Mean,
}

/// `(op, policy, torch op name)`, the whole policy. `Mean` is passthrough, as in torch (only
/// `sum`/`prod`/`cumsum`/`cumprod` are on torch's f32 list among the reductions); `RmsNorm` is
/// f32 as torch's `rms_norm` on recent versions.
pub const AUTOCAST_TABLE: &[(Op, CastPolicy, &str)] = {
    use CastPolicy::*;
    use Op::*;
    &[
        (Matmul, LowerPrecision, "matmul"),
        (Mm, LowerPrecision, "mm"),
        (Bmm, LowerPrecision, "bmm"),
        (Addmm, LowerPrecision, "addmm"),
        (Addbmm, LowerPrecision, "addbmm"),
        (Baddbmm, LowerPrecision, "baddbmm"),
        (Linear, LowerPrecision, "linear"),
        (Conv1d, LowerPrecision, "conv1d"),
        (Conv2d, LowerPrecision, "conv2d"),
        (Conv3d, LowerPrecision, "conv3d"),
        (ConvTranspose1d, LowerPrecision, "conv_transpose1d"),
        (ConvTranspose2d, LowerPrecision, "conv_transpose2d"),
        (ConvTranspose3d, LowerPrecision, "conv_transpose3d"),
        (Prelu, LowerPrecision, "prelu"),
        (
            ScaledDotProductAttention,
            LowerPrecision,
            "scaled_dot_product_attention",
        ),
        (RnnCell, LowerPrecision, "rnn_tanh_cell / rnn_relu_cell"),
        (LstmCell, LowerPrecision, "lstm_cell"),
        (GruCell, LowerPrecision, "gru_cell"),
        (Pow, Float32, "pow"),
        (Exp, Float32, "exp"),
        (Expm1, Float32, "expm1"),
        (Log, Float32, "log"),
        (Log2, Float32, "log2"),
        (Log10, Float32, "log10"),
        (Log1p, Float32, "log1p"),
        (Reciprocal, Float32, "reciprocal"),
        (Rsqrt, Float32, "rsqrt"),
        (Sinh, Float32, "sinh"),
        (Cosh, Float32, "cosh"),
        (Tan, Float32, "tan"),
        (Acos, Float32, "acos"),
        (Asin, Float32, "asin"),
        (Erfinv, Float32, "erfinv"),
        (Softplus, Float32, "softplus"),
        (Softmax, Float32, "softmax"),
        (LogSoftmax, Float32, "log_softmax"),
        (Logsumexp, Float32, "logsumexp"),
        (LayerNorm, Float32, "layer_norm"),
        (RmsNorm, Float32, "rms_norm"),
        (GroupNorm, Float32, "group_norm"),
        (Norm, Float32, "norm / frobenius_norm / nuclear_norm"),
        (Renorm, Float32, "renorm"),
        (Sum, Float32, "sum"),
        (Prod, Float32, "prod"),
        (Cumsum, Float32, "cumsum"),
        (Cumprod, Float32, "cumprod"),
        (Dist, Float32, "dist"),
        (Cdist, Float32, "cdist"),
        (Pdist, Float32, "pdist"),
        (CosineSimilarity, Float32, "cosine_similarity"),
        (
            CrossEntropy,
            Float32,
            "cross_entropy (log_softmax + nll_loss)",
        ),
        (NllLoss, Float32, "nll_loss"),
        (MseLoss, Float32, "mse_loss"),
        (L1Loss, Float32, "l1_loss"),
        (SmoothL1Loss, Float32, "smooth_l1_loss"),
        (HuberLoss, Float32, "huber_loss"),
        (KlDiv, Float32, "kl_div"),
        (
            BinaryCrossEntropyWithLogits,
            Float32,
            "binary_cross_entropy_with_logits",
        ),
        (CosineEmbeddingLoss, Float32, "cosine_embedding_loss"),
        (MarginRankingLoss, Float32, "margin_ranking_loss"),
        (PoissonNllLoss, Float32, "poisson_nll_loss"),
        (Cat, Promote, "cat"),
        (Stack, Promote, "stack"),
        (Addcmul, Promote, "addcmul"),
        (Addcdiv, Promote, "addcdiv"),
        (Atan2, Promote, "atan2"),
        (Dot, Promote, "dot"),
        (IndexPut, Promote, "index_put"),
        (ScatterAdd, Promote, "scatter_add"),
        (Add, Passthrough, "add"),
        (Mul, Passthrough, "mul"),
        (Relu, Passthrough, "relu"),
        (Gelu, Passthrough, "gelu"),
        (Silu, Passthrough, "silu"),
        (Tanh, Passthrough, "tanh"),
        (Dropout, Passthrough, "dropout"),
        (Embedding, Passthrough, "embedding"),
        (Reshape, Passthrough, "view / reshape / transpose"),
        (Mean, Passthrough, "mean"),
    ]
};

/// The policy: a compute dtype and the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AutocastPolicy {
    /// The low-precision dtype for [`CastPolicy::LowerPrecision`] ops (F16 or BF16); F32
    /// disables autocast.
    pub compute_dtype: Dtype,
}

impl AutocastPolicy {
    /// Autocast to bf16 (no loss scaling needed).
    pub const BF16: Self = Self {
        compute_dtype: Dtype::BF16,
    };
    /// Autocast to f16 (pair with a [`crate::LossScaler`]).
    pub const F16: Self = Self {
        compute_dtype: Dtype::F16,
    };
    /// No autocast: everything in f32.
    pub const F32: Self = Self {
        compute_dtype: Dtype::F32,
    };

    /// The cast policy of `op`.
    pub fn policy(op: Op) -> CastPolicy {
        AUTOCAST_TABLE
            .iter()
            .find(|(o, _, _)| *o == op)
            .map(|(_, p, _)| *p)
            .unwrap_or(CastPolicy::Passthrough)
    }

    /// The dtype `op` should run in, given its floating-point inputs' dtypes.
    pub fn dtype_for(&self, op: Op, inputs: &[Dtype]) -> Dtype {
        let widest = inputs
            .iter()
            .copied()
            .reduce(Dtype::promote)
            .unwrap_or(Dtype::F32);
        if self.compute_dtype == Dtype::F32 {
            return widest;
        }
        match Self::policy(op) {
            CastPolicy::LowerPrecision => self.compute_dtype,
            CastPolicy::Float32 => Dtype::F32,
            CastPolicy::Promote | CastPolicy::Passthrough => widest,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_lists_each_op_once() {
        for (i, (a, _, _)) in AUTOCAST_TABLE.iter().enumerate() {
            assert!(
                AUTOCAST_TABLE[i + 1..].iter().all(|(b, _, _)| b != a),
                "{a:?} twice"
            );
        }
    }

    #[test]
    fn matmuls_low_precision_softmax_and_losses_f32() {
        let p = AutocastPolicy::BF16;
        for op in [Op::Matmul, Op::Linear, Op::Conv2d, Op::Bmm, Op::Baddbmm] {
            assert_eq!(
                p.dtype_for(op, &[Dtype::F32, Dtype::F32]),
                Dtype::BF16,
                "{op:?}"
            );
        }
        for op in [
            Op::Softmax,
            Op::LogSoftmax,
            Op::Exp,
            Op::Log,
            Op::LayerNorm,
            Op::RmsNorm,
            Op::Sum,
            Op::Norm,
            Op::CrossEntropy,
            Op::MseLoss,
        ] {
            assert_eq!(p.dtype_for(op, &[Dtype::BF16]), Dtype::F32, "{op:?}");
        }
        assert_eq!(p.dtype_for(Op::Cat, &[Dtype::BF16, Dtype::F32]), Dtype::F32);
        assert_eq!(p.dtype_for(Op::Gelu, &[Dtype::BF16]), Dtype::BF16);
        assert_eq!(
            AutocastPolicy::F16.dtype_for(Op::Linear, &[Dtype::F32]),
            Dtype::F16
        );
        assert_eq!(
            AutocastPolicy::F32.dtype_for(Op::Linear, &[Dtype::F32]),
            Dtype::F32
        );
    }
}
