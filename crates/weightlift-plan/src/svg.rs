//! The plan as a picture: one horizontal stacked bar per device.

use std::fmt::Write as _;

use crate::plan::{Plan, describe_holds};
use crate::size::fmt_bytes;

const SEGMENTS: &[(&str, &str)] = &[
    ("weights", "#4c78a8"),
    ("kv cache", "#f58518"),
    ("scratch", "#e45756"),
    ("overhead", "#9d755d"),
    ("reserve", "#bab0ac"),
    ("free", "#e8f1e4"),
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Render the chart. Every bar spans the full width and shows its own device's capacity (a
/// common scale makes small GPUs unreadable next to host RAM); the capacity and the used share
/// are written beside it. Unbounded devices (disk, a cpu of unknown size) are drawn at their
/// used size with a dashed outline.
pub(crate) fn render(plan: &Plan) -> String {
    let left = 150.0;
    let bar_w = 620.0;
    let bar_h = 34.0;
    let row_h = 78.0;
    let top = 80.0;
    let width = left + bar_w + 40.0;
    let n = plan.devices.len() as f64;
    let height = top + n * row_h + 70.0;
    let mut s = String::new();
    let _ = write!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">"##
    );
    let _ = write!(
        s,
        r##"<rect width="{width}" height="{height}" fill="white"/>"##
    );
    let ctx = match &plan.cache {
        Some(c) => format!(
            "ctx {} × {} · cache {}",
            c.max_seq_len,
            c.batch_size,
            c.dtype.name()
        ),
        None => "no kv cache".into(),
    };
    let _ = write!(
        s,
        r##"<text x="20" y="30" font-size="18" font-weight="bold">{}</text>"##,
        esc(&format!(
            "{} · {} layers · {}",
            plan.architecture, plan.n_layers, plan.strategy
        ))
    );
    let _ = write!(
        s,
        r##"<text x="20" y="50" font-size="13" fill="#555">{}</text>"##,
        esc(&ctx)
    );
    for (i, d) in plan.devices.iter().enumerate() {
        let y = top + i as f64 * row_h;
        let unbounded = d.capacity == u64::MAX;
        let total = if unbounded { d.used() } else { d.capacity };
        let w_total = bar_w;
        let _ = write!(
            s,
            r##"<text x="20" y="{}" font-size="15" font-weight="bold">{}</text>"##,
            y + 22.0,
            esc(&d.name)
        );
        let cap = if unbounded {
            "unbounded".to_string()
        } else {
            fmt_bytes(d.capacity)
        };
        let _ = write!(
            s,
            r##"<text x="20" y="{}" font-size="11" fill="#555">{}</text>"##,
            y + 38.0,
            esc(&cap)
        );
        let used = d.used().saturating_sub(d.reserve);
        let share = if unbounded || d.capacity == 0 {
            format!("{} used", fmt_bytes(used))
        } else {
            format!(
                "{} used ({:.0}%)",
                fmt_bytes(used),
                100.0 * used as f64 / d.capacity as f64
            )
        };
        let _ = write!(
            s,
            r##"<text x="{}" y="{}" font-size="11" fill="#555" text-anchor="end">{}</text>"##,
            left + bar_w,
            y - 4.0,
            esc(&share)
        );
        let values = [
            d.weights,
            d.kv,
            d.scratch,
            d.overhead,
            d.reserve,
            if unbounded { 0 } else { d.free },
        ];
        let mut x = left;
        for ((label, color), v) in SEGMENTS.iter().zip(values) {
            if v == 0 || total == 0 {
                continue;
            }
            let w = w_total * v as f64 / total as f64;
            let _ = write!(
                s,
                r##"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{bar_h}" fill="{color}" stroke="white" stroke-width="0.5"><title>{}: {}</title></rect>"##,
                label,
                fmt_bytes(v)
            );
            if w > 64.0 {
                let fill = if *label == "free" || *label == "reserve" {
                    "#333"
                } else {
                    "white"
                };
                let _ = write!(
                    s,
                    r##"<text x="{:.1}" y="{:.1}" font-size="11" fill="{fill}" text-anchor="middle">{}</text>"##,
                    x + w / 2.0,
                    y + bar_h / 2.0 + 4.0,
                    esc(&fmt_bytes(v))
                );
            }
            x += w;
        }
        let _ = write!(
            s,
            r##"<rect x="{left}" y="{y:.1}" width="{w_total:.1}" height="{bar_h}" fill="none" stroke="#333" stroke-width="1"{}/>"##,
            if unbounded {
                r#" stroke-dasharray="4 3""#
            } else {
                ""
            }
        );
        let _ = write!(
            s,
            r##"<text x="{left}" y="{:.1}" font-size="12" fill="#222">{}</text>"##,
            y + bar_h + 16.0,
            esc(&describe_holds(d))
        );
    }
    let h = &plan.host;
    let _ = write!(
        s,
        r##"<text x="20" y="{}" font-size="12" fill="#222">{}</text>"##,
        top + n * row_h + 4.0,
        esc(&format!(
            "host RAM at load peak: {} anonymous + {} mmap page cache",
            fmt_bytes(h.peak_anon),
            fmt_bytes(h.mapped_weights)
        ))
    );
    let ly = top + n * row_h + 20.0;
    let mut lx = 20.0;
    for (label, color) in SEGMENTS {
        let _ = write!(
            s,
            r##"<rect x="{lx}" y="{ly}" width="14" height="14" fill="{color}" stroke="#333" stroke-width="0.5"/><text x="{}" y="{}" font-size="12">{label}</text>"##,
            lx + 19.0,
            ly + 11.5
        );
        lx += 100.0;
    }
    s.push_str("</svg>\n");
    s
}
