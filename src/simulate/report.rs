//! The simulator's outputs: a text table and a hand-written SVG chart (no
//! plotting dependency; the chart is a few polylines on a log axis).

use std::fmt::Write;

use super::engine::{Report, DELAYED};

/// Seconds, readable at every scale: `850 ms`, `2.41 s`, `95.3 s`, `14.2 min`.
pub fn fmt_secs(s: f64) -> String {
    if !s.is_finite() {
        "-".to_string()
    } else if s < 1.0 {
        format!("{:.0} ms", s * 1000.0)
    } else if s < 10.0 {
        format!("{s:.2} s")
    } else if s < 600.0 {
        format!("{s:.1} s")
    } else {
        format!("{:.1} min", s / 60.0)
    }
}

/// The comparison table, one row per strategy.
pub fn table(r: &Report) -> String {
    let mut out = String::new();
    let m = &r.mix;
    let _ = writeln!(
        out,
        "{} envelopes; {} shards x {} workers, cap {}, quantum {} s; small tenants: {}, whales: {}",
        r.envelopes,
        m.shards,
        m.workers,
        m.cap,
        m.quantum_seconds,
        m.tenants,
        m.whales
            .iter()
            .map(|w| format!("{} ({})", w.tenant, w.count))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        out,
        "{:<12} {:>10} {:>10} {:>10} {:>10} {:>12} {:>6} {:>8}  lanes",
        "strategy",
        "small p50",
        "small p95",
        "small p99",
        format!("small >{}s", DELAYED.as_secs()),
        "whale drain",
        "skew",
        "wall",
    );
    for s in &r.results {
        let lanes = if s.promoted.is_empty() {
            "-".to_string()
        } else {
            s.promoted
                .iter()
                .map(|(t, at)| {
                    // a whale's lane: also how long after its import began
                    match m.whales.iter().find(|w| w.tenant == *t) {
                        Some(w) => {
                            let start = std::time::Duration::from(w.start).as_secs_f64();
                            format!("{t} at {} (+{})", fmt_secs(*at), fmt_secs(*at - start))
                        }
                        None => format!("{t} at {}", fmt_secs(*at)),
                    }
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        // no small tenants: no waits to show; an idle median shard: no skew ratio
        let wait = |v: f64| {
            if s.small.count == 0 {
                "-".to_string()
            } else {
                fmt_secs(v)
            }
        };
        let delayed = if s.small.count == 0 {
            "-".to_string()
        } else {
            format!("{:.1}%", s.small.delayed_share * 100.0)
        };
        let skew = if s.skew.is_finite() {
            format!("{:.2}", s.skew)
        } else {
            "-".to_string()
        };
        let _ = writeln!(
            out,
            "{:<12} {:>10} {:>10} {:>10} {:>10} {:>12} {:>6} {:>8}  {}",
            s.strategy.name(),
            wait(s.small.p50),
            wait(s.small.p95),
            wait(s.small.p99),
            delayed,
            s.max_whale_drain().map_or("-".to_string(), fmt_secs),
            skew,
            fmt_secs(s.wall.as_secs_f64()),
            lanes
        );
    }
    out
}

const COLORS: [&str; 4] = ["#d62728", "#ff7f0e", "#1f77b4", "#2ca02c"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A decade of seconds as an axis label: `1 ms` ... `100 s`, `1000 s`.
fn decade_label(decade: i32) -> String {
    if decade < 0 {
        format!("{} ms", 10i64.pow((decade + 3) as u32))
    } else {
        format!("{} s", 10i64.pow(decade as u32))
    }
}

/// Where a legend entry's text starts, right of the plot.
const LEGEND_TEXT_X: f64 = 41.0;
/// A safe average glyph width of 12 px sans-serif text with digits and
/// parentheses (Helvetica and DejaVu Sans average about 6.7 px).
const GLYPH_WIDTH: f64 = 7.5;

/// The chart: small-tenant p99 wait (log scale) against arrival time, one
/// polyline per strategy.
pub fn svg(r: &Report) -> String {
    let legend: Vec<String> = r
        .results
        .iter()
        .map(|s| format!("{} (p99 {})", s.strategy.name(), fmt_secs(s.small.p99)))
        .collect();
    // The legend sits right of the plot: as wide as its longest entry (line
    // and gap, then the text at a generous average glyph width), so that no
    // entry is cut off at the image's edge.
    let longest = legend.iter().map(|l| l.chars().count()).max().unwrap_or(0);
    let (left, top, bottom) = (70.0, 40.0, 50.0);
    let right = LEGEND_TEXT_X + longest as f64 * GLYPH_WIDTH + 12.0;
    let (pw, h) = (650.0, 440.0);
    let (w, ph) = (left + pw + right, h - top - bottom);
    // y: log10 of seconds, from 1 ms up to the decade above the largest value
    let max = r
        .results
        .iter()
        .flat_map(|s| s.series.iter().flatten())
        .fold(0.001f64, |a, b| a.max(*b));
    let (lo, hi) = (-3.0f64, max.log10().ceil().max(-2.0));
    let y = |secs: f64| top + ph * (1.0 - (secs.max(0.001).log10() - lo) / (hi - lo));
    let duration = r.bucket_s * r.results.first().map_or(1, |s| s.series.len()) as f64;
    let x = |secs: f64| left + pw * secs / duration.max(0.001);

    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{left}" y="22" font-size="15">Small-tenant wait (p99 of each {:.1} s of arrivals), {} shards x {} workers</text>"#,
        r.bucket_s, r.mix.shards, r.mix.workers
    );
    // axes and grid
    let mut decade = lo as i32;
    while decade as f64 <= hi {
        let secs = 10f64.powi(decade);
        let yy = y(secs);
        let label = decade_label(decade);
        let _ = writeln!(
            o,
            r##"<line x1="{left}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{label}</text>"##,
            left + pw,
            left - 6.0,
            yy + 4.0
        );
        decade += 1;
    }
    for k in 0..=6 {
        let secs = duration * k as f64 / 6.0;
        let xx = x(secs);
        let _ = writeln!(
            o,
            r##"<line x1="{xx:.1}" y1="{top}" x2="{xx:.1}" y2="{:.1}" stroke="#eee"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{:.0} s</text>"##,
            top + ph,
            top + ph + 18.0,
            secs
        );
    }
    let _ = writeln!(
        o,
        r##"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">arrival time (virtual)</text>"#,
        left + pw / 2.0,
        h - 10.0
    );
    // one polyline per strategy, and its legend entry
    for (k, s) in r.results.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        // lanes often coincide with fair: dashed, so both stay visible
        let dash = if k % 2 == 1 {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let points: Vec<String> = s
            .series
            .iter()
            .enumerate()
            .filter_map(|(b, v)| {
                v.map(|v| format!("{:.1},{:.1}", x((b as f64 + 0.5) * r.bucket_s), y(v)))
            })
            .collect();
        let _ = writeln!(
            o,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"><title>{}</title></polyline>"#,
            points.join(" "),
            esc(s.strategy.name())
        );
        let ly = top + 20.0 * k as f64 + 10.0;
        let lx = left + pw + 15.0;
        let _ = writeln!(
            o,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="3"{dash}/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 20.0,
            left + pw + LEGEND_TEXT_X,
            ly + 4.0,
            esc(&legend[k])
        );
    }
    o.push_str("</svg>\n");
    o
}
