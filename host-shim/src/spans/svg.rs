//! A picture of a recording's spans: per vCPU, one lane per depth of its phases and one per
//! depth of its functions, over host time; the host's exits as ticks on a lane of their own
//! (docs/spans.md, "The picture").
//!
//! - A closed span is a solid bar from its entry to its exit (phases blue, functions orange),
//!   named inside when the name fits, and with a `<title>` (name and duration) either way.
//! - A span without its exit (abandoned, or open when the recording ended) is hatched and
//!   outlined dashed from its entry to the right edge; one without its entry (an orphan exit)
//!   from the left edge to its exit. Neither is drawn with a duration.
//! - The x axis is host time since the earliest span end or exit, in s, ms or µs.
//!
//! The SVG is written as text (plotters has no patterns for the hatching). Its size is
//! bounded whatever the recording: spans narrower than half a pixel are merged into one
//! pixel-wide mark per lane and pixel column, exits into one tick per pixel column and label,
//! and lanes deeper than [`MAX_LANES`] are counted in a note instead of drawn.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use thiserror::Error;

use super::{Span, SpanKind, SpanState};

/// The picture's width in SVG user units (pixels).
pub const WIDTH: f64 = 1200.0;
/// The height of one lane.
pub const LANE: f64 = 16.0;
/// The most lanes of one vCPU and kind (depths 0..MAX_LANES).
pub const MAX_LANES: u32 = 32;

/// Left margin (lane names), right, top (title) and bottom (axis).
const LEFT: f64 = 170.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
/// Space between two vCPUs' lane groups.
const GAP: f64 = 10.0;

/// Fill of phases.
pub const PHASE: &str = "#4c78a8";
/// Fill of functions.
pub const FUNCTION: &str = "#f58518";
/// Colour of the host's exits.
pub const EXIT: &str = "#d62728";

/// Why no picture was drawn.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SvgError {
    /// Nothing to draw.
    #[error("no spans and no exits to draw: record span records (or give host exits) first")]
    Empty,
    /// The TSC frequency is needed to label the time axis.
    #[error("a TSC frequency of 0 Hz: give the host's (e.g. --tsc-hz)")]
    ZeroHz,
}

/// One lane: a vCPU, a kind and a depth.
type LaneKey = (u32, SpanKind, u32);

/// Escapes `s` for SVG text and attributes.
fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            c if c.is_control() => o.push(' '),
            c => o.push(c),
        }
    }
    o
}

/// A duration of `ticks` at `hz` in the unit that keeps it readable.
fn duration(ticks: u64, hz: u64) -> String {
    let s = ticks as f64 / hz as f64;
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.3} µs", s * 1e6)
    }
}

/// The axis unit for a range of `secs` seconds: (name, seconds per unit).
fn unit(secs: f64) -> (&'static str, f64) {
    if secs >= 2.0 {
        ("s", 1.0)
    } else if secs >= 2e-3 {
        ("ms", 1e-3)
    } else {
        ("µs", 1e-6)
    }
}

/// A tick step of 1, 2 or 5 times a power of ten giving at most about 10 ticks over `range`.
fn tick_step(range: f64) -> f64 {
    let raw = range / 10.0;
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|s| *s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * p)
}

/// The picture of `spans` and the host's `exits` (host TSC, label), titled `title`, its time
/// axis from a TSC of `tsc_hz` ticks per second.
///
/// # Errors
/// [`SvgError::Empty`] with nothing to draw, [`SvgError::ZeroHz`].
pub fn draw(
    spans: &[Span],
    exits: &[(u64, String)],
    title: &str,
    tsc_hz: u64,
) -> Result<String, SvgError> {
    let c = Canvas::layout(spans, exits, tsc_hz)?;
    let mut o = String::with_capacity(4096 + spans.len().min(100_000) * 160);
    c.head(&mut o, title);
    c.spans(&mut o, spans);
    c.exits(&mut o, exits);
    c.axis(&mut o);
    o.push_str("</svg>\n");
    Ok(o)
}

/// Where everything goes: the time range, each lane's height, the exits' lane.
struct Canvas {
    t0: u64,
    t1: u64,
    tsc_hz: u64,
    lane_y: BTreeMap<LaneKey, f64>,
    labels: Vec<(f64, String)>,
    exits_y: Option<f64>,
    plot_bottom: f64,
    height: f64,
    too_deep: u64,
}

