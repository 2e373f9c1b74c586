//! Property-based fuzzing of every reader in stoker-data: arbitrary bytes, and mutations of
//! valid files (bit flips, truncation at any length, a run of bytes overwritten). Whatever
//! the input, opening and reading everything the reader then offers never panics, never
//! reads past the file, and every error names the file. A short run in `make test`
//! (`PROPTEST_CASES`, default 256 per property); `make fuzz` runs 20,000 each.

use std::path::Path;

use proptest::prelude::*;
use stoker_data::dtype::DType;
use stoker_data::npy::{parse_header, write_npy, NpyArray};
use stoker_data::pack::idx::read_idx;
use stoker_data::records::{RecordPaths, RecordShard, RecordWriter};
use stoker_data::tokens::{write_tokens, TokenFormat, TokenShard};
use stoker_data::transform::{
    ImagePipeline, ImageScratch, ImageTransformConfig, JpegBackend, JpegDecoder, TransformMode,
};

/// A change to a valid file's bytes.
#[derive(Debug, Clone)]
enum Mutation {
    /// Flip bit `bit` of byte `at` (positions taken modulo the length).
    Flip { at: usize, bit: u8 },
    /// Keep the first `len` bytes (modulo the length + 1).
    Truncate { len: usize },
    /// Overwrite from `at` with `bytes`.
    Overwrite { at: usize, bytes: Vec<u8> },
    /// Append `bytes`.
    Append { bytes: Vec<u8> },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        any::<usize>().prop_map(|len| Mutation::Truncate { len }),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Overwrite { at, bytes }),
        prop::collection::vec(any::<u8>(), 1..64).prop_map(|bytes| Mutation::Append { bytes }),
    ]
}

fn mutate(mut v: Vec<u8>, ms: &[Mutation]) -> Vec<u8> {
    for m in ms {
        match m {
            Mutation::Flip { at, bit } if !v.is_empty() => {
                let i = at % v.len();
                v[i] ^= 1 << bit;
            }
            Mutation::Truncate { len } => v.truncate(len % (v.len() + 1)),
            Mutation::Overwrite { at, bytes } if !v.is_empty() => {
                let i = at % v.len();
                for (d, s) in v[i..].iter_mut().zip(bytes) {
                    *d = *s;
                }
            }
            Mutation::Append { bytes } => v.extend(bytes),
            _ => {}
        }
    }
    v
}

/// An error from a reader must name the file it was reading.
fn names(e: &impl std::fmt::Display, path: &Path) -> bool {
    let text = e.to_string();
    text.contains(&*path.to_string_lossy())
        || text.contains(&*path.file_name().unwrap().to_string_lossy())
}

fn valid_npy(dir: &Path) -> Vec<u8> {
    let p = dir.join("valid.npy");
    let data: Vec<u8> = (0..6 * 5 * 4).map(|i| i as u8).collect();
    write_npy(&p, DType::F32, &[6, 5], &data).unwrap();
    std::fs::read(p).unwrap()
}

fn valid_tokens(dir: &Path, format: TokenFormat) -> Vec<u8> {
    let p = dir.join("valid.bin");
    let tokens: Vec<u16> = (0..300).map(|i| (i * 7 % 50) as u16).collect();
    write_tokens(&p, &tokens, format).unwrap();
    std::fs::read(p).unwrap()
}

fn valid_idx(gzip: bool) -> Vec<u8> {
    let mut v = vec![0, 0, 8, 3];
    for d in [5u32, 4, 3] {
        v.extend(d.to_be_bytes());
    }
    v.extend((0..60).map(|i| i as u8));
    if !gzip {
        return v;
    }
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(&v).unwrap();
    e.finish().unwrap()
}

