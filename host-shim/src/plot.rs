//! `vmtsync plot`: a sync file as a picture (SVG), one panel per vCPU.
//!
//! Each panel shows, over host time, the offset estimate of every segment (a black line through
//! the anchors, broken at segment breaks) and its guaranteed interval at the anchor (a vertical
//! bar, with a translucent band joining consecutive bars so the eye can follow it), coloured by
//! how the segment's samples were stamped: exit-anchored (host `kvm_pio` exits) or in-process
//! (the host process's own reads and writes, on the far side of the VMM). Segment breaks (the
//! relation changed: a reset or a migration) are red vertical lines at the first probe of the
//! segment that starts anew.
//!
//! The bars are the exact guaranteed bounds the sync file holds at each anchor; the band between
//! two anchors is a visual aid only (between anchors the guaranteed interval is the segment's
//! offset bounds widened by its drift bounds times the distance from the anchor, see
//! [`crate::syncfile`]). The y axis is the offset minus a per-vCPU reference (the first
//! segment's offset, printed in the panel's caption), so intervals a few thousand ticks wide
//! stay visible next to offsets of 10^13. The x axis is host TSC ticks since the earliest
//! anchor of the file, in millions.
//!
//! Only the SVG backend of `plotters` is used: no font or bitmap stack, text sized by the
//! viewer.

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;
use thiserror::Error;

use crate::atomic_file::write_atomically;
use crate::syncfile::AnchorKind;
use crate::syncfile::{SyncFile, SyncFileError, SyncSegment};

/// The picture's width in SVG user units (pixels).
pub const WIDTH: u32 = 1000;
/// The height of one vCPU's panel.
pub const PANEL_HEIGHT: u32 = 360;

/// The fill of exit-anchored intervals.
pub const ANCHORED: RGBColor = RGBColor(31, 119, 180);
/// The fill of in-process intervals.
pub const IN_PROCESS: RGBColor = RGBColor(255, 127, 14);
/// Segments whose stamping this version does not know.
pub const UNKNOWN: RGBColor = RGBColor(127, 127, 127);
/// The offset estimate.
pub const ESTIMATE: RGBColor = RGBColor(33, 33, 33);
/// Segment breaks.
pub const BREAK: RGBColor = RGBColor(214, 39, 40);
/// A known true offset (`--truth`).
pub const TRUTH: RGBColor = RGBColor(44, 160, 44);

/// The opacity of the band between two anchors' bars.
const BAND_OPACITY: f64 = 0.25;

/// How a segment's samples were stamped on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stamping {
    /// At the VM exits of the probe's I/O (host `kvm_pio`): brackets a few µs wide.
    ExitAnchored,
    /// In the host process, around its own reads and writes: brackets include the VMM's and
    /// the host kernel's latency.
    InProcess,
    /// A kind this version does not know (a sync file from a newer writer): drawn in grey,
    /// never claimed as either.
    Unknown,
}

impl Stamping {
    /// How `segment` was stamped (its `anchor`; files without one are from in-process
    /// probing, the only kind that existed before exit anchoring).
    #[must_use]
    pub fn of(segment: &SyncSegment) -> Self {
        match segment.anchor {
            AnchorKind::InProcess => Self::InProcess,
            // Both are the host kernel's `kvm_pio` stamps: of the UART's data port, or of the
            // agent's sync port.
            AnchorKind::KvmPioUart | AnchorKind::KvmPioSyncPort | AnchorKind::KvmPioBeacon => {
                Self::ExitAnchored
            }
            AnchorKind::Unknown => Self::Unknown,
        }
    }

    fn color(self) -> RGBColor {
        match self {
            Self::ExitAnchored => ANCHORED,
            Self::InProcess => IN_PROCESS,
            Self::Unknown => UNKNOWN,
        }
    }

    fn short(self) -> &'static str {
        match self {
            Self::ExitAnchored => "exit-anchored",
            Self::InProcess => "in-process",
            Self::Unknown => "unknown stamping",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::ExitAnchored => "guaranteed interval, exit-anchored",
            Self::InProcess => "guaranteed interval, in-process",
            Self::Unknown => "guaranteed interval, unknown stamping",
        }
    }
}

