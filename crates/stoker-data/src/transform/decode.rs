//! JPEG decoding with zune-jpeg into a reused buffer.
//!
//! zune-jpeg runs its SIMD paths (AVX2/SSE) at default options and has been fuzzed; we keep its
//! strict mode, so a truncated or non-conforming stream is an error rather than a grey-padded
//! image. As a last line of defence a decoder panic is caught and returned as an error.

use zune_jpeg::zune_core::bytestream::ZCursor;
use zune_jpeg::zune_core::colorspace::ColorSpace;
use zune_jpeg::zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

use crate::{DataError, Result};

/// Largest width or height accepted (a bound on the decode buffer for hostile headers).
pub const MAX_DIMENSION: usize = 16384;

/// Size and layout of a decoded image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoded {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Interleaved channels per pixel: 1 (grayscale) or 3 (RGB).
    pub channels: usize,
}

/// An error about JPEG bytes that have no file name yet; the dataset replaces the placeholder
/// path with the shard's data file and the record index.
pub(crate) fn jpeg_error(message: impl Into<String>) -> DataError {
    DataError::format(IN_MEMORY, "jpeg", message)
}

/// The placeholder path of [`jpeg_error`].
pub(crate) const IN_MEMORY: &str = "<jpeg bytes>";

/// Decodes `jpeg` into `buf` (grown when needed, never shrunk) as interleaved RGB. zune-jpeg
/// 0.5 expands grayscale and converts CMYK/YCCK to RGB itself; a 1-channel result (older
/// decoders) is accepted too and replicated to 3 channels by the last pass.
pub fn decode_jpeg(jpeg: &[u8], buf: &mut Vec<u8>) -> Result<Decoded> {
    if jpeg.len() < 4 || jpeg[0] != 0xFF || jpeg[1] != 0xD8 {
        return Err(jpeg_error(format!(
            "not a JPEG: expected the SOI marker FF D8, found {:02X?} ({} bytes)",
            &jpeg[..jpeg.len().min(2)],
            jpeg.len()
        )));
    }
    check_structure(jpeg).map_err(|m| jpeg_error(format!("corrupt JPEG structure: {m}")))?;
    let options = DecoderOptions::default()
        .jpeg_set_out_colorspace(ColorSpace::RGB)
        .set_max_width(MAX_DIMENSION)
        .set_max_height(MAX_DIMENSION);
    let run = || -> std::result::Result<Decoded, String> {
        let mut decoder = JpegDecoder::new_with_options(ZCursor::new(jpeg), options);
        decoder
            .decode_headers()
            .map_err(|e| format!("corrupt JPEG header: {e:?}"))?;
        let (w, h) = decoder.dimensions().ok_or("no dimensions after header")?;
        let channels = decoder
            .output_colorspace()
            .ok_or("no colorspace after header")?
            .num_components();
        if channels != 1 && channels != 3 {
            return Err(format!(
                "unsupported output colorspace with {channels} channels"
            ));
        }
        if w == 0 || h == 0 {
            return Err(format!("empty image {w}x{h}"));
        }
        let n = decoder
            .output_buffer_size()
            .ok_or("no output size after header")?;
        if buf.len() < n {
            buf.resize(n, 0);
        }
        decoder
            .decode_into(&mut buf[..n])
            .map_err(|e| format!("corrupt JPEG data: {e:?}"))?;
        Ok(Decoded {
            width: w as u32,
            height: h as u32,
            channels,
        })
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(Ok(decoded)) => Ok(decoded),
        Ok(Err(message)) => Err(jpeg_error(message)),
        Err(_) => Err(jpeg_error("the JPEG decoder panicked on this input")),
    }
}

/// Walks the marker segments and entropy-coded scans from SOI and requires an EOI marker.
/// Segment lengths are trusted (as decoders do), a bad one shows up as a missing EOI or a
/// decode error.
///
/// zune-jpeg pads a truncated stream and may return a partly grey image without an error; a
/// truncated file must be an error instead. Scans are skipped with memchr (inside them a 0xFF
/// byte is always followed by 0x00 or a restart marker), so the walk costs a few percent of the
/// decode. Bytes after EOI (some cameras append data) are accepted.
fn check_structure(jpeg: &[u8]) -> std::result::Result<(), String> {
    let n = jpeg.len();
    let truncated = || format!("truncated: no end-of-image marker (FF D9) in {n} bytes");
    let mut i = 2;
    loop {
        // Stray bytes between segments: libjpeg warns and skips to the next 0xFF; so do we.
        match jpeg.get(i..).and_then(|rest| memchr::memchr(0xFF, rest)) {
            None => return Err(truncated()),
            Some(skip) => i += skip,
        }
        while jpeg.get(i) == Some(&0xFF) {
            i += 1; // fill bytes before a marker
        }
        let marker = *jpeg.get(i).ok_or_else(truncated)?;
        i += 1;
        match marker {
            0xD9 => return Ok(()),
            0x00 | 0x01 | 0xD0..=0xD7 => continue, // stuffing, TEM, RSTn: no segment
            0xD8 => {
                return Err(format!(
                    "unexpected marker FF {marker:02X} at byte {}",
                    i - 2
                ))
            }
            _ => {}
        }
        let len = match jpeg.get(i..i + 2) {
            Some(b) => usize::from(u16::from_be_bytes([b[0], b[1]])),
            None => return Err(truncated()),
        };
        if len < 2 {
            return Err(format!(
                "segment FF {marker:02X} at byte {} has length {len}",
                i - 2
            ));
        }
        i += len;
        if marker == 0xDA {
            // Entropy-coded data runs to the next marker that is neither stuffing nor RSTn.
            loop {
                let at = i + memchr::memchr(0xFF, jpeg.get(i..).ok_or_else(truncated)?)
                    .ok_or_else(truncated)?;
                match jpeg.get(at + 1) {
                    None => return Err(truncated()),
                    Some(0x00 | 0xD0..=0xD7) => i = at + 2,
                    Some(_) => {
                        i = at;
                        break;
                    }
                }
            }
        }
    }
}
