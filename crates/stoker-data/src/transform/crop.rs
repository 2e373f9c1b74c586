//! Crop geometry: random-resized-crop sampling (train) and resize-then-center-crop (eval).
//!
//! The sampling follows the published RandomResizedCrop procedure of torchvision: up to ten
//! tries of an area fraction drawn uniformly from `scale` and an aspect ratio drawn log-uniformly
//! from `ratio`; a try is accepted when the box fits the image, at a uniformly drawn position;
//! after ten failures the largest centered box whose aspect ratio is clamped into `ratio` is used.
//! Rounding is half-to-even, as Python's `round`, so box sizes agree with torchvision's formulas.

use super::rng::SampleRng;

/// A crop box in pixels of the source image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CropBox {
    /// First row.
    pub top: u32,
    /// First column.
    pub left: u32,
    /// Rows in the box (>= 1).
    pub height: u32,
    /// Columns in the box (>= 1).
    pub width: u32,
}

/// Tries before the centered fallback, as torchvision.
const RRC_ATTEMPTS: usize = 10;

/// Samples a random-resized-crop box of a `width` x `height` image (both >= 1).
///
/// `scale` bounds the box's area as a fraction of the image's; `ratio` bounds its width/height.
pub fn random_resized_crop(
    width: u32,
    height: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
    rng: &mut SampleRng,
) -> CropBox {
    let area = width as f64 * height as f64;
    let (log_lo, log_hi) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..RRC_ATTEMPTS {
        let target_area = area * rng.uniform(scale.0, scale.1);
        let aspect = rng.uniform(log_lo, log_hi).exp();
        let w = (target_area * aspect).sqrt().round_ties_even();
        let h = (target_area / aspect).sqrt().round_ties_even();
        if w >= 1.0 && h >= 1.0 && w <= width as f64 && h <= height as f64 {
            let (w, h) = (w as u32, h as u32);
            let top = rng.below(u64::from(height - h) + 1) as u32;
            let left = rng.below(u64::from(width - w) + 1) as u32;
            return CropBox {
                top,
                left,
                height: h,
                width: w,
            };
        }
    }
    // Fallback: the whole image, narrowed to the nearest allowed aspect ratio, centered.
    let in_ratio = width as f64 / height as f64;
    let (w, h) = if in_ratio < ratio.0 {
        let h = (width as f64 / ratio.0).round_ties_even() as u32;
        (width, h.clamp(1, height))
    } else if in_ratio > ratio.1 {
        let w = (height as f64 * ratio.1).round_ties_even() as u32;
        (w.clamp(1, width), height)
    } else {
        (width, height)
    };
    CropBox {
        top: (height - h) / 2,
        left: (width - w) / 2,
        height: h,
        width: w,
    }
}

/// The size of a `width` x `height` image resized so its shorter side is `shorter`, the longer
/// side scaled in proportion and truncated (torchvision's `Resize(int)` rule).
pub fn resize_shorter_side(width: u32, height: u32, shorter: u32) -> (u32, u32) {
    let (w, h) = (u64::from(width), u64::from(height));
    let s = u64::from(shorter);
    if width <= height {
        (shorter, ((s * h) / w).max(1) as u32)
    } else {
        (((s * w) / h).max(1) as u32, shorter)
    }
}

/// The centered `size` x `size` box of a `width` x `height` image (both >= `size`); offsets
/// round half-to-even like torchvision's `CenterCrop`.
pub fn center_crop(width: u32, height: u32, size: u32) -> CropBox {
    let offset = |full: u32| ((f64::from(full) - f64::from(size)) / 2.0).round_ties_even() as u32;
    CropBox {
        top: offset(height),
        left: offset(width),
        height: size,
        width: size,
    }
}

/// DCT-domain reductions libjpeg-turbo decodes at (as PIL's `Image.draft`), largest first.
const DCT_REDUCTIONS: [u32; 3] = [8, 4, 2];

/// The largest reduction `d` in {8, 4, 2, 1} such that `crop`, decoded at 1/`d` scale, still
/// spans at least `dst_w` x `dst_h` pixels: the bilinear resize then only shrinks, as at full
/// scale, so no detail the output can show is dropped before it.
///
/// Quality trade-off: libjpeg-turbo's reduced IDCTs (`jidctred.c`) output the mean of each
/// d x d group of the pixels a full IDCT would give (1/8: the block's DC), so the decode is a
/// box-filter downscale by d, and the bilinear (antialiased) resize then shrinks the rest of
/// the way. The full path filters the whole reduction with the wider triangle filter, so the
/// scaled path passes a little more detail near the output's Nyquist limit (slightly sharper,
/// slightly more aliasing), and chroma is upsampled at the reduced size. On the benchmark
/// photos this moves output pixels by 0.5-0.75 levels on average (a few at edges; bounded in
/// `tests/image.rs`), not the content, and the decode skips most of its IDCT, upsampling and
/// color conversion work (at 1/8 on progressive files also the AC scans: see `scans.rs`).
pub fn dct_reduction(crop: CropBox, dst_w: u32, dst_h: u32) -> u32 {
    let fits = |d: u32| {
        u64::from(crop.width) >= u64::from(dst_w) * u64::from(d)
            && u64::from(crop.height) >= u64::from(dst_h) * u64::from(d)
    };
    DCT_REDUCTIONS.into_iter().find(|&d| fits(d)).unwrap_or(1)
}
