//! The device check's scenario on the host: every kernel's outputs are finite (but for
//! f16's rounding of values past its range), the same bits on a second run (nothing
//! depends on scheduling or leftovers), and bf16 and f16 storage land within their
//! precision of f32 storage.

use stoker_gpu::scenario::{all_outputs, ScenarioSize};
use stoker_gpu::Host;
use stoker_testkit::{assert_bits_eq, assert_close, max_abs};

/// The output that rounds values up to 1e5 into f16, whose largest finite value is
/// 65,504: it must hold inf.
const PAST_F16: &str = "from-f32/large f16";

#[test]
fn every_kernel_runs_deterministically_and_16_bit_storage_tracks_f32() {
    let first = all_outputs(&Host, ScenarioSize::SMALL).unwrap();
    let second = all_outputs(&Host, ScenarioSize::SMALL).unwrap();
    assert_eq!(
        first.len(),
        3 * (24 + 11 + 3) + 9 + 21,
        "outputs per scenario"
    );
    for ((name, a), (_, b)) in first.iter().zip(&second) {
        assert!(!a.is_empty(), "{name}: empty");
        match name.as_str() {
            PAST_F16 => assert!(
                a.iter().any(|x| x.is_infinite()) && !a.iter().any(|x| x.is_nan()),
                "{name}: values past 65,504 did not round to inf"
            ),
            _ => assert!(max_abs(a).is_finite(), "{name}: not finite"),
        }
        assert_bits_eq(a, b, &format!("{name}, second run"));
    }
    // An FP8 cast's transpose alone is the transpose a whole cast writes beside it.
    for step in 0..3 {
        let find = |name: String| &first.iter().find(|(n, _)| *n == name).unwrap().1;
        assert_bits_eq(
            find(format!("fp8-quantize/e4m3-t alone f32 step {step}")),
            find(format!("fp8-quantize/e4m3-t f32 step {step}")),
            "the transpose cast alone",
        );
    }
    // The inputs are drawn in f32 and rounded for 16 bits, so each output tracks its f32
    // twin; the gradients of a softmax over rounded scores drift the most. f16 keeps 11
    // significant bits to bf16's 8.
    for (name, a) in first.iter().filter(|(n, _)| n.ends_with(" f32")) {
        for (ty, tol) in [("bf16", 5e-2), ("f16", 1e-2)] {
            let twin = name.replace(" f32", &format!(" {ty}"));
            if twin == PAST_F16 {
                continue;
            }
            let (_, b) = first.iter().find(|(n, _)| *n == twin).unwrap();
            assert_close(b, a, tol, &format!("{twin} against {name}"));
        }
    }
}
