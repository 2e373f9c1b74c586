//! Training and evaluation data: opening the configured paths, the subsets a run trains
//! and evaluates on (a contiguous tail of token windows held out; a seeded draw of other
//! samples, which `stoker pack images` writes in class order), and conversion of loader
//! batches into model inputs. [`checks`]: what the opened data must agree on with the
//! model and with itself, before a run's first step.

pub mod checks;

use std::sync::Arc;

use candle_core::{Device, Tensor};
use stoker_data::pack::text::Vocab;
use stoker_data::transform::{ImageTransformConfig, TransformMode};
use stoker_data::{
    open_dataset, AnyDataset, DType, Dataset, FieldSpec, MappedBytes, OpenOptions, SampleContext,
};

use crate::accumulate::MicroBatch;
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::models::Model;
use crate::models::ModelConfig;

/// Samples of a dataset, re-indexed from 0: `start..start + len`, or the samples an
/// order names, in that order.
pub struct Subset<D: Dataset> {
    inner: Arc<D>,
    start: usize,
    len: usize,
    /// Where sample `i` is in `inner`, where the subset is not one run of samples.
    order: Option<Arc<[usize]>>,
}

impl<D: Dataset> Subset<D> {
    /// The samples `start..start + len` of `inner`.
    pub fn new(inner: Arc<D>, start: usize, len: usize) -> Self {
        Subset {
            inner,
            start,
            len,
            order: None,
        }
    }

    /// The samples of `inner` that `order` names, sample `i` being `order[i]`.
    pub fn picked(inner: Arc<D>, order: Vec<usize>) -> Self {
        Subset {
            inner,
            start: 0,
            len: order.len(),
            order: Some(order.into()),
        }
    }

    /// The dataset the samples are of.
    pub fn inner(&self) -> &Arc<D> {
        &self.inner
    }
}

impl<D: Dataset> Dataset for Subset<D> {
    type Worker = D::Worker;

    fn len(&self) -> usize {
        self.len
    }

    fn fields(&self) -> &[FieldSpec] {
        self.inner.fields()
    }

    fn read_sample(
        &self,
        w: &mut D::Worker,
        ctx: SampleContext,
        out: &mut [&mut [u8]],
    ) -> stoker_data::Result<()> {
        let index =
            match &self.order {
                Some(order) => *order.get(ctx.index as usize).ok_or_else(|| {
                    stoker_data::DataError::Sample {
                        index: ctx.index,
                        message: format!("out of range: {} samples", self.len),
                    }
                })? as u64,
                None => ctx.index + self.start as u64,
            };
        self.inner
            .read_sample(w, SampleContext { index, ..ctx }, out)
    }

    fn mapped_run(&self, field: usize, start: usize, count: usize) -> Option<MappedBytes> {
        // A picked order is no run of the inner dataset's samples.
        (self.order.is_none() && start + count <= self.len)
            .then(|| self.inner.mapped_run(field, self.start + start, count))
            .flatten()
    }

    /// The whole of `inner`'s files: a subset maps them all.
    fn mapped_bytes(&self) -> u64 {
        self.inner.mapped_bytes()
    }
}

/// The train and eval datasets and the names of their input and target fields.
pub struct Datasets {
    /// Training samples.
    pub train: Arc<Subset<AnyDataset>>,
    /// Evaluation samples.
    pub eval: Arc<Subset<AnyDataset>>,
    /// Input field name.
    pub input: String,
    /// Target field name.
    pub target: String,
    /// How the eval split was made, for the log.
    pub eval_note: String,
    /// Whether the evaluation samples are a held-out split of the training files.
    pub held_out: bool,
    /// What the run should warn of before training (the run and `--dry-run` print them).
    pub notes: Vec<String>,
    /// `data.vocab`, read once and checked against the model (the run's text sample
    /// decodes through it).
    pub vocab: Option<Vocab>,
}

