//! The structural JPEG check run before either decoder: SOI first, marker segments and
//! entropy-coded scans walked, EOI required.

use super::decode::jpeg_error;
use crate::Result;

/// Checks the SOI marker and [`check_structure`], naming what is wrong.
pub(crate) fn validate(jpeg: &[u8]) -> Result<()> {
    if jpeg.len() < 4 || jpeg[0] != 0xFF || jpeg[1] != 0xD8 {
        return Err(jpeg_error(format!(
            "not a JPEG: expected the SOI marker FF D8, found {:02X?} ({} bytes)",
            &jpeg[..jpeg.len().min(2)],
            jpeg.len()
        )));
    }
    check_structure(jpeg).map_err(|m| jpeg_error(format!("corrupt JPEG structure: {m}")))
}

/// Walks the marker segments and entropy-coded scans from SOI and requires an EOI marker.
/// Segment lengths are trusted (as decoders do), a bad one shows up as a missing EOI or a
/// decode error.
///
/// zune-jpeg pads a truncated stream and may return a partly grey image without an error (and
/// libjpeg-turbo only warns); a truncated file must be an error instead. Scans are skipped with memchr (inside them a 0xFF
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
