//! Lean progressive streams for 1/8-scale decodes.
//!
//! A progressive JPEG sends each coefficient band in its own scans, and libjpeg-turbo
//! entropy-decodes every scan even when it then scales by 1/8, where the IDCT of a full-size
//! component reads nothing but the DC coefficient (each output pixel is DC / 8, the mean of its
//! 8x8 block). On large progressive photos that entropy decoding is most of the decode. So for
//! a 1/8 decode we hand libjpeg-turbo a copy of the stream with every DC scan (first and
//! refinement, so the DC coefficients are exact) and, of each component it decodes with a 1x1
//! IDCT, only the first AC scan. Chroma subsampled by 2 in both directions is decoded with a
//! 2x2 IDCT instead (libjpeg-turbo scales it up in the DCT domain), which reads AC
//! coefficients, so all its scans stay.
//!
//! The first AC scan stays because libjpeg-turbo (2.1) smooths the DC values themselves when a
//! component has no AC data at all (its progressive preview smoothing); with one AC scan it
//! only estimates AC values, which a 1x1 IDCT ignores. Dropping only later scans of a
//! component keeps the progression consistent (no kept scan refines a dropped one). The pixels
//! are the same as from the whole stream: a unit test checks this bit for bit against the
//! linked library. On the two large benchmark photos (libjpeg's standard scan script, chroma
//! subsampled 3x3, so every component is 1x1) about 80% of the bytes are skipped and their 1/8
//! decode is 4-5x faster. Only 1/8 decodes use this: at 1/2 and 1/4 the IDCT reads AC too.

