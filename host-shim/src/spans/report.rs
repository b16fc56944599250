//! `vmtsync spans`: a recording's spans, summed up for a reader: the longest spans with the
//! guaranteed interval of each duration, the spans open when the recording ended (where a
//! hung guest is), the last spans closed before that, and every span as JSON Lines.
//!
//! Memory stays bounded whatever the recording's length: the longest spans and the picture's
//! spans are kept in bounded sets, the rest only counted (and streamed to `--out`).

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::Write;

use serde_json::json;

use super::{Span, SpanConfig, SpanCounts, SpanEnd, SpanKind, SpanState, SpanStep, SpanTracker};
use crate::formats::{Bound, ExportError, ExportEvent};

/// The most spans kept for a picture; beyond it the shortest are let go (a span shorter than
/// a pixel does not show anyway).
pub const PICTURE_MAX: usize = 50_000;

/// How much the report keeps.
#[derive(Clone, Copy, Debug)]
pub struct ReportOptions {
    /// The longest closed spans listed.
    pub top: usize,
    /// The last closed spans listed before the end.
    pub last: usize,
}

impl Default for ReportOptions {
    fn default() -> Self {
        Self { top: 10, last: 5 }
    }
}

/// What a recording's spans add up to.
#[derive(Debug, Default)]
pub struct SpanReport {
    /// The tracker's counts.
    pub counts: SpanCounts,
    /// Closed spans per kind (phases, functions).
    pub closed_by_kind: [u64; 2],
    /// Host TSC of the recording's first and last records.
    pub first_tsc: Option<u64>,
    /// See `first_tsc`.
    pub last_tsc: Option<u64>,
    /// The longest closed spans, longest first.
    pub top: Vec<Span>,
    /// The last closed spans, oldest first.
    pub last_closed: Vec<Span>,
    /// Spans open when the recording ended, by vCPU and kind, outermost first.
    pub open: Vec<Span>,
    /// The last abandoned and orphan spans (at most `top` of them), oldest first.
    pub one_ended: Vec<Span>,
    /// Spans for a picture: every open one and the longest others, at most [`PICTURE_MAX`].
    pub picture: Vec<Span>,
    /// Function symbols known.
    pub symbols: usize,
    /// The relocations in force at the end (the guest's records and `--reloc`).
    pub relocs: Vec<super::Reloc>,
    /// Ordinary (non-span) events met.
    pub other_events: u64,
}

/// Reads `events` (each with its guest boot: 0 unless the recording followed resets), pairs their span records with `cfg`'s names, writes every span as a JSON
/// line to `sink` (if any) and sums them up.
///
/// # Errors
/// The input's [`ExportError`], or [`ExportError::Write`] naming `sink_name` for the sink.
pub fn collect(
    events: impl Iterator<Item = Result<(ExportEvent, u32), ExportError>>,
    cfg: &SpanConfig,
    opts: ReportOptions,
    mut sink: Option<(&mut dyn Write, &std::path::Path)>,
) -> Result<SpanReport, ExportError> {
    let mut tracker = SpanTracker::new(cfg);
    let mut r = SpanReport {
        symbols: cfg.symbols.as_ref().map_or(0, |s| s.len()),
        ..SpanReport::default()
    };
    let mut last: VecDeque<Span> = VecDeque::new();
    let mut one_ended: VecDeque<Span> = VecDeque::new();
    let mut steps = Vec::new();
    for e in events {
        let (e, boot) = e?;
        r.first_tsc = Some(r.first_tsc.map_or(e.host_tsc, |t| t.min(e.host_tsc)));
        r.last_tsc = Some(r.last_tsc.map_or(e.host_tsc, |t| t.max(e.host_tsc)));
        steps.clear();
        if !tracker.push_in_boot(&e, boot, &mut steps) {
            r.other_events += 1;
            continue;
        }
        for s in steps.drain(..) {
            let span = match s {
                SpanStep::Enter(_) => continue,
                SpanStep::Exit(s) => {
                    r.closed_by_kind[usize::from(s.kind == SpanKind::Function)] += 1;
                    keep_longest(&mut r.top, &s, opts.top);
                    push_bounded(&mut last, s.clone(), opts.last);
                    s
                }
                SpanStep::Abandoned(s) | SpanStep::Orphan(s) => {
                    push_bounded(&mut one_ended, s.clone(), opts.top);
                    s
                }
            };
            if let Some((w, path)) = sink.as_mut() {
                write_line(&mut **w, path, &span)?;
            }
            keep_for_picture(&mut r.picture, span);
        }
    }
    r.counts = tracker.counts();
    r.relocs = tracker.namer().relocs().to_vec();
    r.open = tracker.finish();
    for s in &r.open {
        if let Some((w, path)) = sink.as_mut() {
            write_line(&mut **w, path, s)?;
        }
    }
    r.picture.extend(r.open.iter().cloned());
    r.top.sort_by_key(|s| std::cmp::Reverse(s.ticks()));
    r.top.truncate(opts.top);
    r.last_closed = last.into();
    r.one_ended = one_ended.into();
    Ok(r)
}

