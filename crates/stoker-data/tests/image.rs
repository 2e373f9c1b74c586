//! The JPEG image pipeline: decode, crop sampling, determinism, dtypes, a torchvision reference,
//! and the packed image dataset end to end.

use std::path::{Path, PathBuf};

use half::bf16;
use jpeg_encoder::{ColorType, Encoder, SamplingFactor};
use stoker_data::pack::image_folder::{pack_image_folder, pack_image_folder_with, PackOptions};
use stoker_data::transform::{
    dct_reduction, decode_jpeg, CropBox, Decoded, ImagePipeline, ImageScratch,
    ImageTransformConfig, JpegBackend, TransformMode, IMAGENET_MEAN, IMAGENET_STD,
};
use stoker_data::{DType, Dataset, ImageRecordDataset, SampleContext};

fn jpeg(width: u16, height: u16, pixels: &[u8], color: ColorType) -> Vec<u8> {
    let mut out = Vec::new();
    let mut enc = Encoder::new(&mut out, 95);
    enc.set_sampling_factor(SamplingFactor::R_4_4_4);
    enc.encode(pixels, width, height, color).unwrap();
    out
}

fn solid_rgb(width: u16, height: u16, rgb: [u8; 3]) -> Vec<u8> {
    let px: Vec<u8> = rgb
        .iter()
        .copied()
        .cycle()
        .take(width as usize * height as usize * 3)
        .collect();
    jpeg(width, height, &px, ColorType::Rgb)
}

/// A deterministic textured image, so crops and flips change the output.
fn textured(width: u16, height: u16) -> Vec<u8> {
    let mut px = Vec::new();
    for y in 0..height as usize {
        for x in 0..width as usize {
            px.extend([
                (x * 255 / width as usize) as u8,
                (y * 255 / height as usize) as u8,
                ((x ^ y) * 8) as u8,
            ]);
        }
    }
    jpeg(width, height, &px, ColorType::Rgb)
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
        .collect()
}

fn run(config: ImageTransformConfig, jpeg: &[u8], seed: u64) -> Vec<u8> {
    let pipeline = ImagePipeline::new(config).unwrap();
    let mut out = vec![0u8; pipeline.output_bytes()];
    pipeline
        .apply(jpeg, seed, &mut ImageScratch::default(), &mut out)
        .unwrap();
    out
}

/// torchvision's per-pixel arithmetic: ToTensor (v / 255) then Normalize, in f32.
fn normalized(v: u8, c: usize) -> f32 {
    (v as f32 / 255.0 - IMAGENET_MEAN[c]) / IMAGENET_STD[c]
}

#[test]
fn solid_color_decodes_within_one_and_normalizes_exactly() {
    let jpg = solid_rgb(80, 60, [200, 100, 50]);
    let mut buf = Vec::new();
    let d = decode_jpeg(&jpg, &mut buf).unwrap();
    assert_eq!(
        d,
        Decoded {
            width: 80,
            height: 60,
            channels: 3
        }
    );
    let first = [buf[0], buf[1], buf[2]];
    for (c, want) in [200i32, 100, 50].iter().enumerate() {
        assert!(
            (first[c] as i32 - want).abs() <= 1,
            "channel {c}: decoded {}",
            first[c]
        );
    }
    assert!(
        buf[..80 * 60 * 3].chunks(3).all(|p| p == first),
        "a solid JPEG decodes solid"
    );
    for mode in [TransformMode::Train, TransformMode::Eval] {
        let cfg = ImageTransformConfig {
            size: 32,
            mode,
            ..Default::default()
        };
        let out = f32s(&run(cfg, &jpg, 7));
        for c in 0..3 {
            let want = normalized(first[c], c);
            assert!(
                out[c * 1024..(c + 1) * 1024].iter().all(|&v| v == want),
                "{mode:?} channel {c}"
            );
        }
    }
}

