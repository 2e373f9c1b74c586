//! A window's tallies, summed over the ranks in the update's one scalar collective: the
//! valid targets that normalize the gradients, the loss, and the micro-batches (which
//! every rank must run as many of, since the gradients were scaled before anyone knew).

use crate::error::GpuError;

/// What one rank's window tallied (or, summed, every rank's).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Tally {
    /// Valid targets.
    pub valid: f64,
    /// The summed loss of the valid targets.
    pub loss: f64,
    /// Micro-batches.
    pub micro: f64,
    /// Micro-batches squared: with `micro`, whether every rank ran as many.
    pub micro_sq: f64,
}

impl Tally {
    /// A window's tally before its micro-batches run: `n` of them, nothing counted yet.
    pub fn of_micro_batches(n: usize) -> Self {
        Tally {
            micro: n as f64,
            micro_sq: (n * n) as f64,
            ..Tally::default()
        }
    }

    /// The values a collective sums, in order.
    pub fn values(&self) -> [f64; 4] {
        [self.valid, self.loss, self.micro, self.micro_sq]
    }

    /// A tally from [`Tally::values`]' order.
    pub fn from_values(v: &[f64]) -> Self {
        Tally {
            valid: v[0],
            loss: v[1],
            micro: v[2],
            micro_sq: v[3],
        }
    }

    /// This summed tally's rescale of gradients that each micro-batch scaled by
    /// 1 / `capacity`: `capacity / valid`, after checking (the same way on every rank, so
    /// every rank refuses together) that every one of `world` ranks ran as many
    /// micro-batches (`world x sum of squares = square of the sum`) and that some target
    /// was valid.
    pub fn rescale(&self, world: usize, capacity: f64) -> Result<f32, GpuError> {
        let err = |what: String| GpuError::Shape {
            kernel: "window",
            what,
        };
        self.same_micro_batches(world)?;
        if self.valid < 1.0 {
            return Err(err(format!(
                "a window with no valid target on any of {world} ranks ({} micro-batches); \
                 every target is the ignore index",
                self.micro
            )));
        }
        Ok((capacity / self.valid) as f32)
    }

    /// Whether every one of `world` ranks ran as many micro-batches (`world x sum of
    /// squares = square of the sum`), checked alike on every rank from the summed tally.
    pub fn same_micro_batches(&self, world: usize) -> Result<(), GpuError> {
        if world as f64 * self.micro_sq != self.micro * self.micro {
            return Err(GpuError::Shape {
                kernel: "window",
                what: format!(
                    "the {world} ranks ran different numbers of micro-batches in one window \
                     ({} in all); each must run as many",
                    self.micro
                ),
            });
        }
        Ok(())
    }
}
