//! The loader: same batches whatever the worker count, bounded prefetch, buffer reuse,
//! resumption, and errors and panics that reach the consumer instead of hanging it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use stoker_data::npy::write_npy;
use stoker_data::{
    ArrayDataset, DType, DataError, Dataset, FieldSpec, Loader, LoaderConfig, Partition,
    SampleContext, Sampler, SamplerConfig, SamplerState,
};

/// A dataset whose samples carry per-sample randomness, and that can be told to fail.
struct Synthetic {
    n: usize,
    fields: Vec<FieldSpec>,
    fail_at: Option<u64>,
    panic_at: Option<u64>,
    sleep_at: Option<(u64, Duration)>,
    reads: AtomicUsize,
}

impl Synthetic {
    fn new(n: usize) -> Self {
        Synthetic {
            n,
            fields: vec![
                FieldSpec::new("x", DType::F32, vec![3]),
                FieldSpec::new("y", DType::I64, vec![]),
            ],
            fail_at: None,
            panic_at: None,
            sleep_at: None,
            reads: AtomicUsize::new(0),
        }
    }
}

impl Dataset for Synthetic {
    type Worker = Vec<f32>;
    fn len(&self) -> usize {
        self.n
    }
    fn fields(&self) -> &[FieldSpec] {
        &self.fields
    }
    fn read_sample(
        &self,
        scratch: &mut Vec<f32>,
        ctx: SampleContext,
        out: &mut [&mut [u8]],
    ) -> stoker_data::Result<()> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        if self.fail_at == Some(ctx.index) {
            return Err(DataError::Sample {
                index: ctx.index,
                message: "corrupt record".into(),
            });
        }
        if self.panic_at == Some(ctx.index) {
            panic!("decoder bug at {}", ctx.index);
        }
        if let Some((i, d)) = self.sleep_at {
            if i == ctx.index {
                std::thread::sleep(d);
            }
        }
        let r = ctx.sample_seed();
        scratch.clear();
        scratch.extend([ctx.index as f32, (r >> 40) as f32, ctx.epoch as f32]);
        out[0].copy_from_slice(bytemuck::cast_slice(scratch));
        out[1].copy_from_slice(&(ctx.index as i64 * 10).to_le_bytes());
        Ok(())
    }
}

fn shuffled(n: usize) -> Sampler {
    Sampler::new(
        n,
        SamplerConfig {
            shuffle: true,
            seed: 11,
            ..Default::default()
        },
    )
    .unwrap()
}

fn collect<D: Dataset>(loader: &mut Loader<D>, epoch: u64) -> Vec<(Vec<usize>, Vec<u8>, Vec<u8>)> {
    loader
        .epoch(epoch)
        .map(|b| {
            let b = b.unwrap();
            (
                b.indices().to_vec(),
                b.field_at(0).bytes.to_vec(),
                b.field_at(1).bytes.to_vec(),
            )
        })
        .collect()
}

fn config(
    batch_size: usize,
    num_workers: usize,
    prefetch_factor: usize,
    persistent: bool,
) -> LoaderConfig {
    LoaderConfig {
        batch_size,
        num_workers,
        prefetch_factor,
        persistent_workers: persistent,
        ..Default::default()
    }
}

#[test]
fn identical_batches_for_any_worker_count() {
    let ds = Arc::new(Synthetic::new(157));
    let mut reference = Loader::new(ds.clone(), shuffled(157), config(10, 0, 2, false)).unwrap();
    let want: Vec<_> = (0..2).map(|e| collect(&mut reference, e)).collect();
    assert_eq!(want[0].len(), 16);
    assert_eq!(
        want[0][15].0.len(),
        7,
        "short last batch kept without drop_last"
    );
    assert_ne!(want[0], want[1], "epochs differ");
    for (workers, prefetch, persistent) in [
        (1, 1, false),
        (1, 2, true),
        (4, 2, false),
        (4, 3, true),
        (3, 1, true),
    ] {
        let mut l = Loader::new(
            ds.clone(),
            shuffled(157),
            config(10, workers, prefetch, persistent),
        )
        .unwrap();
        for (e, w) in want.iter().enumerate() {
            assert_eq!(
                &collect(&mut l, e as u64),
                w,
                "workers {workers} prefetch {prefetch} epoch {e}"
            );
        }
    }
}

