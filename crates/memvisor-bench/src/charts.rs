//! Grouped bar charts for the report: the [`Chart`] model the experiments fill in, and [`render`],
//! which draws one as a standalone 900×500 SVG with `plotters` (SVG backend only: text is emitted
//! as `<text>` elements, laid out by the viewer, so no font files are read).
//!
//! A chart reads top to bottom: the title; one line saying which way is better (and that the y
//! axis is logarithmic, when it is); the legend, one swatch per variant; the plot, one group of
//! bars per case along the x axis with the x axis title naming what the cases are, and the y
//! axis title giving the quantity and its unit; last, a footnote counting values that could not
//! be drawn. Each variant keeps one slot and one colour in every group. The y axis is linear from
//! zero or, for `log_scale`, plotters' log coordinate over whole decades; `YAxis` chooses only
//! the range, plotters the ticks (round numbers, or the powers of ten), labelled with the
//! values. A value that cannot be drawn (not finite, or ≤ 0 on a log scale) is left out, marked
//! "n/a" in its slot and counted in the footnote.
//!
//! **Cost against size** ([`Chart::sizes`] set): the same model drawn as a log-log line chart,
//! each group a size at its numeric x, each variant a line through its values with a dot at each;
//! a variant whose name starts with "ideal" is drawn dashed in grey — the slope a row should not
//! exceed (log n, linear), anchored at the row's first value.

use super::short_num;
use anyhow::anyhow;
use plotters::coord::Shift;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Which way a chart's bars are better.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Better {
    /// Times, costs: shorter bars are better.
    Lower,
    /// Throughputs, rates: taller bars are better.
    Higher,
}

impl Better {
    /// "lower is better" / "higher is better": the words every chart carries.
    pub fn as_str(self) -> &'static str {
        match self {
            Better::Lower => "lower is better",
            Better::Higher => "higher is better",
        }
    }
}

/// A grouped bar chart, rendered to SVG by [`render`]: one group per case, one bar per variant,
/// one colour per variant across all groups.
#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    /// What the groups along the x axis are, e.g. "transfer size" or "backing, pages per call".
    pub x_title: String,
    /// The y axis: the quantity with its unit, e.g. "ns per translation (median)".
    pub y_title: String,
    pub better: Better,
    pub log_scale: bool,
    pub groups: Vec<ChartGroup>,
    /// When set, the numeric size of each group (same order): the chart is drawn as lines on
    /// log-log axes instead of bars (see the module docs).
    pub sizes: Option<Vec<f64>>,
}

impl Chart {
    /// An empty chart; push [`ChartGroup`]s into `groups`.
    pub fn new(
        title: &str,
        x_title: &str,
        y_title: &str,
        better: Better,
        log_scale: bool,
    ) -> Chart {
        Chart {
            title: title.to_string(),
            x_title: x_title.to_string(),
            y_title: y_title.to_string(),
            better,
            log_scale,
            groups: Vec::new(),
            sizes: None,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct ChartGroup {
    pub label: String,
    /// `(variant, value)`.
    pub bars: Vec<(String, f64)>,
}

const W: u32 = 900;
const H: u32 = 500;
/// Left edge of the legend and the footnote; the plot's y labels sit left of `PLOT_LEFT`.
const MARGIN: i32 = 16;
const Y_LABELS_W: u32 = 78;
const FOOTER_H: u32 = 22;
/// At most this many labelled ticks on the y axis (plotters picks round values, or the powers of
/// ten on a log scale).
const Y_TICKS: usize = 6;
/// Okabe–Ito palette: distinguishable with the common colour-vision deficiencies.
const COLOURS: [RGBColor; 8] = [
    RGBColor(0x00, 0x72, 0xB2),
    RGBColor(0xE6, 0x9F, 0x00),
    RGBColor(0x00, 0x9E, 0x73),
    RGBColor(0xD5, 0x5E, 0x00),
    RGBColor(0xCC, 0x79, 0xA7),
    RGBColor(0x56, 0xB4, 0xE9),
    RGBColor(0xF0, 0xE4, 0x42),
    RGBColor(0x00, 0x00, 0x00),
];
const GREY: RGBColor = RGBColor(0x55, 0x55, 0x55);

/// A text style whose SVG `font-size` is `px` (plotters writes the size it is given / 1.24).
fn font(px: f64) -> TextStyle<'static> {
    styled(px, FontStyle::Normal)
}

fn styled(px: f64, style: FontStyle) -> TextStyle<'static> {
    TextStyle::from(("sans-serif", px * 1.24, style).into_font()).color(&BLACK)
}

/// Rough width of `s` in pixels at `px`: the SVG is laid out by its viewer, so this only has to
/// keep neighbours apart in common sans-serif fonts.
fn text_width(s: &str, px: f64) -> f64 {
    s.chars().count() as f64 * px * 0.62
}

/// Renders `chart` as a standalone SVG document.
pub fn render(chart: &Chart) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        draw(&root, chart).map_err(|e| anyhow!("drawing chart {:?}: {e}", chart.title))?;
        root.present()
            .map_err(|e| anyhow!("drawing chart {:?}: {e}", chart.title))?;
    }
    Ok(svg)
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type DrawError = DrawingAreaErrorKind<std::io::Error>;