/// Reads the samples `indices` of `ds` outside the loader, each into scratch buffers (one
/// per field, as the loader fills them), and hands them to `each`: for the checks that
/// read samples before a run's first step.
pub fn for_each_sample(
    ds: &Subset<AnyDataset>,
    indices: impl IntoIterator<Item = usize>,
    mut each: impl FnMut(&[Vec<u8>]),
) -> stoker_data::Result<()> {
    let mut bufs: Vec<Vec<u8>> = ds
        .fields()
        .iter()
        .map(|f| vec![0; f.sample_bytes()])
        .collect();
    let mut worker = Default::default();
    for i in indices {
        let mut out: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let ctx = SampleContext {
            seed: 0,
            epoch: 0,
            index: i as u64,
        };
        ds.read_sample(&mut worker, ctx, &mut out)?;
        each(&bufs);
    }
    Ok(())
}

impl Datasets {
    /// A fingerprint of the training samples: the CRC-32 of the first, middle and last
    /// (every field, as the loader reads them). Two files of the same size (MNIST and
    /// Fashion-MNIST) differ in it; a resume compares it with its checkpoint's.
    pub fn train_fingerprint(&self) -> Result<u32> {
        let n = self.train.len();
        let picks = [0, n / 2, n.saturating_sub(1)]
            .into_iter()
            .filter(|&i| i < n);
        let mut crc = crc32fast::Hasher::new();
        for_each_sample(&self.train, picks, |fields| {
            fields.iter().for_each(|b| crc.update(b))
        })?;
        Ok(crc.finalize())
    }

    /// Bytes of the files the training and evaluation data map, each file once (a held-out
    /// evaluation split maps the training file): what reading them adds to the resident
    /// set as file-backed pages.
    pub fn mapped_bytes(&self) -> u64 {
        match self.held_out {
            true => self.train.mapped_bytes(),
            false => self.train.mapped_bytes() + self.eval.mapped_bytes(),
        }
    }
}

/// How JPEG records become the model's input: at the CNN's `image_size` (the ImageNet
/// recipe's geometry, its 224 only where the model is 224), training data with random
/// resized crops and flips, evaluation data with the resize and center crop.
fn image_transform(config: &TrainConfig, mode: TransformMode) -> ImageTransformConfig {
    let size = match &config.model {
        ModelConfig::Cnn(c) => c.image_size as u32,
        _ => ImageTransformConfig::default().size,
    };
    let defaults = ImageTransformConfig::default();
    ImageTransformConfig {
        size,
        mode,
        decoder: config
            .data
            .jpeg_decoder
            .map_or(defaults.decoder, |d| d.backend()),
        ..defaults
    }
}

fn open(
    path: &std::path::Path,
    (config, vocab): (&TrainConfig, Option<&Vocab>),
    mode: TransformMode,
    key: &str,
) -> Result<Arc<AnyDataset>> {
    let opts = OpenOptions {
        context: config.model.context().unwrap_or(1),
        token_dtype: DType::I64,
        token_vocab: id_limit(config, vocab),
        image: image_transform(config, mode),
    };
    open_dataset(path, &opts)
        .map(Arc::new)
        .map_err(|source| TrainError::Dataset {
            key: key.to_string(),
            source: relative_hint(path, source),
        })
}

/// The ids token windows may hold: `model.vocab`'s, or fewer where `data.vocab` holds
/// fewer tokens (an id past the file's tokens decodes as no character, and the model's
/// spare rows are never targets).
fn id_limit(config: &TrainConfig, vocab: Option<&Vocab>) -> Option<stoker_data::tokens::IdLimit> {
    use stoker_data::tokens::IdLimit;
    let model = config.model.vocab()?;
    Some(match vocab.map(Vocab::size) {
        Some(ids) if ids < model => IdLimit {
            ids,
            key: "data.vocab",
        },
        _ => IdLimit {
            ids: model,
            key: "model.vocab",
        },
    })
}

