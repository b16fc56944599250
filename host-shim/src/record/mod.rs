//! `vmtsync record`: one session that syncs the clocks and drains the guest's events into a
//! trace file (trace-cmd's trace.dat, JSON Lines or CTF).
//!
//! The session: hello, an initial sync round, then event drains
//! ([`ProbeSession::drain_events`]) interleaved with a re-sync round every `resync`, with the
//! same probe engine and estimators as `vmtsync probe --continuous` (each round becomes a
//! [`SyncSegment`]). It ends after `events` events, after `duration`, on the stop flag
//! (SIGINT/SIGTERM in the CLI) or when the agent ends the session; whatever was received is
//! written either way, and the summary says why it ended.
//!
//! Every event is placed with the segment that covers its guest tick (the last one whose
//! `guest_start` is at or before it; the first one before that), the same rule a sync file's
//! conversion and the trace.dat TIME_SHIFT use; its guaranteed host interval comes from
//! [`bounds::host_bounds`].
//!
//! Memory is constant in the number of events: JSON Lines are streamed; for trace.dat the events
//! go to a spool file (32 bytes each) and are written when the segments are all known, as raw
//! guest TSCs with a TIME_SHIFT when trace-cmd's reader represents the segments exactly (every
//! segment at identity rate), else pre-converted to host TSC (said in the file's UNAME and the
//! summary). Outputs are written beside the target and renamed into place when complete: the
//! target only ever holds a finished file; a killed run leaves `OUT.partial` (JSON Lines) with
//! every line flushed so far.

mod spool;

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use thiserror::Error;
use vmtsync_core::HostTicks;
use vmtsync_core::estimate::{EstimateError, ProbeSample};
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_core::proto::{EventBatch, EventClock};

use crate::formats::perfetto::PerfettoWriter;
use crate::formats::perfetto::clock::{BootClock, ClockSnapshot};
use crate::formats::tracedat::{
    self, FileVersion, ShiftMode, TimeShift, TraceDatWriter, WriterOptions,
};
use crate::link::ConnectOptions;
use crate::link::StampedTransport;
use crate::link::connect::{self};
use crate::probe::anchor;
use crate::probe::continuous::{Cumulative, segment};
use crate::probe::{
    ConsoleLog, ProbeError, ProbeLog, ProbeOptions, ProbeSession, ProbeSummary, Progress,
};
use crate::syncfile::{SyncHeader, SyncSegment, SyncWriter};

use crate::formats::jsonl::{EVENT_SCHEMA, JsonlWriter, Line};
use crate::syncfile::bounds::{self, Placement};

/// The output format of `vmtsync record`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RecordFormat {
    /// trace-cmd's trace.dat (`--file-version 6|7`).
    #[default]
    TraceCmd,
    /// One JSON object per event (schema in `docs/record.md`).
    Jsonl,
    /// A Perfetto protobuf trace on the host's CLOCK_BOOTTIME (`docs/perfetto.md`), mapped by
    /// TSC/BOOTTIME snapshots taken at every sync round.
    Perfetto,
    /// A CTF 1.8 trace directory on the host's TSC (`docs/ctf.md`).
    Ctf,
}

/// Everything `vmtsync record` needs.
#[derive(Clone, Debug)]
pub struct RecordOptions {
    /// Address, probes per round, timeouts, the stop flag, `--shutdown`.
    pub probe: ProbeOptions,
    /// The output file.
    pub out: PathBuf,
    /// Its format.
    pub format: RecordFormat,
    /// trace.dat version.
    pub file_version: FileVersion,
    /// Stop after this many events.
    pub events: Option<u64>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// Time between the starts of two sync rounds.
    pub resync: Duration,
    /// The most events one drain asks for (the CLI: [`DRAIN_MAX`]).
    pub drain_max: u32,
    /// A sync file to append each round's segment to as it is made (`--sync-out`), so the
    /// conversion the output used can be checked (`vmtsync validate`) or drawn (`plot`).
    pub sync_out: Option<PathBuf>,
    /// How events are placed (`--placement`, default two-sided).
    pub placement: Placement,
}

/// The most events one drain asks for: the bare-metal agent's whole ring (4096 records), so
/// one round trip takes everything waiting and a vsock agent sends it in a few packets (its
/// link coalesces the batches of one answer). The host holds at most `DRAIN_MAX / 64 + 1`
/// batches of one answer (about 170 KiB), whatever the guest sends.
pub const DRAIN_MAX: u32 = 4096;

/// Why a recording ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndReason {
    /// `--events N` reached.
    Events,
    /// `--duration` passed.
    Duration,
    /// The stop flag (SIGINT/SIGTERM).
    Stopped,
    /// The agent ended the session.
    AgentExited,
}

/// What a recording did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordSummary {
    /// Events written.
    pub events: u64,
    /// Events the guest's stop-when-full rings refused (their cumulative counters at the end).
    pub dropped: u64,
    /// Records the guest's flight-recorder rings overwrote before the agent sent them (exact:
    /// each gap in a flight ring's indices split into these and `lost`).
    pub overwritten: u64,
    /// Sync rounds that became segments.
    pub segments: u64,
    /// Of which started a new estimate (the relation changed).
    pub breaks: u64,
    /// Width (`host_hi - host_lo`) of the events' guaranteed intervals: min, median, max.
    pub widths: Option<(u64, u64, u64)>,
    /// Events stamped in the host clock by the agent (a mapping was pushed to it by someone
    /// else): skipped, since their guest tick is unknown.
    pub host_stamped_skipped: u64,
    /// Events whose host time leaves the 64-bit range (a guest clock no segment maps): skipped.
    pub unplaceable: u64,
    /// Events the agent sent that never arrived (a drain lost to a timeout or a corrupted
    /// frame), counted exactly from the batches' `first` index.
    pub lost: u64,
    /// Events received twice (skipped).
    pub replayed: u64,
    /// Drains that failed and were asked again.
    pub failed_drains: u64,
    /// trace.dat only: timestamps were pre-converted to host TSC (a segment's rate is not 1).
    pub preconverted: bool,
    /// trace.dat only: pre-converted timestamps that went backwards across a segment change and
    /// were raised to the previous one to keep the file in order (a raised timestamp can lie
    /// above its own guaranteed interval: the JSON Lines output has the intervals).
    pub clamped: u64,
    /// Why it ended.
    pub end: EndReason,
    /// The vCPU the agent runs on.
    pub vcpu: u32,
    /// Every vCPU synced (and whose events were accepted), in increasing order: the agent's
    /// own, or with an SMP agent every vCPU it serves (docs/smp.md).
    pub vcpus: Vec<u32>,
    /// The guest trace's TRACEID (trace.dat only; 0 for JSON Lines).
    pub trace_id: u64,
    /// The file written.
    pub out: PathBuf,
    /// Bytes of console text the guest printed between frames (docs/probe.md), and the file
    /// they were appended to (`--console`), if any.
    pub console_bytes: u64,
    /// `--console`'s file.
    pub console: Option<PathBuf>,
}

