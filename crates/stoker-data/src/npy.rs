//! `.npy` arrays, memory-mapped, exactly as numpy writes them (`np.save`, `open_memmap`).
//!
//! Format (numpy's `lib/format.py`): the magic `\x93NUMPY`, a major and minor version byte,
//! a header length (u16 for 1.0, u32 for 2.0 and 3.0), then a Python dict literal with keys
//! `descr`, `fortran_order` and `shape`, padded with spaces and a newline so the data starts
//! aligned. stoker reads little-endian (or byte-order-free) C-order arrays of the dtypes in
//! [`DType`] that numpy has: u1, u2, i4, i8, f2, f4, f8.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::mapped::Mapped;

use crate::{DType, DataError, MappedBytes, Result};

const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// A memory-mapped `.npy` array: its dtype, shape and the mapping holding its bytes.
#[derive(Clone)]
pub struct NpyArray {
    path: PathBuf,
    map: Arc<Mapped>,
    dtype: DType,
    shape: Vec<usize>,
    data_offset: usize,
}

impl std::fmt::Debug for NpyArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NpyArray({}, {} {:?})",
            self.path.display(),
            self.dtype,
            self.shape
        )
    }
}

impl NpyArray {
    /// The mapping of the array's file.
    pub(crate) fn mapping(&self) -> &Arc<Mapped> {
        &self.map
    }

    /// Maps `path` and parses its header; errors name the header field that is wrong.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = crate::mapped::open_file(&path)?;
        let map = Mapped::map(&file, &path)?;
        let header = parse_header(&path, &map)?;
        // Checked: a header's shape can claim more than usize holds.
        let want = header
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(header.dtype.size()))
            .and_then(|n| n.checked_add(header.data_offset));
        let Some(want) = want else {
            return Err(DataError::format(
                &path,
                "shape",
                format!(
                    "{:?} x {} is more bytes than any file holds",
                    header.shape, header.dtype
                ),
            ));
        };
        if map.len() < want {
            return Err(DataError::format(
                &path,
                "data",
                format!(
                    "file is {} bytes but header says {:?} x {} needs {} bytes after a {}-byte header (truncated file?)",
                    map.len(), header.shape, header.dtype, want, header.data_offset
                ),
            ));
        }
        Ok(NpyArray {
            path,
            map: Arc::new(map),
            dtype: header.dtype,
            shape: header.shape,
            data_offset: header.data_offset,
        })
    }

    /// The file this array was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Full shape; axis 0 indexes samples.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Length along axis 0 (1 for a 0-d array).
    pub fn len(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }

    /// True when axis 0 has length 0.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes in one slice along axis 0.
    pub fn row_bytes(&self) -> usize {
        self.shape.iter().skip(1).product::<usize>() * self.dtype.size()
    }

    /// All data bytes (after the header).
    pub fn bytes(&self) -> &[u8] {
        let n = self.shape.iter().product::<usize>() * self.dtype.size();
        &self.map[self.data_offset..self.data_offset + n]
    }

    /// Bytes of rows `start..start + count` along axis 0.
    pub fn rows(&self, start: usize, count: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes()[start * rb..(start + count) * rb]
    }

    /// Rows `start..start + count` as a zero-copy view that keeps the mapping alive; None
    /// where the data does not start at a multiple of its element size (a legal header
    /// length numpy never writes, but other writers may): such a view could not be read
    /// as its elements, so the rows are copied instead. The mapping starts on a page, so
    /// the offset's alignment is the address's.
    pub fn mapped_rows(&self, start: usize, count: usize) -> Option<MappedBytes> {
        if !self.data_offset.is_multiple_of(self.dtype.size().max(1)) {
            return None;
        }
        let rb = self.row_bytes();
        Some(MappedBytes {
            map: self.map.clone(),
            offset: self.data_offset + start * rb,
            len: count * rb,
        })
    }

    /// The data as a typed slice, when `T` matches the dtype's size and the data is aligned
    /// (numpy aligns data to 64 bytes, so it is for files numpy wrote).
    pub fn as_slice<T: bytemuck::Pod>(&self) -> Option<&[T]> {
        if std::mem::size_of::<T>() != self.dtype.size() {
            return None;
        }
        bytemuck::try_cast_slice(self.bytes()).ok()
    }
}

/// A parsed `.npy` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyHeader {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Byte offset where the data starts.
    pub data_offset: usize,
}