/// A file of a relative `path` that is not found (a missing file, or a path or pattern
/// that names none): the error also says where relative paths are read from (a run
/// started in another directory, or by a launcher in the home one).
fn relative_hint(path: &std::path::Path, e: stoker_data::DataError) -> stoker_data::DataError {
    use stoker_data::DataError;
    let hint = || {
        let cwd = std::env::current_dir()
            .map_or_else(|_| "(unreadable)".into(), |d| d.display().to_string());
        format!("relative paths are read from the working directory {cwd}")
    };
    if !path.is_relative() {
        return e;
    }
    match e {
        DataError::Io { path: file, source } if source.kind() == std::io::ErrorKind::NotFound => {
            let source = std::io::Error::new(source.kind(), format!("{source}; {}", hint()));
            DataError::Io { path: file, source }
        }
        DataError::NotFound {
            path: file,
            field,
            message,
        } => DataError::NotFound {
            path: file,
            field,
            message: format!("{message}; {}", hint()),
        },
        other => other,
    }
}

/// Opens the configured data (token shards in windows of the model's context) and checks
/// it against `model` before any training.
pub fn open_datasets(config: &TrainConfig, model: &dyn Model) -> Result<Datasets> {
    let d = &config.data;
    let vocab = load_vocab(config)?;
    let with = (config, vocab.as_ref());
    let train = open(&d.train, with, TransformMode::Train, "data.train")?;
    if d.jpeg_decoder.is_some() && !matches!(&*train, AnyDataset::Images(_)) {
        return Err(TrainError::Config {
            key: "data.jpeg_decoder".into(),
            message: format!(
                "{} is not image records (`stoker pack images`): there are no JPEGs to decode; remove the key",
                d.train.display()
            ),
        });
    }
    let tokens = matches!(&*train, AnyDataset::Tokens(_));
    // A token model's samples are windows of a text stream (a shard, or windows saved as
    // arrays): held out as a tail and evaluated in order. A classifier's are drawn.
    let stream = tokens || config.model.vocab().is_some();
    let input = d
        .input_field
        .clone()
        .unwrap_or_else(|| if tokens { "input" } else { "image" }.into());
    let target = d
        .target_field
        .clone()
        .unwrap_or_else(|| if tokens { "target" } else { "label" }.into());
    let token_model = config.model.vocab().is_some();
    let names = (input.as_str(), target.as_str());
    check_fields(
        &train,
        names,
        model,
        token_model,
        &d.train.display().to_string(),
    )?;
    let n = train.len();
    let (train, eval, eval_note) = match &d.eval {
        Some(p) => {
            let eval = open(p, with, TransformMode::Eval, "data.eval")?;
            check_fields(&eval, names, model, token_model, &p.display().to_string())?;
            let m = eval.len();
            // Evaluating part of a set of records or arrays: a seeded draw of it, not its
            // first samples (in class order, those are the first classes alone). Token
            // windows, a stream of text, are evaluated from the start.
            let part = config.train.eval_batches.max(1) * config.batch.micro_batch < m;
            let (eval, note) = match (stream, part) {
                (false, true) => (
                    Subset::picked(eval, drawn(m)?),
                    format!(
                        "{} ({m} samples, a seeded draw of them evaluated)",
                        p.display()
                    ),
                ),
                _ => (
                    Subset::new(eval, 0, m),
                    format!("{} ({m} samples)", p.display()),
                ),
            };
            (Subset::new(train, 0, n), eval, note)
        }
        None => {
            let held = ((n as f64) * d.eval_fraction).round() as usize;
            if d.eval_fraction == 0.0 {
                return Err(crate::error::config_err(
                    "data.eval_fraction",
                    "0 holds out nothing to evaluate on: give data.eval, or a fraction above 0",
                ));
            }
            if held == 0 || held >= n {
                return Err(TrainError::Data {
                    what: d.train.display().to_string(),
                    message: format!(
                        "{n} samples: too few to hold out data.eval_fraction = {}",
                        d.eval_fraction
                    ),
                });
            }
            // JPEG records are opened again for the held-out split, with the evaluation
            // transform (no random crops); the other formats are the same either way.
            let eval = match &*train {
                AnyDataset::Images(_) => open(&d.train, with, TransformMode::Eval, "data.train")?,
                _ => train.clone(),
            };
            let f = d.eval_fraction;
            let from = d.train.display();
            match stream {
                // The last windows: neighbouring windows share text, so a contiguous tail
                // keeps the held-out text apart (nanoGPT's split).
                true => (
                    Subset::new(train, 0, n - held),
                    Subset::new(eval, n - held, held),
                    format!("last {held} of {n} samples of {from} (data.eval_fraction {f})"),
                ),
                // A seeded draw (torch's random_split): records and arrays are often in
                // class order, and their tail would hold out the last classes whole.
                false => {
                    let order = drawn(n)?;
                    let mut kept = order[..n - held].to_vec();
                    kept.sort_unstable();
                    (
                        Subset::picked(train, kept),
                        Subset::picked(eval, order[n - held..].to_vec()),
                        format!(
                            "a seeded draw of {held} of {n} samples of {from} (data.eval_fraction {f})"
                        ),
                    )
                }
            }
        }
    };
    if train.len() < config.batch.micro_batch {
        return Err(TrainError::Data {
            what: d.train.display().to_string(),
            message: format!(
                "{} training samples, fewer than batch.micro_batch {}",
                train.len(),
                config.batch.micro_batch
            ),
        });
    }
    let mut notes: Vec<String> = match &**train.inner() {
        AnyDataset::Tokens(w) => unused_tokens(w, &d.train).into_iter().collect(),
        _ => Vec::new(),
    };
    if let Some(eval) = &d.eval {
        notes.extend(shared_files(&d.train, eval));
    }
    let data = Datasets {
        train: Arc::new(train),
        eval: Arc::new(eval),
        input,
        target,
        eval_note,
        held_out: d.eval.is_none(),
        notes,
        vocab,
    };
    checks::check_data(config, &data)?;
    Ok(data)
}