/// Why `vmtsync record` failed.
#[derive(Debug, Error)]
pub enum RecordError {
    /// The session failed (connect, hello, a probe round, a drain).
    #[error(transparent)]
    Probe(#[from] ProbeError),
    /// Writing the trace.dat failed.
    #[error(transparent)]
    TraceDat(#[from] tracedat::TraceDatError),
    /// Writing the Perfetto trace failed.
    #[error(transparent)]
    Perfetto(#[from] crate::formats::perfetto::PerfettoError),
    /// Writing the CTF trace failed.
    #[error(transparent)]
    Ctf(#[from] crate::formats::ExportError),
    /// Writing the output failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The agent records no events (its capabilities lack `EVENTS`).
    #[error(
        "the guest agent records no events (its capabilities lack EVENTS): link the vmtsync recorder into it (see vmtsync-core's recorder docs), or boot vmtsync-agent with workload= or events="
    )]
    NoEvents,
    /// No sync round produced a segment, so no event can be placed on the host timeline:
    /// `NoSamples` when every probe was lost, else why the last round's samples were refused.
    #[error(
        "no sync round produced a segment, so no event can be placed on the host timeline: {}",
        crate::probe::refusal_text(*.0)
    )]
    NoSync(EstimateError),
}

impl RecordError {
    fn io(path: &Path) -> impl FnOnce(io::Error) -> Self + '_ {
        move |source| Self::Io {
            path: path.to_owned(),
            source,
        }
    }
}

/// Connects to `opts.probe.addr` and records (see [`run_record_on`]).
///
/// # Errors
/// [`RecordError`].
pub fn run_record(
    opts: &RecordOptions,
    progress: &mut Progress,
) -> Result<RecordSummary, RecordError> {
    // Sync rounds are exit-anchored as `probe`'s are (docs/anchor.md), decided before
    // connecting so `--anchor kvm-pio` fails at once; the event drains in between pass through
    // unrefined.
    let note = &mut |m: &str| eprintln!("vmtsync: record: {m}");
    let setup = anchor::prepare(
        &opts.probe.addr,
        &opts.probe.anchor,
        opts.probe.connect_timeout,
        note,
    )?;
    let transport = connect::connect_until_stopped(
        &opts.probe.addr,
        &ConnectOptions {
            connect_timeout: opts.probe.connect_timeout,
            io_timeout: opts.probe.timeout,
        },
        opts.probe.stop,
    )
    .map_err(ProbeError::from)?;
    let mut t = setup.wrap(transport);
    let r = run_record_on(&mut t, opts, progress);
    if let Some(why) = t.gave_up() {
        note(&format!(
            "not exit-anchored: the agent's first exchange was not among the VM's UART exits ({why:?}); host stamps were taken in this process"
        ));
    }
    r
}

/// One event on its way to the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Placed<'a> {
    vcpu: u32,
    id: u16,
    guest: u64,
    payload: &'a [u8],
    host: u64,
    lo: u64,
    hi: u64,
    round: u64,
}

impl Placed<'_> {
    /// The event as a JSON Lines line.
    fn line(&self) -> Line {
        Line {
            schema: EVENT_SCHEMA,
            vcpu: self.vcpu,
            id: self.id,
            guest_tsc: self.guest,
            host_tsc: self.host,
            host_lo: self.lo,
            host_hi: self.hi,
            payload: crate::formats::Payload::new(self.payload).unwrap_or_default(),
            round: self.round,
        }
    }

    /// The event as the exporters see it (everything known).
    fn export(&self) -> crate::formats::ExportEvent {
        crate::formats::ExportEvent {
            vcpu: self.vcpu,
            id: self.id,
            guest_tsc: Some(self.guest),
            host_tsc: self.host,
            bound: Some(crate::formats::Bound {
                lo: self.lo,
                hi: self.hi,
            }),
            payload: crate::formats::Payload::new(self.payload).unwrap_or_default(),
        }
    }
}

/// Appends `p` to the JSON Lines output, an error naming the file being written.
fn jsonl_write(w: &mut JsonlWriter, p: &Placed<'_>) -> Result<(), RecordError> {
    w.write(&p.line()).map_err(|e| RecordError::io(w.path())(e))
}

/// The CTF output: the host's TSC frequency (`ctf::host_tsc_hz`), named after the directory.
fn create_ctf(opts: &RecordOptions) -> Result<crate::formats::ctf::GuestCtf, RecordError> {
    use crate::formats::ctf;
    let o = ctf::CtfOptions {
        tsc_hz: ctf::host_tsc_hz()?,
        name: opts
            .out
            .file_name()
            .map_or_else(|| "vmtsync".into(), |n| n.to_string_lossy().into_owned()),
        env: vec![("vmtsync_agent".into(), opts.probe.addr.to_string())],
    };
    Ok(ctf::GuestCtf::create(&opts.out, &o, ctf::GuestFields::ALL)?)
}