#[test]
fn grayscale_jpeg_becomes_three_equal_channels() {
    let jpg = jpeg(40, 30, &[90u8; 40 * 30], ColorType::Luma);
    let mut buf = Vec::new();
    let d = decode_jpeg(&jpg, &mut buf).unwrap();
    let n = d.channels * 40 * 30;
    assert!(
        buf[..n].iter().all(|&v| v == buf[0]),
        "a solid gray JPEG decodes solid"
    );
    let out = f32s(&run(
        ImageTransformConfig {
            size: 16,
            ..Default::default()
        },
        &jpg,
        1,
    ));
    for c in 0..3 {
        let want = normalized(buf[0], c);
        assert!(
            out[c * 256..(c + 1) * 256].iter().all(|&v| v == want),
            "channel {c}"
        );
    }
}

#[test]
fn rrc_params_are_deterministic_and_in_range() {
    let p = ImagePipeline::new(ImageTransformConfig::default()).unwrap();
    let (mut flips, mut distinct) = (0, std::collections::HashSet::new());
    for (w, h) in [(500u32, 375u32), (64, 64), (1000, 100), (3, 7)] {
        for seed in 0..500u64 {
            let (b, flip) = p.train_params(w, h, seed);
            assert_eq!(
                (b, flip),
                p.train_params(w, h, seed),
                "same seed, same draw"
            );
            assert!(
                b.width >= 1 && b.height >= 1 && b.left + b.width <= w && b.top + b.height <= h,
                "{b:?} in {w}x{h}"
            );
            let area = (b.width * b.height) as f64 / (w * h) as f64;
            let aspect = b.width as f64 / b.height as f64;
            if (w, h) == (500, 375) {
                // Always accepted on a large image: area and aspect within bounds up to rounding.
                assert!((0.08 - 0.01..=1.0).contains(&area), "area {area}");
                assert!(
                    (0.75 - 0.01..=4.0 / 3.0 + 0.01).contains(&aspect),
                    "aspect {aspect}"
                );
                distinct.insert(b);
                flips += flip as u32;
            }
        }
    }
    assert!(
        distinct.len() > 450,
        "boxes vary with the seed: {}",
        distinct.len()
    );
    assert!(
        (200..300).contains(&flips),
        "flip probability 0.5: {flips}/500"
    );
    // A 1000x100 image rarely fits a box: the fallback clamps the aspect ratio to 4/3, centered.
    let fallback = stoker_data::transform::crop::random_resized_crop(
        1000,
        100,
        (1.0, 1.0),
        (0.75, 4.0 / 3.0),
        &mut stoker_data::transform::SampleRng::new(3),
    );
    assert_eq!(
        (fallback.width, fallback.height, fallback.left, fallback.top),
        (133, 100, 433, 0)
    );
}

#[test]
fn same_sample_context_gives_bit_identical_output() {
    let jpg = textured(120, 90);
    let other = textured(333, 251);
    let p = ImagePipeline::new(ImageTransformConfig {
        size: 48,
        ..Default::default()
    })
    .unwrap();
    let ctx = |epoch| {
        SampleContext {
            seed: 42,
            epoch,
            index: 5,
        }
        .sample_seed()
    };
    let mut a = vec![0u8; p.output_bytes()];
    let mut b = a.clone();
    let mut used = ImageScratch::default();
    p.apply(&other, 9, &mut used, &mut b).unwrap(); // a scratch that held a bigger image
    p.apply(&jpg, ctx(0), &mut ImageScratch::default(), &mut a)
        .unwrap();
    p.apply(&jpg, ctx(0), &mut used, &mut b).unwrap();
    assert_eq!(a, b, "fresh and reused scratch agree bit for bit");
    p.apply(&jpg, ctx(1), &mut used, &mut b).unwrap();
    assert_ne!(a, b, "another epoch draws another crop");
}