/// A note where `data.eval` reads files `data.train` also reads: the same file, or a
/// training pattern that also matches the evaluation shard (`data/x_*.bin` beside
/// `data/x_val_000000.bin`), so the evaluation measures text the model trains on.
fn shared_files(train: &std::path::Path, eval: &std::path::Path) -> Option<String> {
    // Compared as the files they are (a link or a `./` names the same file).
    let real = |p: std::path::PathBuf| std::fs::canonicalize(&p).unwrap_or(p);
    let trained: std::collections::BTreeSet<_> = stoker_data::dataset_files(train)
        .into_iter()
        .map(real)
        .collect();
    let shared: Vec<String> = stoker_data::dataset_files(eval)
        .into_iter()
        .map(real)
        .filter(|f| trained.contains(f))
        .map(|f| f.display().to_string())
        .collect();
    (!shared.is_empty()).then(|| {
        format!(
            "data.eval {} reads {} file(s) data.train {} also trains on ({}): its loss \
             measures samples the model has seen; give data.eval files apart from \
             data.train's (a narrower pattern, e.g. PREFIX_train_*.bin)",
            eval.display(),
            shared.len(),
            train.display(),
            shared.join(", ")
        )
    })
}

/// A note where more than a tenth of a token set's tokens are in no window: a window
/// never spans shards, so shards not much longer than the context leave each its tail
/// (51 shards of 1,000 tokens at context 600 train on 60% of them).
fn unused_tokens(w: &stoker_data::TokenWindows, path: &std::path::Path) -> Option<String> {
    let total = w.tokens();
    let used = stoker_data::Dataset::len(w) * w.context();
    let unused = total.saturating_sub(used);
    (unused * 10 > total).then(|| {
        format!(
            "data.train {}: {unused} of its {total} tokens ({:.0}%) are in no window of \
             context {}: a window never spans its {} shard(s), so each leaves its tail; pack \
             with a larger --shard-tokens, or use a shorter model.context",
            path.display(),
            100.0 * unused as f64 / total as f64,
            w.context(),
            w.shard_count()
        )
    })
}

/// The seed of the draws [`drawn`] makes: fixed, so that a set's held-out samples are the
/// same for every run's seed, as a dataset's own split is.
const SPLIT_SEED: u64 = 0x5707_4e12;