/// One segment as the plot needs it: host time since the file's origin and the offset
/// relative to its vCPU's reference, both exact integers until they become coordinates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlotPoint {
    /// Host ticks of the anchor since the origin.
    pub host: i128,
    /// Host ticks of the segment's first probe since the origin (where a break is drawn).
    pub host_first: i128,
    /// Offset minus the reference.
    pub offset: i128,
    /// Guaranteed lower bound minus the reference.
    pub lo: i128,
    /// Guaranteed upper bound minus the reference.
    pub hi: i128,
    /// How its samples were stamped.
    pub stamping: Stamping,
    /// A new estimate starts here.
    pub is_break: bool,
}

/// One vCPU's panel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VcpuSeries {
    /// The vCPU.
    pub vcpu: u32,
    /// The offset subtracted from every value (its first segment's).
    pub reference: i64,
    /// Its segments in file order.
    pub points: Vec<PlotPoint>,
}

/// What a plot shows, ready to draw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlotData {
    /// The host TSC every x value is relative to (the earliest anchor).
    pub origin: u64,
    /// One panel per vCPU, by vCPU number.
    pub vcpus: Vec<VcpuSeries>,
    /// A true offset known from outside the sync file (guest − host ticks, e.g. KVM debugfs'
    /// exact `tsc-offset`), drawn as a dashed line so the eye can check every interval holds
    /// it.
    pub truth: Option<i64>,
}

/// Why a plot failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PlotError {
    /// The sync file could not be read.
    #[error(transparent)]
    SyncFile(#[from] SyncFileError),
    /// The sync file has no segment yet.
    #[error(
        "the sync file has no segment to plot yet (is `vmtsync probe --continuous` still starting?)"
    )]
    Empty,
    /// plotters failed to draw.
    #[error("drawing the plot: {0}")]
    Draw(String),
    /// The output could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The output file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

impl PlotData {
    /// Groups `file`'s segments by vCPU, relative to the earliest anchor and to each vCPU's
    /// first offset.
    ///
    /// # Errors
    /// [`PlotError::Empty`] without segments.
    pub fn from_sync_file(file: &SyncFile) -> Result<Self, PlotError> {
        let origin = file
            .segments
            .iter()
            .map(|s| s.host_anchor.min(s.host_first))
            .min()
            .ok_or(PlotError::Empty)?;
        let mut vcpus: Vec<VcpuSeries> = Vec::new();
        for seg in &file.segments {
            let series = match vcpus.iter().position(|v| v.vcpu == seg.vcpu) {
                Some(i) => &mut vcpus[i],
                None => {
                    vcpus.push(VcpuSeries {
                        vcpu: seg.vcpu,
                        reference: seg.offset,
                        points: Vec::new(),
                    });
                    vcpus.last_mut().ok_or(PlotError::Empty)?
                }
            };
            let rel = |v: i64| i128::from(v) - i128::from(series.reference);
            series.points.push(PlotPoint {
                host: i128::from(seg.host_anchor) - i128::from(origin),
                host_first: i128::from(seg.host_first) - i128::from(origin),
                offset: rel(seg.offset),
                lo: rel(seg.offset_lo),
                hi: rel(seg.offset_hi),
                stamping: Stamping::of(seg),
                is_break: seg.is_break,
            });
        }
        vcpus.sort_by_key(|v| v.vcpu);
        Ok(Self {
            origin,
            vcpus,
            truth: None,
        })
    }
}

impl PlotData {
    /// Sets a known true offset and makes it every panel's reference, so the y axis reads as
    /// the error of each estimate and bound.
    pub fn set_truth(&mut self, truth: i64) {
        for v in &mut self.vcpus {
            let by = i128::from(v.reference) - i128::from(truth);
            for p in &mut v.points {
                p.offset += by;
                p.lo += by;
                p.hi += by;
            }
            v.reference = truth;
        }
        self.truth = Some(truth);
    }
}

/// A run of consecutive points of one vCPU with one stamping and no break inside.
fn runs(points: &[PlotPoint]) -> Vec<&[PlotPoint]> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=points.len() {
        let ends =
            i == points.len() || points[i].is_break || points[i].stamping != points[i - 1].stamping;
        if ends {
            out.push(&points[start..i]);
            start = i;
        }
    }
    out
}

/// Ticks to an x coordinate (millions of host ticks). Plot coordinates are the one place
/// floats are used: they only place pixels, every value is exact until here.
#[allow(clippy::cast_precision_loss)]
fn x_of(host: i128) -> f64 {
    host as f64 / 1e6
}

#[allow(clippy::cast_precision_loss)]
fn y_of(ticks: i128) -> f64 {
    ticks as f64
}

