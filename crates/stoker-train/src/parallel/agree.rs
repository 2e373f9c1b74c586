//! Ranks refuse to start unless their resolved configs are identical: a rank launched with
//! another file (or an edited copy on another node) would train something else and
//! corrupt the sums silently. Each rank hashes its config; on a mismatch rank 0's config
//! is broadcast and every differing rank names the first key that differs.

use stoker_comm::{CommExt, Communicator};

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};

/// `key = value` for every leaf of `config`, dotted keys in a fixed order.
pub fn flat_keys(config: &TrainConfig) -> Vec<(String, String)> {
    let value = toml::Value::try_from(config).expect("the config serializes to TOML");
    let mut out = Vec::new();
    walk("", &value, &mut out);
    out
}

fn walk(prefix: &str, v: &toml::Value, out: &mut Vec<(String, String)>) {
    match v {
        toml::Value::Table(t) => {
            let mut keys: Vec<&String> = t.keys().collect();
            keys.sort();
            for k in keys {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                walk(&p, &t[k], out);
            }
        }
        other => out.push((prefix.to_string(), other.to_string())),
    }
}

fn text(keys: &[(String, String)]) -> String {
    keys.iter().map(|(k, v)| format!("{k} = {v}\n")).collect()
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Fails on every rank unless all ranks hold the same config; a differing rank's error
/// names the first key whose value differs from rank 0's.
pub fn check_same_config(comm: &dyn Communicator, config: &TrainConfig) -> Result<()> {
    let mine = flat_keys(config);
    let t = text(&mine);
    let n = comm.world_size();
    let mut hashes = vec![0u64; n];
    let counts = vec![1; n];
    comm.all_gather(&[fnv(t.as_bytes())], &counts, &mut hashes)?;
    if hashes.iter().all(|&h| h == hashes[0]) {
        return Ok(());
    }
    // Rank 0's text to everyone, packed into u64 words behind its length.
    let mut len = [t.len() as u64];
    comm.broadcast(&mut len, 0)?;
    let mut words = vec![0u64; (len[0] as usize).div_ceil(8)];
    if comm.rank() == 0 {
        for (w, c) in words.iter_mut().zip(t.as_bytes().chunks(8)) {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            *w = u64::from_le_bytes(b);
        }
    }
    comm.broadcast(&mut words, 0)?;
    let bytes: Vec<u8> = words
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .take(len[0] as usize)
        .collect();
    let theirs: Vec<(String, String)> = String::from_utf8_lossy(&bytes)
        .lines()
        .filter_map(|l| {
            l.split_once(" = ")
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    let differing: Vec<usize> = (0..n).filter(|&r| hashes[r] != hashes[0]).collect();
    if hashes[comm.rank()] == hashes[0] {
        return Err(TrainError::Mismatch(format!(
            "rank(s) {differing:?} hold a config that differs from rank 0's (each names the key); refusing to start"
        )));
    }
    let get = |v: &[(String, String)], k: &str| {
        v.iter()
            .find(|(kk, _)| kk == k)
            .map(|(_, x)| x.clone())
            .unwrap_or_else(|| "(absent)".into())
    };
    let mut keys: Vec<&String> = mine.iter().chain(&theirs).map(|(k, _)| k).collect();
    keys.sort();
    keys.dedup();
    let key = keys
        .into_iter()
        .find(|k| get(&mine, k) != get(&theirs, k))
        .cloned()
        .unwrap_or_else(|| "(none found)".into());
    Err(TrainError::Mismatch(format!(
        "rank {}'s config differs from rank 0's at key `{key}`: {} here, {} on rank 0; refusing to start",
        comm.rank(),
        get(&mine, &key),
        get(&theirs, &key)
    )))
}

/// Fails on every rank unless all ranks opened data of the same size: each rank opens the
/// config's paths on its own host, and a copy of another length there (a relative path
/// from another working directory, a stale copy on another node) would draw its
/// permutation and epochs over other samples, silently (the global batch's samples then
/// depend on which ranks read them).
pub fn check_same_data(
    comm: &dyn Communicator,
    (train, eval): (usize, usize),
    config: &TrainConfig,
) -> Result<()> {
    let n = comm.world_size();
    let mut all = vec![0u64; 2 * n];
    comm.all_gather(&[train as u64, eval as u64], &vec![2; n], &mut all)?;
    let first = (all[0], all[1]);
    let Some(r) = (0..n).find(|&r| (all[2 * r], all[2 * r + 1]) != first) else {
        return Ok(());
    };
    Err(TrainError::Data {
        what: config.data.train.display().to_string(),
        message: format!(
            "rank {r} opened {} training and {} evaluation samples, rank 0 {} and {}: every \
             rank must read the same data (data.train, data.eval; relative paths are read from \
             each rank's working directory)",
            all[2 * r],
            all[2 * r + 1],
            first.0,
            first.1
        ),
    })
}
