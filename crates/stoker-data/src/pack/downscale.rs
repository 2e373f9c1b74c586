//! Pack-time downscaling, as FFCV's `max_resolution`: photos whose longer side exceeds a limit
//! are decoded, shrunk (bilinear, antialiased) and re-encoded as baseline JPEG.
//!
//! Decode cost grows with pixel count, and a 224-pixel training crop rarely needs a 20-megapixel
//! source; shrinking once at pack time removes most of the per-epoch decode. It is lossy (one
//! more JPEG generation, and small random crops are upsampled from fewer pixels), so it is off
//! unless asked for, and never applied to images already within the limit.

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use jpeg_encoder::{ColorType, Encoder, SamplingFactor};

use crate::transform::decode::{decode_jpeg, jpeg_error};
use crate::transform::resize::resize_bytes;
use crate::Result;

/// Reusable buffers for [`downscale_jpeg`].
#[derive(Default)]
pub(crate) struct Downscaler {
    decoded: Vec<u8>,
    resized: Vec<u8>,
    resizer: Resizer,
}

/// The size of a `width` x `height` image whose longer side is scaled to `max_side`.
fn fit(width: u32, height: u32, max_side: u32) -> (u32, u32) {
    let scale = f64::from(max_side) / f64::from(width.max(height));
    let side = |s: u32| ((f64::from(s) * scale).round() as u32).clamp(1, max_side);
    (side(width), side(height))
}

impl Downscaler {
    /// `Some(new JPEG)` when `jpeg`'s longer side exceeds `max_side`, else `None` (keep it).
    pub(crate) fn downscale_jpeg(
        &mut self,
        jpeg: &[u8],
        max_side: u32,
        quality: u8,
    ) -> Result<Option<Vec<u8>>> {
        let img = decode_jpeg(jpeg, &mut self.decoded)?;
        if img.width.max(img.height) <= max_side {
            return Ok(None);
        }
        let (w, h) = fit(img.width, img.height, max_side);
        let (pixel_type, color) = match img.channels {
            1 => (PixelType::U8, ColorType::Luma),
            _ => (PixelType::U8x3, ColorType::Rgb),
        };
        let err = |e: &dyn std::fmt::Display| jpeg_error(format!("downscale: {e}"));
        let src =
            ImageRef::new(img.width, img.height, &self.decoded, pixel_type).map_err(|e| err(&e))?;
        let need = w as usize * h as usize * img.channels;
        self.resized.resize(need, 0);
        let mut dst =
            Image::from_slice_u8(w, h, &mut self.resized, pixel_type).map_err(|e| err(&e))?;
        let options = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear));
        resize_bytes(&mut self.resizer, &src, &mut dst, &options).map_err(|e| err(&e))?;
        let mut out = Vec::with_capacity(need / 8);
        let mut encoder = Encoder::new(&mut out, quality);
        encoder.set_sampling_factor(SamplingFactor::R_4_2_0);
        // `fit` keeps both sides <= max_side <= u16::MAX (checked by the packer).
        encoder
            .encode(&self.resized, w as u16, h as u16, color)
            .map_err(|e| err(&e))?;
        Ok(Some(out))
    }
}
