//! A memory recording's trace.dat and Perfetto outputs, written as the records are placed.
//!
//! A memory recording places each record once: exact mode by KVM's mapping when it reads it
//! (width 0, `memory/mapping.rs`), beacon mode once the sync round after it is known
//! (`memory/hold.rs`). No later round changes what was written, so the records go straight
//! into the format's streaming writer, and the file is finished, never written again, when the
//! recording ends (docs/record.md, "Memory recordings stream"). The protocol front end, which
//! places again with every round at the end, keeps the spool (`write.rs`) and writes its
//! trace.dat through [`TraceDatStream`] when the recording ends.
//!
//! - trace.dat: each vCPU's raw guest TSCs, with a TIME_SHIFT made of the offsets its records
//!   were placed by (trace-cmd then computes exactly the host time we placed). A vCPU whose
//!   guest TSC steps back (a guest that wrote its TSC) continues on a trace CPU of its own,
//!   since a CPU's timestamps only go forward; a guest tick beyond trace-cmd's signed 64-bit
//!   times is written as its host tick (an offset-0 part). Points that do not follow KVM's
//!   mapping (beacon mode without it) are written as host ticks, pre-converted, each vCPU's
//!   kept in order by writing a point behind the last one at the last one (counted).
//! - Perfetto: host TSCs on BOOTTIME through snapshots taken while recording. The first
//!   conversion needs two snapshots far enough apart for a good rate, so the first events are
//!   held (at most [`HOLD_EVENTS`], in memory) until [`MIN_SPAN`] has passed since the first.

use std::time::{Duration, Instant};

use vmtsync_core::HostTicks;

use super::RecordError;
use super::place::{Placed, export_event, split_key};
use super::target::{Target, host_tsc2nsec};
use crate::formats::perfetto::clock::{BootClock, ClockSnapshot};
use crate::formats::perfetto::{
    DEFAULT_MACHINE_ID, PerfettoError, PerfettoOptions, PerfettoWriter,
};
use crate::formats::tracedat::{
    self, Padded, ShiftMode, SpanGraph, TimeShift, TraceDatWriter, WriterOptions,
};
use crate::formats::{ExportEvent, Payload};
use crate::guestmem::{GuestRecord, RoundRing};

/// trace-cmd keeps times as signed 64-bit numbers (and its step TIME_SHIFT a sentinel at the
/// largest): a guest tick above this is written as its host tick.
const MAX_TICK: u64 = (i64::MAX as u64) - 1;

/// What a guest's clock may cost a trace.dat written at raw guest ticks: trace CPUs beyond one
/// per vCPU (each started by a TSC that stepped back; each holds a page and a spill file) and
/// TIME_SHIFT samples beyond one per sync round (32 bytes each, in memory and in the file:
/// points of one round at more than one offset). The host makes the rounds; the guest is
/// untrusted, so past either bound the rest of the file is pre-converted, which needs neither.
const MAX_EXTRA_PARTS: usize = 64;
const MAX_EXTRA_SAMPLES: usize = 1 << 16;

/// One vCPU's records of a round that its latest exact segment places (KVM's mapping did not
/// change during the round): each plain event's host tick is its guest tick minus `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ExactRun {
    /// The vCPU's placement key.
    pub(super) key: u32,
    /// The segment's offset (`guest - host`), the guest tick it starts at, and its round.
    pub(super) offset: i64,
    pub(super) start: u64,
    pub(super) round: u64,
}

impl ExactRun {
    /// The host tick of `r` when it is a plain event (not a beacon, not a span record) that
    /// the segment places: at or after its start, and in the host's range.
    #[inline]
    pub(super) fn places(&self, r: &GuestRecord) -> Option<u64> {
        if r.is_beacon() || crate::formats::event::is_span_id(r.id) || r.tsc < self.start {
            return None;
        }
        self.host(r.tsc)
    }

    /// Guest tick `tsc` on the host by the segment's offset, `None` outside the host's range.
    #[inline]
    fn host(&self, tsc: u64) -> Option<u64> {
        tsc.checked_add_signed(self.offset.checked_neg()?)
    }

    /// Whether [`Self::places`] places every record of `ring` whose id is not reserved (by
    /// its clock's extremes alone: at or after the segment's start, and in the host's range
    /// at both ends). The records with reserved ids (beacons, spans) it never places.
    #[inline]
    pub(super) fn places_unreserved(&self, ring: &RoundRing) -> bool {
        ring.min_tsc >= self.start
            && self.host(ring.min_tsc).is_some()
            && self.host(ring.max_tsc).is_some()
    }
}