/// A seeded permutation of `0..n` (the sampler's Fisher-Yates).
fn drawn(n: usize) -> Result<Vec<usize>> {
    let config = stoker_data::SamplerConfig {
        shuffle: true,
        seed: SPLIT_SEED,
        ..Default::default()
    };
    Ok(stoker_data::Sampler::new(n, config)?.global_order(0))
}

/// Visits the integer ids (class ids, token ids) held as little-endian `dtype` elements
/// in `bytes`, as i64, in order until `visit` breaks: the one decoding of ids that the
/// checks at open and every batch share. `None` for a dtype that holds no ids (floats).
fn visit_ids(
    dtype: DType,
    bytes: &[u8],
    mut visit: impl FnMut(i64) -> std::ops::ControlFlow<()>,
) -> Option<()> {
    match dtype {
        DType::U8 => {
            let _ = bytes.iter().try_for_each(|&v| visit(v as i64));
        }
        DType::U16 => {
            let _ = bytes
                .chunks_exact(2)
                .try_for_each(|c| visit(u16::from_le_bytes([c[0], c[1]]) as i64));
        }
        DType::I32 => {
            let _ = bytes
                .chunks_exact(4)
                .try_for_each(|c| visit(i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64));
        }
        DType::I64 => {
            let _ = bytes
                .chunks_exact(8)
                .try_for_each(|c| visit(i64::from_le_bytes(c.try_into().expect("8 bytes"))));
        }
        DType::F16 | DType::BF16 | DType::F32 | DType::F64 => return None,
    }
    Some(())
}

/// The ids in `bytes` (see [`visit_ids`]) as i64; `None` for a float dtype.
pub fn ids_as_i64(dtype: DType, bytes: &[u8]) -> Option<Vec<i64>> {
    let mut out = Vec::with_capacity(bytes.len() / dtype.size().max(1));
    visit_ids(dtype, bytes, |v| {
        out.push(v);
        std::ops::ControlFlow::Continue(())
    })?;
    Some(out)
}

/// The first id in `bytes` (see [`visit_ids`]) that `bad` picks, with its position; `None`
/// where none is (or the dtype holds no ids).
pub fn first_id_where(
    dtype: DType,
    bytes: &[u8],
    bad: impl Fn(i64) -> bool,
) -> Option<(usize, i64)> {
    let (mut at, mut found) = (0, None);
    visit_ids(dtype, bytes, |v| match bad(v) {
        true => {
            found = Some((at, v));
            std::ops::ControlFlow::Break(())
        }
        false => {
            at += 1;
            std::ops::ControlFlow::Continue(())
        }
    })?;
    found
}

/// The input dtypes a model reads, and numpy's conversion to them: a token model's ids
/// (made i64 by [`to_micro_batch`]); a classifier's u8 pixels (which it scales by 1/255)
/// or f32 values. A classifier given u16 or i32 values would take them raw, unscaled.
fn input_dtypes(token_model: bool) -> (&'static [DType], &'static str) {
    match token_model {
        true => (
            &[DType::U16, DType::I32, DType::I64],
            "a token model's inputs are ids; convert the array (numpy: `x.astype(np.int64)`)",
        ),
        false => (
            &[DType::U8, DType::F32],
            "a classifier's inputs are u8 pixels (scaled by 1/255) or f32 values; convert \
             the array (numpy: `x.astype(np.float32)`)",
        ),
    }
}

