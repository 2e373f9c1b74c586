//! `stoker tune loader --write-config`: the chosen loader keys written into the planned
//! config's `[data]` in place, keeping the file's comments, order and other keys as the
//! user wrote them (the config is edited, not re-serialized).

use anyhow::Context;
use toml_edit::{DocumentMut, Item, TableLike};

/// What the tuner chose for `[data]`.
pub struct LoaderKeys {
    /// `data.num_workers`.
    pub num_workers: usize,
    /// `data.prefetch_factor` (written only with workers: nothing to prefetch without).
    pub prefetch_factor: usize,
}

/// `text` (a training config) with `[data]`'s loader keys set to `keys`, a comment `note`
/// above `num_workers`. With workers they are persistent; without, `persistent_workers`
/// is removed (nothing to keep alive; stoker refuses it without workers, as torch does)
/// and `prefetch_factor` left as it is (unused without workers).
pub fn with_loader_keys(text: &str, keys: &LoaderKeys, note: &str) -> anyhow::Result<String> {
    let mut doc: DocumentMut = text.parse().context("the config is not valid TOML")?;
    let data = doc
        .get_mut("data")
        .and_then(Item::as_table_like_mut)
        .context("the config has no [data] table")?;
    set(data, "num_workers", keys.num_workers as i64);
    if keys.num_workers > 0 {
        set(data, "prefetch_factor", keys.prefetch_factor.max(1) as i64);
        set(data, "persistent_workers", true);
    } else {
        data.remove("persistent_workers");
    }
    // An inline table (`data = { ... }`) holds no comment lines.
    if let Some(decor) = doc
        .get_mut("data")
        .and_then(Item::as_table_mut)
        .and_then(|t| t.key_mut("num_workers"))
        .map(|mut k| k.leaf_decor_mut().clone())
    {
        let kept = decor.prefix().and_then(|p| p.as_str()).unwrap_or("");
        // A rerun replaces its own note rather than stacking them.
        let kept: String = kept
            .lines()
            .filter(|l| !l.starts_with(NOTE_MARK))
            .map(|l| format!("{l}\n"))
            .collect();
        if let Some(mut key) = doc
            .get_mut("data")
            .and_then(Item::as_table_mut)
            .and_then(|t| t.key_mut("num_workers"))
        {
            key.leaf_decor_mut()
                .set_prefix(format!("{kept}{NOTE_MARK}{note}\n"));
        }
    }
    Ok(doc.to_string())
}

/// How the note of [`with_loader_keys`] starts, to find it again.
const NOTE_MARK: &str = "# loader set by `stoker tune loader`";

/// Sets `key` to `v`, keeping the comment after an existing value.
fn set(table: &mut dyn TableLike, key: &str, v: impl Into<toml_edit::Value>) {
    let mut v: toml_edit::Value = v.into();
    match table.get_mut(key).and_then(Item::as_value_mut) {
        Some(old) => {
            *v.decor_mut() = old.decor().clone();
            *old = v;
        }
        None => {
            table.insert(key, Item::Value(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = "# my run\nrun_dir = \"r\"\n\n[data]\n# the corpus\ntrain = \"t.bin\"\n\
                          num_workers = 1 # one core here\nprefetch_factor = 4\n\
                          persistent_workers = true\n\n# the model\n[model]\nkind = \"gpt\"\n";

    #[test]
    fn the_loader_keys_are_set_in_place_and_every_comment_kept() {
        let keys = LoaderKeys {
            num_workers: 3,
            prefetch_factor: 2,
        };
        let out = with_loader_keys(CONFIG, &keys, " (900 samples/s measured)").unwrap();
        assert_eq!(
            out,
            "# my run\nrun_dir = \"r\"\n\n[data]\n# the corpus\ntrain = \"t.bin\"\n\
             # loader set by `stoker tune loader` (900 samples/s measured)\n\
             num_workers = 3 # one core here\nprefetch_factor = 2\npersistent_workers = true\n\n\
             # the model\n[model]\nkind = \"gpt\"\n"
        );
        // Again, with no workers: one note, and no persistence.
        let keys = LoaderKeys {
            num_workers: 0,
            prefetch_factor: 2,
        };
        let again = with_loader_keys(&out, &keys, " (1000 samples/s measured)").unwrap();
        assert_eq!(
            again,
            "# my run\nrun_dir = \"r\"\n\n[data]\n# the corpus\ntrain = \"t.bin\"\n\
             # loader set by `stoker tune loader` (1000 samples/s measured)\n\
             num_workers = 0 # one core here\nprefetch_factor = 2\n\n\
             # the model\n[model]\nkind = \"gpt\"\n"
        );
    }

    #[test]
    fn an_inline_data_table_is_set_and_a_missing_one_named() {
        let keys = LoaderKeys {
            num_workers: 2,
            prefetch_factor: 3,
        };
        let out = with_loader_keys("data = { train = \"t.bin\" }\n", &keys, "").unwrap();
        let doc: DocumentMut = out.parse().unwrap();
        assert_eq!(doc["data"]["num_workers"].as_integer(), Some(2));
        assert_eq!(doc["data"]["prefetch_factor"].as_integer(), Some(3));
        let e = with_loader_keys("run_dir = \"r\"\n", &keys, "").unwrap_err();
        assert!(e.to_string().contains("no [data] table"), "{e}");
    }
}
