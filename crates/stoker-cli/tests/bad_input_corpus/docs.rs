//! Users' documents through `stoker pack docs`: Parquet files truncated at every boundary
//! that matters, without the text column, with a column of numbers or nulls; JSON Lines
//! with a number or nothing where the text is, bytes that are not UTF-8, a cut line, a line
//! that is not JSON; a directory with no documents and a file of another kind. Every one
//! is a `format` error naming the file.

use std::path::Path;
use std::sync::Arc;

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};

use super::{s, Case};

fn parquet(columns: Vec<(&str, ArrayRef)>) -> Vec<u8> {
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    let props = parquet::file::properties::WriterProperties::builder()
        .set_max_row_group_size(4)
        .build();
    let mut out = Vec::new();
    let mut w =
        parquet::arrow::ArrowWriter::try_new(&mut out, batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    out
}

/// Document files through `stoker pack docs`.
pub fn cases(dir: &Path, out: &mut Vec<Case>) {
    let docs: Vec<String> = (0..10)
        .map(|i| format!("document {i} of the corpus"))
        .collect();
    let text: ArrayRef = Arc::new(StringArray::from_iter_values(docs.iter()));
    let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..10));
    let valid = parquet(vec![("id", ids.clone()), ("text", text.clone())]);
    let mut files: Vec<(String, String, Vec<u8>)> = Vec::new();
    for n in [
        0,
        3,
        4,
        8,
        valid.len() / 2,
        valid.len() - 8,
        valid.len() - 1,
    ] {
        files.push((
            format!("Parquet truncated at {n} of {}", valid.len()),
            "parquet".into(),
            valid[..n].to_vec(),
        ));
    }
    files.push((
        "Parquet without a text column".into(),
        "parquet".into(),
        parquet(vec![("id", ids.clone())]),
    ));
    files.push((
        "Parquet whose text column holds numbers".into(),
        "parquet".into(),
        parquet(vec![("text", ids)]),
    ));
    let nulls: ArrayRef = Arc::new(StringArray::from(vec![Some("a"), None]));
    files.push((
        "Parquet with a null document".into(),
        "parquet".into(),
        parquet(vec![("text", nulls)]),
    ));
    for (what, body) in [
        (
            "JSON Lines with a number as text",
            &b"{\"text\": \"a\"}\n{\"text\": 3}\n"[..],
        ),
        (
            "JSON Lines without the text field",
            b"{\"text\": \"a\"}\n{\"body\": \"b\"}\n",
        ),
        ("JSON Lines not UTF-8", b"{\"text\": \"caf\xe9\"}\n"),
        (
            "JSON Lines cut in a line",
            b"{\"text\": \"a\"}\n{\"text\": \"b",
        ),
        ("JSON Lines that are not JSON", b"text: a\n"),
        ("JSON Lines whose line is an array", b"[\"text\", \"a\"]\n"),
    ] {
        files.push((what.into(), "jsonl".into(), body.to_vec()));
    }
    for (i, (what, ext, bytes)) in files.into_iter().enumerate() {
        let p = dir.join(format!("docs{i}.{ext}"));
        std::fs::write(&p, bytes).unwrap();
        out.push(Case {
            what,
            args: vec![
                s("pack"),
                s("docs"),
                s(dir.join(format!("docs{i}-out/x"))),
                s(&p),
            ],
            names: vec![s(p.file_name().unwrap())],
            kind: "format",
        });
    }
    let empty = dir.join("no-documents");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::write(dir.join("notes.txt"), "x").unwrap();
    for (what, input) in [
        ("a directory with no documents", empty),
        ("a file of another kind", dir.join("notes.txt")),
    ] {
        out.push(Case {
            what: what.into(),
            args: vec![s("pack"), s("docs"), s(dir.join("docs-other/x")), s(&input)],
            names: vec![s(input.file_name().unwrap())],
            kind: "format",
        });
    }
}
