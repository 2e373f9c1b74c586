//! The loss scaler with the DeepSpeed preset against a line-by-line transcription of DeepSpeed's
//! `DynamicLossScaler.update_scale`: same overflow sequence in, same scales, hysteresis and
//! skips out.

use stoker_precision::{LossScaler, ScalerConfig};

/// DeepSpeed's `DynamicLossScaler.update_scale` (deepspeed/runtime/fp16/loss_scaler.py),
/// transcribed line by line, with `raise_error_at_min_scale = False`.
struct DeepSpeedReference {
    cur_scale: f64,
    cur_iter: i64,
    last_overflow_iter: i64,
    scale_window: i64,
    min_scale: f64,
    delayed_shift: u32,
    cur_hysteresis: u32,
    consecutive_hysteresis: bool,
}

impl DeepSpeedReference {
    fn update_scale(&mut self, overflow: bool) {
        if overflow {
            if self.delayed_shift == 1 || self.cur_hysteresis == 1 {
                self.cur_scale = (self.cur_scale / 2.0).max(self.min_scale);
            } else {
                self.cur_hysteresis -= 1;
            }
            self.last_overflow_iter = self.cur_iter;
        } else {
            if self.consecutive_hysteresis {
                self.cur_hysteresis = self.delayed_shift;
            }
            let stable_interval = (self.cur_iter - self.last_overflow_iter) - 1;
            if stable_interval > 0 && stable_interval % self.scale_window == 0 {
                if !self.consecutive_hysteresis {
                    self.cur_hysteresis = self.delayed_shift;
                }
                self.cur_scale *= 2.0;
            }
        }
        self.cur_iter += 1;
    }
}

#[test]
fn matches_deepspeed_update_scale() {
    let mut rng = 0x1234_5678u64;
    let mut rand = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64
    };
    for window in [1u32, 2, 7, 50] {
        for hysteresis in [1u32, 2, 3] {
            for consecutive in [false, true] {
                let ScalerConfig::Dynamic(mut c) = ScalerConfig::deepspeed() else {
                    unreachable!()
                };
                c.growth_interval = window;
                c.hysteresis = hysteresis;
                c.consecutive_hysteresis = consecutive;
                let mut ours = LossScaler::new(ScalerConfig::Dynamic(c)).unwrap();
                let mut ds = DeepSpeedReference {
                    cur_scale: 65536.0,
                    cur_iter: 0,
                    last_overflow_iter: -1,
                    scale_window: window as i64,
                    min_scale: 1.0,
                    delayed_shift: hysteresis,
                    cur_hysteresis: hysteresis,
                    consecutive_hysteresis: consecutive,
                };
                let (mut growths, mut at_floor) = (0, 0);
                for step in 0..20_000 {
                    // Overflow when the scale is too large, at random, and in bursts that
                    // drive the scale to its floor.
                    let burst = (step / 1000) % 5 == 4 && step % 1000 < 40;
                    let overflow = ds.cur_scale > 2f64.powi(22) || rand() < 0.03 || burst;
                    let before = ours.scale();
                    let decision = ours.update(overflow);
                    ds.update_scale(overflow);
                    assert_eq!(decision.should_step(), !overflow);
                    assert_eq!(
                        ours.scale() as f64,
                        ds.cur_scale,
                        "w {window} h {hysteresis} c {consecutive} step {step}"
                    );
                    assert_eq!(ours.state().hysteresis_left, ds.cur_hysteresis);
                    growths += usize::from(ours.scale() > before);
                    at_floor += usize::from(ours.scale() == 1.0);
                }
                assert!(
                    growths > 20 && at_floor > 0,
                    "w {window} h {hysteresis}: {growths} growths, {at_floor} at floor"
                );
            }
        }
    }
}
