//! stoker-testkit: the checkers every stoker test compares with.
//!
//! "N ranks give what 1 rank gives" and "fused equals composed" are only as good as the
//! comparison that says so. These helpers fail on NaN and infinity instead of folding
//! them away (`f32::max` returns the other operand when one is NaN, so a fold with it
//! passes an all-NaN gradient), name the first element that differs, and make a test that
//! cannot run on this machine say so where the person running the suite sees it.
#![deny(missing_docs)]

use std::io::Write;

/// Values a checker can compare: f32 and f64, widened to f64.
pub trait Value: Copy + std::fmt::Debug {
    /// The value in f64.
    fn f64(self) -> f64;
    /// The raw bits, for bit-exact comparison.
    fn bits(self) -> u64;
}

impl Value for f32 {
    fn f64(self) -> f64 {
        self as f64
    }
    fn bits(self) -> u64 {
        self.to_bits() as u64
    }
}

impl Value for f64 {
    fn f64(self) -> f64 {
        self
    }
    fn bits(self) -> u64 {
        self.to_bits()
    }
}

pub mod module_cycles;

pub use module_cycles::module_cycles;

/// The largest `|x|`, or NaN if any element is NaN or infinite (a checker must never
/// mistake a broken buffer for a small one).
pub fn max_abs<T: Value>(x: &[T]) -> f64 {
    let mut m = 0f64;
    for &v in x {
        let v = v.f64();
        if !v.is_finite() {
            return f64::NAN;
        }
        m = nan_max(m, v.abs());
    }
    m
}

/// The larger of `m` and `x`, NaN if either is NaN (`f64::max` would drop a NaN and let a
/// broken value pass as small).
pub fn nan_max(m: f64, x: f64) -> f64 {
    if m.is_nan() || x.is_nan() {
        f64::NAN
    } else if x > m {
        x
    } else {
        m
    }
}

/// The largest `|a - b|`, or NaN if any element of either side is NaN or infinite, or
/// the lengths differ.
pub fn max_abs_diff<T: Value>(a: &[T], b: &[T]) -> f64 {
    if a.len() != b.len() {
        return f64::NAN;
    }
    let mut m = 0f64;
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x.f64(), y.f64());
        if !x.is_finite() || !y.is_finite() {
            return f64::NAN;
        }
        m = nan_max(m, (x - y).abs());
    }
    m
}

/// The first index where `a` and `b` are not finite-and-within `tol`, if any.
fn first_bad<T: Value>(a: &[T], b: &[T], tol: f64) -> Option<usize> {
    a.iter().zip(b).position(|(&x, &y)| {
        let (x, y) = (x.f64(), y.f64());
        !x.is_finite() || !y.is_finite() || (x - y).abs() > tol
    })
}

/// Asserts `max |got - want| <= rel x max |want|` (and `<= rel` where `want` is all
/// zero), every element finite on both sides; the panic names `what`, the first
/// offending index and both values.
pub fn assert_close<T: Value>(got: &[T], want: &[T], rel: f64, what: &str) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: {} values vs {} expected",
        got.len(),
        want.len()
    );
    let scale = max_abs(want);
    assert!(
        scale.is_finite(),
        "{what}: the expected values hold NaN or infinity"
    );
    let tol = rel * scale.max(f64::MIN_POSITIVE);
    let tol = if scale == 0.0 { rel } else { tol };
    if let Some(i) = first_bad(got, want, tol) {
        panic!(
            "{what}: element {i}: got {:?}, expected {:?} (tolerance {tol:e} = {rel:e} x max |expected| {scale:e}; max |diff| {:e})",
            got[i],
            want[i],
            max_abs_diff(got, want)
        );
    }
}

/// Asserts the two buffers are identical bit for bit; the panic names `what`, the first
/// differing index, both values and how many differ.
pub fn assert_bits_eq<T: Value>(got: &[T], want: &[T], what: &str) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: {} values vs {} expected",
        got.len(),
        want.len()
    );
    let diffs = got
        .iter()
        .zip(want)
        .filter(|(a, b)| a.bits() != b.bits())
        .count();
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a.bits() != b.bits()) {
        panic!(
            "{what}: {diffs} of {} values differ in their bits; first at {i}: got {:?}, expected {:?} (max |diff| {:e})",
            got.len(),
            got[i],
            want[i],
            max_abs_diff(got, want)
        );
    }
}