/// Where events go while recording.
enum Out {
    Jsonl(JsonlWriter),
    Ctf(crate::formats::ctf::GuestCtf),
    Spool(spool::Spool),
    /// Two-sided placement: every event is spooled and placed when the recording ends, with
    /// every round known; JSON Lines are also streamed to `OUT.partial` as soon as the round
    /// after them is known (`live`, with the spool index of the first event still waiting),
    /// so a killed run keeps all but the last round's events.
    Held {
        spool: spool::Spool,
        live: Option<(JsonlWriter, u64)>,
        ctf: Option<crate::formats::ctf::GuestCtf>,
    },
}

impl Out {
    /// A sync round was made: the JSON Lines events waiting for it are placed with it and
    /// written.
    fn round_made(&mut self, st: &State, opts: &RecordOptions) -> Result<(), RecordError> {
        let Self::Held {
            spool,
            live: Some((w, next)),
            ..
        } = self
        else {
            return Ok(());
        };
        for rec in spool.iter_from(*next).map_err(RecordError::io(&opts.out))? {
            let rec = rec.map_err(RecordError::io(&opts.out))?;
            *next += 1;
            if let Some(placed) = st.placed(&rec) {
                jsonl_write(w, &placed)?;
            }
        }
        w.flush().map_err(|e| RecordError::io(w.path())(e))
    }
}

/// Records over an open transport (see the module docs).
///
/// # Errors
/// [`RecordError`]; events received before a failure are still written.
pub fn run_record_on<T: StampedTransport>(
    transport: T,
    opts: &RecordOptions,
    progress: &mut Progress,
) -> Result<RecordSummary, RecordError> {
    let p = &opts.probe;
    let console = p.console.as_deref().map(ConsoleLog::create).transpose()?;
    let mut session = ProbeSession::hello_until_stopped(transport, p.timeout, p.stop, console)?;
    if let Some(path) = &p.probe_log {
        session.log_probes(ProbeLog::create(path, &p.addr, &p.anchor)?);
    }
    let session_vcpu = session.info().vcpu;
    if !session
        .info()
        .features
        .contains(vmtsync_core::proto::Features::EVENTS)
    {
        return Err(RecordError::NoEvents);
    }
    // Every vCPU the agent serves is synced on itself each round: a unikernel may record on
    // any of them, and each vCPU's TSC is its own clock (docs/smp.md).
    let vcpus = session.vcpus()?;
    let mut out = match opts.format {
        _ if opts.placement == Placement::TwoSided => Out::Held {
            spool: spool::Spool::new().map_err(RecordError::io(&opts.out))?,
            live: match opts.format {
                RecordFormat::Jsonl => Some((
                    JsonlWriter::create(&opts.out).map_err(RecordError::io(&opts.out))?,
                    0,
                )),
                _ => None,
            },
            ctf: match opts.format {
                RecordFormat::Ctf => Some(create_ctf(opts)?),
                _ => None,
            },
        },
        RecordFormat::Jsonl => {
            Out::Jsonl(JsonlWriter::create(&opts.out).map_err(RecordError::io(&opts.out))?)
        }
        RecordFormat::TraceCmd | RecordFormat::Perfetto => {
            Out::Spool(spool::Spool::new().map_err(RecordError::io(&opts.out))?)
        }
        RecordFormat::Ctf => Out::Ctf(create_ctf(opts)?),
    };
    let sync_out = match &opts.sync_out {
        Some(path) => Some(
            SyncWriter::open(path, &SyncHeader::now(p.addr.to_string()))
                .map_err(ProbeError::from)?,
        ),
        None => None,
    };
    let mut st = State {
        sync_out,
        vcpus: vcpus.iter().map(|&v| VcpuSync::new(v)).collect(),
        round: 0,
        breaks: 0,
        events: 0,
        host_stamped: 0,
        unplaceable: 0,
        lost: 0,
        replayed: 0,
        failed_drains: 0,
        widths: Widths::default(),
        clocks: Vec::new(),
        refused: None,
        placement: opts.placement,
    };
    let started = Instant::now();
    // The initial sync: nothing can be placed before it.
    let first = st.sync(&mut session, p);
    let end = match first {
        Ok(()) if st.segments() == 0 => {
            return Err(RecordError::NoSync(
                st.refused.unwrap_or(EstimateError::NoSamples),
            ));
        }
        Ok(()) => record_loop(&mut session, opts, &mut st, &mut out, started, progress),
        Err(ProbeError::Interrupted) => return Err(ProbeError::Interrupted.into()),
        Err(e) => return Err(e.into()),
    };
    progress.clear();
    let end = match end {
        Ok(end) => end,
        Err(e) => {
            // Whatever was received is written, then the error is reported.
            st.final_widths(&mut out);
            let _ = finish(out, opts, &st);
            return Err(e);
        }
    };
    if opts.placement == Placement::TwoSided
        && matches!(end, EndReason::Events | EndReason::Duration)
    {
        // One more round, so the last drain's events have a round after them too. It is not
        // needed for correctness: without it they keep the one-sided interval.
        if let Err(e) = st.sync(&mut session, p) {
            eprintln!(
                "vmtsync: warning: the closing sync round failed ({e}); the last events are placed from the rounds before them"
            );
        }
    }
    st.final_widths(&mut out);
    let console_bytes = if p.shutdown && end != EndReason::AgentExited {
        session.shutdown()
    } else {
        session.stats()
    }
    .console_bytes;
    let (preconverted, clamped) = finish(out, opts, &st)?;
    Ok(RecordSummary {
        events: st.events,
        dropped: st.vcpus.iter().map(|v| v.ledger.refused).sum(),
        overwritten: st.vcpus.iter().map(|v| v.ledger.overwritten).sum(),
        segments: st.segments(),
        breaks: st.breaks,
        widths: st.widths.summary(),
        lost: st.lost,
        replayed: st.replayed,
        failed_drains: st.failed_drains,
        host_stamped_skipped: st.host_stamped,
        unplaceable: st.unplaceable,
        preconverted,
        clamped,
        end,
        vcpu: session_vcpu,
        vcpus,
        trace_id: if opts.format == RecordFormat::TraceCmd {
            trace_id(opts, &st)
        } else {
            0
        },
        out: opts.out.clone(),
        console_bytes,
        console: p.console.clone(),
    })
}