fn draw_err(e: impl std::fmt::Display) -> PlotError {
    PlotError::Draw(e.to_string())
}

/// Draws `data` as an SVG document.
///
/// # Errors
/// [`PlotError::Draw`] if plotters fails (it does not for the SVG backend on valid data).
pub fn render_svg(data: &PlotData) -> Result<String, PlotError> {
    let mut svg = String::new();
    let panels = u32::try_from(data.vcpus.len().max(1)).unwrap_or(u32::MAX);
    let height = PANEL_HEIGHT.saturating_mul(panels);
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let areas = root.split_evenly((data.vcpus.len().max(1), 1));
        let (x_lo, x_hi) = padded(
            data.vcpus
                .iter()
                .flat_map(|v| v.points.iter())
                .flat_map(|p| [x_of(p.host), x_of(p.host_first)]),
        );
        for (area, series) in areas.iter().zip(&data.vcpus) {
            draw_panel(area, series, data, x_lo..x_hi)?;
        }
        root.present().map_err(draw_err)?;
    }
    Ok(svg)
}

/// The range of `values` with 5 % room on each side (and a unit range around a single value).
fn padded(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() || !hi.is_finite() {
        return (-1.0, 1.0);
    }
    let room = if hi > lo { (hi - lo) * 0.05 } else { 1.0 };
    (lo - room, hi + room)
}