/// `||a - b|| / ||b||` over the whole buffers, accumulated in f64; NaN if any element
/// of either is NaN or infinite, or the lengths differ.
pub fn rel_l2<T: Value>(a: &[T], b: &[T]) -> f64 {
    if a.len() != b.len() || !max_abs(a).is_finite() || !max_abs(b).is_finite() {
        return f64::NAN;
    }
    let d: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x.f64() - y.f64()).powi(2))
        .sum();
    let n: f64 = b.iter().map(|y| y.f64().powi(2)).sum();
    (d / n).sqrt()
}

/// How far (relative L2, [`rel_l2`]) data-parallel weights may be from one rank's after a
/// few steps in `precision` when the reduction order differs (docs/distributed.md
/// derives it): the reduction reorders only f32 sums in every precision, 1e-5; in bf16
/// and fp16 a master weight moved by that rounding can also flip the rounding of its
/// low-precision compute copy by one ulp of the format (2^-8, 2^-11).
pub fn data_parallel_tolerance(precision: &str) -> f64 {
    match precision {
        "bf16" => 1e-4,
        "fp16" => 5e-5,
        _ => 1e-5,
    }
}

/// Asserts a scalar is finite and within `rel` (relative to `|want|`, absolute when
/// `want` is 0).
pub fn assert_close_scalar(got: f64, want: f64, rel: f64, what: &str) {
    assert!(
        got.is_finite() && want.is_finite(),
        "{what}: got {got}, expected {want} (not finite)"
    );
    let tol = if want == 0.0 { rel } else { rel * want.abs() };
    assert!(
        (got - want).abs() <= tol,
        "{what}: got {got}, expected {want} (|diff| {:e} > {tol:e})",
        (got - want).abs()
    );
}

/// Writes a C-order `.npy` file (format 1.0) of `shape` with dtype `descr` (`<f4`, `|u1`,
/// `<i8`, ...) and the raw little-endian `data`: fixtures for the loaders and trainers.
pub fn write_npy(path: &std::path::Path, descr: &str, shape: &[usize], data: &[u8]) {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_s = match dims.as_slice() {
        [one] => format!("({one},)"),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_s}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(data);
    std::fs::write(path, out).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// Says loudly that `test` did not run its check here and why: straight to the terminal
/// (libtest captures `eprintln!` of passing tests, not writes to the stderr handle) and,
/// when `STOKER_SKIP_LOG` names a file, appended there for the suite's summary.
pub fn skip(test: &str, reason: &str) {
    let line = format!("SKIPPED {test}: {reason}");
    let _ = writeln!(std::io::stderr(), "\n*** {line} ***");
    if let Some(path) = std::env::var_os("STOKER_SKIP_LOG") {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_and_infinity_never_pass() {
        let want = [1.0f32, 2.0, 3.0];
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let got = [1.0f32, bad, 3.0];
            assert!(max_abs_diff(&got, &want).is_nan());
            assert!(max_abs(&got).is_nan());
            let r = std::panic::catch_unwind(|| assert_close(&got, &want, 1.0, "t"));
            assert!(r.is_err(), "{bad} passed assert_close");
            let r = std::panic::catch_unwind(|| assert_close(&want, &got, 1.0, "t"));
            assert!(r.is_err(), "{bad} as expected value passed assert_close");
        }
        let all_nan = [f32::NAN; 3];
        assert!(std::panic::catch_unwind(|| assert_close(&all_nan, &all_nan, 1.0, "t")).is_err());
        assert!(std::panic::catch_unwind(|| assert_close_scalar(f64::NAN, 1.0, 1.0, "t")).is_err());
    }

    #[test]
    fn nan_max_keeps_a_nan_wherever_it_comes() {
        assert!(nan_max(0.0, f64::NAN).is_nan());
        assert!(nan_max(f64::NAN, 5.0).is_nan());
        let worst = [0.1, f64::NAN, 0.2].into_iter().fold(0.0, nan_max);
        assert!(worst.is_nan(), "a NaN in the middle was dropped");
        assert_eq!([0.1, 0.3, 0.2].into_iter().fold(0.0, nan_max), 0.3);
    }

    #[test]
    fn tolerance_and_bits() {
        assert_close(&[1.0f32, 2.0001], &[1.0, 2.0], 1e-4, "t");
        assert!(
            std::panic::catch_unwind(|| assert_close(&[1.0f32, 2.01], &[1.0, 2.0], 1e-4, "t"))
                .is_err()
        );
        assert_close(&[0.0f64], &[0.0], 0.0, "zeros");
        assert_bits_eq(&[1.0f32, -0.0], &[1.0, -0.0], "t");
        assert!(std::panic::catch_unwind(|| assert_bits_eq(&[0.0f32], &[-0.0], "t")).is_err());
        assert!(
            std::panic::catch_unwind(|| assert_close(&[1.0f32], &[1.0, 2.0], 1.0, "t")).is_err()
        );
    }
}
