//! A guest's spans in a CTF guest trace: four event classes beside `vmtsync:event`, on the
//! span's vCPU stream (docs/ctf.md, "Spans").
//!
//! | class | when (its timestamp) | fields after the common ones |
//! |---|---|---|
//! | `vmtsync:span_begin` (1) | the entry | the entry's `host_tsc`, `guest_tsc`, `host_lo`/`host_hi` |
//! | `vmtsync:span_end` (2) | the exit of a closed span | the exit's, `begin_host_tsc`, `duration` (ticks) and, with intervals, its guaranteed `duration_lo`/`duration_hi` |
//! | `vmtsync:span_unfinished` (3) | when the exit is known never to come: the outer exit that abandoned it, or the end of the recording | `state` (`abandoned`, `open_at_end`), `begin_host_tsc` |
//! | `vmtsync:span_orphan` (4) | an exit whose entry was not seen | the exit's |
//!
//! The common fields: `vcpu`, `kind` (`phase`, `function`), `depth` (its place in its own
//! stack), `addr` (a function's address, 0 for a phase) and `name`. Only `span_end` has a
//! duration. The guest TSC and the interval fields are there when the trace declares them for
//! its events ([`GuestFields`]). Events come in each vCPU's own order, so a stream's
//! timestamps never go back for them.

use std::fmt::Write as _;

use super::{CtfTrace, ExportError, GuestCtf, GuestFields};
use crate::formats::ExportEvent;
use crate::spans::{Span, SpanConfig, SpanEnd, SpanKind, SpanStep, SpanTracker};

/// Class ids.
const BEGIN: u8 = 1;
const END: u8 = 2;
const UNFINISHED: u8 = 3;
const ORPHAN: u8 = 4;

/// Names longer than this many bytes are cut (at a character boundary).
const MAX_NAME: usize = 255;

/// The span state a guest trace keeps.
#[derive(Debug, Default)]
pub(super) struct Spans {
    tracker: SpanTracker,
    steps: Vec<SpanStep>,
}

/// The TSDL of the span classes for a trace whose events carry `fields`.
pub(super) fn tsdl(fields: GuestFields) -> String {
    let common = "\t\tuint32_t vcpu;\n\
                  \t\tenum : uint8_t { phase = 0, function = 1 } kind;\n\
                  \t\tuint32_t depth;\n\
                  \t\tuint64_t addr;\n\
                  \t\tstring name;\n";
    let mut record = String::from("\t\tuint64_t host_tsc;\n");
    if fields.guest_tsc {
        record.push_str("\t\tuint64_t guest_tsc;\n");
    }
    if fields.bound() {
        record.push_str("\t\tuint64_t host_lo;\n\t\tuint64_t host_hi;\n");
    }
    let mut end = format!("{record}\t\tuint64_t begin_host_tsc;\n\t\tuint64_t duration;\n");
    if fields.bound() {
        end.push_str("\t\tuint64_t duration_lo;\n\t\tuint64_t duration_hi;\n");
    }
    let unfinished = "\t\tenum : uint8_t { abandoned = 0, open_at_end = 1 } state;\n\
                      \t\tuint64_t begin_host_tsc;\n";
    let mut t = String::new();
    for (id, name, rest) in [
        (BEGIN, "span_begin", record.as_str()),
        (END, "span_end", end.as_str()),
        (UNFINISHED, "span_unfinished", unfinished),
        (ORPHAN, "span_orphan", record.as_str()),
    ] {
        let _ = write!(
            t,
            "event {{\n\tname = \"vmtsync:{name}\";\n\tid = {id};\n\tstream_id = 0;\n\tfields := struct {{\n{common}{rest}\t}};\n}};\n"
        );
    }
    t
}

impl CtfTrace {
    /// [`Self::event`] with fields of any length, already encoded as the class declares them
    /// (the span classes, whose names have no fixed size).
    ///
    /// # Errors
    /// As [`Self::event`].
    pub fn event_bytes(
        &mut self,
        instance: u32,
        class: u8,
        ts: u64,
        fields: &[u8],
    ) -> Result<bool, ExportError> {
        self.event_with(instance, class, ts, fields.len(), |d| {
            d[..fields.len()].copy_from_slice(fields);
            fields.len()
        })
    }

    /// The last timestamp of `instance`'s stream, if it has one.
    #[must_use]
    pub fn last_ts(&self, instance: u32) -> Option<u64> {
        self.streams
            .iter()
            .find(|s| s.instance == instance && s.seq + s.in_packet > 0)
            .map(|s| s.last)
    }
}

impl GuestCtf {
    /// Names functions with `cfg` from now on (call before the first event).
    pub fn set_spans(&mut self, cfg: &SpanConfig) {
        self.spans = Spans {
            tracker: SpanTracker::new(cfg),
            steps: Vec::new(),
        };
    }

