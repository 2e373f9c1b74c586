//! `stoker report RUN_DIR`: PNG plots of a run's `metrics.jsonl` (loss with eval loss,
//! throughput, loader wait, loss scale, learning rate), drawn with plotters.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::error::{Result, TrainError};
use crate::metrics::{read, Record};

/// The DejaVu font plotters draws text with (registered once per call; Debian's path).
const FONT_PATHS: [&str; 2] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

fn plot_err(path: &Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::Data {
        what: path.display().to_string(),
        message: format!("plotting: {e}"),
    }
}

fn register_font() -> Result<()> {
    for p in FONT_PATHS {
        if let Ok(bytes) = std::fs::read(p) {
            let leaked: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            return plotters::style::register_font("sans-serif", FontStyle::Normal, leaked)
                .map_err(|_| plot_err(Path::new(p), "unreadable font"));
        }
    }
    Err(plot_err(
        Path::new(FONT_PATHS[0]),
        "no TTF font found (install fonts-dejavu-core)",
    ))
}

/// One training record: (step, loss, lr, loss scale, throughput, loader wait %).
type Row = (f64, f64, f64, f64, f64, f64);

/// One line of a chart.
struct Series<'a> {
    label: &'a str,
    points: Vec<(f64, f64)>,
    color: RGBColor,
}

/// Draws `series` into `path`; false (and nothing written) where no point is finite.
fn chart(path: &Path, title: &str, y_label: &str, series: &[Series], log_y: bool) -> Result<bool> {
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts.filter(|p| p.1.is_finite() && (!log_y || p.1 > 0.0)) {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        return Ok(false); // nothing to draw
    }
    if x1 == x0 {
        x1 = x0 + 1.0;
    }
    if y1 == y0 {
        (y0, y1) = (y0 * 0.9 - 1e-9, y1 * 1.1 + 1e-9);
    }
    let root = BitMapBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let mut b = ChartBuilder::on(&root);
    b.caption(title, ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70);
    macro_rules! draw {
        ($c:expr) => {{
            let mut c = $c;
            c.configure_mesh()
                .x_desc("step")
                .y_desc(y_label)
                .draw()
                .map_err(|e| plot_err(path, e))?;
            for s in series {
                let color = s.color;
                c.draw_series(LineSeries::new(
                    s.points.iter().copied().filter(|p| p.1.is_finite()),
                    color.stroke_width(2),
                ))
                .map_err(|e| plot_err(path, e))?
                .label(s.label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
                // Sparse series (evaluations) also get markers, so a single point shows.
                if s.points.len() <= 50 {
                    let marks = s.points.iter().filter(|p| p.1.is_finite());
                    c.draw_series(marks.map(|&p| Circle::new(p, 4, color.filled())))
                        .map_err(|e| plot_err(path, e))?;
                }
            }
            if series.len() > 1 {
                c.configure_series_labels()
                    .background_style(WHITE.mix(0.8))
                    .border_style(BLACK)
                    .draw()
                    .map_err(|e| plot_err(path, e))?;
            }
        }};
    }
    if log_y {
        draw!(b
            .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
            .map_err(|e| plot_err(path, e))?);
    } else {
        draw!(b
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|e| plot_err(path, e))?);
    }
    root.present().map_err(|e| plot_err(path, e))?;
    Ok(true)
}

/// A run's metrics, collected for the plots.
struct Collected {
    /// One row per logged step.
    train: Vec<Row>,
    /// (step, eval loss).
    eval: Vec<(f64, f64)>,
    /// The throughput's unit.
    unit: String,
    /// (step, step seconds, RSS bytes) per logged step.
    measured: Vec<(f64, f64, f64)>,
    /// The planner's forecast, with the run's measured peaks: its training steps' and the
    /// whole run's (evaluation, checkpoints and sampling too), bytes.
    forecast: Option<(crate::planned::RunForecast, (u64, u64))>,
}

fn collect(records: &[Record]) -> Collected {
    let mut c = Collected {
        train: Vec::new(),
        eval: Vec::new(),
        unit: String::from("targets/s"),
        measured: Vec::new(),
        forecast: None,
    };
    for r in records {
        match r {
            Record::Train {
                step,
                loss,
                lr,
                loss_scale,
                throughput,
                unit: u,
                loader_wait_pct,
                step_s,
                rss_bytes,
                ..
            } => {
                c.measured.push((*step as f64, *step_s, *rss_bytes as f64));
                c.train.push((
                    *step as f64,
                    *loss,
                    *lr,
                    *loss_scale as f64,
                    *throughput,
                    *loader_wait_pct,
                ));
                c.unit = u.clone();
            }
            Record::Eval { step, loss, .. } => c.eval.push((*step as f64, *loss)),
            Record::States { .. } => {}
            Record::Forecast {
                forecast: f,
                train_rss_bytes,
                peak_rss_bytes,
                ..
            } => c.forecast = Some((f.clone(), (*train_rss_bytes, *peak_rss_bytes))),
        }
    }
    c
}