/// Parses the header at the start of `bytes` (from file `path`, named in errors).
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<NpyHeader> {
    let err = |field: &str, msg: String| DataError::format(path, field, msg);
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err(err(
            "magic",
            "not a .npy file: expected the bytes \\x93NUMPY at offset 0".into(),
        ));
    }
    let (major, minor) = (bytes[6], bytes[7]);
    let (len_bytes, utf8) = match (major, minor) {
        (1, 0) => (2usize, false),
        (2, 0) => (4, false),
        (3, 0) => (4, true),
        _ => {
            return Err(err(
                "version",
                format!("version {major}.{minor} unsupported: expected 1.0, 2.0 or 3.0"),
            ))
        }
    };
    if bytes.len() < 8 + len_bytes {
        return Err(err(
            "header_len",
            "file ends inside the header length".into(),
        ));
    }
    let hlen = if len_bytes == 2 {
        u16::from_le_bytes([bytes[8], bytes[9]]) as usize
    } else {
        u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize
    };
    let start = 8 + len_bytes;
    let data_offset = start + hlen;
    if bytes.len() < data_offset {
        return Err(err(
            "header_len",
            format!(
                "header claims {hlen} bytes but the file has {}",
                bytes.len() - start
            ),
        ));
    }
    let raw = &bytes[start..data_offset];
    let text = if utf8 {
        std::str::from_utf8(raw)
            .map_err(|_| err("header", "version 3.0 header is not valid UTF-8".into()))?
    } else {
        if !raw.is_ascii() {
            return Err(err(
                "header",
                format!("version {major}.0 header must be ASCII"),
            ));
        }
        std::str::from_utf8(raw).expect("ascii")
    };
    let dict =
        parse_dict(text).map_err(|m| err("header", format!("{m} in {:?}", text.trim_end())))?;
    let mut descr = None;
    let mut fortran = None;
    let mut shape = None;
    for (k, v) in dict {
        match (k.as_str(), v) {
            ("descr", Value::Str(s)) => descr = Some(s),
            ("fortran_order", Value::Bool(b)) => fortran = Some(b),
            ("shape", Value::Tuple(t)) => shape = Some(t),
            ("descr" | "fortran_order" | "shape", other) => {
                return Err(err(&k, format!("unexpected value {other:?}")));
            }
            _ => {
                return Err(err(
                    &k,
                    "unknown header key: expected only descr, fortran_order, shape".into(),
                ))
            }
        }
    }
    let descr = descr.ok_or_else(|| err("descr", "missing".into()))?;
    let fortran = fortran.ok_or_else(|| err("fortran_order", "missing".into()))?;
    let shape = shape.ok_or_else(|| err("shape", "missing".into()))?;
    if fortran {
        return Err(err(
            "fortran_order",
            "True: stoker reads C-order arrays only; save with np.ascontiguousarray".into(),
        ));
    }
    let dtype = dtype_from_descr(&descr).ok_or_else(|| {
        err(
            "descr",
            format!("{descr:?} unsupported: expected one of '|u1' '<u2' '<i4' '<i8' '<f2' '<f4' '<f8' (little-endian, not structured)"),
        )
    })?;
    Ok(NpyHeader {
        dtype,
        shape,
        data_offset,
    })
}

fn dtype_from_descr(d: &str) -> Option<DType> {
    let (order, code) = d.split_at(1.min(d.len()));
    let le = matches!(order, "<" | "|" | "=");
    let single = matches!(code, "u1" | "i1" | "b1");
    if !(le || (order == ">" && single)) {
        return None;
    }
    Some(match code {
        "u1" => DType::U8,
        "u2" => DType::U16,
        "i4" => DType::I32,
        "i8" => DType::I64,
        "f2" => DType::F16,
        "f4" => DType::F32,
        "f8" => DType::F64,
        _ => return None,
    })
}

fn descr_of(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::U8 => "|u1",
        DType::U16 => "<u2",
        DType::I32 => "<i4",
        DType::I64 => "<i8",
        DType::F16 => "<f2",
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::BF16 => return None,
    })
}

#[derive(Debug)]
enum Value {
    Str(String),
    Bool(bool),
    Tuple(Vec<usize>),
}