/// Writes into `out` the progressive `jpeg` without the AC scans a 1/8 decode can skip (see
/// the module docs) and returns true; returns false (leaving `out` unspecified) for a
/// sequential JPEG, a stream with nothing to drop, or a structure the walk does not follow
/// (the caller then decodes `jpeg` itself). Expects a stream that passed the structural check.
pub(crate) fn dc_only(jpeg: &[u8], out: &mut Vec<u8>) -> bool {
    out.clear();
    let (mut progressive, mut dropped) = (false, false);
    let mut has_ac: Vec<u8> = Vec::new(); // component ids whose first AC scan was kept
    let mut one_by_one: Vec<u8> = Vec::new(); // component ids libjpeg-turbo decodes at 1x1
    let mut copied = 0; // jpeg[copied..] is not yet in `out`
    let mut i = 2;
    loop {
        match jpeg.get(i..).and_then(|rest| memchr::memchr(0xFF, rest)) {
            None => return false,
            Some(skip) => i += skip,
        }
        let start = i;
        while jpeg.get(i) == Some(&0xFF) {
            i += 1;
        }
        let Some(&marker) = jpeg.get(i) else {
            return false;
        };
        i += 1;
        match marker {
            0xD9 => {
                out.extend_from_slice(&jpeg[copied..i]);
                return progressive && dropped;
            }
            0x00 | 0x01 | 0xD0..=0xD7 => continue,
            _ => {}
        }
        let Some(len) = jpeg
            .get(i..i + 2)
            .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
        else {
            return false;
        };
        let Some(segment) = jpeg.get(i + 2..i + len.max(2)) else {
            return false;
        };
        i += len.max(2);
        match marker {
            0xC2 | 0xCA => {
                // Progressive (Huffman or arithmetic). At 1/8 libjpeg-turbo gives a component a
                // 1x1 IDCT unless it is subsampled by 2 in both directions, which it upscales
                // with a 2x2 IDCT (reading AC coefficients) instead of upsampling.
                progressive = true;
                let comps: Vec<(u8, u8, u8)> = segment
                    .get(6..)
                    .unwrap_or(&[])
                    .chunks_exact(3)
                    .take(usize::from(*segment.get(5).unwrap_or(&0)))
                    .map(|c| (c[0], (c[1] >> 4).max(1), (c[1] & 15).max(1)))
                    .collect();
                let max_h = comps.iter().map(|c| c.1).max().unwrap_or(1);
                let max_v = comps.iter().map(|c| c.2).max().unwrap_or(1);
                one_by_one = comps
                    .iter()
                    .filter(|&&(_, h, v)| max_h % (2 * h) != 0 || max_v % (2 * v) != 0)
                    .map(|c| c.0)
                    .collect();
            }
            0xC0 | 0xC1 | 0xC3 | 0xC5..=0xC7 | 0xC9 | 0xCB | 0xCD..=0xCF => return false,
            0xDA => {
                let ns = usize::from(*segment.first().unwrap_or(&0));
                let (Some(&component), Some(&ss)) = (segment.get(1), segment.get(1 + 2 * ns))
                else {
                    return false;
                };
                // Entropy-coded data runs to the next marker that is neither stuffing nor RSTn.
                loop {
                    let Some(at) = jpeg.get(i..).and_then(|rest| memchr::memchr(0xFF, rest)) else {
                        return false;
                    };
                    match jpeg.get(i + at + 1) {
                        None => return false,
                        Some(0x00 | 0xD0..=0xD7) => i += at + 2,
                        Some(_) => {
                            i += at;
                            break;
                        }
                    }
                }
                // AC scans of a progressive JPEG hold exactly one component.
                if progressive && ss > 0 {
                    if ns != 1 {
                        return false;
                    }
                    if !one_by_one.contains(&component) {
                        // Read by a larger IDCT: keep every scan.
                    } else if has_ac.contains(&component) {
                        out.extend_from_slice(&jpeg[copied..start]);
                        copied = i;
                        dropped = true;
                    } else {
                        has_ac.push(component);
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use jpeg_encoder::{ColorType, Encoder, SamplingFactor};
    use turbojpeg::Decompressor;

    use super::super::turbo;
    use super::dc_only;

    fn textured(progressive: bool, sampling: SamplingFactor) -> Vec<u8> {
        let (w, h) = (203u16, 150u16);
        let mut px = Vec::new();
        for y in 0..usize::from(h) {
            for x in 0..usize::from(w) {
                px.extend([
                    (x * 255 / 203) as u8,
                    (y * 255 / 150) as u8,
                    ((x ^ y) * 8) as u8,
                ]);
            }
        }
        let mut out = Vec::new();
        let mut enc = Encoder::new(&mut out, 90);
        enc.set_sampling_factor(sampling);
        enc.set_progressive(progressive);
        enc.encode(&px, w, h, ColorType::Rgb).unwrap();
        out
    }

    /// `progressive.jpg`: the XOR texture of `tests/image.rs` at 203x150, saved by PIL with
    /// `quality=90, progressive=True` (libjpeg's standard scan script, 4:2:0).
    const PIL_PROGRESSIVE: &[u8] = include_bytes!("../../tests/fixtures/image/progressive.jpg");

    /// The lean stream decodes at 1/8 to the very bytes the whole stream does, for libjpeg's
    /// scan script (PIL) and jpeg-encoder's (4:4:4 and 4:2:0).
    #[test]
    fn lean_stream_decodes_bit_identically_at_one_eighth() {
        let streams = [
            ("PIL", PIL_PROGRESSIVE.to_vec()),
            (
                "jpeg-encoder 4:4:4",
                textured(true, SamplingFactor::R_4_4_4),
            ),
            (
                "jpeg-encoder 4:2:0",
                textured(true, SamplingFactor::R_4_2_0),
            ),
        ];
        for (sampling, jpeg) in streams {
            let mut dc = Vec::new();
            assert!(dc_only(&jpeg, &mut dc), "{sampling}");
            assert!(
                dc.len() < jpeg.len(),
                "{} of {} bytes",
                dc.len(),
                jpeg.len()
            );
            let mut dec = Decompressor::new().unwrap();
            let header = turbo::header(&mut dec, &jpeg).unwrap();
            let (mut a, mut b) = (Vec::new(), Vec::new());
            let da = turbo::decode(&mut dec, &jpeg, header, 8, &mut a).unwrap();
            let db = turbo::decode(&mut dec, &dc, header, 8, &mut b).unwrap();
            assert_eq!(da, db);
            assert_eq!((da.width, da.height), (26, 19));
            assert_eq!(a, b, "{sampling}");
        }
        assert!(!dc_only(
            &textured(false, SamplingFactor::R_4_2_0),
            &mut Vec::new()
        ));
    }
}
