//! `.npy` files written by numpy itself read back bit-exactly; bad files give named errors.

use std::path::PathBuf;

use stoker_data::npy::{write_npy, NpyArray};
use stoker_data::{ArrayDataset, DType, Dataset, SampleContext};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/npy")
        .join(name)
}

fn expected(name: &str) -> (String, Vec<usize>, Vec<u8>) {
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture(&format!("{name}.json"))).unwrap()).unwrap();
    let shape = meta["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    (
        meta["dtype"].as_str().unwrap().to_string(),
        shape,
        std::fs::read(fixture(&format!("{name}.raw"))).unwrap(),
    )
}

#[test]
fn every_dtype_and_version_reads_back_bit_exactly() {
    let cases = [
        ("u8", DType::U8),
        ("u16", DType::U16),
        ("i32", DType::I32),
        ("i64", DType::I64),
        ("f16", DType::F16),
        ("f32", DType::F32),
        ("f64", DType::F64),
        ("scalar", DType::F32),
        ("empty", DType::F32),
        ("v2", DType::F32),
        ("v3", DType::I64),
    ];
    for (name, dtype) in cases {
        let a = NpyArray::open(fixture(&format!("{name}.npy"))).unwrap();
        let (_, shape, raw) = expected(name);
        assert_eq!(a.dtype(), dtype, "{name}");
        assert_eq!(a.shape(), &shape[..], "{name}");
        assert_eq!(a.bytes(), &raw[..], "{name}: bytes differ from numpy's");
    }
}

#[test]
fn typed_view_and_rows() {
    let a = NpyArray::open(fixture("f32.npy")).unwrap();
    let (_, _, raw) = expected("f32");
    let v: &[f32] = a.as_slice().expect("numpy aligns data to 64 bytes");
    assert_eq!(v.len(), 24);
    assert_eq!(v[0].to_le_bytes(), raw[..4]);
    assert_eq!(a.row_bytes(), 2 * 3 * 4);
    assert_eq!(a.rows(1, 2), &raw[24..72]);
    assert!(v[10].is_sign_negative() && v[10] == 0.0, "-0.0 kept");
}

#[test]
fn writer_round_trips_and_numpy_layout() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.npy");
    let data: Vec<u8> = (0..60u8).collect();
    write_npy(&p, DType::U8, &[5, 3, 4], &data).unwrap();
    let a = NpyArray::open(&p).unwrap();
    assert_eq!(
        (a.dtype(), a.shape().to_vec(), a.bytes().to_vec()),
        (DType::U8, vec![5, 3, 4], data)
    );
    // Same header bytes as numpy's own for the same dtype and shape.
    let ours = std::fs::read(&p).unwrap();
    assert_eq!((ours.len() - 60) % 64, 0, "data starts 64-byte aligned");
    assert_eq!(&ours[..8], b"\x93NUMPY\x01\x00");
    let numpy = std::fs::read(fixture("u8.npy")).unwrap();
    assert_eq!(
        u16::from_le_bytes([ours[8], ours[9]]),
        u16::from_le_bytes([numpy[8], numpy[9]])
    );
    assert!(
        write_npy(dir.path().join("x.npy"), DType::F32, &[3], &[0u8; 8])
            .unwrap_err()
            .to_string()
            .contains("needs 12 bytes")
    );
}

#[test]
fn zipped_arrays_form_a_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let img: Vec<u8> = (0..40u8).collect();
    let lab: Vec<u8> = (0..4i64).flat_map(|v| (v * 10).to_le_bytes()).collect();
    write_npy(dir.path().join("d.image.npy"), DType::U8, &[4, 2, 5], &img).unwrap();
    write_npy(dir.path().join("d.label.npy"), DType::I64, &[4], &lab).unwrap();
    let ds = ArrayDataset::open_prefix(dir.path().join("d"), &["image", "label"]).unwrap();
    assert_eq!(ds.len(), 4);
    assert_eq!(ds.fields()[0].shape, vec![2, 5]);
    assert_eq!(ds.fields()[1].shape, Vec::<usize>::new());
    let (mut a, mut b) = ([0u8; 10], [0u8; 8]);
    ds.read_sample(
        &mut (),
        SampleContext {
            seed: 0,
            epoch: 0,
            index: 2,
        },
        &mut [&mut a, &mut b],
    )
    .unwrap();
    assert_eq!(a.to_vec(), (20..30u8).collect::<Vec<_>>());
    assert_eq!(i64::from_le_bytes(b), 20);
    assert_eq!(ds.mapped_run(0, 1, 2).unwrap().as_bytes(), &img[10..30]);

    write_npy(dir.path().join("e.label.npy"), DType::I64, &[3], &lab[..24]).unwrap();
    std::fs::copy(
        dir.path().join("d.image.npy"),
        dir.path().join("e.image.npy"),
    )
    .unwrap();
    let err = ArrayDataset::open_prefix(dir.path().join("e"), &["image", "label"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"label\"") && err.contains("3 rows") && err.contains("has 4"),
        "{err}"
    );
}

