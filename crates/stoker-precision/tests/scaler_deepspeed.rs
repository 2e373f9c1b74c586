//! The loss scaler with DeepSpeed's presets against line-by-line transcriptions of DeepSpeed's
//! two fp16 update rules (deepspeed/runtime/fp16/, as of 2025-02): `DynamicLossScaler.
//! update_scale` (loss_scaler.py, its ZeRO optimizers' scaler) and `FP16_Optimizer.
//! _update_scale` (fused_optimizer.py, fp16 without ZeRO). Same overflow sequence in, same
//! scales, hysteresis, skips and "already at minimum" steps out.

use stoker_precision::{LossScaler, ScalerConfig, StepDecision};

/// `DynamicLossScaler.update_scale`, transcribed line by line. Returns whether it would
/// raise "Current loss scale already at minimum" (`raise_error_at_min_scale`); the
/// transcription goes on as if it had not.
struct DynamicLossScalerReference {
    cur_scale: f64,
    cur_iter: i64,
    last_overflow_iter: i64,
    scale_window: i64,
    min_scale: f64,
    delayed_shift: u32,
    cur_hysteresis: u32,
    consecutive_hysteresis: bool,
}

impl DynamicLossScalerReference {
    fn update_scale(&mut self, overflow: bool) -> bool {
        let mut would_raise = false;
        if overflow {
            if self.delayed_shift == 1 || self.cur_hysteresis == 1 {
                if self.cur_scale == self.min_scale {
                    would_raise = true;
                } else {
                    self.cur_scale = (self.cur_scale / 2.0).max(self.min_scale);
                }
            } else {
                self.cur_hysteresis -= 1;
            }
            self.last_overflow_iter = self.cur_iter;
        } else {
            if self.consecutive_hysteresis {
                self.cur_hysteresis = self.delayed_shift;
            }
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0 {
                if !self.consecutive_hysteresis {
                    self.cur_hysteresis = self.delayed_shift;
                }
                self.cur_scale *= 2.0;
            }
        }
        self.cur_iter += 1;
        would_raise
    }
}

/// `FP16_Optimizer._update_scale` (dynamic), transcribed line by line: no hysteresis, and
/// it never raises at the floor.
struct Fp16OptimizerReference {
    cur_scale: f64,
    cur_iter: i64,
    last_overflow_iter: i64,
    scale_window: i64,
    min_loss_scale: f64,
}

impl Fp16OptimizerReference {
    fn update_scale(&mut self, skip: bool) {
        if skip {
            self.cur_scale = (self.cur_scale / 2.0).max(self.min_loss_scale);
            self.last_overflow_iter = self.cur_iter;
        } else {
            let stable_interval = (self.cur_iter - self.last_overflow_iter) - 1;
            if stable_interval > 0 && stable_interval % self.scale_window == 0 {
                self.cur_scale *= 2.0;
            }
        }
        self.cur_iter += 1;
    }
}

/// An xorshift stream of uniforms in [0, 1).
fn uniforms(mut state: u64) -> impl FnMut() -> f64 {
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Overflow when the scale is too large, at random, and in bursts that drive the scale to
/// its floor.
fn overflows(step: u32, scale: f64, rand: &mut impl FnMut() -> f64) -> bool {
    let burst = (step / 1000) % 5 == 4 && step % 1000 < 40;
    scale > 2f64.powi(22) || rand() < 0.03 || burst
}

fn at_min_scale(decision: &StepDecision) -> bool {
    matches!(decision, StepDecision::Skip(r) if r.at_min_scale)
}

#[test]
fn the_deepspeed_preset_matches_dynamic_loss_scaler() {
    let mut rand = uniforms(0x1234_5678);
    for window in [1u32, 2, 7, 50] {
        for hysteresis in [1u32, 2, 3] {
            for consecutive in [false, true] {
                // 2^-3: a negative `initial_scale_power`, below the floor of 1.
                for init_power in [16, -3] {
                    let ScalerConfig::Dynamic(mut c) = ScalerConfig::deepspeed() else {
                        unreachable!()
                    };
                    c.init_scale = 2f32.powi(init_power);
                    c.growth_interval = window;
                    c.hysteresis = hysteresis;
                    c.consecutive_hysteresis = consecutive;
                    let mut ours = LossScaler::new(ScalerConfig::Dynamic(c)).unwrap();
                    let mut ds = DynamicLossScalerReference {
                        cur_scale: 2f64.powi(init_power),
                        cur_iter: 0,
                        last_overflow_iter: -1,
                        scale_window: window as i64,
                        min_scale: 1.0,
                        delayed_shift: hysteresis,
                        cur_hysteresis: hysteresis,
                        consecutive_hysteresis: consecutive,
                    };
                    let what = format!("w {window} h {hysteresis} c {consecutive} 2^{init_power}");
                    let (mut growths, mut raises) = (0, 0);
                    for step in 0..20_000 {
                        let overflow = overflows(step, ds.cur_scale, &mut rand);
                        let before = ours.scale();
                        let decision = ours.update(overflow);
                        let would_raise = ds.update_scale(overflow);
                        assert_eq!(decision.should_step(), !overflow, "{what} step {step}");
                        assert_eq!(ours.scale() as f64, ds.cur_scale, "{what} step {step}");
                        assert_eq!(ours.state().hysteresis_left, ds.cur_hysteresis);
                        assert_eq!(at_min_scale(&decision), would_raise, "{what} step {step}");
                        growths += usize::from(ours.scale() > before);
                        raises += usize::from(would_raise);
                    }
                    assert!(
                        growths > 20 && raises > 0,
                        "{what}: {growths} growths, {raises} steps at the floor"
                    );
                }
            }
        }
    }
}

#[test]
fn the_fp16_optimizer_preset_matches_fp16_optimizer() {
    let mut rand = uniforms(0x9abc_def0);
    for window in [1u32, 2, 7, 50] {
        for init_power in [16, -3] {
            let ScalerConfig::Dynamic(mut c) = ScalerConfig::deepspeed_fp16_optimizer() else {
                unreachable!()
            };
            c.init_scale = 2f32.powi(init_power);
            c.growth_interval = window;
            let mut ours = LossScaler::new(ScalerConfig::Dynamic(c)).unwrap();
            let mut ds = Fp16OptimizerReference {
                cur_scale: 2f64.powi(init_power),
                cur_iter: 0,
                last_overflow_iter: -1,
                scale_window: window as i64,
                min_loss_scale: 1.0,
            };
            let what = format!("w {window} 2^{init_power}");
            let (mut growths, mut at_floor) = (0, 0);
            for step in 0..20_000 {
                let overflow = overflows(step, ds.cur_scale, &mut rand);
                let before = ours.scale();
                let decision = ours.update(overflow);
                ds.update_scale(overflow);
                assert_eq!(decision.should_step(), !overflow, "{what} step {step}");
                assert_eq!(ours.scale() as f64, ds.cur_scale, "{what} step {step}");
                growths += usize::from(ours.scale() > before);
                at_floor += usize::from(at_min_scale(&decision));
            }
            assert!(
                growths > 20 && at_floor > 0,
                "{what}: {growths} growths, {at_floor} overflows at the floor"
            );
        }
    }
}