/// `f` for each record of a run its segment places plainly, as the exporters see it (a
/// memory recording's key names its ring: its boots share the ring's vCPU stream). Stops at
/// the first other record; returns how many it took.
#[inline]
pub(super) fn for_each_plain<E>(
    run: &ExactRun,
    records: &[GuestRecord],
    mut f: impl FnMut(&ExportEvent) -> Result<(), E>,
) -> Result<usize, E> {
    let mut n = 0;
    for r in records {
        let Some(host) = run.places(r) else {
            break;
        };
        // What `Placed::exact(..).export()` gives, without padding the record's payload again.
        let payload = Payload::from_padded(r.len, r.payload).unwrap_or_default();
        f(&export_event(
            run.key,
            true,
            r.id,
            (r.tsc, host, host, host),
            payload,
        ))?;
        n += 1;
    }
    Ok(n)
}

/// A trace CPU's name: a memory recording's rings by their number, a later boot's with it.
pub(super) fn cpu_name(key: u32, keyed: bool) -> String {
    match split_key(key) {
        (b, r) if keyed && b > 0 => format!("{r} of boot {b}"),
        (_, r) if keyed => r.to_string(),
        _ => key.to_string(),
    }
}

/// The UNAME of a guest trace.dat whose CPUs are `names`: how its timestamps read.
pub(super) fn uname(names: &[String], identity: bool) -> String {
    let which = if names.len() == 1 {
        format!("vCPU {}", names[0])
    } else {
        format!("vCPUs {} as CPUs 0..{}", names.join(","), names.len())
    };
    if identity {
        format!("vmtsync record: {which}, raw guest TSC, TIME_SHIFT to host TSC")
    } else {
        format!(
            "vmtsync record: {which}, timestamps pre-converted to host TSC (the guest TSC \
             rate is not the host's: trace-cmd's TIME_SHIFT cannot represent it exactly)"
        )
    }
}

/// One trace CPU of a streamed trace.dat: a vCPU's records while its guest TSC only went
/// forward.
#[derive(Debug)]
struct Part {
    key: u32,
    /// Written as host ticks (offset 0): its guest ticks are beyond trace-cmd's range.
    host_ticks: bool,
    /// Parts of this vCPU before it (each started by a guest TSC that stepped back).
    after: u32,
    /// Its TIME_SHIFT: each offset its records were placed by, from the host tick of the
    /// first record placed by it.
    shift: Vec<tracedat::SyncSegment>,
    /// The latest segment's offset (`guest - host`), the timestamp it starts at, and the
    /// round of the first record it placed.
    offset: i64,
    seg_start: u64,
    round: u64,
    /// Its last timestamp, and how many records it holds.
    last: u64,
    events: u64,
}

impl Part {
    fn new(key: u32, host_ticks: bool, after: u32) -> Self {
        Self {
            key,
            host_ticks,
            after,
            shift: Vec::new(),
            offset: 0,
            seg_start: 0,
            round: 0,
            last: 0,
            events: 0,
        }
    }

    /// Whether a record at `ts` placed by `offset` can follow this part's records: in order,
    /// and a new offset only at a later timestamp than the last segment's start (TIME_SHIFT's
    /// starts must increase strictly).
    fn takes(&self, host_ticks: bool, ts: u64, offset: i64) -> bool {
        self.host_ticks == host_ticks
            && (self.events == 0
                || (ts >= self.last && (offset == self.offset || ts > self.seg_start)))
    }

    /// Whether taking a record placed by `offset` adds a TIME_SHIFT sample.
    fn new_sample(&self, offset: i64) -> bool {
        self.events == 0 || offset != self.offset
    }

    /// Whether taking a record placed by `offset` in round `round` adds a second sample to
    /// that round's.
    fn extra_sample(&self, offset: i64, round: u64) -> bool {
        self.events > 0 && offset != self.offset && round == self.round
    }

    /// Takes a record at `ts`, placed at `host` by `offset` in round `round`.
    fn take(&mut self, ts: u64, host: u64, offset: i64, round: u64) {
        if self.new_sample(offset) {
            self.shift
                .push(tracedat::SyncSegment::offset_only(HostTicks(host), offset));
            self.offset = offset;
            self.seg_start = ts;
            self.round = round;
        }
        self.last = ts;
        self.events += 1;
    }
}

/// A trace.dat written as exact mode places its records (see the module docs).
#[derive(Debug)]
pub(super) struct TraceDatStream {
    w: TraceDatWriter,
    graph: SpanGraph,
    parts: Vec<Part>,
    /// Each vCPU key's trace CPU now (its latest part), and the entry used last.
    now: Vec<(u32, u32)>,
    hint: usize,
    keyed: bool,
    /// Every record from now on is written at its host tick ([`Self::preconvert`]).
    preconverted: bool,
    /// Host ticks written at their CPU's last timestamp instead (they were behind it).
    clamped: u64,
    /// TIME_SHIFT samples taken beyond one per round so far, every part's.
    extra_samples: usize,
}

