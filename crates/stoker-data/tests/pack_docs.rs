//! `pack_docs`: users' documents (Parquet, JSON Lines) to llm.c token shards. The tests
//! write their own Parquet (arrow's writer, several row groups) and JSON Lines files.
//!
//! - The same documents from Parquet and from JSON Lines give the same shards, and their
//!   tokens are GPT-2's BPE of each document (`encode_ordinary`) with the end-of-text
//!   token after it, in order, across the shards: whole documents in the validation
//!   shard up to `val_tokens`, training shards of exactly `shard_tokens` but the last.
//! - A pattern of shards opens as one dataset of windows over all of them.
//! - Characters: the vocabulary of the characters seen, the end-of-text token last.
//! - Bad input fails naming the file, the row group or line, and the field.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;
use stoker_data::pack::docs::{pack_docs, DocsOptions, END_OF_TEXT};
use stoker_data::pack::text::{Tokenizer, Vocab};
use stoker_data::{open_dataset, Dataset, OpenOptions, TokenShard};

/// Documents of realistic variety: words, punctuation, newlines, non-ASCII, an empty one.
fn documents(n: usize) -> Vec<String> {
    let words = [
        "the",
        "training",
        "step",
        "keeps",
        "accelerators",
        "fed:",
        "données",
        "und",
        "名前",
        "GPU's",
        "memory,",
        "2048",
        "tokens.",
        "\n",
        "  ",
        "emoji🙂",
        "end",
    ];
    let mut z = 0x9E37_79B9_7F4A_7C15u64;
    (0..n)
        .map(|i| {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = match i % 11 {
                0 => 0,
                _ => 1 + (z >> 40) as usize % 120,
            };
            (0..len)
                .map(|k| words[((z >> 20) as usize + k * 7) % words.len()])
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

fn write_parquet(path: &Path, docs: &[String], rows_per_group: usize) {
    let file = std::fs::File::create(path).unwrap();
    let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..docs.len() as i64));
    let text: ArrayRef = Arc::new(StringArray::from_iter_values(docs.iter()));
    let batch = RecordBatch::try_from_iter([("id", ids), ("text", text)]).unwrap();
    let props = WriterProperties::builder()
        .set_max_row_group_size(rows_per_group)
        .build();
    let mut w = ArrowWriter::try_new(file, batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

fn write_jsonl(path: &Path, docs: &[String]) {
    let lines: Vec<String> = docs
        .iter()
        .enumerate()
        .map(|(i, d)| serde_json::json!({"id": i, "text": d}).to_string())
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

fn shard_tokens(paths: &[(PathBuf, usize)]) -> Vec<u16> {
    let mut out = Vec::new();
    for (p, n) in paths {
        let s = TokenShard::open_detect(p).unwrap();
        assert_eq!(s.len(), *n, "{}", p.display());
        out.extend((0..s.len()).map(|i| s.token(i)));
    }
    out
}

fn gpt2(field: &str, shard: usize, val: usize) -> DocsOptions {
    DocsOptions {
        field: field.into(),
        tokenizer: Tokenizer::Gpt2,
        shard_tokens: shard,
        val_tokens: val,
    }
}

#[test]
fn parquet_and_jsonl_give_gpt2_s_tokens_of_each_document_then_end_of_text() {
    let dir = tempfile::tempdir().unwrap();
    let docs = documents(700);
    // A directory of Parquet shards (read in name order) and one JSON Lines file.
    let pq_dir = dir.path().join("parquet");
    std::fs::create_dir_all(&pq_dir).unwrap();
    write_parquet(&pq_dir.join("a.parquet"), &docs[..400], 64);
    write_parquet(&pq_dir.join("b.parquet"), &docs[400..], 100);
    write_jsonl(&dir.path().join("all.jsonl"), &docs);
    let (shard, val) = (5000, 3000);
    let pq = pack_docs(
        &[pq_dir],
        &dir.path().join("out/pq"),
        &gpt2("text", shard, val),
    )
    .unwrap();
    let js = pack_docs(
        &[dir.path().join("all.jsonl")],
        &dir.path().join("out/js"),
        &gpt2("text", shard, val),
    )
    .unwrap();
    assert_eq!((pq.documents, js.documents), (700, 700));
    assert_eq!(
        pq.text_bytes,
        docs.iter().map(|d| d.len() as u64).sum::<u64>()
    );
    let bpe = tiktoken_rs::r50k_base().unwrap();
    let want: Vec<Vec<u16>> = docs
        .iter()
        .map(|d| {
            let mut t: Vec<u16> = bpe
                .encode_ordinary(d)
                .into_iter()
                .map(|x| x as u16)
                .collect();
            t.push(50_256);
            t
        })
        .collect();
    let flat: Vec<u16> = want.concat();
    for s in [&pq, &js] {
        let (v, t) = (shard_tokens(&s.shards.val), shard_tokens(&s.shards.train));
        assert_eq!([v.clone(), t.clone()].concat(), flat);
        // The validation split is whole documents, the fewest that reach val_tokens.
        let mut at = 0;
        let whole = want
            .iter()
            .position(|d| {
                at += d.len();
                at >= val
            })
            .unwrap();
        assert_eq!(v.len(), at, "whole documents up to {whole}");
        assert_eq!(v.last(), Some(&50_256));
        let sizes: Vec<usize> = s.shards.train.iter().map(|(_, n)| *n).collect();
        assert!(
            sizes[..sizes.len() - 1].iter().all(|&n| n == shard),
            "{sizes:?}"
        );
        assert!(*sizes.last().unwrap() <= shard);
        assert_eq!(s.vocab_size, 50_257);
        assert_eq!(
            Vocab::load(&s.vocab_path).unwrap().end_of_text(),
            Some(50_256)
        );
    }
    // Names: PREFIX_val_000000.bin, then PREFIX_train_000001.bin, ...
    assert!(pq.shards.val[0].0.ends_with("pq_val_000000.bin"));
    assert!(pq.shards.train[0].0.ends_with("pq_train_000001.bin"));
    // The training shards open as one dataset through a pattern.
    let opts = OpenOptions {
        context: 32,
        ..OpenOptions::default()
    };
    let ds = open_dataset(dir.path().join("out/pq_train_*.bin"), &opts).unwrap();
    let windows: usize = pq.shards.train.iter().map(|(_, n)| (n - 1) / 32).sum();
    assert_eq!(ds.len(), windows);
    let e = match open_dataset(dir.path().join("out/none_*.bin"), &opts) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a pattern that matches nothing opened"),
    };
    assert!(
        e.contains("none_*.bin") && e.contains("no file matches"),
        "{e}"
    );
    // A context no one shard can fill: named as the shards' length, not the sum's
    // (before: "N tokens: not one window", N the whole set's count).
    let longest = pq.shards.train.iter().map(|(_, n)| *n).max().unwrap();
    let wide = OpenOptions {
        context: longest,
        ..OpenOptions::default()
    };
    let e = match open_dataset(dir.path().join("out/pq_train_*.bin"), &wide) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("windows longer than every shard opened"),
    };
    assert!(
        e.contains(&format!(
            "the longest {longest}: a window never spans shards"
        )) && e.contains("--shard-tokens"),
        "{e}"
    );
}

#[test]
fn characters_make_their_vocabulary_with_the_end_of_text_token_last() {
    let dir = tempfile::tempdir().unwrap();
    let docs = documents(50);
    write_jsonl(&dir.path().join("d.jsonl"), &docs);
    let opts = DocsOptions {
        field: "text".into(),
        tokenizer: Tokenizer::Char,
        shard_tokens: 1 << 20,
        val_tokens: 0,
    };
    let s = pack_docs(&[dir.path().join("d.jsonl")], &dir.path().join("c"), &opts).unwrap();
    assert!(s.shards.val.is_empty());
    let vocab = Vocab::load(&s.vocab_path).unwrap();
    let Vocab::Char { tokens } = &vocab else {
        panic!("a character vocabulary")
    };
    assert_eq!(tokens.last().map(String::as_str), Some(END_OF_TEXT));
    let eot = vocab.end_of_text().unwrap();
    assert_eq!(eot as usize, tokens.len() - 1);
    let ids: Vec<u32> = shard_tokens(&s.shards.train)
        .into_iter()
        .map(u32::from)
        .collect();
    let want: String = docs.iter().map(|d| format!("{d}{END_OF_TEXT}")).collect();
    assert_eq!(vocab.decode(&ids), want);
}

#[test]
fn bad_documents_fail_naming_the_file_the_place_and_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let docs = documents(40);
    let opts = gpt2("text", 1000, 0);
    let fails = |inputs: &[PathBuf], opts: &DocsOptions| {
        pack_docs(inputs, &d.join("out/x"), opts)
            .unwrap_err()
            .to_string()
    };
    // Parquet: another column name, a column of numbers, nulls, a truncated file.
    write_parquet(&d.join("ok.parquet"), &docs, 10);
    let e = fails(&[d.join("ok.parquet")], &gpt2("content", 1000, 0));
    assert!(
        e.contains("ok.parquet") && e.contains("content") && e.contains("no such column"),
        "{e}"
    );
    let e = fails(&[d.join("ok.parquet")], &gpt2("id", 1000, 0));
    assert!(
        e.contains("ok.parquet") && e.contains("id") && e.contains("expected strings"),
        "{e}"
    );
    let nulls: ArrayRef = Arc::new(StringArray::from(vec![Some("a"), None, Some("c")]));
    let batch = RecordBatch::try_from_iter([("text", nulls)]).unwrap();
    let f = std::fs::File::create(d.join("nulls.parquet")).unwrap();
    let mut w = ArrowWriter::try_new(f, batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let e = fails(&[d.join("nulls.parquet")], &opts);
    assert!(
        e.contains("nulls.parquet") && e.contains("row group 0") && e.contains("row 1 is null"),
        "{e}"
    );
    // Row groups of 10, 3 and 2 rows, a null at the file's row 14: row group 2's row 1.
    let f = std::fs::File::create(d.join("groups.parquet")).unwrap();
    let texts = |n: usize, null_at: Option<usize>| {
        let col: ArrayRef = Arc::new(StringArray::from(
            (0..n)
                .map(|i| (Some(i) != null_at).then_some("doc"))
                .collect::<Vec<_>>(),
        ));
        RecordBatch::try_from_iter_with_nullable([("text", col, true)]).unwrap()
    };
    let mut w = ArrowWriter::try_new(f, texts(1, None).schema(), None).unwrap();
    for (n, null_at) in [(10, None), (3, None), (2, Some(1))] {
        w.write(&texts(n, null_at)).unwrap();
        w.flush().unwrap();
    }
    w.close().unwrap();
    let e = fails(&[d.join("groups.parquet")], &opts);
    assert!(
        e.contains("groups.parquet: row group 2, column text")
            && e.contains("row 14 is null (row 1 of the group)"),
        "{e}"
    );
    let bytes = std::fs::read(d.join("ok.parquet")).unwrap();
    std::fs::write(d.join("cut.parquet"), &bytes[..bytes.len() / 2]).unwrap();
    let e = fails(&[d.join("cut.parquet")], &opts);
    assert!(
        e.contains("cut.parquet") && e.contains("footer") && e.contains("truncated"),
        "{e}"
    );
    // JSON Lines: a number where the text is, no text, bytes that are not UTF-8, a line cut.
    let jl = |name: &str, body: &[u8]| {
        std::fs::write(d.join(name), body).unwrap();
        fails(&[d.join(name)], &opts)
    };
    let e = jl("num.jsonl", b"{\"text\": \"a\"}\n{\"text\": 7}\n");
    assert!(
        e.contains("num.jsonl") && e.contains("line 2, field text") && e.contains("a number"),
        "{e}"
    );
    let e = jl("missing.jsonl", b"{\"text\": \"a\"}\n{\"body\": \"b\"}\n");
    assert!(
        e.contains("missing.jsonl") && e.contains("line 2, field text") && e.contains("missing"),
        "{e}"
    );
    let e = jl(
        "latin1.jsonl",
        b"{\"text\": \"ok\"}\n{\"text\": \"caf\xe9\"}\n",
    );
    assert!(
        e.contains("latin1.jsonl") && e.contains("line 2") && e.contains("not UTF-8"),
        "{e}"
    );
    let e = jl("cut.jsonl", b"{\"text\": \"a\"}\n{\"text\": \"b");
    assert!(
        e.contains("cut.jsonl") && e.contains("line 2") && e.contains("truncated"),
        "{e}"
    );
    // A file that is one JSON array, on one line or over several: not JSON Lines.
    let e = jl("array.json", b"[{\"text\": \"a\"}, {\"text\": \"b\"}]\n");
    assert!(
        e.contains("array.json") && e.contains("a JSON array, expected an object"),
        "{e}"
    );
    let e = jl("pretty.json", b"[\n  {\"text\": \"a\"}\n]\n");
    assert!(
        e.contains("pretty.json") && e.contains("is not JSON Lines"),
        "{e}"
    );
    // Inputs: a file of another kind, an empty directory.
    std::fs::write(d.join("notes.txt"), "x").unwrap();
    let e = fails(&[d.join("notes.txt")], &opts);
    assert!(
        e.contains("notes.txt") && e.contains(".parquet or .jsonl"),
        "{e}"
    );
    std::fs::create_dir_all(d.join("empty")).unwrap();
    let e = fails(&[d.join("empty")], &opts);
    assert!(
        e.contains("empty") && e.contains("no .parquet or .jsonl"),
        "{e}"
    );
}

#[test]
fn a_directory_is_read_with_its_sub_directories_and_names_what_it_passes_over() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("hub");
    let docs = documents(90);
    std::fs::create_dir_all(d.join("data/more")).unwrap();
    std::fs::create_dir_all(d.join(".cache")).unwrap();
    // Read, in path order: a.parquet, data/B.PARQUET, data/more/c.jsonl.
    write_parquet(&d.join("a.parquet"), &docs[..30], 8);
    write_parquet(&d.join("data/B.PARQUET"), &docs[30..60], 8);
    write_jsonl(&d.join("data/more/c.jsonl"), &docs[60..]);
    // Passed over and named: a dataset card. Hidden: left out without a word.
    std::fs::write(d.join("README.md"), "# a dataset card").unwrap();
    write_jsonl(&d.join(".cache/stale.jsonl"), &docs[..5]);
    let s = pack_docs(
        std::slice::from_ref(&d),
        &dir.path().join("out/x"),
        &gpt2("text", 1 << 20, 0),
    )
    .unwrap();
    assert_eq!(s.documents, 90);
    assert_eq!(s.passed_over, vec![d.join("README.md")]);
    let bpe = tiktoken_rs::r50k_base().unwrap();
    let want: Vec<u16> = docs
        .iter()
        .flat_map(|doc| {
            let mut t: Vec<u16> = bpe
                .encode_ordinary(doc)
                .into_iter()
                .map(|t| t as u16)
                .collect();
            t.push(50256);
            t
        })
        .collect();
    assert_eq!(shard_tokens(&s.shards.train), want);
    // A compressed data file is refused, not passed over: it is data this cannot read.
    std::fs::write(d.join("data/more/d.jsonl.gz"), b"\x1f\x8b").unwrap();
    let e = pack_docs(
        std::slice::from_ref(&d),
        &dir.path().join("out/y"),
        &gpt2("text", 1 << 20, 0),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("d.jsonl.gz") && e.contains("decompress it first"),
        "{e}"
    );
}

#[test]
fn an_earlier_pack_s_shards_at_the_prefix_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_jsonl(&d.join("a.jsonl"), &documents(200));
    let opts = gpt2("text", 500, 300);
    let first = pack_docs(&[d.join("a.jsonl")], &d.join("out/x"), &opts).unwrap();
    assert!(first.shards.train.len() > 1);
    // Another prefix beside it that starts with the same letters is not an earlier pack.
    pack_docs(&[d.join("a.jsonl")], &d.join("out/x2"), &opts).unwrap();
    let e = pack_docs(&[d.join("a.jsonl")], &d.join("out/x"), &opts)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("x_val_000000.bin")
            && e.contains("x_train_000001.bin")
            && !e.contains("x2_")
            && e.contains("remove them"),
        "{e}"
    );
}

