//! Pictures of a run's training: an SVG of loss, token accuracy and
//! simulated acceptance over the steps (written by `dflash up` at the end of
//! a run, from the ledger's history), and text sparklines of the same for
//! `dflash status`.

use std::path::Path;

use anyhow::Context;
use dflash_proto::ProgressPoint;
use plotters::prelude::*;

/// Size of the plot, in pixels.
pub const WIDTH: u32 = 960;
pub const HEIGHT: u32 = 720;

/// The figures a plot and a sparkline show, with their names.
fn series(points: &[ProgressPoint]) -> [(&'static str, Vec<(u64, f32)>); 3] {
    let of = |f: fn(&ProgressPoint) -> f32| points.iter().map(|p| (p.step, f(p))).collect::<Vec<_>>();
    [
        ("loss", of(|p| p.loss)),
        ("token accuracy", of(|p| p.accuracy)),
        ("simulated acceptance length", of(|p| p.acceptance_length)),
    ]
}

/// Writes the three panels, one above the other, as an SVG.
pub fn write_training_plot(path: &Path, title: &str, points: &[ProgressPoint]) -> anyhow::Result<()> {
    anyhow::ensure!(!points.is_empty(), "no training figures to plot yet");
    let root = SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22))?;
    let panels = root.split_evenly((3, 1));
    let last_step = points.iter().map(|p| p.step).max().unwrap_or(1).max(1);
    let first_step = points.iter().map(|p| p.step).min().unwrap_or(0).min(last_step - 1);
    for (panel, ((name, values), color)) in panels.iter().zip(series(points).into_iter().zip([RED, BLUE, GREEN])) {
        let (lo, hi) = values.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &(_, v)| {
            if v.is_finite() { (lo.min(v), hi.max(v)) } else { (lo, hi) }
        });
        let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
        let pad = ((hi - lo) * 0.05).max(1e-3);
        let mut chart = ChartBuilder::on(panel)
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .caption(name, ("sans-serif", 16))
            .build_cartesian_2d(first_step..last_step, (lo - pad)..(hi + pad))?;
        chart.configure_mesh().x_desc("step").light_line_style(WHITE.mix(0.0)).draw()?;
        chart.draw_series(LineSeries::new(values.into_iter().filter(|(_, v)| v.is_finite()), color.stroke_width(2)))?;
    }
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Block characters from low to high.
const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// `values` as a line of block characters scaled between their minimum and
/// maximum (non-finite values show as a space).
pub fn sparkline(values: &[f32]) -> String {
    let finite = values.iter().copied().filter(|v| v.is_finite());
    let (lo, hi) = finite.fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    values
        .iter()
        .map(|&v| {
            if !v.is_finite() {
                ' '
            } else if hi > lo {
                BARS[(((v - lo) / (hi - lo)) * (BARS.len() - 1) as f32).round() as usize]
            } else {
                BARS[BARS.len() / 2]
            }
        })
        .collect()
}

/// One sparkline row per figure: name, first and last value, the line.
pub fn sparklines(points: &[ProgressPoint]) -> Vec<String> {
    let Some((first, last)) = points.first().zip(points.last()) else { return Vec::new() };
    series(points)
        .iter()
        .map(|(name, values)| {
            let v: Vec<f32> = values.iter().map(|&(_, v)| v).collect();
            format!(
                "  {name:<28} {} {:.3} -> {:.3} (steps {}-{})",
                sparkline(&v),
                v[0],
                v[v.len() - 1],
                first.step,
                last.step
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(n: u64) -> Vec<ProgressPoint> {
        (1..=n)
            .map(|s| ProgressPoint {
                step: s,
                loss: 8.0 / (1.0 + s as f32 / 10.0),
                accuracy: s as f32 / n as f32,
                acceptance_length: 1.0 + s as f32 / n as f32,
            })
            .collect()
    }

    #[test]
    fn sparklines_scale_between_minimum_and_maximum() {
        assert_eq!(sparkline(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]), "▁▂▃▄▅▆▇█");
        assert_eq!(sparkline(&[2.0, 2.0]), "▅▅");
        assert_eq!(sparkline(&[1.0, f32::NAN, 3.0]), "▁ █");
        let rows = sparklines(&history(40));
        assert_eq!(rows.len(), 3);
        assert!(rows[0].contains("loss") && rows[0].contains("(steps 1-40)"), "{}", rows[0]);
        assert!(rows[1].contains("▁▁") && rows[1].contains("█ 0.025 -> 1.000 (steps 1-40)"), "{}", rows[1]);
    }

    #[test]
    fn the_plot_is_an_svg_of_the_stated_size_with_three_panels() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("training.svg");
        write_training_plot(&path, "run test", &history(200)).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
        assert!(svg.contains(&format!("width=\"{WIDTH}\"")) && svg.contains(&format!("height=\"{HEIGHT}\"")));
        for caption in ["loss", "token accuracy", "simulated acceptance length", "run test"] {
            assert!(svg.contains(caption), "no {caption:?} in the plot");
        }
        // The data lines are the thick ones (axes and ticks are 1 px).
        assert_eq!(svg.matches("stroke-width=\"2\" points=").count(), 3, "one line per panel");
        assert!(svg.trim_end().ends_with("</svg>"));
        let err = write_training_plot(&path, "empty", &[]).unwrap_err();
        assert!(err.to_string().contains("no training figures"), "{err}");
    }
}
