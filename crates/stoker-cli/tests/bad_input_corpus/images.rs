//! Image folders through `stoker pack images` (missing and empty folders, files that are not
//! JPEGs, symlink loops, links to themselves or nowhere, two classes linking one folder, a
//! pipe, a class name that is not UTF-8, truncated JPEGs when downscaling), and the JPEG
//! record shards packed from a valid folder through `stoker bench loader` (missing,
//! truncated and flipped files, forged manifests and indexes, labels that disagree, records
//! that do not decode).

use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::{s, Case, STOKER};

fn jpeg(side: u16, seed: u8) -> Vec<u8> {
    let px: Vec<u8> = (0..side as usize * side as usize * 3)
        .map(|i| (i as u8).wrapping_mul(seed).wrapping_add(seed))
        .collect();
    let mut out = Vec::new();
    jpeg_encoder::Encoder::new(&mut out, 90)
        .encode(&px, side, side, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    out
}

/// A valid folder: classes `ant` and `cat`, two 16x16 photos each.
fn good_folder(root: &Path) -> PathBuf {
    for (c, class) in ["ant", "cat"].iter().enumerate() {
        std::fs::create_dir_all(root.join(class)).unwrap();
        for k in 0..2u8 {
            let p = root.join(class).join(format!("{k}.jpg"));
            std::fs::write(p, jpeg(16, 3 + 2 * c as u8 + k)).unwrap();
        }
    }
    root.to_path_buf()
}

fn pack(src: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut a = vec![s("pack"), s("images"), s(src), s(out)];
    a.extend(extra.iter().map(s));
    a
}

fn folder_cases(dir: &Path, out: &mut Vec<Case>) {
    let mut n = 0;
    let mut case = |what: &str, edit: &dyn Fn(&Path), extra: &[&str], name: &str, kind| {
        n += 1;
        let src = good_folder(&dir.join(format!("folder{n}")));
        edit(&src);
        out.push(Case {
            what: format!("image folder: {what}"),
            args: pack(&src, &dir.join(format!("folder{n}-out/train")), extra),
            names: vec![name.to_string()],
            kind,
        });
    };
    let rm = |p: PathBuf| std::fs::remove_dir_all(p).unwrap();
    case(
        "empty",
        &|d| {
            rm(d.join("ant"));
            rm(d.join("cat"));
        },
        &[],
        "classes",
        "format",
    );
    case(
        "class folders without photos",
        &|d| {
            for c in ["ant", "cat"] {
                for k in 0..2 {
                    std::fs::remove_file(d.join(c).join(format!("{k}.jpg"))).unwrap();
                }
            }
        },
        &[],
        "ant: class folder: holds no files",
        "format",
    );
    case(
        "one class folder without photos",
        &|d| {
            for k in 0..2 {
                std::fs::remove_file(d.join("cat").join(format!("{k}.jpg"))).unwrap();
            }
        },
        &[],
        "cat: class folder: holds no files",
        "format",
    );
    case(
        "a text file",
        &|d| std::fs::write(d.join("cat/notes.txt"), "hello").unwrap(),
        &[],
        "notes.txt",
        "format",
    );
    case(
        "an empty .jpg",
        &|d| std::fs::write(d.join("cat/empty.jpg"), b"").unwrap(),
        &[],
        "empty.jpg",
        "format",
    );
    case(
        "a .jpg of two bytes",
        &|d| std::fs::write(d.join("cat/two.jpg"), [0xFF, 0xD8]).unwrap(),
        &[],
        "two.jpg",
        "format",
    );
    case(
        "a PNG named .jpg",
        &|d| std::fs::write(d.join("cat/png.jpg"), b"\x89PNG\r\n\x1a\n....").unwrap(),
        &[],
        "png.jpg",
        "format",
    );
    case(
        "a symlink loop",
        &|d| symlink("..", d.join("cat/loop")).unwrap(),
        &[],
        "loop",
        "format",
    );
    case(
        "a folder linking to itself",
        &|d| symlink(".", d.join("cat/here")).unwrap(),
        &[],
        "here",
        "format",
    );
    case(
        "two classes linking one folder",
        &|d| symlink("cat", d.join("dog")).unwrap(),
        &[],
        "dog",
        "format",
    );
    case(
        "a file linking to itself",
        &|d| symlink("self.jpg", d.join("cat/self.jpg")).unwrap(),
        &[],
        "self.jpg",
        "io",
    );
    case(
        "a dangling link",
        &|d| symlink("/nonexistent/x.jpg", d.join("cat/gone.jpg")).unwrap(),
        &[],
        "gone.jpg",
        "io",
    );
    case(
        "a named pipe",
        &|d| {
            let st = Command::new("mkfifo")
                .arg(d.join("cat/pipe.jpg"))
                .status()
                .unwrap();
            assert!(st.success());
        },
        &[],
        "pipe.jpg",
        "format",
    );
    case(
        "a class name that is not UTF-8",
        &|d| {
            let name = std::ffi::OsStr::from_bytes(b"b\xffd");
            std::fs::create_dir(d.join(name)).unwrap();
            std::fs::write(d.join(name).join("0.jpg"), jpeg(16, 9)).unwrap();
        },
        &[],
        "class name",
        "format",
    );
    case(
        "a sub-folder named like a photo, holding a text file",
        &|d| {
            std::fs::create_dir(d.join("cat/dir.jpg")).unwrap();
            std::fs::write(d.join("cat/dir.jpg/x.txt"), "x").unwrap();
        },
        &[],
        "x.txt",
        "format",
    );
    case(
        "max_side 0",
        &|_| {},
        &["--max-side", "0"],
        "max_side",
        "config",
    );
    for cut in [3usize, 20, 100, 300] {
        case(
            &format!("a JPEG cut at {cut} bytes, downscaled"),
            &move |d| {
                let j = jpeg(64, 5);
                std::fs::write(d.join("cat/cut.jpg"), &j[..cut.min(j.len() - 1)]).unwrap();
            },
            &["--max-side", "8"],
            "cut.jpg",
            "format",
        );
    }
    out.push(Case {
        what: "image folder: does not exist".into(),
        args: pack(&dir.join("no-such-folder"), &dir.join("nf/train"), &[]),
        names: vec![s("no-such-folder")],
        kind: "io",
    });
    let src = good_folder(&dir.join("folder-outfile"));
    std::fs::write(dir.join("a-file"), "x").unwrap();
    out.push(Case {
        what: "image folder: output prefix under a regular file".into(),
        args: pack(&src, &dir.join("a-file/train"), &[]),
        names: vec![s("a-file")],
        kind: "io",
    });
}

fn bench(prefix: &Path) -> Vec<String> {
    [
        "bench",
        "loader",
        &s(prefix),
        "--image-size",
        "8",
        "--sequential",
        "--seconds",
        "0.05",
        "--max-batches",
        "3",
        "--workers",
        "0",
        "--batch",
        "2",
    ]
    .iter()
    .map(|x| x.to_string())
    .collect()
}

const SUFFIXES: [&str; 5] = [
    ".data",
    ".index",
    ".manifest.json",
    ".labels.npy",
    ".classes.json",
];

fn record_cases(dir: &Path, out: &mut Vec<Case>) {
    let src = good_folder(&dir.join("records-src"));
    let good = dir.join("records-good/train");
    let o = Command::new(STOKER)
        .args(pack(&src, &good, &[]))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut n = 0;
    let mut case = |what: String, edit: &dyn Fn(&Path), name: &str, kind| {
        n += 1;
        let d = dir.join(format!("records{n}"));
        std::fs::create_dir_all(&d).unwrap();
        for suffix in SUFFIXES {
            let from = good.with_file_name(format!("train{suffix}"));
            std::fs::copy(from, d.join(format!("train{suffix}"))).unwrap();
        }
        let prefix = d.join("train");
        edit(&prefix);
        out.push(Case {
            what: format!("JPEG records: {what}"),
            args: bench(&prefix),
            names: vec![name.to_string(), format!("records{n}")],
            kind,
        });
    };
    let file = |p: &Path, suffix: &str| p.with_file_name(format!("train{suffix}"));
    let truncate = move |p: &Path, suffix: &str, frac: f64| {
        let f = file(p, suffix);
        let len = std::fs::metadata(&f).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .unwrap()
            .set_len((len as f64 * frac) as u64)
            .unwrap();
    };
    // The manifest is how a prefix is recognized as records: without it the prefix is not a
    // dataset of any kind (a format error naming the prefix).
    for suffix in [".data", ".index", ".manifest.json", ".labels.npy"] {
        let kind = if suffix == ".manifest.json" {
            "format"
        } else {
            "io"
        };
        case(
            format!("without {suffix}"),
            &move |p| std::fs::remove_file(file(p, suffix)).unwrap(),
            suffix,
            kind,
        );
    }
    for suffix in [".data", ".index", ".manifest.json", ".labels.npy"] {
        for frac in [0.0, 0.05, 0.5, 0.97] {
            case(
                format!("{suffix} truncated to {frac}"),
                &move |p| truncate(p, suffix, frac),
                suffix,
                "format",
            );
        }
    }
    let edit_json = |from: &'static str, to: &'static str| {
        move |p: &Path| {
            let f = file(p, ".manifest.json");
            let m = std::fs::read_to_string(&f).unwrap();
            assert!(m.contains(from), "{from} not in {m}");
            std::fs::write(&f, m.replacen(from, to, 1)).unwrap();
        }
    };
    for (from, to) in [
        ("\"stoker-records\"", "\"other\""),
        ("\"version\": 1", "\"version\": 2"),
        ("\"records\": 4", "\"records\": 5"),
        ("\"records\": 4", "\"records\": 3"),
        ("\"records\": 4", "\"records\": 18446744073709551615"),
        ("\"records\": 4", "\"records\": -1"),
        ("\"bytes\": ", "\"bytes\": 1"),
        ("{", "{\"surprise\": 1,"),
        ("\"data\"", "\"dtaa\""),
    ] {
        case(
            format!("manifest {from} -> {to}"),
            &edit_json(from, to),
            ".manifest.json",
            "format",
        );
    }
    // Index offsets rewritten in place (same size: the manifest's sizes still hold).
    let edit_index = |k: usize, value: u64| {
        move |p: &Path| {
            let f = file(p, ".index");
            let mut b = std::fs::read(&f).unwrap();
            b[8 * k..8 * k + 8].copy_from_slice(&value.to_le_bytes());
            std::fs::write(&f, b).unwrap();
        }
    };
    for (k, v, what) in [
        (0usize, 1u64, "offset 0 is 1"),
        (1, u64::MAX, "offset 1 is 2^64-1"),
        (2, 3, "offsets go backwards"),
        (4, 1 << 40, "the last offset is past the data"),
        (4, 10, "the last offset is before the data's end"),
    ] {
        case(
            format!("index: {what}"),
            &edit_index(k, v),
            ".index",
            "format",
        );
    }
    // Records that are not JPEGs: the bytes of record 0 overwritten in place.
    let edit_record = |at: usize, bytes: &'static [u8]| {
        move |p: &Path| {
            let f = file(p, ".data");
            let mut b = std::fs::read(&f).unwrap();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            std::fs::write(&f, b).unwrap();
        }
    };
    for (at, bytes, what) in [
        (0usize, &[0u8, 0, 0][..], "no SOI marker"),
        (2, &[0xFF, 0xD9][..], "an EOI right after the SOI"),
        (2, &[0u8; 64][..], "the segment headers zeroed"),
        (
            2,
            &[0xFF, 0xC0, 0xFF, 0xFF, 0x08, 0xFF, 0xFF, 0xFF, 0xFF][..],
            "a frame header claiming 65535 x 65535",
        ),
    ] {
        case(
            format!("record 0 has {what}"),
            &edit_record(at, bytes),
            "record 0",
            "format",
        );
    }
    let labels = |data: Vec<u8>, descr: &'static str, shape: Vec<usize>| {
        move |p: &Path| stoker_testkit::write_npy(&file(p, ".labels.npy"), descr, &shape, &data)
    };
    case(
        "3 labels for 4 records".into(),
        &labels(vec![0; 24], "<i8", vec![3]),
        ".labels.npy",
        "format",
    );
    case(
        "5 labels for 4 records".into(),
        &labels(vec![0; 40], "<i8", vec![5]),
        ".labels.npy",
        "format",
    );
    case(
        "labels as f32".into(),
        &labels(vec![0; 16], "<f4", vec![4]),
        ".labels.npy",
        "format",
    );
    case(
        "labels of shape [2, 2]".into(),
        &labels(vec![0; 32], "<i8", vec![2, 2]),
        ".labels.npy",
        "format",
    );
}

/// Image folder and JPEG record cases.
pub fn cases(dir: &Path, out: &mut Vec<Case>) {
    folder_cases(dir, out);
    record_cases(dir, out);
}
