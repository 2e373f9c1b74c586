//! The `Dataset` seam between storage formats and the loader.
//!
//! A dataset is a fixed number of samples, each made of named fields of fixed shape. The loader
//! asks it to write one sample's fields straight into the batch buffers (no per-sample
//! allocation), or, when a batch is a contiguous run of samples of a memory-mapped field, to
//! hand out that run of the mapping itself (zero copy).

use std::sync::Arc;

use crate::{DType, Result};

/// Name, element type and per-sample shape of one field (e.g. `image: u8 [1, 28, 28]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldSpec {
    /// Field name, e.g. "image", "label", "input", "target".
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape of one sample (the batch shape is `[batch] + shape`).
    pub shape: Vec<usize>,
}

impl FieldSpec {
    /// A field spec.
    pub fn new(name: impl Into<String>, dtype: DType, shape: Vec<usize>) -> Self {
        FieldSpec {
            name: name.into(),
            dtype,
            shape,
        }
    }

    /// Elements in one sample of this field.
    pub fn sample_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes in one sample of this field.
    pub fn sample_bytes(&self) -> usize {
        self.sample_elements() * self.dtype.size()
    }
}

/// Where a sample sits in the run: its randomness (augmentation) derives from these alone, so
/// a sample is bit-identical whichever worker, or how many workers, produced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleContext {
    /// The run's base seed.
    pub seed: u64,
    /// The epoch being loaded.
    pub epoch: u64,
    /// The dataset index of the sample.
    pub index: u64,
}

impl SampleContext {
    /// A 64-bit seed for this sample alone, mixing seed, epoch and index (splitmix64 finalizer).
    pub fn sample_seed(&self) -> u64 {
        let mut z = mix64(self.seed ^ 0x9E37_79B9_7F4A_7C15);
        z = mix64(z ^ self.epoch.wrapping_mul(0xBF58_476D_1CE4_E5B9));
        mix64(z ^ self.index.wrapping_mul(0x94D0_49BB_1331_11EB))
    }
}

/// The splitmix64 finalizer: a bijective 64-bit mixer.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A borrowed run of bytes inside a memory mapping, kept alive by the `Arc`.
#[derive(Clone)]
pub struct MappedBytes {
    /// The mapping that owns the bytes.
    pub map: Arc<crate::mapped::Mapped>,
    /// Byte offset of the run inside the mapping.
    pub offset: usize,
    /// Length of the run in bytes.
    pub len: usize,
}

impl MappedBytes {
    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.map[self.offset..self.offset + self.len]
    }
}

impl std::fmt::Debug for MappedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MappedBytes({}..{})",
            self.offset,
            self.offset + self.len
        )
    }
}

/// Most fields a dataset may have (samples are filled through a fixed-size slot array).
pub const MAX_FIELDS: usize = 8;

/// A collection of samples the loader can batch.
pub trait Dataset: Send + Sync + 'static {
    /// Per-worker scratch state (decode buffers and the like), created once per worker thread
    /// and reused for every sample that worker reads.
    type Worker: Default + Send;

    /// Number of samples.
    fn len(&self) -> usize;

    /// True when the dataset holds no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The fields of every sample, in batch order.
    fn fields(&self) -> &[FieldSpec];

    /// Writes sample `ctx.index`'s fields into `out` (one slice per field, each exactly
    /// `fields()[i].sample_bytes()` long).
    fn read_sample(
        &self,
        worker: &mut Self::Worker,
        ctx: SampleContext,
        out: &mut [&mut [u8]],
    ) -> Result<()>;

    /// Fills a whole batch: `out[f]` receives the samples `indices` of field `f` back to back
    /// (it may be longer than needed, for a short final batch). The default calls
    /// [`read_sample`](Self::read_sample) per sample; formats that can gather faster override it.
    fn read_batch(
        &self,
        worker: &mut Self::Worker,
        seed: u64,
        epoch: u64,
        indices: &[usize],
        out: &mut [&mut [u8]],
    ) -> Result<()> {
        let fields = self.fields();
        let mut regions: [&mut [u8]; MAX_FIELDS] = Default::default();
        for (r, o) in regions.iter_mut().zip(out.iter_mut()) {
            *r = std::mem::take(o);
        }
        for &index in indices {
            let mut slots: [&mut [u8]; MAX_FIELDS] = Default::default();
            for ((slot, region), spec) in slots.iter_mut().zip(regions.iter_mut()).zip(fields) {
                // Peel this sample off the front of each field's remaining region.
                let (head, tail) = std::mem::take(region).split_at_mut(spec.sample_bytes());
                *slot = head;
                *region = tail;
            }
            let ctx = SampleContext {
                seed,
                epoch,
                index: index as u64,
            };
            self.read_sample(worker, ctx, &mut slots[..fields.len()])?;
        }
        Ok(())
    }

    /// The bytes of samples `start..start + count` of field `field` if they lie contiguous in a
    /// mapping and need no transform; the loader then hands them out without copying.
    fn mapped_run(&self, _field: usize, _start: usize, _count: usize) -> Option<MappedBytes> {
        None
    }

    /// Bytes of the files this dataset maps, each counted once: what reading it can add to
    /// the process's resident set (file-backed pages, which the kernel may drop again), so
    /// that a memory forecast can count them. 0 for data held otherwise.
    fn mapped_bytes(&self) -> u64 {
        0
    }
}