impl TraceDatStream {
    /// The file for `target`, one trace CPU per vCPU key in `keys` to start with, its pages
    /// written on the caller's thread with `write_here` ([`WriterOptions::write_here`]).
    pub(super) fn create(
        target: &Target,
        keys: &[u32],
        keyed: bool,
        trace_id: u64,
        write_here: bool,
    ) -> Result<Self, RecordError> {
        let cpus = u32::try_from(keys.len().max(1)).unwrap_or(u32::MAX);
        let mut wo = WriterOptions::new(cpus, trace_id);
        wo.version = target.file_version;
        wo.write_here = write_here;
        wo.tsc2nsec = host_tsc2nsec();
        let graph = SpanGraph::new(&target.spans, wo.tsc2nsec);
        let w = TraceDatWriter::create(&target.out, wo)?;
        let mut parts: Vec<Part> = keys.iter().map(|&k| Part::new(k, false, 0)).collect();
        if parts.is_empty() {
            parts.push(Part::new(0, false, 0));
        }
        let now = parts.iter().zip(0u32..).map(|(p, c)| (p.key, c)).collect();
        Ok(Self {
            w,
            graph,
            parts,
            now,
            hint: 0,
            keyed,
            preconverted: false,
            clamped: 0,
            extra_samples: 0,
        })
    }

    /// From now on every record is written at its host tick, pre-converted: the points no
    /// longer follow one offset per segment, which a TIME_SHIFT would need.
    pub(super) fn preconvert(&mut self) {
        self.preconverted = true;
        for p in self.parts.iter_mut().filter(|p| p.events == 0) {
            p.host_ticks = true;
        }
    }

    /// One placed record.
    #[inline]
    pub(super) fn push(&mut self, p: &Placed<'_>) -> Result<(), RecordError> {
        let (cpu, ts, offset) = loop {
            if let Some(at) = self.stamp(p)? {
                break at;
            }
            // Past the bounds of a raw-tick file: pre-converted, the record always has a
            // trace CPU.
            self.preconvert();
        };
        self.take(cpu, ts, p.host, offset, p.round);
        if crate::formats::event::is_span_id(p.id) {
            let mut e = p.export();
            // Each boot's rings are CPUs of their own here: keyed, they are stacks of their own
            // too.
            e.vcpu = p.vcpu;
            self.graph.push(&mut self.w, cpu, ts, &e)?;
        } else {
            self.w.push(cpu, ts, u32::from(p.id), p.payload)?;
        }
        Ok(())
    }

    /// A run of vCPU `run.key`'s records, in ring order, written while each is a plain event
    /// its latest segment places (see [`ExactRun::places`]) and its trace CPU takes in order.
    /// Returns how many it wrote: the record after them needs [`Self::push`].
    #[inline]
    pub(super) fn push_run(
        &mut self,
        run: &ExactRun,
        records: &[GuestRecord],
    ) -> Result<usize, RecordError> {
        let Some(first) = records.first() else {
            return Ok(0);
        };
        let Some(host) = run.places(first).filter(|_| first.tsc <= MAX_TICK) else {
            return Ok(0);
        };
        let Some(cpu) = self.part_for(run.key, false, first.tsc, run.offset, run.round)? else {
            return Ok(0);
        };
        // The records in trace-cmd's range, in order on their trace CPU, checked as they are
        // written, in one pass: the record after them takes the general path. Each is a plain
        // event the run places (a run holds no other: `memory::pipe`'s `Item::Run`), so only
        // the range is checked here.
        let (n, written) = self.w.push_padded_while(cpu, records, |r| {
            debug_assert!(run.places(r).is_some(), "a run's record it does not place");
            (r.tsc <= MAX_TICK).then(|| Padded {
                ts: r.tsc,
                id: u32::from(r.id),
                len: r.payload().len(),
                payload: r.payload,
            })
        });
        // What was written counts also when the write failed part way.
        if n > 0 {
            self.take(cpu, first.tsc, host, run.offset, run.round);
            let part = &mut self.parts[cpu as usize];
            part.last = records[n - 1].tsc;
            part.events += (n - 1) as u64;
        }
        written?;
        Ok(n)
    }