#[test]
fn drop_last_and_batch_values() {
    let ds = Arc::new(Synthetic::new(25));
    let mut l = Loader::new(
        ds,
        Sampler::new(25, SamplerConfig::default()).unwrap(),
        LoaderConfig {
            drop_last: true,
            ..config(4, 2, 2, false)
        },
    )
    .unwrap();
    assert_eq!(l.batches_per_epoch(), 6);
    let batches: Vec<_> = l.epoch(0).map(Result::unwrap).collect();
    assert_eq!(batches.len(), 6);
    let b = &batches[2];
    assert_eq!(b.field("x").unwrap().shape(), vec![4, 3]);
    assert_eq!(
        b.field("y").unwrap().as_slice::<i64>().unwrap(),
        &[80, 90, 100, 110]
    );
    assert_eq!(b.field("x").unwrap().as_slice::<f32>().unwrap()[3], 9.0);
}

#[test]
fn steady_state_reuses_buffers_and_prefetch_is_bounded() {
    let ds = Arc::new(Synthetic::new(400));
    let mut l = Loader::new(ds, shuffled(400), config(8, 2, 3, true)).unwrap();
    for b in l.epoch(0) {
        let _b = b.unwrap();
        std::thread::sleep(Duration::from_millis(1)); // a slow consumer: workers run ahead
    }
    let cap = 2 * 3;
    assert!(
        l.buffers_allocated() <= cap + 1,
        "at most prefetch x workers in flight plus the one held: {}",
        l.buffers_allocated()
    );
    for e in 1..4 {
        for b in l.epoch(e) {
            b.unwrap();
        }
    }
    // 200 batches served from at most cap + 1 buffers, whatever the thread timing was.
    assert!(
        l.buffers_allocated() <= cap + 1,
        "{} buffers for 200 batches",
        l.buffers_allocated()
    );
    let s = l.stats();
    assert_eq!(s.batches, 200);
    assert_eq!(s.samples, 1600);
    assert_eq!(s.bytes, 1600 * (12 + 8));
    assert_eq!(s.worker_busy.len(), 2);
    assert!(s.worker_busy.iter().all(|d| *d > Duration::ZERO));
}

#[test]
fn contiguous_batches_are_zero_copy_views() {
    let dir = tempfile::tempdir().unwrap();
    let img: Vec<u8> = (0..=255u8).cycle().take(100 * 6).collect();
    write_npy(dir.path().join("d.image.npy"), DType::U8, &[100, 6], &img).unwrap();
    let lab: Vec<u8> = (0..100i64).flat_map(|v| v.to_le_bytes()).collect();
    write_npy(dir.path().join("d.label.npy"), DType::I64, &[100], &lab).unwrap();
    let ds =
        Arc::new(ArrayDataset::open_prefix(dir.path().join("d"), &["image", "label"]).unwrap());
    for shuffle in [false, true] {
        let sampler = Sampler::new(
            100,
            SamplerConfig {
                shuffle,
                ..Default::default()
            },
        )
        .unwrap();
        let mut l = Loader::new(ds.clone(), sampler, config(16, 2, 2, false)).unwrap();
        for b in l.epoch(0) {
            let b = b.unwrap();
            let f = b.field("image").unwrap();
            assert_eq!(f.zero_copy, !shuffle);
            let want: Vec<u8> = b
                .indices()
                .iter()
                .flat_map(|&i| img[i * 6..i * 6 + 6].to_vec())
                .collect();
            assert_eq!(f.bytes, &want[..]);
            let labels: Vec<i64> = b.indices().iter().map(|&i| i as i64).collect();
            assert_eq!(
                b.field("label").unwrap().as_slice::<i64>().unwrap(),
                &labels[..]
            );
        }
        assert_eq!(l.stats().zero_copy_batches, if shuffle { 0 } else { 7 });
    }
}

#[test]
fn resume_mid_epoch_continues_identically() {
    let ds = Arc::new(Synthetic::new(90));
    let mut full = Loader::new(ds.clone(), shuffled(90), config(7, 2, 2, false)).unwrap();
    let want = collect(&mut full, 3);
    let mut first = Loader::new(ds.clone(), shuffled(90), config(7, 2, 2, false)).unwrap();
    let state = {
        let mut it = first.epoch(3);
        for _ in 0..5 {
            it.next().unwrap().unwrap();
        }
        it.state()
    };
    assert_eq!(
        state,
        SamplerState {
            epoch: 3,
            batches_done: 5
        }
    );
    let json = serde_json::to_string(&state).unwrap();
    let restored: SamplerState = serde_json::from_str(&json).unwrap();
    let mut second = Loader::new(ds, shuffled(90), config(7, 3, 1, false)).unwrap();
    let rest: Vec<_> = second
        .resume(restored)
        .map(|b| {
            let b = b.unwrap();
            (
                b.indices().to_vec(),
                b.field_at(0).bytes.to_vec(),
                b.field_at(1).bytes.to_vec(),
            )
        })
        .collect();
    assert_eq!(rest, want[5..].to_vec());
}

