//! Record shards: round trip, and a named error for every kind of bad input.

use std::path::Path;

use stoker_data::records::{RecordPaths, RecordShard, RecordWriter, RECORDS_FORMAT};

fn records() -> Vec<Vec<u8>> {
    vec![
        b"first".to_vec(),
        vec![],
        (0..=255u8).cycle().take(5000).collect(),
        b"x".to_vec(),
    ]
}

fn write_shard(prefix: &Path) -> RecordPaths {
    let mut w = RecordWriter::create(prefix).unwrap();
    for (i, r) in records().iter().enumerate() {
        assert_eq!(w.append(r).unwrap(), i as u64);
    }
    w.finish().unwrap();
    RecordPaths::new(prefix)
}

fn open_err(prefix: &Path) -> String {
    RecordShard::open(prefix)
        .expect_err("open should fail")
        .to_string()
}

#[test]
fn round_trip_preserves_every_record_and_writes_the_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("shard");
    let paths = write_shard(&prefix);
    let shard = RecordShard::open(&prefix).unwrap();
    assert_eq!(shard.len(), 4);
    for (i, r) in records().iter().enumerate() {
        assert_eq!(shard.get(i).unwrap(), &r[..], "record {i}");
    }
    assert_eq!(shard.get(4), None);
    shard.verify().unwrap();
    let m = shard.manifest();
    assert_eq!(
        (m.format.as_str(), m.version, m.records),
        (RECORDS_FORMAT, 1, 4)
    );
    assert_eq!(m.data.bytes, 5006);
    assert_eq!(m.index.bytes, 5 * 8);
    assert_eq!(
        m.data.crc32,
        crc32fast::hash(&std::fs::read(&paths.data).unwrap())
    );
    // The index is count + 1 little-endian u64 offsets.
    let index = std::fs::read(&paths.index).unwrap();
    let offsets: Vec<u64> = index
        .chunks(8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(offsets, vec![0, 5, 5, 5005, 5006]);
    // Opening through the manifest path works too.
    assert_eq!(RecordShard::open(&paths.manifest).unwrap().len(), 4);
}

#[test]
fn empty_shard_opens_with_no_records() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("empty");
    RecordWriter::create(&prefix).unwrap().finish().unwrap();
    let shard = RecordShard::open(&prefix).unwrap();
    assert!(shard.is_empty());
    assert_eq!(shard.get(0), None);
    shard.verify().unwrap();
}

#[test]
fn truncated_data_file_names_the_file_and_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_shard(&dir.path().join("s"));
    let data = std::fs::read(&paths.data).unwrap();
    std::fs::write(&paths.data, &data[..100]).unwrap();
    let msg = open_err(&paths.prefix);
    assert!(msg.contains(&paths.data.display().to_string()), "{msg}");
    assert!(
        msg.contains("size: truncated: 100 bytes, the manifest says 5006"),
        "{msg}"
    );
}

#[test]
fn truncated_index_file_names_the_index() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_shard(&dir.path().join("s"));
    let index = std::fs::read(&paths.index).unwrap();
    std::fs::write(&paths.index, &index[..20]).unwrap();
    let msg = open_err(&paths.prefix);
    assert!(
        msg.contains(&format!(
            "{}: size: truncated: 20 bytes",
            paths.index.display()
        )),
        "{msg}"
    );
}

fn write_offsets(path: &Path, offsets: &[u64]) {
    let bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn decreasing_offsets_name_the_offset() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_shard(&dir.path().join("s"));
    write_offsets(&paths.index, &[0, 5, 3, 5005, 5006]);
    let msg = open_err(&paths.prefix);
    assert!(msg.contains(&paths.index.display().to_string()), "{msg}");
    assert!(
        msg.contains("offset[2]: 3 is below offset[1] = 5: offsets must not decrease"),
        "{msg}"
    );
}

#[test]
fn offset_past_the_data_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_shard(&dir.path().join("s"));
    write_offsets(&paths.index, &[0, 5, 9999, 9999, 5006]);
    let msg = open_err(&paths.prefix);
    assert!(msg.contains("offset[2]: 9999 is past the end of"), "{msg}");
    write_offsets(&paths.index, &[0, 5, 5, 5005, 5005]);
    let msg = open_err(&paths.prefix);
    assert!(
        msg.contains("offset[4]: 5005 (expected the data file size 5006)"),
        "{msg}"
    );
    write_offsets(&paths.index, &[1, 5, 5, 5005, 5006]);
    assert!(open_err(&paths.prefix).contains("offset[0]: 1 (expected 0)"));
}

#[test]
fn checksum_mismatch_is_found_by_verify_not_open() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_shard(&dir.path().join("s"));
    let mut data = std::fs::read(&paths.data).unwrap();
    data[10] ^= 0xFF;
    std::fs::write(&paths.data, &data).unwrap();
    let shard = RecordShard::open(&paths.prefix).expect("sizes and offsets still agree");
    let msg = shard.verify().unwrap_err().to_string();
    assert!(
        msg.contains(&format!(
            "{}: crc32: checksum mismatch",
            paths.data.display()
        )),
        "{msg}"
    );
}

#[test]
fn unknown_manifest_version_and_format_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_shard(&dir.path().join("s"));
    let text = std::fs::read_to_string(&paths.manifest).unwrap();
    std::fs::write(
        &paths.manifest,
        text.replace("\"version\": 1", "\"version\": 7"),
    )
    .unwrap();
    let msg = open_err(&paths.prefix);
    assert!(msg.contains(&paths.manifest.display().to_string()), "{msg}");
    assert!(
        msg.contains("version: unknown version 7 (this build reads version 1"),
        "{msg}"
    );
    std::fs::write(&paths.manifest, text.replace(RECORDS_FORMAT, "tfrecord")).unwrap();
    assert!(open_err(&paths.prefix).contains("format: \"tfrecord\" (expected \"stoker-records\")"));
    std::fs::write(&paths.manifest, "{ not json").unwrap();
    assert!(open_err(&paths.prefix).contains("json: not valid JSON"));
    std::fs::write(
        &paths.manifest,
        text.replace("\"records\": 4", "\"records\": 5"),
    )
    .unwrap();
    assert!(open_err(&paths.prefix).contains("index.bytes: 40 for 5 records"));
}

#[test]
fn missing_file_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_shard(&dir.path().join("s"));
    std::fs::remove_file(&paths.index).unwrap();
    let msg = open_err(&paths.prefix);
    assert!(msg.starts_with(&paths.index.display().to_string()), "{msg}");
}
