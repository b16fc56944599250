//! CTF 1.8 trace directories (TSDL `metadata` plus one binary stream file per vCPU), the
//! format babeltrace2 2.0 and Trace Compass read. No Rust crate writes CTF; the layout is
//! small (`docs/ctf.md`, "Layout").
//!
//! **Clock.** Timestamps are host TSC cycles, exactly the host ticks `vmtsync record`
//! computed, on a clock class `host_tsc` with `freq` = the host's TSC frequency (integer Hz,
//! from CPUID unless given), `offset_s = 0`, `offset = 0` and `absolute = true`. babeltrace2
//! shows the cycles as they are (`--clock-cycles`) and derives nanoseconds from them; two
//! traces written with the same frequency (a guest's and the host's kvm_pio exits) line up on
//! one timeline because both clock classes are absolute.
//!
//! **Order.** babeltrace2 requires non-decreasing timestamps within a stream. Host times of
//! one vCPU's events can step back where one sync segment hands over to the next; such an
//! event's timestamp is raised to the previous one (counted in [`CtfSummary::raised`]) while
//! its `host_tsc` field keeps the exact value.
//!
//! **Memory.** One packet buffer per stream ([`PACKET_BYTES`] for the first
//! [`BACKGROUND_STREAMS`], [`DIRECT_PACKET_BYTES`] after them), at most [`MAX_STREAMS`]
//! streams: constant in the number of events. The trace is written into a temporary directory
//! beside the target and renamed into place when complete.
//!
//! **Writing.** The first [`BACKGROUND_STREAMS`] streams (the vCPUs of most traces) hand their
//! full packets to a [`BackgroundFile`]: a thread writes them while the caller fills the next,
//! and a second one syncs every 16 MiB, so the sync before the rename finds little left. The
//! streams after them write their packets themselves: two threads per stream would not stay
//! few at [`MAX_STREAMS`]. A writer that already runs beside what produces its events (a
//! memory recording's writer thread) has those first streams write their packets itself, still
//! synced by a thread each, the first sync 50 ms after the first write
//! ([`CtfTrace::write_here`], [`crate::atomic_file::SYNC_START`]): a third busy thread on few
//! cores would only wait for the other two.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use super::event::{Bound, ExportError, ExportEvent, MAX_PAYLOAD, Payload};
use crate::atomic_file::BackgroundFile;

/// The CTF packet magic.
const MAGIC: u32 = 0xC1FC_1FC1;
/// Bytes of packet header and context (see [`Stream::flush`]).
const PACKET_HEADER: usize = 56;
/// The compact event header holds a timestamp's low 31 bits: the step from the previous event
/// of the packet must be below this.
const COMPACT_SPAN: u64 = 1 << 31;
/// A packet of one of the first [`BACKGROUND_STREAMS`] streams is written when its buffer
/// reaches this size: each packet is one write, and with 64 KiB packets the writes' own costs
/// (a system call and the file's bookkeeping each) were a large part of a memory recording's
/// CPU (docs/ctf.md).
pub const PACKET_BYTES: usize = 1 << 20;
/// The packet size of the streams after the first [`BACKGROUND_STREAMS`] (which hold a buffer
/// each for as many as [`MAX_STREAMS`]: their memory stays small).
pub const DIRECT_PACKET_BYTES: usize = 64 * 1024;
/// The room kept after a packet's bytes (its buffer is this much larger than
/// the stream's packet size): every event of fixed-size fields (a header and at most
/// [`FIELDS_MAX`] + [`MAX_PAYLOAD`] bytes) is written straight into it.
const EVENT_ROOM: usize = 256;
/// The most streams (vCPUs, host CPUs) a trace holds: bounds memory whatever the input says.
pub const MAX_STREAMS: usize = 512;
/// The streams whose packets are written by a thread of their own (see the module docs).
pub const BACKGROUND_STREAMS: usize = 8;

/// Who writes a stream's packets: the caller with no syncing thread (the streams past
/// [`BACKGROUND_STREAMS`]), a writing thread, or the caller with a syncing thread
/// ([`CtfTrace::write_here`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Writes {
    Direct,
    Thread,
    Here,
}

/// Where a stream's packets go.
#[derive(Debug)]
enum Sink {
    /// Written by the caller.
    Direct(File),
    /// Handed to a writing thread, or written on the caller's thread and synced in the
    /// background ([`BackgroundFile::on_this_thread`]).
    Background(BackgroundFile<File>),
}

/// The host's TSC frequency in Hz, the same on every call on one boot of one host: the
/// kernel's own `tsc_khz` as its log states it (`tsc: Refined TSC clocksource calibration`, else
/// `tsc: Detected ... MHz TSC|processor`, read from `/dev/kmsg`), else CPUID (leaf 0x15, the
/// hypervisor timing leaf, the nominal base frequency). The kernel's value comes first because
/// it is what the host's own clocks (and trace-cmd's `--tsc2nsec`) use; CPUID reports none on
/// some hypervisors (this project's machine among them).
///
/// # Errors
/// [`ExportError::Unsupported`] when neither says (give `--tsc-hz`).
pub fn host_tsc_hz() -> Result<u64, ExportError> {
    if let Some(khz) = kernel_tsc_khz() {
        return Ok(khz * 1000);
    }
    #[cfg(target_arch = "x86_64")]
    {
        use vmtsync_core::arch::cpuid::tsc_freq;
        use vmtsync_core::arch::x86_64::NativeCpuid;
        if let Some(f) = tsc_freq(&NativeCpuid) {
            return Ok(f.hz);
        }
    }
    Err(ExportError::Unsupported(
        "neither the kernel log (/dev/kmsg: no \"tsc:\" line, or it has been overwritten) nor CPUID states the host's TSC frequency: give it with --tsc-hz".into(),
    ))
}