#[test]
fn bf16_output_is_f32_output_rounded() {
    let jpg = textured(150, 100);
    for mode in [TransformMode::Train, TransformMode::Eval] {
        let cfg = ImageTransformConfig {
            size: 40,
            mode,
            ..Default::default()
        };
        let f = f32s(&run(cfg.clone(), &jpg, 11));
        let h = run(
            ImageTransformConfig {
                dtype: DType::BF16,
                ..cfg
            },
            &jpg,
            11,
        );
        let h: Vec<u16> = h
            .chunks_exact(2)
            .map(|b| u16::from_ne_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(h.len(), f.len());
        for (x, y) in f.iter().zip(&h) {
            assert_eq!(bf16::from_f32(*x).to_bits(), *y);
        }
    }
}

fn fixture(name: &str) -> Vec<u8> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/image")
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Largest and mean absolute difference, in units of one pixel level (1/255/std).
fn diff_in_levels(ours: &[f32], reference: &[f32]) -> (f32, f32) {
    let plane = ours.len() / 3;
    let (mut max, mut sum) = (0f32, 0f32);
    for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
        let d = (a - b).abs() * 255.0 * IMAGENET_STD[i / plane];
        max = max.max(d);
        sum += d;
    }
    (max, sum / ours.len() as f32)
}

/// Reference: scripts/fixtures/make_image_reference.py (PIL decode, torchvision Resize(36) ->
/// CenterCrop(32) -> ToTensor -> Normalize). Tolerances in pixel levels (1 level = 1/255/std):
/// from PIL's own pixels only the resize's fixed-point rounding differs (measured: max 1, mean
/// 0.13). From the JPEG, at full scale (`dct_scaling: false`, which is what torchvision
/// does): libjpeg-turbo is PIL's own decoder, so only the resize rounding remains; zune-jpeg
/// rounds IDCT and color conversion differently (decoded pixels differ by <= 2; measured after
/// resize: max 1, mean 0.15), and is held to the looser bound it always had.
#[test]
fn eval_mode_matches_torchvision_reference() {
    let reference = f32s(&fixture("photo_eval32_f32.bin"));
    let cfg = ImageTransformConfig {
        size: 32,
        dct_scaling: false,
        ..ImageTransformConfig::eval()
    };
    let p = ImagePipeline::new(cfg).unwrap();
    let mut out = vec![0u8; p.output_bytes()];
    let pil_rgb = fixture("photo_rgb.bin");
    let decoded = Decoded {
        width: 61,
        height: 47,
        channels: 3,
    };
    p.apply_pixels(&pil_rgb, decoded, 0, &mut ImageScratch::default(), &mut out)
        .unwrap();
    let (max, mean) = diff_in_levels(&f32s(&out), &reference);
    assert!(
        max <= 1.01 && mean <= 0.2,
        "from PIL pixels: max {max} levels, mean {mean}"
    );
    for (backend, max_levels, mean_levels) in [
        (JpegBackend::LibjpegTurbo, 1.01, 0.2),
        (JpegBackend::Zune, 3.01, 0.3),
    ] {
        let p = ImagePipeline::new(ImageTransformConfig {
            decoder: backend,
            ..p.config().clone()
        })
        .unwrap();
        p.apply(
            &fixture("photo.jpg"),
            0,
            &mut ImageScratch::default(),
            &mut out,
        )
        .unwrap();
        let (max, mean) = diff_in_levels(&f32s(&out), &reference);
        assert!(
            max <= max_levels && mean <= mean_levels,
            "{backend:?} from the JPEG: max {max} levels, mean {mean}"
        );
    }
}

#[test]
fn corrupt_and_non_jpeg_bytes_are_errors_not_panics() {
    let p = ImagePipeline::new(ImageTransformConfig {
        size: 16,
        ..Default::default()
    })
    .unwrap();
    let mut out = vec![0u8; p.output_bytes()];
    let mut s = ImageScratch::default();
    let good = textured(64, 64);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("not a JPEG", b"\x89PNG\r\n\x1a\n....".to_vec()),
        ("not a JPEG", vec![]),
        ("corrupt JPEG", good[..good.len() / 3].to_vec()),
        (
            "corrupt JPEG",
            [&[0xFF, 0xD8][..], &[0x55; 200][..]].concat(),
        ),
    ];
    for (want, bytes) in cases {
        let msg = p
            .apply(&bytes, 0, &mut s, &mut out)
            .unwrap_err()
            .to_string();
        assert!(msg.contains(want), "{msg}");
    }
    let msg = p
        .apply(&good, 0, &mut s, &mut out[1..])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("expected 3 x 16 x 16 x 4 = 3072"), "{msg}");
    let bad = ImageTransformConfig {
        scale: (0.5, 0.1),
        ..Default::default()
    };
    assert!(ImagePipeline::new(bad)
        .unwrap_err()
        .to_string()
        .contains("scale"));
}

