//! The image pipeline: decode -> crop (random-resized or center) -> bilinear resize -> flip,
//! normalize and CHW in one pass, into a caller-owned output slice.
//!
//! Costs on a typical photo are dominated by the JPEG decode; the resize touches only the crop
//! (train) and the final pass touches only the output window. All buffers live in
//! [`ImageScratch`], one per worker, so steady state allocates nothing of ours (zune-jpeg still
//! allocates its per-image component planes internally).

use fast_image_resize::images::{CroppedImage, Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use super::config::{ImageTransformConfig, TransformMode};
use super::crop::{center_crop, random_resized_crop, resize_shorter_side, CropBox};
use super::decode::{decode_jpeg, jpeg_error, Decoded};
use super::normalize::{write_chw, NormalizeLut, Window};
use super::rng::SampleRng;
use crate::{DataError, Result};

/// Per-worker reusable buffers: the decoded image, the resized crop and the resizer's own
/// scratch. Create one per worker thread and pass it to every [`ImagePipeline::apply`].
#[derive(Default)]
pub struct ImageScratch {
    decoded: Vec<u8>,
    resized: Vec<u8>,
    resizer: Resizer,
}

impl std::fmt::Debug for ImageScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageScratch")
            .field("decoded_bytes", &self.decoded.len())
            .field("resized_bytes", &self.resized.len())
            .finish()
    }
}

/// A validated [`ImageTransformConfig`] with its normalization tables precomputed.
#[derive(Debug, Clone)]
pub struct ImagePipeline {
    config: ImageTransformConfig,
    lut: NormalizeLut,
}

impl ImagePipeline {
    /// Validates `config` and precomputes the normalization tables.
    pub fn new(config: ImageTransformConfig) -> Result<Self> {
        config.validate()?;
        let lut = NormalizeLut::new(config.mean, config.std);
        Ok(ImagePipeline { config, lut })
    }

    /// The configuration.
    pub fn config(&self) -> &ImageTransformConfig {
        &self.config
    }

    /// Bytes `apply` writes: 3 x size x size elements of the output dtype.
    pub fn output_bytes(&self) -> usize {
        self.config.output_bytes()
    }

    /// Decodes `jpeg` and writes the transformed `[3, size, size]` image into `out` (CHW,
    /// native-endian f32 or bf16). Train-mode randomness comes from `seed` alone (use
    /// `SampleContext::sample_seed()`), so equal seeds give bit-identical outputs.
    pub fn apply(
        &self,
        jpeg: &[u8],
        seed: u64,
        scratch: &mut ImageScratch,
        out: &mut [u8],
    ) -> Result<()> {
        self.check_out(out)?;
        let decoded = decode_jpeg(jpeg, &mut scratch.decoded)?;
        let ImageScratch {
            decoded: pixels,
            resized,
            resizer,
        } = scratch;
        self.transform(pixels, decoded, seed, resized, resizer, out)
    }

    /// As [`apply`](Self::apply) from already decoded HWC u8 pixels (`channels` 1 or 3): for
    /// callers with their own decoder, and for testing the geometry apart from the decoder.
    pub fn apply_pixels(
        &self,
        pixels: &[u8],
        decoded: Decoded,
        seed: u64,
        scratch: &mut ImageScratch,
        out: &mut [u8],
    ) -> Result<()> {
        self.check_out(out)?;
        let need = decoded.width as usize * decoded.height as usize * decoded.channels;
        if !matches!(decoded.channels, 1 | 3) || decoded.width == 0 || decoded.height == 0 {
            return Err(DataError::Shape(format!(
                "pixels: {decoded:?} (expected width, height >= 1 and 1 or 3 channels)"
            )));
        }
        if pixels.len() < need {
            return Err(DataError::Shape(format!(
                "pixels: {} bytes for {decoded:?} (expected {need})",
                pixels.len()
            )));
        }
        let ImageScratch {
            resized, resizer, ..
        } = scratch;
        self.transform(pixels, decoded, seed, resized, resizer, out)
    }

    /// The crop box and flip train mode draws from `seed` for a `width` x `height` image.
    pub fn train_params(&self, width: u32, height: u32, seed: u64) -> (CropBox, bool) {
        let mut rng = SampleRng::new(seed);
        let crop = random_resized_crop(
            width,
            height,
            self.config.scale,
            self.config.ratio,
            &mut rng,
        );
        let flip = rng.next_f64() < self.config.hflip_prob;
        (crop, flip)
    }

    fn check_out(&self, out: &[u8]) -> Result<()> {
        if out.len() != self.output_bytes() {
            return Err(DataError::Shape(format!(
                "image output: {} bytes (expected 3 x {} x {} x {} = {})",
                out.len(),
                self.config.size,
                self.config.size,
                self.config.dtype.size(),
                self.output_bytes()
            )));
        }
        Ok(())
    }

    fn transform(
        &self,
        pixels: &[u8],
        img: Decoded,
        seed: u64,
        resized: &mut Vec<u8>,
        resizer: &mut Resizer,
        out: &mut [u8],
    ) -> Result<()> {
        let size = self.config.size;
        let (crop, dst_w, dst_h, window, flip) = match self.config.mode {
            TransformMode::Train => {
                let (crop, flip) = self.train_params(img.width, img.height, seed);
                (
                    crop,
                    size,
                    size,
                    CropBox {
                        top: 0,
                        left: 0,
                        height: size,
                        width: size,
                    },
                    flip,
                )
            }
            TransformMode::Eval => {
                let whole = CropBox {
                    top: 0,
                    left: 0,
                    height: img.height,
                    width: img.width,
                };
                let (w, h) = resize_shorter_side(img.width, img.height, self.config.eval_resize());
                (whole, w, h, center_crop(w, h, size), false)
            }
        };
        resize_crop(pixels, img, crop, dst_w, dst_h, resized, resizer)?;
        let win = Window {
            src_width: dst_w as usize,
            channels: img.channels,
            top: window.top as usize,
            left: window.left as usize,
            size: size as usize,
            flip,
        };
        write_chw(resized, win, &self.lut, self.config.dtype, out);
        Ok(())
    }
}

/// Bilinear (antialiased when shrinking) resize of `crop` of `pixels` to `dst_w` x `dst_h`
/// into `resized`; the crop is resized as an image of its own, as crop-then-resize does.
fn resize_crop(
    pixels: &[u8],
    img: Decoded,
    crop: CropBox,
    dst_w: u32,
    dst_h: u32,
    resized: &mut Vec<u8>,
    resizer: &mut Resizer,
) -> Result<()> {
    let pixel_type = if img.channels == 1 {
        PixelType::U8
    } else {
        PixelType::U8x3
    };
    let err = |what: &str, e: &dyn std::fmt::Display| jpeg_error(format!("{what}: {e}"));
    let src = ImageRef::new(img.width, img.height, pixels, pixel_type)
        .map_err(|e| err("decoded image", &e))?;
    let cropped = CroppedImage::new(&src, crop.left, crop.top, crop.width, crop.height)
        .map_err(|e| err("crop box", &e))?;
    let need = dst_w as usize * dst_h as usize * img.channels;
    if resized.len() < need {
        resized.resize(need, 0);
    }
    let mut dst = Image::from_slice_u8(dst_w, dst_h, &mut resized[..need], pixel_type)
        .map_err(|e| err("resize buffer", &e))?;
    let options = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear));
    resizer
        .resize(&cropped, &mut dst, &options)
        .map_err(|e| err("resize", &e))
}