/// The kernel's TSC frequency in kHz from its log, if the boot messages are still there.
fn kernel_tsc_khz() -> Option<u64> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
        .ok()?;
    let mut best = None;
    let mut buf = vec![0u8; 8192];
    // One record per read; EPIPE means records were overwritten meanwhile (read on), EAGAIN
    // the end of the log. The bound keeps a log that never ends from holding us.
    for _ in 0..1_000_000 {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let rec = String::from_utf8_lossy(&buf[..n]);
                let msg = rec.split_once(';').map_or(&*rec, |(_, m)| m);
                if let Some(k) = tsc_khz_from_log(msg.trim_end()) {
                    best = Some(best.map_or(k, |b: (u8, u64)| if k.0 >= b.0 { k } else { b }));
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
            Err(_) => break,
        }
    }
    best.map(|(_, khz)| khz)
}

/// A kernel log line stating the TSC frequency: (priority, kHz). A refined calibration
/// replaces the detected value; "MHz TSC" is stated only when it differs from the processor's.
fn tsc_khz_from_log(msg: &str) -> Option<(u8, u64)> {
    let (prio, rest) =
        if let Some(r) = msg.strip_prefix("tsc: Refined TSC clocksource calibration: ") {
            (2, r.strip_suffix(" MHz")?)
        } else if let Some(r) = msg.strip_prefix("tsc: Detected ") {
            if let Some(r) = r.strip_suffix(" MHz TSC") {
                (1, r)
            } else {
                (0, r.strip_suffix(" MHz processor")?)
            }
        } else {
            return None;
        };
    // The kernel prints `khz / 1000`, a dot, and `khz % 1000` in three digits.
    let (mhz, frac) = rest.split_once('.')?;
    if frac.len() != 3 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let khz = mhz.parse::<u64>().ok()?.checked_mul(1000)? + frac.parse::<u64>().ok()?;
    (khz > 0).then_some((prio, khz))
}

/// What a CTF trace directory holds about its clock and origin.
#[derive(Clone, Debug)]
pub struct CtfOptions {
    /// The host TSC frequency in Hz (the clock class's `freq`).
    pub tsc_hz: u64,
    /// `env.trace_name`: how babeltrace2 names the trace.
    pub name: String,
    /// More `env` entries (key, value), e.g. the input file.
    pub env: Vec<(String, String)>,
}

/// What a finished trace holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CtfSummary {
    /// Events written.
    pub events: u64,
    /// Streams (one per vCPU or host CPU).
    pub streams: usize,
    /// Events whose timestamp was raised to the previous one of their stream (their
    /// `host_tsc` field holds the exact value).
    pub raised: u64,
    /// The directory.
    pub dir: PathBuf,
}

/// One stream file with the packet being filled.
#[derive(Debug)]
struct Stream {
    sink: Sink,
    path: PathBuf,
    instance: u32,
    /// The packet being filled: its first `used` bytes (the header's, filled in by
    /// [`Self::flush`], then the events'); at least [`EVENT_ROOM`] more follow.
    buf: Vec<u8>,
    /// The size at which its packet is written ([`PACKET_BYTES`] or [`DIRECT_PACKET_BYTES`]).
    packet_bytes: usize,
    used: usize,
    begin: u64,
    last: u64,
    seq: u64,
    in_packet: u64,
}

impl Stream {
    /// Stream `instance` of the trace being written in `dir`, its packets written as
    /// `writes` says.
    fn new(dir: &Path, prefix: &str, instance: u32, writes: Writes) -> io::Result<Self> {
        let path = dir.join(format!("{prefix}{instance}"));
        let file = File::create_new(&path)?;
        let packet_bytes = match writes {
            Writes::Direct => DIRECT_PACKET_BYTES,
            Writes::Thread | Writes::Here => PACKET_BYTES,
        };
        let len = packet_bytes + EVENT_ROOM;
        let (sink, buf) = match writes {
            Writes::Direct => (Sink::Direct(file), vec![0; len]),
            Writes::Thread => {
                let (w, buf) = BackgroundFile::new(file, len)?;
                (Sink::Background(w), buf)
            }
            Writes::Here => {
                let (w, buf) = BackgroundFile::on_this_thread(file, len)?;
                (Sink::Background(w), buf)
            }
        };
        Ok(Self {
            sink,
            path,
            instance,
            buf,
            packet_bytes,
            used: PACKET_HEADER,
            begin: 0,
            last: 0,
            seq: 0,
            in_packet: 0,
        })
    }

    /// The `n` bytes after the packet's (grown for an event longer than [`EVENT_ROOM`]).
    #[inline]
    fn room(&mut self, n: usize) -> &mut [u8] {
        let end = self.used + n;
        if self.buf.len() < end {
            self.buf.resize(end, 0);
        }
        &mut self.buf[self.used..end]
    }

    /// Writes the packet once it reaches the stream's packet size.
    #[inline]
    fn flush_when_full(&mut self) -> Result<(), ExportError> {
        if self.used < self.packet_bytes {
            return Ok(());
        }
        self.flush().map_err(|source| ExportError::Write {
            path: self.path.clone(),
            source,
        })
    }