fn draw_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    series: &VcpuSeries,
    data: &PlotData,
    x_range: std::ops::Range<f64>,
) -> Result<(), PlotError> {
    let origin = data.origin;
    let x_ends = (x_range.start, x_range.end);
    let truth = data
        .truth
        .map(|t| y_of(i128::from(t) - i128::from(series.reference)));
    let (y_lo, y_hi) = padded(
        series
            .points
            .iter()
            .flat_map(|p| [y_of(p.lo), y_of(p.hi)])
            .chain(truth),
    );
    let mut caption = format!(
        "vCPU {}: offset (guest - host) relative to {} ticks; {} segments",
        series.vcpu,
        series.reference,
        series.points.len()
    );
    for stamping in [
        Stamping::InProcess,
        Stamping::ExitAnchored,
        Stamping::Unknown,
    ] {
        let widths = series
            .points
            .iter()
            .filter(|p| p.stamping == stamping)
            .map(|p| p.hi - p.lo);
        if let (Some(min), Some(max)) = (widths.clone().min(), widths.max()) {
            let _ = write!(caption, "; {} width {min}..{max}", stamping.short());
        }
    }
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(90)
        .build_cartesian_2d(x_range, y_lo..y_hi)
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .x_desc(format!("host TSC since {origin} (millions of ticks)"))
        .y_desc(if data.truth.is_some() {
            "offset minus the true offset (ticks)"
        } else {
            "offset relative to the reference (ticks)"
        })
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(draw_err)?;

    let runs = runs(&series.points);
    for stamping in [
        Stamping::InProcess,
        Stamping::ExitAnchored,
        Stamping::Unknown,
    ] {
        let mine: Vec<&[PlotPoint]> = runs
            .iter()
            .copied()
            .filter(|r| r.first().map(|p| p.stamping) == Some(stamping))
            .collect();
        if mine.is_empty() {
            continue;
        }
        let color = stamping.color();
        // One band per run: along the upper bounds, back along the lower ones.
        chart
            .draw_series(mine.iter().filter(|r| r.len() > 1).map(|r| {
                let upper = r.iter().map(|p| (x_of(p.host), y_of(p.hi)));
                let lower = r.iter().rev().map(|p| (x_of(p.host), y_of(p.lo)));
                Polygon::new(
                    upper.chain(lower).collect::<Vec<_>>(),
                    color.mix(BAND_OPACITY).filled(),
                )
            }))
            .map_err(draw_err)?;
        chart
            .draw_series(mine.iter().flat_map(|r| r.iter()).map(|p| {
                PathElement::new(
                    vec![(x_of(p.host), y_of(p.lo)), (x_of(p.host), y_of(p.hi))],
                    color.stroke_width(2),
                )
            }))
            .map_err(draw_err)?
            .label(stamping.label())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    chart
        .draw_series(runs.iter().map(|r| {
            PathElement::new(
                r.iter()
                    .map(|p| (x_of(p.host), y_of(p.offset)))
                    .collect::<Vec<_>>(),
                ESTIMATE.stroke_width(1),
            )
        }))
        .map_err(draw_err)?
        .label("offset estimate")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], ESTIMATE.stroke_width(1)));
    if let Some(t) = truth {
        chart
            .draw_series(DashedLineSeries::new(
                [(x_ends.0, t), (x_ends.1, t)],
                8,
                5,
                TRUTH.stroke_width(2),
            ))
            .map_err(draw_err)?
            .label("true offset (--truth)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], TRUTH.stroke_width(2)));
    }
    // The first segment of a vCPU always starts an estimate: only later breaks are news.
    let breaks: Vec<f64> = series
        .points
        .iter()
        .skip(1)
        .filter(|p| p.is_break)
        .map(|p| x_of(p.host_first))
        .collect();
    if !breaks.is_empty() {
        chart
            .draw_series(
                breaks
                    .iter()
                    .map(|&x| PathElement::new(vec![(x, y_lo), (x, y_hi)], BREAK.stroke_width(2))),
            )
            .map_err(draw_err)?
            .label("segment break")
            .legend(|(x, y)| PathElement::new(vec![(x, y - 5), (x, y + 5)], BREAK.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(draw_err)?;
    Ok(())
}

/// What [`plot_sync_file`] drew.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlotSummary {
    /// Panels (vCPUs).
    pub vcpus: usize,
    /// Segments drawn.
    pub segments: usize,
    /// Bytes the reader cut from an incomplete last line (a writer still appending).
    pub cut_bytes: u64,
}

/// Reads the sync file at `sync` and writes its plot to `out` (atomically), with a known
/// true offset `truth` if given.
///
/// # Errors
/// [`PlotError`].
pub fn plot_sync_file(
    sync: &Path,
    out: &Path,
    truth: Option<i64>,
) -> Result<PlotSummary, PlotError> {
    let file = SyncFile::read(sync)?;
    let mut data = PlotData::from_sync_file(&file)?;
    if let Some(t) = truth {
        data.set_truth(t);
    }
    let svg = render_svg(&data)?;
    write_atomically(out, |w| w.write_all(svg.as_bytes())).map_err(|source| PlotError::Write {
        path: out.to_owned(),
        source,
    })?;
    Ok(PlotSummary {
        vcpus: data.vcpus.len(),
        segments: file.segments.len(),
        cut_bytes: file.cut.map_or(0, |c| c.bytes),
    })
}

#[cfg(test)]
mod tests {
    //! The SVG is parsed back (roxmltree) and its elements are checked against the data: which
    //! series exist, in which colour, with how many points, and that they sit where the data
    //! says relative to each other. No pixel comparisons.

    use super::*;

    /// The `#RRGGBB` plotters writes for `c`.
    fn hex(c: RGBColor) -> String {
        format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
    }

    /// One drawn element of a panel, before its legend.
    #[derive(Debug)]
    struct Shape {
        kind: &'static str,
        color: String,
        points: Vec<(f64, f64)>,
    }

    /// The shapes of each panel in document order, legend entries left out (everything after
    /// a panel's translucent white legend background belongs to the legend), and the texts.
    fn parse(svg: &str) -> (Vec<Vec<Shape>>, Vec<String>) {
        let doc = roxmltree::Document::parse(svg).expect("well-formed SVG");
        let mut panels: Vec<Vec<Shape>> = Vec::new();
        let mut texts = Vec::new();
        let mut in_legend = true;
        for node in doc.descendants().filter(roxmltree::Node::is_element) {
            let attr = |n: &str| node.attribute(n).unwrap_or("").to_owned();
            let points = || {
                attr("points")
                    .split_whitespace()
                    .map(|p| {
                        let (x, y) = p.split_once(',').expect("x,y");
                        (x.parse().expect("x"), y.parse().expect("y"))
                    })
                    .collect::<Vec<(f64, f64)>>()
            };
            match node.tag_name().name() {
                "text" => {
                    let t = node.text().unwrap_or("").trim().to_owned();
                    if t.starts_with("vCPU ") {
                        // A caption starts the next panel.
                        panels.push(Vec::new());
                        in_legend = false;
                    }
                    texts.push(t);
                }
                "rect" if attr("fill") == "#FFFFFF" && attr("opacity") == "0.85" => {
                    in_legend = true;
                }
                "polyline" if !in_legend => panels.last_mut().expect("caption first").push(Shape {
                    kind: "polyline",
                    color: attr("stroke"),
                    points: points(),
                }),
                "polygon" if !in_legend => panels.last_mut().expect("caption first").push(Shape {
                    kind: "polygon",
                    color: attr("fill"),
                    points: points(),
                }),
                _ => {}
            }
        }
        (panels, texts)
    }

    fn of<'a>(shapes: &'a [Shape], kind: &str, color: RGBColor) -> Vec<&'a Shape> {
        shapes
            .iter()
            .filter(|s| s.kind == kind && s.color == hex(color))
            .collect()
    }

    fn point(
        host: i128,
        offset: i128,
        half: i128,
        stamping: Stamping,
        is_break: bool,
    ) -> PlotPoint {
        PlotPoint {
            host,
            host_first: host - 1_000_000,
            offset,
            lo: offset - half,
            hi: offset + half,
            stamping,
            is_break,
        }
    }

    /// vCPU 0: four in-process rounds, a break, then three exit-anchored ones; vCPU 1: three
    /// exit-anchored rounds.
    fn mixed() -> PlotData {
        let ip = Stamping::InProcess;
        let ex = Stamping::ExitAnchored;
        let mut v0: Vec<PlotPoint> = (0..4)
            .map(|i| point(i * 50_000_000, 1000 * i, 2_000_000, ip, false))
            .collect();
        v0.push(point(200_000_000, 700_000, 15_000, ex, true));
        v0.extend((5..7).map(|i| point(i * 50_000_000, 700_000 + 100 * i, 15_000, ex, false)));
        let v1 = (0..3)
            .map(|i| point(10_000_000 + i * 60_000_000, -50 * i, 16_000, ex, false))
            .collect();
        PlotData {
            origin: 1_000_000_000,
            truth: None,
            vcpus: vec![
                VcpuSeries {
                    vcpu: 0,
                    reference: 5,
                    points: v0,
                },
                VcpuSeries {
                    vcpu: 1,
                    reference: -7,
                    points: v1,
                },
            ],
        }
    }

    #[test]
    fn every_series_is_drawn_in_its_colour_with_one_element_per_segment() {
        let data = mixed();
        let (panels, texts) = parse(&render_svg(&data).unwrap());
        assert_eq!(panels.len(), 2, "one panel per vCPU");
        assert!(
            texts
                .iter()
                .any(|t| t.starts_with("vCPU 0:") && t.contains("relative to 5 ticks"))
        );
        assert!(
            texts
                .iter()
                .any(|t| t.starts_with("vCPU 1:") && t.contains("relative to -7 ticks"))
        );
        assert!(texts.iter().any(|t| t.contains("since 1000000000")));
        // Legends name what each colour means.
        for label in [
            "guaranteed interval, in-process",
            "guaranteed interval, exit-anchored",
            "offset estimate",
            "segment break",
        ] {
            assert!(
                texts.iter().any(|t| t == label),
                "legend {label:?} in {texts:?}"
            );
        }

        let p0 = &panels[0];
        assert_eq!(
            of(p0, "polyline", IN_PROCESS).len(),
            4,
            "a bar per in-process round"
        );
        assert_eq!(
            of(p0, "polyline", ANCHORED).len(),
            3,
            "a bar per anchored round"
        );
        let bands_ip = of(p0, "polygon", IN_PROCESS);
        let bands_ex = of(p0, "polygon", ANCHORED);
        assert_eq!((bands_ip.len(), bands_ex.len()), (1, 1), "one band per run");
        assert_eq!(bands_ip[0].points.len(), 8, "4 upper + 4 lower corners");
        assert_eq!(bands_ex[0].points.len(), 6);
        let estimates = of(p0, "polyline", ESTIMATE);
        let lens: Vec<usize> = estimates.iter().map(|e| e.points.len()).collect();
        assert_eq!(lens, [4, 3], "the estimate is broken at the break");
        let breaks = of(p0, "polyline", BREAK);
        assert_eq!(breaks.len(), 1, "one break after the first segment");

        let p1 = &panels[1];
        assert_eq!(of(p1, "polyline", ANCHORED).len(), 3);
        assert!(of(p1, "polyline", IN_PROCESS).is_empty());
        assert!(
            of(p1, "polyline", BREAK).is_empty(),
            "a vCPU's first segment is no break"
        );
        assert_eq!(of(p1, "polyline", ESTIMATE).len(), 1);
    }

    #[test]
    fn elements_sit_where_the_data_puts_them() {
        let (panels, _) = parse(&render_svg(&mixed()).unwrap());
        let p0 = &panels[0];
        let bars: Vec<&Shape> = of(p0, "polyline", IN_PROCESS)
            .into_iter()
            .chain(of(p0, "polyline", ANCHORED))
            .collect();
        let estimate: Vec<(f64, f64)> = of(p0, "polyline", ESTIMATE)
            .iter()
            .flat_map(|e| e.points.iter().copied())
            .collect();
        assert_eq!(bars.len(), estimate.len());
        for (bar, &(ex, ey)) in bars.iter().zip(&estimate) {
            let [(x0, y0), (x1, y1)] = bar.points[..] else {
                panic!("a bar has two points: {bar:?}");
            };
            assert_eq!(x0, x1, "bars are vertical");
            assert_eq!(x0, ex, "the estimate passes through its bar's x");
            assert!(
                y0.min(y1) <= ey && ey <= y0.max(y1),
                "the estimate lies inside its bar"
            );
        }
        // Host time grows to the right.
        assert!(estimate.windows(2).all(|w| w[0].0 < w[1].0));
        // A 4M-tick interval is drawn taller than a 30k-tick one.
        let height = |s: &Shape| (s.points[0].1 - s.points[1].1).abs();
        assert!(
            height(of(p0, "polyline", IN_PROCESS)[0])
                > 10.0 * height(of(p0, "polyline", ANCHORED)[0])
        );
        // The break is drawn at the first probe of the segment that starts anew: after the
        // last in-process anchor, before the first anchored one.
        let bx = of(p0, "polyline", BREAK)[0].points[0].0;
        assert!(
            estimate[3].0 < bx && bx < estimate[4].0,
            "{bx} between {:?}",
            &estimate[3..5]
        );
        // x is shared between panels: vCPU 1's first anchor (host 10M) lies right of vCPU 0's
        // first (host 0).
        let first1 = of(&panels[1], "polyline", ESTIMATE)[0].points[0].0;
        assert!(first1 > estimate[0].0);
    }

    #[test]
    fn sync_file_segments_group_by_vcpu_relative_to_origin_and_first_offset() {
        use crate::syncfile::SyncHeader;
        let header = SyncHeader {
            schema: crate::syncfile::SYNC_SCHEMA,
            tool: "t".into(),
            host_clock: "x86-tsc".into(),
            created_unix_s: 0,
            source: String::new(),
        };
        let seg = |vcpu: u32, round: u64, host: u64, offset: i64, is_break: bool| SyncSegment {
            vcpu,
            round,
            guest_start: 0,
            host_anchor: host,
            guest_anchor: host.checked_add_signed(offset).unwrap(),
            offset,
            offset_lo: offset - 10,
            offset_hi: offset + 20,
            drift_ppb: 0,
            drift_ppb_lo: None,
            drift_ppb_hi: None,
            model: crate::syncfile::OffsetModel::Drift,
            probes: 8,
            rtt_min_ticks: 1,
            host_first: host - 100,
            host_last: host + 100,
            is_break,
            anchor: if vcpu == 0 {
                AnchorKind::KvmPioUart
            } else {
                AnchorKind::InProcess
            },
        };
        let segs = [
            seg(1, 0, 5_000, -3, false),
            seg(0, 0, 6_000, 1_000_000_000_000, false),
            seg(1, 1, 7_000, -1, true),
        ];
        let mut text = format!(
            "{}\n",
            serde_json::to_string(&serde_json::json!({
                "type": "header", "schema": header.schema, "tool": header.tool,
                "host_clock": header.host_clock, "created_unix_s": 0, "source": ""
            }))
            .unwrap()
        );
        for s in &segs {
            let mut v = serde_json::to_value(s).unwrap();
            v["type"] = "segment".into();
            text.push_str(&serde_json::to_string(&v).unwrap());
            text.push('\n');
        }
        let file = SyncFile::parse(text.as_bytes()).unwrap();
        let data = PlotData::from_sync_file(&file).unwrap();
        assert_eq!(data.origin, 4_900, "the earliest first probe");
        let vcpus: Vec<u32> = data.vcpus.iter().map(|v| v.vcpu).collect();
        assert_eq!(vcpus, [0, 1]);
        let v1 = &data.vcpus[1];
        assert_eq!(v1.reference, -3);
        assert_eq!(
            v1.points
                .iter()
                .map(|p| (p.host, p.offset, p.lo, p.hi, p.is_break))
                .collect::<Vec<_>>(),
            [(100, 0, -10, 20, false), (2_100, 2, -8, 22, true)]
        );
        assert_eq!(data.vcpus[0].points[0].offset, 0);
        assert!(v1.points.iter().all(|p| p.stamping == Stamping::InProcess));
        assert_eq!(data.vcpus[0].points[0].stamping, Stamping::ExitAnchored);
        // Files written before the anchor field existed come from in-process probing.
        let old = text.replace("\"anchor\":\"kvm-pio-uart\",", "");
        assert_ne!(old, text);
        let old = PlotData::from_sync_file(&SyncFile::parse(old.as_bytes()).unwrap()).unwrap();
        assert_eq!(old.vcpus[0].points[0].stamping, Stamping::InProcess);

        let dir = tempfile::tempdir().unwrap();
        let sync = dir.path().join("s.jsonl");
        let out = dir.path().join("s.svg");
        std::fs::write(&sync, &text).unwrap();
        let summary = plot_sync_file(&sync, &out, None).unwrap();
        assert_eq!(
            (summary.vcpus, summary.segments, summary.cut_bytes),
            (2, 3, 0)
        );
        let (panels, _) = parse(&std::fs::read_to_string(&out).unwrap());
        assert_eq!(panels.len(), 2);
    }

    #[test]
    fn a_known_truth_is_a_dashed_line_inside_the_intervals_that_hold_it() {
        let mut data = mixed();
        // vCPU 0's reference is 5: a truth of 5 is y = 0, inside every in-process interval
        // (centred near 0, 2M ticks either side) and outside the anchored ones (near 700k).
        data.set_truth(5);
        assert_eq!(data.vcpus[0].points[0].offset, 0, "the same reference");
        assert_eq!(
            data.vcpus[1].reference, 5,
            "vCPU 1 now relative to the truth too"
        );
        assert_eq!(
            data.vcpus[1].points[0].offset, -12,
            "its offset -7 is 12 below 5"
        );
        let (panels, texts) = parse(&render_svg(&data).unwrap());
        assert!(texts.iter().any(|t| t == "true offset (--truth)"));
        let dashes = of(&panels[0], "polyline", TRUTH);
        assert!(dashes.len() > 10, "a dashed line is many short pieces");
        let y = dashes[0].points[0].1;
        assert!(
            dashes
                .iter()
                .flat_map(|d| &d.points)
                .all(|p| (p.1 - y).abs() < 0.5),
            "horizontal"
        );
        let spans = |c| {
            of(&panels[0], "polyline", c)
                .iter()
                .map(|b| {
                    let (a, b) = (b.points[0].1, b.points[1].1);
                    (a.min(b), a.max(b))
                })
                .collect::<Vec<_>>()
        };
        assert!(spans(IN_PROCESS).iter().all(|&(lo, hi)| lo <= y && y <= hi));
        assert!(spans(ANCHORED).iter().all(|&(lo, hi)| y > hi || y < lo));
        assert!(
            of(&panels[1], "polyline", TRUTH).len() > 10,
            "on every panel"
        );
        // Without a truth, no such line.
        let (panels, _) = parse(&render_svg(&mixed()).unwrap());
        assert!(of(&panels[0], "polyline", TRUTH).is_empty());
    }

    #[test]
    fn a_file_without_segments_is_an_error_not_an_empty_picture() {
        let text = "{\"type\":\"header\",\"schema\":1,\"tool\":\"t\",\"host_clock\":\"x86-tsc\",\"created_unix_s\":0}\n";
        let file = SyncFile::parse(text.as_bytes()).unwrap();
        assert!(matches!(
            PlotData::from_sync_file(&file),
            Err(PlotError::Empty)
        ));
    }

    #[test]
    fn one_segment_draws_a_bar_and_no_band() {
        let data = PlotData {
            origin: 0,
            truth: None,
            vcpus: vec![VcpuSeries {
                vcpu: 0,
                reference: 0,
                points: vec![point(0, 0, 10, Stamping::ExitAnchored, false)],
            }],
        };
        let (panels, _) = parse(&render_svg(&data).unwrap());
        assert_eq!(of(&panels[0], "polyline", ANCHORED).len(), 1);
        assert!(of(&panels[0], "polygon", ANCHORED).is_empty());
    }
}
