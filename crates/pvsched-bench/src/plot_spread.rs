//! PNG of the spread over repetitions for `pvsched-bench s4|s6 --plot`:
//! one panel per cell (an S6 workload, an S4 kernel and interval), its
//! variants side by side, each repetition's figure a point and the
//! median a bar across the variant's column, so that a ratio of medians
//! can be read with the spread behind it.

use super::font;
use super::s4::Spread;
use plotters::prelude::*;
use std::path::Path;

impl Panel {
    /// The panel of `variants` (in that order) over `rows`: each row whose
    /// variant is `variant(row)` gives its `figure`, when it has one.
    pub fn of<R>(
        title: String,
        variants: impl Iterator<Item = String>,
        rows: &[&R],
        variant: impl Fn(&R) -> &str,
        figure: impl Fn(&R) -> Option<f64>,
    ) -> Panel {
        Panel {
            title,
            groups: variants
                .map(|v| {
                    let reps = rows
                        .iter()
                        .filter(|r| variant(r) == v)
                        .filter_map(|r| figure(r))
                        .collect();
                    (v, reps)
                })
                .collect(),
        }
    }
}

/// Errors drawing the plot.
#[derive(Debug, thiserror::Error)]
#[error("drawing the plot {path} failed: {msg} (check that the directory exists and is writable)")]
pub struct SpreadPlotError {
    path: String,
    msg: String,
}

/// One panel: a title and, per variant, each repetition's figure.
#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    /// Drawn above the panel.
    pub title: String,
    /// (variant, figures of its repetitions) in the order drawn.
    pub groups: Vec<(String, Vec<f64>)>,
}

const POINT: RGBColor = RGBColor(20, 80, 200);
const MEDIAN: RGBColor = RGBColor(200, 30, 30);
const GRID: RGBColor = RGBColor(215, 215, 215);
/// Pixels per panel.
const PANEL_W: u32 = 1000;
const PANEL_H: u32 = 260;

/// Draws `panels` one under the other into `path` (PNG).
pub fn png(path: &Path, title: &str, panels: &[Panel]) -> Result<(), SpreadPlotError> {
    let err = |e: &dyn std::fmt::Display| SpreadPlotError {
        path: path.display().to_string(),
        msg: e.to_string(),
    };
    let h = 30 + PANEL_H * panels.len().max(1) as u32;
    let root = BitMapBackend::new(path, (PANEL_W, h)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    font::draw(&root, 10, 8, title, 2, &BLACK);
    let body = root.margin(30, 0, 0, 0);
    let areas = body.split_evenly((panels.len().max(1), 1));
    for (area, p) in areas.iter().zip(panels) {
        font::draw(area, 10, 4, &p.title, 1, &BLACK);
        let all: Vec<f64> = p.groups.iter().flat_map(|g| g.1.iter().copied()).collect();
        let top = all.iter().copied().fold(0.0, f64::max).max(1e-9) * 1.15;
        let n = p.groups.len().max(1) as f64;
        let mut ch = ChartBuilder::on(area)
            .margin_top(20)
            .margin_bottom(30)
            .margin_left(80)
            .margin_right(20)
            .build_cartesian_2d(0.0..n, 0.0..top)
            .map_err(|e| err(&e))?;
        for i in 0..=4 {
            let y = top * f64::from(i) / 4.0;
            ch.draw_series(LineSeries::new([(0.0, y), (n, y)], GRID))
                .map_err(|e| err(&e))?;
            let (x, py) = ch.backend_coord(&(0.0, y));
            let t = format!("{y:.3}");
            let t = t.trim_end_matches('0').trim_end_matches('.').to_owned();
            // backend_coord is in the whole image's pixels: drawn on root.
            font::draw(&root, x - font::width(&t, 1) - 6, py - 3, &t, 1, &BLACK);
        }
        for (i, (name, reps)) in p.groups.iter().enumerate() {
            let k = reps.len().max(1) as f64;
            // The repetitions spread across the column, in order.
            ch.draw_series(reps.iter().enumerate().map(|(j, v)| {
                let x = i as f64 + 0.2 + 0.6 * (j as f64 + 0.5) / k;
                Circle::new((x, *v), 3, POINT.filled())
            }))
            .map_err(|e| err(&e))?;
            if let Some(m) = Spread::of(reps.iter().copied()).median {
                ch.draw_series(LineSeries::new(
                    [(i as f64 + 0.1, m), (i as f64 + 0.9, m)],
                    MEDIAN.stroke_width(2),
                ))
                .map_err(|e| err(&e))?;
            }
            let (px, py) = ch.backend_coord(&(i as f64 + 0.5, 0.0));
            let label = format!("{name} N{}", reps.len());
            font::draw(
                &root,
                px - font::width(&label, 1) / 2,
                py + 8,
                &label,
                1,
                &BLACK,
            );
        }
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_are_drawn() {
        let p = std::env::temp_dir().join(format!("pvsched-spread-{}.png", std::process::id()));
        let panel = Panel {
            title: "1x2 cpu per CPU-s".into(),
            groups: vec![
                ("vanilla".into(), vec![1.0, 1.2, 0.9]),
                ("pvsched".into(), vec![1.1]),
                ("none".into(), vec![]),
            ],
        };
        png(&p, "S6", &[panel.clone(), panel]).unwrap();
        assert_eq!(&std::fs::read(&p).unwrap()[1..4], b"PNG");
        std::fs::remove_file(&p).unwrap();
    }
}
