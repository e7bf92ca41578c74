//! Renders a [`Chart`] as a standalone 900×420 SVG grouped bar chart, by hand, without a plotting
//! crate. Each group (a case) gets an equal slice of the x axis and each variant a fixed slot and
//! colour inside every group, so a variant is always in the same place and the same colour. The
//! y axis is linear from zero or, for `log_scale`, spans whole decades; values that cannot be
//! drawn (not finite, or ≤ 0 on a log scale) are left out, marked "n/a" and counted in a footnote.

use super::{Chart, short_num};
use std::fmt::Write;

const W: f64 = 900.0;
const H: f64 = 420.0;
const LEFT: f64 = 72.0;
const RIGHT: f64 = W - 20.0;
const BOTTOM: f64 = H - 85.0;
/// Okabe–Ito palette: distinguishable with the common colour-vision deficiencies.
const COLOURS: [&str; 8] = [
    "#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000",
];

pub fn render(chart: &Chart) -> String {
    let mut out = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{W}' height='{H}' viewBox='0 0 {W} {H}' \
         font-family='sans-serif'>\n<rect width='{W}' height='{H}' fill='white'/>\n"
    );
    let bold = "text-anchor='middle' font-size='16' font-weight='bold'";
    text(&mut out, W / 2.0, 22.0, bold, &chart.title);

    let drawable = |v: f64| v.is_finite() && (!chart.log_scale || v > 0.0);
    let values = chart.groups.iter().flat_map(|g| g.bars.iter().map(|b| b.1));
    let (shown, hidden): (Vec<f64>, Vec<f64>) = values.partition(|&v| drawable(v));
    let mut variants: Vec<&str> = Vec::new();
    for (variant, _) in chart.groups.iter().flat_map(|g| &g.bars) {
        if !variants.contains(&variant.as_str()) {
            variants.push(variant);
        }
    }

    // Legend under the title, wrapping onto more rows if needed.
    let (mut x, mut y) = (LEFT, 40.0);
    for (i, variant) in variants.iter().enumerate() {
        let advance = 34.0 + 7.0 * variant.chars().count() as f64;
        if x + advance > RIGHT && x > LEFT {
            (x, y) = (LEFT, y + 18.0);
        }
        let colour = COLOURS[i % COLOURS.len()];
        let _ = writeln!(
            out,
            "<rect x='{x:.1}' y='{:.1}' width='12' height='12' fill='{colour}'/>",
            y - 10.0
        );
        text(&mut out, x + 16.0, y, "font-size='12'", variant);
        x += advance;
    }
    let top = y + 22.0;

    if !hidden.is_empty() {
        let why = if chart.log_scale {
            "zero, negative or non-finite values cannot be drawn on a log scale"
        } else {
            "non-finite values cannot be drawn"
        };
        let note = format!("{} value(s) left out (n/a): {why}", hidden.len());
        text(
            &mut out,
            LEFT,
            H - 8.0,
            "font-size='11' font-style='italic'",
            &note,
        );
    }
    if shown.is_empty() {
        let grey = "text-anchor='middle' font-size='14' fill='#666'";
        text(&mut out, W / 2.0, (top + BOTTOM) / 2.0, grey, "no data");
        return out + "</svg>\n";
    }

    // Y axis: grid lines, tick labels and the unit.
    let scale = Scale::new(&shown, chart.log_scale, top);
    for tick in scale.ticks() {
        let ty = scale.y(tick);
        let _ = writeln!(
            out,
            "<line x1='{LEFT}' y1='{ty:.1}' x2='{RIGHT}' y2='{ty:.1}' stroke='#ddd'/>"
        );
        let attrs = "text-anchor='end' font-size='11'";
        text(&mut out, LEFT - 6.0, ty + 4.0, attrs, &short_num(tick));
    }
    let mid = (top + BOTTOM) / 2.0;
    let attrs = format!("text-anchor='middle' font-size='12' transform='rotate(-90 16 {mid:.1})'");
    text(&mut out, 16.0, mid, &attrs, &chart.unit);

    // Bars with value labels, then group labels.
    let group_w = (RIGHT - LEFT) / chart.groups.len() as f64;
    let bar_w = group_w * 0.8 / variants.len() as f64;
    let base = scale.y(scale.baseline());
    for (g, group) in chart.groups.iter().enumerate() {
        let gx = LEFT + g as f64 * group_w;
        for (variant, value) in &group.bars {
            let slot = variants.iter().position(|v| v == variant).unwrap_or(0);
            let bx = gx + group_w * 0.1 + slot as f64 * bar_w;
            let cx = bx + bar_w / 2.0;
            if !drawable(*value) {
                let attrs = "text-anchor='middle' font-size='10' fill='#666'";
                text(&mut out, cx, base - 4.0, attrs, "n/a");
                continue;
            }
            let vy = scale.y(*value);
            let (bar_top, colour) = (vy.min(base), COLOURS[slot % COLOURS.len()]);
            let _ = writeln!(
                out,
                "<rect x='{bx:.1}' y='{bar_top:.1}' width='{:.1}' height='{:.1}' fill='{colour}'/>",
                (bar_w - 2.0).max(1.0),
                (vy - base).abs()
            );
            let label = short_num(*value);
            if bar_w >= 30.0 {
                let attrs = "text-anchor='middle' font-size='10'";
                text(&mut out, cx, bar_top - 4.0, attrs, &label);
            } else {
                let (lx, ly) = (cx + 3.0, bar_top - 4.0);
                let attrs = format!("font-size='10' transform='rotate(-90 {lx:.1} {ly:.1})'");
                text(&mut out, lx, ly, &attrs, &label);
            }
        }
        let cx = gx + group_w / 2.0;
        if 6.5 * group.label.chars().count() as f64 <= group_w {
            let attrs = "text-anchor='middle' font-size='11'";
            text(&mut out, cx, BOTTOM + 16.0, attrs, &group.label);
        } else {
            let ly = BOTTOM + 12.0;
            let attrs =
                format!("text-anchor='end' font-size='11' transform='rotate(-30 {cx:.1} {ly:.1})'");
            text(&mut out, cx, ly, &attrs, &group.label);
        }
    }
    let _ = writeln!(
        out,
        "<line x1='{LEFT}' y1='{top:.1}' x2='{LEFT}' y2='{BOTTOM}' stroke='black'/>\n\
         <line x1='{LEFT}' y1='{base:.1}' x2='{RIGHT}' y2='{base:.1}' stroke='black'/>"
    );
    out + "</svg>\n"
}

