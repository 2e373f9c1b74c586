//! Several `.npy` arrays zipped into one dataset (e.g. images + labels): sample `i` is row `i`
//! of every array.

use std::path::Path;

use crate::npy::NpyArray;
use crate::{DataError, Dataset, FieldSpec, MappedBytes, Result, SampleContext};

/// Named `.npy` arrays of equal length along axis 0, read as one dataset.
#[derive(Debug, Clone)]
pub struct ArrayDataset {
    arrays: Vec<NpyArray>,
    fields: Vec<FieldSpec>,
    len: usize,
}

impl ArrayDataset {
    /// Zips `(field name, array)` pairs; their lengths along axis 0 must agree.
    pub fn new(arrays: Vec<(String, NpyArray)>) -> Result<Self> {
        let Some((_, first)) = arrays.first() else {
            return Err(DataError::Shape(
                "an array dataset needs at least one array".into(),
            ));
        };
        let len = first.len();
        for (name, a) in &arrays {
            if a.shape().is_empty() {
                return Err(DataError::format(
                    a.path(),
                    "shape",
                    format!("field {name:?} is 0-d: expected at least one axis (samples)"),
                ));
            }
            if a.len() != len {
                return Err(DataError::Shape(format!(
                    "field {name:?} ({}) has {} rows but {:?} ({}) has {len}: zipped arrays must have the same length along axis 0",
                    a.path().display(),
                    a.len(),
                    arrays[0].0,
                    first.path().display()
                )));
            }
        }
        let fields = arrays
            .iter()
            .map(|(n, a)| FieldSpec::new(n.clone(), a.dtype(), a.shape()[1..].to_vec()))
            .collect();
        Ok(ArrayDataset {
            arrays: arrays.into_iter().map(|(_, a)| a).collect(),
            fields,
            len,
        })
    }

    /// Opens the arrays `PREFIX.FIELD.npy` for each field name, e.g. `mnist-train.image.npy`.
    pub fn open_prefix(prefix: impl AsRef<Path>, fields: &[&str]) -> Result<Self> {
        let prefix = prefix.as_ref();
        let mut arrays = Vec::new();
        for f in fields {
            let path = crate::paths::prefixed(prefix, &format!(".{f}.npy"));
            arrays.push((f.to_string(), NpyArray::open(path)?));
        }
        Self::new(arrays)
    }

    /// The underlying arrays, in field order.
    pub fn arrays(&self) -> &[NpyArray] {
        &self.arrays
    }
}

impl Dataset for ArrayDataset {
    type Worker = ();

    fn len(&self) -> usize {
        self.len
    }

    fn fields(&self) -> &[FieldSpec] {
        &self.fields
    }

    fn read_sample(&self, _: &mut (), ctx: SampleContext, out: &mut [&mut [u8]]) -> Result<()> {
        let i = ctx.index as usize;
        if i >= self.len {
            return Err(DataError::Sample {
                index: ctx.index,
                message: format!("out of range: dataset has {} samples", self.len),
            });
        }
        for (a, o) in self.arrays.iter().zip(out.iter_mut()) {
            o.copy_from_slice(a.rows(i, 1));
        }
        Ok(())
    }

    /// Gathers field by field: one tight copy loop per array instead of a call per sample.
    fn read_batch(
        &self,
        _: &mut (),
        _seed: u64,
        _epoch: u64,
        indices: &[usize],
        out: &mut [&mut [u8]],
    ) -> Result<()> {
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.len) {
            return Err(DataError::Sample {
                index: bad as u64,
                message: format!("out of range: dataset has {} samples", self.len),
            });
        }
        for (a, o) in self.arrays.iter().zip(out.iter_mut()) {
            let rb = a.row_bytes();
            let src = a.bytes();
            for (&i, dst) in indices.iter().zip(o.chunks_exact_mut(rb.max(1))) {
                dst.copy_from_slice(&src[i * rb..(i + 1) * rb]);
            }
        }
        Ok(())
    }

    fn mapped_run(&self, field: usize, start: usize, count: usize) -> Option<MappedBytes> {
        (start + count <= self.len)
            .then(|| self.arrays[field].mapped_rows(start, count))
            .flatten()
    }

    fn mapped_bytes(&self) -> u64 {
        crate::mapped::distinct_bytes(self.arrays.iter().map(NpyArray::mapping))
    }
}