fn draw(root: &Area, chart: &Chart) -> Result<(), DrawError> {
    root.fill(&WHITE)?;
    let centre = |px| font(px).pos(Pos::new(HPos::Center, VPos::Top));
    let title = styled(16.0, FontStyle::Bold);
    let title = title.pos(Pos::new(HPos::Center, VPos::Top));
    let mid = W as i32 / 2;
    root.draw(&Text::new(chart.title.clone(), (mid, 10), title))?;
    let mut direction = chart.better.as_str().to_string();
    if chart.log_scale {
        direction += " · log scale: each step up the axis is ten times the last";
    }
    root.draw(&Text::new(direction, (mid, 34), centre(12.0).color(&GREY)))?;

    let variants = variants(chart);
    let legend_bottom = draw_legend(root, &variants, 56)?;

    let values = chart.groups.iter().flat_map(|g| g.bars.iter().map(|b| b.1));
    let (shown, hidden): (Vec<f64>, Vec<f64>) = values.partition(|&v| drawable(chart, v));

    let (body, footer) = root.split_vertically(H - FOOTER_H);
    if !hidden.is_empty() {
        let why = if chart.log_scale {
            "zero, negative or non-finite values cannot be drawn on a log scale"
        } else {
            "non-finite values cannot be drawn"
        };
        let note = format!("{} value(s) left out (n/a): {why}", hidden.len());
        let style = styled(11.0, FontStyle::Italic);
        footer.draw(&Text::new(note, (MARGIN, 4), style))?;
    }

    // Group labels wrap at spaces to fit their group's width; the label area grows to fit them.
    let group_w = (W - Y_LABELS_W - 2 * MARGIN as u32) as f64 / chart.groups.len().max(1) as f64;
    let labels: Vec<Vec<String>> = chart
        .groups
        .iter()
        .map(|g| wrap(&g.label, group_w - 6.0, 11.0))
        .collect();
    let lines = labels.iter().map(Vec::len).max().unwrap_or(1) as u32;
    let x_label_h = 14 * lines + 26;

    if let Some(sizes) = &chart.sizes {
        return draw_lines(&body, chart, sizes, &variants, legend_bottom as u32 + 8);
    }
    let y = YAxis::new(&shown, chart.log_scale);
    let plot = Plot {
        root,
        body: &body,
        chart,
        top: legend_bottom as u32 + 8,
        x_label_h,
        labels: &labels,
        variants: &variants,
        shown: !shown.is_empty(),
    };
    if chart.log_scale {
        // Plotters finds the decades from logarithms, which can land a hair past a power of ten
        // and lose the end's tick: widen the range by a part in 1e9, which no pixel shows.
        let (lo, hi) = (y.lo * (1.0 - 1e-9), y.hi * (1.0 + 1e-9));
        plot.draw((lo..hi).log_scale(), lo)
    } else {
        plot.draw(y.lo..y.hi, 0.0)
    }
}

