//! The trainer's errors: each names the config key, file, parameter or step it concerns.

use std::path::PathBuf;

/// Everything that can go wrong while building or running training.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A config value is invalid; `key` is its dotted TOML path.
    #[error("config key `{key}`: {message}")]
    Config {
        /// Dotted key, e.g. `batch.micro_batch`.
        key: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// An environment variable the run reads holds a value it cannot use.
    #[error("environment variable {var}: {message}")]
    Environment {
        /// The variable, e.g. `RAYON_NUM_THREADS`.
        var: String,
        /// What was found and what was expected.
        message: String,
    },
    /// The config file does not parse (unknown keys included).
    #[error("config {path}: {message}")]
    ConfigParse {
        /// The file.
        path: PathBuf,
        /// The parser's message (names the key).
        message: String,
    },
    /// The machine profile (`stoker plan --calibrate`'s figures) does not read or write.
    #[error("machine profile {path}: {message}")]
    Profile {
        /// The profile file.
        path: PathBuf,
        /// What is wrong, naming the field.
        message: String,
    },
    /// A parameter received no gradient in backward (e.g. a fused candle op detached it).
    #[error(
        "parameter `{name}` received no gradient: a detached (fused, backward-less) op sits on \
         its path; HINT: use the composed ops in stoker_train::ops instead of candle's fused \
         softmax_last_dim / layer_norm / rms_norm"
    )]
    NoGradient {
        /// The parameter.
        name: String,
    },
    /// Training produced a non-finite value.
    #[error("step {step}: non-finite {what} (first non-finite parameter: `{param}`)")]
    NonFinite {
        /// The optimizer step at which it happened, counted from 1 (before 2026-12-07 from 0,
        /// so "step 0" named a step that the metrics call 1).
        step: u64,
        /// `loss`, `gradient` or `value`.
        what: String,
        /// The first parameter whose gradient or value was non-finite.
        param: String,
    },
    /// An fp16 overflow found the loss scale already at its floor, and `[loss_scale]`
    /// stops the run there.
    #[error(
        "step {step}: fp16 overflow with the loss scale already at its minimum ({shown}): \
         {detail}\nstopped, as loss_scale.stop_at_min_scale asks (DeepSpeed's \
         raise_error_at_min_scale); set it false to go on skipping such steps, as torch's \
         GradScaler does",
        shown = stoker_precision::ShownScale(*.scale)
    )]
    LossScaleAtMinimum {
        /// The step, counted from 1.
        step: u64,
        /// The scale the step ran at.
        scale: f32,
        /// The scaler's report: skips so far, overflowing parameters, hints.
        detail: String,
    },
    /// A checkpoint failed validation.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The checkpoint file or directory.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A dataset does not fit the model.
    #[error("dataset {what}: {message}")]
    Data {
        /// Which dataset or field.
        what: String,
        /// What is wrong.
        message: String,
    },
    /// A dataset named by a config key failed to open or read (the source names the file
    /// and the field).
    #[error("config key `{key}`: {source}")]
    Dataset {
        /// Dotted key, e.g. `data.train`.
        key: String,
        /// The reader's error.
        #[source]
        source: stoker_data::DataError,
    },
    /// A flat buffer that does not match its layout (sizes, names, shapes, pieces).
    #[error("layout: {0}")]
    Layout(String),
    /// A model's declaration does not hold together (a parameter its table lacks, a unit
    /// it does not have).
    #[error("model: {0}")]
    Model(String),
    /// What a strategy or step path cannot serve (a hook it lacks, a forward that needs
    /// every rank, a path chosen for another strategy).
    #[error("strategy: {0}")]
    Strategy(String),
    /// ZeRO-3's unit-by-unit schedule broke one of its rules (a unit before its groups,
    /// a group without a unit).
    #[error("zero3 units: {0}")]
    Units(String),
    /// A GPU model's host staging (pinned buffers, copies) failed.
    #[error("offload: {0}")]
    Offload(String),
    /// The run could not set itself up (its compute pool, its run directory's config).
    #[error("run setup: {0}")]
    Setup(String),
    /// An I/O error on `path`.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A candle error.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A fused kernel rejected its input.
    #[error(transparent)]
    Kernel(#[from] stoker_kernels::KernelError),
    /// A loader error.
    #[error(transparent)]
    DataLoader(#[from] stoker_data::DataError),
    /// A precision error (scaler, FP8).
    #[error(transparent)]
    Precision(#[from] stoker_precision::PrecisionError),
    /// A collective failed (timeout, lost rank, mismatch).
    #[error(transparent)]
    Comm(#[from] stoker_comm::CommError),
    /// A layer's FP8 scalers as saved do not hold together (a checkpoint's).
    #[error("fp8 scalers of layer {layer}: {source}")]
    Fp8State {
        /// The linear layer's name.
        layer: String,
        /// What is wrong.
        #[source]
        source: stoker_precision::PrecisionError,
    },
    /// Ranks disagree about something that must be identical (their configs).
    #[error("ranks disagree: {0}")]
    Mismatch(String),
}

/// Result with [`TrainError`].
pub type Result<T> = std::result::Result<T, TrainError>;

/// Shorthand for a [`TrainError::Config`].
pub fn config_err(key: impl Into<String>, message: impl Into<String>) -> TrainError {
    TrainError::Config {
        key: key.into(),
        message: message.into(),
    }
}

/// Shorthand for a [`TrainError::Io`].
pub fn io_err(path: impl Into<PathBuf>, source: std::io::Error) -> TrainError {
    TrainError::Io {
        path: path.into(),
        source,
    }
}
