//! The last pass: crop offset, flip, normalize and HWC -> CHW, fused into one walk over the
//! resized pixels.
//!
//! Normalization goes through a 256-entry table per channel, filled with exactly the arithmetic
//! torchvision does per pixel (`(v / 255 - mean) / std` in f32), so a solid-color image
//! normalizes bit-identically to it, and the bf16 table holds the f32 values rounded to nearest
//! even: bf16 output equals f32 output rounded, by construction.

use half::bf16;

use crate::DType;

/// Per-channel lookup tables from a u8 pixel value to its normalized output.
#[derive(Debug, Clone)]
pub(crate) struct NormalizeLut {
    f32: [[f32; 256]; 3],
    bf16: [[u16; 256]; 3],
}

impl NormalizeLut {
    /// Tables for `(v / 255 - mean[c]) / std[c]`.
    pub(crate) fn new(mean: [f32; 3], std: [f32; 3]) -> Self {
        let mut lut = NormalizeLut {
            f32: [[0.0; 256]; 3],
            bf16: [[0; 256]; 3],
        };
        for c in 0..3 {
            for v in 0..256 {
                let x = (v as f32 / 255.0 - mean[c]) / std[c];
                lut.f32[c][v] = x;
                lut.bf16[c][v] = bf16::from_f32(x).to_bits();
            }
        }
        lut
    }
}

/// Where the output window lies in the source pixels, and how to read it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Window {
    /// Source row stride in pixels.
    pub src_width: usize,
    /// Channels per source pixel: 1 (grayscale, replicated to 3) or 3 (RGB).
    pub channels: usize,
    /// First source row of the window.
    pub top: usize,
    /// First source column of the window.
    pub left: usize,
    /// Output height and width.
    pub size: usize,
    /// Mirror the window left-right.
    pub flip: bool,
}

/// Writes the `size` x `size` window of `src` (HWC u8) into `out` as CHW `dtype` (native
/// endian). `out` must hold exactly `3 * size * size * dtype.size()` bytes.
pub(crate) fn write_chw(src: &[u8], win: Window, lut: &NormalizeLut, dtype: DType, out: &mut [u8]) {
    match dtype {
        DType::BF16 => write_typed(src, win, &lut.bf16, out, |v: u16| v.to_ne_bytes()),
        _ => write_typed(src, win, &lut.f32, out, |v: f32| v.to_ne_bytes()),
    }
}

fn write_typed<T: Copy, const N: usize>(
    src: &[u8],
    win: Window,
    lut: &[[T; 256]; 3],
    out: &mut [u8],
    bytes: impl Fn(T) -> [u8; N],
) {
    let (size, ch) = (win.size, win.channels);
    let plane = size * size * N;
    for (c, out_plane) in out.chunks_exact_mut(plane).take(3).enumerate() {
        let table = &lut[c];
        let src_c = if ch == 1 { 0 } else { c };
        for (y, out_row) in out_plane.chunks_exact_mut(size * N).enumerate() {
            let start = ((win.top + y) * win.src_width + win.left) * ch;
            let row = &src[start..start + size * ch];
            for (x, o) in out_row.chunks_exact_mut(N).enumerate() {
                let sx = if win.flip { size - 1 - x } else { x };
                o.copy_from_slice(&bytes(table[row[sx * ch + src_c] as usize]));
            }
        }
    }
}