impl Canvas {
    /// Lanes for every (vCPU, kind) that has spans, depths 0..=deepest (below MAX_LANES),
    /// and one for the exits if there are any.
    fn layout(spans: &[Span], exits: &[(u64, String)], tsc_hz: u64) -> Result<Self, SvgError> {
        if tsc_hz == 0 {
            return Err(SvgError::ZeroHz);
        }
        let times = spans
            .iter()
            .flat_map(|s| [s.begin, s.end])
            .flatten()
            .map(|e| e.host_tsc)
            .chain(exits.iter().map(|e| e.0));
        let (t0, t1) = times
            .fold(None, |r: Option<(u64, u64)>, t| {
                Some(r.map_or((t, t), |(a, b)| (a.min(t), b.max(t))))
            })
            .ok_or(SvgError::Empty)?;
        let t1 = t1.max(t0 + 1);
        let mut deepest: BTreeMap<(u32, SpanKind), u32> = BTreeMap::new();
        let mut too_deep = 0u64;
        for s in spans {
            if s.depth >= MAX_LANES {
                too_deep += 1;
                continue;
            }
            let d = deepest.entry((s.vcpu, s.kind)).or_insert(0);
            *d = (*d).max(s.depth);
        }
        let mut lane_y: BTreeMap<LaneKey, f64> = BTreeMap::new();
        let mut labels = Vec::new();
        let mut y = TOP;
        let mut last_vcpu = None;
        for (&(vcpu, kind), &d) in &deepest {
            if last_vcpu.is_some_and(|v| v != vcpu) {
                y += GAP;
            }
            last_vcpu = Some(vcpu);
            for depth in 0..=d {
                lane_y.insert((vcpu, kind, depth), y);
                let name = match kind {
                    SpanKind::Phase => "phases",
                    SpanKind::Function => "functions",
                };
                labels.push((y, format!("vCPU {vcpu} {name} {depth}")));
                y += LANE;
            }
        }
        let exits_y = (!exits.is_empty()).then(|| {
            let at = y + GAP;
            labels.push((at, "host exits".to_owned()));
            y = at + LANE;
            at
        });
        Ok(Self {
            t0,
            t1,
            tsc_hz,
            lane_y,
            labels,
            exits_y,
            plot_bottom: y,
            height: y + BOTTOM + if too_deep > 0 { 16.0 } else { 0.0 },
            too_deep,
        })
    }

    /// The plot's width in SVG units.
    fn span_px() -> f64 {
        WIDTH - LEFT - RIGHT
    }

    /// The x of host tick `t`.
    fn x_of(&self, t: u64) -> f64 {
        LEFT + (t - self.t0) as f64 / (self.t1 - self.t0) as f64 * Self::span_px()
    }

