//! llm.c and nanoGPT token shards: truncations, magic, version and token counts.

use std::path::Path;

use super::npy::bench_case;
use super::Case;

fn llmc(magic: i32, version: i32, ntok: i64, tokens: usize) -> Vec<u8> {
    let mut h = [0i32; 256];
    h[0] = magic;
    h[1] = version;
    h[2] = ntok as i32;
    let mut out: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
    out.extend(std::iter::repeat_n(0u8, 2 * tokens));
    out
}

/// Token shards through `stoker bench loader`: every one is a `format` error.
pub fn cases(dir: &Path, out: &mut Vec<Case>) {
    let valid = llmc(20240520, 1, 300, 300);
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    for n in [4usize, 8, 12, 100, 1023, 1024, 1025, 1024 + 599] {
        files.push((format!("llm.c shard truncated at {n}"), valid[..n].to_vec()));
    }
    for (magic, version, ntok, tokens) in [
        (20240520, 0, 300, 300),
        (20240520, 2, 300, 300),
        (20240520, 99, 300, 300),
        (20240520, 1, 1_000_000_000, 300),
        (20240520, 1, -1, 300),
        (20240520, 1, 301, 300),
        (20240520, 1, 299, 300),
        (20240520, 1, 0, 300),
        (20240520, -7, 300, 300),
    ] {
        files.push((
            format!("llm.c header magic {magic} version {version} tokens {ntok} holding {tokens}"),
            llmc(magic, version, ntok, tokens),
        ));
    }
    for n in [1usize, 3, 1001] {
        files.push((format!("nanoGPT shard of odd length {n}"), vec![1u8; n]));
    }
    files.push(("empty token shard".into(), Vec::new()));
    for (i, (what, bytes)) in files.into_iter().enumerate() {
        let p = dir.join(format!("tok{i}.bin"));
        std::fs::write(&p, bytes).unwrap();
        out.push(bench_case(what, &p, "format"));
    }
}