    /// Where `p` is written: its trace CPU, timestamp and offset; `None` when that would take
    /// a trace CPU or a TIME_SHIFT sample past the bounds of a raw-tick file (never once
    /// pre-converted).
    fn stamp(&mut self, p: &Placed<'_>) -> Result<Option<(u32, u64, i64)>, RecordError> {
        let host_ticks = self.preconverted || p.guest > MAX_TICK;
        let (mut ts, offset) = if host_ticks {
            (p.host, 0)
        } else {
            (p.guest, p.guest.wrapping_sub(p.host).cast_signed())
        };
        if self.preconverted
            && let Some(last) = self.last_host_tick(p.vcpu)
            && ts < last
        {
            // A vCPU's points may step back across segments; its CPU's timestamps may not.
            ts = last;
            self.clamped += 1;
        }
        Ok(self
            .part_for(p.vcpu, host_ticks, ts, offset, p.round)?
            .map(|cpu| (cpu, ts, offset)))
    }

    /// Part `cpu` takes a record at `ts`, placed at `host` by `offset` in round `round`.
    fn take(&mut self, cpu: u32, ts: u64, host: u64, offset: i64, round: u64) {
        let part = &mut self.parts[cpu as usize];
        self.extra_samples += usize::from(part.extra_sample(offset, round));
        part.take(ts, host, offset, round);
    }

    /// The last timestamp of `key`'s part now, when it holds host ticks.
    fn last_host_tick(&self, key: u32) -> Option<u64> {
        let &(_, cpu) = self.now.iter().find(|&&(k, _)| k == key)?;
        let part = &self.parts[cpu as usize];
        (part.host_ticks && part.events > 0).then_some(part.last)
    }

    /// The trace CPU a record of `key` at `ts` placed by `offset` in round `round` goes to:
    /// the vCPU's part now, or a new one when that one cannot take it; `None` when that takes
    /// a trace CPU or a TIME_SHIFT sample past [`MAX_EXTRA_PARTS`] or [`MAX_EXTRA_SAMPLES`]
    /// before the stream is pre-converted.
    fn part_for(
        &mut self,
        key: u32,
        host_ticks: bool,
        ts: u64,
        offset: i64,
        round: u64,
    ) -> Result<Option<u32>, RecordError> {
        let room = |s: &Self, part: Option<&Part>| {
            s.preconverted
                || (part.is_some() || s.parts.len() < s.now.len() + MAX_EXTRA_PARTS)
                    && (part.is_none_or(|p| !p.extra_sample(offset, round))
                        || s.extra_samples < MAX_EXTRA_SAMPLES)
        };
        // The vCPU of the last record, most often.
        if let Some(&(k, cpu)) = self.now.get(self.hint)
            && k == key
            && self.parts[cpu as usize].takes(host_ticks, ts, offset)
        {
            let part = &self.parts[cpu as usize];
            return Ok(room(self, Some(part)).then_some(cpu));
        }
        let now = self.now.iter().position(|&(k, _)| k == key);
        if let Some(i) = now {
            self.hint = i;
            let cpu = self.now[i].1;
            let part = &self.parts[cpu as usize];
            if part.takes(host_ticks, ts, offset) {
                return Ok(room(self, Some(part)).then_some(cpu));
            }
        }
        if !room(self, None) {
            return Ok(None);
        }
        let cpu = self.w.add_cpu()?;
        let after = self.parts.iter().filter(|p| p.key == key).count();
        self.parts.push(Part::new(
            key,
            host_ticks,
            u32::try_from(after).unwrap_or(u32::MAX),
        ));
        match now {
            Some(i) => self.now[i].1 = cpu,
            None => {
                self.hint = self.now.len();
                self.now.push((key, cpu));
            }
        }
        Ok(Some(cpu))
    }

    /// Finishes the file: its UNAME naming the trace CPUs, the function graph's names, the
    /// TIME_SHIFT (none when every timestamp is a host tick). Returns the number of
    /// timestamps written as host ticks, and of those written at their CPU's last one.
    pub(super) fn finish(mut self) -> Result<(u64, u64), RecordError> {
        let identity = !self.parts.iter().all(|p| p.host_ticks);
        let names: Vec<String> = self
            .parts
            .iter()
            .map(|p| {
                let mut n = cpu_name(p.key, self.keyed);
                if p.after > 0 {
                    n.push_str(&format!(" (part {}: its TSC stepped back)", p.after + 1));
                }
                if p.host_ticks && identity {
                    n.push_str(" (host ticks)");
                }
                n
            })
            .collect();
        self.w.set_uname(uname(&names, identity));
        let cpus = u32::try_from(self.parts.len()).unwrap_or(u32::MAX);
        self.graph.finish(&mut self.w, cpus);
        let shift = TimeShift {
            peer_trace_id: 0,
            mode: ShiftMode::Step,
            cpus: self
                .parts
                .iter()
                .map(|p| {
                    if p.shift.is_empty() {
                        // No record uses it: any segment serves.
                        vec![tracedat::SyncSegment::offset_only(HostTicks(0), 0)]
                    } else {
                        p.shift.clone()
                    }
                })
                .collect(),
        };
        let host_ticks = self
            .parts
            .iter()
            .filter(|p| p.host_ticks)
            .map(|p| p.events)
            .sum();
        self.w.finish(identity.then_some(&shift))?;
        Ok((host_ticks, self.clamped))
    }
}