/// A prefix that names a folder (`out/`, or an existing folder) is refused by name before
/// anything is read or written (before: `out/` wrote `out/_train_000001.bin` and a hidden
/// `out/.vocab.json`, over an earlier pack's shards there, which were not seen and then
/// trained on beside the new ones).
#[test]
fn a_prefix_that_names_a_folder_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_jsonl(&d.join("a.jsonl"), &documents(50));
    std::fs::create_dir(d.join("there")).unwrap();
    let opts = gpt2("text", 500, 0);
    let slash = format!("{}/", d.join("out").display());
    for prefix in [PathBuf::from(&slash), d.join("there")] {
        let e = pack_docs(&[d.join("a.jsonl")], &prefix, &opts)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("output prefix") && e.contains("names a folder"),
            "{prefix:?}: {e}"
        );
    }
    assert!(!d.join("out").exists(), "nothing written for out/");
    let there: Vec<_> = std::fs::read_dir(d.join("there")).unwrap().collect();
    assert!(there.is_empty(), "nothing written in there/");
    let t = stoker_data::pack::text::pack_text(
        &[d.join("a.jsonl")],
        Path::new(&slash),
        Tokenizer::Char,
    );
    assert!(t.is_err(), "pack text too");
}

/// A data page whose bytes do not match its CRC32 (pyarrow's `write_page_checksum`; the
/// fixture is `scripts/fixtures/make_parquet.py`'s) is refused, naming the file, row group
/// and column (before: packed as read, one letter changed).
#[test]
fn a_parquet_page_that_fails_its_checksum_is_refused() {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parquet/page_checksums.parquet");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let good = pack_docs(
        std::slice::from_ref(&fixture),
        &d.join("out/good"),
        &gpt2("text", 1 << 20, 0),
    )
    .unwrap();
    assert_eq!(good.documents, 40);
    let mut bytes = std::fs::read(&fixture).unwrap();
    let at = bytes
        .windows(16)
        .position(|w| w == b"Document 7: hell")
        .expect("uncompressed text in the fixture");
    bytes[at + 13] = b'X';
    let bad = d.join("bad.parquet");
    std::fs::write(&bad, bytes).unwrap();
    let e = pack_docs(&[bad], &d.join("out/bad"), &gpt2("text", 1 << 20, 0))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad.parquet")
            && e.contains("row group 0, column text")
            && e.contains("CRC checksum mismatch"),
        "{e}"
    );
}

