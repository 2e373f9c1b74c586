//! The device check's scenario on the host: every kernel's outputs are finite, the same
//! bits on a second run (nothing depends on scheduling or leftovers), and bf16 storage
//! lands within bf16's precision of f32 storage.

use stoker_gpu::scenario::{all_outputs, ScenarioSize};
use stoker_gpu::Host;
use stoker_testkit::{assert_bits_eq, assert_close, max_abs};

#[test]
fn every_kernel_runs_deterministically_and_bf16_tracks_f32() {
    let first = all_outputs(&Host, ScenarioSize::SMALL).unwrap();
    let second = all_outputs(&Host, ScenarioSize::SMALL).unwrap();
    assert_eq!(first.len(), 2 * (22 + 11) + 9, "outputs per scenario");
    for ((name, a), (_, b)) in first.iter().zip(&second) {
        assert!(
            !a.is_empty() && max_abs(a).is_finite(),
            "{name}: empty or not finite"
        );
        assert_bits_eq(a, b, &format!("{name}, second run"));
    }
    // The inputs are drawn in f32 and rounded for bf16, so each bf16 output tracks its
    // f32 twin; the gradients of a softmax over rounded scores drift the most.
    for (name, a) in first.iter().filter(|(n, _)| n.ends_with(" f32")) {
        let twin = name.replace(" f32", " bf16");
        let (_, b) = first.iter().find(|(n, _)| *n == twin).unwrap();
        assert_close(b, a, 5e-2, &format!("{twin} against {name}"));
    }
}