/// The y range, in values: linear from zero (or the lowest negative value) to a little above the
/// tallest bar, or on a log scale from whole powers of ten below the shortest bar to above the
/// tallest. `lo < hi` always holds. Plotters picks the ticks within it: round numbers on a linear
/// axis, the powers of ten on a log axis.
#[derive(Debug, Clone, Copy, PartialEq)]
struct YAxis {
    lo: f64,
    hi: f64,
}

impl YAxis {
    /// `values` are finite, and positive when `log`; none gives a placeholder axis. Leaves
    /// headroom above the tallest bar for its value label.
    fn new(values: &[f64], log: bool) -> YAxis {
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if values.is_empty() {
            return YAxis {
                lo: if log { 1.0 } else { 0.0 },
                hi: 10.0,
            };
        }
        if log {
            // A decade below the smallest value unless it sits well above its power of ten, so
            // its bar has some height.
            let lo = (min.log10() - 0.1).floor();
            let hi = (max * 1.5).log10().ceil().max(lo + 1.0);
            YAxis {
                lo: 10f64.powi(lo as i32),
                hi: 10f64.powi(hi as i32),
            }
        } else {
            let (lo, hi) = (min.min(0.0), (max * 1.15).max(0.0));
            YAxis {
                lo,
                hi: if hi > lo { hi } else { lo + 1.0 },
            }
        }
    }
}

/// What the plot part of a chart needs, whatever its y coordinate.
struct Plot<'a, 'b> {
    root: &'a Area<'b>,
    body: &'a Area<'b>,
    chart: &'a Chart,
    /// Where the plot starts below the legend.
    top: u32,
    x_label_h: u32,
    /// Each group's label, wrapped into lines.
    labels: &'a [Vec<String>],
    variants: &'a [&'a str],
    /// Whether any value can be drawn.
    shown: bool,
}

