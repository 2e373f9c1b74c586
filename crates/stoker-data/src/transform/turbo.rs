//! The libjpeg-turbo decoder (Debian's `libturbojpeg0`, TurboJPEG 2 API, through the
//! `turbojpeg` 0.5 crate), with DCT-domain scaling.
//!
//! TurboJPEG's `tjDecompress2` scales when asked for smaller dimensions than the header's: it
//! picks the largest of its n/8 factors whose output fits. We ask for exactly `ceil(w / d)` x
//! `ceil(h / d)` with `d` in {1, 2, 4, 8}, which only the factor 1/`d` yields for images of
//! more than a few pixels (where another factor fits too, it gives the same size, so the
//! buffer and dimensions we report are right either way).

use turbojpeg::{Colorspace, Decompressor, Image, PixelFormat};

use super::decode::{Decoded, MAX_DIMENSION};

/// What the header says, when libjpeg-turbo can decode the image to RGB or grayscale.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Header {
    pub(crate) width: u32,
    pub(crate) height: u32,
    gray: bool,
}

/// Reads the header; `Err` when libjpeg-turbo cannot read it or cannot convert its colorspace
/// (CMYK, YCCK) to RGB, so the caller falls back to zune-jpeg.
pub(crate) fn header(dec: &mut Decompressor, jpeg: &[u8]) -> Result<Header, String> {
    let h = dec.read_header(jpeg).map_err(|e| e.to_string())?;
    let gray = match h.colorspace {
        Colorspace::Gray => true,
        Colorspace::YCbCr | Colorspace::RGB => false,
        other => return Err(format!("colorspace {other:?}")),
    };
    if h.width == 0 || h.height == 0 || h.width > MAX_DIMENSION || h.height > MAX_DIMENSION {
        return Err(format!(
            "dimensions {}x{} (expected 1..={MAX_DIMENSION})",
            h.width, h.height
        ));
    }
    Ok(Header {
        width: h.width as u32,
        height: h.height as u32,
        gray,
    })
}

/// Decodes `jpeg` (whose header is `h`) at 1/`reduction` scale into `buf` (grown when
/// needed): interleaved RGB, or one channel for grayscale files. Any libjpeg-turbo warning
/// (such as a premature end of data) fails the decode.
pub(crate) fn decode(
    dec: &mut Decompressor,
    jpeg: &[u8],
    h: Header,
    reduction: u32,
    buf: &mut Vec<u8>,
) -> Result<Decoded, String> {
    let (width, height) = (h.width.div_ceil(reduction), h.height.div_ceil(reduction));
    let (format, channels) = if h.gray {
        (PixelFormat::GRAY, 1)
    } else {
        (PixelFormat::RGB, 3)
    };
    let pitch = width as usize * channels;
    let n = pitch * height as usize;
    if buf.len() < n {
        buf.resize(n, 0);
    }
    let image = Image {
        pixels: &mut buf[..n],
        width: width as usize,
        pitch,
        height: height as usize,
        format,
    };
    dec.decompress(jpeg, image).map_err(|e| e.to_string())?;
    Ok(Decoded {
        width,
        height,
        channels,
    })
}
