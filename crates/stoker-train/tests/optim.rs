//! AdamW and SGD against torch.optim on the same gradients (reference vectors written by
//! scripts/ref/adamw_reference.py), plus the schedule and clipping.

use serde_json::Value;
use stoker_train::clip::{clip_global_norm, global_norm};
use stoker_train::layout::FlatLayout;
use stoker_train::layout::ParamSpec;
use stoker_train::optim::{segments, AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use stoker_train::pieces::Pieces;
use stoker_train::schedule::Schedule;

fn reference() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/optim_reference.json"
    ))
    .unwrap();
    serde_json::from_str(&text).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// Runs `opt` over torch's gradients and returns the largest relative error of any
/// parameter after any step.
fn replay(case: &Value, opt: &mut dyn Optimizer, layout: &FlatLayout) -> f64 {
    let mut buf = vec![0f32; layout.total_len()];
    for (slot, init) in layout.slots().iter().zip(case["init"].as_array().unwrap()) {
        buf[slot.offset..slot.offset + slot.len].copy_from_slice(&floats(init));
    }
    let mut worst = 0f64;
    for step in case["steps"].as_array().unwrap() {
        let mut grads = vec![0f32; layout.total_len()];
        for (slot, g) in layout.slots().iter().zip(step["grads"].as_array().unwrap()) {
            grads[slot.offset..slot.offset + slot.len].copy_from_slice(&floats(g));
        }
        opt.step(&mut buf, &grads, step["lr"].as_f64().unwrap() as f32, None);
        for (slot, want) in layout
            .slots()
            .iter()
            .zip(step["params"].as_array().unwrap())
        {
            for (a, b) in buf[slot.offset..].iter().zip(floats(want)) {
                let rel = (*a as f64 - b as f64).abs() / (b as f64).abs().max(1e-6);
                worst = worst.max(rel);
            }
        }
    }
    worst
}

fn layout(case: &Value) -> FlatLayout {
    let shapes = case["shapes"].as_array().unwrap();
    let specs: Vec<ParamSpec> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let dims = s
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize);
            ParamSpec::new(format!("p{i}"), &dims.collect::<Vec<_>>())
        })
        .collect();
    FlatLayout::new(&specs, 16).unwrap()
}

#[test]
fn adamw_matches_torch_within_1e6_relative() {
    let r = reference();
    let case = &r["adamw"];
    let layout = layout(case);
    let config = AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    // Rank-2 weight decays, the bias does not: torch's two param groups.
    let mut opt = AdamW::new(config, &segments(&layout, false), 0..layout.total_len());
    let worst = replay(case, &mut opt, &layout);
    assert!(
        worst < 1e-6,
        "AdamW vs torch: worst relative error {worst:e}"
    );
}

#[test]
fn sgd_momentum_matches_torch_within_1e6_relative() {
    let r = reference();
    for (name, nesterov) in [("sgd", false), ("sgd_nesterov", true)] {
        let case = &r[name];
        let layout = layout(case);
        let config = SgdConfig {
            momentum: 0.9,
            weight_decay: 0.01,
            nesterov,
        };
        let mut opt = Sgd::new(config, &segments(&layout, false), 0..layout.total_len());
        let worst = replay(case, &mut opt, &layout);
        assert!(
            worst < 1e-6,
            "{name} vs torch: worst relative error {worst:e}"
        );
    }
}

#[test]
fn optimizer_state_round_trips_and_rejects_wrong_sizes() {
    let layout = FlatLayout::new(&[ParamSpec::new("w", &[3, 3])], 16).unwrap();
    let mut a = AdamW::new(AdamWConfig::default(), &segments(&layout, false), 0..16);
    let mut p = vec![0.5f32; 16];
    a.step(&mut p, &[0.1; 16], 1e-2, None);
    let mut b = AdamW::new(AdamWConfig::default(), &segments(&layout, false), 0..16);
    b.restore(a.state()).unwrap();
    let mut q = p.clone();
    a.step(&mut p, &[0.2; 16], 1e-2, None);
    b.step(&mut q, &[0.2; 16], 1e-2, None);
    assert_eq!(p, q);
    let mut c = AdamW::new(AdamWConfig::default(), &[], 0..32);
    let err = c.restore(a.state()).unwrap_err();
    assert!(err.contains("0..16") && err.contains("0..32"), "{err}");
    let mut bad = a.state();
    bad.buffers[1].1.pop();
    let err = b.restore(bad).unwrap_err();
    assert!(err.contains("exp_avg_sq"), "{err}");
}