/// One vCPU's part of a recording: its segments (its own clock's), its cumulative estimate,
/// and its event queue's counters (the agent counts each vCPU's `first` indices on their own).
struct VcpuSync {
    vcpu: u32,
    segments: Vec<SyncSegment>,
    cumulative: Cumulative,
    /// What its batches' indices and counters say was lost, and where.
    ledger: Ledger,
}

impl VcpuSync {
    fn new(vcpu: u32) -> Self {
        Self {
            vcpu,
            segments: Vec::new(),
            cumulative: Cumulative::new(),
            ledger: Ledger::default(),
        }
    }
}

/// The state of a recording.
struct State {
    /// `--sync-out`: every segment is appended as it is made.
    sync_out: Option<SyncWriter>,
    /// Every vCPU synced, in increasing order.
    vcpus: Vec<VcpuSync>,
    round: u64,
    breaks: u64,
    events: u64,
    host_stamped: u64,
    unplaceable: u64,
    /// Events the agent sent that never arrived (gaps in the batches' `first` index).
    lost: u64,
    /// Records received twice (skipped).
    replayed: u64,
    /// Drains that failed and were asked again.
    failed_drains: u64,
    /// Interval widths, for the summary's min/median/max, in constant memory.
    widths: Widths,
    /// Host TSC/BOOTTIME snapshots, one per sync round (for the Perfetto output).
    clocks: Vec<ClockSnapshot>,
    /// Why the last vCPU round whose samples gave no estimate refused them.
    refused: Option<EstimateError>,
    /// `--placement`.
    placement: Placement,
}

/// Where a batch of `len` records whose first has index `first` stands against the index the
/// next record should have (`expected`, `None` before the first batch): how many of its records
/// were delivered already (skip them), how many the agent sent before it that never arrived,
/// and the next expected index.
fn account(expected: Option<u64>, first: u64, len: usize) -> (usize, u64, u64) {
    let end = first.saturating_add(len as u64);
    match expected {
        None => (0, 0, end),
        Some(n) if first < n => (
            usize::try_from(n - first).unwrap_or(usize::MAX).min(len),
            0,
            n.max(end),
        ),
        Some(n) => (0, first - n, end),
    }
}

/// One vCPU's accounting of its batches: where the next record should start, and what the
/// guest says it lost before it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Ledger {
    /// The index the next batch's first record should have (`None` before the first batch).
    next: Option<u64>,
    /// Events a stop-when-full ring refused (its cumulative counter; they have no index).
    refused: u64,
    /// Records a flight ring overwrote before they were sent, attributed gap by gap.
    overwritten: u64,
    /// The flight ring's cumulative `dropped` already attributed.
    attributed: u64,
}

impl Ledger {
    /// Accounts batch `b`: returns how many of its records were delivered already (skip
    /// them) and how many records sent before it never arrived. A flight ring's `dropped`
    /// counts only records below `first`, so the growth since the last batch is the part of
    /// the gap in indices the ring overwrote (never more than the gap: a guest cannot make
    /// the host count more than it missed); the rest of the gap was lost in transit. Before
    /// the first batch the host expected nothing, so the ring's whole count (at most `first`)
    /// is what it overwrote.
    fn batch(&mut self, b: &EventBatch) -> (usize, u64) {
        let (skip, gap, next) = account(self.next, b.first, b.records.len());
        let mut lost = gap;
        if b.overwrite {
            let new = b.dropped.saturating_sub(self.attributed);
            let over = if self.next.is_none() {
                new.min(b.first)
            } else {
                new.min(gap)
            };
            self.overwritten += over;
            lost -= over.min(lost);
            self.attributed = self.attributed.max(b.dropped);
        } else {
            self.refused = self.refused.max(b.dropped);
        }
        self.next = Some(next);
        (skip, lost)
    }
}

/// Drains that may fail in a row before the recording gives up.
const MAX_FAILED_DRAINS: u32 = 3;

/// Event interval widths in constant memory: the exact minimum and maximum, and an evenly
/// spaced sample for the median (every `stride`-th width; when the sample fills up, every
/// other one is dropped and the stride doubles).
#[derive(Debug, Default)]
struct Widths {
    min: Option<u64>,
    max: u64,
    sample: Vec<u64>,
    stride: u64,
    seen: u64,
}

/// The sample's capacity.
const WIDTH_SAMPLE: usize = 1 << 16;

impl Widths {
    fn push(&mut self, w: u64) {
        self.min = Some(self.min.map_or(w, |m| m.min(w)));
        self.max = self.max.max(w);
        let stride = self.stride.max(1);
        if self.seen.is_multiple_of(stride) {
            if self.sample.len() == WIDTH_SAMPLE {
                let mut keep = false;
                self.sample.retain(|_| {
                    keep = !keep;
                    keep
                });
                self.stride = stride * 2;
            }
            if self.seen.is_multiple_of(self.stride.max(1)) {
                self.sample.push(w);
            }
        }
        self.seen += 1;
    }

    /// (min, median of the sample, max), `None` without widths.
    fn summary(&self) -> Option<(u64, u64, u64)> {
        let mut s = self.sample.clone();
        s.sort_unstable();
        Some((self.min?, *s.get(s.len() / 2)?, self.max))
    }
}

