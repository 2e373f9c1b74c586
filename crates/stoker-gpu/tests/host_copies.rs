//! The host build's copies between "host" and "device" (`Backend::start_write`,
//! `start_read`, and the pinned source's `start_write_from_pin`), which stand in for a
//! GPU's copy streams in every test: a write lands at its wait and poisons its
//! destination until then, a read reads at its finish, and a copy from pinned memory
//! refuses a source written before it landed. A device copies at any moment between
//! start and wait; these make a missing wait, or a write in between, show in the bits or
//! as an error.

use stoker_gpu::counting::{CountingBackend, Work};
use stoker_gpu::host::POISON;
use stoker_gpu::{Backend, GpuError, Host, PinnedHostBuf};

#[test]
fn a_write_poisons_its_destination_until_its_wait_lands_it() {
    let be = Host;
    let dst = be.upload(&[1.0f32, 2.0, 3.0]).unwrap();
    // SAFETY: nothing touches `dst` until the wait; it outlives it.
    let w = unsafe { be.start_write(be.all(&dst), &[7.0f32, 8.0, 9.0]).unwrap() };
    let poisoned = be.download(&dst).unwrap();
    assert!(poisoned.iter().all(|x| x.is_nan()), "{poisoned:?}");
    assert_eq!(
        f32::from_ne_bytes([POISON; 4]).to_bits(),
        poisoned[0].to_bits()
    );
    be.wait_write(w).unwrap();
    assert_eq!(be.download(&dst).unwrap(), vec![7.0, 8.0, 9.0]);
}

#[test]
fn a_destination_written_before_the_wait_is_refused() {
    let be = Host;
    let dst = be.upload(&[0i32; 4]).unwrap();
    // SAFETY: the test breaks the contract on purpose, on the host build only.
    let w = unsafe { be.start_write(be.all(&dst), &[1, 2, 3, 4]).unwrap() };
    be.write(&dst, 2, &[5]).unwrap();
    match be.wait_write(w) {
        Err(GpuError::Order { what }) => assert!(what.contains("byte 8"), "{what}"),
        other => panic!("expected an order error, got {other:?}"),
    }
}

#[test]
fn a_read_takes_the_elements_at_its_finish() {
    let be = Host;
    let src = be.upload(&[1.0f32, 2.0]).unwrap();
    // SAFETY: the test writes `src` before the finish on purpose: on the host build the
    // read happens at the finish, so the write shows.
    let r = unsafe { be.start_read(be.all(&src)).unwrap() };
    be.write(&src, 0, &[4.0]).unwrap();
    let mut out = [0.0f32; 2];
    be.finish_read(r, be.all(&src), &mut out).unwrap();
    assert_eq!(out, [4.0, 2.0]);
    // A read finished for another view is refused.
    // SAFETY: `src` is alive and unwritten until the finish.
    let r = unsafe { be.start_read(be.view(&src, 0..1).unwrap()).unwrap() };
    let err = be
        .finish_read(r, be.view(&src, 1..2).unwrap(), &mut out[..1])
        .unwrap_err();
    assert!(matches!(err, GpuError::Shape { .. }), "{err:?}");
}

#[test]
fn a_pinned_copy_lands_its_source_and_refuses_one_written_in_flight() {
    let be = Host;
    let pinned = PinnedHostBuf::<Host, f32>::zeros(&be, 6).unwrap();
    Host.write_at(
        pinned.settled(&be).unwrap(),
        &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
    )
    .unwrap();
    let dst = be.zeros::<f32>(3).unwrap();

    // SAFETY: nothing touches `dst` until the wait; it outlives it.
    let w = unsafe { pinned.start_copy_to(&be, 2..5, be.all(&dst)).unwrap() };
    be.wait_write(w).unwrap();
    assert_eq!(be.download(&dst).unwrap(), vec![3.0, 4.0, 5.0]);

    // In the stream's order: at once on the host build.
    pinned.copy_to(&be, 0..3, be.all(&dst)).unwrap();
    assert_eq!(be.download(&dst).unwrap(), vec![1.0, 2.0, 3.0]);

    // The source changed between the start and the wait: on a device the copy engine
    // may have read either value.
    // SAFETY: as above.
    let w = unsafe { pinned.start_copy_to(&be, 3..6, be.all(&dst)).unwrap() };
    Host.write_at(pinned.view(4..5).unwrap(), &[-1.0]).unwrap();
    match be.wait_write(w) {
        Err(GpuError::Order { what }) => assert!(what.contains("pinned"), "{what}"),
        other => panic!("expected an order error, got {other:?}"),
    }

    // Out of range: refused before anything is copied.
    // SAFETY: as above.
    let err = unsafe { pinned.start_copy_to(&be, 4..7, be.all(&dst)) }.unwrap_err();
    assert!(matches!(err, GpuError::Shape { .. }), "{err:?}");
}

