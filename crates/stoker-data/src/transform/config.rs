//! The image transform's configuration: one typed struct, one source of defaults.

use crate::{DType, DataError, Result};

/// ImageNet channel means (RGB, on [0, 1] pixels): the usual normalization constants.
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// ImageNet channel standard deviations (RGB, on [0, 1] pixels).
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];
/// Eval mode resizes the shorter side to `size / EVAL_CROP_FRACTION` (224 -> 256) before the
/// center crop: the standard ImageNet evaluation recipe.
pub const EVAL_CROP_FRACTION: f64 = 0.875;

/// Train (random augmentation) or eval (deterministic) geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransformMode {
    /// Random-resized-crop to `size` x `size`, then a random horizontal flip.
    Train,
    /// Resize the shorter side to `floor(size / 0.875)`, then center-crop `size` x `size`; no
    /// randomness, no flip.
    Eval,
}

/// Which library decodes the JPEG bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JpegBackend {
    /// libjpeg-turbo (the system library, through the `turbojpeg` crate): faster on progressive
    /// photos and able to scale in the DCT domain. Any decoder warning is an error. Files whose
    /// header it cannot use (CMYK/YCCK, unusual chroma subsampling) go to zune-jpeg, full size.
    LibjpegTurbo,
    /// zune-jpeg alone (pure Rust, strict mode), always at full scale: the decoder of earlier
    /// releases, kept to compare against and for builds that want no C library at run time.
    Zune,
}

/// How a JPEG becomes a normalized `[3, size, size]` tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageTransformConfig {
    /// Output height and width in pixels.
    pub size: u32,
    /// Bounds of the random crop's area as a fraction of the image's (train mode).
    pub scale: (f64, f64),
    /// Bounds of the random crop's width / height (train mode).
    pub ratio: (f64, f64),
    /// Probability of a horizontal flip (train mode).
    pub hflip_prob: f64,
    /// Per-channel mean subtracted from [0, 1] pixels.
    pub mean: [f32; 3],
    /// Per-channel standard deviation the centered pixels are divided by.
    pub std: [f32; 3],
    /// Output element type: F32 or BF16.
    pub dtype: DType,
    /// Train or eval geometry.
    pub mode: TransformMode,
    /// The JPEG decoder.
    pub decoder: JpegBackend,
    /// Decode at 1/2, 1/4 or 1/8 scale in the DCT domain when the crop still keeps at least the
    /// output size on both sides (see [`dct_reduction`](super::crop::dct_reduction)); only
    /// with [`JpegBackend::LibjpegTurbo`]. Off gives the full-size decode torchvision does.
    pub dct_scaling: bool,
}

impl Default for ImageTransformConfig {
    /// The standard ImageNet training recipe: RRC 224, scale (0.08, 1), ratio (3/4, 4/3),
    /// flip 0.5, ImageNet mean/std, f32; libjpeg-turbo with DCT-domain scaling.
    fn default() -> Self {
        ImageTransformConfig {
            size: 224,
            scale: (0.08, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
            hflip_prob: 0.5,
            mean: IMAGENET_MEAN,
            std: IMAGENET_STD,
            dtype: DType::F32,
            mode: TransformMode::Train,
            decoder: JpegBackend::LibjpegTurbo,
            dct_scaling: true,
        }
    }
}

impl ImageTransformConfig {
    /// The default configuration in eval mode.
    pub fn eval() -> Self {
        ImageTransformConfig {
            mode: TransformMode::Eval,
            ..Self::default()
        }
    }

    /// The shorter side eval mode resizes to before its center crop.
    pub fn eval_resize(&self) -> u32 {
        (f64::from(self.size) / EVAL_CROP_FRACTION).floor() as u32
    }

    /// Bytes of one output image: 3 x size x size elements of `dtype`.
    pub fn output_bytes(&self) -> usize {
        3 * self.size as usize * self.size as usize * self.dtype.size()
    }

    /// Checks every field, naming the first one out of range.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, message: String| Err(DataError::Config { field, message });
        if self.size == 0 || self.size > 16384 {
            return bad("size", format!("{} (expected 1..=16384)", self.size));
        }
        let (lo, hi) = self.scale;
        if !(lo > 0.0 && lo <= hi && hi.is_finite()) {
            return bad(
                "scale",
                format!("{:?} (expected 0 < min <= max)", self.scale),
            );
        }
        let (lo, hi) = self.ratio;
        if !(lo > 0.0 && lo <= hi && hi.is_finite()) {
            return bad(
                "ratio",
                format!("{:?} (expected 0 < min <= max)", self.ratio),
            );
        }
        if !(0.0..=1.0).contains(&self.hflip_prob) {
            return bad(
                "hflip_prob",
                format!("{} (expected 0..=1)", self.hflip_prob),
            );
        }
        if self.std.iter().any(|s| !(s.is_finite() && *s != 0.0)) {
            return bad("std", format!("{:?} (expected finite, non-zero)", self.std));
        }
        if self.mean.iter().any(|m| !m.is_finite()) {
            return bad("mean", format!("{:?} (expected finite)", self.mean));
        }
        if !matches!(self.dtype, DType::F32 | DType::BF16) {
            return bad("dtype", format!("{} (expected f32 or bf16)", self.dtype));
        }
        Ok(())
    }
}
