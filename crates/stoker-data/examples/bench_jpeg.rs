//! JPEG pipeline benchmark: pack an image folder into a record shard, then decode +
//! random-resized-crop 224 + flip + normalize every record, on 1 and on 2 threads.
//!
//! Run: `cargo run --release -p stoker-data --example bench_jpeg -- DIR [--threads 1,2]
//! [--limit N] [--bf16] [--max-side PX] [--decoder turbo|zune] [--no-dct-scaling]` (DIR: one
//! sub-folder per class, e.g. data/photos-3k from scripts/fetch-photos.sh). Prints one `RESULT`
//! line per thread count. The decoder flags compare backends: libjpeg-turbo with DCT-domain
//! scaling is the default; `--decoder zune` is the earlier pure-Rust decoder (always full size). `--max-side` packs
//! FFCV-style (photos shrunk to that longer side and re-encoded at quality 90): less decode work
//! per epoch, so not the same work as decoding the original files; `--export DIR2` also writes
//! the packed records back out as an image folder, so a baseline can decode the same bytes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use stoker_data::pack::image_folder::{pack_image_folder_with, PackOptions};
use stoker_data::transform::{ImageScratch, ImageTransformConfig, JpegBackend};
use stoker_data::{DType, Dataset, ImageRecordDataset, SampleContext};

/// Indices a worker claims at a time from the shared counter.
const CHUNK: usize = 4;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args.first().ok_or(
        "usage: bench_jpeg DIR [--threads 1,2] [--limit N] [--bf16] [--decoder turbo|zune]",
    )?;
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
    };
    let threads: Vec<usize> = flag("--threads")
        .map_or("1,2", |s| s.as_str())
        .split(',')
        .map(|t| t.parse())
        .collect::<Result<_, _>>()?;
    let dtype = if args.iter().any(|a| a == "--bf16") {
        DType::BF16
    } else {
        DType::F32
    };

    let tmp = tempfile::tempdir()?;
    let prefix = tmp.path().join("photos");
    let t = Instant::now();
    let max_side = flag("--max-side").map(|s| s.parse::<u32>()).transpose()?;
    let options = PackOptions {
        max_side,
        ..Default::default()
    };
    let summary = pack_image_folder_with(dir, &prefix, &options)?;
    let secs = t.elapsed().as_secs_f64();
    let bytes = summary.manifest.data.bytes as f64;
    println!(
        "pack: {} images ({} downscaled), {} classes, {:.1} MB in {secs:.2} s ({:.0} images/s, {:.0} MB/s)",
        summary.manifest.records,
        summary.downscaled,
        summary.classes.len(),
        bytes / 1e6,
        summary.manifest.records as f64 / secs,
        bytes / 1e6 / secs
    );

    if let Some(export) = flag("--export") {
        let shard = stoker_data::RecordShard::open(&prefix)?;
        let labels = stoker_data::NpyArray::open(stoker_data::image_folder::labels_path(&prefix))?;
        let labels: &[i64] = labels.as_slice().ok_or("labels are not i64")?;
        for (i, &label) in labels.iter().enumerate() {
            let class_dir = std::path::Path::new(export).join(&summary.classes[label as usize]);
            std::fs::create_dir_all(&class_dir)?;
            std::fs::write(
                class_dir.join(format!("{i:06}.jpg")),
                shard.get(i).ok_or("short shard")?,
            )?;
        }
        println!("export: {} records to {export}", labels.len());
    }

    let decoder = match flag("--decoder").map(String::as_str) {
        None | Some("turbo") => JpegBackend::LibjpegTurbo,
        Some("zune") => JpegBackend::Zune,
        Some(other) => return Err(format!("--decoder {other} (expected turbo or zune)").into()),
    };
    let dct_scaling = !args.iter().any(|a| a == "--no-dct-scaling");
    let config = ImageTransformConfig {
        dtype,
        decoder,
        dct_scaling,
        ..Default::default()
    };
    let ds = ImageRecordDataset::open(&prefix, config)?;
    let n = flag("--limit")
        .map_or(Ok(ds.len()), |s| s.parse::<usize>())?
        .min(ds.len());
    // Warm the page cache and the CPU once, as a loader's first epoch would.
    run(&ds, n.min(16), 1, 0)?;
    for &t in &threads {
        let start = Instant::now();
        run(&ds, n, t, 1)?;
        let secs = start.elapsed().as_secs_f64();
        println!(
            "RESULT stoker threads={t} images={n} seconds={secs:.2} images_per_s={:.1} dtype={dtype} max_side={} decoder={decoder:?} dct_scaling={dct_scaling}",
            n as f64 / secs,
            max_side.map_or("none".to_string(), |m| m.to_string())
        );
    }
    Ok(())
}

/// Transforms samples `0..n` on `threads` threads, each with its own scratch and output.
fn run(ds: &ImageRecordDataset, n: usize, threads: usize, epoch: u64) -> stoker_data::Result<()> {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> stoker_data::Result<()> {
                    let mut scratch = ImageScratch::default();
                    let mut image = vec![0u8; ds.fields()[0].sample_bytes()];
                    let mut label = [0u8; 8];
                    loop {
                        let start = next.fetch_add(CHUNK, Ordering::Relaxed);
                        if start >= n {
                            return Ok(());
                        }
                        for index in start..(start + CHUNK).min(n) {
                            let ctx = SampleContext {
                                seed: 0,
                                epoch,
                                index: index as u64,
                            };
                            ds.read_sample(&mut scratch, ctx, &mut [&mut image, &mut label])?;
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("bench worker panicked"))
    })
}
