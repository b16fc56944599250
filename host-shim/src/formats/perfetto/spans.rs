//! A guest's spans in the Perfetto trace: nested slices on two child tracks of each vCPU's
//! track, `vCPU N phases` and `vCPU N functions` (each kind is its own stack, so the two need
//! not nest inside each other) (docs/perfetto.md, "Spans").
//!
//! A closed span is a `TYPE_SLICE_BEGIN` at its entry and a `TYPE_SLICE_END` at its exit, both
//! written when its exit is read (the trace processor sorts by time). Its arguments: `depth`
//! (its place in the guest's own stack), `kind`, `addr` for a function, and each end's host
//! TSC, guest TSC and guaranteed interval (`host_tsc`, `guest_tsc`, `before_ns`, `after_ns`
//! for the entry, `end_*` for the exit).
//!
//! The trace processor nests slices by a stack per track and closes the top one at an END, so
//! a slice must not stay open below a closed one. Hence what has no exit:
//! - a frame still open when the recording ends: a BEGIN with no END, written at the end (the
//!   trace processor shows `dur = -1`); its descendants all closed earlier, inside it;
//! - an abandoned frame (an outer frame's exit came first) and an exit whose entry was not
//!   seen: an instant, `NAME (exit not seen)` at the entry or `NAME (entry not seen)` at the
//!   exit, with `open = true`. Never a duration.
//!
//! So the trace processor's `depth` of a span inside an abandoned frame is one less per
//! abandoned frame around it than the guest's; the `depth` argument is the guest's (the one
//! trace-cmd's graph indents by).

use std::collections::BTreeSet;

use super::proto::{
    CLOCK_BOOTTIME, DebugAnnotation, TYPE_INSTANT, TYPE_SLICE_BEGIN, TYPE_SLICE_END, TracePacket,
    TrackDescriptor, TrackEvent,
};
use super::{MAX_VCPUS, PerfettoError, PerfettoWriter, process_uuid, vcpu_sequence, vcpu_uuid};
use crate::formats::ExportEvent;
use crate::spans::{Span, SpanConfig, SpanEnd, SpanKind, SpanStep, SpanTracker};

/// The span state a writer keeps.
#[derive(Debug, Default)]
pub(super) struct Spans {
    tracker: SpanTracker,
    steps: Vec<SpanStep>,
    /// (vCPU index, kind) whose track is described.
    described: BTreeSet<(usize, SpanKind)>,
    /// Slices and instants written.
    pub(super) written: u64,
}

impl Spans {
    pub(super) fn new(cfg: &SpanConfig) -> Self {
        Self {
            tracker: SpanTracker::new(cfg),
            ..Self::default()
        }
    }
}

/// The uuid of the `index`-th vCPU's track of `kind` (after every vCPU track of the machine).
fn span_uuid(machine_id: u32, index: usize, kind: SpanKind) -> u64 {
    let k = match kind {
        SpanKind::Phase => 0,
        SpanKind::Function => 1,
    };
    process_uuid(machine_id) + 1 + MAX_VCPUS as u64 + 2 * index as u64 + k
}

/// The argument `name` (not interned) with a value.
fn arg(name: &str) -> DebugAnnotation {
    DebugAnnotation {
        name: Some(name.to_owned()),
        ..Default::default()
    }
}

fn uint(name: &str, v: u64) -> DebugAnnotation {
    DebugAnnotation {
        uint_value: Some(v),
        ..arg(name)
    }
}

fn int(name: &str, v: i64) -> DebugAnnotation {
    DebugAnnotation {
        int_value: Some(v),
        ..arg(name)
    }
}

fn string(name: &str, v: &str) -> DebugAnnotation {
    DebugAnnotation {
        string_value: Some(v.to_owned()),
        ..arg(name)
    }
}

impl PerfettoWriter {
    /// Names functions with `cfg` from now on (call before the first event).
    pub fn set_spans(&mut self, cfg: &SpanConfig) {
        self.spans = Spans::new(cfg);
    }

    /// [`Self::push`] for a recording that followed the guest across resets: `boot` numbers
    /// its boots, and a new one abandons the spans the last one left open.
    ///
    /// # Errors
    /// [`PerfettoError::Io`], [`PerfettoError::TooManyVcpus`].
    pub fn push_in_boot(&mut self, e: &ExportEvent, boot: u32) -> Result<(), PerfettoError> {
        let mut steps = std::mem::take(&mut self.spans.steps);
        steps.clear();
        let span = self.spans.tracker.push_in_boot(e, boot, &mut steps);
        let r = self.push_event(e);
        if span && r.is_ok() {
            for s in &steps {
                self.write_step(s)?;
            }
        }
        self.spans.steps = steps;
        r
    }