/// Parses the restricted dict literal numpy writes: string keys; values are strings, booleans
/// or tuples of non-negative integers.
fn parse_dict(s: &str) -> std::result::Result<Vec<(String, Value)>, String> {
    let mut p = Parser {
        s: s.as_bytes(),
        i: 0,
    };
    p.ws();
    p.expect(b'{')?;
    let mut out = Vec::new();
    loop {
        p.ws();
        if p.eat(b'}') {
            break;
        }
        let key = p.string()?;
        p.ws();
        p.expect(b':')?;
        p.ws();
        let val = match p.peek() {
            Some(b'\'' | b'"') => Value::Str(p.string()?),
            Some(b'(') => Value::Tuple(p.tuple()?),
            Some(b'T' | b'F') => Value::Bool(p.boolean()?),
            other => {
                return Err(format!(
                    "unexpected {:?} at byte {}",
                    other.map(|b| b as char),
                    p.i
                ))
            }
        };
        out.push((key, val));
        p.ws();
        if !p.eat(b',') {
            p.ws();
            p.expect(b'}')?;
            break;
        }
    }
    Ok(out)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }
    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\t' | b'\r')) {
            self.i += 1;
        }
    }
    fn eat(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, c: u8) -> std::result::Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("expected {:?} at byte {}", c as char, self.i))
        }
    }
    fn string(&mut self) -> std::result::Result<String, String> {
        let q = self
            .peek()
            .filter(|c| *c == b'\'' || *c == b'"')
            .ok_or(format!("expected a string at byte {}", self.i))?;
        self.i += 1;
        let start = self.i;
        while self.peek().ok_or("unterminated string")? != q {
            self.i += 1;
        }
        let v = String::from_utf8_lossy(&self.s[start..self.i]).into_owned();
        self.i += 1;
        Ok(v)
    }
    fn boolean(&mut self) -> std::result::Result<bool, String> {
        for (word, v) in [(&b"True"[..], true), (&b"False"[..], false)] {
            if self.s[self.i..].starts_with(word) {
                self.i += word.len();
                return Ok(v);
            }
        }
        Err(format!("expected True or False at byte {}", self.i))
    }
    fn tuple(&mut self) -> std::result::Result<Vec<usize>, String> {
        self.expect(b'(')?;
        let mut dims = Vec::new();
        loop {
            self.ws();
            if self.eat(b')') {
                return Ok(dims);
            }
            let start = self.i;
            while matches!(self.peek(), Some(b'0'..=b'9')) {
                self.i += 1;
            }
            // numpy writes Python ints; some writers append an L (Python 2 longs).
            let digits = std::str::from_utf8(&self.s[start..self.i]).unwrap();
            let dim = digits.parse::<usize>().map_err(|_| {
                format!("expected a non-negative integer dimension at byte {start}")
            })?;
            self.eat(b'L');
            dims.push(dim);
            self.ws();
            if !self.eat(b',') {
                self.ws();
                self.expect(b')')?;
                return Ok(dims);
            }
        }
    }
}

/// Writes a `.npy` file (version 1.0, or 2.0 when the header needs it) with the data aligned
/// to 64 bytes, as numpy does, so numpy and [`NpyArray::open`] read it back.
pub fn write_npy(path: impl AsRef<Path>, dtype: DType, shape: &[usize], data: &[u8]) -> Result<()> {
    let path = path.as_ref();
    let descr = descr_of(dtype).ok_or_else(|| DataError::Config {
        field: "dtype",
        message: format!("{dtype} has no numpy .npy descr; store bf16 as u2 bits"),
    })?;
    let want: usize = shape.iter().product::<usize>() * dtype.size();
    if want != data.len() {
        return Err(DataError::Shape(format!(
            "{}: shape {shape:?} of {dtype} needs {want} bytes, got {}",
            path.display(),
            data.len()
        )));
    }
    let dims = match shape.len() {
        1 => format!("({},)", shape[0]),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {dims}, }}");
    let mut header = Vec::new();
    header.extend_from_slice(MAGIC);
    let body_len = dict.len() + 1;
    let (version, len_field) = if (10 + body_len).div_ceil(64) * 64 - 10 <= u16::MAX as usize {
        (1u8, 2usize)
    } else {
        (2, 4)
    };
    let total = (6 + 2 + len_field + body_len).div_ceil(64) * 64;
    let hlen = total - (6 + 2 + len_field);
    header.extend_from_slice(&[version, 0]);
    if len_field == 2 {
        header.extend_from_slice(&(hlen as u16).to_le_bytes());
    } else {
        header.extend_from_slice(&(hlen as u32).to_le_bytes());
    }
    header.extend_from_slice(dict.as_bytes());
    header.resize(total - 1, b' ');
    header.push(b'\n');
    let mut f = std::io::BufWriter::new(File::create(path).map_err(|e| DataError::io(path, e))?);
    f.write_all(&header)
        .and_then(|_| f.write_all(data))
        .and_then(|_| f.flush())
        .map_err(|e| DataError::io(path, e))?;
    Ok(())
}
