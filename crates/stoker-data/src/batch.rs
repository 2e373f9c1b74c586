//! A collated batch: one contiguous, typed buffer per field.

use std::sync::Arc;
use std::time::Duration;

use crate::pool::PooledStorage;
use crate::FieldSpec;

/// A batch of samples: for every field, one contiguous buffer of shape `[len] + field shape`.
/// Its storage returns to the loader's pool when the batch is dropped.
pub struct Batch {
    pub(crate) epoch: u64,
    pub(crate) index: usize,
    pub(crate) len: usize,
    pub(crate) wait: Duration,
    pub(crate) storage: PooledStorage,
    pub(crate) fields: Arc<[FieldSpec]>,
    pub(crate) offsets: Arc<[usize]>,
}

impl Batch {
    /// The epoch this batch belongs to.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Position of the batch within its epoch on this rank.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Number of samples (the last batch may be short unless drop_last).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a batch with no samples (never produced by the loader).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Dataset indices of the samples, in batch order.
    pub fn indices(&self) -> &[usize] {
        &self.storage.indices
    }

    /// How long the consumer waited for this batch.
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// Number of fields.
    pub fn num_fields(&self) -> usize {
        self.fields.len()
    }

    /// Field `i`.
    pub fn field_at(&self, i: usize) -> BatchField<'_> {
        let spec = &self.fields[i];
        let n = self.len * spec.sample_bytes();
        let bytes = match &self.storage.mapped.get(i) {
            Some(Some(m)) => m.as_bytes(),
            _ => &self.storage.data[self.offsets[i]..self.offsets[i] + n],
        };
        BatchField {
            spec,
            len: self.len,
            bytes,
            zero_copy: matches!(self.storage.mapped.get(i), Some(Some(_))),
        }
    }

    /// The field named `name`.
    pub fn field(&self, name: &str) -> Option<BatchField<'_>> {
        self.fields
            .iter()
            .position(|f| f.name == name)
            .map(|i| self.field_at(i))
    }

    /// Total bytes across fields.
    pub fn bytes(&self) -> usize {
        self.fields
            .iter()
            .map(|f| f.sample_bytes() * self.len)
            .sum()
    }
}

/// One field of a batch: spec, length and bytes.
pub struct BatchField<'a> {
    /// The field's per-sample spec.
    pub spec: &'a FieldSpec,
    /// Samples in the batch.
    pub len: usize,
    /// The contiguous bytes, `len * spec.sample_bytes()` long.
    pub bytes: &'a [u8],
    /// True when the bytes are a view of the memory-mapped file, not a copy.
    pub zero_copy: bool,
}

impl BatchField<'_> {
    /// The batch shape: `[len] + spec.shape`.
    pub fn shape(&self) -> Vec<usize> {
        std::iter::once(self.len)
            .chain(self.spec.shape.iter().copied())
            .collect()
    }

    /// The bytes as `&[T]` when sizes match and the data is aligned for `T`.
    pub fn as_slice<T: bytemuck::Pod>(&self) -> Option<&[T]> {
        if std::mem::size_of::<T>() != self.spec.dtype.size() {
            return None;
        }
        bytemuck::try_cast_slice(self.bytes).ok()
    }
}