    /// Writes the packet: header (magic, stream class 0, instance) and context (first and
    /// last timestamps, content and packet size in bits, sequence number), then the events.
    fn flush(&mut self) -> io::Result<()> {
        if self.in_packet == 0 {
            return Ok(());
        }
        let bits = (self.used as u64) * 8;
        let mut h = [0u8; PACKET_HEADER];
        h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        h[4..8].copy_from_slice(&0u32.to_le_bytes());
        h[8..16].copy_from_slice(&u64::from(self.instance).to_le_bytes());
        h[16..24].copy_from_slice(&self.begin.to_le_bytes());
        h[24..32].copy_from_slice(&self.last.to_le_bytes());
        h[32..40].copy_from_slice(&bits.to_le_bytes());
        h[40..48].copy_from_slice(&bits.to_le_bytes());
        h[48..56].copy_from_slice(&self.seq.to_le_bytes());
        self.buf[..PACKET_HEADER].copy_from_slice(&h);
        match &mut self.sink {
            Sink::Direct(f) => f.write_all(&self.buf[..self.used])?,
            Sink::Background(w) => {
                let next = w.submit(std::mem::take(&mut self.buf), self.used)?;
                self.buf = next;
            }
        }
        if self.buf.len() < self.packet_bytes + EVENT_ROOM {
            self.buf.resize(self.packet_bytes + EVENT_ROOM, 0);
        }
        self.used = PACKET_HEADER;
        self.seq += 1;
        self.in_packet = 0;
        Ok(())
    }
}

/// A CTF trace directory being written: one stream class whose event classes are given as
/// TSDL, stream files created as instances appear.
#[derive(Debug)]
pub struct CtfTrace {
    tmp: Option<tempfile::TempDir>,
    target: PathBuf,
    metadata: String,
    prefix: &'static str,
    /// Few in practice (one per vCPU): a list, the last one used checked first.
    streams: Vec<Stream>,
    last: usize,
    events: u64,
    raised: u64,
    /// Streams write their packets on the caller's thread ([`Self::write_here`]).
    here: bool,
}

impl CtfTrace {
    /// The streams created from now on write their packets on the caller's thread (the first
    /// [`BACKGROUND_STREAMS`] with their data synced in the background, as every stream after
    /// them already writes): for a caller that already runs beside what produces its events.
    pub fn write_here(&mut self) {
        self.here = true;
    }

    /// Starts a trace that becomes directory `target` (which must not exist, or be empty).
    /// `events_tsdl` declares the event classes of stream class 0 (ids from 0, in the order
    /// [`CtfTrace::event`] is called with); `prefix` names the stream files.
    ///
    /// # Errors
    /// The target exists and is not an empty directory, or the temporary directory beside it
    /// cannot be made.
    pub fn create(
        target: &Path,
        opts: &CtfOptions,
        events_tsdl: &str,
        prefix: &'static str,
    ) -> Result<Self, ExportError> {
        let werr = |source| ExportError::Write {
            path: target.to_owned(),
            source,
        };
        if opts.tsc_hz == 0 {
            return Err(ExportError::Unsupported(
                "a TSC frequency of 0 Hz: give the host's with --tsc-hz".into(),
            ));
        }
        match std::fs::read_dir(target).map(|mut d| d.next().is_none()) {
            Ok(true) => {}
            Ok(false) => {
                return Err(ExportError::Unsupported(format!(
                    "{} exists and is not empty: a CTF trace is a directory of its own",
                    target.display()
                )));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) if target.is_file() || e.kind() == io::ErrorKind::NotADirectory => {
                return Err(ExportError::Unsupported(format!(
                    "{} is a file: a CTF trace is a directory",
                    target.display()
                )));
            }
            Err(e) => return Err(werr(e)),
        }
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let name = target
            .file_name()
            .map_or_else(|| "ctf".into(), |n| n.to_string_lossy().into_owned());
        let tmp = tempfile::Builder::new()
            .prefix(&format!(".{name}."))
            .suffix(".partial")
            .tempdir_in(parent)
            .map_err(werr)?;
        Ok(Self {
            tmp: Some(tmp),
            target: target.to_owned(),
            metadata: metadata(opts, events_tsdl),
            prefix,
            streams: Vec::new(),
            last: 0,
            events: 0,
            raised: 0,
            here: false,
        })
    }

    /// Appends one event of class `class` at host tick `ts` to stream `instance` with its
    /// `fields`, behind a compact header (class 0, a step below 2^31 ticks from the packet's
    /// previous event) or an extended one (`docs/ctf.md`, "Layout"). A timestamp before the
    /// stream's previous one is raised to it; returns whether it was.
    ///
    /// # Errors
    /// Writing a packet failed, or the trace would exceed [`MAX_STREAMS`].
    pub fn event(
        &mut self,
        instance: u32,
        class: u8,
        ts: u64,
        fields: &Fields,
    ) -> Result<bool, ExportError> {
        self.event_with(instance, class, ts, FIELDS_MAX + MAX_PAYLOAD, |d| {
            // The whole array (a fixed-size copy); only the fields' length counts.
            if let Some(d) = d.first_chunk_mut::<{ FIELDS_MAX + MAX_PAYLOAD }>() {
                *d = fields.b;
            }
            fields.n
        })
    }

