//! Guest events as a Perfetto protobuf trace, on the host's CLOCK_BOOTTIME (docs/perfetto.md).
//!
//! The trace holds, on a separate machine (`TracePacket.machine_id`), one process track for
//! the guest and one child track per vCPU; each event is an instant on its vCPU's track, named
//! `event <id>`, with the guest TSC, the host TSC, the guaranteed interval mapped to BOOTTIME
//! and the payload as arguments. Timestamps are pre-converted: the host TSC of each event (the
//! recording's placement) goes through [`clock::BootClock`], the host's own TSC/BOOTTIME
//! snapshots. Perfetto's trace processor converts between clocks only by the offset at the
//! nearest earlier snapshot, which cannot follow the TSC's rate against BOOTTIME, so the
//! events carry BOOTTIME directly and line up with a host Perfetto trace recorded on BOOTTIME
//! (its default). No `RemoteClockSync` is written: the trace processor then leaves the guest
//! machine's timestamps as they are.
//!
//! The snapshots are written too, as clock snapshots pairing BOOTTIME with a sequence-scoped
//! clock 64 holding the host TSC (no packet is timestamped in it: they document the
//! conversion; the trace processor lists them in `clock_snapshot`).
//!
//! Memory is constant: packets are encoded one by one into one reused buffer (names interned
//! per vCPU sequence, one bit per event id) and streamed to a temporary file beside the
//! target, renamed into place by [`PerfettoWriter::finish`].

pub mod clock;
pub mod proto;
mod spans;

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

use self::clock::{BootClock, ClockError, ClockSnapshot, PairHint};
use self::proto::{
    Clock, ClockSnapshot as ClockSnapshotMsg, EventPacket, InternedData, InternedString,
    ProcessDescriptor, TracePacket, TracePacketDefaults, TrackDescriptor, TrackEventDefaults,
};
use super::event::{Bound, ExportError, ExportEvent, InputKind};
use crate::atomic_file::{AtomicFile, BackgroundFile};

/// The machine id of the guest's packets unless told otherwise (the host is 0).
pub const DEFAULT_MACHINE_ID: u32 = 1;

/// Packets are encoded straight into one buffer, written to the file when it holds this much.
/// The buffer has [`proto::EVENT_PACKET_MAX`] bytes more, so an event packet is always
/// encoded in place, right after the last one.
const BUFFER: usize = 1 << 20;

/// The packet sequence of the trace-wide packets (snapshots, the process track); the `n`-th
/// vCPU to appear writes on sequence `FIRST_VCPU_SEQUENCE + n`.
const META_SEQUENCE: u32 = 1;
/// See [`META_SEQUENCE`]; sequences go by the order vCPUs first appear, not by their number.
const FIRST_VCPU_SEQUENCE: u32 = 2;

/// What the trace describes.
#[derive(Clone, Debug)]
pub struct PerfettoOptions {
    /// The guest's machine id (not 0, the host's).
    pub machine_id: u32,
    /// The name of the guest's process track (e.g. the VM's name).
    pub guest_name: String,
    /// The host's TSC on BOOTTIME.
    pub clock: BootClock,
}

/// Why writing a Perfetto trace failed.
#[derive(Debug, Error)]
pub enum PerfettoError {
    /// Writing the file failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// Reading the input failed.
    #[error(transparent)]
    Input(#[from] ExportError),
    /// No TSC → BOOTTIME mapping.
    #[error(transparent)]
    Clock(#[from] ClockError),
    /// An event later than the host's TSC now: the input was recorded on another boot (or
    /// host), whose TSC this boot's clocks cannot map.
    #[error(
        "an event's host TSC {host_tsc} is later than this host's TSC now ({now}): the recording comes from another boot or host, and its TSC cannot be mapped to this boot's BOOTTIME (record with --format perfetto on the recording host instead)"
    )]
    NotThisBoot {
        /// The event's host TSC.
        host_tsc: u64,
        /// The host TSC at export.
        now: u64,
    },
    /// More distinct vCPUs than [`MAX_VCPUS`] in one input.
    #[error(
        "the input names more than {MAX_VCPUS} vCPUs (the next is vCPU {vcpu}): not a VM's recording"
    )]
    TooManyVcpus {
        /// The vCPU that would have been one too many.
        vcpu: u32,
    },
    /// Machine id 0 is the host's.
    #[error("machine id 0 is the host's: the guest needs another (e.g. 1)")]
    HostMachineId,
}