/// How many events a Perfetto stream holds before its clock has two snapshots.
pub(super) const HOLD_EVENTS: usize = 1 << 18;
/// How far apart the first two snapshots are at least (unless [`HOLD_EVENTS`] fill first):
/// the rate they give is off by about their resolutions over this span.
pub(super) const MIN_SPAN: Duration = Duration::from_millis(50);

/// An event held until the Perfetto clock exists.
#[derive(Clone, Copy, Debug)]
struct Held {
    key: u32,
    id: u16,
    len: u8,
    guest: u64,
    host: u64,
    lo: u64,
    hi: u64,
    payload: [u8; 16],
}

/// A Perfetto trace written as exact mode places its records (see the module docs).
#[derive(Debug)]
pub(super) struct PerfettoStream {
    target: Target,
    keyed: bool,
    /// The first snapshot and when it was taken, until the writer exists.
    first: (ClockSnapshot, Instant),
    w: Option<PerfettoWriter>,
    held: Vec<Held>,
}

impl PerfettoStream {
    /// The stream for `target`, its clock starting at a snapshot taken now.
    pub(super) fn create(target: &Target, keyed: bool) -> Result<Self, RecordError> {
        let first = ClockSnapshot::take().map_err(PerfettoError::from)?;
        Ok(Self {
            target: target.clone(),
            keyed,
            first: (first, Instant::now()),
            w: None,
            held: Vec::new(),
        })
    }

    /// One placed record: held until the clock exists, then written.
    #[inline]
    pub(super) fn push(&mut self, p: &Placed<'_>) -> Result<(), RecordError> {
        if let Some(w) = &mut self.w {
            return write_perfetto_event(w, p, self.keyed);
        }
        let mut payload = [0u8; 16];
        let n = p.payload.len().min(16);
        payload[..n].copy_from_slice(&p.payload[..n]);
        self.held.push(Held {
            key: p.vcpu,
            id: p.id,
            len: u8::try_from(n).unwrap_or(16),
            guest: p.guest,
            host: p.host,
            lo: p.lo,
            hi: p.hi,
            payload,
        });
        if self.held.len() >= HOLD_EVENTS {
            self.open()?;
        }
        Ok(())
    }

    /// Exact mode: as many of `records` as `run` places plainly, written in one go, or held
    /// until the clock exists (then written, and the rest with them). Returns how many.
    #[inline]
    pub(super) fn push_run(
        &mut self,
        run: ExactRun,
        records: &[GuestRecord],
    ) -> Result<usize, RecordError> {
        let mut taken = 0;
        if self.w.is_none() {
            let room = HOLD_EVENTS.saturating_sub(self.held.len());
            for r in records.iter().take(room) {
                let Some(host) = run.places(r) else {
                    return Ok(taken);
                };
                self.held.push(Held {
                    key: run.key,
                    id: r.id,
                    len: r.len,
                    guest: r.tsc,
                    host,
                    lo: host,
                    hi: host,
                    payload: r.payload,
                });
                taken += 1;
            }
            if self.held.len() < HOLD_EVENTS {
                return Ok(taken);
            }
            self.open()?;
        }
        match &mut self.w {
            Some(w) => Ok(taken + for_each_plain(&run, &records[taken..], |e| w.push(e))?),
            None => Ok(taken),
        }
    }

    /// After a round: the writer opens once the first snapshot is [`MIN_SPAN`] old.
    pub(super) fn round_end(&mut self) -> Result<(), RecordError> {
        if self.w.is_none() && self.first.1.elapsed() >= MIN_SPAN {
            self.open()?;
        }
        Ok(())
    }

    /// A snapshot taken while recording (about one a second): later host TSCs convert
    /// through it.
    pub(super) fn snapshot(&mut self, s: ClockSnapshot) -> Result<(), RecordError> {
        match &mut self.w {
            Some(w) => Ok(w.add_snapshot(s)?),
            None => Ok(()),
        }
    }