impl Plot<'_, '_> {
    /// Draws the axes, group labels and bars on the y coordinate `y` (a linear or a log range),
    /// bars standing on `base`.
    fn draw<Y>(&self, y: Y, base: f64) -> Result<(), DrawError>
    where
        Y: AsRangedCoord<Value = f64>,
        Y::CoordDescType: Ranged<ValueType = f64> + ValueFormatter<f64>,
    {
        let (root, chart) = (self.root, self.chart);
        let centre = |px| font(px).pos(Pos::new(HPos::Center, VPos::Top));
        let groups = chart.groups.len().max(1) as f64;
        let mut plot = ChartBuilder::on(self.body)
            .margin_top(self.top)
            .margin_left(MARGIN as u32)
            .margin_right(MARGIN as u32 + 4)
            .x_label_area_size(self.x_label_h)
            .y_label_area_size(Y_LABELS_W)
            .build_cartesian_2d(0f64..groups, y)?;
        let (lo, hi) = {
            let range = plot.y_range();
            (range.start, range.end)
        };
        plot.configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_labels(Y_TICKS)
            .max_light_lines(0)
            .y_label_formatter(&|v: &f64| short_num(*v))
            .y_label_style(font(11.0))
            .axis_desc_style(font(13.0))
            .x_desc(chart.x_title.clone())
            .y_desc(chart.y_title.clone())
            .bold_line_style(RGBColor(0xDD, 0xDD, 0xDD))
            .axis_style(BLACK)
            .draw()?;

        // Group labels under the axis, centred on their group.
        let below_axis = plot.backend_coord(&(0.0, lo)).1 + 6;
        for (g, lines) in self.labels.iter().enumerate() {
            let x = plot.backend_coord(&(g as f64 + 0.5, lo)).0;
            for (i, line) in lines.iter().enumerate() {
                let at = (x, below_axis + 14 * i as i32);
                root.draw(&Text::new(line.clone(), at, centre(11.0)))?;
            }
        }

        if !self.shown {
            let x = plot.backend_coord(&(groups / 2.0, lo)).0;
            let y = (plot.backend_coord(&(0.0, lo)).1 + plot.backend_coord(&(0.0, hi)).1) / 2;
            root.draw(&Text::new("no data", (x, y), centre(14.0).color(&GREY)))?;
            return Ok(());
        }

        // Variant by variant, each in its slot and colour; a value label above every bar, or n/a.
        let slot_w = 0.8 / self.variants.len().max(1) as f64;
        let bar_px = plot.backend_coord(&(slot_w, base)).0 - plot.backend_coord(&(0.0, base)).0;
        for (slot, variant) in self.variants.iter().enumerate() {
            let colour = COLOURS[slot % COLOURS.len()];
            let bars = chart.groups.iter().enumerate().flat_map(|(g, group)| {
                let x0 = g as f64 + 0.1 + slot as f64 * slot_w;
                group
                    .bars
                    .iter()
                    .filter(|(v, _)| v == variant)
                    .map(move |&(_, value)| (x0, value))
            });
            for (x0, value) in bars {
                let cx = x0 + slot_w / 2.0;
                if !drawable(chart, value) {
                    let (x, y) = plot.backend_coord(&(cx, base));
                    let style = font(10.0)
                        .color(&GREY)
                        .pos(Pos::new(HPos::Center, VPos::Bottom));
                    root.draw(&Text::new("n/a", (x, y - 3), style))?;
                    continue;
                }
                plot.draw_series(std::iter::once(Rectangle::new(
                    [(x0 + slot_w * 0.05, base), (x0 + slot_w * 0.95, value)],
                    colour.filled(),
                )))?;
                let (x, top) = plot.backend_coord(&(cx, value.max(base)));
                let label = short_num(value);
                if text_width(&label, 10.0) + 4.0 <= f64::from(bar_px) {
                    let style = font(10.0).pos(Pos::new(HPos::Center, VPos::Bottom));
                    root.draw(&Text::new(label, (x, top - 3), style))?;
                } else {
                    // Too narrow for the label: stand it up, reading upwards from the bar's top.
                    let style = font(10.0)
                        .transform(FontTransform::Rotate270)
                        .pos(Pos::new(HPos::Left, VPos::Center));
                    root.draw(&Text::new(label, (x, top - 3), style))?;
                }
            }
        }
        Ok(())
    }
}

