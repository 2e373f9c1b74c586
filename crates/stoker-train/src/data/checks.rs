//! What the opened data must agree on before a run's first step: with the model (class
//! ids inside `model.classes`, the evaluated token ids inside `model.vocab`), with the
//! vocabulary (`data.vocab` against the `PREFIX.vocab.json` `stoker pack` wrote beside a
//! shard), and between the training and evaluation sets (the same class names in the
//! same order, an evaluation set that holds samples). Unchecked, each surfaced mid-run,
//! or after the whole run at its first evaluation with no checkpoint written, or never:
//! an evaluation set packed with another character map was evaluated silently.

use std::path::Path;

use stoker_data::image_folder::classes_path;
use stoker_data::pack::shard_writer::shard_prefix;
use stoker_data::pack::text::Vocab;
use stoker_data::{AnyDataset, Dataset};

use super::{for_each_sample, Datasets, Subset};
use crate::config::TrainConfig;
use crate::error::{config_err, Result, TrainError};
use crate::loss::IGNORE_INDEX;

/// Runs every check on the opened `data` of `config`.
pub fn check_data(config: &TrainConfig, data: &Datasets) -> Result<()> {
    let d = &config.data;
    let eval_key = if data.held_out {
        "data.train"
    } else {
        "data.eval"
    };
    let eval_path = d.eval.as_deref().unwrap_or(&d.train);
    if data.eval.len() == 0 {
        return Err(TrainError::Data {
            what: format!("{} ({eval_key})", eval_path.display()),
            message: "holds no samples to evaluate on".into(),
        });
    }
    if let Some(classes) = config.model.classes() {
        // The class names first: a list longer than model.classes says more than the
        // first id past it.
        check_class_names(&d.train, d.eval.as_deref(), classes)?;
        for (ds, path, key) in [
            (&data.train, &*d.train, "data.train"),
            (&data.eval, eval_path, eval_key),
        ] {
            check_one_id_per_sample(ds, &data.target, path, key)?;
        }
        check_class_ids(&data.train, &data.target, classes, &d.train, "data.train")?;
        if !data.held_out {
            check_class_ids(&data.eval, &data.target, classes, eval_path, "data.eval")?;
        }
    }
    // `data.vocab` itself was read, and checked against the model, at open (`load_vocab`).
    if let Some(vocab) = &d.vocab {
        for (path, key) in [
            (Some(&*d.train), "data.train"),
            (d.eval.as_deref(), "data.eval"),
        ] {
            if let Some(path) = path {
                check_vocab_beside(path, key, (vocab, "data.vocab", "data.vocab"))?;
            }
        }
    } else if let (Some(eval), Some(train_vocab)) = (d.eval.as_deref(), vocab_beside(&d.train)) {
        // Without data.vocab: the evaluation shards' vocabulary is the training shards'.
        let against = (
            &*train_vocab,
            "data.train",
            "the training shards' vocabulary",
        );
        check_vocab_beside(eval, "data.eval", against)?;
    }
    // The token windows evaluation reads (each checked against model.vocab as it is
    // read): the training windows are read from the first step on, these only at the
    // first evaluation, after training.
    // Token ids saved as arrays: every id of the files, read once (a shard's windows are
    // checked as each is read; an array's would fail inside the step, naming no file).
    if let Some(vocab) = config.model.vocab() {
        check_token_arrays(&data.train, data, vocab, &d.train, "data.train")?;
        if !data.held_out {
            check_token_arrays(&data.eval, data, vocab, eval_path, eval_key)?;
        }
    }
    if let AnyDataset::Tokens(_) = &**data.eval.inner() {
        let wanted = config.train.eval_batches.max(1) * config.batch.micro_batch;
        for_each_sample(&data.eval, 0..wanted.min(data.eval.len()), |_| {}).map_err(|source| {
            TrainError::Dataset {
                key: eval_key.into(),
                source,
            }
        })?;
    }
    Ok(())
}

/// A classifier's target is one class id per sample (a token model's, one per input
/// token, is its windows' own): an image named as the target failed inside the loss.
fn check_one_id_per_sample(
    ds: &Subset<AnyDataset>,
    target: &str,
    path: &Path,
    key: &str,
) -> Result<()> {
    match ds.fields().iter().find(|f| f.name == target) {
        Some(f) if f.sample_elements() != 1 => Err(TrainError::Data {
            what: format!("{} ({key}) field `{target}`", path.display()),
            message: format!(
                "shape {:?} per sample: a classifier's target is one class id per sample \
                 (config key data.target_field)",
                f.shape
            ),
        }),
        _ => Ok(()),
    }
}

/// Checks every class id of `ds`'s field `target` (the whole file under the subset; one id
/// per sample, [`check_one_id_per_sample`] checked first) is in `0..classes` or the
/// ignored index, naming the file, the key and the sample.
fn check_class_ids(
    ds: &Subset<AnyDataset>,
    target: &str,
    classes: usize,
    path: &Path,
    key: &str,
) -> Result<()> {
    let outside = |id: i64| id != IGNORE_INDEX && !(0..classes as i64).contains(&id);
    let bad = match &**ds.inner() {
        AnyDataset::Images(im) => im
            .labels()
            .iter()
            .enumerate()
            .find(|&(_, &id)| outside(id))
            .map(|(at, &id)| (at, id)),
        AnyDataset::Arrays(a) => {
            let Some(i) = a.fields().iter().position(|f| f.name == target) else {
                return Ok(());
            };
            let arr = &a.arrays()[i];
            // Other dtypes are refused by the field check before this one.
            super::first_id_where(arr.dtype(), arr.bytes(), outside)
        }
        AnyDataset::Tokens(_) => return Ok(()),
    };
    match bad {
        None => Ok(()),
        Some((at, id)) => Err(TrainError::Data {
            what: format!("{} ({key}) field `{target}`", path.display()),
            message: format!(
                "class id {id} at sample {at} is outside 0..{classes} (model.classes)"
            ),
        }),
    }
}