fn check_fields(
    ds: &AnyDataset,
    (input, target): (&str, &str),
    model: &dyn Model,
    token_model: bool,
    what: &str,
) -> Result<()> {
    let find = |name: &str, key: &str| {
        ds.fields()
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| TrainError::Data {
                what: what.into(),
                message: format!(
                    "no field `{name}` (config key `data.{key}`); fields: {:?}",
                    ds.fields()
                        .iter()
                        .map(|f| f.name.as_str())
                        .collect::<Vec<_>>()
                ),
            })
    };
    let inp = find(input, "input_field")?;
    let tgt = find(target, "target_field")?;
    // The file a field is read from, where it is one array of its own.
    let file = |name: &str| {
        match ds {
            AnyDataset::Arrays(a) => ds
                .fields()
                .iter()
                .position(|f| f.name == name)
                .and_then(|i| a.arrays().get(i))
                .map(|arr| arr.path().display().to_string()),
            _ => None,
        }
        .unwrap_or_else(|| what.to_string())
    };
    let (accepted, how) = input_dtypes(token_model);
    if !accepted.contains(&inp.dtype) {
        return Err(TrainError::Data {
            what: format!("{} field `{input}` (data.input_field)", file(input)),
            message: format!(
                "dtype {}, expected {}: {how}",
                inp.dtype.name(),
                accepted
                    .iter()
                    .map(|d| d.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    }
    model
        .check_input(&inp.shape, inp.dtype.name())
        .map_err(|m| TrainError::Data {
            what: format!("{} field `{input}`", file(input)),
            message: format!("does not fit the model: {m}"),
        })?;
    if !matches!(tgt.dtype, DType::U8 | DType::U16 | DType::I32 | DType::I64) {
        return Err(TrainError::Data {
            what: format!("{} field `{target}` (data.target_field)", file(target)),
            message: format!("dtype {}: class ids must be integers", tgt.dtype.name()),
        });
    }
    Ok(())
}

/// Converts a loader batch into a [`MicroBatch`] (input tensor on `device`, flattened i64
/// targets).
pub fn to_micro_batch(
    batch: &stoker_data::Batch,
    input: &str,
    target: &str,
    device: &Device,
) -> Result<MicroBatch> {
    let missing = |n: &str| TrainError::Data {
        what: "batch".into(),
        message: format!("no field `{n}`"),
    };
    let f = batch.field(input).ok_or_else(|| missing(input))?;
    let shape = f.shape();
    let unsupported = |n: &str, d: DType| TrainError::Data {
        what: format!("field `{n}`"),
        message: format!("dtype {} not supported as model input", d.name()),
    };
    let x = match f.spec.dtype {
        DType::U8 => Tensor::from_slice(f.bytes, shape.as_slice(), device)?,
        DType::F32 => Tensor::from_slice(
            f.as_slice::<f32>().ok_or_else(|| TrainError::Data {
                what: format!("field `{input}`"),
                message: "f32 values not aligned to 4 bytes in the batch".into(),
            })?,
            shape.as_slice(),
            device,
        )?,
        d => Tensor::from_vec(
            ids_as_i64(d, f.bytes).ok_or_else(|| unsupported(input, d))?,
            shape.as_slice(),
            device,
        )?,
    };
    let t = batch.field(target).ok_or_else(|| missing(target))?;
    let targets = ids_as_i64(t.spec.dtype, t.bytes).ok_or_else(|| TrainError::Data {
        what: format!("field `{target}`"),
        message: format!("dtype {}: targets are integer ids", t.spec.dtype.name()),
    })?;
    if !device.is_cpu() {
        // A copy from the loader's page-locked buffer is asynchronous, and the buffer goes
        // back to the loader's pool when the batch is dropped: wait for it.
        device.synchronize()?;
    }
    Ok(MicroBatch { input: x, targets })
}

/// The vocabulary `data.vocab` names (what `stoker pack` wrote beside the shard: the
/// characters, or GPT-2's BPE), checked against the model's vocabulary size.
pub fn load_vocab(config: &TrainConfig) -> Result<Option<Vocab>> {
    let Some(path) = &config.data.vocab else {
        return Ok(None);
    };
    let vocab = Vocab::load(path).map_err(|source| TrainError::Dataset {
        key: "data.vocab".into(),
        source: relative_hint(path, source),
    })?;
    if vocab.size() == 0 {
        return Err(crate::error::config_err(
            "data.vocab",
            format!(
                "{} holds no tokens: expected the vocabulary `stoker pack` wrote beside the shard",
                path.display()
            ),
        ));
    }
    if let Some(model_vocab) = config.model.vocab() {
        if vocab.size() > model_vocab {
            return Err(crate::error::config_err(
                "model.vocab",
                format!(
                    "{} < {} tokens in {} (data.vocab)",
                    model_vocab,
                    vocab.size(),
                    path.display()
                ),
            ));
        }
    }
    Ok(Some(vocab))
}