/// Maps values to pixel rows between `top` and `BOTTOM`. Linear axes run between multiples of a
/// 1/2/5 step and include zero; log axes run between powers of ten. `lo < hi` always holds.
struct Scale {
    lo: f64,
    hi: f64,
    step: f64,
    log: bool,
    top: f64,
}

impl Scale {
    /// `values` are finite, non-empty, and positive when `log`. Leaves headroom above the
    /// tallest bar for its value label.
    fn new(values: &[f64], log: bool, top: f64) -> Scale {
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let (lo, hi, step) = if log {
            // Start a little below the smallest value, so its bar has some height.
            let lo = (min.log10() - 0.1).floor();
            (lo, (max * 1.5).log10().ceil().max(lo + 1.0), 1.0)
        } else {
            let (lo, hi) = (min.min(0.0), (max * 1.15).max(0.0));
            let step = nice_step(if hi > lo { (hi - lo) / 6.0 } else { 1.0 });
            let lo = (lo / step).floor() * step;
            (lo, ((hi / step).ceil() * step).max(lo + step), step)
        };
        Scale {
            lo,
            hi,
            step,
            log,
            top,
        }
    }

    fn ticks(&self) -> Vec<f64> {
        let n = ((self.hi - self.lo) / self.step).round() as i32;
        let at = |i| self.lo + f64::from(i) * self.step;
        (0..=n)
            .map(|i| if self.log { 10f64.powf(at(i)) } else { at(i) })
            .collect()
    }

    /// Where bars start: zero, or the bottom of a log axis.
    fn baseline(&self) -> f64 {
        if self.log { 10f64.powf(self.lo) } else { 0.0 }
    }

    fn y(&self, v: f64) -> f64 {
        let v = if self.log { v.log10() } else { v };
        BOTTOM - (v - self.lo) / (self.hi - self.lo) * (BOTTOM - self.top)
    }
}

/// The smallest 1, 2 or 5 × 10^k that is at least `x` (`x` > 0).
fn nice_step(x: f64) -> f64 {
    let pow = 10f64.powf(x.log10().floor());
    let nice = [1.0, 2.0, 5.0].into_iter().find(|&n| x / pow <= n);
    nice.unwrap_or(10.0) * pow
}