    /// One event whose fields `put` writes into the `room` bytes after its header (returning
    /// how many it wrote): see [`Self::event`].
    #[inline(always)]
    fn event_with(
        &mut self,
        instance: u32,
        class: u8,
        ts: u64,
        room: usize,
        put: impl FnOnce(&mut [u8]) -> usize,
    ) -> Result<bool, ExportError> {
        if self
            .streams
            .get(self.last)
            .is_none_or(|s| s.instance != instance)
        {
            self.last = self.stream_index(instance)?;
        }
        let s = &mut self.streams[self.last];
        let raised = s.seq + s.in_packet > 0 && ts < s.last;
        let ts = if raised { s.last } else { ts };
        if s.in_packet == 0 {
            s.begin = ts;
            s.last = ts;
        }
        // The compact header (4 bytes: kind bit 0, then the timestamp's low 31 bits, which
        // babeltrace2 extends from the previous event's timestamp) when the class is 0 and the
        // step from the previous event of the packet is below 2^31 ticks; else the extended
        // one (kind 1, the class, the whole timestamp). A packet's first event is always
        // extended, so no reader has to know what the packet context did to its clock.
        // `docs/ctf.md`, "Layout".
        let step = ts - s.last;
        let compact = class == 0 && s.in_packet > 0 && step < COMPACT_SPAN;
        let d = s.room(10 + room);
        let header = if compact {
            let word = (u32::try_from(ts & (COMPACT_SPAN - 1)).unwrap_or(0)) << 1;
            d[..4].copy_from_slice(&word.to_le_bytes());
            4
        } else {
            d[..2].copy_from_slice(&[1, class]);
            d[2..10].copy_from_slice(&ts.to_le_bytes());
            10
        };
        let n = put(&mut d[header..]);
        s.used += header + n;
        s.last = ts;
        s.in_packet += 1;
        self.events += 1;
        self.raised += u64::from(raised);
        s.flush_when_full()?;
        Ok(raised)
    }

    /// Appends events of class 0 to `instance`'s stream while each of `recs` in turn is one
    /// that [`Self::event_with`] would give a compact header: `event` gives its timestamp and
    /// what `put` needs (`None` ends the run), the timestamp not before the stream's last and
    /// less than 2^31 ticks after it, in a packet that holds an event already; `put` writes
    /// its fields into the `ROOM` bytes after the header and returns how many it wrote.
    /// Stops after the event that fills the packet (written out), so the next one, a
    /// packet's first, takes [`Self::event_with`]. Returns how many it appended. One loop
    /// with no call per event: the memory path's runs go through it.
    ///
    /// # Errors
    /// Writing the packet failed (the events before it count as appended).
    #[inline(always)]
    fn compact_while<R, E, const ROOM: usize>(
        &mut self,
        instance: u32,
        recs: &[R],
        event: impl Fn(&R) -> Option<(u64, E)>,
        put: impl Fn(&E, &mut [u8; ROOM]) -> usize,
    ) -> Result<usize, ExportError> {
        let Some(i) = self.streams.iter().position(|s| s.instance == instance) else {
            return Ok(0);
        };
        self.last = i;
        let s = &mut self.streams[i];
        let (mut used, mut last) = (s.used, s.last);
        let mut k = 0;
        if s.in_packet > 0 {
            for r in recs {
                // Wrapping: an event before the last shows as a step of 2^31 or more.
                let Some((ts, e)) = event(r).filter(|(t, _)| t.wrapping_sub(last) < COMPACT_SPAN)
                else {
                    break;
                };
                let Some((head, fields)) = s
                    .buf
                    .get_mut(used..)
                    .and_then(|tail| tail.split_first_chunk_mut::<4>())
                else {
                    break;
                };
                let Some(fields) = fields.first_chunk_mut::<ROOM>() else {
                    break;
                };
                let word = (u32::try_from(ts & (COMPACT_SPAN - 1)).unwrap_or(0)) << 1;
                *head = word.to_le_bytes();
                used += 4 + put(&e, fields);
                last = ts;
                k += 1;
                if used >= s.packet_bytes {
                    break;
                }
            }
        }
        (s.used, s.last) = (used, last);
        s.in_packet += k as u64;
        self.events += k as u64;
        s.flush_when_full()?;
        Ok(k)
    }

    /// The index of `instance`'s stream, created (with its file) if new.
    fn stream_index(&mut self, instance: u32) -> Result<usize, ExportError> {
        if let Some(i) = self.streams.iter().position(|s| s.instance == instance) {
            return Ok(i);
        }
        let Some(dir) = self.tmp.as_ref() else {
            return Err(ExportError::Unsupported("trace already finished".into()));
        };
        if self.streams.len() >= MAX_STREAMS {
            return Err(ExportError::Unsupported(format!(
                "more than {MAX_STREAMS} streams (vCPU {instance}): is the input damaged?"
            )));
        }
        // Threads of their own only for the first streams, so they stay few.
        let writes = match (self.streams.len() < BACKGROUND_STREAMS, self.here) {
            (false, _) => Writes::Direct,
            (true, false) => Writes::Thread,
            (true, true) => Writes::Here,
        };
        let s = Stream::new(dir.path(), self.prefix, instance, writes).map_err(|source| {
            ExportError::Write {
                path: self.target.clone(),
                source,
            }
        })?;
        self.streams.push(s);
        Ok(self.streams.len() - 1)
    }