/// Optimizers over the shards of a buffer update exactly what one optimizer over the
/// whole buffer does, bit for bit: ZeRO-1/2's contiguous split (boundaries inside tensors
/// included) and ZeRO-3's piece of every group (each rank's pieces end to end).
#[test]
fn shard_optimizers_equal_one_whole_buffer_optimizer() {
    let layout = FlatLayout::new(
        &[
            ParamSpec::new("a.weight", &[5, 7]),
            ParamSpec::new("a.bias", &[5]),
            ParamSpec::new("b.weight", &[3, 9]),
        ],
        16,
    )
    .unwrap();
    let n = layout.total_len();
    let segs = segments(&layout, false);
    let p0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let splits: Vec<Vec<Pieces>> = vec![
        vec![Pieces::one(0..n)],
        vec![Pieces::one(0..16), Pieces::one(16..n)],
        vec![
            Pieces::one(0..20),
            Pieces::one(20..45),
            Pieces::one(45..77),
            Pieces::one(77..n),
        ],
        // Two ranks, a piece of every one of three groups each.
        vec![
            Pieces::new([0..20, 40..48, 64..80]),
            Pieces::new([20..40, 48..64, 80..n]),
        ],
    ];
    for split in splits {
        let mut whole = AdamW::new(AdamWConfig::default(), &segs, 0..n);
        let mut sgd_whole = Sgd::new(SgdConfig::default(), &segs, 0..n);
        let (mut pw, mut ps) = (p0.clone(), p0.clone());
        let (mut qw, mut qs) = (p0.clone(), p0.clone());
        let mut shards: Vec<_> = split
            .iter()
            .map(|pieces| {
                (
                    AdamW::new(AdamWConfig::default(), &segs, pieces.clone()),
                    Sgd::new(SgdConfig::default(), &segs, pieces.clone()),
                )
            })
            .collect();
        for _ in 0..3 {
            whole.step(&mut pw, &g, 1e-2, None);
            sgd_whole.step(&mut qw, &g, 1e-2, None);
            for (a, s) in shards.iter_mut() {
                let pieces = a.pieces().clone();
                let grads = pieces.take(&g);
                let (mut lp, mut lq) = (pieces.take(&ps), pieces.take(&qs));
                a.step(&mut lp, &grads, 1e-2, None);
                s.step(&mut lq, &grads, 1e-2, None);
                pieces.put(&lp, &mut ps);
                pieces.put(&lq, &mut qs);
            }
        }
        let what = format!("{:?}", split.iter().map(Pieces::ranges).collect::<Vec<_>>());
        stoker_testkit::assert_bits_eq(&ps, &pw, &format!("AdamW shards {what}"));
        stoker_testkit::assert_bits_eq(&qs, &qw, &format!("SGD shards {what}"));
        assert_eq!(
            shards.iter().map(|(a, _)| a.state_bytes()).sum::<usize>(),
            whole.state_bytes()
        );
    }
}

#[test]
fn warmup_then_cosine() {
    let s = Schedule {
        lr: 1.0,
        min_lr: 0.1,
        warmup_steps: 4,
        decay_steps: 14,
    };
    assert_eq!(s.lr_at(0), 0.25);
    assert_eq!(s.lr_at(3), 1.0);
    assert_eq!(s.lr_at(4), 1.0);
    assert!((s.lr_at(9) - 0.55).abs() < 1e-12); // halfway down the cosine
    assert_eq!(s.lr_at(14), 0.1);
    assert_eq!(s.lr_at(1000), 0.1);
}

#[test]
fn clipping_scales_to_max_norm_and_leaves_small_gradients() {
    let mut g = vec![3.0f32, 4.0];
    let n = clip_global_norm(&mut g, 1.0);
    assert_eq!(n, 5.0);
    assert!((global_norm(&g) - 1.0).abs() < 1e-6);
    let mut small = vec![0.3f32, 0.4];
    clip_global_norm(&mut small, 1.0);
    assert_eq!(small, vec![0.3, 0.4]);
}

/// `step_each` is `step` (bit for bit, bf16 copy included) and tells every segment once,
/// in order, with its final values: what an offloaded model uploads while the optimizer
/// steps the rest.
#[test]
fn step_each_tells_every_segment_its_final_values() {
    let layout = FlatLayout::new(
        &[
            ParamSpec::new("a.weight", &[5, 7]),
            ParamSpec::new("a.bias", &[5]),
            ParamSpec::new("b.weight", &[3, 5]),
        ],
        16,
    )
    .unwrap();
    let segs = segments(&layout, false);
    let n = layout.total_len();
    let grads: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.01)
        .collect();
    let opts: Vec<(Box<dyn Optimizer>, Box<dyn Optimizer>)> = vec![
        (
            Box::new(AdamW::new(AdamWConfig::default(), &segs, 0..n)),
            Box::new(AdamW::new(AdamWConfig::default(), &segs, 0..n)),
        ),
        (
            Box::new(Sgd::new(SgdConfig::default(), &segs, 0..n)),
            Box::new(Sgd::new(SgdConfig::default(), &segs, 0..n)),
        ),
    ];
    for (mut plain, mut each) in opts {
        let (mut a, mut b) = (vec![0.5f32; n], vec![0.5f32; n]);
        let (mut ca, mut cb) = (vec![half::bf16::ZERO; n], vec![half::bf16::ZERO; n]);
        for _ in 0..3 {
            plain.step(&mut a, &grads, 1e-2, Some(&mut ca));
            let mut reported = Vec::new();
            each.step_each(&mut b, &grads, 1e-2, Some(&mut cb), &mut |r, v, c| {
                reported.push((r, v.to_vec(), c.map(|c| c.to_vec())));
            });
            assert_eq!(reported.len(), layout.slots().len());
            for ((r, v, c), s) in reported.iter().zip(layout.slots()) {
                assert_eq!(*r, s.offset..s.offset + s.len);
                let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(v), bits(&b[r.clone()]), "reported values are final");
                assert_eq!(c.as_deref(), Some(&cb[r.clone()]));
            }
        }
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b));
        assert_eq!(ca, cb);
    }
}
