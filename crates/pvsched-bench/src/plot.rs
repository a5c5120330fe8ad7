//! PNG plots for `pvsched-bench --plot`, with plotters' bitmap backend and
//! the built-in [`super::font`]: latency CDFs (left: CDF, linear y; right:
//! the tail as the fraction of samples ≥ x, log y; both log x) and, for
//! S3, bars of BPF ns/event per program against the target.

use super::font;
use plotters::prelude::*;
use std::path::Path;

/// Errors drawing a plot.
#[derive(Debug, thiserror::Error)]
#[error("drawing the plot {path} failed: {msg} (check that the directory exists and is writable)")]
pub struct PlotError {
    path: String,
    msg: String,
}

/// One curve: its name, CDF points (µs, fraction ≤ x) and sample count.
#[derive(Clone, Debug)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Sorted by x.
    pub points: Vec<(f64, f64)>,
    /// Samples behind the points.
    pub n: f64,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(200, 30, 30),
    RGBColor(20, 80, 200),
    RGBColor(20, 150, 60),
    RGBColor(170, 60, 170),
    RGBColor(230, 130, 0),
    RGBColor(0, 150, 170),
];
const GRID: RGBColor = RGBColor(215, 215, 215);

fn floor_decade(x: f64) -> f64 {
    10f64.powf(x.log10().floor())
}

fn ceil_decade(x: f64) -> f64 {
    10f64.powf(x.log10().ceil())
}

fn decades(lo: f64, hi: f64) -> Vec<f64> {
    let mut v = Vec::new();
    let mut d = floor_decade(lo);
    while d <= hi * 1.0001 {
        if d >= lo * 0.9999 {
            v.push(d);
        }
        d *= 10.0;
    }
    v
}

fn label(x: f64) -> String {
    if x >= 1.0 {
        format!("{x:.0}")
    } else {
        format!("{x}")
    }
}

