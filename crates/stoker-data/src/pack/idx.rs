//! MNIST-style IDX files (raw or gzip) to `.npy`.
//!
//! IDX (LeCun's format): two zero bytes, a type code (0x08 = u8), the number of dimensions,
//! then each dimension as a big-endian u32, then the data. Images become `PREFIX.image.npy`
//! (u8, [N, 1, rows, cols]: a channel axis, as conv layers expect) and labels
//! `PREFIX.label.npy` (i64, [N], as cross-entropy expects).

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::npy::write_npy;
use crate::paths::{create_parent, prefixed};
use crate::{DType, DataError, Result};

/// A parsed IDX file of u8 data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    /// Dimensions, outermost first.
    pub dims: Vec<usize>,
    /// The data, row-major.
    pub data: Vec<u8>,
}

/// Reads an IDX file of u8 data, gunzipping it when it starts with the gzip magic.
pub fn read_idx(path: impl AsRef<Path>) -> Result<IdxArray> {
    let path = path.as_ref();
    let raw = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
    let bytes = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| DataError::format(path, "gzip", format!("corrupt gzip stream: {e}")))?;
        out
    } else {
        raw
    };
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        return Err(DataError::format(
            path,
            "magic",
            "not an IDX file: expected two zero bytes, a type code and a dimension count",
        ));
    }
    if bytes[2] != 0x08 {
        return Err(DataError::format(
            path,
            "type",
            format!(
                "type code 0x{:02x}: expected 0x08 (unsigned byte)",
                bytes[2]
            ),
        ));
    }
    let nd = bytes[3] as usize;
    let header = 4 + 4 * nd;
    if nd == 0 || bytes.len() < header {
        return Err(DataError::format(
            path,
            "dims",
            format!("{nd} dimensions: expected at least 1, each a 4-byte size"),
        ));
    }
    let dims: Vec<usize> = (0..nd)
        .map(|i| u32::from_be_bytes(bytes[4 + 4 * i..8 + 4 * i].try_into().unwrap()) as usize)
        .collect();
    let n: usize = dims.iter().product();
    if bytes.len() - header != n {
        return Err(DataError::format(
            path,
            "data",
            format!("dims {dims:?} need {n} bytes after the header, file has {} (truncated or wrong file?)", bytes.len() - header),
        ));
    }
    Ok(IdxArray {
        dims,
        data: bytes[header..].to_vec(),
    })
}

/// What [`pack_idx`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxSummary {
    /// Number of samples.
    pub samples: usize,
    /// Image rows and columns.
    pub rows: usize,
    /// Image columns.
    pub cols: usize,
    /// The two files written.
    pub files: [PathBuf; 2],
}

/// Packs an IDX image file and its label file to `PREFIX.image.npy` and `PREFIX.label.npy`.
pub fn pack_idx(
    images: impl AsRef<Path>,
    labels: impl AsRef<Path>,
    prefix: impl AsRef<Path>,
) -> Result<IdxSummary> {
    let (images, labels) = (images.as_ref(), labels.as_ref());
    let img = read_idx(images)?;
    let lab = read_idx(labels)?;
    if img.dims.len() != 3 {
        return Err(DataError::format(
            images,
            "dims",
            format!(
                "{:?}: an image file has 3 dimensions [N, rows, cols]",
                img.dims
            ),
        ));
    }
    if lab.dims.len() != 1 {
        return Err(DataError::format(
            labels,
            "dims",
            format!("{:?}: a label file has 1 dimension [N]", lab.dims),
        ));
    }
    if img.dims[0] != lab.dims[0] {
        return Err(DataError::Shape(format!(
            "{} holds {} images but {} holds {} labels",
            images.display(),
            img.dims[0],
            labels.display(),
            lab.dims[0]
        )));
    }
    let (n, rows, cols) = (img.dims[0], img.dims[1], img.dims[2]);
    let prefix = prefix.as_ref();
    create_parent(prefix)?;
    let (ip, lp) = (
        prefixed(prefix, ".image.npy"),
        prefixed(prefix, ".label.npy"),
    );
    write_npy(&ip, DType::U8, &[n, 1, rows, cols], &img.data)?;
    let labels64: Vec<u8> = lab
        .data
        .iter()
        .flat_map(|&l| (l as i64).to_le_bytes())
        .collect();
    write_npy(&lp, DType::I64, &[n], &labels64)?;
    Ok(IdxSummary {
        samples: n,
        rows,
        cols,
        files: [ip, lp],
    })
}