/// The log-log line chart of cost against size: x over the sizes' decades, y over the values'
/// (both via [`YAxis`]); one line per variant, "ideal" variants dashed grey.
fn draw_lines(
    body: &Area,
    chart: &Chart,
    sizes: &[f64],
    variants: &[&str],
    top: u32,
) -> Result<(), DrawError> {
    let point = |g: usize, v: f64| {
        let x = sizes.get(g).copied().unwrap_or(f64::NAN);
        (x.is_finite() && x > 0.0 && v.is_finite() && v > 0.0).then_some((x, v))
    };
    let mut xs = Vec::new();
    let mut ys = Vec::new();
    for (g, group) in chart.groups.iter().enumerate() {
        for &(_, v) in &group.bars {
            if let Some((x, y)) = point(g, v) {
                xs.push(x);
                ys.push(y);
            }
        }
    }
    let (x, y) = (YAxis::new(&xs, true), YAxis::new(&ys, true));
    let (xlo, xhi) = (x.lo * (1.0 - 1e-9), x.hi * (1.0 + 1e-9));
    let (ylo, yhi) = (y.lo * (1.0 - 1e-9), y.hi * (1.0 + 1e-9));
    let mut plot = ChartBuilder::on(body)
        .margin_top(top)
        .margin_left(MARGIN as u32)
        .margin_right(MARGIN as u32 + 4)
        .x_label_area_size(40)
        .y_label_area_size(Y_LABELS_W)
        .build_cartesian_2d((xlo..xhi).log_scale(), (ylo..yhi).log_scale())?;
    plot.configure_mesh()
        .x_labels(Y_TICKS)
        .y_labels(Y_TICKS)
        .max_light_lines(0)
        .x_label_formatter(&|v: &f64| short_num(*v))
        .y_label_formatter(&|v: &f64| short_num(*v))
        .x_label_style(font(11.0))
        .y_label_style(font(11.0))
        .axis_desc_style(font(13.0))
        .x_desc(chart.x_title.clone())
        .y_desc(chart.y_title.clone())
        .bold_line_style(RGBColor(0xDD, 0xDD, 0xDD))
        .axis_style(BLACK)
        .draw()?;
    for (slot, variant) in variants.iter().enumerate() {
        let points: Vec<(f64, f64)> = chart
            .groups
            .iter()
            .enumerate()
            .flat_map(|(g, group)| {
                group
                    .bars
                    .iter()
                    .filter(|(v, _)| v == variant)
                    .filter_map(move |&(_, value)| point(g, value))
            })
            .collect();
        let colour = COLOURS[slot % COLOURS.len()];
        if variant.starts_with("ideal") {
            // Dashed: every other tenth of each segment, in log space (straight there).
            let dashes = points.windows(2).flat_map(|w| {
                let (a, b) = (w[0], w[1]);
                let at = move |t: f64| {
                    let lerp = |p: f64, q: f64| (p.ln() + (q.ln() - p.ln()) * t).exp();
                    (lerp(a.0, b.0), lerp(a.1, b.1))
                };
                (0..10)
                    .step_by(2)
                    .map(move |k| vec![at(k as f64 / 10.0), at((k + 1) as f64 / 10.0)])
            });
            plot.draw_series(dashes.map(|d| PathElement::new(d, GREY.stroke_width(1))))?;
        } else {
            plot.draw_series(std::iter::once(PathElement::new(
                points.clone(),
                colour.stroke_width(2),
            )))?;
            plot.draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 3, colour.filled())),
            )?;
        }
    }
    Ok(())
}

/// Whether `chart` can show `v` as a bar: finite, and positive on a log scale.
fn drawable(chart: &Chart, v: f64) -> bool {
    v.is_finite() && (!chart.log_scale || v > 0.0)
}

/// Variants in order of first appearance.
fn variants(chart: &Chart) -> Vec<&str> {
    let mut variants: Vec<&str> = Vec::new();
    for (variant, _) in chart.groups.iter().flat_map(|g| &g.bars) {
        if !variants.contains(&variant.as_str()) {
            variants.push(variant);
        }
    }
    variants
}

/// Where each legend entry's swatch goes, as (x, y of its centre line) from a legend top of 0:
/// left to right from the plot's left edge, wrapping onto another row when the next entry
/// would cross the right margin.
fn legend_layout<S: AsRef<str>>(variants: &[S]) -> Vec<(i32, i32)> {
    let left = MARGIN + Y_LABELS_W as i32;
    let right = W as i32 - MARGIN;
    let (mut x, mut y) = (left, 7);
    let mut at = Vec::new();
    for variant in variants {
        let advance = 34 + text_width(variant.as_ref(), 12.0) as i32;
        if x + advance > right && x > left {
            (x, y) = (left, y + 20);
        }
        at.push((x, y));
        x += advance;
    }
    at
}