/// Draws `series` as CDF + tail panels into `path` (PNG, 1000×440).
pub fn cdf_png(path: &Path, title: &str, xlabel: &str, series: &[Series]) -> Result<(), PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError {
        path: path.display().to_string(),
        msg: e.to_string(),
    };
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut lo, mut hi) = (f64::MAX, f64::MIN);
    for &(x, _) in pts {
        lo = lo.min(x);
        hi = hi.max(x);
    }
    if lo > hi {
        (lo, hi) = (1.0, 10.0);
    }
    let lo = floor_decade(lo.max(0.1));
    let hi = ceil_decade(hi.max(lo * 10.0));
    let nmax = series.iter().map(|s| s.n).fold(1.0, f64::max);
    let ylo = floor_decade((1.0 / nmax).max(1e-6));

    let root = BitMapBackend::new(path, (1000, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    font::draw(&root, 10, 8, title, 2, &BLACK);
    let (left, right) = root.split_horizontally(500);
    for (panel, tail) in [(&left, false), (&right, true)] {
        let mut b = ChartBuilder::on(panel);
        b.margin_top(36)
            .margin_bottom(44)
            .margin_left(70)
            .margin_right(16);
        let ylab = if tail { "FRACTION >= X" } else { "CDF" };
        // Linear y for the CDF, log y for the tail: two chart types.
        if tail {
            let mut ch = b
                .build_cartesian_2d((lo..hi).log_scale(), (ylo..1.0).log_scale())
                .map_err(|e| err(&e))?;
            draw_grid(&mut ch, lo, hi, &decades(ylo, 1.0)).map_err(|e| err(&e))?;
            for (i, s) in series.iter().enumerate() {
                let pts: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .map(|&(x, f)| (x.max(lo), (1.0 - f + 1.0 / s.n.max(1.0)).clamp(ylo, 1.0)))
                    .collect();
                ch.draw_series(LineSeries::new(
                    pts,
                    COLORS[i % COLORS.len()].stroke_width(2),
                ))
                .map_err(|e| err(&e))?;
            }
            axis_labels(&root, &ch, lo, hi, &decades(ylo, 1.0), true);
        } else {
            let mut ch = b
                .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)
                .map_err(|e| err(&e))?;
            draw_grid(&mut ch, lo, hi, &[0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0])
                .map_err(|e| err(&e))?;
            for (i, s) in series.iter().enumerate() {
                let pts: Vec<(f64, f64)> = s.points.iter().map(|&(x, f)| (x.max(lo), f)).collect();
                ch.draw_series(LineSeries::new(
                    pts,
                    COLORS[i % COLORS.len()].stroke_width(2),
                ))
                .map_err(|e| err(&e))?;
            }
            axis_labels(&root, &ch, lo, hi, &[0.0, 0.25, 0.5, 0.75, 0.9, 1.0], false);
            // Legend, lower right of the CDF panel (where CDFs are near 0).
            let longest = series
                .iter()
                .map(|s| font::width(&s.name, 2))
                .max()
                .unwrap_or(0);
            let (rx, _) = ch.backend_coord(&(hi, 0.0));
            let (_, ly) = ch.backend_coord(&(lo, 0.45));
            let lx = rx - longest - 44;
            for (i, s) in series.iter().enumerate() {
                let y = ly + 8 + i as i32 * 20;
                let c = COLORS[i % COLORS.len()];
                let _ = root.draw(&Rectangle::new(
                    [(lx + 8, y + 2), (lx + 24, y + 4)],
                    c.filled(),
                ));
                font::draw(&root, lx + 34, y, &s.name, 2, &c);
            }
        }
        let (pw, ph) = panel.dim_in_pixel();
        let (ox, _) = panel.get_base_pixel();
        font::draw(
            &root,
            ox + pw as i32 / 2 - font::width(xlabel, 1) / 2,
            ph as i32 - 14,
            xlabel,
            1,
            &BLACK,
        );
        font::draw(&root, ox + 6, 26, ylab, 1, &BLACK);
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Light grid lines at the x decades and at `ys`.
fn draw_grid<DB: DrawingBackend, X, Y>(
    ch: &mut ChartContext<'_, DB, Cartesian2d<X, Y>>,
    lo: f64,
    hi: f64,
    ys: &[f64],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let (ylo, yhi) = (
        ys.iter().copied().fold(f64::MAX, f64::min),
        ys.iter().copied().fold(f64::MIN, f64::max),
    );
    for d in decades(lo, hi) {
        ch.draw_series(LineSeries::new([(d, ylo), (d, yhi)], GRID))?;
    }
    for &y in ys {
        ch.draw_series(LineSeries::new([(lo, y), (hi, y)], GRID))?;
    }
    ch.draw_series(LineSeries::new([(lo, ylo), (hi, ylo)], BLACK))?;
    ch.draw_series(LineSeries::new([(lo, ylo), (lo, yhi)], BLACK))?;
    Ok(())
}

/// Tick labels: x decades under the axis, `ys` left of it.
fn axis_labels<DB: DrawingBackend, X, Y>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    ch: &ChartContext<'_, DB, Cartesian2d<X, Y>>,
    lo: f64,
    hi: f64,
    ys: &[f64],
    log_y: bool,
) where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let ybase = ys.iter().copied().fold(f64::MAX, f64::min);
    for d in decades(lo, hi) {
        let (x, y) = ch.backend_coord(&(d, ybase));
        let t = label(d);
        font::draw(root, x - font::width(&t, 1) / 2, y + 6, &t, 1, &BLACK);
    }
    for &v in ys {
        let (x, y) = ch.backend_coord(&(lo, v));
        let t = if log_y && v < 1.0 {
            format!("1E{}", v.log10().round() as i32)
        } else {
            format!("{v}")
        };
        font::draw(
            root,
            x - font::width(&t, 1) - 6,
            y - font::height(1) / 2,
            &t,
            1,
            &BLACK,
        );
    }
}

