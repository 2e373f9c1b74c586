//! How an update treats a window's summed gradients before the optimizer: rescaled to
//! the mean over the valid targets, unscaled by fp16's loss scale, clipped to a norm; and
//! whether an overflow skips it. With a loss scale a non-finite global norm is the
//! overflow (DeepSpeed's fp16 optimizer's test; torch's GradScaler looks at every
//! gradient, which a non-finite sum of squares implies): every rank computes the same
//! norm, so every rank skips together without another collective.

use crate::step::optimizer::grad_multiplier;

/// Clipping and fp16's loss scale for an update.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GradRule {
    /// The global norm to clip the mean gradient to, if any.
    pub clip: Option<f64>,
    /// fp16's loss scale, which the gradients carry (each micro-batch's backward
    /// multiplies by it); None without loss scaling.
    pub loss_scale: Option<f32>,
}

impl GradRule {
    /// The multiplier that unscales: `1 / loss scale` as torch's GradScaler computes it
    /// (the f64 reciprocal rounded to f32), 1 without a loss scale.
    pub fn inv_scale(&self) -> f32 {
        self.loss_scale.map_or(1.0, |s| (1.0 / s as f64) as f32)
    }

    /// Whether an update whose mean gradient has norm `norm` is skipped: under a loss
    /// scale, when the norm is not finite (the scaled gradients overflowed).
    pub fn skips(&self, norm: f64) -> bool {
        self.loss_scale.is_some() && !norm.is_finite()
    }

    /// For summed gradients with squared norm `squares` (as they lie, scaled) that
    /// `rescale` turns into the mean: the mean gradient's unscaled norm, and the
    /// optimizer's multiplier (rescale, unscale and clip in one), None when the update is
    /// skipped.
    pub fn multiplier(&self, squares: f64, rescale: f32) -> (f64, Option<f32>) {
        let unscale = rescale * self.inv_scale();
        let norm = squares.sqrt() * unscale as f64;
        let mult = (!self.skips(norm)).then(|| grad_multiplier(norm, unscale, self.clip));
        (norm, mult)
    }
}

#[cfg(test)]
mod tests {
    use super::GradRule;

    #[test]
    fn a_loss_scale_unscales_and_an_overflow_skips() {
        let plain = GradRule::default();
        assert_eq!(plain.multiplier(16.0, 0.5), (2.0, Some(0.5)));
        assert!(!plain.skips(f64::NAN), "without a loss scale nothing skips");
        let fp16 = GradRule {
            clip: Some(2.0),
            loss_scale: Some(1024.0),
        };
        // sqrt(2^20 x 4) x 0.5 / 1024 = 1: below the clip.
        let (norm, mult) = fp16.multiplier(4.0 * 1048576.0, 0.5);
        assert_eq!((norm, mult), (1.0, Some(0.5 / 1024.0)));
        // Clipped to 0.5 by torch's coefficient, 0.5 / (1 + 1e-6).
        let clipped = GradRule {
            clip: Some(0.5),
            ..fp16
        };
        let want = (0.5 / 1024.0) * (0.5 / (1.0 + 1e-6)) as f32;
        assert_eq!(clipped.multiplier(4.0 * 1048576.0, 0.5), (1.0, Some(want)));
        for bad in [f64::INFINITY, f64::NAN] {
            let (norm, mult) = fp16.multiplier(bad, 0.5);
            assert!(
                !norm.is_finite() && mult.is_none(),
                "{bad}: {norm} {mult:?}"
            );
        }
    }
}
