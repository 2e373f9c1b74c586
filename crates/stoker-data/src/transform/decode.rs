//! JPEG decoding into a reused buffer: libjpeg-turbo (with DCT-domain scaling) or zune-jpeg.
//!
//! Both decoders run behind the same structural check (SOI, segments, EOI), so a truncated
//! stream is an error rather than a grey-padded image. zune-jpeg keeps its strict mode;
//! libjpeg-turbo fails on any warning, which also catches a stream cut short mid-scan even when
//! an EOI marker follows (zune-jpeg accepts that one). Files whose header libjpeg-turbo cannot
//! use (CMYK/YCCK, chroma subsampling its TurboJPEG 2 API cannot name) are decoded by zune-jpeg
//! at full size instead. As a last line of defence a decoder panic is caught and returned as an
//! error.

use turbojpeg::Decompressor;

use super::config::JpegBackend;
use super::{scans, structure, turbo, zune};
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

/// Decodes `jpeg` at full size into `buf` (grown when needed, never shrunk) as interleaved RGB
/// (or one channel for grayscale files) with libjpeg-turbo, falling back to zune-jpeg.
pub fn decode_jpeg(jpeg: &[u8], buf: &mut Vec<u8>) -> Result<Decoded> {
    let mut decoder = JpegDecoder::new(JpegBackend::LibjpegTurbo);
    let header = decoder.header(jpeg)?;
    decoder.decode(jpeg, header, 1, buf)
}

/// A JPEG's size from its header, read before decoding so the crop can be drawn from the full
/// image and the decode scaled to it.
#[derive(Debug, Clone, Copy)]
pub struct JpegHeader {
    /// Full width in pixels, or `None` when only zune-jpeg can read the file (it is then
    /// decoded at full size and the size known afterwards).
    pub size: Option<(u32, u32)>,
    turbo: Option<turbo::Header>,
}

/// One worker's decoder: the backend and libjpeg-turbo's handle, created on first use and
/// reused (it holds libjpeg's state and buffers).
pub struct JpegDecoder {
    backend: JpegBackend,
    turbo: Option<Decompressor>,
    /// A progressive stream without its AC scans, for 1/8-scale decodes ([`scans::dc_only`]).
    dc_stream: Vec<u8>,
}

impl std::fmt::Debug for JpegDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JpegDecoder")
            .field("backend", &self.backend)
            .field("turbo_handle", &self.turbo.is_some())
            .field("dc_stream_bytes", &self.dc_stream.len())
            .finish()
    }
}

impl Default for JpegDecoder {
    /// libjpeg-turbo, the default backend.
    fn default() -> Self {
        JpegDecoder::new(JpegBackend::LibjpegTurbo)
    }
}

impl JpegDecoder {
    /// A decoder for `backend`; no library state is created until the first image.
    pub fn new(backend: JpegBackend) -> Self {
        JpegDecoder {
            backend,
            turbo: None,
            dc_stream: Vec::new(),
        }
    }

    /// The backend.
    pub fn backend(&self) -> JpegBackend {
        self.backend
    }

    /// Switches the backend (keeping libjpeg-turbo's handle for later).
    pub fn set_backend(&mut self, backend: JpegBackend) {
        self.backend = backend;
    }

    /// Checks the stream's structure (SOI ... EOI) and reads its header.
    pub fn header(&mut self, jpeg: &[u8]) -> Result<JpegHeader> {
        structure::validate(jpeg)?;
        if self.backend == JpegBackend::Zune {
            return Ok(JpegHeader {
                size: None,
                turbo: None,
            });
        }
        let handle = match &mut self.turbo {
            Some(handle) => handle,
            slot => slot.insert(Decompressor::new().map_err(|e| {
                jpeg_error(format!("cannot create a libjpeg-turbo decompressor: {e}"))
            })?),
        };
        let header = guard(|| Ok(turbo::header(handle, jpeg).ok()))?;
        Ok(JpegHeader {
            size: header.map(|h| (h.width, h.height)),
            turbo: header,
        })
    }

    /// Decodes `jpeg` (whose [`header`](Self::header) is `header`) at 1/`reduction` scale
    /// (1, 2, 4 or 8; honoured by libjpeg-turbo only) into `buf`, grown when needed. The
    /// returned size is the decoded one: full size whenever zune-jpeg did the decoding. A
    /// libjpeg-turbo failure after a good header is an error, not a retry with zune-jpeg. At
    /// 1/8 a progressive stream is decoded from its DC scans alone (same pixels, a fraction of
    /// the entropy decoding; see [`scans`]).
    pub fn decode(
        &mut self,
        jpeg: &[u8],
        header: JpegHeader,
        reduction: u32,
        buf: &mut Vec<u8>,
    ) -> Result<Decoded> {
        if !matches!(reduction, 1 | 2 | 4 | 8) {
            return Err(jpeg_error(format!(
                "DCT reduction {reduction} (expected 1, 2, 4 or 8)"
            )));
        }
        if let (Some(h), Some(handle)) = (header.turbo, self.turbo.as_mut()) {
            let stream = if reduction == 8 && scans::dc_only(jpeg, &mut self.dc_stream) {
                &self.dc_stream[..]
            } else {
                jpeg
            };
            return guard(|| {
                turbo::decode(handle, stream, h, reduction, buf).map_err(|e| {
                    format!(
                        "libjpeg-turbo: {e}\nHINT: a corrupt or truncated stream; if the file \
                         is known good, zune-jpeg decodes some streams libjpeg-turbo warns \
                         about (`data.jpeg_decoder = \"zune\"` in a run's config)"
                    )
                })
            });
        }
        guard(|| zune::decode(jpeg, buf))
    }
}

/// Runs a decoder, turning its error message or a panic into a [`DataError`].
fn guard<T>(run: impl FnOnce() -> std::result::Result<T, String>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(message)) => Err(jpeg_error(message)),
        Err(_) => Err(jpeg_error("the JPEG decoder panicked on this input")),
    }
}
