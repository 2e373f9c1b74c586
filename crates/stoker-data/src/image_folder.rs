//! JPEG image classification datasets: a record shard of JPEG bytes plus a labels array.
//!
//! Files for prefix `NAME` (written by [`crate::pack::image_folder::pack_image_folder`]):
//! `NAME.data` / `NAME.index` / `NAME.manifest.json` (the [`RecordShard`]), `NAME.labels.npy`
//! (i64, shape `[N]`), `NAME.classes.json` (class names; label `k` is the `k`-th name) and
//! `NAME.sources.json` (each record's photo, to name it when it fails to decode; packs made
//! before it existed are named by record alone).
//! Each sample decodes and transforms its JPEG with the [`ImagePipeline`], so the fields are
//! `image` (f32 or bf16, `[3, size, size]`) and `label` (i64, `[]`).

use std::path::{Path, PathBuf};

use crate::npy::NpyArray;
use crate::records::{RecordPaths, RecordShard};
use crate::transform::decode::IN_MEMORY;
use crate::transform::{ImagePipeline, ImageScratch, ImageTransformConfig};
use crate::{DType, DataError, Dataset, FieldSpec, Result, SampleContext};

/// The labels file of the image dataset at `prefix`: `PREFIX.labels.npy`.
pub fn labels_path(prefix: impl AsRef<Path>) -> PathBuf {
    RecordPaths::new(prefix).sidecar(".labels.npy")
}

/// The class names file of the image dataset at `prefix`: `PREFIX.classes.json`.
pub fn classes_path(prefix: impl AsRef<Path>) -> PathBuf {
    RecordPaths::new(prefix).sidecar(".classes.json")
}

/// The photo list of the image dataset at `prefix`: `PREFIX.sources.json`.
pub fn sources_path(prefix: impl AsRef<Path>) -> PathBuf {
    RecordPaths::new(prefix).sidecar(".sources.json")
}

/// Where a pack's records came from: record `i` is `root/files[i]`. Read only when a record
/// fails, to name the photo behind it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PackSources {
    /// The source folder, made absolute when the pack was written.
    pub root: String,
    /// Each record's photo, relative to `root`, in record order.
    pub files: Vec<String>,
}

impl PackSources {
    /// Writes the list as JSON at `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_string(self).expect("strings serialize");
        std::fs::write(path, json + "\n").map_err(|e| DataError::io(path, e))
    }

    /// The photo of `record` from the list at `path`, if the list exists, reads and names it.
    pub fn photo_of(path: &Path, record: usize) -> Option<PathBuf> {
        let text = std::fs::read_to_string(path).ok()?;
        let sources: PackSources = serde_json::from_str(&text).ok()?;
        let file = sources.files.get(record)?;
        Some(Path::new(&sources.root).join(file))
    }
}

/// A record shard of JPEGs with one i64 label each, transformed on read.
#[derive(Debug)]
pub struct ImageRecordDataset {
    shard: RecordShard,
    /// The prefix the dataset was opened at, for its side files.
    prefix: PathBuf,
    labels: Vec<i64>,
    pipeline: ImagePipeline,
    fields: Vec<FieldSpec>,
}

impl ImageRecordDataset {
    /// Opens the shard and labels at `prefix` and validates `config`; the label count must
    /// equal the record count.
    pub fn open(prefix: impl AsRef<Path>, config: ImageTransformConfig) -> Result<Self> {
        let pipeline = ImagePipeline::new(config)?;
        let shard = RecordShard::open(prefix.as_ref())?;
        let path = labels_path(prefix.as_ref());
        let labels = read_labels(&path, shard.len())?;
        let size = pipeline.config().size as usize;
        let fields = vec![
            FieldSpec::new("image", pipeline.config().dtype, vec![3, size, size]),
            FieldSpec::new("label", DType::I64, vec![]),
        ];
        Ok(ImageRecordDataset {
            shard,
            prefix: prefix.as_ref().to_path_buf(),
            labels,
            pipeline,
            fields,
        })
    }

    /// The underlying record shard.
    pub fn shard(&self) -> &RecordShard {
        &self.shard
    }

    /// The label of every record.
    pub fn labels(&self) -> &[i64] {
        &self.labels
    }

    /// The transform applied to every image.
    pub fn pipeline(&self) -> &ImagePipeline {
        &self.pipeline
    }
}

fn read_labels(path: &Path, records: usize) -> Result<Vec<i64>> {
    let array = NpyArray::open(path)?;
    if array.dtype() != DType::I64 {
        let found = array.dtype();
        return Err(DataError::format(
            path,
            "descr",
            format!("{found} (expected i64, '<i8')"),
        ));
    }
    if array.shape() != [records] {
        return Err(DataError::format(
            path,
            "shape",
            format!(
                "{:?} (expected [{records}], one label per record of the shard)",
                array.shape()
            ),
        ));
    }
    Ok(array
        .bytes()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect())
}

impl Dataset for ImageRecordDataset {
    type Worker = ImageScratch;

    fn len(&self) -> usize {
        self.shard.len()
    }

    fn fields(&self) -> &[FieldSpec] {
        &self.fields
    }

    fn read_sample(
        &self,
        worker: &mut ImageScratch,
        ctx: SampleContext,
        out: &mut [&mut [u8]],
    ) -> Result<()> {
        let i = ctx.index as usize;
        let data_path = &self.shard.paths().data;
        let jpeg = self.shard.get(i).ok_or_else(|| DataError::Sample {
            index: ctx.index,
            message: format!(
                "out of range: {} holds {} records",
                data_path.display(),
                self.len()
            ),
        })?;
        let [image, label] = out else {
            return Err(DataError::Shape(format!(
                "image dataset writes 2 fields (image, label), got {} output slices",
                out.len()
            )));
        };
        if label.len() != 8 {
            return Err(DataError::Shape(format!(
                "label output: {} bytes (expected 8)",
                label.len()
            )));
        }
        label.copy_from_slice(&self.labels[i].to_ne_bytes());
        self.pipeline
            .apply(jpeg, ctx.sample_seed(), worker, image)
            .map_err(|e| match e {
                // The pipeline does not know where the bytes came from: name the photo the
                // record was packed from where the pack lists it, and the record.
                DataError::Format {
                    path,
                    field,
                    message,
                } if path.as_os_str() == IN_MEMORY => {
                    let record = format!("record {i} of {} ({field})", data_path.display());
                    match PackSources::photo_of(&sources_path(&self.prefix), i) {
                        Some(photo) => DataError::format(photo, record, message),
                        None => {
                            DataError::format(data_path, format!("record {i} ({field})"), message)
                        }
                    }
                }
                other => other,
            })
    }

    fn mapped_bytes(&self) -> u64 {
        self.shard.mapped_bytes()
    }
}