/// An f32 array whose data starts at byte 130 (a legal header length that numpy never
/// writes): its rows are copied, not handed out as a view that cannot be read as f32
/// (before: "f32 values not aligned to 4 bytes in the batch", naming no file).
#[test]
fn an_unaligned_data_offset_is_copied_not_mapped() {
    let dir = tempfile::tempdir().unwrap();
    let values: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
    let mut header = "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }".to_string();
    // 10 bytes of magic, version and length, then the header up to byte 130, newline last.
    while header.len() < 119 {
        header.push(' ');
    }
    header.push('\n');
    let mut file = b"\x93NUMPY\x01\x00".to_vec();
    file.extend_from_slice(&(header.len() as u16).to_le_bytes());
    file.extend_from_slice(header.as_bytes());
    assert_eq!(file.len(), 130);
    file.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    let path = dir.path().join("mis.npy");
    std::fs::write(&path, file).unwrap();
    let ds = ArrayDataset::new(vec![("x".into(), NpyArray::open(&path).unwrap())]).unwrap();
    assert!(ds.mapped_run(0, 0, 2).is_none(), "an unaligned view");
    let mut row = [0u8; 16];
    ds.read_sample(
        &mut (),
        SampleContext {
            seed: 0,
            epoch: 0,
            index: 1,
        },
        &mut [&mut row],
    )
    .unwrap();
    let got: Vec<f32> = row
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(got, values[4..8]);
}

fn open_err(path: &std::path::Path) -> String {
    NpyArray::open(path).unwrap_err().to_string()
}

#[test]
fn bad_files_give_named_errors() {
    let e = open_err(&fixture("bad_big_endian.npy"));
    assert!(
        e.contains("bad_big_endian.npy") && e.contains("descr") && e.contains(">f4"),
        "{e}"
    );
    let e = open_err(&fixture("bad_fortran.npy"));
    assert!(e.contains("fortran_order") && e.contains("C-order"), "{e}");
    let e = open_err(&fixture("bad_complex.npy"));
    assert!(e.contains("descr") && e.contains("<c8"), "{e}");

    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read(fixture("f32.npy")).unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let e = open_err(&write("trunc.npy", &good[..good.len() - 4]));
    assert!(
        e.contains("trunc.npy") && e.contains("data") && e.contains("truncated"),
        "{e}"
    );
    let e = open_err(&write("magic.npy", b"PK\x03\x04 this is a zip"));
    assert!(e.contains("magic") && e.contains("not a .npy"), "{e}");
    let mut v = good.clone();
    v[6] = 4;
    let e = open_err(&write("ver.npy", &v));
    assert!(e.contains("version") && e.contains("4.0"), "{e}");
    let e = open_err(&write("short.npy", &good[..20]));
    assert!(e.contains("header"), "{e}");
    let mut v = good.clone();
    let pos = v.windows(5).position(|w| w == b"shape").unwrap();
    v[pos..pos + 5].copy_from_slice(b"shapf");
    let e = open_err(&write("key.npy", &v));
    assert!(
        e.contains("shapf") && e.contains("unknown header key"),
        "{e}"
    );
    let mut v = good;
    let pos = v.windows(4).position(|w| w == b"(4, ").unwrap();
    v[pos + 1] = b'x';
    let e = open_err(&write("dim.npy", &v));
    assert!(e.contains("header") && e.contains("integer"), "{e}");
    let e = open_err(&dir.path().join("missing.npy"));
    assert!(
        e.contains("missing.npy") && e.contains("No such file"),
        "{e}"
    );
}