    /// The spans still open: BEGINs with no END.
    pub(super) fn finish_spans(&mut self) -> Result<(), PerfettoError> {
        let tracker = std::mem::take(&mut self.spans.tracker);
        for s in tracker.finish() {
            self.write_span(&s, Shape::OpenSlice)?;
        }
        Ok(())
    }

    fn write_step(&mut self, step: &SpanStep) -> Result<(), PerfettoError> {
        match step {
            // Written at its exit, with both ends.
            SpanStep::Enter(_) => Ok(()),
            SpanStep::Exit(s) => self.write_span(s, Shape::Slice),
            SpanStep::Abandoned(s) => self.write_span(s, Shape::Instant("exit not seen")),
            SpanStep::Orphan(s) => self.write_span(s, Shape::Instant("entry not seen")),
        }
    }

    /// BOOTTIME of `end` and its guaranteed interval as distances from it.
    fn place(&mut self, end: &SpanEnd) -> Option<(u64, Option<(i64, i64)>)> {
        let clock = &self.opts.clock;
        let hint = &mut self.pair_hint;
        let ts = clock
            .boottime_ns_near(end.host_tsc, hint)
            .filter(|&t| i64::try_from(t).is_ok())?;
        let interval = end.bound.and_then(|b| {
            let (lo, hi) = clock.widened_ns(b.lo, b.hi, hint)?;
            let sat = |d: i128| i64::try_from(d).unwrap_or(if d < 0 { i64::MIN } else { i64::MAX });
            Some((
                sat(i128::from(ts) - i128::from(lo)),
                sat(i128::from(hi) - i128::from(ts)),
            ))
        });
        Some((ts, interval))
    }

    fn write_span(&mut self, s: &Span, shape: Shape) -> Result<(), PerfettoError> {
        let begin = match s.begin.as_ref() {
            Some(b) => self.place(b),
            None => None,
        };
        let end = match s.end.as_ref() {
            Some(e) => self.place(e),
            None => None,
        };
        // A slice needs the ends it shows; an orphan's instant is at its exit, everything
        // else starts at its entry. An end outside BOOTTIME's range leaves the span out.
        let ts = match (shape, begin, end) {
            (Shape::Slice, Some((b, _)), Some(_)) | (Shape::OpenSlice, Some((b, _)), _) => b,
            (Shape::Instant(_), Some((b, _)), _) | (Shape::Instant(_), None, Some((b, _))) => b,
            _ => {
                self.summary.unmappable += 1;
                return Ok(());
            }
        };
        let machine_id = self.opts.machine_id;
        // The vCPU's sequence normally exists from its first event; if not, it starts here.
        let index = self.vcpu_index(s.vcpu, ts)?;
        let track = span_uuid(machine_id, index, s.kind);
        if self.spans.described.insert((index, s.kind)) {
            let name = match s.kind {
                SpanKind::Phase => format!("vCPU {} phases", s.vcpu),
                SpanKind::Function => format!("vCPU {} functions", s.vcpu),
            };
            let d = TracePacket {
                trusted_packet_sequence_id: Some(vcpu_sequence(index)),
                machine_id: Some(machine_id),
                track_descriptor: Some(TrackDescriptor {
                    uuid: Some(track),
                    parent_uuid: Some(vcpu_uuid(machine_id, index)),
                    name: Some(name),
                    ..Default::default()
                }),
                ..Default::default()
            };
            self.write_packet(&d)?;
        }
        let mut args = vec![
            uint("depth", u64::from(s.depth)),
            string("kind", s.kind.as_str()),
        ];
        if let Some(a) = s.addr {
            args.push(uint("addr", a));
        }
        for (prefix, end, placed) in [("", s.begin, begin), ("end_", s.end, end)] {
            let Some(e) = end else { continue };
            args.push(uint(&format!("{prefix}host_tsc"), e.host_tsc));
            if let Some(g) = e.guest_tsc {
                args.push(uint(&format!("{prefix}guest_tsc"), g));
            }
            if let Some((_, Some((before, after)))) = placed {
                args.push(int(&format!("{prefix}before_ns"), before));
                args.push(int(&format!("{prefix}after_ns"), after));
            }
        }
        let (kind, name, end_ts) = match shape {
            Shape::Slice => (TYPE_SLICE_BEGIN, s.name.clone(), end.map(|e| e.0)),
            Shape::OpenSlice => {
                args.push(DebugAnnotation {
                    bool_value: Some(true),
                    ..arg("open")
                });
                (TYPE_SLICE_BEGIN, s.name.clone(), None)
            }
            Shape::Instant(why) => {
                args.push(DebugAnnotation {
                    bool_value: Some(true),
                    ..arg("open")
                });
                (TYPE_INSTANT, format!("{} ({why})", s.name), None)
            }
        };
        let packet =
            |ts: u64, kind: i32, name: Option<String>, args: Vec<DebugAnnotation>| TracePacket {
                timestamp: Some(ts),
                timestamp_clock_id: Some(CLOCK_BOOTTIME),
                trusted_packet_sequence_id: Some(vcpu_sequence(index)),
                machine_id: Some(machine_id),
                track_event: Some(TrackEvent {
                    r#type: Some(kind),
                    track_uuid: Some(track),
                    name,
                    debug_annotations: args,
                    ..Default::default()
                }),
                ..Default::default()
            };
        self.write_packet(&packet(ts, kind, Some(name), args))?;
        if let (Shape::Slice, Some(e)) = (shape, end_ts) {
            self.write_packet(&packet(e, TYPE_SLICE_END, None, Vec::new()))?;
        }
        self.spans.written += 1;
        Ok(())
    }
}