    /// Writes the last packets and the metadata, syncs, and renames the directory into place.
    ///
    /// # Errors
    /// Writing, syncing or renaming failed (the target is then unchanged).
    pub fn finish(mut self) -> Result<CtfSummary, ExportError> {
        let Some(tmp) = self.tmp.take() else {
            return Err(ExportError::Unsupported("trace already finished".into()));
        };
        let werr = |path: &Path| {
            let path = path.to_owned();
            move |source| ExportError::Write { path, source }
        };
        let mut streams = 0;
        for s in std::mem::take(&mut self.streams) {
            let mut s = s;
            s.flush().map_err(werr(&s.path))?;
            let file = match s.sink {
                Sink::Direct(f) => f,
                Sink::Background(w) => w.finish().map_err(werr(&s.path))?,
            };
            file.sync_all().map_err(werr(&s.path))?;
            streams += 1;
        }
        let meta = tmp.path().join("metadata");
        let mut f = File::create_new(&meta).map_err(werr(&meta))?;
        f.write_all(self.metadata.as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(werr(&meta))?;
        // An empty directory at the target is replaced (rename(2) allows that).
        std::fs::rename(tmp.path(), &self.target).map_err(werr(&self.target))?;
        let _ = tmp.keep();
        Ok(CtfSummary {
            events: self.events,
            streams,
            raised: self.raised,
            dir: self.target.clone(),
        })
    }
}

/// A TSDL string literal's contents: `"` and `\` escaped, control characters dropped.
fn tsdl_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                o.push('\\');
                o.push(c);
            }
            c if c.is_control() => o.push(' '),
            c => o.push(c),
        }
    }
    o
}

/// The metadata: integer types, the trace and its packet header, `env`, the host TSC clock,
/// stream class 0 (packet context, the compact or extended event header: see [`CtfTrace::event`])
/// and the caller's event classes.
fn metadata(opts: &CtfOptions, events_tsdl: &str) -> String {
    let mut m = String::from(
        "/* CTF 1.8 */\n\
         /* Written by vmtsync: timestamps are host TSC cycles (see vmtsync's docs/ctf.md). */\n\n\
         typealias integer { size = 8; align = 8; signed = false; } := uint8_t;\n\
         typealias integer { size = 16; align = 8; signed = false; } := uint16_t;\n\
         typealias integer { size = 32; align = 8; signed = false; } := uint32_t;\n\
         typealias integer { size = 64; align = 8; signed = false; } := uint64_t;\n\n\
         trace {\n\
         \tmajor = 1;\n\
         \tminor = 8;\n\
         \tbyte_order = le;\n\
         \tpacket.header := struct {\n\
         \t\tuint32_t magic;\n\
         \t\tuint32_t stream_id;\n\
         \t\tuint64_t stream_instance_id;\n\
         \t};\n\
         };\n\n\
         env {\n\
         \tdomain = \"vmtsync\";\n\
         \ttracer_name = \"vmtsync\";\n",
    );
    let _ = writeln!(m, "\ttrace_name = \"{}\";", tsdl_str(&opts.name));
    for (k, v) in &opts.env {
        // Keys are identifiers: keep only what TSDL allows.
        let k: String = k
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let _ = writeln!(m, "\t{k} = \"{}\";", tsdl_str(v));
    }
    let _ = write!(
        m,
        "}};\n\n\
         clock {{\n\
         \tname = host_tsc;\n\
         \tdescription = \"host TSC (trace-cmd's x86-tsc clock)\";\n\
         \tfreq = {};\n\
         \toffset_s = 0;\n\
         \toffset = 0;\n\
         \tprecision = 0;\n\
         \tabsolute = true;\n\
         }};\n\n\
         typealias integer {{ size = 64; align = 8; signed = false; map = clock.host_tsc.value; }} := host_tsc_t;\n\
         typealias integer {{ size = 31; align = 1; signed = false; map = clock.host_tsc.value; }} := host_tsc31_t;\n\n\
         stream {{\n\
         \tid = 0;\n\
         \tpacket.context := struct {{\n\
         \t\thost_tsc_t timestamp_begin;\n\
         \t\thost_tsc_t timestamp_end;\n\
         \t\tuint64_t content_size;\n\
         \t\tuint64_t packet_size;\n\
         \t\tuint64_t packet_seq_num;\n\
         \t}};\n\
         \tevent.header := struct {{\n\
         \t\tenum : integer {{ size = 1; align = 8; signed = false; }} {{ compact = 0, extended = 1 }} id;\n\
         \t\tvariant <id> {{\n\
         \t\t\tstruct {{ host_tsc31_t timestamp; }} compact;\n\
         \t\t\tstruct {{ uint8_t id; host_tsc_t timestamp; }} extended;\n\
         \t\t}} v;\n\
         \t}};\n\
         }};\n\n",
        opts.tsc_hz
    );
    m.push_str(events_tsdl);
    m
}

/// Which optional fields a guest trace's events carry (what the input knows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestFields {
    /// `guest_tsc`.
    pub guest_tsc: bool,
    /// How the guaranteed interval is carried.
    pub interval: Interval,
}

/// How a guest trace carries each event's guaranteed interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interval {
    /// `host_lo`, `host_hi` on every event.
    Fields,
    /// Every event's interval is its `host_tsc` alone (an exact recording): no field carries
    /// it, the trace's `env.vmtsync_interval` says `exact`, and an event whose interval is
    /// wider or unknown is refused, never written as exact.
    Exact,
    /// The input does not know it: no field, no claim.
    Unknown,
}

impl GuestFields {
    /// Everything (JSON Lines, `record --format ctf`).
    pub const ALL: Self = Self {
        guest_tsc: true,
        interval: Interval::Fields,
    };

    /// An exact recording's: the guest TSC, every interval its `host_tsc` ([`Interval::Exact`]).
    pub const EXACT: Self = Self {
        guest_tsc: true,
        interval: Interval::Exact,
    };

    /// What a source of `kind` knows.
    #[must_use]
    pub fn of(kind: super::InputKind) -> Self {
        match kind {
            super::InputKind::Jsonl => Self::ALL,
            super::InputKind::TraceDatShifted => Self {
                guest_tsc: true,
                interval: Interval::Unknown,
            },
            super::InputKind::TraceDatHost => Self {
                guest_tsc: false,
                interval: Interval::Unknown,
            },
        }
    }

