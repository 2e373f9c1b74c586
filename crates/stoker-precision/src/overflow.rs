//! Overflow diagnostics: which parameters overflowed, how many steps were skipped, and the
//! "loss scale already at minimum" spiral, explained.
//!
//! DeepSpeed and torch only say that a step was skipped. Here a skipped step comes with a
//! [`OverflowReport`]: the names of the parameters whose gradients held inf/NaN (found through
//! a [`ParamTable`] of `(name, offset, len)` spans over the flat gradient buffer), the number of
//! skips so far and in a row, and — when the scale has been at its floor for
//! [`DiagnosticsConfig::collapse_patience`] overflowing steps in a row — a
//! [`CollapseWarning`] that says what to try. At the floor, lowering the scale cannot help: the
//! gradients are non-finite for a reason that is not fp16 range.

use std::fmt;

use crate::error::{PrecisionError, Result};
use crate::scaler::ShownScale;

/// One parameter's place in the flat gradient buffer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParamSpan {
    /// Parameter name (e.g. `"h.3.attn.c_proj.weight"`).
    pub name: String,
    /// Index of its first element in the flat buffer.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

/// The layout of a flat gradient buffer: parameter spans in buffer order.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParamTable {
    spans: Vec<ParamSpan>,
}

impl ParamTable {
    /// Builds a table from `(name, offset, len)` triples; they are sorted by offset.
    pub fn new<S: Into<String>>(spans: impl IntoIterator<Item = (S, usize, usize)>) -> Self {
        let mut spans: Vec<ParamSpan> = spans
            .into_iter()
            .map(|(name, offset, len)| ParamSpan {
                name: name.into(),
                offset,
                len,
            })
            .collect();
        spans.sort_by_key(|s| s.offset);
        Self { spans }
    }

    /// Lays parameters out back to back in the given order, from offset 0.
    pub fn contiguous<S: Into<String>>(params: impl IntoIterator<Item = (S, usize)>) -> Self {
        let mut offset = 0;
        Self::new(params.into_iter().map(|(n, len)| {
            let o = offset;
            offset += len;
            (n, o, len)
        }))
    }

    /// The spans, sorted by offset.
    pub fn spans(&self) -> &[ParamSpan] {
        &self.spans
    }

    /// Total elements covered (end of the last span).
    pub fn end(&self) -> usize {
        self.spans
            .iter()
            .map(|s| s.offset + s.len)
            .max()
            .unwrap_or(0)
    }

    /// Checks that every span lies inside a buffer of `len` elements.
    pub fn check_fits(&self, len: usize) -> Result<()> {
        match self
            .spans
            .iter()
            .find(|s| s.offset.checked_add(s.len).is_none_or(|e| e > len))
        {
            Some(s) => Err(PrecisionError::SpanOutOfBounds {
                name: s.name.clone(),
                offset: s.offset,
                end: s.offset.saturating_add(s.len),
                len,
            }),
            None => Ok(()),
        }
    }

    /// Names of the parameters whose span holds a non-finite value, in buffer order.
    pub fn nonfinite_names(&self, grads: &[f32]) -> Result<Vec<String>> {
        self.check_fits(grads.len())?;
        Ok(self
            .spans
            .iter()
            .filter(|s| !all_finite(&grads[s.offset..s.offset + s.len]))
            .map(|s| s.name.clone())
            .collect())
    }
}

/// Whether every value is finite (vectorizable: an OR over exponent-all-ones tests).
/// Buffers of at least [`PAR_FINITE`] elements are split over rayon's threads: the trainer
/// runs this over the whole flat master buffer every step.
pub fn all_finite(xs: &[f32]) -> bool {
    let serial = |xs: &[f32]| {
        xs.chunks(1024).all(|c| {
            let mut bad = false;
            for &x in c {
                bad |= x.to_bits() & 0x7F80_0000 == 0x7F80_0000;
            }
            !bad
        })
    };
    if xs.len() < PAR_FINITE {
        return serial(xs);
    }
    use rayon::prelude::*;
    xs.par_chunks(PAR_FINITE / 2).all(serial)
}

/// Length from which [`all_finite`] runs in parallel (128 Ki elements, 512 KiB).
pub const PAR_FINITE: usize = 1 << 17;

/// Settings of the overflow diagnostics.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DiagnosticsConfig {
    /// Overflowing steps in a row at the floor before a [`CollapseWarning`] (default 3).
    pub collapse_patience: u32,
    /// The scale counted as "at minimum". `None` means the scaler's `min_scale` when it has one,
    /// else 1.0 (torch has no floor: its scale keeps halving; below 1 the loss is shrunk, not
    /// magnified, so overflow there is not a range problem).
    pub collapse_floor: Option<f32>,
    /// At most this many parameter names are kept per report (default 64).
    pub max_names: usize,
}

impl Default for DiagnosticsConfig {
    fn default() -> Self {
        Self {
            collapse_patience: 3,
            collapse_floor: None,
            max_names: 64,
        }
    }
}

/// The scale sat at its floor while gradients kept overflowing.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CollapseWarning {
    /// Overflowing steps in a row with the scale at or below the floor.
    pub consecutive_at_floor: u32,
    /// The scale on those steps.
    pub scale: f32,
    /// The floor.
    pub floor: f32,
    /// Parameters non-finite on the latest of those steps.
    pub params: Vec<String>,
}

