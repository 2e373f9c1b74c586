//! IDX files (MNIST's format), raw and gzip, through `stoker pack idx`: truncated at every
//! header boundary, wrong magic, type and dimension counts, sizes that overflow or disagree
//! with the data, images and labels that disagree, corrupt gzip, and a gzip bomb (a small
//! file whose header claims a little data and whose stream inflates to much more).

use std::io::Write;
use std::path::Path;

use super::{s, Case};

fn idx(type_code: u8, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 0, type_code, dims.len() as u8];
    for d in dims {
        out.extend(d.to_be_bytes());
    }
    out.extend(data);
    out
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

/// IDX cases: each pairs a broken file with a valid partner (images or labels).
pub fn cases(dir: &Path, out: &mut Vec<Case>) {
    let images = idx(8, &[10, 4, 4], &[7u8; 160]);
    let labels = idx(8, &[10], &[1u8; 10]);
    let mut broken: Vec<(String, Vec<u8>, bool)> = Vec::new(); // (what, bytes, is the image file)
    for n in [0usize, 1, 2, 3, 4, 7, 8, 11, 12, 15, 16, 17, 100, 175] {
        broken.push((
            format!("IDX images truncated at {n}"),
            images[..n].to_vec(),
            true,
        ));
    }
    for n in [0usize, 3, 4, 7, 8, 9, 17] {
        broken.push((
            format!("IDX labels truncated at {n}"),
            labels[..n].to_vec(),
            false,
        ));
    }
    let variants: Vec<(&str, Vec<u8>, bool)> = vec![
        (
            "magic byte 0 set",
            [&[1u8][..], &images[1..]].concat(),
            true,
        ),
        (
            "magic byte 1 set",
            [&[0u8, 9][..], &images[2..]].concat(),
            true,
        ),
        (
            "type code f32 (0x0d)",
            idx(0x0d, &[10, 4, 4], &[0; 640]),
            true,
        ),
        ("type code 0xff", idx(0xff, &[10, 4, 4], &[7; 160]), true),
        ("zero dimensions", idx(8, &[], &[7; 160]), true),
        ("255 dimensions", idx(8, &[1; 255], &[7; 160]), true),
        (
            "dims overflow 64 bits",
            idx(8, &[u32::MAX, u32::MAX, u32::MAX], &[7; 160]),
            true,
        ),
        (
            "dims claim 4 GiB",
            idx(8, &[u32::MAX, 1, 1], &[7; 160]),
            true,
        ),
        ("one byte too many", idx(8, &[10, 4, 4], &[7; 161]), true),
        ("images with 2 dims", idx(8, &[10, 16], &[7; 160]), true),
        (
            "images with 4 dims",
            idx(8, &[10, 1, 4, 4], &[7; 160]),
            true,
        ),
        ("images with 0 rows", idx(8, &[10, 0, 4], &[]), true),
        ("no images", idx(8, &[0, 4, 4], &[]), true),
        ("labels with 2 dims", idx(8, &[10, 1], &[1; 10]), false),
        ("11 labels for 10 images", idx(8, &[11], &[1; 11]), false),
        ("9 labels for 10 images", idx(8, &[9], &[1; 9]), false),
        ("gzip of truncated images", gzip(&images[..100]), true),
        ("gzip of wrong magic", gzip(&[9u8; 64]), true),
        (
            "gzip stream cut in half",
            gzip(&images)[..20].to_vec(),
            true,
        ),
        ("gzip header only", vec![0x1f, 0x8b], true),
        (
            "gzip bomb: 64 MiB under a 160-byte header",
            {
                let mut b = images.clone();
                b.resize(images.len() + (64 << 20), 0);
                gzip(&b)
            },
            true,
        ),
        (
            "gzip labels with garbage",
            [&gzip(&labels)[..12], &[0x55; 20][..]].concat(),
            false,
        ),
    ];
    for (what, bytes, img) in variants {
        broken.push((format!("IDX {what}"), bytes, img));
    }
    for (i, (what, bytes, img)) in broken.into_iter().enumerate() {
        let bad = dir.join(format!(
            "idx{i}-{}.idx",
            if img { "images" } else { "labels" }
        ));
        std::fs::write(&bad, bytes).unwrap();
        let good = dir.join(format!("idx{i}-good.idx"));
        std::fs::write(&good, if img { &labels } else { &images }).unwrap();
        let (im, la) = if img { (&bad, &good) } else { (&good, &bad) };
        // Two valid files that disagree on the sample count are a `data` error.
        let kind = if what.contains(" labels for ") {
            "data"
        } else {
            "format"
        };
        out.push(Case {
            what,
            args: vec![
                s("pack"),
                s("idx"),
                s("--images"),
                s(im),
                s("--labels"),
                s(la),
                s(dir.join(format!("idx{i}-out"))),
            ],
            names: vec![s(bad.file_name().unwrap())],
            kind,
        });
    }
    out.push(Case {
        what: "IDX images that do not exist".into(),
        args: vec![
            s("pack"),
            s("idx"),
            s("--images"),
            s(dir.join("no-such-images.idx")),
            s("--labels"),
            s(dir.join("idx0-good.idx")),
            s(dir.join("idx-none")),
        ],
        names: vec![s("no-such-images.idx")],
        kind: "io",
    });
}