/// How a span is written.
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// BEGIN and END.
    Slice,
    /// BEGIN only: open at the end of the recording.
    OpenSlice,
    /// An instant: one end only, for the reason given.
    Instant(&'static str),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::perfetto::PerfettoOptions;
    use crate::formats::perfetto::clock::{BootClock, ClockSnapshot};
    use crate::formats::{Bound, Payload};
    use prost::Message;

    #[derive(Clone, PartialEq, Message)]
    struct Trace {
        #[prost(message, repeated, tag = "1")]
        packet: Vec<TracePacket>,
    }

    fn ev(id: u16, payload: &[u8], t: u64) -> ExportEvent {
        ExportEvent {
            vcpu: 3,
            id,
            guest_tsc: Some(t + 7),
            host_tsc: t,
            bound: Some(Bound {
                lo: t - 2,
                hi: t + 2,
            }),
            payload: Payload::new(payload).unwrap(),
        }
    }

    /// Slices per kind on the vCPU's child tracks; open at the end: BEGIN only; abandoned and
    /// orphan: instants, never an END.
    #[test]
    fn spans_become_slices_and_instants_on_child_tracks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t");
        let s = |tsc, ns| ClockSnapshot {
            tsc,
            boottime_ns: ns,
            resolution: 0,
        };
        let clock = BootClock::new(vec![s(0, 1_000), s(1_000_000, 1_001_000)]).unwrap();
        let mut w = PerfettoWriter::create(
            &path,
            PerfettoOptions {
                machine_id: 1,
                guest_name: "vm".into(),
                clock,
            },
        )
        .unwrap();
        let f = |id, a: u32, t| {
            let mut p = [0u8; 8];
            p[..4].copy_from_slice(&a.to_le_bytes());
            ev(id, &p, t)
        };
        for e in [
            ev(0xFF01, b"boot", 10),
            f(0xFF03, 0x10, 20),
            f(0xFF03, 0x20, 30),
            f(0xFF03, 0x30, 40),
            // Closes 0x20 and abandons 0x30.
            f(0xFF04, 0x20, 50),
            f(0xFF04, 0x99, 60),
            ev(5, b"", 70),
        ] {
            w.push(&e).unwrap();
        }
        let sum = w.finish().unwrap();
        assert_eq!(sum.events, 7);
        let t = Trace::decode(std::fs::read(&path).unwrap().as_slice()).unwrap();
        let tracks: Vec<(u64, String)> = t
            .packet
            .iter()
            .filter_map(|p| {
                let d = p.track_descriptor.as_ref()?;
                Some((d.uuid?, d.name.clone()?))
            })
            .collect();
        let named = |n: &str| tracks.iter().find(|t| t.1 == n).unwrap().0;
        let (phases, functions) = (named("vCPU 3 phases"), named("vCPU 3 functions"));
        let got: Vec<(u64, i32, Option<String>, u64)> = t
            .packet
            .iter()
            .filter_map(|p| {
                let e = p.track_event.as_ref()?;
                let track = e.track_uuid?;
                Some((track, e.r#type?, e.name.clone(), p.timestamp?))
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    functions,
                    TYPE_INSTANT,
                    Some("0x30 (exit not seen)".into()),
                    1_040
                ),
                (functions, TYPE_SLICE_BEGIN, Some("0x20".into()), 1_030),
                (functions, TYPE_SLICE_END, None, 1_050),
                (
                    functions,
                    TYPE_INSTANT,
                    Some("0x99 (entry not seen)".into()),
                    1_060
                ),
                (phases, TYPE_SLICE_BEGIN, Some("boot".into()), 1_010),
                (functions, TYPE_SLICE_BEGIN, Some("0x10".into()), 1_020),
            ]
        );
        let open = t
            .packet
            .iter()
            .filter_map(|p| p.track_event.as_ref())
            .filter(|e| e.track_uuid.is_some())
            .filter(|e| {
                e.debug_annotations
                    .iter()
                    .any(|a| a.name.as_deref() == Some("open") && a.bool_value == Some(true))
            })
            .count();
        assert_eq!(open, 4);
    }
}
