//! The image pipeline: decode -> crop (random-resized or center) -> bilinear resize -> flip,
//! normalize and CHW in one pass, into a caller-owned output slice.
//!
//! Costs on a typical photo are dominated by the JPEG decode. The crop is drawn from the full
//! size in the header, then libjpeg-turbo decodes at the largest DCT reduction that keeps the
//! crop at least the output size ([`dct_reduction`]); the resize touches only the crop (train)
//! and the final pass touches only the output window. All buffers live in [`ImageScratch`],
//! one per worker, so steady state allocates nothing of ours (the decoders still allocate their
//! per-image working memory internally).

use fast_image_resize::images::{CroppedImage, Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use super::config::{ImageTransformConfig, TransformMode};
use super::crop::{center_crop, dct_reduction, random_resized_crop, resize_shorter_side, CropBox};
use super::decode::{jpeg_error, Decoded, JpegDecoder};
use super::normalize::{write_chw, NormalizeLut, Window};
use super::resize::resize_bytes;
use super::rng::SampleRng;
use crate::{DataError, Result};

/// Per-worker reusable state: the JPEG decoder, the decoded image, the resized crop and the
/// resizer's own scratch. Create one per worker thread and pass it to every
/// [`ImagePipeline::apply`].
#[derive(Default)]
pub struct ImageScratch {
    jpeg: JpegDecoder,
    decoded: Vec<u8>,
    resized: Vec<u8>,
    resizer: Resizer,
}

impl std::fmt::Debug for ImageScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageScratch")
            .field("jpeg", &self.jpeg)
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
        let ImageScratch {
            jpeg: decoder,
            decoded: pixels,
            resized,
            resizer,
        } = scratch;
        decoder.set_backend(self.config.decoder);
        let header = decoder.header(jpeg)?;
        let (decoded, geometry) = match header.size {
            Some((width, height)) => {
                let mut geometry = self.geometry(width, height, seed);
                if self.config.dct_scaling {
                    geometry.reduction =
                        dct_reduction(geometry.crop, geometry.dst_w, geometry.dst_h);
                }
                let decoded = decoder.decode(jpeg, header, geometry.reduction, pixels)?;
                (decoded, geometry)
            }
            None => {
                let decoded = decoder.decode(jpeg, header, 1, pixels)?;
                (decoded, self.geometry(decoded.width, decoded.height, seed))
            }
        };
        self.transform(pixels, decoded, &geometry, resized, resizer, out)
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
        let geometry = self.geometry(decoded.width, decoded.height, seed);
        self.transform(pixels, decoded, &geometry, resized, resizer, out)
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

    /// Where the output comes from in a `width` x `height` image (full size, from the header).
    fn geometry(&self, width: u32, height: u32, seed: u64) -> Geometry {
        let size = self.config.size;
        match self.config.mode {
            TransformMode::Train => {
                let (crop, flip) = self.train_params(width, height, seed);
                Geometry {
                    full: (width, height),
                    crop,
                    dst_w: size,
                    dst_h: size,
                    window: CropBox {
                        top: 0,
                        left: 0,
                        height: size,
                        width: size,
                    },
                    flip,
                    reduction: 1,
                }
            }
            TransformMode::Eval => {
                let (w, h) = resize_shorter_side(width, height, self.config.eval_resize());
                Geometry {
                    full: (width, height),
                    crop: CropBox {
                        top: 0,
                        left: 0,
                        height,
                        width,
                    },
                    dst_w: w,
                    dst_h: h,
                    window: center_crop(w, h, size),
                    flip: false,
                    reduction: 1,
                }
            }
        }
    }

    /// Resizes the geometry's crop of `pixels` (decoded at full size or reduced) and writes the
    /// output window, flipped and normalized, into `out`.
    fn transform(
        &self,
        pixels: &[u8],
        img: Decoded,
        g: &Geometry,
        resized: &mut Vec<u8>,
        resizer: &mut Resizer,
        out: &mut [u8],
    ) -> Result<()> {
        resize_crop(pixels, img, g, resized, resizer)?;
        let win = Window {
            src_width: g.dst_w as usize,
            channels: img.channels,
            top: g.window.top as usize,
            left: g.window.left as usize,
            size: self.config.size as usize,
            flip: g.flip,
        };
        write_chw(resized, win, &self.lut, self.config.dtype, out);
        Ok(())
    }
}

/// One sample's geometry in full-size pixels: the crop, the size it is resized to, the output
/// window of that and the flip.
struct Geometry {
    /// The image's full size (width, height), which `crop` refers to.
    full: (u32, u32),
    crop: CropBox,
    dst_w: u32,
    dst_h: u32,
    window: CropBox,
    flip: bool,
    /// The DCT reduction the decode was asked for (1 = full size).
    reduction: u32,
}

/// Bilinear (antialiased when shrinking) resize of the geometry's crop of `pixels` to
/// `dst_w` x `dst_h` into `resized`; the crop is resized as an image of its own, as
/// crop-then-resize does. When `img` was decoded at 1/d scale, the full-size crop box is divided
/// by d (fractional coordinates): scaled pixel i covers full-size pixels d*i .. d*i + d, as each
/// 8x8 DCT block becomes an (8/d)x(8/d) block.
fn resize_crop(
    pixels: &[u8],
    img: Decoded,
    g: &Geometry,
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
    let need = g.dst_w as usize * g.dst_h as usize * img.channels;
    if resized.len() < need {
        resized.resize(need, 0);
    }
    let mut dst = Image::from_slice_u8(g.dst_w, g.dst_h, &mut resized[..need], pixel_type)
        .map_err(|e| err("resize buffer", &e))?;
    let options = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear));
    let c = g.crop;
    if (img.width, img.height) == g.full {
        let cropped = CroppedImage::new(&src, c.left, c.top, c.width, c.height)
            .map_err(|e| err("crop box", &e))?;
        return resize_bytes(resizer, &cropped, &mut dst, &options).map_err(|e| err("resize", &e));
    }
    let d = g.reduction;
    if (img.width, img.height) != (g.full.0.div_ceil(d), g.full.1.div_ceil(d)) {
        return Err(jpeg_error(format!(
            "decoded {}x{} is neither the full {}x{} nor its 1/{d} scale",
            img.width, img.height, g.full.0, g.full.1
        )));
    }
    let d = f64::from(d);
    let options = options.crop(
        f64::from(c.left) / d,
        f64::from(c.top) / d,
        f64::from(c.width) / d,
        f64::from(c.height) / d,
    );
    resize_bytes(resizer, &src, &mut dst, &options).map_err(|e| err("resize", &e))
}
