//! Whether a run continues the run that wrote a checkpoint. The layout check
//! ([`super::load`]) sees only the parameters' shapes: a changed head count, rotary base
//! or norm epsilon keeps every shape, as does another dataset of the same model, and a
//! resume would then go on training another model, or over other samples than the
//! checkpoint's data position counts, silently. The manifest records what a run must
//! keep ([`RunRecord`]) and the training samples it counted; [`check_continues`] compares.

use std::path::Path;

use crate::config::TrainConfig;
use crate::error::{config_err, Result};
use crate::models::ModelConfig;
use crate::precision::Precision;

use super::Resumed;

/// What a checkpoint records of the run that wrote it beyond its state: the seed that
/// orders the data, the model's `[model]` table (resolved: defaults filled in,
/// `init_from` left out) and the precision.
#[derive(Debug, Clone, PartialEq)]
pub struct RunRecord {
    /// `seed`.
    pub seed: u64,
    /// `[model]`, [`ModelConfig::resolved`].
    pub model: ModelConfig,
    /// `precision`.
    pub precision: Precision,
    /// `data.shuffle`, which orders the data with the seed (recorded in the data
    /// position).
    pub shuffle: bool,
}

impl RunRecord {
    /// The record of a run of `config`.
    pub fn of(config: &TrainConfig) -> Self {
        RunRecord {
            seed: config.seed,
            model: config.model.resolved(),
            precision: config.precision,
            shuffle: config.data.shuffle,
        }
    }
}

/// Checks that a run of `ours`, over `train` training data (its sample count and
/// fingerprint; None: not training, as an export), continues the run that wrote the
/// checkpoint `dir` (`saved`). Refused, naming the key: another seed or `data.shuffle`,
/// another model,
/// another number of training samples (another data file or `eval_fraction`) or other
/// samples (another file of the same size). Allowed, with the warnings
/// returned: another precision (the FP32 master weights and the optimizer's moments go
/// on; a loss scaler or FP8 scalers the checkpoint lacks start afresh, as they do at a
/// run's first step). Checkpoints written before a record was kept pass unchecked.
pub fn check_continues(
    saved: &Resumed,
    ours: &RunRecord,
    train: Option<(usize, u32)>,
    dir: &Path,
) -> Result<Vec<String>> {
    let at = dir.display();
    if let Some(seed) = saved.seed.filter(|&s| s != ours.seed) {
        return Err(config_err(
            "seed",
            format!(
                "{}, but the checkpoint {at} was written by a run with seed {seed}: its data \
                 order would not continue",
                ours.seed
            ),
        ));
    }
    check_model(saved.model.as_ref(), &ours.model, dir)?;
    if let Some(then) = saved.data.as_ref().and_then(|d| d.shuffle) {
        if then != ours.shuffle {
            return Err(config_err(
                "data.shuffle",
                format!(
                    "{}, but the checkpoint {at} was written with data.shuffle = {then}: its \
                     data order would not continue",
                    ours.shuffle
                ),
            ));
        }
    }
    let counted = saved.data.as_ref().and_then(|d| d.train_samples);
    let print = saved.data.as_ref().and_then(|d| d.train_crc32);
    if let (Some((_, now)), Some(then)) = (train, print) {
        if now != then && train.map(|t| t.0) == counted {
            return Err(config_err(
                "data.train",
                format!(
                    "its samples differ from those the checkpoint {at} was written over \
                     (fingerprint {now:08x}, then {then:08x}): another data file of the same \
                     size would go on over other samples"
                ),
            ));
        }
    }
    if let (Some((now, _)), Some(then)) = (train, counted) {
        if now != then {
            return Err(config_err(
                "data.train",
                format!(
                    "{now} training samples, but the checkpoint {at} was written over {then}: \
                     another data file, or another data.eval_fraction / data.eval, would \
                     go on over other samples than its data position counts"
                ),
            ));
        }
    }
    let mut warnings = Vec::new();
    if let Some(p) = saved.precision.filter(|&p| p != ours.precision) {
        warnings.push(format!(
            "precision: {}, but the checkpoint {at} was written in {}: the FP32 master \
             weights and the optimizer's moments go on; {}",
            ours.precision.name(),
            p.name(),
            afresh(ours.precision, p)
        ));
    }
    Ok(warnings)
}

/// Checks that `ours` (resolved) is the model whose weights the checkpoint `dir` holds
/// (`saved`, absent in checkpoints written before it was recorded), naming the first
/// key that differs.
pub fn check_model(saved: Option<&ModelConfig>, ours: &ModelConfig, dir: &Path) -> Result<()> {
    let Some((key, here, there)) = saved.and_then(|m| model_change(m, ours)) else {
        return Ok(());
    };
    Err(config_err(
        format!("model.{key}"),
        format!(
            "{here}, but the checkpoint {} was written with {there}: its weights are that \
             model's (to train a changed model from them, export them under the \
             checkpoint's [model] with `stoker export hf` and start from that directory \
             with [model] init_from)",
            dir.display()
        ),
    ))
}