    /// Whether events carry `host_lo`, `host_hi`.
    #[must_use]
    pub fn bound(self) -> bool {
        self.interval == Interval::Fields
    }
}

/// One event's fields (little-endian, byte-aligned, as its class's TSDL declares them),
/// built on the stack in a fixed-size array: copies of fixed sizes compile to a few moves,
/// which keeps the writer above 20 M events/s.
#[derive(Clone, Copy, Debug)]
pub struct Fields {
    b: [u8; FIELDS_MAX + MAX_PAYLOAD],
    n: usize,
}

/// The most bytes of fixed-size fields an event carries (before a payload).
pub const FIELDS_MAX: usize = 64;

impl Default for Fields {
    fn default() -> Self {
        Self {
            b: [0; FIELDS_MAX + MAX_PAYLOAD],
            n: 0,
        }
    }
}

impl Fields {
    /// Appends a fixed-size field; fields past [`FIELDS_MAX`] bytes are dropped (the classes
    /// here need at most 39).
    #[inline]
    pub fn put<const N: usize>(&mut self, v: [u8; N]) {
        if let Some(d) = self
            .b
            .get_mut(self.n..self.n + N)
            .filter(|_| self.n + N <= FIELDS_MAX)
        {
            d.copy_from_slice(&v);
            self.n += N;
        }
    }

    /// Appends a payload: its length byte, then its bytes.
    #[inline]
    pub fn put_payload(&mut self, p: &Payload) {
        self.put([p.len]);
        if let Some(d) = self.b.get_mut(self.n..self.n + MAX_PAYLOAD) {
            // All 16 bytes are copied (a fixed-size move); only `len` of them count.
            d.copy_from_slice(&p.bytes);
            self.n += usize::from(p.len);
        }
    }

    /// The bytes so far.
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        &self.b[..self.n]
    }
}

/// The most bytes of a `vmtsync:event`'s fields: id, vCPU, host and guest TSC, interval,
/// payload length and payload.
const GUEST_FIELDS_MAX: usize = 2 + 4 + 8 + 8 + 16 + 1 + MAX_PAYLOAD;

/// A `vmtsync:event`'s fields into `d`, as its class declares them: id, vCPU, host TSC, the
/// guest TSC and the interval's ends where the trace has them (`Some`), the length byte, then
/// all 16 payload bytes (a fixed-size move; only `len` count). Returns the bytes that count.
/// Inlined, each call site's fixed fields make its offsets constants.
#[inline(always)]
fn put_guest_fields(
    d: &mut [u8; GUEST_FIELDS_MAX],
    id: u16,
    vcpu: u32,
    host: u64,
    guest: Option<u64>,
    bound: Option<Bound>,
    payload: &Payload,
) -> usize {
    d[..2].copy_from_slice(&id.to_le_bytes());
    d[2..6].copy_from_slice(&vcpu.to_le_bytes());
    d[6..14].copy_from_slice(&host.to_le_bytes());
    let mut n = 14;
    if let Some(g) = guest {
        d[n..n + 8].copy_from_slice(&g.to_le_bytes());
        n += 8;
    }
    if let Some(bd) = bound {
        d[n..n + 8].copy_from_slice(&bd.lo.to_le_bytes());
        d[n + 8..n + 16].copy_from_slice(&bd.hi.to_le_bytes());
        n += 16;
    }
    d[n] = payload.len;
    d[n + 1..n + 1 + MAX_PAYLOAD].copy_from_slice(&payload.bytes);
    n + 1 + usize::from(payload.len)
}

/// An event at its exact host TSC, as [`GuestCtf::push_exact_while`] takes it.
#[derive(Clone, Copy, Debug)]
pub struct ExactEvent {
    /// The event id.
    pub id: u16,
    /// Its host TSC, its interval's both ends.
    pub host_tsc: u64,
    /// The guest TSC it was recorded at.
    pub guest_tsc: u64,
    /// Its payload.
    pub payload: Payload,
}

/// The name of the guest event class.
pub const GUEST_EVENT: &str = "vmtsync:event";

/// A guest trace: event class `vmtsync:event` with `id`, `vcpu`, `host_tsc`, then
/// `guest_tsc` and `host_lo`/`host_hi` when known, and the payload (`payload_len` bytes);
/// one stream per vCPU (`vcpuN`).
#[derive(Debug)]
pub struct GuestCtf {
    trace: CtfTrace,
    fields: GuestFields,
    /// Span records paired into span events ([`spans`]).
    spans: spans::Spans,
}

impl GuestCtf {
    /// Starts a guest trace at directory `target`.
    ///
    /// # Errors
    /// As [`CtfTrace::create`].
    pub fn create(
        target: &Path,
        opts: &CtfOptions,
        fields: GuestFields,
    ) -> Result<Self, ExportError> {
        let mut f = String::from("\t\tuint16_t id;\n\t\tuint32_t vcpu;\n\t\tuint64_t host_tsc;\n");
        if fields.guest_tsc {
            f.push_str("\t\tuint64_t guest_tsc;\n");
        }
        if fields.bound() {
            f.push_str("\t\tuint64_t host_lo;\n\t\tuint64_t host_hi;\n");
        }
        f.push_str("\t\tuint8_t payload_len;\n\t\tuint8_t payload[payload_len];\n");
        let mut tsdl = format!(
            "event {{\n\tname = \"{GUEST_EVENT}\";\n\tid = 0;\n\tstream_id = 0;\n\tfields := struct {{\n{f}\t}};\n}};\n"
        );
        tsdl.push_str(&spans::tsdl(fields));
        let mut opts = opts.clone();
        if fields.interval == Interval::Exact {
            opts.env.push(("vmtsync_interval".into(), "exact".into()));
        }
        Ok(Self {
            trace: CtfTrace::create(target, &opts, &tsdl, "vcpu")?,
            fields,
            spans: spans::Spans::default(),
        })
    }

