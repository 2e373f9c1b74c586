//! Formatting of bytes, seconds and rates for the report's sentences and tables.

use crate::hardware::{GB, GIB};
use crate::setup::Accounting;

/// Formats bytes in the accounting's unit (GB for stoker, GiB for DeepSpeed's).
pub fn fmt_bytes(bytes: f64, accounting: Accounting) -> String {
    match accounting {
        Accounting::Stoker => format!("{:.1} GB", bytes / GB),
        _ => format!("{:.2} GiB", bytes / GIB),
    }
}

/// Formats a rate with three significant digits (0.0123, 1.23, 123.4).
pub fn fmt_rate(x: f64) -> String {
    if x >= 100.0 || x == 0.0 {
        format!("{x:.1}")
    } else {
        let digits = (2 - x.abs().log10().floor() as i32).clamp(0, 6) as usize;
        format!("{x:.digits$}")
    }
}

/// Formats seconds with a unit that keeps three significant digits.
pub fn fmt_s(s: f64) -> String {
    if s == 0.0 {
        "0 s".into()
    } else if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{:.1} us", s * 1e6)
    }
}

/// 124439808 -> "124,439,808".
pub fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