/// `pack text` of no text is refused by name, as `pack docs` warns of no shard (before:
/// "packed 0 tokens", exit 0, and the run found "not one window" at its start).
#[test]
fn pack_text_of_no_text_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let e = stoker_data::pack::text::pack_text(
        std::slice::from_ref(&empty),
        dir.path().join("out/e"),
        Tokenizer::Char,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("empty.txt") && e.contains("no text to pack"),
        "{e}"
    );
    assert!(!dir.path().join("out").exists(), "nothing written");
}

/// What Python writes and reads as JSON Lines: `NaN` / `Infinity` in a field beside the
/// text (Python's `json.dumps` default) and a byte-order mark before the first line
/// (`utf-8-sig`) pack as the same documents (before: "not a JSON object" for the whole
/// file); a text field that is `NaN` is refused as null, by field.
#[test]
fn python_s_json_lines_pack_as_python_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let opts = DocsOptions {
        field: "text".into(),
        tokenizer: Tokenizer::Char,
        shard_tokens: 1 << 20,
        val_tokens: 0,
    };
    let plain = "{\"text\": \"first\", \"score\": 0.5}\n{\"text\": \"second\", \"score\": 1.0}\n";
    let python = "\u{feff}{\"text\": \"first\", \"score\": NaN}\n{\"text\": \"second\", \"score\": [Infinity, -Infinity]}\n";
    let mut ids = Vec::new();
    for (name, text) in [("plain", plain), ("python", python)] {
        let path = d.join(format!("{name}.jsonl"));
        std::fs::write(&path, text).unwrap();
        let s = pack_docs(&[path], &d.join(name), &opts).unwrap();
        ids.push(shard_tokens(&s.shards.train));
    }
    assert_eq!(ids[0], ids[1]);
    let path = d.join("nan_text.jsonl");
    std::fs::write(&path, "{\"text\": NaN}\n").unwrap();
    let e = pack_docs(&[path], &d.join("nan_text"), &opts)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("line 1, field text") && e.contains("null"),
        "{e}"
    );
}