#[test]
fn distributed_loaders_use_global_batches() {
    let ds = Arc::new(Synthetic::new(64));
    let mut single = Loader::new(
        ds.clone(),
        Sampler::new(
            64,
            SamplerConfig {
                shuffle: true,
                partition: Partition::GlobalBatch { global_batch: 8 },
                ..Default::default()
            },
        )
        .unwrap(),
        config(8, 1, 2, false),
    )
    .unwrap();
    let one: Vec<Vec<usize>> = collect(&mut single, 0).into_iter().map(|b| b.0).collect();
    let ranks: Vec<Vec<Vec<usize>>> = (0..2)
        .map(|rank| {
            let c = SamplerConfig {
                shuffle: true,
                rank,
                world: 2,
                partition: Partition::GlobalBatch { global_batch: 8 },
                ..Default::default()
            };
            let mut l = Loader::new(
                ds.clone(),
                Sampler::new(64, c).unwrap(),
                config(4, 2, 2, false),
            )
            .unwrap();
            collect(&mut l, 0).into_iter().map(|b| b.0).collect()
        })
        .collect();
    for k in 0..8 {
        let mut union = [ranks[0][k].clone(), ranks[1][k].clone()].concat();
        union.sort();
        let mut want = one[k].clone();
        want.sort();
        assert_eq!(union, want, "global step {k}");
    }
}

#[test]
fn worker_errors_and_panics_reach_the_consumer() {
    for workers in [0, 1, 3] {
        let mut ds = Synthetic::new(50);
        ds.fail_at = Some(23);
        let ds = Arc::new(ds);
        let mut l = Loader::new(
            ds.clone(),
            Sampler::new(50, SamplerConfig::default()).unwrap(),
            config(5, workers, 2, workers > 0),
        )
        .unwrap();
        let results: Vec<_> = l.epoch(0).collect();
        assert_eq!(
            results.iter().filter(|r| r.is_ok()).count(),
            4,
            "workers {workers}: batches before the bad one arrive"
        );
        let err = results.last().unwrap().as_ref().err().unwrap().to_string();
        assert!(
            err.contains("sample 23") && err.contains("corrupt record"),
            "{err}"
        );

        let mut ds = Synthetic::new(50);
        ds.panic_at = Some(31);
        let mut l = Loader::new(
            Arc::new(ds),
            Sampler::new(50, SamplerConfig::default()).unwrap(),
            config(5, workers.max(1), 2, false),
        )
        .unwrap();
        let err = l.epoch(0).find_map(Result::err).unwrap().to_string();
        assert!(
            err.contains("panicked") && err.contains("decoder bug at 31"),
            "{err}"
        );
        // The loader is still usable: the next epoch fails at the same place, not with a hang.
        assert!(l.epoch(1).any(|r| r.is_err()));
    }
}

#[test]
fn a_stuck_worker_times_out_with_an_error() {
    let mut ds = Synthetic::new(20);
    ds.sleep_at = Some((2, Duration::from_millis(1500)));
    let cfg = LoaderConfig {
        timeout_s: Some(0.2),
        ..config(2, 1, 1, false)
    };
    let mut l = Loader::new(
        Arc::new(ds),
        Sampler::new(20, SamplerConfig::default()).unwrap(),
        cfg,
    )
    .unwrap();
    let err = l.epoch(0).find_map(Result::err).unwrap().to_string();
    assert!(err.contains("timeout"), "{err}");
}

#[test]
fn bad_loader_configs() {
    let ds = Arc::new(Synthetic::new(10));
    let s = || Sampler::new(10, SamplerConfig::default()).unwrap();
    let e = |c: LoaderConfig| Loader::new(ds.clone(), s(), c).err().unwrap().to_string();
    assert!(e(config(0, 0, 2, false)).contains("batch_size"));
    assert!(e(config(1, 2, 0, false)).contains("prefetch_factor"));
    assert!(e(config(1, 0, 2, true)).contains("persistent_workers"));
    // Past the bounds: refused by name before a thread starts or a queue is allocated.
    assert!(e(config(1, 100_000, 2, false)).contains("num_workers"));
    assert!(e(config(1, 1, 1_000_000_000_000, false)).contains("prefetch_factor"));
    Loader::new(ds.clone(), s(), config(1, 1024, 1024, false)).unwrap();
    assert!(e(LoaderConfig {
        timeout_s: Some(-1.0),
        ..config(1, 1, 1, false)
    })
    .contains("timeout_s"));
    let wrong = Sampler::new(11, SamplerConfig::default()).unwrap();
    assert!(Loader::new(ds.clone(), wrong, config(1, 0, 2, false))
        .err()
        .unwrap()
        .to_string()
        .contains("11"));
}