/// Every id of the input and target arrays under `ds` (token windows saved as `.npy`) is
/// in `0..vocab` (a target may also be the ignored index), naming the file, the key and
/// the sample.
fn check_token_arrays(
    ds: &Subset<AnyDataset>,
    data: &Datasets,
    vocab: usize,
    path: &Path,
    key: &str,
) -> Result<()> {
    let AnyDataset::Arrays(a) = &**ds.inner() else {
        return Ok(());
    };
    for (name, ignored) in [(&data.input, None), (&data.target, Some(IGNORE_INDEX))] {
        let Some(i) = a.fields().iter().position(|f| &f.name == name) else {
            continue;
        };
        let (arr, per) = (&a.arrays()[i], a.fields()[i].sample_elements().max(1));
        let outside = |id: i64| Some(id) != ignored && !(0..vocab as i64).contains(&id);
        if let Some((at, id)) = super::first_id_where(arr.dtype(), arr.bytes(), outside) {
            return Err(TrainError::Data {
                what: format!(
                    "{} ({key}, {}) field `{name}`",
                    arr.path().display(),
                    path.display()
                ),
                message: format!(
                    "token id {id} at sample {}, position {} is outside 0..{vocab} (model.vocab)",
                    at / per,
                    at % per
                ),
            });
        }
    }
    Ok(())
}

/// The class names `stoker pack images` wrote beside the training and evaluation records
/// (`PREFIX.classes.json`), where both have them: the same names in the same order (a
/// label is a position in that list), and no more of them than `model.classes`.
fn check_class_names(train: &Path, eval: Option<&Path>, classes: usize) -> Result<()> {
    let read = |prefix: &Path| -> Result<Option<(std::path::PathBuf, Vec<String>)>> {
        let path = classes_path(prefix);
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read(&path).map_err(|e| crate::error::io_err(&path, e))?;
        let names: Vec<String> = serde_json::from_slice(&text).map_err(|e| TrainError::Data {
            what: path.display().to_string(),
            message: format!("expected a JSON list of class names: {e}"),
        })?;
        Ok(Some((path, names)))
    };
    let Some((train_file, names)) = read(train)? else {
        return Ok(());
    };
    if names.len() > classes {
        return Err(config_err(
            "model.classes",
            format!(
                "{classes}, but {} names {} classes",
                train_file.display(),
                names.len()
            ),
        ));
    }
    if let Some((eval_file, eval_names)) = eval.map(read).transpose()?.flatten() {
        if eval_names != names {
            return Err(TrainError::Data {
                what: format!("{} (data.eval)", eval_file.display()),
                message: format!(
                    "classes {eval_names:?}, but the training records' {} are {names:?}: a \
                     label is a position in that list, so the evaluation labels would mean \
                     other classes (pack both from folders with the same class names)",
                    train_file.display()
                ),
            });
        }
    }
    Ok(())
}

/// The vocabulary `stoker pack` wrote beside the token shard (or shard pattern) `shard`:
/// `pack text`'s X.bin has X.vocab.json; `pack docs`' PREFIX_train_000001.bin (or the
/// pattern PREFIX_train_*.bin) has PREFIX.vocab.json.
fn vocab_beside(shard: &Path) -> Option<std::path::PathBuf> {
    if shard.extension().is_none_or(|e| e != "bin") {
        return None;
    }
    [
        Some(shard.with_extension("vocab.json")),
        shard_prefix(shard).map(|p| stoker_data::paths::prefixed(&p, ".vocab.json")),
    ]
    .into_iter()
    .flatten()
    .find(|p| p.is_file())
}

/// A token shard with a vocabulary beside it must have been packed with `vocab`: the file
/// `data.vocab` names, or where none is given the training shards' own (`vocab_key` is the
/// key that names it, `against` how the message calls it). A character vocabulary is made
/// per `stoker pack` call, so a shard packed on its own maps ids to other characters.
fn check_vocab_beside(
    shard: &Path,
    key: &str,
    (vocab, vocab_key, against): (&Path, &str, &str),
) -> Result<()> {
    let Some(beside) = vocab_beside(shard) else {
        return Ok(());
    };
    let same_file = |a: &Path, b: &Path| matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y);
    if same_file(&beside, vocab) {
        return Ok(());
    }
    let load = |p: &Path, key: &str| {
        Vocab::load(p).map_err(|source| TrainError::Dataset {
            key: key.into(),
            source,
        })
    };
    if load(&beside, key)? == load(vocab, vocab_key)? {
        return Ok(());
    }
    Err(TrainError::Data {
        what: format!("{} ({key})", shard.display()),
        message: format!(
            "packed with the vocabulary {}, which differs from {against} {}: its token ids \
             would be read as other tokens (pack the files together, or with the same \
             vocabulary)",
            beside.display(),
            vocab.display()
        ),
    })
}