    /// Creates the writer with the first snapshot and one taken now, and writes what was held.
    fn open(&mut self) -> Result<(), RecordError> {
        let now = ClockSnapshot::take().map_err(PerfettoError::from)?;
        let clock = BootClock::new(vec![self.first.0, now]).map_err(PerfettoError::from)?;
        let mut w = PerfettoWriter::create(
            &self.target.out,
            PerfettoOptions {
                machine_id: DEFAULT_MACHINE_ID,
                guest_name: format!("vmtsync guest ({})", self.target.source),
                clock,
            },
        )?;
        w.set_spans(&self.target.spans);
        for h in std::mem::take(&mut self.held) {
            // Held payloads are zero-padded already.
            let payload = Payload::from_padded(h.len, h.payload).unwrap_or_default();
            write_perfetto(
                &mut w,
                h.key,
                self.keyed,
                h.id,
                (h.guest, h.host, h.lo, h.hi),
                payload,
            )?;
        }
        self.w = Some(w);
        Ok(())
    }

    /// Finishes the trace with a last snapshot.
    pub(super) fn finish(mut self) -> Result<(), RecordError> {
        if self.w.is_none() {
            self.open()?;
        }
        let Some(mut w) = self.w.take() else {
            return Ok(());
        };
        if let Ok(s) = ClockSnapshot::take() {
            match w.add_snapshot(s) {
                // A snapshot not after the last one adds nothing: the trace is complete
                // without it.
                Ok(()) | Err(PerfettoError::Clock(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        w.finish()?;
        Ok(())
    }
}

/// One placed record into the Perfetto trace: a memory recording's boots share their rings'
/// vCPU tracks, and a new boot abandons the spans the last one left open.
#[inline]
pub(super) fn write_perfetto_event(
    w: &mut PerfettoWriter,
    p: &Placed<'_>,
    keyed: bool,
) -> Result<(), RecordError> {
    let payload = Payload::new(p.payload).unwrap_or_default();
    write_perfetto(
        w,
        p.vcpu,
        keyed,
        p.id,
        (p.guest, p.host, p.lo, p.hi),
        payload,
    )
}

/// [`write_perfetto_event`] of the event's parts: its key, its id, its guest tick, host tick
/// and interval's ends, and its payload.
#[inline]
fn write_perfetto(
    w: &mut PerfettoWriter,
    key: u32,
    keyed: bool,
    id: u16,
    (guest, host, lo, hi): (u64, u64, u64, u64),
    payload: Payload,
) -> Result<(), RecordError> {
    let boot = if keyed { split_key(key).0 } else { 0 };
    let e = export_event(key, keyed, id, (guest, host, lo, hi), payload);
    if crate::formats::event::is_span_id(id) {
        w.push_in_boot(&e, boot)?;
    } else {
        w.push(&e)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::tracedat::consts::option;
    use crate::formats::tracedat::timeshift::{decode, trace_cmd_host_time};
    use crate::formats::tracedat::{read_layout, reader};
    use crate::record::RecordFormat;

    fn target(out: &std::path::Path) -> Target {
        Target::test(out, RecordFormat::TraceCmd)
    }

    fn placed(key: u32, guest: u64, host: u64, seq: u8) -> Placed<'static> {
        static PAYLOADS: [[u8; 1]; 8] = [[0], [1], [2], [3], [4], [5], [6], [7]];
        Placed {
            vcpu: key,
            id: 0x0C01,
            guest,
            payload: &PAYLOADS[usize::from(seq)],
            host,
            lo: host,
            hi: host,
            round: 0,
            keyed: true,
        }
    }

    /// `places_unreserved` says yes exactly when `places` places every record of the ring
    /// with an id below the reserved ones: checked over rings of clocks before, at and after
    /// the segment's start, and offsets that overflow the host's range at either end.
    #[test]
    fn places_unreserved_agrees_with_placing_each_record() {
        use crate::guestmem::{GuestRecord, RoundRing};
        let rec = |tsc: u64| GuestRecord {
            vcpu: 0,
            id: 7,
            tsc,
            len: 0,
            payload: [0; 16],
        };
        let tscs = [0u64, 99, 100, 101, 5_000, u64::MAX - 1, u64::MAX];
        let offsets = [0i64, 50, 200, -50, i64::MIN, i64::MAX];
        let mut both = (0, 0);
        for offset in offsets {
            let run = ExactRun {
                key: 0,
                offset,
                start: 100,
                round: 0,
            };
            for a in 0..tscs.len() {
                for b in a..tscs.len() {
                    let ring = [rec(tscs[a]), rec(tscs[b])];
                    let summary = RoundRing {
                        vcpu: 0,
                        records: 0..2,
                        reserved: 0..0,
                        min_tsc: tscs[a],
                        max_tsc: tscs[b],
                    };
                    let each = ring.iter().all(|r| run.places(r).is_some());
                    let all = run.places_unreserved(&summary);
                    assert_eq!(all, each, "{offset} {ring:?}");
                    both.0 += usize::from(all);
                    both.1 += usize::from(!all);
                }
            }
        }
        assert!(
            both.0 > 0 && both.1 > 0,
            "both answers were exercised: {both:?}"
        );
    }

    /// Every event of the file as (trace CPU, the host tick trace-cmd computes, payload byte).
    fn host_times(path: &std::path::Path) -> Vec<(u32, u64, u8)> {
        let layout = read_layout(path).unwrap();
        let body = &layout
            .options_with(option::TIME_SHIFT)
            .next()
            .expect("TIME_SHIFT")
            .data;
        let shift = decode(body).unwrap();
        let mut got = Vec::new();
        reader::for_each_event(path, &layout, 0, |e| {
            let host = trace_cmd_host_time(&shift.cpus[e.cpu as usize], shift.flags, e.ts).unwrap();
            got.push((e.cpu, host, e.payload[0]));
        })
        .unwrap();
        got
    }

    #[test]
    fn trace_cmd_computes_each_events_placed_host_time_across_offset_changes_and_steps_back() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("g.dat");
        let mut s = TraceDatStream::create(&target(&out), &[0, 1], true, 7, false).unwrap();
        // vCPU 0: offset 100, then 600 (the guest TSC jumped forward), then -5000 (it stepped
        // back: a trace CPU of its own); vCPU 1: offset 0 throughout.
        let events = [
            placed(0, 1_100, 1_000, 0),
            placed(1, 1_050, 1_050, 1),
            placed(0, 1_300, 1_200, 2),
            placed(0, 2_100, 1_500, 3),
            placed(0, 2_200, 1_600, 4),
            placed(0, 1_000, 6_000, 5),
            placed(1, 7_000, 7_000, 6),
            placed(0, 1_400, 6_400, 7),
        ];
        for e in &events {
            s.push(e).unwrap();
        }
        assert_eq!(s.finish().unwrap(), (0, 0));
        let mut got = host_times(&out);
        got.sort_by_key(|&(_, _, seq)| seq);
        let want: Vec<(u32, u64, u8)> = events
            .iter()
            .map(|e| {
                let cpu = match e.payload[0] {
                    1 | 6 => 1,
                    5 | 7 => 2,
                    _ => 0,
                };
                (cpu, e.host, e.payload[0])
            })
            .collect();
        assert_eq!(got, want);
        let layout = read_layout(&out).unwrap();
        let uname = &layout.options_with(option::UNAME).next().unwrap().data;
        assert_eq!(
            String::from_utf8_lossy(uname),
            "vmtsync record: vCPUs 0,1,0 (part 2: its TSC stepped back) as CPUs 0..3, raw guest \
             TSC, TIME_SHIFT to host TSC\0"
        );
    }

    #[test]
    fn a_guest_tick_beyond_trace_cmds_range_is_written_as_its_host_tick() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("h.dat");
        let mut s = TraceDatStream::create(&target(&out), &[0], true, 7, true).unwrap();
        s.push(&placed(0, 5_000, 4_000, 0)).unwrap();
        s.push(&placed(0, u64::MAX - 10, 4_100, 1)).unwrap();
        s.push(&placed(0, u64::MAX - 5, 4_105, 2)).unwrap();
        assert_eq!(s.finish().unwrap(), (2, 0));
        assert_eq!(
            host_times(&out),
            [(0, 4_000, 0), (1, 4_100, 1), (1, 4_105, 2)]
        );
    }

    /// Pre-converted, every record is written at its host tick, a point behind its vCPU's
    /// last one at that one (counted), and the file has no TIME_SHIFT: trace-cmd shows the
    /// host ticks as they are.
    #[test]
    fn a_preconverted_stream_writes_host_ticks_in_order_without_a_time_shift() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("p.dat");
        let mut s = TraceDatStream::create(&target(&out), &[0, 1], true, 7, false).unwrap();
        s.preconvert();
        for e in [
            placed(0, 5_000, 4_000, 0),
            placed(1, 7_000, 6_000, 1),
            placed(0, 5_100, 3_990, 2),
            placed(0, 5_200, 4_200, 3),
        ] {
            s.push(&e).unwrap();
        }
        assert_eq!(s.finish().unwrap(), (4, 1));
        let layout = read_layout(&out).unwrap();
        assert!(layout.options_with(option::TIME_SHIFT).next().is_none());
        let mut got = Vec::new();
        reader::for_each_event(&out, &layout, 0, |e| got.push((e.cpu, e.ts, e.payload[0])))
            .unwrap();
        got.sort_by_key(|&(_, _, seq)| seq);
        assert_eq!(
            got,
            [(0, 4_000, 0), (1, 6_000, 1), (0, 4_000, 2), (0, 4_200, 3)]
        );
        let uname = &layout.options_with(option::UNAME).next().unwrap().data;
        assert!(
            String::from_utf8_lossy(uname)
                .contains("vCPUs 0,1 as CPUs 0..2, timestamps pre-converted"),
            "{}",
            String::from_utf8_lossy(uname)
        );
    }

    /// A guest TSC that keeps stepping back costs at most [`MAX_EXTRA_PARTS`] trace CPUs:
    /// past them the rest of the file is pre-converted (host ticks, each vCPU's on one trace
    /// CPU), and every record is still written, trace-cmd showing each at its host tick.
    #[test]
    fn a_tsc_that_keeps_stepping_back_is_preconverted_past_the_trace_cpu_bound() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("b.dat");
        let mut s = TraceDatStream::create(&target(&out), &[0], true, 7, false).unwrap();
        let n = 2 * MAX_EXTRA_PARTS as u64 + 10;
        let hosts: Vec<u64> = (0..n).map(|i| 10_000 + 100 * i).collect();
        for (i, &h) in hosts.iter().enumerate() {
            // Guest ticks alternate between two far-apart clocks: every other one steps back.
            let g = if i % 2 == 0 { h + 1_000_000 } else { h + 5_000 };
            s.push(&placed(0, g, h, u8::try_from(i % 8).unwrap()))
                .unwrap();
        }
        let (host_ticks, clamped) = s.finish().unwrap();
        assert!(host_ticks > 0 && clamped == 0, "{host_ticks} {clamped}");
        let layout = read_layout(&out).unwrap();
        let cpus = layout.buffers[0].cpus.len();
        assert!(cpus <= 1 + MAX_EXTRA_PARTS + 1, "{cpus} trace CPUs");
        let mut got: Vec<u64> = host_times(&out).into_iter().map(|(_, h, _)| h).collect();
        got.sort_unstable();
        assert_eq!(got, hosts, "every record at its host tick");
    }