fn push_bounded(q: &mut VecDeque<Span>, s: Span, max: usize) {
    if max == 0 {
        return;
    }
    if q.len() == max {
        q.pop_front();
    }
    q.push_back(s);
}

/// Keeps the `n` longest closed spans (sorting only when the set has doubled).
fn keep_longest(top: &mut Vec<Span>, s: &Span, n: usize) {
    if n == 0 {
        return;
    }
    top.push(s.clone());
    if top.len() >= 2 * n.max(8) {
        top.sort_by_key(|s| std::cmp::Reverse(s.ticks()));
        top.truncate(n);
    }
}

fn keep_for_picture(p: &mut Vec<Span>, s: Span) {
    p.push(s);
    if p.len() > PICTURE_MAX {
        // One-ended spans first (they are few and the point of the picture), then longest.
        p.sort_by_key(|s| (s.state() == SpanState::Closed, std::cmp::Reverse(s.ticks())));
        p.truncate(PICTURE_MAX / 2);
    }
}

fn end_json(e: Option<SpanEnd>) -> serde_json::Value {
    e.map_or(serde_json::Value::Null, |e| {
        json!({
            "host_tsc": e.host_tsc,
            "lo": e.bound.map(|b| b.lo),
            "hi": e.bound.map(|b| b.hi),
            "guest_tsc": e.guest_tsc,
        })
    })
}

/// One span as a JSON object (the `--out` line).
#[must_use]
pub fn span_json(s: &Span) -> serde_json::Value {
    json!({
        "vcpu": s.vcpu,
        "kind": s.kind.as_str(),
        "name": s.name,
        "addr": s.addr,
        "depth": s.depth,
        "state": match s.state() {
            SpanState::Closed => "closed",
            SpanState::Open => "open",
            SpanState::Orphan => "orphan",
        },
        "begin": end_json(s.begin),
        "end": end_json(s.end),
    })
}

fn write_line(w: &mut dyn Write, path: &std::path::Path, s: &Span) -> Result<(), ExportError> {
    writeln!(w, "{}", span_json(s)).map_err(|source| ExportError::Write {
        path: path.to_owned(),
        source,
    })
}

/// Ticks as a duration in the unit that suits it, to the nanosecond below a microsecond
/// and to the microsecond above.
#[must_use]
pub fn duration(ticks: u64, tsc_hz: u64) -> String {
    let ns = u128::from(ticks) * 1_000_000_000 / u128::from(tsc_hz.max(1));
    in_unit(ns, unit_of(ns))
}

/// The unit (ns per unit, name) a duration of `ns` is shown in.
fn unit_of(ns: u128) -> (u128, &'static str) {
    match ns {
        1_000_000_000.. => (1_000_000_000, "s"),
        1_000_000.. => (1_000_000, "ms"),
        1_000.. => (1_000, "µs"),
        _ => (1, "ns"),
    }
}