fn make_folder(root: &Path) -> PathBuf {
    let src = root.join("src");
    for (class, files) in [("cat", vec!["b.jpg", "a.jpg"]), ("ant", vec!["z.jpeg"])] {
        std::fs::create_dir_all(src.join(class)).unwrap();
        for (i, f) in files.iter().enumerate() {
            std::fs::write(src.join(class).join(f), textured(50 + i as u16 * 10, 40)).unwrap();
        }
    }
    src
}

#[test]
fn pack_then_read_gives_sorted_classes_labels_and_images() {
    let dir = tempfile::tempdir().unwrap();
    let src = make_folder(dir.path());
    let out = dir.path().join("packed/train");
    let summary = pack_image_folder(&src, &out).unwrap();
    assert_eq!(summary.classes, vec!["ant", "cat"]);
    assert_eq!(summary.per_class, vec![1, 2]);
    let classes: Vec<String> = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("packed/train.classes.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(classes, summary.classes);
    let ds = ImageRecordDataset::open(
        &out,
        ImageTransformConfig {
            size: 24,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!((ds.len(), ds.labels()), (3, &[0i64, 1, 1][..]));
    // Files in name order: cat/a.jpg (60x40) is record 1.
    assert_eq!(
        ds.shard().get(1).unwrap(),
        std::fs::read(src.join("cat/a.jpg")).unwrap()
    );
    assert_eq!(ds.fields()[0].shape, vec![3, 24, 24]);
    assert_eq!(
        (ds.fields()[1].dtype, ds.fields()[1].shape.len()),
        (DType::I64, 0)
    );
    let (mut img, mut label) = (vec![0u8; ds.fields()[0].sample_bytes()], [0u8; 8]);
    let ctx = SampleContext {
        seed: 1,
        epoch: 0,
        index: 2,
    };
    ds.read_sample(
        &mut ImageScratch::default(),
        ctx,
        &mut [&mut img, &mut label],
    )
    .unwrap();
    assert_eq!(i64::from_ne_bytes(label), 1);
    assert_eq!(
        img,
        run(
            ImageTransformConfig {
                size: 24,
                ..Default::default()
            },
            ds.shard().get(2).unwrap(),
            ctx.sample_seed()
        )
    );
}

#[test]
fn non_jpeg_file_fails_pack_unless_skipped_and_corrupt_record_names_its_photo() {
    let dir = tempfile::tempdir().unwrap();
    let src = make_folder(dir.path());
    std::fs::write(src.join("cat/notes.txt"), "hello").unwrap();
    let msg = pack_image_folder(&src, dir.path().join("p"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("notes.txt: SOI marker: not a JPEG"), "{msg}");
    let opts = PackOptions {
        skip_non_jpeg: true,
        ..Default::default()
    };
    let summary = pack_image_folder_with(&src, dir.path().join("p"), &opts).unwrap();
    assert_eq!((summary.manifest.records, summary.skipped.len()), (3, 1));
    // A file that starts like a JPEG but is garbage: refused by the pack, naming it.
    std::fs::write(
        src.join("cat/c.jpg"),
        [&[0xFF, 0xD8, 0xFF][..], &[0u8; 64][..]].concat(),
    )
    .unwrap();
    let msg = pack_image_folder_with(&src, dir.path().join("p"), &opts)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains(&format!(
            "{}: jpeg: corrupt JPEG structure: truncated",
            src.join("cat/c.jpg").display()
        )),
        "{msg}"
    );
    // Cut mid-scan with an end marker appended: whole in structure, so it packs; decoding
    // it fails, naming the photo from the pack's sources list, the record and the shard.
    let whole = textured(200, 150);
    let cut = [&whole[..whole.len() / 2], &[0xFF, 0xD9][..]].concat();
    std::fs::write(src.join("cat/c.jpg"), cut).unwrap();
    pack_image_folder_with(&src, dir.path().join("p"), &opts).unwrap();
    let ds = ImageRecordDataset::open(
        dir.path().join("p"),
        ImageTransformConfig {
            size: 8,
            ..Default::default()
        },
    )
    .unwrap();
    let (mut img, mut label) = (vec![0u8; ds.fields()[0].sample_bytes()], [0u8; 8]);
    let ctx = SampleContext {
        seed: 0,
        epoch: 0,
        index: 3,
    };
    let mut read_record_3 = || {
        ds.read_sample(
            &mut ImageScratch::default(),
            ctx,
            &mut [&mut img, &mut label],
        )
        .unwrap_err()
        .to_string()
    };
    let msg = read_record_3();
    let data = ds.shard().paths().data.display().to_string();
    assert!(
        msg.contains(&format!(
            "{}: record 3 of {data} (jpeg): libjpeg-turbo:",
            src.join("cat/c.jpg").display()
        )) && msg.contains("data.jpeg_decoder = \"zune\""),
        "{msg}"
    );
    // A pack from before the sources list: named by shard and record.
    std::fs::remove_file(dir.path().join("p.sources.json")).unwrap();
    let msg = read_record_3();
    assert!(msg.contains(&format!("{data}: record 3 (jpeg)")), "{msg}");
    // Labels that disagree with the shard are named.
    let labels = dir.path().join("p.labels.npy");
    stoker_data::npy::write_npy(&labels, DType::I64, &[2], &[0u8; 16]).unwrap();
    let msg = ImageRecordDataset::open(dir.path().join("p"), Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("p.labels.npy: shape: [2] (expected [4]"),
        "{msg}"
    );
}

/// A hidden folder is no class; an empty class folder is refused by name (it would take a
/// label and shift every later class's); a pack that fails part way (after writing
/// records) leaves the pack before it whole, and no temporary files.
#[test]
fn hidden_folders_are_passed_over_empty_classes_refused_and_a_failed_pack_keeps_the_last() {
    let dir = tempfile::tempdir().unwrap();
    let src = make_folder(dir.path());
    std::fs::create_dir_all(src.join(".ipynb_checkpoints")).unwrap();
    // Hidden folders inside a class hold no photos of it either (notebooks' copies).
    let copies = src.join("cat/.ipynb_checkpoints");
    std::fs::create_dir_all(&copies).unwrap();
    std::fs::copy(src.join("cat/a.jpg"), copies.join("a-checkpoint.jpg")).unwrap();
    let out = dir.path().join("p");
    let summary = pack_image_folder(&src, &out).unwrap();
    assert_eq!(summary.classes, vec!["ant", "cat"]);
    assert_eq!(summary.per_class, vec![1, 2]);
    let read_all = || -> Vec<Vec<u8>> {
        summary
            .outputs
            .iter()
            .map(|f| std::fs::read(f).unwrap())
            .collect()
    };
    let before = read_all();
    assert_eq!(before.len(), 6);
    std::fs::create_dir_all(src.join("dog")).unwrap();
    let msg = pack_image_folder(&src, &out).unwrap_err().to_string();
    assert!(msg.contains("dog: class folder: holds no files"), "{msg}");
    // A class whose files are all skipped as not JPEG is as empty.
    std::fs::write(src.join("dog/notes.txt"), "hello").unwrap();
    let opts = PackOptions {
        skip_non_jpeg: true,
        ..Default::default()
    };
    let msg = pack_image_folder_with(&src, &out, &opts)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("dog: class folder: holds no JPEG photos"),
        "{msg}"
    );
    std::fs::remove_dir_all(src.join("dog")).unwrap();
    // cat/notes.txt sorts after cat's photos: ant's and cat's records are written first.
    std::fs::write(src.join("cat/notes.txt"), "hello").unwrap();
    assert!(pack_image_folder(&src, &out).is_err());
    assert!(read_all() == before, "the earlier pack changed");
    let ds = ImageRecordDataset::open(&out, Default::default()).unwrap();
    assert_eq!(ds.len(), 3);
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains("partial"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn pack_with_max_side_shrinks_only_larger_photos() {
    let dir = tempfile::tempdir().unwrap();
    let src = make_folder(dir.path()); // 50x40, 60x40 (cat), 50x40 (ant)
    let opts = PackOptions {
        max_side: Some(55),
        ..Default::default()
    };
    let summary = pack_image_folder_with(&src, dir.path().join("p"), &opts).unwrap();
    assert_eq!(summary.downscaled, 1);
    let ds =
        ImageRecordDataset::open(dir.path().join("p"), ImageTransformConfig::default()).unwrap();
    let mut buf = Vec::new();
    let sizes: Vec<(u32, u32)> = (0..3)
        .map(|i| {
            decode_jpeg(ds.shard().get(i).unwrap(), &mut buf)
                .map(|d| (d.width, d.height))
                .unwrap()
        })
        .collect();
    assert_eq!(sizes, vec![(50, 40), (55, 37), (50, 40)]);
    assert_eq!(
        ds.shard().get(0).unwrap(),
        std::fs::read(src.join("ant/z.jpeg")).unwrap(),
        "kept byte for byte"
    );
    let bad = PackOptions { quality: 0, ..opts };
    assert!(pack_image_folder_with(&src, dir.path().join("q"), &bad)
        .unwrap_err()
        .to_string()
        .contains("quality"));
}

#[test]
fn dct_reduction_is_the_largest_that_keeps_the_output_size() {
    let crop = |width, height| CropBox {
        top: 0,
        left: 0,
        height,
        width,
    };
    assert_eq!(dct_reduction(crop(1792, 1792), 224, 224), 8);
    assert_eq!(dct_reduction(crop(1791, 1792), 224, 224), 4);
    assert_eq!(dct_reduction(crop(896, 5000), 224, 224), 4);
    assert_eq!(dct_reduction(crop(447, 447), 224, 224), 1);
    assert_eq!(dct_reduction(crop(448, 448), 224, 224), 2);
    // Eval: the whole 1024x768 image to 341x256 (shorter side 256) allows 1/2, not 1/4.
    assert_eq!(dct_reduction(crop(1024, 768), 341, 256), 2);
}

/// Train and eval outputs from a scaled decode (`dct_scaling: true`) against the full-size
/// decode of the same crop, on a textured image whose XOR pattern has hard edges every few
/// pixels (a worst case for the reduced IDCT: detail near the output's Nyquist limit). The crop
/// and flip are drawn from the full size in both, so they match; what differs is the reduced
/// IDCT's block-wise low-pass against the bilinear filter's. Measured (12 train crops at 1/2
/// or 1/4, eval at 1/4): train max 3-21, mean 0.45-1.6 levels; eval max 34, mean 1.7.
/// Bound: max 40, mean 2 levels (1 level = 1/255 of the pixel range).
#[test]
fn dct_scaled_decode_stays_close_to_full_scale() {
    let (w, h) = (1600u16, 1200u16);
    let jpg = textured(w, h);
    let train = ImageTransformConfig {
        size: 64,
        scale: (0.25, 1.0),
        ..Default::default()
    };
    let mut checked = 0;
    for (cfg, seeds) in [(train, 0..12u64), (ImageTransformConfig::eval(), 0..1)] {
        let scaled = ImagePipeline::new(cfg.clone()).unwrap();
        let full = ImagePipeline::new(ImageTransformConfig {
            dct_scaling: false,
            ..cfg.clone()
        })
        .unwrap();
        for seed in seeds {
            let (crop, dst) = match cfg.mode {
                TransformMode::Train => (scaled.train_params(w.into(), h.into(), seed).0, 64),
                TransformMode::Eval => (
                    CropBox {
                        top: 0,
                        left: 0,
                        height: h.into(),
                        width: w.into(),
                    },
                    256,
                ),
            };
            assert!(dct_reduction(crop, dst, dst) >= 2, "seed {seed}: {crop:?}");
            let a = f32s(&run(cfg.clone(), &jpg, seed));
            let b = f32s(&run(full.config().clone(), &jpg, seed));
            let (max, mean) = diff_in_levels(&a, &b);
            assert!(
                max <= 40.0 && mean <= 2.0,
                "{:?} seed {seed} crop {crop:?}: max {max} levels, mean {mean}",
                cfg.mode
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 13);
}

/// With DCT scaling on, equal (seed, epoch, index) give bit-identical output whatever the
/// scratch held before, and the sampled crop is the one drawn from the full-size header.
#[test]
fn scaled_decode_is_deterministic_per_sample_context() {
    let jpg = textured(1200, 900);
    let big = textured(1600, 1200);
    let cfg = ImageTransformConfig {
        size: 64,
        ..Default::default()
    };
    let p = ImagePipeline::new(cfg).unwrap();
    let seed = |epoch, index| {
        SampleContext {
            seed: 7,
            epoch,
            index,
        }
        .sample_seed()
    };
    let mut fresh = vec![0u8; p.output_bytes()];
    let mut reused = fresh.clone();
    let mut used = ImageScratch::default();
    for (epoch, index) in [(0, 0), (0, 1), (3, 0), (3, 17)] {
        p.apply(&big, seed(epoch + 1, index), &mut used, &mut reused)
            .unwrap();
        p.apply(&jpg, seed(epoch, index), &mut used, &mut reused)
            .unwrap();
        p.apply(
            &jpg,
            seed(epoch, index),
            &mut ImageScratch::default(),
            &mut fresh,
        )
        .unwrap();
        assert_eq!(fresh, reused, "epoch {epoch} index {index}");
    }
    p.apply(&jpg, seed(0, 0), &mut used, &mut fresh).unwrap();
    p.apply(&jpg, seed(0, 1), &mut used, &mut reused).unwrap();
    assert_ne!(fresh, reused, "another index draws another crop");
}

/// libjpeg-turbo and zune-jpeg decode the same pixels to within their rounding (both full
/// size). A stream cut short mid-scan with an EOI marker appended passes the structural check;
/// libjpeg-turbo rejects it (its "premature end of data segment" warning is an error), while
/// zune-jpeg, as before this backend existed, decodes it (recorded here, not endorsed).
#[test]
fn backends_agree_and_libjpeg_turbo_rejects_a_cut_stream() {
    let jpg = textured(200, 150);
    let da = decode_jpeg(&jpg, &mut Vec::new()).unwrap();
    let cfg = ImageTransformConfig {
        size: 32,
        decoder: JpegBackend::Zune,
        dct_scaling: false,
        ..ImageTransformConfig::eval()
    };
    let turbo_out = f32s(&run(
        ImageTransformConfig {
            decoder: JpegBackend::LibjpegTurbo,
            ..cfg.clone()
        },
        &jpg,
        0,
    ));
    let zune_out = f32s(&run(cfg.clone(), &jpg, 0));
    let (max, _) = diff_in_levels(&turbo_out, &zune_out);
    assert!(max <= 3.01, "turbo vs zune: max {max} levels");
    assert_eq!((da.width, da.height, da.channels), (200, 150, 3));
    let cut = [&jpg[..jpg.len() / 2], &[0xFF, 0xD9][..]].concat();
    for (backend, rejects) in [
        (JpegBackend::LibjpegTurbo, true),
        (JpegBackend::Zune, false),
    ] {
        let p = ImagePipeline::new(ImageTransformConfig {
            decoder: backend,
            ..cfg.clone()
        })
        .unwrap();
        let mut out = vec![0u8; p.output_bytes()];
        let r = p.apply(&cut, 0, &mut ImageScratch::default(), &mut out);
        assert_eq!(r.is_err(), rejects, "{backend:?}: {r:?}");
        if let Err(e) = r {
            assert!(e.to_string().contains("premature end"), "{e}");
        }
    }
}