fn valid_jpeg(progressive: bool) -> Vec<u8> {
    let px: Vec<u8> = (0..24 * 16 * 3).map(|i| (i * 37 % 251) as u8).collect();
    let mut out = Vec::new();
    let mut enc = jpeg_encoder::Encoder::new(&mut out, 85);
    enc.set_progressive(progressive);
    enc.encode(&px, 24, 16, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    out
}

proptest! {
    #[test]
    fn npy_header_parser_takes_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let p = Path::new("fuzz.npy");
        if let Err(e) = parse_header(p, &bytes) {
            prop_assert!(names(&e, p), "{e}");
        }
    }

    #[test]
    fn npy_mutations_open_and_read_or_fail_naming_the_file(ms in prop::collection::vec(mutation(), 1..4)) {
        let dir = tempfile::tempdir().unwrap();
        let bytes = mutate(valid_npy(dir.path()), &ms);
        let p = dir.path().join("x.npy");
        std::fs::write(&p, &bytes).unwrap();
        match NpyArray::open(&p) {
            Ok(a) => {
                // Everything it offers lies inside the file.
                let all = a.rows(0, a.len());
                prop_assert!(all.len() <= bytes.len());
                prop_assert_eq!(all.len(), a.len() * a.row_bytes());
            }
            Err(e) => prop_assert!(names(&e, &p), "{e}"),
        }
    }

    #[test]
    fn token_shard_mutations_open_and_read_or_fail_naming_the_file(
        ms in prop::collection::vec(mutation(), 1..4),
        llmc in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let format = if llmc { TokenFormat::Llmc } else { TokenFormat::NanoGpt };
        let bytes = mutate(valid_tokens(dir.path(), format), &ms);
        let p = dir.path().join("x.bin");
        std::fs::write(&p, &bytes).unwrap();
        for opened in [TokenShard::open(&p, format), TokenShard::open_detect(&p)] {
            match opened {
                Ok(t) => {
                    prop_assert!(2 * t.len() <= bytes.len());
                    let sum: u64 = (0..t.len()).map(|i| t.token(i) as u64).sum();
                    prop_assert!(sum <= 65535 * t.len() as u64);
                }
                Err(e) => prop_assert!(names(&e, &p), "{e}"),
            }
        }
    }

    #[test]
    fn record_shard_mutations_open_verify_and_read_or_fail_naming_a_file(
        which in 0usize..3,
        ms in prop::collection::vec(mutation(), 1..4),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("shard");
        let mut w = RecordWriter::create(&prefix).unwrap();
        for r in [b"first".to_vec(), vec![], vec![7u8; 300], b"x".to_vec()] {
            w.append(&r).unwrap();
        }
        w.finish().unwrap();
        let paths = RecordPaths::new(&prefix);
        let target = [&paths.manifest, &paths.index, &paths.data][which].clone();
        let bytes = mutate(std::fs::read(&target).unwrap(), &ms);
        std::fs::write(&target, &bytes).unwrap();
        let files = [&paths.manifest, &paths.index, &paths.data];
        match RecordShard::open(&prefix) {
            Ok(s) => {
                let data_len = std::fs::metadata(&paths.data).unwrap().len() as usize;
                let total: usize = (0..s.len()).map(|i| s.get(i).map_or(0, <[u8]>::len)).sum();
                prop_assert!(total <= data_len);
                if let Err(e) = s.verify() {
                    prop_assert!(files.iter().any(|f| names(&e, f)), "{e}");
                }
            }
            Err(e) => prop_assert!(files.iter().any(|f| names(&e, f)), "{e}"),
        }
    }

    #[test]
    fn idx_mutations_read_or_fail_naming_the_file(
        gzip in any::<bool>(),
        ms in prop::collection::vec(mutation(), 1..4),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("images.idx");
        std::fs::write(&p, mutate(valid_idx(gzip), &ms)).unwrap();
        match read_idx(&p) {
            Ok(a) => {
                let n: usize = a.dims.iter().product();
                prop_assert_eq!(a.data.len(), n);
            }
            Err(e) => prop_assert!(names(&e, &p), "{e}"),
        }
    }

    /// The JPEG decoders (libjpeg-turbo and zune-jpeg) and the whole train and eval
    /// transforms on mutated JPEGs (baseline and progressive): an error or an image of
    /// the size the header gave, never a panic or a write past the output.
    #[test]
    fn jpeg_mutations_decode_and_transform_or_fail(
        progressive in any::<bool>(),
        zune in any::<bool>(),
        train in any::<bool>(),
        ms in prop::collection::vec(mutation(), 1..4),
    ) {
        let jpeg = mutate(valid_jpeg(progressive), &ms);
        let backend = if zune { JpegBackend::Zune } else { JpegBackend::LibjpegTurbo };
        let mut decoder = JpegDecoder::new(backend);
        if let Ok(header) = decoder.header(&jpeg) {
            let mut buf = Vec::new();
            if let Ok(d) = decoder.decode(&jpeg, header, 1, &mut buf) {
                let want = d.width as usize * d.height as usize * d.channels;
                prop_assert!(buf.len() >= want, "{} bytes for {d:?}", buf.len());
            }
        }
        let config = ImageTransformConfig {
            size: 8,
            decoder: backend,
            mode: if train { TransformMode::Train } else { TransformMode::Eval },
            ..ImageTransformConfig::default()
        };
        let pipeline = ImagePipeline::new(config).unwrap();
        let mut out = vec![0u8; pipeline.output_bytes()];
        let _ = pipeline.apply(&jpeg, 7, &mut ImageScratch::default(), &mut out);
    }
}