/// `ns` in `unit`, to the microsecond (the nanosecond for `ns`).
fn in_unit(ns: u128, (per, name): (u128, &str)) -> String {
    let decimals = match per {
        1_000_000_000 => 6,
        1_000_000 => 3,
        1_000 => 3,
        _ => 0,
    };
    if decimals == 0 {
        return format!("{ns} {name}");
    }
    let scale = 10u128.pow(decimals);
    let v = ns * scale / per;
    format!(
        "{}.{:0w$} {name}",
        v / scale,
        v % scale,
        w = usize::try_from(decimals).unwrap_or(3)
    )
}

/// A duration and its guaranteed interval in the duration's unit: `2.333253 s (guaranteed
/// 2.333180 .. 2.333330 s)`.
fn duration_with_bound(ticks: u64, bound: Option<Bound>, tsc_hz: u64) -> String {
    let ns = |t: u64| u128::from(t) * 1_000_000_000 / u128::from(tsc_hz.max(1));
    let unit = unit_of(ns(ticks));
    let d = in_unit(ns(ticks), unit);
    match bound {
        Some(b) => {
            let lo = in_unit(ns(b.lo), unit);
            let lo = lo.strip_suffix(unit.1).unwrap_or(&lo).trim_end();
            format!("{d} (guaranteed {lo} .. {})", in_unit(ns(b.hi), unit))
        }
        None => d,
    }
}

impl SpanReport {
    /// Seconds from the recording's first record to host tick `t`.
    fn at(&self, t: u64, tsc_hz: u64) -> String {
        let d = t.saturating_sub(self.first_tsc.unwrap_or(t));
        #[allow(clippy::cast_precision_loss)]
        let s = d as f64 / tsc_hz.max(1) as f64;
        format!("{s:.6} s")
    }

    fn line(&self, s: &Span, tsc_hz: u64) -> String {
        let what = format!(
            "vCPU {} {:<8} {}{}",
            s.vcpu,
            s.kind.as_str(),
            "  ".repeat(usize::try_from(s.depth.min(16)).unwrap_or(0)),
            s.name
        );
        match (s.begin, s.end) {
            (Some(b), Some(e)) => format!(
                "{:>12}  at {}  {what}",
                duration_with_bound(
                    e.host_tsc.saturating_sub(b.host_tsc),
                    s.ticks_bound(),
                    tsc_hz
                ),
                self.at(b.host_tsc, tsc_hz)
            ),
            (Some(b), None) => format!(
                "{:>12}  at {}  {what}  (open: exit not seen)",
                "open",
                self.at(b.host_tsc, tsc_hz)
            ),
            (None, Some(e)) => format!(
                "{:>12}  at {}  {what}  (exit; entry not seen)",
                "open",
                self.at(e.host_tsc, tsc_hz)
            ),
            (None, None) => what,
        }
    }