    /// The document's start, the patterns, the title, the legend and the lanes' names.
    fn head(&self, o: &mut String, title: &str) {
        let height = self.height;
        let _ = writeln!(
            o,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">"#
        );
        let _ = writeln!(
            o,
            r#"<defs>{}{}</defs>"#,
            hatch("hatch-phase", PHASE),
            hatch("hatch-function", FUNCTION)
        );
        let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            o,
            r#"<text class="title" x="{LEFT}" y="22" font-size="15">{}</text>"#,
            esc(title)
        );
        // The legend, top right: what the fills mean.
        let mut lx = WIDTH - RIGHT - 420.0;
        for (class, paint, stroke, text) in [
            ("phase", PHASE.to_owned(), "", "phase"),
            ("function", FUNCTION.to_owned(), "", "function"),
            (
                "unfinished",
                "url(#hatch-function)".to_owned(),
                r##" stroke="#f58518" stroke-dasharray="4 2""##,
                "exit (or entry) not seen",
            ),
        ] {
            let _ = writeln!(
                o,
                r#"<rect class="legend {class}" x="{lx}" y="8" width="18" height="10" fill="{paint}"{stroke}/><text class="legend" x="{}" y="17">{text}</text>"#,
                lx + 22.0
            );
            lx += 22.0 + text.len() as f64 * 6.5 + 16.0;
        }
        for (ly, name) in &self.labels {
            let _ = writeln!(
                o,
                r#"<text class="lane" x="{}" y="{}" text-anchor="end">{}</text>"#,
                LEFT - 6.0,
                ly + LANE - 4.0,
                esc(name)
            );
        }
    }

    /// Spans: the wide ones one by one, the narrow ones as one mark per lane and pixel column.
    fn spans(&self, o: &mut String, spans: &[Span]) {
        let right = LEFT + Self::span_px();
        let mut dense: BTreeSet<(LaneKey, u32)> = BTreeSet::new();
        for s in spans {
            let Some(&ly) = self.lane_y.get(&(s.vcpu, s.kind, s.depth)) else {
                continue;
            };
            let (fill, hatch_id) = match s.kind {
                SpanKind::Phase => (PHASE, "hatch-phase"),
                SpanKind::Function => (FUNCTION, "hatch-function"),
            };
            let (x0, x1, state) = match (s.state(), s.begin, s.end) {
                (SpanState::Closed, Some(b), Some(e)) => {
                    (self.x_of(b.host_tsc), self.x_of(e.host_tsc), "closed")
                }
                (SpanState::Open, Some(b), _) => (self.x_of(b.host_tsc), right, "open"),
                (SpanState::Orphan, _, Some(e)) => (LEFT, self.x_of(e.host_tsc), "orphan"),
                _ => continue,
            };
            let w = x1 - x0;
            if state == "closed" && w < 0.5 {
                // Truncation to the pixel column is the point here.
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                dense.insert(((s.vcpu, s.kind, s.depth), x0.max(0.0) as u32));
                continue;
            }
            let tip = match (state, s.ticks()) {
                ("closed", Some(t)) => format!("{} ({})", s.name, duration(t, self.tsc_hz)),
                ("open", _) => format!("{} (exit not seen)", s.name),
                _ => format!("{} (entry not seen)", s.name),
            };
            let (paint, stroke) = if state == "closed" {
                (fill.to_owned(), String::new())
            } else {
                (
                    format!("url(#{hatch_id})"),
                    format!(r#" stroke="{fill}" stroke-dasharray="4 2""#),
                )
            };
            let _ = write!(
                o,
                r#"<rect class="span {} {state}" x="{x0:.2}" y="{:.1}" width="{:.2}" height="{:.1}" fill="{paint}"{stroke}><title>{}</title></rect>"#,
                s.kind.as_str(),
                ly + 1.0,
                w.max(1.0),
                LANE - 2.0,
                esc(&tip)
            );
            // The name inside when it fits (about 6 units per character).
            let label = s.name.chars().count() as f64 * 6.0 + 4.0;
            if w >= label {
                let _ = write!(
                    o,
                    r#"<text class="name" x="{:.2}" y="{:.1}" fill="white">{}</text>"#,
                    x0 + 2.0,
                    ly + LANE - 4.0,
                    esc(&s.name)
                );
            }
            o.push('\n');
        }
        for (lane, px) in &dense {
            let ly = self.lane_y.get(lane).copied().unwrap_or(TOP);
            let fill = match lane.1 {
                SpanKind::Phase => PHASE,
                SpanKind::Function => FUNCTION,
            };
            let _ = writeln!(
                o,
                r#"<rect class="span {} dense" x="{px}" y="{:.1}" width="1" height="{:.1}" fill="{fill}"/>"#,
                lane.1.as_str(),
                ly + 1.0,
                LANE - 2.0
            );
        }
    }

    /// Exits: one tick per pixel column and label.
    fn exits(&self, o: &mut String, exits: &[(u64, String)]) {
        let Some(ey) = self.exits_y else {
            return;
        };
        let mut ticks: BTreeMap<(u32, &str), u64> = BTreeMap::new();
        for (t, label) in exits {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let px = self.x_of(*t).round() as u32;
            *ticks.entry((px, label.as_str())).or_default() += 1;
        }
        for ((px, label), n) in ticks {
            let _ = writeln!(
                o,
                r#"<line class="exit" x1="{px}" y1="{:.1}" x2="{px}" y2="{:.1}" stroke="{EXIT}" stroke-width="1"><title>{} × {n}</title></line>"#,
                ey + 1.0,
                ey + LANE - 1.0,
                esc(label)
            );
        }
    }

    /// The time axis, its ticks and label, and the note on lanes too deep to draw.
    fn axis(&self, o: &mut String) {
        let (plot_bottom, span_px) = (self.plot_bottom, Self::span_px());
        let right = LEFT + span_px;
        let secs = (self.t1 - self.t0) as f64 / self.tsc_hz as f64;
        let (uname, per) = unit(secs);
        let range = secs / per;
        let step = tick_step(range);
        let _ = writeln!(
            o,
            r#"<line class="axis" x1="{LEFT}" y1="{plot_bottom}" x2="{right}" y2="{plot_bottom}" stroke="black"/>"#
        );
        // Enough decimals to tell the ticks apart.
        let mut digits = 0usize;
        let mut scaled = step;
        while scaled < 1.0 - 1e-9 && digits < 9 {
            scaled *= 10.0;
            digits += 1;
        }
        // About 10 ticks: the bound only guards against a step that does not advance.
        for k in 0..=100u32 {
            let v = f64::from(k) * step;
            if v > range * (1.0 + 1e-9) {
                break;
            }
            let x = LEFT + v / range * span_px;
            let _ = writeln!(
                o,
                r#"<line class="tick" x1="{x:.2}" y1="{plot_bottom}" x2="{x:.2}" y2="{}" stroke="black"/><text class="tick" x="{x:.2}" y="{}" text-anchor="middle">{v:.digits$}</text>"#,
                plot_bottom + 4.0,
                plot_bottom + 16.0
            );
        }
        let _ = writeln!(
            o,
            r#"<text class="axis-label" x="{}" y="{}" text-anchor="middle">host time ({uname}) since the first event</text>"#,
            LEFT + span_px / 2.0,
            plot_bottom + 34.0
        );
        if self.too_deep > 0 {
            let _ = writeln!(
                o,
                r#"<text class="note" x="{LEFT}" y="{}">{} spans deeper than {MAX_LANES} levels not drawn</text>"#,
                plot_bottom + 50.0,
                self.too_deep
            );
        }
    }
}