impl State {
    /// One sync round: every vCPU in turn; appends each vCPU's segment (if its probes
    /// produced samples).
    fn sync<T: StampedTransport>(
        &mut self,
        session: &mut ProbeSession<T>,
        p: &ProbeOptions,
    ) -> Result<(), ProbeError> {
        // A failed snapshot only thins the BOOTTIME mapping; the Perfetto writer needs two.
        self.clocks.extend(ClockSnapshot::take().ok());
        let round = self.round;
        self.round += 1;
        for v in &mut self.vcpus {
            session.select_vcpu(v.vcpu)?;
            session.forget_reference();
            let samples: Vec<ProbeSample> =
                session.probe_round(p.probes, p.interval, &mut Progress::hidden())?;
            if samples.is_empty() {
                continue;
            }
            let s = match ProbeSummary::from_samples(session.info(), &samples, session.stats()) {
                Ok(s) => s,
                // The samples fit no constant relation (the clock stepped inside the round,
                // or a bracket was wrong): nothing trustworthy to add.
                Err(e) => {
                    self.refused = Some(e);
                    continue;
                }
            };
            let is_break = v.cumulative.add(&samples);
            let seg = segment(&v.cumulative, &s, &samples, round, is_break)?;
            self.breaks += u64::from(is_break);
            if let Some(w) = &mut self.sync_out {
                w.append(&seg)?;
            }
            v.segments.push(seg);
        }
        Ok(())
    }

    /// Segments made so far, every vCPU's.
    fn segments(&self) -> u64 {
        self.vcpus.iter().map(|v| v.segments.len() as u64).sum()
    }

    /// Where `vcpu` stands in [`State::vcpus`].
    fn index_of(&self, vcpu: u32) -> Option<usize> {
        self.vcpus.iter().position(|v| v.vcpu == vcpu)
    }

    /// Guest tick `g` of `vcpu` on the host timeline: (placed, lo, hi) through the vCPU's
    /// segment that covers it; `None` without one (the vCPU never synced) or outside `u64`.
    fn place(&self, vcpu: u32, g: u64) -> Option<(u64, u64, u64)> {
        self.place_as(vcpu, g, self.placement)
            .map(|p| (p.host, p.lo, p.hi))
    }

    /// [`State::place`] with a given placement, and the round that covers the event.
    fn place_as(&self, vcpu: u32, g: u64, how: Placement) -> Option<bounds::Place> {
        let v = self.vcpus.get(self.index_of(vcpu)?)?;
        bounds::place(&v.segments, g, how)
    }

    /// A spooled event placed with the rounds known now.
    fn placed<'a>(&self, rec: &'a spool::Spooled) -> Option<Placed<'a>> {
        let p = self.place_as(rec.vcpu, rec.guest, self.placement)?;
        Some(Placed {
            vcpu: rec.vcpu,
            id: rec.id,
            guest: rec.guest,
            payload: rec.payload(),
            host: p.host,
            lo: p.lo,
            hi: p.hi,
            round: p.round,
        })
    }

    /// Two-sided placement: the summary's widths are those of the final placement, with
    /// every round known (one more pass over the spool).
    fn final_widths(&mut self, out: &mut Out) {
        let Out::Held { spool, .. } = out else {
            return;
        };
        let Ok(recs) = spool.iter() else {
            return;
        };
        let mut w = Widths::default();
        for rec in recs {
            let Ok(rec) = rec else {
                break;
            };
            if let Some(p) = self.place_as(rec.vcpu, rec.guest, self.placement) {
                w.push(p.hi - p.lo);
            }
        }
        self.widths = w;
    }
}