/// What starts afresh when a run in `ours` resumes a checkpoint written in `saved`.
fn afresh(ours: Precision, saved: Precision) -> &'static str {
    match (ours, saved) {
        (Precision::Fp16, _) => "the dynamic loss scaler starts at its initial scale",
        (Precision::Fp8, _) => "the FP8 scalers start with an empty amax history",
        (_, Precision::Fp16) => "the checkpoint's loss-scaler state is not used",
        (_, Precision::Fp8) => "the checkpoint's FP8 scalers are not used",
        _ => "nothing else is kept by precision",
    }
}

/// The first key of `[model]` whose value differs between the checkpoint's (`saved`) and
/// this run's (`ours`), with this run's value and the checkpoint's, as TOML writes them.
fn model_change(saved: &ModelConfig, ours: &ModelConfig) -> Option<(String, String, String)> {
    let table = |m: &ModelConfig| match toml::Value::try_from(m) {
        Ok(toml::Value::Table(t)) => t,
        _ => toml::map::Map::new(),
    };
    let (saved, ours) = (table(saved), table(ours));
    let unset = || "unset".to_string();
    let show = |v: Option<&toml::Value>| v.map_or_else(unset, |v| v.to_string());
    // `kind` first: another model's keys say less than its name.
    let keys = std::iter::once("kind".to_string())
        .chain(ours.keys().cloned())
        .chain(saved.keys().cloned());
    for key in keys {
        let (here, there) = (ours.get(&key), saved.get(&key));
        if here != there {
            let (h, t) = (show(here), show(there));
            return Some((key.clone(), h, format!("{key} = {t}")));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{GptConfig, LlamaConfig};

    fn llama(extra: &str) -> ModelConfig {
        let text =
            format!("vocab = 64\ncontext = 16\nd_model = 32\nn_layer = 2\nn_head = 4\n{extra}");
        ModelConfig::Llama(toml::from_str::<LlamaConfig>(&text).unwrap()).resolved()
    }

    fn saved(model: ModelConfig, precision: Precision) -> Resumed {
        Resumed {
            step: 2,
            sampler: Default::default(),
            data: None,
            seed: Some(3),
            model: Some(model),
            precision: Some(precision),
            elapsed_s: None,
            eval_pending: false,
        }
    }

    fn ours(model: ModelConfig, precision: Precision) -> RunRecord {
        RunRecord {
            seed: 3,
            model,
            precision,
            shuffle: true,
        }
    }

    /// A key left at its default and the same value written out are the same model;
    /// a changed rotary base (no parameter's shape changes) is named with both values.
    #[test]
    fn the_model_is_compared_key_by_key_with_defaults_filled_in() {
        let dir = Path::new("ck");
        let run = ours(llama("n_kv_head = 4\ninit_from = \"hf\""), Precision::Fp32);
        let same = saved(llama(""), Precision::Fp32);
        assert_eq!(
            check_continues(&same, &run, None, dir).unwrap(),
            Vec::<String>::new()
        );
        let other = ours(llama("rope_theta = 500000.0"), Precision::Fp32);
        match check_continues(&same, &other, None, dir) {
            Err(crate::TrainError::Config { key, message }) => {
                assert_eq!(key, "model.rope_theta");
                assert!(
                    message.starts_with(
                        "500000.0, but the checkpoint ck was written with rope_theta = 10000.0"
                    ),
                    "{message}"
                );
            }
            other => panic!("expected model.rope_theta refused, got {other:?}"),
        }
        let gpt = ModelConfig::Gpt(GptConfig {
            vocab: 64,
            context: 16,
            d_model: 32,
            n_layer: 2,
            n_head: 4,
            init_from: None,
        });
        let e = check_model(Some(&llama("")), &gpt, dir).unwrap_err();
        assert!(e.to_string().contains("model.kind"), "{e}");
    }

    /// The manifest's JSON gives back the table bit for bit: without serde_json's
    /// `float_roundtrip`, 7 of 30 random `norm_eps` came back one ulp off, and the same
    /// config's resume was refused.
    #[test]
    fn the_recorded_table_reads_back_bit_for_bit() {
        for eps in ["0.013962865098050427", "9.999999747378752e-06", "0.1"] {
            let m = llama(&format!(
                "norm_eps = {eps}\nrope_theta = 123456.78901234567"
            ));
            let back: ModelConfig =
                serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
            assert_eq!(back, m, "{eps}");
        }
    }

    /// Another precision is allowed and said; a checkpoint from before the record was
    /// kept passes unchecked.
    #[test]
    fn another_precision_warns_and_older_checkpoints_pass() {
        let dir = Path::new("ck");
        let run = ours(llama(""), Precision::Fp8);
        let notes =
            check_continues(&saved(llama(""), Precision::Fp32), &run, Some((9, 0)), dir).unwrap();
        assert_eq!(notes.len(), 1);
        assert!(
            notes[0].starts_with("precision: fp8, but the checkpoint ck was written in fp32")
                && notes[0].ends_with("the FP8 scalers start with an empty amax history"),
            "{}",
            notes[0]
        );
        let older = Resumed {
            seed: None,
            model: None,
            precision: None,
            ..saved(llama(""), Precision::Fp32)
        };
        let other = ours(llama("n_kv_head = 2"), Precision::Bf16);
        assert!(check_continues(&older, &other, Some((9, 0)), dir)
            .unwrap()
            .is_empty());
    }
}
