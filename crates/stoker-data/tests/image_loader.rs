//! JPEG records through the loader: augmented batches are bit-identical for any worker count,
//! and differ between epochs (randomness from (seed, epoch, index), not from the thread).

use std::sync::Arc;

use jpeg_encoder::{ColorType, Encoder};
use stoker_data::pack::image_folder::pack_image_folder;
use stoker_data::transform::ImageTransformConfig;
use stoker_data::{DType, ImageRecordDataset, Loader, LoaderConfig, Sampler, SamplerConfig};

fn textured(w: u16, h: u16, salt: usize) -> Vec<u8> {
    let mut px = Vec::with_capacity(w as usize * h as usize * 3);
    for y in 0..h as usize {
        for x in 0..w as usize {
            px.extend([
                (x * 7 + salt) as u8,
                (y * 5 + salt * 3) as u8,
                ((x ^ y) * 9) as u8,
            ]);
        }
    }
    let mut out = Vec::new();
    Encoder::new(&mut out, 90)
        .encode(&px, w, h, ColorType::Rgb)
        .unwrap();
    out
}

#[test]
fn augmented_batches_do_not_depend_on_num_workers() {
    let dir = tempfile::tempdir().unwrap();
    for (c, class) in ["bird", "fish"].iter().enumerate() {
        let d = dir.path().join("src").join(class);
        std::fs::create_dir_all(&d).unwrap();
        for i in 0..9 {
            std::fs::write(
                d.join(format!("{i}.jpg")),
                textured(40 + 4 * i as u16, 36 + 2 * c as u16, i + c),
            )
            .unwrap();
        }
    }
    let prefix = dir.path().join("packed");
    pack_image_folder(dir.path().join("src"), &prefix).unwrap();
    let cfg = ImageTransformConfig {
        size: 24,
        dtype: DType::BF16,
        ..ImageTransformConfig::default()
    };
    let ds = Arc::new(ImageRecordDataset::open(&prefix, cfg).unwrap());
    let run = |workers: usize| -> Vec<Vec<u8>> {
        let sampler = Sampler::new(
            18,
            SamplerConfig {
                shuffle: true,
                seed: 5,
                ..Default::default()
            },
        )
        .unwrap();
        let config = LoaderConfig {
            batch_size: 4,
            num_workers: workers,
            persistent_workers: workers > 0,
            ..Default::default()
        };
        let mut l = Loader::new(ds.clone(), sampler, config).unwrap();
        (0..2)
            .flat_map(|e| {
                l.epoch(e)
                    .map(|b| {
                        let b = b.unwrap();
                        assert_eq!(b.field("image").unwrap().shape(), vec![b.len(), 3, 24, 24]);
                        [
                            b.field("image").unwrap().bytes,
                            b.field("label").unwrap().bytes,
                        ]
                        .concat()
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let reference = run(0);
    assert_eq!(reference.len(), 10, "5 batches per epoch, 2 epochs");
    assert_ne!(
        reference[..5],
        reference[5..],
        "augmentation differs between epochs"
    );
    for w in [1, 3] {
        assert_eq!(run(w), reference, "num_workers {w}");
    }
}
