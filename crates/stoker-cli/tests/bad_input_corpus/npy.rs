//! `.npy` files truncated at every header byte and along the data, with wrong magic and
//! versions, and with broken header dicts (dtypes, shapes, keys).

use std::path::Path;

use super::{s, Case};

fn npy_bytes(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.to_string();
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((h.len() as u16).to_le_bytes());
    out.extend(h.as_bytes());
    out.extend(data);
    out
}

fn valid_header(descr: &str, shape: &str) -> String {
    format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}")
}

/// `.npy` files through `stoker bench loader`: every one is a `format` error.
pub fn cases(dir: &Path, out: &mut Vec<Case>) {
    let data = vec![0u8; 64 * 8 * 4];
    let valid = npy_bytes(&valid_header("<f4", "(64, 8)"), &data);
    let header_end = valid.len() - data.len();
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    for n in 0..header_end {
        files.push((
            format!("npy truncated at header byte {n}"),
            valid[..n].to_vec(),
        ));
    }
    for k in 1..=40 {
        let n = header_end + k * data.len() / 41;
        files.push((
            format!("npy truncated in the data at {n}"),
            valid[..n].to_vec(),
        ));
    }
    for i in 0..6 {
        let mut v = valid.clone();
        v[i] ^= 0x20;
        files.push((format!("npy magic byte {i} changed"), v));
    }
    for major in [0u8, 4, 9] {
        let mut v = valid.clone();
        v[6] = major;
        files.push((format!("npy version {major}"), v));
    }
    let bad_headers = [
        valid_header("<f9", "(64, 8)"),
        valid_header("|V8", "(64, 8)"),
        valid_header("O", "(64, 8)"),
        valid_header(">c8", "(64, 8)"),
        valid_header("x", "(64, 8)"),
        valid_header("", "(64, 8)"),
        valid_header("<f4", "(99999999999, 8)"),
        valid_header("<f4", "(-1, 8)"),
        valid_header("<f4", "(64, 8, 99999999)"),
        valid_header("<f4", "('a',)"),
        valid_header("<f4", "64"),
        valid_header("<f4", "(18446744073709551615, 2)"),
        "{'descr': '<f4', 'fortran_order': True, 'shape': (64, 8), }".into(),
        "{'fortran_order': False, 'shape': (64, 8), }".into(),
        "{'descr': '<f4', 'fortran_order': False, }".into(),
        "{'descr': '<f4', 'shape': (64, 8), }".into(),
        "{]".into(),
        "not a dict at all".into(),
    ];
    for h in bad_headers {
        files.push((format!("npy header {h:?}"), npy_bytes(&h, &data)));
    }
    for (i, (what, bytes)) in files.into_iter().enumerate() {
        let p = dir.join(format!("npy{i}.npy"));
        std::fs::write(&p, bytes).unwrap();
        out.push(bench_case(what, &p, "format"));
    }
}

/// `stoker bench loader` on one file, briefly; its error must name the file.
pub fn bench_case(what: String, p: &Path, kind: &'static str) -> Case {
    Case {
        what,
        args: [
            "bench",
            "loader",
            &s(p),
            "--context",
            "8",
            "--seconds",
            "0.05",
            "--max-batches",
            "2",
            "--workers",
            "0",
            "--batch",
            "2",
        ]
        .iter()
        .map(|x| x.to_string())
        .collect(),
        names: vec![s(p.file_name().unwrap())],
        kind,
    }
}
