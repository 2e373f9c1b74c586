//! The model's candle variables and the flat buffers: the layout of a [`ParamSet`], and
//! values copied between its variables and a flat buffer in both directions (the FP32
//! master into variables of any dtype, a bf16 copy without conversion, each parameter's
//! gradient from candle's store into a flat gradient buffer).

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

use crate::error::{Result, TrainError};
use crate::layout::{FlatLayout, DEFAULT_ALIGN};
use crate::params::{Param, ParamSet};

impl FlatLayout {
    /// The layout of `params` (declaration order) with [`DEFAULT_ALIGN`].
    pub fn of(params: &ParamSet) -> Result<Self> {
        Self::new(&params.specs(), DEFAULT_ALIGN)
    }

    /// Checks that `params` matches this layout name for name, shape for shape.
    pub fn check_params(&self, params: &ParamSet) -> Result<()> {
        if params.len() != self.slots().len() {
            return Err(TrainError::Layout(format!(
                "{} parameters, layout has {}",
                params.len(),
                self.slots().len()
            )));
        }
        for (p, s) in params.iter().zip(self.slots()) {
            if p.name != s.name || p.var.dims() != s.shape.as_slice() {
                return Err(TrainError::Layout(format!(
                    "parameter `{}` {:?} where the layout has `{}` {:?}",
                    p.name,
                    p.var.dims(),
                    s.name,
                    s.shape
                )));
            }
        }
        Ok(())
    }

    /// Copies the variables' values (any float dtype, widened to f32) into a new buffer.
    pub fn flatten(&self, params: &ParamSet) -> Result<Vec<f32>> {
        self.check_params(params)?;
        let mut buf = vec![0f32; self.total_len()];
        for (p, s) in params.iter().zip(self.slots()) {
            let v = p.var.as_tensor().to_dtype(DType::F32)?.flatten_all()?;
            buf[s.offset..s.offset + s.len].copy_from_slice(&v.to_vec1::<f32>()?);
        }
        Ok(buf)
    }

    /// Refreshes the variables from `buf`, casting to each variable's dtype.
    pub fn unflatten(&self, buf: &[f32], params: &ParamSet) -> Result<()> {
        self.check_len(buf.len())?;
        for (p, s) in params.iter().zip(self.slots()) {
            let t = Tensor::from_slice(
                &buf[s.offset..s.offset + s.len],
                s.shape.as_slice(),
                p.var.device(),
            )?
            .to_dtype(p.var.dtype())?;
            p.var.set(&t)?;
        }
        Ok(())
    }

    /// Refreshes bf16 variables from `buf`, a bf16 copy of the master buffer in this
    /// layout (the optimizer's copy-out), with no conversion.
    pub fn unflatten_bf16(&self, buf: &[half::bf16], params: &ParamSet) -> Result<()> {
        self.check_len(buf.len())?;
        for (p, s) in params.iter().zip(self.slots()) {
            if p.var.dtype() != DType::BF16 {
                return Err(TrainError::Layout(format!(
                    "parameter `{}` is {:?}, not bf16",
                    p.name,
                    p.var.dtype()
                )));
            }
            let t = Tensor::from_slice(
                &buf[s.offset..s.offset + s.len],
                s.shape.as_slice(),
                p.var.device(),
            )?;
            p.var.set(&t)?;
        }
        Ok(())
    }

    /// Adds (`scale` x) each parameter's gradient from `grads` into `out`. A parameter
    /// without a gradient is an error naming it (see [`crate::check`]).
    pub fn gather_grads(
        &self,
        grads: &GradStore,
        params: &ParamSet,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_len(out.len())?;
        for (p, s) in params.iter().zip(self.slots()) {
            if !add_grad(grads, p, &mut out[s.offset..s.offset + s.len])? {
                return Err(TrainError::NoGradient {
                    name: p.name.clone(),
                });
            }
        }
        Ok(())
    }
}

/// Adds parameter `p`'s gradient from `grads`, as f32, into `out` (its slot of a flat
/// buffer); false if the backward gave it none.
pub(crate) fn add_grad(grads: &GradStore, p: &Param, out: &mut [f32]) -> Result<bool> {
    let Some(g) = grads.get(p.var.as_tensor()) else {
        return Ok(false);
    };
    let g = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    for (o, x) in out.iter_mut().zip(&g) {
        *o += x;
    }
    Ok(true)
}