#[test]
fn a_copy_from_a_pin_must_read_inside_it() {
    let be = Host;
    let pinned = PinnedHostBuf::<Host, f32>::zeros(&be, 2).unwrap();
    let elsewhere = [1.0f32, 2.0];
    let dst = be.zeros::<f32>(2).unwrap();
    // A pin of another buffer: its copies must not read `elsewhere`.
    let pin = {
        let v = pinned.all().unwrap();
        // SAFETY: the pinned buffer outlives this pin and is not written meanwhile.
        unsafe { be.pin_host(v.addr(), 8).unwrap() }
    };
    // SAFETY: `dst` is untouched and alive until the wait (which never comes: refused).
    let err = unsafe { be.start_write_from_pin(be.all(&dst), &pin, &elsewhere) }.unwrap_err();
    match err {
        GpuError::Shape { what, .. } => assert!(what.contains("outside"), "{what}"),
        other => panic!("expected a shape error, got {other:?}"),
    }
    let err = unsafe { be.write_from_pin(be.all(&dst), &pin, &elsewhere) }.unwrap_err();
    assert!(matches!(err, GpuError::Shape { .. }), "{err:?}");
}

#[test]
fn pinned_copies_count_as_the_copies_they_replace() {
    let be = CountingBackend::new();
    let pinned = PinnedHostBuf::<CountingBackend, i32>::zeros(&be, 8).unwrap();
    let dst = be.zeros::<i32>(4).unwrap();
    // SAFETY: the counting backend writes nothing.
    copy_and_wait(&be, &pinned, 0..4, be.all(&dst));
    pinned.copy_to(&be, 4..8, be.all(&dst)).unwrap();
    assert_eq!(
        be.take(),
        vec![
            Work::Transfer {
                bytes: 16,
                up: true
            },
            Work::Upload { bytes: 16 }
        ]
    );
}

/// Starts a copy from `pinned` into `dst` and waits for it (generic: the counting
/// backend's pending write is `()`).
fn copy_and_wait<B: Backend>(
    be: &B,
    pinned: &PinnedHostBuf<B, i32>,
    src: std::ops::Range<usize>,
    dst: stoker_gpu::View<i32>,
) {
    // SAFETY: the callers' `dst` is untouched and alive until the wait just below.
    let pending = unsafe { pinned.start_copy_to(be, src, dst).unwrap() };
    be.wait_write(pending).unwrap();
}

#[test]
fn the_offload_bench_lands_every_way_of_copying_on_the_host_build() {
    // The times mean nothing here; every way's landed bytes are checked inside.
    let rows = stoker_gpu::offload_bench::time_copies(&Host, 1000, 3).unwrap();
    let ways: Vec<_> = rows.iter().map(|r| r.what).collect();
    assert_eq!(
        ways,
        [
            "up: pageable, in the stream's order",
            "up: staged, copy stream",
            "up: pinned, copy stream",
            "down: pageable, in the stream's order",
            "down: copy stream",
            "down: into pinned, copy stream",
        ]
    );
    assert!(rows.iter().all(|r| r.bytes == 4000 && r.micros >= 0.0));
    let overlap = stoker_gpu::offload_bench::time_overlap(&Host, 1000, (2000, 3), 3).unwrap();
    let hidden = overlap.hidden();
    assert!((0.0..=1.0).contains(&hidden), "{overlap:?}");
}

#[test]
fn overlap_is_the_share_of_the_shorter_run_beside_the_longer() {
    use stoker_gpu::offload_bench::Overlap;
    let o = |compute_us, copy_us, both_us| Overlap {
        compute_us,
        copy_us,
        both_us,
        pinned_direct: true,
    };
    assert_eq!(o(10.0, 4.0, 10.0).hidden(), 1.0);
    assert_eq!(o(10.0, 4.0, 14.0).hidden(), 0.0);
    assert_eq!(o(10.0, 4.0, 12.0).hidden(), 0.5);
    assert_eq!(o(10.0, 4.0, 16.0).hidden(), 0.0);
    assert_eq!(o(0.0, 4.0, 4.0).hidden(), 0.0);
}