/// A JSON Lines string with an unpaired UTF-16 surrogate (what Python's `json.dumps`
/// writes for text decoded with `surrogateescape`) packs with U+FFFD in its place, and the
/// summary counts it with its first line (before: "not a JSON object" for the whole file).
#[test]
fn python_s_unpaired_surrogates_pack_as_the_replacement_character() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let opts = DocsOptions {
        field: "text".into(),
        tokenizer: Tokenizer::Char,
        shard_tokens: 1 << 20,
        val_tokens: 0,
    };
    let lone = d.join("lone.jsonl");
    std::fs::write(
        &lone,
        "{\"text\": \"ok \\ud83d\\ude00\"}\n{\"text\": \"lone \\ud800 and \\udfff\"}\n",
    )
    .unwrap();
    let replaced = d.join("replaced.jsonl");
    std::fs::write(
        &replaced,
        "{\"text\": \"ok \u{1f600}\"}\n{\"text\": \"lone \u{fffd} and \u{fffd}\"}\n",
    )
    .unwrap();
    let a = pack_docs(std::slice::from_ref(&lone), &d.join("a"), &opts).unwrap();
    let b = pack_docs(&[replaced], &d.join("b"), &opts).unwrap();
    assert_eq!(shard_tokens(&a.shards.train), shard_tokens(&b.shards.train));
    assert_eq!(a.surrogates_replaced, vec![(lone, 2, 2)]);
    assert!(b.surrogates_replaced.is_empty());
}