/// One series.
fn one(label: &'static str, points: Vec<(f64, f64)>, color: RGBColor) -> Vec<Series<'static>> {
    vec![Series {
        label,
        points,
        color,
    }]
}

/// Writes `loss.png`, `throughput.png`, `loader_wait.png`, `loss_scale.png` and `lr.png`
/// into `run_dir`, and the planned-vs-measured `memory.png` and `step_time.png` where the
/// run recorded its forecast; returns the files written.
pub fn write_report(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let records = read(run_dir)?;
    register_font()?;
    let c = collect(&records);
    let train = &c.train;
    let col = |f: fn(&Row) -> f64| train.iter().map(|t| (t.0, f(t))).collect::<Vec<_>>();
    let mut out = Vec::new();
    let mut emit =
        |name: &str, title: &str, y: &str, series: Vec<Series>, log_y: bool| -> Result<()> {
            let p = run_dir.join(name);
            if chart(&p, title, y, &series, log_y)? {
                out.push(p);
            } else if p.exists() {
                // An earlier report's plot of other records: gone, not left to mislead.
                std::fs::remove_file(&p).map_err(|e| crate::error::io_err(&p, e))?;
            }
            Ok(())
        };
    emit(
        "loss.png",
        "Loss",
        "cross-entropy",
        vec![
            Series {
                label: "train",
                points: col(|t| t.1),
                color: BLUE,
            },
            Series {
                label: "eval",
                points: c.eval.clone(),
                color: RED,
            },
        ],
        false,
    )?;
    emit(
        "throughput.png",
        "Throughput",
        &c.unit,
        one("train", col(|t| t.4), GREEN),
        false,
    )?;
    emit(
        "loader_wait.png",
        "Loader wait",
        "% of wall time",
        one("wait", col(|t| t.5), MAGENTA),
        false,
    )?;
    emit(
        "loss_scale.png",
        "Loss scale",
        "scale",
        one("scale", col(|t| t.3), BLACK),
        true,
    )?;
    // Planned vs measured: the forecast as a flat line over the measured curve (runs
    // written before these fields existed have no measured points).
    let measured = &c.measured;
    if let (Some((f, peaks)), false) = (&c.forecast, measured.iter().all(|m| m.1 == 0.0)) {
        let flat = |v: f64| measured.iter().map(|m| (m.0, v)).collect::<Vec<_>>();
        let mib = (1u64 << 20) as f64;
        emit(
            "memory.png",
            "Memory per rank: planned peak vs measured resident set",
            "MiB",
            vec![
                Series {
                    label: "measured RSS",
                    points: measured.iter().map(|m| (m.0, m.2 / mib)).collect(),
                    color: BLUE,
                },
                Series {
                    label: "planned peak",
                    points: flat(f.peak_bytes / mib),
                    color: RED,
                },
                Series {
                    label: "measured peak of training steps",
                    points: flat(peaks.0 as f64 / mib),
                    color: CYAN,
                },
                Series {
                    label: "measured peak of the whole run",
                    points: flat(peaks.1 as f64 / mib),
                    color: BLACK,
                },
            ],
            false,
        )?;
        emit(
            "step_time.png",
            "Step time: planned vs measured",
            "ms",
            vec![
                Series {
                    label: "measured",
                    points: measured.iter().map(|m| (m.0, m.1 * 1e3)).collect(),
                    color: GREEN,
                },
                Series {
                    label: "planned",
                    points: f.step_s.map_or(Vec::new(), |t| flat(t * 1e3)),
                    color: RED,
                },
            ],
            false,
        )?;
    } else {
        // No forecast to plot: nothing drawn, and an earlier report's are removed.
        for name in ["memory.png", "step_time.png"] {
            emit(name, "", "", Vec::new(), false)?;
        }
    }
    emit(
        "lr.png",
        "Learning rate",
        "lr",
        one("lr", col(|t| t.2), CYAN),
        false,
    )?;
    if out.is_empty() {
        // Nothing plotted (an earlier report's plots removed above): said, not an exit
        // status 0 with no file.
        return Err(TrainError::Data {
            what: run_dir.join("metrics.jsonl").display().to_string(),
            message: "holds no training or evaluation records to plot: the run stopped \
                      before its first log line (train.log_every steps)"
                .into(),
        });
    }
    Ok(out)
}