/// One entry of a generated image folder.
#[derive(Debug, Clone)]
enum Entry {
    /// A file: 0 a valid JPEG, 1 a mutated one, 2 arbitrary bytes, 3 empty.
    File {
        kind: u8,
        ms: Vec<Mutation>,
        junk: Vec<u8>,
    },
    /// A sub-folder with files of kinds `kinds`.
    Dir { kinds: Vec<u8> },
    /// A symbolic link to: 0 the root, 1 its own class folder, 2 the first file written, 3
    /// a missing path, 4 itself.
    Link { to: u8 },
}

fn entry() -> impl Strategy<Value = Entry> {
    prop_oneof![
        4 => (0u8..4, prop::collection::vec(mutation(), 1..3), prop::collection::vec(any::<u8>(), 0..64))
            .prop_map(|(kind, ms, junk)| Entry::File { kind, ms, junk }),
        1 => prop::collection::vec(0u8..4, 0..3).prop_map(|kinds| Entry::Dir { kinds }),
        1 => (0u8..5).prop_map(|to| Entry::Link { to }),
    ]
}

/// Writes a generated tree: class folders `c0..` under `root` with `entries` each.
fn write_tree(root: &Path, classes: &[Vec<Entry>]) {
    let file = |p: &Path, kind: u8, ms: &[Mutation], junk: &[u8]| {
        let bytes = match kind {
            0 => valid_jpeg(false),
            1 => mutate(valid_jpeg(true), ms),
            2 => junk.to_vec(),
            _ => Vec::new(),
        };
        std::fs::write(p, bytes).unwrap();
    };
    let mut first_file = None;
    for (c, entries) in classes.iter().enumerate() {
        let dir = root.join(format!("c{c}"));
        std::fs::create_dir_all(&dir).unwrap();
        for (i, e) in entries.iter().enumerate() {
            let p = dir.join(format!("e{i}.jpg"));
            match e {
                Entry::File { kind, ms, junk } => {
                    file(&p, *kind, ms, junk);
                    first_file.get_or_insert(p);
                }
                Entry::Dir { kinds } => {
                    std::fs::create_dir_all(&p).unwrap();
                    for (j, k) in kinds.iter().enumerate() {
                        file(&p.join(format!("f{j}.jpg")), *k, &[], b"junk");
                    }
                }
                Entry::Link { to } => {
                    let target = match to {
                        0 => root.to_path_buf(),
                        1 => dir.clone(),
                        2 => first_file.clone().unwrap_or_else(|| root.join("missing")),
                        3 => root.join("missing"),
                        _ => p.clone(),
                    };
                    std::os::unix::fs::symlink(target, &p).unwrap();
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).map_or(64, |n: u32| (n / 4).max(64)),
        ..ProptestConfig::default()
    })]

    /// Image folders as directory trees: class folders holding valid, mutated, arbitrary and
    /// empty files, nested folders and symbolic links (to the root, to their own folder, to
    /// a file, to nothing, to themselves). Packing ends (no loop runs forever), never
    /// panics, and either packs exactly the JPEG files reachable once each (every record
    /// then opens and reads back) or fails naming a path inside the tree.
    #[test]
    fn image_folder_trees_pack_or_fail_naming_a_path(
        classes in prop::collection::vec(prop::collection::vec(entry(), 0..5), 0..4),
        skip_non_jpeg in any::<bool>(),
    ) {
        use stoker_data::pack::image_folder::{pack_image_folder_with, PackOptions};
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("photos");
        std::fs::create_dir_all(&root).unwrap();
        write_tree(&root, &classes);
        let out = dir.path().join("packed");
        let options = PackOptions { skip_non_jpeg, ..PackOptions::default() };
        match pack_image_folder_with(&root, &out, &options) {
            Ok(s) => {
                let packed: u64 = s.per_class.iter().sum();
                prop_assert_eq!(packed, s.manifest.records);
                prop_assert_eq!(s.classes.len(), s.per_class.len());
                let shard = RecordShard::open(&out).unwrap();
                prop_assert_eq!(shard.len() as u64, packed);
                for i in 0..shard.len() {
                    let r = shard.get(i).unwrap();
                    prop_assert!(r.starts_with(&[0xFF, 0xD8]), "record {} is not a JPEG", i);
                }
                shard.verify().unwrap();
            }
            Err(e) => {
                let text = e.to_string();
                prop_assert!(
                    text.contains(&*root.display().to_string()) || text.contains(&*out.display().to_string()),
                    "{text}"
                );
            }
        }
    }
}

