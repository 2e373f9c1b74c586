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
///
/// The data is read through a limit of the size the header's dimensions claim (plus one
/// byte, to notice extra data), so memory grows only with bytes that really arrive: a
/// header claiming 2^96 bytes or a gzip bomb under a small header costs no more than the
/// header justifies.
pub fn read_idx(path: impl AsRef<Path>) -> Result<IdxArray> {
    let path = path.as_ref();
    let raw = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
    let gzip = raw.starts_with(&[0x1f, 0x8b]);
    let mut reader: Box<dyn Read + '_> = if gzip {
        Box::new(flate2::read::MultiGzDecoder::new(&raw[..]))
    } else {
        Box::new(&raw[..])
    };
    let corrupt =
        |e: std::io::Error| DataError::format(path, "gzip", format!("corrupt gzip stream: {e}"));
    let mut head = Vec::with_capacity(4);
    (&mut reader)
        .take(4)
        .read_to_end(&mut head)
        .map_err(corrupt)?;
    if head.len() < 4 || head[0] != 0 || head[1] != 0 {
        return Err(DataError::format(
            path,
            "magic",
            "not an IDX file: expected two zero bytes, a type code and a dimension count",
        ));
    }
    if head[2] != 0x08 {
        return Err(DataError::format(
            path,
            "type",
            format!("type code 0x{:02x}: expected 0x08 (unsigned byte)", head[2]),
        ));
    }
    let nd = head[3] as usize;
    let mut sizes = Vec::with_capacity(4 * nd);
    (&mut reader)
        .take(4 * nd as u64)
        .read_to_end(&mut sizes)
        .map_err(corrupt)?;
    if nd == 0 || sizes.len() < 4 * nd {
        return Err(DataError::format(
            path,
            "dims",
            format!("{nd} dimensions: expected at least 1, each a 4-byte size"),
        ));
    }
    let dims: Vec<usize> = sizes
        .chunks_exact(4)
        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .collect();
    let n = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            DataError::format(
                path,
                "dims",
                format!("dims {dims:?}: the data size overflows 64 bits"),
            )
        })?;
    let mut data = Vec::new();
    reader
        .take(n as u64 + 1)
        .read_to_end(&mut data)
        .map_err(corrupt)?;
    if data.len() != n {
        let found = if data.len() > n {
            format!("more than {n}")
        } else {
            data.len().to_string()
        };
        return Err(DataError::format(
            path,
            "data",
            format!("dims {dims:?} need {n} bytes after the header, file has {found} (truncated or wrong file?)"),
        ));
    }
    Ok(IdxArray { dims, data })
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
    crate::paths::check_prefix(prefix.as_ref())?;
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
    if img.dims.contains(&0) {
        return Err(DataError::format(
            images,
            "dims",
            format!(
                "{:?}: no images, or images of zero rows or columns (expected [N, rows, cols] all positive)",
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