/// Inputs that hold no document (an empty JSON Lines file, a Parquet file of no rows) are
/// refused, naming them, before anything is written (before: exit 0 and a warning).
#[test]
fn inputs_with_no_document_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("empty.jsonl"), "\n\n").unwrap();
    write_parquet(&d.join("none.parquet"), &[], 10);
    for name in ["empty.jsonl", "none.parquet"] {
        let e = pack_docs(&[d.join(name)], &d.join("out/z"), &gpt2("text", 1000, 0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no document") && e.contains(name), "{e}");
        assert!(
            !d.join("out/z.vocab.json").exists(),
            "{name}: nothing written"
        );
    }
}

/// A Parquet string that is not UTF-8 is named by its row, in the file and in its row
/// group, and the byte where it stops being UTF-8 (the reader names no row).
#[test]
fn a_parquet_string_that_is_not_utf8_is_named_by_its_row() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Row groups of 4; row 9 holds a marker whose first byte is then made a lone
    // continuation byte, in the uncompressed, plain-encoded page.
    let docs: Vec<String> = (0..12)
        .map(|i| match i {
            9 => "ab\u{e9}MARKERxyz".to_string(),
            _ => format!("document {i}"),
        })
        .collect();
    let path = d.join("bad.parquet");
    let file = std::fs::File::create(&path).unwrap();
    let text: ArrayRef = Arc::new(StringArray::from_iter_values(docs.iter()));
    let batch = RecordBatch::try_from_iter([("text", text)]).unwrap();
    let props = WriterProperties::builder()
        .set_max_row_group_size(4)
        .set_dictionary_enabled(false)
        .set_statistics_enabled(parquet::file::properties::EnabledStatistics::None)
        .build();
    let mut w = ArrowWriter::try_new(file, batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let marker = "\u{e9}MARKER".as_bytes();
    let at = bytes
        .windows(marker.len())
        .position(|w| w == marker)
        .expect("the marker in the page");
    // é is C3 A9: dropping its lead byte leaves A9, a continuation byte with no lead.
    bytes[at] = b'_';
    std::fs::write(&path, &bytes).unwrap();
    let e = pack_docs(&[path], &d.join("out/x"), &gpt2("text", 1000, 0))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad.parquet: row group 2, column text")
            && e.contains("row 9 (row 1 of the group) is not UTF-8 at byte 3 of its text"),
        "{e}"
    );
}