    /// Every vCPU's stream writes its packets on the caller's thread ([`CtfTrace::write_here`]).
    pub fn write_here(&mut self) {
        self.trace.write_here();
    }

    /// Appends one event to its vCPU's stream (each vCPU's events in its own order); a span
    /// record is also paired into span events ([`spans`]).
    ///
    /// # Errors
    /// The event lacks a field the trace declares, or writing failed.
    #[inline(always)]
    pub fn push(&mut self, e: &ExportEvent) -> Result<(), ExportError> {
        // Most events are not span records: straight to their class (the per-event path).
        if e.is_span_record() {
            self.push_in_boot(e, 0)
        } else {
            self.push_event(e)
        }
    }

    /// The `vmtsync:event` of one event, its fields written straight into the packet (inlined
    /// into the caller, the event's fields are values in registers: building them in an
    /// array first and copying that on waited on a store-forwarding stall per event, the
    /// writer's costliest instruction by `perf`).
    #[inline(always)]
    fn push_event(&mut self, e: &ExportEvent) -> Result<(), ExportError> {
        let guest = declared(self.fields.guest_tsc, e.guest_tsc, "a guest TSC")?;
        let bound = declared(self.fields.bound(), e.bound, "its interval")?;
        let (id, vcpu, host, payload) = (e.id, e.vcpu, e.host_tsc, &e.payload);
        if self.fields.interval == Interval::Exact {
            exact_at(e.bound, host)?;
        }
        self.trace
            .event_with(vcpu, 0, host, GUEST_FIELDS_MAX, |d| {
                d.first_chunk_mut::<GUEST_FIELDS_MAX>().map_or(0, |d| {
                    put_guest_fields(d, id, vcpu, host, guest, bound, payload)
                })
            })?;
        Ok(())
    }

    /// Whether [`Self::push_exact_while`] writes events: a trace that declares each event's
    /// guest TSC and every interval exact (a memory recording in exact mode).
    #[must_use]
    pub fn takes_exact_runs(&self) -> bool {
        self.fields == GuestFields::EXACT
    }

    /// Appends events of vCPU `vcpu` while `event` gives each of `recs` in turn as an
    /// [`ExactEvent`] (`None` ends the run) that is not a span record and that its stream's
    /// packet takes with a compact header, in one loop ([`CtfTrace::compact_while`]); a trace
    /// that does not [take exact runs](Self::takes_exact_runs) takes none. Returns how many it
    /// appended: the record after them goes to [`Self::push`].
    ///
    /// # Errors
    /// Writing a packet failed.
    #[inline(always)]
    pub fn push_exact_while<R>(
        &mut self,
        vcpu: u32,
        recs: &[R],
        event: impl Fn(&R) -> Option<ExactEvent>,
    ) -> Result<usize, ExportError> {
        if !self.takes_exact_runs() {
            return Ok(0);
        }
        self.trace.compact_while::<R, ExactEvent, GUEST_FIELDS_MAX>(
            vcpu,
            recs,
            |r| {
                event(r)
                    .filter(|e| !crate::formats::event::is_span_id(e.id))
                    .map(|e| (e.host_tsc, e))
            },
            // As `push_event` writes an exact trace's event: a guest TSC, no interval fields.
            |e, d| {
                put_guest_fields(
                    d,
                    e.id,
                    vcpu,
                    e.host_tsc,
                    Some(e.guest_tsc),
                    None,
                    &e.payload,
                )
            },
        )
    }

    /// Finishes the trace (see [`CtfTrace::finish`]).
    ///
    /// # Errors
    /// As [`CtfTrace::finish`].
    pub fn finish(mut self) -> Result<CtfSummary, ExportError> {
        self.finish_spans()?;
        self.trace.finish()
    }
}

/// An event's interval in a trace that declares every interval exact: it must be its host
/// TSC alone.
#[inline(always)]
fn exact_at(bound: Option<Bound>, host: u64) -> Result<(), ExportError> {
    match bound {
        Some(b) if b.lo == host && b.hi == host => Ok(()),
        _ => Err(not_exact(bound, host)),
    }
}

#[cold]
#[inline(never)]
fn not_exact(bound: Option<Bound>, host: u64) -> ExportError {
    ExportError::Unsupported(match bound {
        Some(b) => format!(
            "an event at host TSC {host} with the interval [{}, {}] in a trace that declares every interval exact",
            b.lo, b.hi
        ),
        None => format!(
            "an event at host TSC {host} without an interval in a trace that declares every interval exact"
        ),
    })
}

/// An event's optional field where the trace's class has it or not: `None` where the class
/// leaves it out, the value where it declares it, and an error where it declares a field the
/// event lacks (`what`: the field, as the message names it).
#[inline(always)]
fn declared<T>(declares: bool, value: Option<T>, what: &str) -> Result<Option<T>, ExportError> {
    match (declares, value) {
        (false, _) => Ok(None),
        (true, Some(v)) => Ok(Some(v)),
        (true, None) => Err(ExportError::Unsupported(format!(
            "an event without {what} in a trace that declares one"
        ))),
    }
}

