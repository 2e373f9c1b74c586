//! Decision (b), precision: bf16 where the device runs it natively, otherwise fp16 with
//! dynamic loss scaling, otherwise fp32; fp8 only on request and only where the device has it.

use serde::Serialize;

use crate::hardware::Hardware;
use crate::setup::{Dtype, Precision};

/// The precision chosen and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PrecisionChoice {
    /// The recipe used for the plan.
    pub precision: Precision,
    /// Dynamic loss scaling is needed (fp16).
    pub loss_scaling: bool,
    /// One sentence with the numbers behind the choice.
    pub reason: String,
    /// Requests that could not be honoured.
    pub warnings: Vec<String>,
}

fn rate(flops: f64) -> String {
    if flops >= 1e12 {
        format!("{:.0} TFLOP/s", flops / 1e12)
    } else {
        format!("{:.0} GFLOP/s", flops / 1e9)
    }
}

/// The dtype's peak, and what a measured training step reaches where the preset has it.
fn tflops(hw: &Hardware, d: Dtype) -> String {
    match hw.dtype(d) {
        Some(s) => match s.mfu {
            Some(mfu) => format!(
                "{} peak, {} in a measured training step",
                rate(s.peak_flops),
                rate(s.peak_flops * mfu)
            ),
            None => rate(s.peak_flops),
        },
        None => "none".into(),
    }
}

/// A dtype the device has without its hardware: its rate, said to be emulated.
fn support(hw: &Hardware, d: Dtype) -> String {
    match hw.dtype(d) {
        Some(_) => format!("emulated, {}", tflops(hw, d)),
        None => "none".into(),
    }
}

fn native(hw: &Hardware, d: Dtype) -> bool {
    hw.dtype(d).is_some_and(|s| s.native)
}

/// Chooses the precision for `hw`, honouring `requested` where the device allows it.
pub fn choose(hw: &Hardware, requested: Option<Precision>) -> PrecisionChoice {
    let mut warnings = Vec::new();
    if let Some(req) = requested {
        let d = req.compute_dtype();
        match hw.dtype(d) {
            Some(s) => {
                if !s.native {
                    // Its rates are the figures given for the dtype (a preset's may be
                    // another CPU's bf16 hardware): no claim that they beat fp32's.
                    warnings.push(format!(
                        "{} was requested but {} has no hardware for it (emulated): the plan \
                         takes the figures it has ({}), which an emulated step may fall far \
                         short of, and fp32 may train faster (--precision auto lets decision \
                         (b) choose)",
                        req.name(),
                        hw.name,
                        tflops(hw, d),
                    ));
                }
                return PrecisionChoice {
                    precision: req,
                    loss_scaling: req == Precision::Fp16,
                    reason: format!(
                        "{} as requested ({} at {} on {}){}",
                        req.name(),
                        req.name(),
                        tflops(hw, d),
                        hw.name,
                        if req == Precision::Fp16 {
                            ", with dynamic loss scaling (fp16's 5-bit exponent underflows small gradients)"
                        } else {
                            ""
                        }
                    ),
                    warnings,
                };
            }
            None => warnings.push(format!(
                "{} was requested but {} has no {} matmul; falling back to the automatic choice",
                req.name(),
                hw.name,
                req.name()
            )),
        }
    }
    let mut choice = if native(hw, Dtype::Bf16) {
        PrecisionChoice {
            precision: Precision::Bf16,
            loss_scaling: false,
            reason: format!(
                "bf16 mixed precision: {} runs bf16 natively at {} (fp32 {}), and bf16 keeps \
                 fp32's 8-bit exponent, so no loss scaling is needed",
                hw.name,
                tflops(hw, Dtype::Bf16),
                tflops(hw, Dtype::Fp32)
            ),
            warnings: Vec::new(),
        }
    } else if native(hw, Dtype::Fp16) {
        PrecisionChoice {
            precision: Precision::Fp16,
            loss_scaling: true,
            reason: format!(
                "fp16 mixed precision with dynamic loss scaling: {} has no native bf16 but runs \
                 fp16 at {} (fp32 {})",
                hw.name,
                tflops(hw, Dtype::Fp16),
                tflops(hw, Dtype::Fp32)
            ),
            warnings: Vec::new(),
        }
    } else {
        PrecisionChoice {
            precision: Precision::Fp32,
            loss_scaling: false,
            // No "faster" or "slower" here: an emulated dtype's peak is its matmul's,
            // which may beat fp32's while its training step does not (a CPU's bf16 on
            // candle's graph: the GEMM near fp32's, the step about 5x slower).
            reason: format!(
                "fp32: {} runs neither bf16 nor fp16 natively (bf16: {}, fp16: {}; fp32: \
                 {}), so the reduced precisions would add rounding without their hardware",
                hw.name,
                support(hw, Dtype::Bf16),
                support(hw, Dtype::Fp16),
                tflops(hw, Dtype::Fp32)
            ),
            warnings: Vec::new(),
        }
    };
    choice.warnings = warnings;
    choice
}