/// What [`PerfettoWriter::finish`] reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerfettoSummary {
    /// Events written.
    pub events: u64,
    /// Events (and spans, by an end) skipped because their host TSC maps outside BOOTTIME's
    /// 64-bit range.
    pub unmappable: u64,
    /// vCPU tracks.
    pub vcpus: u32,
    /// Bytes written.
    pub bytes: u64,
    /// The earliest and latest host TSC written.
    pub host_tsc_range: Option<(u64, u64)>,
    /// The largest [`BootClock::error_ns`] of any event written: how far a timestamp can be
    /// from BOOTTIME by the snapshots' resolutions alone (it grows with the distance from the
    /// snapshots, so an export long after the recording says so here).
    pub max_error_ns: u64,
}

/// Per-vCPU sequence state.
#[derive(Debug)]
struct Vcpu {
    vcpu: u32,
    /// The sequence's incremental clock ([`proto::CLOCK_EVENT_DELTA`]): the BOOTTIME of the
    /// latest event written in it.
    clock_ns: u64,
    /// Event ids whose name is interned on this sequence, one bit each.
    interned: Box<[u64; 1024]>,
}

/// A streaming writer of one Perfetto trace file.
#[derive(Debug)]
pub struct PerfettoWriter {
    /// The file, written on its own thread a buffer at a time (`spill`).
    out: BackgroundFile,
    path: PathBuf,
    opts: PerfettoOptions,
    vcpus: Vec<Vcpu>,
    /// `BUFFER + EVENT_PACKET_MAX` bytes, of which `used` are packets not written yet (always
    /// fewer than `BUFFER` between calls).
    buf: Vec<u8>,
    used: usize,
    /// Packets encoded by prost (or too large for the fast encoder), before they are copied.
    tmp: Vec<u8>,
    summary: PerfettoSummary,
    /// The earliest and latest host TSC written (the summary's range once one is).
    tsc_min: u64,
    tsc_max: u64,
    /// The snapshot pair the last conversion used.
    pair_hint: PairHint,
    /// Span records paired into slices ([`spans`]).
    spans: spans::Spans,
}

/// The uuid of the guest's process track: one per machine id.
fn process_uuid(machine_id: u32) -> u64 {
    0x766d_7473_0000_0000 | (u64::from(machine_id) << 20)
}

/// The uuid of the track of the `index`-th vCPU seen (below [`MAX_VCPUS`], so tracks of one
/// machine never meet the next machine's).
fn vcpu_uuid(machine_id: u32, index: usize) -> u64 {
    process_uuid(machine_id) + 1 + index as u64
}

/// The `index`-th vCPU's packet sequence.
fn vcpu_sequence(index: usize) -> u32 {
    FIRST_VCPU_SEQUENCE + u32::try_from(index).unwrap_or(0)
}

/// The most vCPUs one trace holds (KVM's limit on x86): the input is untrusted, and each vCPU
/// costs a sequence, a track and an 8 KiB interning bitmap.
pub const MAX_VCPUS: usize = 4096;