    /// `n` records of vCPU 0 into `out`, record `i` at guest tick `1_000_000 + 10 i` placed at
    /// host tick `100 + 9 i` (its offset changes at every record) in round `round(i)`;
    /// returns what `finish` returns.
    fn drifting_points(out: &std::path::Path, n: u64, round: impl Fn(u64) -> u64) -> (u64, u64) {
        let mut s = TraceDatStream::create(&target(out), &[0], true, 7, true).unwrap();
        for i in 0..n {
            let p = Placed {
                round: round(i),
                ..placed(0, 1_000_000 + 10 * i, 100 + 9 * i, (i % 8) as u8)
            };
            s.push(&p).unwrap();
        }
        s.finish().unwrap()
    }

    /// Points of one round whose offset changes at every record cost at most
    /// [`MAX_EXTRA_SAMPLES`] TIME_SHIFT samples beyond the round's: past them the rest is
    /// pre-converted, every record still at its host tick.
    #[test]
    fn offsets_that_change_at_every_record_are_preconverted_past_the_sample_bound() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("s.dat");
        let n = MAX_EXTRA_SAMPLES as u64 + 1_001;
        let (host_ticks, _) = drifting_points(&out, n, |_| 0);
        assert_eq!(host_ticks, 1_000, "the records past the bound");
        let layout = read_layout(&out).unwrap();
        let body = &layout.options_with(option::TIME_SHIFT).next().unwrap().data;
        let samples: usize = decode(body).unwrap().cpus.iter().map(Vec::len).sum();
        assert!(samples <= MAX_EXTRA_SAMPLES + 4, "{samples} samples");
        let got = host_times(&out);
        assert_eq!(got.len() as u64, n);
        assert!(
            got.iter().zip(0..).all(|(&(_, h, _), i)| h == 100 + 9 * i),
            "every record at its host tick, in order"
        );
    }

    /// A new offset in each new round is the host's doing (it makes the rounds), never bounded:
    /// more rounds than [`MAX_EXTRA_SAMPLES`], each at its own offset, stay raw guest ticks.
    #[test]
    fn an_offset_per_round_is_not_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("r.dat");
        let n = MAX_EXTRA_SAMPLES as u64 + 1_000;
        assert_eq!(
            drifting_points(&out, n, |i| i),
            (0, 0),
            "nothing pre-converted"
        );
        let got = host_times(&out);
        assert_eq!(got.len() as u64, n);
        assert!(
            got.iter()
                .zip(0..)
                .all(|(&(c, h, _), i)| c == 0 && h == 100 + 9 * i)
        );
    }
}