    /// The report as text; times from the first record, on a host TSC of `tsc_hz`.
    #[must_use]
    pub fn render(&self, tsc_hz: u64) -> String {
        let c = &self.counts;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "spans: {} closed ({} phases, {} functions), {} open at the end, {} abandoned \
             (exit never seen), {} exits without their entry; {} other events",
            c.closed,
            self.closed_by_kind[0],
            self.closed_by_kind[1],
            self.open.len(),
            c.abandoned,
            c.orphans,
            self.other_events
        );
        let names = if self.symbols > 0 {
            format!("{} function symbols", self.symbols)
        } else {
            "no symbols (functions named by address; give --symbols IMAGE)".to_owned()
        };
        let _ = writeln!(o, "names: {names}");
        for r in &self.relocs {
            let _ = writeln!(o, "relocation: code linked at {r}");
        }
        if !self.top.is_empty() {
            let _ = writeln!(
                o,
                "\nlongest {} spans (duration, its guaranteed interval, start):",
                self.top.len()
            );
            for s in &self.top {
                let _ = writeln!(o, "  {}", self.line(s, tsc_hz));
            }
        }
        if !self.open.is_empty() {
            let _ = writeln!(
                o,
                "\nopen when the recording ended (the guest was inside these), outermost first:"
            );
            for s in &self.open {
                let _ = writeln!(o, "  {}", self.line(s, tsc_hz));
            }
        }
        if !self.last_closed.is_empty() {
            let _ = writeln!(o, "\nlast spans closed before the end:");
            for s in &self.last_closed {
                let _ = writeln!(o, "  {}", self.line(s, tsc_hz));
            }
        }
        if !self.one_ended.is_empty() {
            let _ = writeln!(o, "\nlast spans with one end only:");
            for s in &self.one_ended {
                let _ = writeln!(o, "  {}", self.line(s, tsc_hz));
            }
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::{ReportOptions, collect, duration};
    use crate::formats::{Bound, ExportEvent, Payload};
    use crate::spans::SpanConfig;

    fn ev(
        id: u16,
        payload: &[u8],
        t: u64,
    ) -> Result<(ExportEvent, u32), crate::formats::ExportError> {
        Ok((
            ExportEvent {
                vcpu: 0,
                id,
                guest_tsc: Some(t),
                host_tsc: t,
                bound: Some(Bound {
                    lo: t - 2,
                    hi: t + 3,
                }),
                payload: Payload::new(payload).unwrap(),
            },
            0,
        ))
    }

    #[test]
    fn the_report_lists_the_longest_the_open_and_every_span_once() {
        let events = vec![
            ev(0xFF01, b"post", 100),
            ev(0xFF01, b"init", 200),
            ev(0xFF02, b"init", 1_200),
            ev(5, b"x", 1_300),
            ev(0xFF01, b"devices", 1_400),
            ev(0xFF01, b"usb", 1_500),
            ev(0xFF02, b"usb", 1_600),
            ev(0xFF01, b"hang", 1_700),
        ];
        let mut out = Vec::new();
        let path = std::path::Path::new("spans.jsonl");
        let r = collect(
            events.into_iter(),
            &SpanConfig::default(),
            ReportOptions { top: 1, last: 5 },
            Some((&mut out, path)),
        )
        .unwrap();
        assert_eq!(r.top.len(), 1);
        assert_eq!(r.top[0].name, "init");
        assert_eq!(
            r.top[0].ticks_bound().map(|b| (b.lo, b.hi)),
            Some((995, 1_005))
        );
        let open: Vec<_> = r.open.iter().map(|s| (s.name.as_str(), s.depth)).collect();
        assert_eq!(open, [("post", 0), ("devices", 1), ("hang", 2)]);
        assert_eq!(r.other_events, 1);
        let lines: Vec<serde_json::Value> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 5, "2 closed and 3 open, each once");
        assert_eq!(lines[0]["name"], "init");
        assert_eq!(lines[0]["begin"]["lo"], 198);
        assert_eq!(lines[4]["state"], "open");
        assert!(lines[4]["end"].is_null());
        let text = r.render(1_000_000_000);
        assert!(text.contains("open when the recording ended"), "{text}");
        assert!(text.contains("hang  (open: exit not seen)"), "{text}");
        assert!(
            text.contains("1.000 µs (guaranteed 0.995 .. 1.005 µs)"),
            "{text}"
        );
    }

    #[test]
    fn durations_pick_their_unit() {
        assert_eq!(duration(1_500, 1_000_000_000), "1.500 µs");
        assert_eq!(duration(3_000_000_000, 1_000_000_000), "3.000000 s");
        assert_eq!(duration(2_500_000, 1_000_000_000), "2.500 ms");
        assert_eq!(
            super::duration_with_bound(
                2_333_253_000,
                Some(Bound {
                    lo: 2_333_180_400,
                    hi: 2_333_330_000
                }),
                1_000_000_000
            ),
            "2.333253 s (guaranteed 2.333180 .. 2.333330 s)"
        );
        assert_eq!(duration(12, 1_000_000_000), "12 ns");
    }
}