impl PerfettoWriter {
    /// Starts the trace at `path` (written beside it, renamed by [`Self::finish`]): the clock
    /// snapshots and the guest's process track.
    ///
    /// # Errors
    /// [`PerfettoError`].
    pub fn create(path: &Path, opts: PerfettoOptions) -> Result<Self, PerfettoError> {
        if opts.machine_id == 0 {
            return Err(PerfettoError::HostMachineId);
        }
        let io = |source| PerfettoError::Io {
            path: path.to_owned(),
            source,
        };
        let file = AtomicFile::new(path).map_err(io)?;
        let (out, buf) = BackgroundFile::new(file, BUFFER + proto::EVENT_PACKET_MAX).map_err(io)?;
        let mut w = Self {
            out,
            path: path.to_owned(),
            opts,
            vcpus: Vec::new(),
            buf,
            used: 0,
            tmp: Vec::new(),
            summary: PerfettoSummary::default(),
            tsc_min: u64::MAX,
            tsc_max: 0,
            pair_hint: PairHint::default(),
            spans: spans::Spans::default(),
        };
        let snaps = w.opts.clock.snapshots().to_vec();
        for (i, s) in snaps.iter().enumerate() {
            w.write_snapshot(s, i == 0)?;
        }
        let machine_id = w.opts.machine_id;
        let process = TracePacket {
            trusted_packet_sequence_id: Some(META_SEQUENCE),
            machine_id: Some(machine_id),
            track_descriptor: Some(TrackDescriptor {
                uuid: Some(process_uuid(machine_id)),
                name: Some(w.opts.guest_name.clone()),
                process: Some(ProcessDescriptor {
                    // The guest is not a host process: a pid in its own machine's space.
                    pid: Some(1),
                    process_name: Some(w.opts.guest_name.clone()),
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        w.write_packet(&process)?;
        Ok(w)
    }

    /// One clock snapshot packet: BOOTTIME and the host TSC (clock 64) read together.
    fn write_snapshot(&mut self, s: &ClockSnapshot, first: bool) -> Result<(), PerfettoError> {
        self.write_packet(&TracePacket {
            trusted_packet_sequence_id: Some(META_SEQUENCE),
            first_packet_on_sequence: first.then_some(true),
            sequence_flags: first.then_some(proto::SEQ_INCREMENTAL_STATE_CLEARED),
            clock_snapshot: Some(ClockSnapshotMsg {
                clocks: vec![
                    Clock {
                        clock_id: Some(proto::CLOCK_BOOTTIME),
                        timestamp: Some(s.boottime_ns),
                        is_incremental: None,
                    },
                    Clock {
                        clock_id: Some(proto::CLOCK_HOST_TSC),
                        timestamp: Some(s.tsc),
                        is_incremental: None,
                    },
                ],
            }),
            ..Default::default()
        })
    }

    /// A snapshot taken while streaming ([`BootClock::extend`]): host TSCs from it on convert
    /// through it, and the trace carries it like the first ones.
    ///
    /// # Errors
    /// [`PerfettoError`]: the snapshot is behind the clock's last one, or writing failed.
    pub fn add_snapshot(&mut self, s: ClockSnapshot) -> Result<(), PerfettoError> {
        self.opts.clock.extend(s)?;
        self.write_snapshot(&s, false)
    }

    fn write_packet(&mut self, p: &TracePacket) -> Result<(), PerfettoError> {
        let mut tmp = std::mem::take(&mut self.tmp);
        tmp.clear();
        proto::append_packet(p, &mut tmp);
        let r = self.put(&tmp);
        self.tmp = tmp;
        r
    }

    /// Appends encoded packets to the buffer (one larger than it in buffer-sized pieces).
    fn put(&mut self, bytes: &[u8]) -> Result<(), PerfettoError> {
        self.summary.bytes += bytes.len() as u64;
        for piece in bytes.chunks(BUFFER) {
            if self.used + piece.len() > BUFFER {
                self.spill(0)?;
            }
            if let Some(d) = self.buf.get_mut(self.used..self.used + piece.len()) {
                d.copy_from_slice(piece);
                self.used += piece.len();
            }
            self.spill(BUFFER)?;
        }
        Ok(())
    }

    /// Hands the buffered packets to the writing thread once they reach `at` bytes (and
    /// continues in the buffer it gives back).
    fn spill(&mut self, at: usize) -> Result<(), PerfettoError> {
        if self.used < at || self.used == 0 {
            return Ok(());
        }
        let full = std::mem::take(&mut self.buf);
        let r = self.out.submit(full, self.used);
        self.used = 0;
        match r {
            Ok(free) => {
                self.buf = free;
                Ok(())
            }
            Err(source) => Err(PerfettoError::Io {
                path: self.path.clone(),
                source,
            }),
        }
    }

    /// The index of `vcpu`'s state, starting its sequence on first use: its track descriptor,
    /// defaults (the track; timestamps on its incremental clock) and interned annotation
    /// names, then the snapshot that pins the incremental clock to BOOTTIME at `ts`, the
    /// first event's.
    #[inline]
    fn vcpu_index(&mut self, vcpu: u32, ts: u64) -> Result<usize, PerfettoError> {
        match self.vcpus.iter().position(|v| v.vcpu == vcpu) {
            Some(i) => Ok(i),
            None => self.start_vcpu(vcpu, ts),
        }
    }

    /// [`Self::vcpu_index`] for a vCPU not seen before (kept out of line: it runs once per
    /// vCPU, and inlined into [`Self::push`] it crowded the per-event path).
    #[cold]
    #[inline(never)]
    fn start_vcpu(&mut self, vcpu: u32, ts: u64) -> Result<usize, PerfettoError> {
        if self.vcpus.len() >= MAX_VCPUS {
            return Err(PerfettoError::TooManyVcpus { vcpu });
        }
        let machine_id = self.opts.machine_id;
        let index = self.vcpus.len();
        let seq = vcpu_sequence(index);
        let start = TracePacket {
            trusted_packet_sequence_id: Some(seq),
            machine_id: Some(machine_id),
            first_packet_on_sequence: Some(true),
            sequence_flags: Some(proto::SEQ_INCREMENTAL_STATE_CLEARED),
            trace_packet_defaults: Some(TracePacketDefaults {
                timestamp_clock_id: Some(proto::CLOCK_EVENT_DELTA),
                track_event_defaults: Some(TrackEventDefaults {
                    track_uuid: Some(vcpu_uuid(machine_id, index)),
                }),
            }),
            interned_data: Some(InternedData {
                debug_annotation_names: proto::ANNOTATIONS
                    .iter()
                    .zip(1u64..)
                    .map(|(n, iid)| InternedString {
                        iid: Some(iid),
                        name: Some((*n).to_owned()),
                    })
                    .collect(),
                ..Default::default()
            }),
            track_descriptor: Some(TrackDescriptor {
                uuid: Some(vcpu_uuid(machine_id, index)),
                parent_uuid: Some(process_uuid(machine_id)),
                name: Some(format!("vCPU {vcpu}")),
                ..Default::default()
            }),
            ..Default::default()
        };
        self.write_packet(&start)?;
        // A packet holds one payload (the snapshot cannot ride on the descriptor's packet).
        let pin = TracePacket {
            trusted_packet_sequence_id: Some(seq),
            machine_id: Some(machine_id),
            clock_snapshot: Some(ClockSnapshotMsg {
                clocks: vec![
                    Clock {
                        clock_id: Some(proto::CLOCK_BOOTTIME),
                        timestamp: Some(ts),
                        is_incremental: None,
                    },
                    Clock {
                        clock_id: Some(proto::CLOCK_EVENT_DELTA),
                        timestamp: Some(ts),
                        is_incremental: Some(true),
                    },
                ],
            }),
            ..Default::default()
        };
        self.write_packet(&pin)?;
        self.vcpus.push(Vcpu {
            vcpu,
            clock_ns: ts,
            interned: Box::new([0; 1024]),
        });
        self.summary.vcpus += 1;
        Ok(self.vcpus.len() - 1)
    }

    /// Writes one event (any order: the trace processor sorts; a vCPU's span records in its
    /// own order). Its arguments are what the input knows: the guest TSC and the guaranteed
    /// interval only when present. A span record is also paired into slices ([`spans`]).
    ///
    /// # Errors
    /// [`PerfettoError::Io`].
    #[inline(always)]
    pub fn push(&mut self, e: &ExportEvent) -> Result<(), PerfettoError> {
        // Most events are not span records: straight to their instant (the per-event path).
        if e.is_span_record() {
            self.push_in_boot(e, 0)
        } else {
            self.push_event(e)
        }
    }

    /// The instant of one event.
    #[inline(always)]
    fn push_event(&mut self, e: &ExportEvent) -> Result<(), PerfettoError> {
        self.instant(
            e.vcpu,
            e.id,
            e.host_tsc,
            e.guest_tsc,
            e.bound,
            e.payload.as_slice(),
        )
    }

    /// [`Self::push_event`] with the event's fields as values, inlined with it into the
    /// caller's loop: the event the caller builds stays in registers, and no call is made
    /// per event. (Passed by reference, the event went through memory, and the load of its
    /// id waited for the narrower stores that had just written it: a store-forwarding stall,
    /// measured with `perf` as the writer's costliest instruction.)
    #[inline(always)]
    fn instant(
        &mut self,
        vcpu: u32,
        id: u16,
        host_tsc: u64,
        guest_tsc: Option<u64>,
        bound: Option<Bound>,
        payload: &[u8],
    ) -> Result<(), PerfettoError> {
        let clock = &self.opts.clock;
        let hint = &mut self.pair_hint;
        // The trace processor keeps timestamps as signed 64-bit ns.
        let Some((ts, error)) = clock
            .boottime_and_error_near(host_tsc, hint)
            .filter(|&(t, _)| i64::try_from(t).is_ok())
        else {
            self.summary.unmappable += 1;
            return Ok(());
        };
        // The interval widened by what the snapshots' resolutions allow, so it still holds,
        // as distances from the timestamp (saturated: only wider). A match, not a closure:
        // the closure was a call per event (`perf`).
        let interval = match bound {
            None => None,
            // Width 0 (an exact recording): the timestamp widened by its error on both sides
            // (`BootClock::boottime_and_error_near`), with `ts` below 2^63.
            Some(b) if b.lo == host_tsc && b.hi == host_tsc => Some((
                i64::try_from(error.min(ts)).unwrap_or(i64::MAX),
                i64::try_from(error.min(u64::MAX - ts)).unwrap_or(i64::MAX),
            )),
            Some(b) => widened_distances(clock, b, ts, hint),
        };
        let i = self.vcpu_index(vcpu, ts)?;
        let v = &mut self.vcpus[i];
        let (word, bit) = (usize::from(id >> 6), 1u64 << (id & 63));
        let first_use = v.interned[word] & bit == 0;
        v.interned[word] |= bit;
        // On the incremental clock when not earlier than the previous event on it; else
        // BOOTTIME itself (the trace processor sorts).
        let absolute = ts < v.clock_ns;
        let timestamp = if absolute {
            ts
        } else {
            let d = ts - v.clock_ns;
            v.clock_ns = ts;
            d
        };
        let ev = EventPacket {
            timestamp,
            absolute,
            sequence: vcpu_sequence(i),
            machine_id: self.opts.machine_id,
            name_iid: u64::from(id) + 1,
            host_tsc,
            guest_tsc,
            interval,
            payload,
        };
        // Encoded in place after the buffered packets (`used < BUFFER` leaves room), unless it
        // is the first event of its id on this vCPU (it also interns the name) or has a
        // message of 128 bytes or more: prost writes those.
        let slot = self
            .buf
            .get_mut(self.used..self.used + proto::EVENT_PACKET_MAX)
            .and_then(|s| <&mut [u8; proto::EVENT_PACKET_MAX]>::try_from(s).ok());
        let written = match slot {
            Some(s) if !first_use => ev.write(s),
            _ => None,
        };
        match written {
            Some(n) => {
                self.used += n;
                self.summary.bytes += n as u64;
            }
            // By value: a reference would keep the packet's fields in memory on the hot path.
            None => self.write_event_by_prost(ev, first_use.then_some(id))?,
        }
        self.summary.events += 1;
        self.tsc_min = self.tsc_min.min(host_tsc);
        self.tsc_max = self.tsc_max.max(host_tsc);
        if self.used >= BUFFER {
            self.spill(0)?;
        }
        Ok(())
    }

    /// Writes an event packet through prost: the first of its id on its vCPU, which also
    /// interns the name (`intern`: the id), or one with a message of 128 bytes or more (out
    /// of line: rare).
    #[cold]
    #[inline(never)]
    fn write_event_by_prost(
        &mut self,
        ev: EventPacket<'_>,
        intern: Option<u16>,
    ) -> Result<(), PerfettoError> {
        let mut packet = ev.to_message();
        if let Some(id) = intern {
            packet.interned_data = Some(InternedData {
                event_names: vec![InternedString {
                    iid: Some(ev.name_iid),
                    name: Some(format!("event {id}")),
                }],
                ..Default::default()
            });
        }
        self.write_packet(&packet)
    }

    /// Flushes, syncs and renames the file into place.
    ///
    /// # Errors
    /// [`PerfettoError::Io`]; the target is then untouched.
    pub fn finish(mut self) -> Result<PerfettoSummary, PerfettoError> {
        self.finish_spans()?;
        self.spill(0)?;
        let path = self.path.clone();
        self.out
            .finish()
            .and_then(AtomicFile::commit)
            .map_err(|source| PerfettoError::Io { path, source })?;
        let mut s = self.summary;
        if s.events > 0 {
            let (a, b) = (self.tsc_min, self.tsc_max);
            s.host_tsc_range = Some((a, b));
            s.max_error_ns = self.opts.clock.error_ns(a).max(self.opts.clock.error_ns(b));
        }
        Ok(s)
    }
}

/// How far apart `export` takes its two clock snapshots: the rate they give is off by about
/// their resolutions over this span (a few ns over 200 ms: a few parts in 10^8).
pub const EXPORT_SNAPSHOT_SPAN: Duration = Duration::from_millis(200);

/// The host's TSC on BOOTTIME from two snapshots taken `span` apart, now.
///
/// # Errors
/// [`ClockError`].
pub fn boot_clock_now(span: Duration) -> Result<BootClock, ClockError> {
    let a = ClockSnapshot::take()?;
    std::thread::sleep(span);
    let b = ClockSnapshot::take()?;
    BootClock::new(vec![a, b])
}

/// What `vmtsync export perfetto` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSummary {
    /// The writer's summary.
    pub trace: PerfettoSummary,
    /// What the input was (and so which arguments the events carry).
    pub input: InputKind,
}

/// `vmtsync export perfetto --from IN --out OUT`: the events of a recording (JSON Lines or our
/// trace.dat, read by [`super::open`]) as a Perfetto trace, their host TSCs mapped to BOOTTIME
/// by snapshots taken now. That is right only for a recording made on this host since its last
/// boot (an event later than the TSC now is refused); the further back the recording, the more
/// the extrapolated rate can be off ([`ExportSummary`]'s `max_error_ns`, which also widens
/// every event's interval). `record --format perfetto` takes its snapshots while recording.
///
/// # Errors
/// [`PerfettoError`]; the target is then untouched.
pub fn export_file(
    from: &Path,
    out: &Path,
    machine_id: u32,
    guest_name: &str,
    spans: &crate::spans::SpanConfig,
) -> Result<ExportSummary, PerfettoError> {
    let source = super::open(from)?;
    let input = source.kind();
    let clock = boot_clock_now(EXPORT_SNAPSHOT_SPAN)?;
    let now = clock.snapshots().last().map_or(0, |s| s.tsc);
    let mut w = PerfettoWriter::create(
        out,
        PerfettoOptions {
            machine_id,
            guest_name: guest_name.to_owned(),
            clock,
        },
    )?;
    w.set_spans(spans);
    let mut source = source;
    while let Some(e) = source.next() {
        let e = e?;
        if e.host_tsc > now {
            return Err(PerfettoError::NotThisBoot {
                host_tsc: e.host_tsc,
                now,
            });
        }
        w.push_in_boot(&e, source.boot())?;
    }
    Ok(ExportSummary {
        trace: w.finish()?,
        input,
    })
}

/// An interval wider than its point, as distances from the timestamp `ts`: its ends on
/// BOOTTIME moved out by the snapshots' resolutions ([`BootClock::widened_ns`]), saturated
/// (only wider); `None` when an end maps outside the 64-bit range.
fn widened_distances(
    clock: &BootClock,
    b: Bound,
    ts: u64,
    hint: &mut PairHint,
) -> Option<(i64, i64)> {
    let (lo, hi) = clock.widened_ns(b.lo, b.hi, hint)?;
    let sat = |d: i128| i64::try_from(d).unwrap_or(if d < 0 { i64::MIN } else { i64::MAX });
    Some((
        sat(i128::from(ts) - i128::from(lo)),
        sat(i128::from(hi) - i128::from(ts)),
    ))
}

#[cfg(test)]
mod tests;
