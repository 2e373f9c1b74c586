//! The kind of fault that ended a command, printed as `error[KIND]: ...`, so that a script
//! (or a scheduler deciding whether a retry can help) and the bad-input corpus can tell a
//! broken file from a bad config or a lost rank without parsing prose. The kind is read off
//! the typed errors of the libraries in the error's chain; plain messages of the command line
//! itself are `usage`.

use stoker_comm::CommError;
use stoker_data::DataError;
use stoker_plan::PlanError;
use stoker_train::TrainError;

/// What class of fault ended a command (docs/reliability.md lists them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// A file could not be opened, read or written (missing, permissions, full disk).
    Io,
    /// A file's bytes do not follow its format (header, sizes, offsets, a corrupt record).
    Format,
    /// A checkpoint is incomplete, corrupt or from another model.
    Checkpoint,
    /// A config file or option is invalid (syntax, unknown key, value out of range).
    Config,
    /// Datasets that do not fit each other or the model (shapes, lengths, token ids).
    Data,
    /// Training produced a non-finite value, or the loss scaler / FP8 state is invalid.
    Numeric,
    /// A collective failed: a timeout, a lost rank, ranks that disagree.
    Comm,
    /// The model or a kernel rejected its input (an internal invariant).
    Model,
    /// The command line itself (arguments that do not go together).
    Usage,
}

impl ErrorKind {
    /// The kind's name as printed in `error[NAME]`.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Io => "io",
            ErrorKind::Format => "format",
            ErrorKind::Checkpoint => "checkpoint",
            ErrorKind::Config => "config",
            ErrorKind::Data => "data",
            ErrorKind::Numeric => "numeric",
            ErrorKind::Comm => "comm",
            ErrorKind::Model => "model",
            ErrorKind::Usage => "usage",
        }
    }

    /// The kind of the first typed error in `e`'s chain (context messages are skipped).
    pub fn of(e: &anyhow::Error) -> ErrorKind {
        for cause in e.chain() {
            if let Some(d) = cause.downcast_ref::<DataError>() {
                return data(d);
            }
            if let Some(t) = cause.downcast_ref::<TrainError>() {
                return train(t);
            }
            if let Some(p) = cause.downcast_ref::<PlanError>() {
                return plan(p);
            }
            if cause.downcast_ref::<CommError>().is_some() {
                return ErrorKind::Comm;
            }
            if cause.downcast_ref::<std::io::Error>().is_some() {
                return ErrorKind::Io;
            }
        }
        ErrorKind::Usage
    }
}

fn data(e: &DataError) -> ErrorKind {
    match e {
        // A path that names no file is the file system's answer, as a missing file's.
        DataError::Io { .. } | DataError::NotFound { .. } => ErrorKind::Io,
        // A sample that does not decode is a broken record of the file.
        DataError::Format { .. } | DataError::Sample { .. } => ErrorKind::Format,
        DataError::Config { .. } => ErrorKind::Config,
        DataError::Shape(_) | DataError::Worker { .. } => ErrorKind::Data,
    }
}

fn train(e: &TrainError) -> ErrorKind {
    match e {
        TrainError::Config { .. } | TrainError::ConfigParse { .. } => ErrorKind::Config,
        TrainError::Profile { .. } | TrainError::Environment { .. } => ErrorKind::Config,
        TrainError::Mismatch(_) => ErrorKind::Config,
        TrainError::Checkpoint { .. } | TrainError::Fp8State { .. } => ErrorKind::Checkpoint,
        TrainError::Data { .. } => ErrorKind::Data,
        TrainError::Io { .. } => ErrorKind::Io,
        TrainError::DataLoader(d) | TrainError::Dataset { source: d, .. } => data(d),
        TrainError::NonFinite { .. }
        | TrainError::LossScaleAtMinimum { .. }
        | TrainError::Precision(_) => ErrorKind::Numeric,
        TrainError::Comm(_) => ErrorKind::Comm,
        TrainError::NoGradient { .. }
        | TrainError::Layout(_)
        | TrainError::Model(_)
        | TrainError::Strategy(_)
        | TrainError::Units(_)
        | TrainError::Offload(_)
        | TrainError::Setup(_)
        | TrainError::Candle(_)
        | TrainError::Kernel(_) => ErrorKind::Model,
    }
}

fn plan(e: &PlanError) -> ErrorKind {
    match e {
        PlanError::Io { .. } => ErrorKind::Io,
        _ => ErrorKind::Config,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kind_is_read_through_context_and_transparent_wrappers() {
        let d = DataError::format("x.npy", "shape", "bad");
        let e = anyhow::Error::from(TrainError::DataLoader(d)).context("opening x.npy");
        assert_eq!(ErrorKind::of(&e), ErrorKind::Format);
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = anyhow::Error::from(io).context("reading y");
        assert_eq!(ErrorKind::of(&e), ErrorKind::Io);
        let e = anyhow::anyhow!("--image-dtype f9: expected f32 or bf16");
        assert_eq!(ErrorKind::of(&e), ErrorKind::Usage);
        let e = anyhow::Error::from(stoker_train::error::config_err("batch.micro_batch", "0"));
        assert_eq!(ErrorKind::of(&e).name(), "config");
    }
}