/// Bars (name, value) with an optional target line, into `path` (PNG).
pub fn bars_png(
    path: &Path,
    title: &str,
    unit: &str,
    bars: &[(String, f64)],
    target: Option<f64>,
) -> Result<(), PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError {
        path: path.display().to_string(),
        msg: e.to_string(),
    };
    let top = bars.iter().map(|b| b.1).chain(target).fold(1.0, f64::max) * 1.15;
    let root = BitMapBackend::new(path, (1000, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    font::draw(&root, 10, 8, title, 2, &BLACK);
    let n = bars.len().max(1) as f64;
    let mut ch = ChartBuilder::on(&root)
        .margin_top(40)
        .margin_bottom(90)
        .margin_left(70)
        .margin_right(20)
        .build_cartesian_2d(0.0..n, 0.0..top)
        .map_err(|e| err(&e))?;
    let step = nice_step(top);
    let mut ys = Vec::new();
    let mut y = 0.0;
    while y <= top {
        ys.push(y);
        y += step;
    }
    for &y in &ys {
        ch.draw_series(LineSeries::new([(0.0, y), (n, y)], GRID))
            .map_err(|e| err(&e))?;
        let (x, py) = ch.backend_coord(&(0.0, y));
        let t = format!("{y}");
        font::draw(&root, x - font::width(&t, 1) - 6, py - 3, &t, 1, &BLACK);
    }
    for (i, (name, v)) in bars.iter().enumerate() {
        let c = COLORS[1];
        let x0 = i as f64 + 0.15;
        let x1 = i as f64 + 0.85;
        ch.draw_series(std::iter::once(Rectangle::new(
            [(x0, 0.0), (x1, *v)],
            c.filled(),
        )))
        .map_err(|e| err(&e))?;
        let (px, py) = ch.backend_coord(&(i as f64 + 0.5, 0.0));
        let short: String = name.chars().take(16).collect();
        font::draw(
            &root,
            px - font::width(&short, 1) / 2,
            py + 8,
            &short,
            1,
            &BLACK,
        );
        let t = format!("{v:.0}");
        let (_, vy) = ch.backend_coord(&(0.0, *v));
        font::draw(&root, px - font::width(&t, 1) / 2, vy - 12, &t, 1, &BLACK);
    }
    if let Some(t) = target {
        ch.draw_series(LineSeries::new(
            [(0.0, t), (n, t)],
            COLORS[0].stroke_width(2),
        ))
        .map_err(|e| err(&e))?;
        let (x, y) = ch.backend_coord(&(0.0, t));
        font::draw(&root, x + 6, y - 12, &format!("TARGET {t}"), 1, &COLORS[0]);
    }
    font::draw(&root, 10, 30, unit, 1, &BLACK);
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// A round grid step giving about 5 lines up to `top`.
fn nice_step(top: f64) -> f64 {
    let raw = top / 5.0;
    let d = floor_decade(raw.max(1e-9));
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * d)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_and_bar_pngs_are_written() {
        let dir = std::env::temp_dir().join(format!("pvsched-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = |name: &str, k: f64| Series {
            name: name.into(),
            points: (1..=100)
                .map(|i| (i as f64 * k, i as f64 / 100.0))
                .collect(),
            n: 100.0,
        };
        let p = dir.join("cdf.png");
        cdf_png(
            &p,
            "S1 WAKEUP",
            "LATENCY US",
            &[s("vanilla", 10.0), s("pvsched", 1.0)],
        )
        .unwrap();
        let png = std::fs::read(&p).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        let b = dir.join("bars.png");
        bars_png(
            &b,
            "S3",
            "NS/EVENT",
            &[("switch".into(), 800.0)],
            Some(300.0),
        )
        .unwrap();
        assert_eq!(&std::fs::read(&b).unwrap()[1..4], b"PNG");
        assert_eq!(nice_step(1000.0), 200.0);
        assert_eq!(decades(0.1, 100.0), vec![0.1, 1.0, 10.0, 100.0]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