fn record_loop<T: StampedTransport>(
    session: &mut ProbeSession<T>,
    opts: &RecordOptions,
    st: &mut State,
    out: &mut Out,
    started: Instant,
    progress: &mut Progress,
) -> Result<EndReason, RecordError> {
    let p = &opts.probe;
    let mut last_sync = Instant::now();
    let mut failed_drains = 0u32;
    loop {
        if p.stopped() {
            return Ok(EndReason::Stopped);
        }
        if opts.duration.is_some_and(|d| started.elapsed() >= d) {
            return Ok(EndReason::Duration);
        }
        if last_sync.elapsed() >= opts.resync {
            last_sync = Instant::now();
            match st.sync(session, p) {
                Ok(()) => out.round_made(st, opts)?,
                Err(ProbeError::Interrupted) => return Ok(EndReason::Stopped),
                Err(ProbeError::AgentExited) => return Ok(EndReason::AgentExited),
                Err(e) => return Err(e.into()),
            }
        }
        let want = opts.events.map_or(opts.drain_max, |n| {
            u32::try_from(n.saturating_sub(st.events))
                .unwrap_or(u32::MAX)
                .min(opts.drain_max)
        });
        let batches = match session.drain_events(want) {
            Ok(b) => {
                failed_drains = 0;
                b
            }
            Err(ProbeError::AgentExited) => return Ok(EndReason::AgentExited),
            Err(ProbeError::Interrupted) => return Ok(EndReason::Stopped),
            // A drain lost to line noise, a corrupted request or a stalled link: the next one
            // goes on (its batches' `first` index counts what this one lost), unless it keeps
            // happening.
            Err(e @ (ProbeError::Timeout { .. } | ProbeError::Protocol(_)))
                if failed_drains < MAX_FAILED_DRAINS =>
            {
                failed_drains += 1;
                st.failed_drains += 1;
                eprintln!("vmtsync: warning: an event drain failed ({e}); asking again");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let mut got = 0u64;
        for b in &batches {
            // The session accepts batches only of the vCPUs it was told of, all synced here.
            let Some(vi) = st.index_of(b.vcpu) else {
                st.unplaceable += b.records.len() as u64;
                continue;
            };
            let v = &mut st.vcpus[vi];
            // Records before the next expected index were delivered already (a replay): skip
            // them. A gap after it is records the ring overwrote before sending them (a
            // flight ring says how many) and records the agent sent that never reached us.
            let (skip, lost) = v.ledger.batch(b);
            st.lost += lost;
            st.replayed += skip as u64;
            if b.clock == EventClock::Host {
                st.host_stamped += b.records.len().saturating_sub(skip) as u64;
                continue;
            }
            for (guest, r) in b.timestamped().flatten().skip(skip) {
                // Placed with the rounds known now; two-sided placement places it again
                // later, never wider (it is intersected with this).
                let placed = st
                    .place_as(b.vcpu, guest, Placement::OneSided)
                    .map(|p| (p.host, p.lo, p.hi, p.round));
                let Some((host, lo, hi, round)) = placed else {
                    // No segment of this vCPU (it never answered a probe), or outside the
                    // host's 64-bit range: no host tick to give it.
                    st.unplaceable += 1;
                    continue;
                };
                let placed = Placed {
                    vcpu: b.vcpu,
                    id: r.id,
                    guest,
                    payload: r.payload.as_slice(),
                    host,
                    lo,
                    hi,
                    round,
                };
                match out {
                    Out::Held { spool, .. } => spool
                        .push(b.vcpu, guest, r.id, r.payload.as_slice())
                        .map_err(RecordError::io(&opts.out))?,
                    Out::Jsonl(w) => jsonl_write(w, &placed)?,
                    Out::Ctf(w) => w.push(&placed.export())?,
                    Out::Spool(s) => s
                        .push(b.vcpu, guest, r.id, r.payload.as_slice())
                        .map_err(RecordError::io(&opts.out))?,
                }
                st.widths.push(hi - lo);
                st.events += 1;
                got += 1;
            }
        }
        if let Out::Jsonl(w) = out {
            w.flush().map_err(|e| RecordError::io(w.path())(e))?;
        }
        progress.status(&format!(
            "vmtsync record: {} events, {} dropped, {} segments",
            st.events,
            st.vcpus
                .iter()
                .map(|v| v.ledger.refused + v.ledger.overwritten)
                .sum::<u64>(),
            st.segments()
        ));
        if opts.events.is_some_and(|n| st.events >= n) {
            return Ok(EndReason::Events);
        }
        if got == 0 {
            // Nothing waiting: do not spin on the link; a stop is still seen within 10 ms.
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Writes the output; returns (pre-converted, clamped timestamps).
fn finish(out: Out, opts: &RecordOptions, st: &State) -> Result<(bool, u64), RecordError> {
    match out {
        Out::Held {
            mut spool,
            live,
            ctf,
        } => match (opts.format, live, ctf) {
            (RecordFormat::Jsonl, live, _) => {
                // Placed again from the start with every round: the live file is replaced.
                drop(live);
                let mut w = JsonlWriter::create(&opts.out).map_err(RecordError::io(&opts.out))?;
                for rec in spool.iter().map_err(RecordError::io(&opts.out))? {
                    let rec = rec.map_err(RecordError::io(&opts.out))?;
                    if let Some(placed) = st.placed(&rec) {
                        jsonl_write(&mut w, &placed)?;
                    }
                }
                w.finish().map_err(RecordError::io(&opts.out))?;
                Ok((false, 0))
            }
            (RecordFormat::Ctf, _, Some(mut w)) => {
                for rec in spool.iter().map_err(RecordError::io(&opts.out))? {
                    let rec = rec.map_err(RecordError::io(&opts.out))?;
                    if let Some(placed) = st.placed(&rec) {
                        w.push(&placed.export())?;
                    }
                }
                Ok((false, w.finish()?.raised))
            }
            (RecordFormat::Perfetto, ..) => write_perfetto(spool, opts, st),
            _ => write_trace_dat(spool, opts, st),
        },
        Out::Jsonl(w) => {
            w.finish().map_err(RecordError::io(&opts.out))?;
            Ok((false, 0))
        }
        Out::Spool(s) if opts.format == RecordFormat::Perfetto => write_perfetto(s, opts, st),
        Out::Ctf(w) => Ok((false, w.finish()?.raised)),
        Out::Spool(s) => write_trace_dat(s, opts, st),
    }
}

/// The Perfetto trace from the spool: each event placed as the JSON Lines output places it,
/// its host TSC mapped to BOOTTIME through the rounds' snapshots and one taken now.
fn write_perfetto(
    mut s: spool::Spool,
    opts: &RecordOptions,
    st: &State,
) -> Result<(bool, u64), RecordError> {
    use crate::formats::perfetto::{DEFAULT_MACHINE_ID, PerfettoError, PerfettoOptions};
    use crate::formats::{Bound, ExportEvent, Payload};
    let mut snaps = st.clocks.clone();
    snaps.extend(ClockSnapshot::take().ok());
    let clock = BootClock::new(snaps).map_err(PerfettoError::from)?;
    let mut w = PerfettoWriter::create(
        &opts.out,
        PerfettoOptions {
            machine_id: DEFAULT_MACHINE_ID,
            guest_name: format!("vmtsync guest ({})", opts.probe.addr),
            clock,
        },
    )?;
    for rec in s.iter().map_err(RecordError::io(&opts.out))? {
        let rec = rec.map_err(RecordError::io(&opts.out))?;
        let Some((host, lo, hi)) = st.place(rec.vcpu, rec.guest) else {
            continue;
        };
        w.push(&ExportEvent {
            vcpu: rec.vcpu,
            id: rec.id,
            guest_tsc: Some(rec.guest),
            host_tsc: host,
            bound: Some(Bound { lo, hi }),
            payload: Payload::new(rec.payload()).unwrap_or_default(),
        })?;
    }
    w.finish()?;
    Ok((false, 0))
}

/// The trace.dat from the spool: raw guest TSCs plus a TIME_SHIFT when every segment is at
/// identity rate (trace-cmd then computes exactly what we do), else host TSCs.
fn write_trace_dat(
    mut s: spool::Spool,
    opts: &RecordOptions,
    st: &State,
) -> Result<(bool, u64), RecordError> {
    let identity = st
        .vcpus
        .iter()
        .flat_map(|v| &v.segments)
        .all(|g| g.drift_ppb == 0);
    if identity {
        match write_trace_dat_as(&mut s, opts, st, true) {
            // Raw guest TSCs that go backwards (the guest clock stepped back) or segments
            // trace-cmd's TIME_SHIFT cannot hold: write host TSCs instead.
            Err(RecordError::TraceDat(
                tracedat::TraceDatError::NotMonotonic { .. }
                | tracedat::TraceDatError::TimeShift(_),
            )) => {}
            r => return r,
        }
    }
    write_trace_dat_as(&mut s, opts, st, false)
}

/// One attempt at the trace.dat: raw guest TSCs with a TIME_SHIFT (`identity`), or host TSCs.
fn write_trace_dat_as(
    s: &mut spool::Spool,
    opts: &RecordOptions,
    st: &State,
    identity: bool,
) -> Result<(bool, u64), RecordError> {
    let trace_id = trace_id(opts, st);
    // One CPU buffer per vCPU synced, in increasing vCPU order (`cpu` N of the file is the
    // N-th of them: the UNAME names them).
    let cpus = u32::try_from(st.vcpus.len()).unwrap_or(u32::MAX);
    let mut wo = WriterOptions::new(cpus, trace_id);
    wo.version = opts.file_version;
    let names = st
        .vcpus
        .iter()
        .map(|v| v.vcpu.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let which = if st.vcpus.len() == 1 {
        format!("vCPU {names}")
    } else {
        format!("vCPUs {names} as CPUs 0..{}", st.vcpus.len())
    };
    wo.uname = Some(if identity {
        format!("vmtsync record: {which}, raw guest TSC, TIME_SHIFT to host TSC")
    } else {
        format!(
            "vmtsync record: {which}, timestamps pre-converted to host TSC (the guest TSC \
             rate is not the host's: trace-cmd's TIME_SHIFT cannot represent it exactly)"
        )
    });
    let mut w = TraceDatWriter::create(&opts.out, wo)?;
    let mut clamped = 0;
    // The last timestamp written per CPU: each CPU's buffer must be in order.
    let mut last = vec![0u64; st.vcpus.len()];
    for rec in s.iter().map_err(RecordError::io(&opts.out))? {
        let rec = rec.map_err(RecordError::io(&opts.out))?;
        let Some(cpu) = st.index_of(rec.vcpu) else {
            continue;
        };
        let ts = if identity {
            rec.guest
        } else {
            let host = st
                .place(rec.vcpu, rec.guest)
                .map_or(last[cpu], |(h, _, _)| h);
            if host < last[cpu] {
                clamped += 1;
            }
            host.max(last[cpu])
        };
        last[cpu] = ts;
        w.push(
            u32::try_from(cpu).unwrap_or(u32::MAX),
            ts,
            u32::from(rec.id),
            rec.payload(),
        )?;
    }
    let shift = identity.then(|| TimeShift {
        peer_trace_id: 0,
        mode: ShiftMode::Step,
        cpus: st
            .vcpus
            .iter()
            .map(|v| {
                v.segments
                    .iter()
                    .map(|g| tracedat::SyncSegment {
                        // The host tick where the segment's first guest tick falls.
                        start: HostTicks(g.guest_start.wrapping_sub(g.offset.cast_unsigned())),
                        map: KvmTscMapping::offset_only(g.offset),
                    })
                    .collect()
            })
            .collect(),
    });
    w.finish(shift.as_ref())?;
    Ok((!identity, clamped))
}

/// A TRACEID for the guest file: stable for one run (source and first anchor).
fn trace_id(opts: &RecordOptions, st: &State) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let first = st
        .vcpus
        .iter()
        .find_map(|v| v.segments.first())
        .map_or(0, |g| g.host_anchor);
    for b in opts
        .probe
        .addr
        .to_string()
        .bytes()
        .chain(first.to_le_bytes())
    {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_indices_count_gaps_and_replays_exactly() {
        // The first batch sets the count; the next in sequence adds nothing.
        assert_eq!(account(None, 100, 64), (0, 0, 164));
        assert_eq!(account(Some(164), 164, 10), (0, 0, 174));
        // A batch the host never got (records 174..238): 64 lost.
        assert_eq!(account(Some(174), 238, 5), (0, 64, 243));
        // A replay of records the host has: all skipped, the expectation stays.
        assert_eq!(account(Some(243), 238, 5), (5, 0, 243));
        // A partial overlap: the first 3 are old, 2 are new.
        assert_eq!(account(Some(243), 240, 5), (3, 0, 245));
        // An empty final batch changes nothing.
        assert_eq!(account(Some(245), 245, 0), (0, 0, 245));
    }

    fn batch(first: u64, len: usize, dropped: u64, overwrite: bool) -> EventBatch {
        let mut b = EventBatch::new(0, EventClock::Guest, 0);
        (b.first, b.dropped, b.overwrite) = (first, dropped, overwrite);
        for _ in 0..len {
            assert!(b.push(0, 0, 1, &[]));
        }
        b
    }

    #[test]
    fn a_flight_rings_gaps_split_into_overwritten_and_lost_exactly() {
        let mut l = Ledger::default();
        // Attached late: 36864 overwritten before the first batch, none lost.
        assert_eq!(l.batch(&batch(36864, 64, 36864, true)), (0, 0));
        assert_eq!(l.batch(&batch(36928, 64, 36864, true)), (0, 0));
        // A gap of 100: 60 overwritten (the counter grew by 60), 40 sent and lost in transit.
        assert_eq!(l.batch(&batch(37092, 8, 36924, true)), (0, 40));
        // A replay of what arrived changes nothing.
        assert_eq!(l.batch(&batch(37092, 8, 36924, true)), (8, 0));
        // A guest claiming more overwritten than the gap holds is held to the gap.
        assert_eq!(l.batch(&batch(37110, 1, 99_999, true)), (0, 0));
        assert_eq!(
            (l.overwritten, l.refused, l.next),
            (36864 + 60 + 10, 0, Some(37111))
        );
        // A stop-when-full ring's gaps are all transit loss, its counter refused events.
        let mut s = Ledger::default();
        assert_eq!(s.batch(&batch(0, 64, 5, false)), (0, 0));
        assert_eq!(s.batch(&batch(100, 1, 9, false)), (0, 36));
        assert_eq!((s.overwritten, s.refused), (0, 9));
    }

    #[test]
    fn widths_stay_bounded_and_keep_min_max_and_a_fair_median() {
        let mut w = Widths::default();
        for i in 0..1_000_000u64 {
            w.push(i % 1000);
        }
        w.push(5_000);
        assert!(w.sample.len() <= WIDTH_SAMPLE);
        let (min, med, max) = w.summary().unwrap();
        assert_eq!((min, max), (0, 5_000));
        assert!((400..600).contains(&med), "median {med}");
        assert_eq!(Widths::default().summary(), None);
    }

    /// An SMP unikernel recording on three vCPUs whose TSCs differ by 2^36 ticks each: every
    /// vCPU is synced on itself each round and its events are placed with its own segments
    /// (the truth: the host tick each event was made up at), counted on its own, and written
    /// to its own trace.dat CPU.
    #[test]
    fn every_vcpu_s_events_are_placed_with_that_vcpu_s_own_sync() {
        use crate::link::ProbeAddr;
        use crate::probe::ProbeOptions;
        use crate::probe::testutil::SimTransport;
        use vmtsync_core::arch::FakeTsc;
        use vmtsync_core::recorder::Recorder;

        const OFFSET: u64 = 1_000;
        const PEER: u64 = 1 << 36;
        let guest_of =
            |v: u32, host: u64| host + OFFSET + if v == 3 { 0 } else { PEER * u64::from(v) };
        let run = |format: RecordFormat, out: &Path| {
            let rec: &'static Recorder<4, 256> = Box::leak(Box::new(Recorder::new()));
            let mut t = SimTransport::with_events(OFFSET, rec);
            t.exact = true;
            let clock = t.agent.clock_mut();
            clock.peers = 0b101;
            clock.peer_offset = PEER;
            // Three events per vCPU (0, 2 and the agent's own 3), each at a known host tick.
            let mut truth = Vec::new();
            for (i, v) in [0u32, 2, 3, 0, 2, 3, 0, 2, 3].into_iter().enumerate() {
                let host = t.now + 10_000 * (i as u64 + 1);
                let payload = u32::try_from(i).unwrap().to_le_bytes();
                let tsc = FakeTsc::new(guest_of(v, host), 0);
                rec.record(v as usize, &tsc, 7, &payload).unwrap();
                truth.push((v, host));
            }
            let mut probe = ProbeOptions::new(ProbeAddr::Unix("sim".into()));
            probe.progress = false;
            probe.probes = 8;
            let opts = RecordOptions {
                probe,
                out: out.to_owned(),
                format,
                file_version: FileVersion::V7,
                events: Some(9),
                duration: None,
                resync: Duration::from_secs(3600),
                drain_max: DRAIN_MAX,
                sync_out: None,
                placement: Placement::default(),
            };
            let summary = run_record_on(t, &opts, &mut Progress::hidden()).unwrap();
            (summary, truth)
        };
        let dir = tempfile::tempdir().unwrap();
        let jsonl = dir.path().join("smp.jsonl");
        let (summary, truth) = run(RecordFormat::Jsonl, &jsonl);
        assert_eq!(summary.vcpus, [0, 2, 3]);
        assert_eq!(summary.vcpu, 3);
        // One segment per vCPU in the first round and in the closing one (two-sided placement
        // syncs once more when the recording reached its event count).
        assert_eq!(summary.segments, 6, "one segment per vCPU per round");
        assert_eq!((summary.events, summary.lost, summary.replayed), (9, 0, 0));
        assert_eq!(summary.unplaceable, 0);
        let text = std::fs::read_to_string(&jsonl).unwrap();
        let mut seen = 0;
        for line in text.lines() {
            let j: serde_json::Value = serde_json::from_str(line).unwrap();
            let Some(hex) = j["payload"].as_str() else {
                continue;
            };
            let i = usize::from_str_radix(&hex[..2], 16).unwrap();
            let (v, host) = truth[i];
            assert_eq!(j["vcpu"].as_u64(), Some(u64::from(v)), "{line}");
            assert_eq!(j["guest_tsc"].as_u64(), Some(guest_of(v, host)), "{line}");
            let (lo, hi) = (
                j["host_lo"].as_u64().unwrap(),
                j["host_hi"].as_u64().unwrap(),
            );
            assert!(
                lo <= host && host <= hi,
                "event {i} of vCPU {v} at {host}: {line}"
            );
            seen += 1;
        }
        assert_eq!(seen, 9);
        // trace.dat: one CPU per vCPU, three events each, at the raw guest TSCs of that vCPU.
        let dat = dir.path().join("smp.dat");
        let (summary, truth) = run(RecordFormat::TraceCmd, &dat);
        assert!(!summary.preconverted);
        let layout = tracedat::read_layout(&dat).unwrap();
        let mut per_cpu = [Vec::new(), Vec::new(), Vec::new()];
        tracedat::for_each_record(&dat, &layout, 0, |cpu, ts, _| {
            per_cpu[cpu as usize].push(ts);
        })
        .unwrap();
        for (cpu, v) in [0u32, 2, 3].into_iter().enumerate() {
            let want: Vec<u64> = truth
                .iter()
                .filter(|(w, _)| *w == v)
                .map(|&(w, h)| guest_of(w, h))
                .collect();
            assert_eq!(per_cpu[cpu], want, "CPU {cpu} holds vCPU {v}");
        }
    }
}
