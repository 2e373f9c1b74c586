//! The zune-jpeg decoder (pure Rust, strict mode): the [`JpegBackend::Zune`] backend and the
//! fallback for files libjpeg-turbo refuses.
//!
//! [`JpegBackend::Zune`]: super::config::JpegBackend::Zune

use zune_jpeg::zune_core::bytestream::ZCursor;
use zune_jpeg::zune_core::colorspace::ColorSpace;
use zune_jpeg::zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

use super::decode::{Decoded, MAX_DIMENSION};

/// Decodes `jpeg` at full size into `buf` (grown when needed) as interleaved RGB. zune-jpeg 0.5
/// expands grayscale and converts CMYK/YCCK to RGB itself; a 1-channel result (older
/// decoders) is accepted too and replicated to 3 channels by the pipeline's last pass.
pub(crate) fn decode(jpeg: &[u8], buf: &mut Vec<u8>) -> Result<Decoded, String> {
    let options = DecoderOptions::default()
        .jpeg_set_out_colorspace(ColorSpace::RGB)
        .set_max_width(MAX_DIMENSION)
        .set_max_height(MAX_DIMENSION);
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
}
