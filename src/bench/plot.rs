//! `--plot DIR`: the submit scenario as pictures (SVG), so the ratio to etcd shows at a glance:
//! throughput against concurrency, and the latency CDF at the highest concurrency.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context};
use plotters::prelude::*;

use super::submit::Point;

const RAW: RGBColor = RGBColor(90, 90, 90);
const BATON: RGBColor = RGBColor(20, 110, 200);

/// Draws the pictures into `dir`; returns their paths.
pub fn draw(points: &[Point], dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut out = Vec::new();
    if points.is_empty() {
        return Ok(out);
    }
    let throughput = dir.join("submit-throughput.svg");
    throughput_chart(points, &throughput)
        .map_err(|e| anyhow!("drawing {}: {e}", throughput.display()))?;
    out.push(throughput);
    let widest = points
        .iter()
        .max_by_key(|p| p.concurrency)
        .expect("not empty");
    let cdf = dir.join("submit-latency-cdf.svg");
    cdf_chart(widest, &cdf).map_err(|e| anyhow!("drawing {}: {e}", cdf.display()))?;
    out.push(cdf);
    Ok(out)
}

type Drawn = Result<(), Box<dyn std::error::Error>>;

/// One point per concurrency, evenly spaced (labelled with the concurrency).
fn throughput_chart(points: &[Point], path: &Path) -> Drawn {
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let last = points.len().saturating_sub(1) as f64;
    let max_y = points
        .iter()
        .map(|p| p.raw.ops_per_sec.max(p.baton.ops_per_sec))
        .fold(1.0, f64::max)
        * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Submissions per second: Baton vs raw etcd transactions of the same shape",
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.3f64..last + 0.3, 0f64..max_y)?;
    let label = |x: &f64| {
        let i = x.round();
        match points.get(i as usize) {
            Some(p) if (x - i).abs() < 1e-6 && i >= 0.0 => p.concurrency.to_string(),
            _ => String::new(),
        }
    };
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_labels(points.len().max(2))
        .x_label_formatter(&label)
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_desc("concurrent clients")
        .y_desc("per second")
        .draw()?;
    for (name, color, pick) in [
        (
            "raw etcd txn",
            RAW,
            (|p: &Point| p.raw.ops_per_sec) as fn(&Point) -> f64,
        ),
        ("baton SubmitJob", BATON, |p: &Point| p.baton.ops_per_sec),
    ] {
        let series: Vec<(f64, f64)> = points
            .iter()
            .enumerate()
            .map(|(i, p)| (i as f64, pick(p)))
            .collect();
        chart
            .draw_series(LineSeries::new(series.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(
            series
                .into_iter()
                .map(|p| Circle::new(p, 4, color.filled())),
        )?;
    }
    for (i, p) in points.iter().enumerate() {
        chart.draw_series(std::iter::once(Text::new(
            format!("{:.2}x", p.ratio),
            (i as f64 + 0.03, p.baton.ops_per_sec),
            ("sans-serif", 14).into_font().color(&BATON),
        )))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn cdf_chart(p: &Point, path: &Path) -> Drawn {
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let max_x = p.raw.p99_ms.max(p.baton.p99_ms).max(0.1) * 1.5;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Latency CDF at {} concurrent clients", p.concurrency),
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..max_x, 0f64..1f64)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .x_desc("latency (ms)")
        .y_desc("fraction of requests")
        .draw()?;
    for (name, color, cdf) in [
        ("raw etcd txn", RAW, &p.raw.cdf_ms),
        ("baton SubmitJob", BATON, &p.baton.cdf_ms),
    ] {
        let n = cdf.len().saturating_sub(1).max(1) as f64;
        let series: Vec<(f64, f64)> = cdf
            .iter()
            .enumerate()
            .map(|(i, ms)| (ms.min(max_x), i as f64 / n))
            .collect();
        chart
            .draw_series(LineSeries::new(series, color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