/// A valid Parquet file of a few documents in two row groups, and the same as JSON Lines.
fn valid_documents() -> (Vec<u8>, Vec<u8>) {
    use arrow_array::{ArrayRef, RecordBatch, StringArray};
    let docs: Vec<String> = (0..12)
        .map(|i| format!("document {i}: some text, données, 名前 {}", "x".repeat(i)))
        .collect();
    let text: ArrayRef = std::sync::Arc::new(StringArray::from_iter_values(docs.iter()));
    let batch = RecordBatch::try_from_iter([("text", text)]).unwrap();
    let props = parquet::file::properties::WriterProperties::builder()
        .set_max_row_group_size(6)
        .build();
    let mut pq = Vec::new();
    let mut w = parquet::arrow::ArrowWriter::try_new(&mut pq, batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let jsonl: String = docs
        .iter()
        .map(|d| serde_json::json!({ "text": d }).to_string() + "\n")
        .collect();
    (pq, jsonl.into_bytes())
}

proptest! {
    #[test]
    fn document_file_mutations_pack_or_fail_naming_the_file(
        ms in prop::collection::vec(mutation(), 1..4),
        parquet in any::<bool>(),
    ) {
        use stoker_data::pack::docs::{pack_docs, DocsOptions};
        use stoker_data::pack::text::Tokenizer;
        let dir = tempfile::tempdir().unwrap();
        let (pq, jsonl) = valid_documents();
        let (name, bytes) = match parquet {
            true => ("d.parquet", mutate(pq, &ms)),
            false => ("d.jsonl", mutate(jsonl, &ms)),
        };
        let p = dir.path().join(name);
        std::fs::write(&p, &bytes).unwrap();
        let opts = DocsOptions {
            field: "text".into(),
            tokenizer: Tokenizer::Gpt2,
            shard_tokens: 64,
            val_tokens: 16,
        };
        match pack_docs(std::slice::from_ref(&p), &dir.path().join("out/x"), &opts) {
            // A document a mutation left valid: what was read is within the file's bytes.
            Ok(s) => prop_assert!(s.text_bytes <= 8 * bytes.len() as u64 + 1024),
            Err(e) => prop_assert!(names(&e, &p), "{e}"),
        }
    }
}
