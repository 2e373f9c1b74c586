//! Simulated FP8: E4M3 quantize-dequantize of linear inputs, E5M2 of output gradients.

mod common;

use common::*;
use stoker_train::accumulate::{accumulate, AccumulateOptions, Normalization};
use stoker_train::layout::FlatLayout;
use stoker_train::precision::{Fp8State, Fx, Precision};

/// One window of the tiny GPT's gradients with its linear layers in simulated FP8 through
/// `fp8`'s scalers, and the same window's FP32 gradients.
fn fp8_and_exact_grads(fp8: &Fp8State) -> (Vec<f32>, Vec<f32>) {
    let model = tiny_gpt(Precision::Fp32);
    let layout = FlatLayout::of(stoker_train::models::Model::params(&model)).unwrap();
    let window = [token_batch(5, 2, 6, 11, &[0, 1])];
    let (exact, _) = window_grads(&model, Precision::Fp32, &window, Normalization::WindowCount);
    let fx = Fx::new(Precision::Fp8, Some(fp8));
    let mut g = vec![0f32; layout.total_len()];
    accumulate(
        &model,
        &fx,
        &window,
        AccumulateOptions::default(),
        &layout,
        &mut g,
    )
    .unwrap();
    (g, exact)
}

#[test]
fn fp8_gradients_are_close_to_fp32_but_not_equal_and_scalers_track_amax() {
    let fp8 = Fp8State::new(Default::default());
    let (g, exact) = fp8_and_exact_grads(&fp8);
    let rel = rel_l2(&g, &exact);
    assert!(
        rel > 1e-4 && rel < 0.25,
        "fp8 vs fp32 gradient: relative difference {rel}"
    );
    let state = fp8.state();
    // Every linear layer (qkv, proj, fc, mlp.proj per block, plus the tied head).
    assert_eq!(
        state.len(),
        4 * 2 + 1,
        "{:?}",
        state.keys().collect::<Vec<_>>()
    );
    for (name, [x, w, dy]) in &state {
        for (role, s) in [("input", x), ("weight", w), ("grad", dy)] {
            assert!(
                s.history().iter().any(|&a| a > 0.0),
                "{name} {role}: amax recorded"
            );
        }
        assert_eq!(dy.format(), stoker_precision::Fp8Format::E5M2);
        assert_eq!(x.format(), stoker_precision::Fp8Format::E4M3);
    }
}

/// A checkpoint's scalers are checked before they are restored: a history entry below 0,
/// a position outside the history, a scale that is not finite and positive, or a
/// `scale_inv` that is not its inverse is refused naming the layer and the field (a
/// position outside the history panicked at the next update).
#[test]
fn saved_scalers_that_do_not_hold_together_are_refused_naming_layer_and_field() {
    let fp8 = Fp8State::new(Default::default());
    fp8_and_exact_grads(&fp8);
    fp8.update();
    let saved = fp8.state();
    Fp8State::check_saved(&saved).unwrap();
    let layer = saved.keys().next().unwrap().clone();
    for (field, value) in [
        ("history", serde_json::json!([-1.0, 0.0])),
        ("pos", serde_json::json!(1024)),
        ("scale", serde_json::json!(0.0)),
        ("scale_inv", serde_json::json!(3.0)),
    ] {
        let mut bad = saved.clone();
        let mut json = serde_json::to_value(&bad[&layer][0]).unwrap();
        json[field] = value;
        // A history of two entries: the position stays inside it unless the case moves it.
        if field == "history" {
            json["pos"] = serde_json::json!(0);
        }
        bad.get_mut(&layer).unwrap()[0] = serde_json::from_value(json).unwrap();
        let e = match Fp8State::check_saved(&bad) {
            Err(e) => e.to_string(),
            Ok(()) => panic!("{field}: accepted"),
        };
        assert!(
            e.contains(&format!("layer {layer}")) && e.contains(field),
            "{field}: {e}"
        );
    }
}

/// The scratch step a run counts its memory with runs in fp8 too (it casts as training
/// does) and leaves the scalers as they were: a trainer that ran it trains the same bits
/// as one that did not, scalers included.
#[test]
fn the_scratch_step_counts_fp8_and_leaves_its_scalers_as_they_were() {
    use common::ranks::{config, micro_batch, GPT, SGD};
    use stoker_train::trainer::Trainer;
    let c = config(GPT, "fp8", "fused", SGD, "");
    let window = |s: usize| [micro_batch(GPT, s, 0), micro_batch(GPT, s, 1)];
    let run = |scratch: bool| {
        let mut t = Trainer::new(&c).unwrap();
        t.train_step(&window(0)).unwrap();
        if scratch {
            let before = t.fp8().unwrap().state();
            let counted = t.scratch_micro_batch(&micro_batch(GPT, 7, 0)).unwrap();
            assert!(counted.is_some(), "fp8's scratch step ran");
            assert_eq!(t.fp8().unwrap().state(), before, "the scalers as they were");
        }
        t.train_step(&window(1)).unwrap();
        (t.full_master().unwrap(), t.fp8().unwrap().state())
    };
    let (with, without) = (run(true), run(false));
    stoker_testkit::assert_bits_eq(&with.0, &without.0, "weights after a scratch step");
    assert_eq!(with.1, without.1, "scalers after a scratch step");
}
