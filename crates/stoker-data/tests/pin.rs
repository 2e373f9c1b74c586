//! pin_memory: page-aligned, zeroed, reused buffers; CUDA registration when a driver exists,
//! otherwise mlock; the same batches either way.

use std::sync::Arc;

use stoker_data::pin::PinKind;
use stoker_data::pool::{BufferPool, BUFFER_ALIGN};
use stoker_data::tokens::{write_tokens, TokenFormat};
use stoker_data::{DType, Loader, LoaderConfig, Sampler, SamplerConfig, TokenShard, TokenWindows};

#[test]
fn pinned_buffers_are_aligned_zeroed_and_locked() {
    let pool = BufferPool::new(10_000, true);
    let b = pool.take();
    assert_eq!(b.data.len(), 10_000);
    assert_eq!(b.data.as_ptr() as usize % BUFFER_ALIGN, 0);
    assert!(b.data.iter().all(|&x| x == 0));
    // No GPU in CI: with or without the `cuda` feature the buffer falls back to mlock (root may
    // always lock; elsewhere RLIMIT_MEMLOCK may refuse, and the buffer stays pageable).
    let has_driver = pool.pinner().has_cuda();
    match b.data.pinned() {
        PinKind::Cuda => assert!(has_driver),
        PinKind::Mlock | PinKind::None => assert!(!has_driver || cfg!(not(feature = "cuda"))),
    }
    drop(b);
    let _again = pool.take();
    assert_eq!(pool.allocated(), 1, "returned buffers are reused");
    assert_eq!(
        BufferPool::new(100, false).take().data.pinned(),
        PinKind::None
    );
}

#[test]
fn pin_memory_does_not_change_batches() {
    let dir = tempfile::tempdir().unwrap();
    let toks: Vec<u16> = (0..1000).map(|i| (i * 37 % 5000) as u16).collect();
    write_tokens(dir.path().join("t.bin"), &toks, TokenFormat::Llmc).unwrap();
    let ds = Arc::new(
        TokenWindows::new(
            vec![TokenShard::open_detect(dir.path().join("t.bin")).unwrap()],
            16,
            DType::I64,
        )
        .unwrap(),
    );
    let run = |pin_memory: bool| -> Vec<Vec<u8>> {
        let s = Sampler::new(
            ds_len(&ds),
            SamplerConfig {
                shuffle: true,
                ..Default::default()
            },
        )
        .unwrap();
        let cfg = LoaderConfig {
            batch_size: 8,
            num_workers: 2,
            pin_memory,
            ..Default::default()
        };
        let mut l = Loader::new(ds.clone(), s, cfg).unwrap();
        l.epoch(0)
            .map(|b| b.unwrap().field("input").unwrap().bytes.to_vec())
            .collect()
    };
    assert_eq!(run(true), run(false));
}

fn ds_len(ds: &TokenWindows) -> usize {
    stoker_data::Dataset::len(ds)
}

#[test]
fn buffer_sizes_that_do_not_round_to_a_page_panic_before_allocating() {
    use stoker_data::pin::Pinner;
    use stoker_data::pool::HostBuffer;
    let pinner = Pinner::new(false);
    // Rounding up to a page would wrap (to 0) or not fit a Layout: a panic, never a buffer
    // that claims more bytes than it holds.
    for len in [usize::MAX, usize::MAX - BUFFER_ALIGN, isize::MAX as usize] {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            HostBuffer::new(len, &pinner)
        }));
        assert!(r.is_err(), "HostBuffer::new({len}) must panic");
    }
    assert_eq!(HostBuffer::new(1, &pinner).len(), 1);
}