/// A `<text>` element at (x, y) with the given (single-quoted) attributes.
fn text(out: &mut String, x: f64, y: f64, attrs: &str, s: &str) {
    let _ = writeln!(
        out,
        "<text x='{x:.1}' y='{y:.1}' {attrs}>{}</text>",
        escape(s)
    );
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&apos;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::ChartGroup;

    fn chart(log_scale: bool, groups: &[(&str, &[(&str, f64)])]) -> Chart {
        let groups = groups.iter().map(|(label, bars)| ChartGroup {
            label: label.to_string(),
            bars: bars.iter().map(|(v, x)| (v.to_string(), *x)).collect(),
        });
        Chart {
            title: "t <&> \"q\"".to_string(),
            unit: "ns/op".to_string(),
            log_scale,
            groups: groups.collect(),
        }
    }

    /// Tags nest and close properly, every `&` starts an entity, and no NaN or inf leaked out.
    fn assert_well_formed(svg: &str) {
        assert!(svg.starts_with("<svg xmlns='http://www.w3.org/2000/svg'"));
        assert!(svg.ends_with("</svg>\n"));
        let mut stack = Vec::new();
        for tag in svg.split('<').skip(1) {
            let tag = &tag[..tag.find('>').expect("unclosed tag")];
            let name = tag.trim_start_matches('/').split_whitespace().next();
            if tag.starts_with('/') {
                assert_eq!(stack.pop(), Some(name), "mismatched </{name:?}>");
            } else if !tag.ends_with('/') {
                stack.push(name);
            }
        }
        assert!(stack.is_empty(), "unclosed: {stack:?}");
        for (i, _) in svg.match_indices('&') {
            let entities = ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"];
            assert!(
                entities.iter().any(|e| svg[i..].starts_with(e)),
                "raw & at {i}"
            );
        }
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
    }

    #[test]
    fn renders_escaped_labels_and_legend() {
        let bars: &[(&str, f64)] = &[("binary search", 120.0), ("cursor <&>", 8.5)];
        let svg = render(&chart(false, &[("1 vCPU <&>", bars), ("16 vCPUs", bars)]));
        assert_well_formed(&svg);
        for label in [
            "1 vCPU &lt;&amp;&gt;",
            "cursor &lt;&amp;&gt;",
            "t &lt;&amp;&gt; &quot;q&quot;",
            "ns/op",
        ] {
            assert!(svg.contains(label), "missing {label}");
        }
        assert!(!svg.contains("<&>"));
        // Same variant, same colour in both groups: one legend swatch and two bars.
        assert_eq!(svg.matches(COLOURS[1]).count(), 3);
        assert!(svg.contains(">120<") && svg.contains(">8.5<"));
    }

    #[test]
    fn log_scale_leaves_out_zero_and_negative() {
        let svg = render(&chart(
            true,
            &[
                ("a", &[("x", 0.0), ("y", 1e6)]),
                ("b", &[("x", -3.0), ("y", f64::NAN)]),
            ],
        ));
        assert_well_formed(&svg);
        assert!(svg.contains("3 value(s) left out"));
        assert_eq!(svg.matches(">n/a<").count(), 3);
        assert_eq!(
            svg.matches("<rect").count(),
            2 + 1 + 1,
            "background, 2 swatches, 1 bar"
        );
    }

    #[test]
    fn empty_and_degenerate_inputs() {
        assert!(render(&chart(false, &[])).contains("no data"));
        for (log, bars) in [
            (true, &[("x", 0.0)][..]),
            (false, &[("x", 0.0), ("y", 0.0)]),
            (false, &[("x", -5.0), ("y", 5.0)]),
            (true, &[("x", 1e-9), ("y", 1e12)]),
        ] {
            assert_well_formed(&render(&chart(log, &[("a", bars)])));
        }
    }

    #[test]
    fn ticks_are_round_numbers() {
        let s = Scale::new(&[0.0, 80.0], false, 60.0);
        assert_eq!(s.ticks(), [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        let s = Scale::new(&[3.0, 4000.0], true, 60.0);
        assert_eq!(s.ticks(), [1.0, 10.0, 100.0, 1000.0, 10000.0]);
        assert_eq!((nice_step(0.03), nice_step(7.0)), (0.05, 10.0));
    }
}