/// `pack text` reads its files as Python's text mode does (nanoGPT's `prepare.py`), with
/// `utf-8-sig`'s dropped byte-order mark: a Windows file (CRLF, a BOM) and an old Mac one
/// (CR) pack to the same
/// tokens as the plain one, and the summary counts what it converted; a directory is
/// refused, pointing at `pack docs`.
#[test]
fn pack_text_reads_line_ends_as_python_s_text_mode() {
    use stoker_data::pack::text::pack_text;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut tokens = Vec::new();
    for (name, body) in [
        ("unix.txt", "to be\nor not\n".as_bytes()),
        ("windows.txt", "\u{feff}to be\r\nor not\r\n".as_bytes()),
        ("mac.txt", "to be\ror not\r".as_bytes()),
    ] {
        std::fs::write(d.join(name), body).unwrap();
        let s = pack_text(
            &[d.join(name)],
            d.join(format!("out/{name}")),
            Tokenizer::Char,
        )
        .unwrap();
        let converted = (s.line_ends_converted, s.boms_dropped);
        let want = match name {
            "unix.txt" => (0, 0),
            "windows.txt" => (2, 1),
            _ => (2, 0),
        };
        assert_eq!(converted, want, "{name}");
        tokens.push((
            std::fs::read(&s.files[0]).unwrap(),
            std::fs::read(&s.files[1]).unwrap(),
        ));
    }
    assert!(
        tokens.iter().all(|t| *t == tokens[0]),
        "the same shard and vocabulary"
    );
    let e = pack_text(&[d.to_path_buf()], d.join("out/dir"), Tokenizer::Char)
        .unwrap_err()
        .to_string();
    assert!(e.contains("a directory") && e.contains("pack docs"), "{e}");
}