/// The legend from `top` down; returns its bottom edge.
fn draw_legend(root: &Area, variants: &[&str], top: i32) -> Result<i32, DrawError> {
    let label_style = font(12.0).pos(Pos::new(HPos::Left, VPos::Center));
    let mut bottom = top;
    for (i, (variant, (x, y))) in variants.iter().zip(legend_layout(variants)).enumerate() {
        let (x, y) = (x, top + y);
        // The ideal slopes of a line chart are grey, whatever their slot.
        let colour = if variant.starts_with("ideal") {
            GREY
        } else {
            COLOURS[i % COLOURS.len()]
        };
        root.draw(&Rectangle::new(
            [(x, y - 6), (x + 12, y + 6)],
            colour.filled(),
        ))?;
        root.draw(&Text::new(
            variant.to_string(),
            (x + 17, y),
            label_style.clone(),
        ))?;
        bottom = y + 8;
    }
    Ok(bottom)
}

/// `label` split at spaces into lines at most `width` pixels wide at `px` (a single word wider
/// than that stays whole).
fn wrap(label: &str, width: f64, px: f64) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for word in label.split_whitespace() {
        match lines.last_mut() {
            Some(line) if text_width(&format!("{line} {word}"), px) <= width => {
                line.push(' ');
                line.push_str(word);
            }
            _ => lines.push(word.to_string()),
        }
    }
    if lines.is_empty() {
        lines.push(String::new());
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(better: Better, log_scale: bool, groups: &[(&str, &[(&str, f64)])]) -> Chart {
        let mut chart = Chart::new(
            "t <&> \"q\"",
            "cases <x>",
            "ns per op & more",
            better,
            log_scale,
        );
        chart.groups = groups
            .iter()
            .map(|(label, bars)| ChartGroup {
                label: label.to_string(),
                bars: bars.iter().map(|(v, x)| (v.to_string(), *x)).collect(),
            })
            .collect();
        chart
    }

    /// The text of every `<text>` element, in document order (plotters puts it on its own line).
    fn texts(svg: &str) -> Vec<&str> {
        svg.split("<text")
            .skip(1)
            .map(|t| {
                let body = &t[t.find('>').unwrap() + 1..t.find("</text>").unwrap()];
                body.trim()
            })
            .collect()
    }

    /// Tags nest and close properly, every `&` starts an entity, and no NaN or inf leaked out.
    fn assert_well_formed(svg: &str) {
        assert!(svg.starts_with("<svg "), "{svg}");
        assert!(svg.contains("xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
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

    /// Title, direction, both axis titles and one legend entry per variant, all escaped.
    #[test]
    fn says_what_it_shows() {
        let bars: &[(&str, f64)] = &[("binary search", 120.0), ("cursor <&>", 8.5)];
        let c = chart(
            Better::Lower,
            false,
            &[("1 vCPU <&>", bars), ("16 vCPUs", bars)],
        );
        let svg = render(&c).unwrap();
        assert_well_formed(&svg);
        let texts = texts(&svg);
        for want in [
            "t &lt;&amp;&gt; &quot;q&quot;",
            "lower is better",
            "cases &lt;x&gt;",
            "ns per op &amp; more",
            "1 vCPU &lt;&amp;&gt;",
            "16 vCPUs",
        ] {
            assert_eq!(
                texts.iter().filter(|t| **t == want).count(),
                1,
                "{want}: {texts:?}"
            );
        }
        assert!(!svg.contains("<&>"));
        // The legend names each variant once (bars carry values, not names).
        for variant in ["binary search", "cursor &lt;&amp;&gt;"] {
            assert_eq!(
                texts.iter().filter(|t| **t == variant).count(),
                1,
                "{variant}"
            );
        }
        // Same variant, same colour in both groups: one legend swatch and two bars.
        assert_eq!(svg.matches("fill=\"#E69F00\"").count(), 3);
        assert_eq!(
            texts.iter().filter(|t| **t == "120").count(),
            2,
            "{texts:?}"
        );
        assert_eq!(
            texts.iter().filter(|t| **t == "8.5").count(),
            2,
            "{texts:?}"
        );
        assert!(!svg.contains("log scale"));

        let svg = render(&chart(Better::Higher, true, &[("a", bars)])).unwrap();
        assert!(svg.contains("higher is better · log scale"), "{svg}");
        assert!(!svg.contains("lower is better"));
    }

    #[test]
    fn log_scale_leaves_out_zero_and_negative() {
        let svg = render(&chart(
            Better::Lower,
            true,
            &[
                ("a", &[("x", 0.0), ("y", 1e6)]),
                ("b", &[("x", -3.0), ("y", f64::NAN)]),
            ],
        ))
        .unwrap();
        assert_well_formed(&svg);
        let texts = texts(&svg);
        assert!(
            texts
                .iter()
                .any(|t| t.starts_with("3 value(s) left out (n/a)"))
        );
        assert_eq!(texts.iter().filter(|t| **t == "n/a").count(), 3);
        // Background, 2 legend swatches, 1 bar.
        assert_eq!(svg.matches("<rect").count(), 1 + 2 + 1, "{svg}");
        // Decade ticks from 1e5 (just under the bar) to 1e7 (room above it).
        for tick in ["100k", "1M", "10M"] {
            assert!(texts.contains(&tick), "{tick}: {texts:?}");
        }
    }

    #[test]
    fn empty_and_degenerate_inputs() {
        let svg = render(&chart(Better::Lower, false, &[])).unwrap();
        assert_well_formed(&svg);
        let texts = texts(&svg);
        for want in [
            "no data",
            "lower is better",
            "cases &lt;x&gt;",
            "ns per op &amp; more",
        ] {
            assert!(texts.contains(&want), "{want}: {texts:?}");
        }
        for (log, bars) in [
            (true, &[("x", 0.0)][..]),
            (false, &[("x", 0.0), ("y", 0.0)]),
            (false, &[("x", -5.0), ("y", 5.0)]),
            (true, &[("x", 1e-9), ("y", 1e12)]),
        ] {
            assert_well_formed(&render(&chart(Better::Higher, log, &[("a", bars)])).unwrap());
        }
    }

    /// Long group labels wrap at spaces instead of running into their neighbours, and many
    /// variants wrap the legend onto a second row.
    #[test]
    fn long_labels_and_many_variants_wrap() {
        let names = [
            "per-page",
            "runs",
            "adaptive",
            "pin+copy+unpin",
            "memcpy from guest",
        ];
        let bars: Vec<(&str, f64)> = names.iter().map(|n| (*n, 3.0)).collect();
        let long = "hugetlbfs 2 MiB, 512 pages";
        let groups: Vec<(&str, &[(&str, f64)])> = (0..12).map(|_| (long, &bars[..])).collect();
        let svg = render(&chart(Better::Lower, false, &groups)).unwrap();
        assert_well_formed(&svg);
        let texts = texts(&svg);
        assert!(!texts.contains(&long), "wrapped");
        // 12 groups leave too little room for "hugetlbfs 2": the first word stands alone.
        assert_eq!(
            texts.iter().filter(|t| **t == "hugetlbfs").count(),
            12,
            "{texts:?}"
        );
        // Greedy wrapping: nothing lost, each line fits (or is one word), and no line could
        // have taken the next line's first word.
        for width in [30.0, 50.0, 60.0, 80.0, 120.0] {
            let lines = wrap(long, width, 11.0);
            assert_eq!(lines.join(" "), long);
            for pair in lines.windows(2) {
                let first_next = pair[1].split(' ').next().unwrap();
                let joined = format!("{} {first_next}", pair[0]);
                assert!(text_width(&joined, 11.0) > width, "{width}: {lines:?}");
            }
            for line in &lines {
                assert!(
                    text_width(line, 11.0) <= width || !line.contains(' '),
                    "{line}"
                );
            }
        }
        assert_eq!(wrap(long, 1000.0, 11.0), [long]);
        assert_eq!(wrap(long, 1.0, 11.0).len(), 5, "one word a line");
        assert_eq!(wrap("", 10.0, 11.0), [""]);
        let legend_rows = legend_layout(&names.iter().map(|n| n.repeat(4)).collect::<Vec<_>>());
        assert!(
            legend_rows.last().unwrap().1 > legend_rows[0].1,
            "{legend_rows:?}"
        );
    }

    /// With sizes, a log-log line chart: one line per measured variant (a path and a dot per
    /// point), the ideal slopes dashed grey, sizes labelled on the x axis, nothing unescaped.
    #[test]
    fn sizes_draw_log_log_lines_with_dashed_ideals() {
        let mut c = chart(
            Better::Lower,
            true,
            &[
                (
                    "1000",
                    &[("translate", 20.0), ("ideal (log n) for translate", 20.0)],
                ),
                (
                    "100000",
                    &[("translate", 30.0), ("ideal (log n) for translate", 33.3)],
                ),
                (
                    "1000000",
                    &[("translate", 0.0), ("ideal (log n) for translate", 40.0)],
                ),
            ],
        );
        c.sizes = Some(vec![1e3, 1e5, 1e6]);
        let svg = render(&c).unwrap();
        assert_well_formed(&svg);
        // The measured line: one path through its two drawable points, a dot at each.
        assert_eq!(svg.matches("<circle").count(), 2, "{svg}");
        // One solid path in the variant's colour, and five grey dashes per segment of the
        // ideal line.
        let lines = |stroke: &str| {
            svg.lines()
                .filter(|l| l.starts_with("<polyline") && l.contains(stroke))
                .count()
        };
        assert_eq!(lines("stroke=\"#0072B2\" stroke-width=\"2\""), 1, "{svg}");
        assert_eq!(
            lines("stroke=\"#555555\" stroke-width=\"1\""),
            2 * 5,
            "{svg}"
        );
        let texts = texts(&svg);
        for tick in ["1000", "10k", "100k", "1M"] {
            assert!(texts.contains(&tick), "{tick}: {texts:?}");
        }
    }

    /// The ranges leave room above the tallest bar and span whole decades on a log scale; the
    /// ticks plotters puts in them are round numbers, the powers of ten on a log scale.
    #[test]
    fn ticks_are_round_numbers() {
        let y = YAxis::new(&[0.0, 80.0], false);
        assert_eq!((y.lo, y.hi), (0.0, 92.0));
        let y = YAxis::new(&[3.0, 4000.0], true);
        assert_eq!((y.lo, y.hi), (1.0, 10_000.0), "1 to 10 000");
        assert_eq!(YAxis::new(&[], true), YAxis { lo: 1.0, hi: 10.0 });
        assert_eq!(YAxis::new(&[0.0], false), YAxis { lo: 0.0, hi: 1.0 });

        let bars: &[(&str, f64)] = &[("x", 3.0), ("y", 4000.0)];
        let texts_of = |log| {
            let svg = render(&chart(Better::Lower, log, &[("a", bars)])).unwrap();
            texts(&svg)
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
        };
        let labels = texts_of(true);
        for tick in ["1", "10", "100", "1000", "10k"] {
            assert!(labels.contains(&tick.to_string()), "{tick}: {labels:?}");
        }
        // The ends of a log axis are labelled, also where log10 is inexact (0.1, 1e-10); over
        // many decades plotters labels every few, from the bottom.
        for (bars, ends) in [
            (&[("x", 0.5), ("y", 30.0)][..], &["0.1", "100"][..]),
            (&[("x", 1e-9), ("y", 1e12)][..], &["1.0e-10", "10G"]),
        ] {
            let svg = render(&chart(Better::Lower, true, &[("a", bars)])).unwrap();
            let texts = texts(&svg);
            for tick in ends {
                assert!(texts.contains(tick), "{tick}: {texts:?}");
            }
        }
        let texts = texts_of(false);
        for tick in ["0", "1000", "2000", "3000", "4000"] {
            assert!(texts.contains(&tick.to_string()), "{tick}: {texts:?}");
        }
    }
}