/// A diagonal hatch pattern in `color`.
fn hatch(id: &str, color: &str) -> String {
    format!(
        r#"<pattern id="{id}" patternUnits="userSpaceOnUse" width="6" height="6" patternTransform="rotate(45)"><rect width="6" height="6" fill="white"/><line x1="0" y1="0" x2="0" y2="6" stroke="{color}" stroke-width="3"/></pattern>"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::Bound;
    use crate::spans::SpanEnd;

    fn end(t: u64) -> Option<SpanEnd> {
        Some(SpanEnd {
            host_tsc: t,
            bound: Some(Bound { lo: t, hi: t }),
            guest_tsc: None,
        })
    }

    fn span(
        vcpu: u32,
        kind: SpanKind,
        name: &str,
        depth: u32,
        b: Option<u64>,
        e: Option<u64>,
    ) -> Span {
        Span {
            vcpu,
            kind,
            name: name.into(),
            addr: None,
            depth,
            begin: b.and_then(end),
            end: e.and_then(end),
        }
    }

    fn parse(svg: &str) -> roxmltree::Document<'_> {
        roxmltree::Document::parse(svg).expect("a well-formed SVG")
    }

    fn class_count(doc: &roxmltree::Document<'_>, tag: &str, class: &str) -> usize {
        doc.descendants()
            .filter(|n| n.has_tag_name(tag))
            .filter(|n| {
                n.attribute("class")
                    .is_some_and(|c| c.split(' ').any(|w| w == class))
            })
            .count()
    }

    fn boot() -> Vec<Span> {
        use SpanKind::{Function as F, Phase as P};
        vec![
            span(0, P, "post", 0, Some(0), Some(1_000_000)),
            span(
                0,
                P,
                "clear <mem> & \"go\"",
                1,
                Some(100_000),
                Some(600_000),
            ),
            span(0, F, "startBoot", 0, Some(10_000), Some(900_000)),
            span(0, F, "memset", 1, Some(20_000), Some(500_000)),
            span(0, F, "tiny", 1, Some(600_000), Some(600_010)),
            span(0, F, "tiny", 1, Some(600_020), Some(600_030)),
            span(0, F, "waitForever", 0, Some(950_000), None),
            span(1, F, "smpEntry", 0, Some(50_000), Some(80_000)),
            span(1, F, "lost", 1, None, Some(70_000)),
        ]
    }

    #[test]
    fn the_picture_parses_and_holds_every_span_lane_and_exit() {
        let exits = vec![
            (5_000, "port 0x402".to_owned()),
            (5_001, "port 0x402".to_owned()),
            (700_000, "port 0x80".to_owned()),
        ];
        let svg = draw(&boot(), &exits, "SeaBIOS <boot>", 1_000_000_000).unwrap();
        let doc = parse(&svg);
        assert!(doc.root_element().has_tag_name("svg"));
        // Five closed spans wide enough; two tiny ones merged into one pixel column.
        assert_eq!(class_count(&doc, "rect", "closed"), 5);
        assert_eq!(class_count(&doc, "rect", "dense"), 1);
        assert_eq!(class_count(&doc, "rect", "open"), 1);
        assert_eq!(class_count(&doc, "rect", "orphan"), 1);
        assert_eq!(
            class_count(&doc, "rect", "phase"),
            3,
            "two phases and the legend"
        );
        // Lanes: vCPU 0 phases 0-1, functions 0-1; vCPU 1 functions 0-1; host exits.
        let lanes: Vec<&str> = doc
            .descendants()
            .filter(|n| n.attribute("class") == Some("lane"))
            .filter_map(|n| n.text())
            .collect();
        assert_eq!(
            lanes,
            [
                "vCPU 0 phases 0",
                "vCPU 0 phases 1",
                "vCPU 0 functions 0",
                "vCPU 0 functions 1",
                "vCPU 1 functions 0",
                "vCPU 1 functions 1",
                "host exits"
            ]
        );
        // The two exits a tick apart share a pixel: one tick saying so.
        assert_eq!(class_count(&doc, "line", "exit"), 2);
        let titles: Vec<&str> = doc
            .descendants()
            .filter(|n| n.has_tag_name("title"))
            .filter_map(|n| n.text())
            .collect();
        assert!(titles.contains(&"port 0x402 × 2"), "{titles:?}");
        assert!(titles.contains(&"memset (480.000 µs)"), "{titles:?}");
        assert!(
            titles.contains(&"waitForever (exit not seen)"),
            "{titles:?}"
        );
        assert!(titles.contains(&"lost (entry not seen)"), "{titles:?}");
        assert!(
            titles.contains(&"clear <mem> & \"go\" (500.000 µs)"),
            "{titles:?}"
        );
        // Open and orphan spans are hatched and dashed, closed ones solid; the open one runs
        // to the right edge.
        for n in doc.descendants().filter(|n| n.has_tag_name("rect")) {
            let c = n.attribute("class").unwrap_or_default();
            if c.contains("open") || c.contains("orphan") {
                assert!(n.attribute("fill").unwrap().starts_with("url(#hatch-"));
                assert!(n.attribute("stroke-dasharray").is_some());
            }
            if c.contains("open") {
                let x: f64 = n.attribute("x").unwrap().parse().unwrap();
                let w: f64 = n.attribute("width").unwrap().parse().unwrap();
                assert!((x + w - (WIDTH - RIGHT)).abs() < 0.01);
            }
        }
        // 1 ms of host time: the axis is in µs, ticks every 100.
        assert!(svg.contains("host time (µs) since the first event"));
        assert_eq!(class_count(&doc, "text", "tick"), 11);
    }

    #[test]
    fn nothing_to_draw_and_no_frequency_are_errors_and_deep_spans_are_counted() {
        assert_eq!(draw(&[], &[], "t", 1), Err(SvgError::Empty));
        assert_eq!(draw(&boot(), &[], "t", 0), Err(SvgError::ZeroHz));
        let deep: Vec<Span> = (0..MAX_LANES + 3)
            .map(|d| {
                span(
                    0,
                    SpanKind::Function,
                    "f",
                    d,
                    Some(u64::from(d)),
                    Some(1000),
                )
            })
            .collect();
        let svg = draw(&deep, &[], "deep", 1000).unwrap();
        let doc = parse(&svg);
        assert_eq!(
            class_count(&doc, "text", "lane"),
            MAX_LANES as usize,
            "one lane per depth up to the cap"
        );
        assert!(svg.contains("3 spans deeper than 32 levels not drawn"));
    }

    #[test]
    fn ticks_are_round_numbers() {
        assert_eq!(tick_step(1.0), 0.1);
        assert_eq!(tick_step(7.3), 1.0);
        assert_eq!(tick_step(130.0), 20.0);
        assert_eq!(unit(0.0005), ("µs", 1e-6));
        assert_eq!(unit(3.5), ("s", 1.0));
    }
}
