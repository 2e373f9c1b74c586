//! The loss scaler against recorded torch.amp.GradScaler traces
//! (scripts/ref/gradscaler_trace.py): same gradients in, same scale sequence, scaled losses
//! and skip decisions out, step for step, down to a scale of 2^-126 (below it torch's
//! scale goes on to 0 and stoker's stays; the decisions still agree).

use std::io::Read;

use serde_json::Value;
use stoker_precision::{DynamicConfig, LossScaler, ScalerConfig};

fn load() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/gradscaler_trace.json.gz"
    );
    let file = std::fs::File::open(path).unwrap_or_else(|e| {
        panic!("{path}: {e}; regenerate with python3 scripts/ref/gradscaler_trace.py")
    });
    let mut s = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut s)
        .unwrap();
    serde_json::from_str(&s).unwrap()
}

fn bits(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn reproduces_torch_gradscaler_trace() {
    let doc = load();
    let runs = doc["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 5);
    let mut total_steps = 0;
    let mut growths = 0;
    for run in runs {
        let name = run["name"].as_str().unwrap();
        let cfg = DynamicConfig {
            init_scale: run["init_scale"].as_f64().unwrap() as f32,
            growth_factor: run["growth_factor"].as_f64().unwrap(),
            backoff_factor: run["backoff_factor"].as_f64().unwrap(),
            growth_interval: run["growth_interval"].as_u64().unwrap() as u32,
            hysteresis: 1,
            consecutive_hysteresis: false,
            min_scale: 0.0,
            deepspeed_window: false,
        };
        let mut scaler = LossScaler::new(ScalerConfig::Dynamic(cfg)).unwrap();
        let grads = run["grads"].as_str().unwrap().as_bytes();
        let stepped = run["stepped"].as_str().unwrap().as_bytes();
        let scale_after = bits(&run["scale_after_bits"]);
        let scaled_loss = bits(&run["scaled_loss_bits"]);
        assert_eq!(grads.len(), scale_after.len());
        // Once torch's scale has fallen below f32's least normal (2^-126), where stoker's
        // stays (a scale of 0 leaves candle's backward nothing to differentiate), the
        // scales part; the step/skip decisions go on agreeing.
        let mut parted = false;
        for (i, &g) in grads.iter().enumerate() {
            let before = scaler.scale();
            if !parted {
                assert_eq!(
                    scaler.scale_loss(1.5).to_bits(),
                    scaled_loss[i],
                    "{name} step {i}: scaled loss"
                );
            }
            let mut grad = [match g {
                b'F' => 3.0f32,
                b'I' => f32::INFINITY,
                _ => f32::NAN,
            }];
            let found_inf = scaler.unscale_and_check(&mut grad, None).unwrap();
            let decision = scaler.update(found_inf);
            assert_eq!(
                decision.should_step(),
                stepped[i] == b'1',
                "{name} step {i} ({}): step/skip differs from torch",
                g as char
            );
            parted |= f32::from_bits(scale_after[i]) < f32::MIN_POSITIVE;
            if parted {
                assert!(
                    scaler.scale() >= f32::MIN_POSITIVE,
                    "{name} step {i}: scale {} below f32's least normal",
                    scaler.scale()
                );
                continue;
            }
            assert_eq!(
                scaler.scale().to_bits(),
                scale_after[i],
                "{name} step {i}: scale {} -> {} but torch has {}",
                before,
                scaler.scale(),
                f32::from_bits(scale_after[i])
            );
            growths += usize::from(scaler.scale() > before);
        }
        total_steps += grads.len();
        if parted {
            assert_eq!(
                name, "collapse_to_zero",
                "only the collapse goes below 2^-126"
            );
            continue;
        }
        assert_eq!(
            scaler.state().scale.to_bits(),
            run["final_scale_bits"].as_u64().unwrap() as u32
        );
        assert_eq!(
            scaler.state().growth_tracker as u64,
            run["final_growth_tracker"].as_u64().unwrap(),
            "{name}: growth tracker"
        );
    }
    assert!(total_steps > 30_000, "{total_steps}");
    assert!(growths > 50, "only {growths} growth events");
}

#[test]
fn torch_trace_covers_the_edge_cases() {
    let doc = load();
    let run = |n: &str| {
        doc["runs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == n)
            .unwrap()
            .clone()
    };
    // growth_to_inf: the scale stops at 2^127 (2^128 would be inf).
    let g = bits(&run("growth_to_inf")["scale_after_bits"]);
    assert!(g.contains(&f32::powi(2.0, 127).to_bits()));
    assert!(g.iter().all(|&b| f32::from_bits(b).is_finite()));
    // collapse_to_zero: torch has no floor; 170 overflows take 2^16 to 0.
    let c = bits(&run("collapse_to_zero")["scale_after_bits"]);
    assert_eq!(f32::from_bits(c[169]), 0.0);
    // default: long finite runs grow the scale above 2^16.
    let d = bits(&run("default")["scale_after_bits"]);
    assert!(d.iter().any(|&b| f32::from_bits(b) > 65536.0));
}
