//! The MFU a machine profile plans a config's step at: the config's own step where the
//! profile measured it, else interpolated over the widths and micro-batch sizes it
//! measured.
//!
//! On this 2-core Zen 4 the direct step's MFU (planner FLOPs over the measured GEMM rate)
//! grows with the model's width most: bf16 0.34 at d_model 64, 0.52-0.54 at 128, 0.61 at
//! 192, 0.70 at 256, 0.77 at 384; and with the tokens per micro-batch (the M of its GEMMs)
//! next: the demo's 8-block GPT at 4 x 128 tokens ran at 0.48 where 8 x 128 ran at 0.54
//! (docs/plan.md, "Machine profile"). So both are axes, each linear in its logarithm
//! between the two nearest values measured (the nearest outside them), the width outer.

use std::collections::BTreeMap;

use super::{StepAt, StepPoint};

/// The MFU chosen for a step, and what it rests on (for the plan's lines).
#[derive(Clone, Debug, PartialEq)]
pub struct MfuPick {
    /// MFU as the run plans it: its rank's rate over the host's peak over the run's
    /// ranks per host, in (0, 1].
    pub mfu: f64,
    /// The measured steps it comes from, in words.
    pub basis: String,
}

/// |ln(a / b)|: how far apart two positive counts are, whatever their scale.
fn ln_ratio(a: usize, b: usize) -> f64 {
    ((a.max(1) as f64) / (b.max(1) as f64)).ln().abs()
}

/// The points of `v` whose `off` is least.
fn nearest_by<'a>(v: &[&'a StepPoint], off: impl Fn(&&'a StepPoint) -> f64) -> Vec<&'a StepPoint> {
    let min = v.iter().map(&off).fold(f64::INFINITY, f64::min);
    v.iter().filter(|p| off(p) <= min).copied().collect()
}

/// How far `p`'s shape is from `want`'s at the same width and tokens per micro-batch:
/// depth, context and vocabulary, each as a ratio.
fn shape_distance(p: &StepAt, want: &StepAt) -> f64 {
    ln_ratio(p.n_layer, want.n_layer)
        + ln_ratio(p.context, want.context)
        + ln_ratio(p.vocab, want.vocab)
}

/// The MFU of `want`'s step from `points` (see the module docs): Err says why none
/// applies (no step of its precision on its path).
pub fn pick_mfu(points: &[StepPoint], want: &StepAt) -> Result<MfuPick, String> {
    let on_path = |p: &&StepPoint| p.at.precision == want.precision && p.at.path == want.path;
    // The model's own family's steps; where the profile measured none on this path (a
    // profile from before Llamas were measured, or the graph path, which is probed with
    // GPTs alone), the other family's, said so in the basis.
    let family: Vec<&StepPoint> = points
        .iter()
        .filter(on_path)
        .filter(|p| p.at.model == want.model)
        .collect();
    let (same, borrowed) = match family.is_empty() {
        false => (family, String::new()),
        true => (
            points.iter().filter(on_path).collect(),
            format!(
                " (from another family's steps: none of a {} here)",
                want.model
            ),
        ),
    };
    if same.is_empty() {
        return Err(format!(
            "it measured no {} step on the {} path",
            want.precision, want.path
        ));
    }
    // The layout nearest the run's: first the ranks at once, then the threads per rank.
    let ranks_off = |p: &&StepPoint| ln_ratio(p.at.ranks_at_once, want.ranks_at_once);
    let threads_off = |p: &&StepPoint| ln_ratio(p.at.threads_per_rank, want.threads_per_rank);
    let layout = nearest_by(&nearest_by(&same, ranks_off), threads_off);
    let off = ranks_off(&layout[0]) + threads_off(&layout[0]);
    let layout_words = format!(
        "{} thread(s) x {} rank(s) at once{}",
        layout[0].at.threads_per_rank,
        layout[0].at.ranks_at_once,
        match off > 0.0 {
            true => format!(
                ", nearest to this run's {} x {}",
                want.threads_per_rank, want.ranks_at_once
            ),
            false => String::new(),
        }
    );
    // A point's MFU is at the host's peak over its own ranks per host; the run's rank
    // gets the host's peak over the run's.
    let scaled = |p: &StepPoint| p.mfu * want.ranks_per_host as f64 / p.at.ranks_per_host as f64;
    let done = |mfu: f64, what: String| MfuPick {
        mfu: mfu.clamp(1e-6, 1.0),
        basis: format!(
            "{} {} {} step{borrowed} {what}, {layout_words}",
            want.precision, want.path, want.model
        ),
    };
    if let Some(p) = layout.iter().find(|p| p.at.same_shape(want)) {
        return Ok(done(
            scaled(p),
            format!("of this shape measured ({:.3})", scaled(p)),
        ));
    }
    // At one width and token count, the point of the nearest shape.
    let nearest_shape = |g: &[&StepPoint]| -> (f64, String) {
        let p = nearest_by(g, |p| shape_distance(&p.at, want))[0];
        (scaled(p), String::new())
    };
    // At one width, along the tokens per micro-batch.
    let at_width = |g: &[&StepPoint]| -> (f64, String) {
        let (v, w) = along(
            g,
            tokens,
            tokens(want),
            "tokens per micro-batch",
            &nearest_shape,
        );
        (v, format!(" ({w})"))
    };
    let (mfu, words) = along(&layout, |a| a.d_model, want.d_model, "d_model", &at_width);
    match mfu.is_finite() {
        true => Ok(done(mfu, words)),
        false => Err(format!(
            "its {} steps give no MFU ({words})",
            want.precision
        )),
    }
}

/// Tokens per micro-batch of a step: the M of its GEMMs.
fn tokens(a: &StepAt) -> usize {
    a.micro_batch * a.context
}

/// The value at `want` along one axis of the points (`key`): linear in ln(key) between the
/// two nearest keys measured, the nearest key's outside them; `value` gives the value at
/// one key from its points (the axes below it) and its own words. Returns the value and
/// the words for it. `points` is not empty.
fn along<'a>(
    points: &[&'a StepPoint],
    key: fn(&StepAt) -> usize,
    want: usize,
    axis: &str,
    value: &dyn Fn(&[&'a StepPoint]) -> (f64, String),
) -> (f64, String) {
    let mut groups: BTreeMap<usize, Vec<&'a StepPoint>> = BTreeMap::new();
    for &p in points {
        groups.entry(key(&p.at)).or_default().push(p);
    }
    let below = groups.range(..=want).next_back();
    let above = groups.range(want..).next();
    match (below, above) {
        (Some((&lo, b)), Some((&hi, a))) if lo != hi => {
            let ((vb, wb), (va, _)) = (value(b), value(a));
            let f = (want as f64 / lo as f64).ln() / (hi as f64 / lo as f64).ln();
            let mfu = vb + f * (va - vb);
            (
                mfu,
                format!("interpolated between {axis} {lo} ({vb:.3}) and {hi} ({va:.3}){wb}"),
            )
        }
        (Some((&k, g)), _) | (None, Some((&k, g))) => {
            let (v, w) = value(g);
            let which = match k == want {
                true => "",
                false => ", the nearest measured",
            };
            (v, format!("at {axis} {k} ({v:.3}{which}){w}"))
        }
        (None, None) => (f64::NAN, format!("no {axis} measured")),
    }
}