/// Exports a recording (`vmtsync export ctf --from IN --out DIR`): every event of `src` into
/// a guest trace at `out`.
///
/// # Errors
/// Reading the input or writing the trace failed; nothing is left at `out` then.
pub fn export_guest(
    mut src: super::EventSource,
    out: &Path,
    opts: &CtfOptions,
    spans: &crate::spans::SpanConfig,
) -> Result<CtfSummary, ExportError> {
    let mut w = GuestCtf::create(out, opts, GuestFields::of(src.kind()))?;
    w.set_spans(spans);
    while let Some(e) = src.next() {
        w.push_in_boot(&e?, src.boot())?;
    }
    w.finish()
}

/// The name of the host event class.
pub const PIO_EVENT: &str = "kvm:kvm_pio";

/// What [`export_kvm_pio`] found besides the events it wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PioSummary {
    /// The trace written.
    pub ctf: CtfSummary,
    /// Records with `kvm_pio`'s id that did not decode (too short, values out of range):
    /// skipped, never guessed.
    pub undecodable: u64,
    /// The clock the file states for its buffers when that is not `x86-tsc`. trace-cmd 3.1.6's
    /// `extract -B` states `local` for an instance on any clock (its timestamps are the
    /// instance's), so the statement cannot be trusted either way: the caller is warned.
    pub stated_clock: Option<String>,
}

/// Exports the `kvm:kvm_pio` exits of a host trace.dat (`trace-cmd record`/`extract` with the
/// x86-tsc clock, compressed or not) to a CTF trace whose clock is the same as a guest trace's:
/// event class `kvm:kvm_pio` with `cpu` (host CPU), `pid` (the vCPU thread), `rw` (0 in, 1
/// out), `port`, `size`, `count`, `val`; one stream per host CPU (`cpuN`; with several trace
/// buffers, one per buffer and CPU). Timestamps are the file's raw ticks, taken to be x86-tsc
/// (see [`PioSummary::stated_clock`]).
///
/// # Errors
/// The file is damaged, it has no `kvm_pio` format, or writing failed.
pub fn export_kvm_pio(
    input: &Path,
    out: &Path,
    opts: &CtfOptions,
) -> Result<PioSummary, ExportError> {
    use crate::formats::tracedat::reader::{for_each_record, read_event_formats, read_layout};
    use crate::ftrace::format::{EventFormat, KVM_PIO, KvmPioLayout, PioDirection};
    let unsupported = |reason: String| {
        ExportError::from(crate::formats::tracedat::TraceDatError::Unsupported {
            path: input.to_owned(),
            reason,
        })
    };
    let layout = read_layout(input)?;
    let with_data: Vec<(usize, u32)> = layout
        .buffers
        .iter()
        .enumerate()
        .flat_map(|(i, b)| {
            b.cpus
                .iter()
                .filter(|c| c.size > 0)
                .map(move |c| (i, c.cpu))
        })
        .collect();
    let stated_clock = with_data
        .iter()
        .filter_map(|&(i, _)| layout.buffers[i].clock.clone())
        .find(|c| c != "x86-tsc");
    let formats = read_event_formats(input, &layout)?;
    let Some(f) = formats
        .iter()
        .find(|f| f.system == "kvm" && f.name == KVM_PIO)
    else {
        return Err(unsupported(
            "no kvm:kvm_pio format in the file: record with -e kvm:kvm_pio".into(),
        ));
    };
    let pio = EventFormat::parse(&f.format)
        .and_then(|f| KvmPioLayout::new(&f))
        .map_err(|e| unsupported(e.to_string()))?;
    let tsdl = format!(
        "event {{\n\tname = \"{PIO_EVENT}\";\n\tid = 0;\n\tstream_id = 0;\n\tfields := struct {{\n\
         \t\tuint32_t cpu;\n\t\tuint32_t pid;\n\t\tuint8_t rw;\n\t\tuint16_t port;\n\
         \t\tuint32_t size;\n\t\tuint32_t count;\n\t\tuint32_t val;\n\t}};\n}};\n"
    );
    let mut w = CtfTrace::create(out, opts, &tsdl, "cpu")?;
    let one_buffer = with_data.iter().all(|&(i, _)| i == with_data[0].0);
    let mut undecodable = 0;
    let mut failed = None;
    let buffers: std::collections::BTreeSet<usize> = with_data.iter().map(|&(i, _)| i).collect();
    for b in buffers {
        for_each_record(input, &layout, b, |cpu, ts, data| {
            if failed.is_some() || data.get(..2) != Some(&pio.id.to_le_bytes()[..]) {
                return;
            }
            let Some(p) = pio.decode(data) else {
                undecodable += 1;
                return;
            };
            let instance = if one_buffer {
                cpu
            } else {
                u32::try_from(b).unwrap_or(u32::MAX).saturating_mul(1 << 16) | (cpu & 0xffff)
            };
            let mut f = Fields::default();
            f.put(cpu.to_le_bytes());
            f.put(p.pid.to_le_bytes());
            f.put([u8::from(p.direction == PioDirection::Out)]);
            f.put(p.port.to_le_bytes());
            f.put(p.size.to_le_bytes());
            f.put(p.count.to_le_bytes());
            f.put(p.val.to_le_bytes());
            let r = w.event(instance, 0, ts, &f);
            if let Err(e) = r {
                failed = Some(e);
            }
        })?;
    }
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(PioSummary {
        ctf: w.finish()?,
        undecodable,
        stated_clock,
    })
}

mod spans;

#[cfg(test)]
mod tests;
