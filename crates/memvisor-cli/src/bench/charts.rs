//! Grouped bar charts for the report: the [`Chart`] model the experiments fill in, and [`render`],
//! which draws one as a standalone 900×500 SVG with `plotters` (SVG backend only: text is emitted
//! as `<text>` elements, laid out by the viewer, so no font files are read).
//!
//! A chart reads top to bottom: the title; one line saying which way is better (and that the y
//! axis is logarithmic, when it is); the legend, one swatch per variant; the plot, one group of
//! bars per case along the x axis with the x axis title naming what the cases are, and the y
//! axis title giving the quantity and its unit; last, a footnote counting values that could not
//! be drawn. Each variant keeps one slot and one colour in every group. The y axis is linear from
//! zero or, for `log_scale`, spans whole decades (the bars are drawn in log10 space, the ticks
//! labelled with the values). A value that cannot be drawn (not finite, or ≤ 0 on a log scale) is
//! left out, marked "n/a" in its slot and counted in the footnote.

use super::short_num;
use anyhow::anyhow;
use plotters::coord::Shift;
use plotters::coord::ranged1d::KeyPointHint;
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

    let drawable = |v: f64| v.is_finite() && (!chart.log_scale || v > 0.0);
    let values = chart.groups.iter().flat_map(|g| g.bars.iter().map(|b| b.1));
    let (shown, hidden): (Vec<f64>, Vec<f64>) = values.partition(|&v| drawable(v));

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

    let scale = Scale::new(&shown, chart.log_scale);
    let groups = chart.groups.len().max(1) as f64;
    let mut plot = ChartBuilder::on(&body)
        .margin_top(legend_bottom as u32 + 8)
        .margin_left(MARGIN as u32)
        .margin_right(MARGIN as u32 + 4)
        .x_label_area_size(x_label_h)
        .y_label_area_size(Y_LABELS_W)
        .build_cartesian_2d(0f64..groups, scale.clone())?;
    let log = chart.log_scale;
    let tick_label = |t: &f64| short_num(if log { 10f64.powf(*t) } else { *t });
    plot.configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_label_formatter(&tick_label)
        .y_label_style(font(11.0))
        .axis_desc_style(font(13.0))
        .x_desc(chart.x_title.clone())
        .y_desc(chart.y_title.clone())
        .bold_line_style(RGBColor(0xDD, 0xDD, 0xDD))
        .axis_style(BLACK)
        .draw()?;

    // Group labels under the axis, centred on their group.
    let below_axis = plot.backend_coord(&(0.0, scale.lo)).1 + 6;
    for (g, lines) in labels.iter().enumerate() {
        let x = plot.backend_coord(&(g as f64 + 0.5, scale.lo)).0;
        for (i, line) in lines.iter().enumerate() {
            let at = (x, below_axis + 14 * i as i32);
            root.draw(&Text::new(line.clone(), at, centre(11.0)))?;
        }
    }

    if shown.is_empty() {
        let (x, y) = plot.backend_coord(&(groups / 2.0, (scale.lo + scale.hi) / 2.0));
        root.draw(&Text::new("no data", (x, y), centre(14.0).color(&GREY)))?;
        return Ok(());
    }

    // Variant by variant, each in its slot and colour; a value label above every bar, or n/a.
    let slot_w = 0.8 / variants.len().max(1) as f64;
    let bar_px = plot.backend_coord(&(slot_w, 0.0)).0 - plot.backend_coord(&(0.0, 0.0)).0;
    let base = scale.baseline();
    for (slot, variant) in variants.iter().enumerate() {
        let colour = COLOURS[slot % COLOURS.len()];
        let bars: Vec<(f64, f64)> = chart
            .groups
            .iter()
            .enumerate()
            .flat_map(|(g, group)| {
                let x0 = g as f64 + 0.1 + slot as f64 * slot_w;
                group
                    .bars
                    .iter()
                    .filter(|(v, _)| v == variant)
                    .map(move |&(_, value)| (x0, value))
            })
            .collect();
        for &(x0, value) in &bars {
            let cx = x0 + slot_w / 2.0;
            if !drawable(value) {
                let (x, y) = plot.backend_coord(&(cx, base));
                let style = font(10.0)
                    .color(&GREY)
                    .pos(Pos::new(HPos::Center, VPos::Bottom));
                root.draw(&Text::new("n/a", (x, y - 3), style))?;
                continue;
            }
            let y = scale.to_axis(value);
            plot.draw_series(std::iter::once(Rectangle::new(
                [(x0 + slot_w * 0.05, base), (x0 + slot_w * 0.95, y)],
                colour.filled(),
            )))?;
            let (x, top) = plot.backend_coord(&(cx, y.max(base)));
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
        let colour = COLOURS[i % COLOURS.len()];
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

/// The y axis, in the units bars are drawn in: values themselves, or their log10 on a log scale.
/// Linear axes run between multiples of a 1/2/5 step and include zero; log axes run between
/// whole powers of ten. `lo < hi` always holds. It is plotters' y coordinate too ([`Ranged`]),
/// so the grid lines and tick labels fall exactly on [`Scale::ticks`].
#[derive(Debug, Clone)]
struct Scale {
    lo: f64,
    hi: f64,
    step: f64,
    log: bool,
}

impl Scale {
    /// `values` are finite, and positive when `log`; none gives a placeholder axis. Leaves
    /// headroom above the tallest bar for its value label.
    fn new(values: &[f64], log: bool) -> Scale {
        if values.is_empty() {
            return Scale {
                lo: 0.0,
                hi: 1.0,
                step: if log { 1.0 } else { 0.2 },
                log,
            };
        }
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
        Scale { lo, hi, step, log }
    }

    /// Tick positions on the axis (log10 of the value on a log scale).
    fn ticks(&self) -> Vec<f64> {
        let n = ((self.hi - self.lo) / self.step).round() as i32;
        (0..=n)
            .map(|i| self.lo + f64::from(i) * self.step)
            .collect()
    }

    /// Where bars start: zero, or the bottom of a log axis.
    fn baseline(&self) -> f64 {
        if self.log { self.lo } else { 0.0 }
    }

    /// A value's position on the axis.
    fn to_axis(&self, v: f64) -> f64 {
        if self.log { v.log10() } else { v }
    }
}

impl Ranged for Scale {
    type ValueType = f64;
    type FormatOption = plotters::coord::ranged1d::DefaultFormatting;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let frac = (v - self.lo) / (self.hi - self.lo);
        limit.0 + (f64::from(limit.1 - limit.0) * frac).round() as i32
    }

    /// The ticks as bold points (labels and grid lines); no light grid lines.
    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

/// The smallest 1, 2 or 5 × 10^k that is at least `x` (`x` > 0).
fn nice_step(x: f64) -> f64 {
    let pow = 10f64.powf(x.log10().floor());
    let nice = [1.0, 2.0, 5.0].into_iter().find(|&n| x / pow <= n);
    nice.unwrap_or(10.0) * pow
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

    #[test]
    fn ticks_are_round_numbers() {
        let s = Scale::new(&[0.0, 80.0], false);
        assert_eq!(s.ticks(), [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        let s = Scale::new(&[3.0, 4000.0], true);
        assert_eq!(s.ticks(), [0.0, 1.0, 2.0, 3.0, 4.0], "log10 of 1 to 10 000");
        assert_eq!((nice_step(0.03), nice_step(7.0)), (0.05, 10.0));
        assert_eq!(s.map(&2.0, (300, 100)), 200, "y grows upwards");
    }
}