#[test]
fn a_read_into_pinned_memory_poisons_it_until_its_finish() {
    let be = Host;
    let src = be.upload(&[1.5f32, 2.5, 3.5]).unwrap();
    let pinned = PinnedHostBuf::<Host, f32>::zeros(&be, 5).unwrap();

    // SAFETY: `src` is unwritten and alive, and elements 1..4 untouched, until the finish.
    let r = unsafe { pinned.start_read_into(&be, be.all(&src), 1..4).unwrap() };
    let meanwhile = Host.read(pinned.all().unwrap()).unwrap();
    assert_eq!(meanwhile[0], 0.0);
    assert!(meanwhile[1..4].iter().all(|x| x.is_nan()), "{meanwhile:?}");
    assert_eq!(meanwhile[4], 0.0);
    pinned.finish_read_into(&be, r, be.all(&src), 1..4).unwrap();
    assert_eq!(
        Host.read(pinned.all().unwrap()).unwrap(),
        vec![0.0, 1.5, 2.5, 3.5, 0.0]
    );

    // Finished into other elements than it started into: refused.
    // SAFETY: as above, for elements 0..3.
    let r = unsafe { pinned.start_read_into(&be, be.all(&src), 0..3).unwrap() };
    let err = pinned
        .finish_read_into(&be, r, be.all(&src), 2..5)
        .unwrap_err();
    assert!(matches!(err, GpuError::Shape { .. }), "{err:?}");

    // Written in flight: refused (on a device the copy engine may land after the write).
    // SAFETY: the test breaks the contract on purpose, on the host build only.
    let r = unsafe { pinned.start_read_into(&be, be.all(&src), 2..5).unwrap() };
    Host.write_at(pinned.view(3..4).unwrap(), &[9.0]).unwrap();
    match pinned.finish_read_into(&be, r, be.all(&src), 2..5) {
        Err(GpuError::Order { what }) => assert!(what.contains("pinned"), "{what}"),
        other => panic!("expected an order error, got {other:?}"),
    }
}

#[test]
fn a_pinned_buffer_starts_on_a_page_of_its_own() {
    // Whole pages from a page boundary (the run the backend pins lies inside the
    // buffer's own allocation), so two pinned buffers never share a page.
    for len in [0usize, 1, 1023, 1024, 5000] {
        let a = PinnedHostBuf::<Host, f32>::zeros(&Host, len).unwrap();
        let b = PinnedHostBuf::<Host, half::bf16>::zeros(&Host, len).unwrap();
        assert_eq!(a.all().unwrap().addr() % 4096, 0, "f32 x {len}");
        assert_eq!(b.all().unwrap().addr() % 4096, 0, "bf16 x {len}");
        assert_eq!((a.len(), b.len()), (len, len));
        assert!(a.is_direct(&Host));
    }
}

#[test]
fn a_source_written_before_its_pin_is_settled_is_refused() {
    let be = Host;
    let pinned = PinnedHostBuf::<Host, f32>::zeros(&be, 4).unwrap();
    Host.write_at(pinned.settled(&be).unwrap(), &[1.0, 2.0, 3.0, 4.0])
        .unwrap();
    let dst = be.zeros::<f32>(2).unwrap();
    // In the stream's order: on a device the copy engine reads the source until the pin
    // is settled.
    pinned.copy_to(&be, 1..3, be.all(&dst)).unwrap();
    pinned.copy_to(&be, 1..3, be.all(&dst)).unwrap();
    assert_eq!(be.download(&dst).unwrap(), vec![2.0, 3.0]);
    // Settled, then written: fine.
    Host.write_at(pinned.settled(&be).unwrap(), &[5.0, 6.0, 7.0, 8.0])
        .unwrap();
    pinned.copy_to(&be, 1..3, be.all(&dst)).unwrap();
    // Written without the settle: the next use of the pin refuses it, and so does the
    // settle.
    Host.write_at(pinned.view(2..3).unwrap(), &[0.5]).unwrap();
    let err = pinned.copy_to(&be, 0..2, be.all(&dst)).unwrap_err();
    assert!(matches!(err, GpuError::Order { .. }), "{err:?}");
    match pinned.settled(&be) {
        Err(GpuError::Order { what }) => assert!(what.contains("settled"), "{what}"),
        other => panic!("expected an order error, got {other:?}"),
    }
}