    /// [`Self::push`] for a recording that followed the guest across resets: `boot` numbers
    /// its boots, and a new one abandons the spans the last one left open.
    ///
    /// # Errors
    /// As [`Self::push`].
    pub fn push_in_boot(&mut self, e: &ExportEvent, boot: u32) -> Result<(), ExportError> {
        self.push_event(e)?;
        let mut steps = std::mem::take(&mut self.spans.steps);
        steps.clear();
        let r = if self.spans.tracker.push_in_boot(e, boot, &mut steps) {
            steps
                .iter()
                .try_for_each(|s| self.write_step(s, e.host_tsc))
        } else {
            Ok(())
        };
        self.spans.steps = steps;
        r
    }

    /// The spans still open: `span_unfinished` (`open_at_end`) at their stream's last time.
    pub(super) fn finish_spans(&mut self) -> Result<(), ExportError> {
        let tracker = std::mem::take(&mut self.spans.tracker);
        for s in tracker.finish() {
            let at = self
                .trace
                .last_ts(s.vcpu)
                .or(s.begin.map(|b| b.host_tsc))
                .unwrap_or(0);
            self.write_unfinished(&s, 1, at)?;
        }
        Ok(())
    }

    fn write_step(&mut self, step: &SpanStep, now: u64) -> Result<(), ExportError> {
        match step {
            SpanStep::Enter(s) => match s.begin {
                Some(b) => self.write_at(s, BEGIN, &b, None),
                None => Ok(()),
            },
            SpanStep::Exit(s) => match (s.begin, s.end) {
                (Some(b), Some(e)) => self.write_at(s, END, &e, Some(&b)),
                _ => Ok(()),
            },
            SpanStep::Abandoned(s) => self.write_unfinished(s, 0, now),
            SpanStep::Orphan(s) => match s.end {
                Some(e) => self.write_at(s, ORPHAN, &e, None),
                None => Ok(()),
            },
        }
    }

    /// An event at one of the span's ends (`begin` given for a closed span's end).
    fn write_at(
        &mut self,
        s: &Span,
        class: u8,
        at: &SpanEnd,
        begin: Option<&SpanEnd>,
    ) -> Result<(), ExportError> {
        let mut f = common(s);
        f.extend_from_slice(&at.host_tsc.to_le_bytes());
        if self.fields.guest_tsc {
            f.extend_from_slice(&at.guest_tsc.unwrap_or_default().to_le_bytes());
        }
        if self.fields.bound() {
            let b = at.bound.map_or((0, 0), |b| (b.lo, b.hi));
            f.extend_from_slice(&b.0.to_le_bytes());
            f.extend_from_slice(&b.1.to_le_bytes());
        }
        if let Some(b) = begin {
            f.extend_from_slice(&b.host_tsc.to_le_bytes());
            f.extend_from_slice(&s.ticks().unwrap_or_default().to_le_bytes());
            if self.fields.bound() {
                let d = s.ticks_bound().map_or((0, 0), |d| (d.lo, d.hi));
                f.extend_from_slice(&d.0.to_le_bytes());
                f.extend_from_slice(&d.1.to_le_bytes());
            }
        }
        self.trace.event_bytes(s.vcpu, class, at.host_tsc, &f)?;
        Ok(())
    }

    /// `span_unfinished` with `state` (0 abandoned, 1 open at the end) at host tick `at`.
    fn write_unfinished(&mut self, s: &Span, state: u8, at: u64) -> Result<(), ExportError> {
        let mut f = common(s);
        f.push(state);
        f.extend_from_slice(&s.begin.map_or(0, |b| b.host_tsc).to_le_bytes());
        self.trace.event_bytes(s.vcpu, UNFINISHED, at, &f)?;
        Ok(())
    }
}

/// `vcpu`, `kind`, `depth`, `addr`, `name` (NUL-terminated, NULs in it replaced).
fn common(s: &Span) -> Vec<u8> {
    let mut f = Vec::with_capacity(64);
    f.extend_from_slice(&s.vcpu.to_le_bytes());
    f.push(match s.kind {
        SpanKind::Phase => 0,
        SpanKind::Function => 1,
    });
    f.extend_from_slice(&s.depth.to_le_bytes());
    f.extend_from_slice(&s.addr.unwrap_or(0).to_le_bytes());
    let mut cut = s.name.len().min(MAX_NAME);
    while !s.name.is_char_boundary(cut) {
        cut -= 1;
    }
    f.extend(
        s.name.as_bytes()[..cut]
            .iter()
            .map(|&b| if b == 0 { b' ' } else { b }),
    );
    f.push(0);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_fields_cut_long_names_and_replace_nuls() {
        let s = Span {
            vcpu: 2,
            kind: SpanKind::Function,
            name: format!("a\0{}", "é".repeat(200)),
            addr: Some(0x1234),
            depth: 5,
            begin: None,
            end: None,
        };
        let f = common(&s);
        assert_eq!(&f[..4], &2u32.to_le_bytes());
        assert_eq!(f[4], 1);
        assert_eq!(&f[5..9], &5u32.to_le_bytes());
        assert_eq!(&f[9..17], &0x1234u64.to_le_bytes());
        let name = &f[17..f.len() - 1];
        assert!(name.len() <= MAX_NAME && std::str::from_utf8(name).is_ok());
        assert_eq!(&name[..2], b"a ");
        assert_eq!(f.last(), Some(&0));
        assert!(tsdl(GuestFields::ALL).contains("uint64_t duration_lo;"));
    }
}