impl fmt::Display for CollapseWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // At the floor, the scale stays; below it (a scaler with no floor, torch's), it
        // keeps halving, and below 1 it shrinks the loss rather than protecting it.
        // The count is of the steps at or below the floor, not of the whole run of skips
        // (which the step's own report gives): said so, not "N in a row" beside another N.
        let (at, floor, n) = (
            ShownScale(self.scale),
            ShownScale(self.floor),
            self.consecutive_at_floor,
        );
        let state = match self.scale < self.floor {
            true => format!(
                "has been below {floor} for the last {n} overflowing steps ({at} on this one)"
            ),
            false => format!(
                "is already at its minimum ({at} <= floor {floor}), at or below it for the \
                 last {n} overflowing steps"
            ),
        };
        write!(
            f,
            "loss scale {state}: the gradients are inf/NaN for a reason other than fp16 \
             range, so every step is skipped and training has stalled"
        )?;
        if !self.params.is_empty() {
            let shown: Vec<&str> = self.params.iter().take(8).map(String::as_str).collect();
            write!(f, " (non-finite: {}", shown.join(", "))?;
            if self.params.len() > 8 {
                write!(f, " and {} more", self.params.len() - 8)?;
            }
            write!(f, ")")?;
        }
        write!(
            f,
            ". HINT: train in bf16 (f32's range, no loss scaling needed); lower the learning \
             rate or lengthen warm-up; clip gradients (e.g. max norm 1.0); check the data and \
             the loss for inf/NaN (log of 0, division by a zero count)."
        )
    }
}

/// What happened on a skipped step.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OverflowReport {
    /// Index of the step (counting every `update`, from 0).
    pub step: u64,
    /// Steps skipped so far, this one included.
    pub total_skips: u64,
    /// Steps skipped in a row, this one included.
    pub consecutive_skips: u32,
    /// Scale used on this step.
    pub scale_before: f32,
    /// Scale for the next step.
    pub scale_after: f32,
    /// Parameters whose gradients held inf/NaN (empty when no table was given or the overflow
    /// was reported by another rank); at most `max_names`.
    pub nonfinite_params: Vec<String>,
    /// Set when the scale is stuck at its floor (see [`CollapseWarning`]).
    pub collapse: Option<CollapseWarning>,
    /// This overflow would have lowered the scale, but it was already at the scaler's
    /// `min_scale`: DeepSpeed's condition for raising "Current loss scale already at
    /// minimum" (`raise_error_at_min_scale`). Never set for a static scale.
    #[serde(default)]
    pub at_min_scale: bool,
}

impl OverflowReport {
    /// What happened, without the step's index: for a caller that numbers its steps
    /// itself (a trainer counts from 1, this report from 0).
    pub fn summary(&self) -> String {
        let mut s = format!(
            "inf/NaN gradients (skip #{}, {} in a row); loss scale {} -> {}",
            self.total_skips,
            self.consecutive_skips,
            ShownScale(self.scale_before),
            ShownScale(self.scale_after)
        );
        if !self.nonfinite_params.is_empty() {
            s += &format!("; non-finite: {}", self.nonfinite_params.join(", "));
        }
        if let Some(c) = &self.collapse {
            s += &format!("\n{c}");
        }
        s
    }
}

impl fmt::Display for OverflowReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {} skipped: {}", self.step, self.summary())
    }
}

/// Counters behind the reports; part of the scaler's saved state.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OverflowCounters {
    /// Steps skipped so far.
    pub total_skips: u64,
    /// Steps skipped in a row.
    pub consecutive_skips: u32,
    /// Overflowing steps in a row with the scale at or below the floor.
    pub consecutive_at_floor: u32,
}

impl OverflowCounters {
    /// Records one step and builds the report of a skipped one.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn record(
        &mut self,
        cfg: &DiagnosticsConfig,
        floor: f32,
        step: u64,
        skipped: bool,
        scale_before: f32,
        scale_after: f32,
        mut names: Vec<String>,
    ) -> Option<OverflowReport> {
        if !skipped {
            self.consecutive_skips = 0;
            self.consecutive_at_floor = 0;
            return None;
        }
        self.total_skips += 1;
        self.consecutive_skips += 1;
        if scale_before <= floor {
            self.consecutive_at_floor += 1;
        } else {
            self.consecutive_at_floor = 0;
        }
        names.truncate(cfg.max_names);
        let collapse =
            (self.consecutive_at_floor >= cfg.collapse_patience.max(1)).then(|| CollapseWarning {
                consecutive_at_floor: self.consecutive_at_floor,
                scale: scale_before,
                floor,
                params: names.clone(),
            });
        Some(OverflowReport {
            step,
            total_skips: self.total_skips,
            consecutive_skips: self.consecutive_skips,
            scale_before,
            scale_after,
            nonfinite_params: names,
            collapse,
            at_min_scale: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_finite_finds_every_non_finite_serial_and_parallel() {
        for len in [0, 1000, 70_001, 3 * PAR_FINITE + 7] {
            let mut x = vec![1.5f32; len];
            assert!(all_finite(&x));
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for at in [0, len / 2, len.saturating_sub(1)] {
                    if at >= len {
                        continue;
                    }
                    let keep = x[at];
                    x[at] = bad;
                    assert!(!all_finite(&x), "{bad} at {at} of {len}");
                    x[at] = keep;
                }
            }
        }
    }

    #[test]
    fn names_nonfinite_spans() {
        let t = ParamTable::contiguous([("wte", 4), ("ln.w", 2), ("head", 3)]);
        let mut g = vec![0.5f32; 9];
        g[5] = f32::NAN;
        g[8] = f32::NEG_INFINITY;
        assert_eq!(t.nonfinite_names(&g).unwrap(), vec!["ln.w", "head"]);
        assert!(matches!(
            t.nonfinite_names(&g[..8]),
            Err(PrecisionError::SpanOutOfBounds { end: 9, len: 8, .. })
        ));
        assert!(all_finite(&[1.0, f32::MAX, -0.0]));
        assert!(!all_finite(&[1.0, f32::INFINITY]));
    }
}
