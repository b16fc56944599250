//! `vmtsync record`: one session that syncs the clocks and drains the guest's events into a
//! trace file (trace-cmd's trace.dat, JSON Lines or CTF).
//!
//! Stages, read forward: a front end, then placement, then output.
//! - `session.rs` (`--connect`): the probe session described below (its batch accounting in
//!   `ledger.rs`).
//! - `memory/` (`--from-memory`): the guest's recorder read out of its VMM's memory, each
//!   raw-TSC record placed exactly by KVM's debugfs mapping ([`run_record_memory`]), or by
//!   the guest's sync beacons bracketed by the host's exits; `launch.rs` starts its VMM paused.
//! - `error.rs`: why a recording failed, typed for the CLI's exit codes.
//! - `place.rs`: every vCPU's segments, an event's host interval, the recording's counters.
//! - `write.rs`: where events go while recording and every format's writer.
//!
//! The session: hello, an initial sync round, then event drains
//! ([`crate::probe::ProbeSession::drain_events`]) interleaved with a re-sync round every `resync`, with the
//! same probe engine and estimators as `vmtsync probe --continuous` (each round becomes a
//! [`crate::syncfile::SyncSegment`]). It ends after `events` events, after `duration`, on the stop flag
//! (SIGINT/SIGTERM in the CLI) or when the agent ends the session; whatever was received is
//! written either way, and the summary says why it ended.
//!
//! Every event is placed with the segment that covers its guest tick (the last one whose
//! `guest_start` is at or before it; the first one before that), the same rule a sync file's
//! conversion and the trace.dat TIME_SHIFT use; its guaranteed host interval comes from
//! [`crate::sync::host_bounds`].
//!
//! Memory is constant in the number of events: JSON Lines are streamed; for trace.dat the events
//! go to a spool file (32 bytes each) and are written when the segments are all known, as raw
//! guest TSCs with a TIME_SHIFT when trace-cmd's reader represents the segments exactly (every
//! segment at identity rate), else pre-converted to host TSC (said in the file's UNAME and the
//! summary). Outputs are written beside the target and renamed into place when complete: the
//! target only ever holds a finished file; a killed run leaves `OUT.partial` (JSON Lines) with
//! every line flushed so far.

mod beacons;
mod error;
pub mod launch;
mod ledger;
mod memory;
mod place;
mod session;
mod spool;
mod stream;
mod target;
pub(crate) mod write;

use std::path::PathBuf;
use std::time::Duration;

use crate::probe::ProbeOptions;
use crate::sync::Placement;

pub use error::{MemoryError, RecordError, Unplaceable};
pub use memory::{DEFAULT_POLL, MemoryOptions, MemorySummary, run_record_memory};
pub use session::{run_record, run_record_on};
pub use target::{OutputOptions, host_tsc2nsec};

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
    /// The output file and format, when to stop, `--sync-out`.
    pub output: OutputOptions,
    /// Time between the starts of two sync rounds.
    pub resync: Duration,
    /// The most events one drain asks for (the CLI: [`DRAIN_MAX`]).
    pub drain_max: u32,
    /// How events are placed (`--placement`, default two-sided).
    pub placement: Placement,
    /// How span records are named in the outputs that show spans (symbols, relocations).
    pub spans: crate::spans::SpanConfig,
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
    /// The VMM whose memory was read exited (`--from-memory`).
    VmmExited,
}

/// Where the events' host times came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostTime {
    /// Sync rounds with the agent (bounded intervals).
    #[default]
    Sync,
    /// KVM's own per-vCPU mapping in debugfs, for records that hold the raw TSC: exact,
    /// every interval of width 0.
    ExactDebugfs,
    /// The guest's sync beacons, bracketed by the host's kvm_pio exits (bounded intervals).
    Beacons,
    /// As [`HostTime::Beacons`], for records that hold the raw TSC: each point is KVM's
    /// exact mapping (inside the beacons' interval), each interval the beacons'.
    BeaconsExactPoints,
    /// Beacon mode on a raw-TSC guest with no bracketed beacon (a late attach): every point
    /// and width-0 interval is KVM's exact mapping on the header's word, not verified.
    ExactUnverified,
}

impl HostTime {
    /// How the summary and JSON name it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Sync => "sync rounds",
            Self::ExactDebugfs => "exact (KVM debugfs)",
            Self::Beacons => "beacons (kvm_pio brackets)",
            Self::BeaconsExactPoints => {
                "exact points (KVM debugfs) in intervals from the beacons (kvm_pio brackets)"
            }
            Self::ExactUnverified => {
                "KVM's mapping (debugfs), not verified: no beacon was bracketed, so the \
                 header's raw-TSC claim is unchecked"
            }
        }
    }
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
    /// Where the host times came from.
    pub host_time: HostTime,
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use vmtsync_core::proto::{EventBatch, EventClock};

    use super::ledger::{Ledger, account};
    use super::place::{WIDTH_SAMPLE, Widths};
    use super::*;
    use crate::formats::tracedat;
    use crate::formats::tracedat::FileVersion;
    use crate::probe::Progress;

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

    /// A recording of `events` events into `out` over the loopback simulation (`sim`), eight
    /// probes a round and no resync before the end.
    fn sim_options(out: &Path, format: RecordFormat, events: u64) -> RecordOptions {
        let mut probe = crate::probe::ProbeOptions::new(crate::link::ProbeAddr::Unix("sim".into()));
        probe.progress = false;
        probe.probes = 8;
        RecordOptions {
            probe,
            output: OutputOptions {
                out: out.to_owned(),
                format,
                file_version: FileVersion::V7,
                events: Some(events),
                duration: None,
                sync_out: None,
            },
            resync: Duration::from_secs(3600),
            drain_max: DRAIN_MAX,
            placement: Placement::default(),
            spans: crate::spans::SpanConfig::default(),
        }
    }

    /// An SMP unikernel recording on three vCPUs whose TSCs differ by 2^36 ticks each: every
    /// vCPU is synced on itself each round and its events are placed with its own segments
    /// (the truth: the host tick each event was made up at), counted on its own, and written
    /// to its own trace.dat CPU.
    #[test]
    fn every_vcpu_s_events_are_placed_with_that_vcpu_s_own_sync() {
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
                rec.ring(v as usize)
                    .unwrap()
                    .record(&tsc, 7, &payload)
                    .unwrap();
                truth.push((v, host));
            }
            let opts = sim_options(out, format, 9);
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

    /// Span records through `vmtsync record` (the loopback simulation, exact sync): the
    /// trace.dat holds every record as before plus the function graph, whose exits carry the
    /// entry's and exit's host times in the file's nanoseconds; CTF holds the span events.
    #[test]
    fn span_records_reach_the_trace_dat_graph_and_the_ctf_span_events() {
        use crate::formats::tracedat::format::{FUNCGRAPH_ENTRY_ID, FUNCGRAPH_EXIT_ID};
        use crate::probe::testutil::SimTransport;
        use vmtsync_core::arch::FakeTsc;
        use vmtsync_core::recorder::Recorder;

        const OFFSET: u64 = 1_000;
        let run = |format: RecordFormat, out: &Path| {
            let rec: &'static Recorder<4, 256> = Box::leak(Box::new(Recorder::new()));
            let mut t = SimTransport::with_events(OFFSET, rec);
            t.exact = true;
            let at = |i: u64| FakeTsc::new(t.now + 10_000 * i + OFFSET, 0);
            rec.ring(3)
                .unwrap()
                .func_entry(&at(1), 0x10u32, 0x99)
                .unwrap();
            rec.ring(3)
                .unwrap()
                .func_entry(&at(2), 0x20u32, 0x99)
                .unwrap();
            rec.ring(3)
                .unwrap()
                .func_exit(&at(4), 0x20u32, 0x99)
                .unwrap();
            rec.ring(3).unwrap().span_begin(&at(5), "boot").unwrap();
            rec.ring(3)
                .unwrap()
                .func_exit(&at(7), 0x10u32, 0x99)
                .unwrap();
            let opts = sim_options(out, format, 5);
            run_record_on(t, &opts, &mut Progress::hidden()).unwrap()
        };
        let dir = tempfile::tempdir().unwrap();
        let dat = dir.path().join("spans.dat");
        let summary = run(RecordFormat::TraceCmd, &dat);
        assert_eq!(summary.events, 5);
        let layout = tracedat::read_layout(&dat).unwrap();
        let (mut plain, mut graph) = (Vec::new(), Vec::new());
        tracedat::for_each_record(&dat, &layout, 0, |_, ts, d| {
            let u = |a: usize, n: usize| {
                let mut b = [0u8; 8];
                b[..n].copy_from_slice(&d[a..a + n]);
                u64::from_le_bytes(b)
            };
            match u16::try_from(u(0, 2)).unwrap() {
                FUNCGRAPH_ENTRY_ID => graph.push(("entry", ts, u(8, 8), u(16, 4), 0, 0)),
                FUNCGRAPH_EXIT_ID => {
                    graph.push(("exit", ts, u(8, 8), u(16, 4), u(24, 8), u(32, 8)));
                }
                _ => plain.push(ts),
            }
        })
        .unwrap();
        assert_eq!(plain.len(), 5, "every record stays an event");
        let kinds: Vec<(&str, u64)> = graph.iter().map(|g| (g.0, g.3)).collect();
        assert_eq!(
            kinds,
            [
                ("entry", 0),
                ("entry", 1),
                ("exit", 1),
                ("entry", 0),
                ("exit", 0)
            ]
        );
        // Raw guest TSCs in the file (TIME_SHIFT to host): host = guest - OFFSET, exactly.
        let ns = |guest: u64| {
            let host = guest - OFFSET;
            target::host_tsc2nsec().map_or(host, |c| c.nanos(host))
        };
        let exit = graph[2];
        assert_eq!((exit.2, exit.4, exit.5), (0x20, ns(plain[1]), ns(plain[2])));
        let exit = graph[4];
        assert_eq!((exit.2, exit.4, exit.5), (0x10, ns(plain[0]), ns(plain[4])));

        let ctf = dir.path().join("spans.ctf");
        let summary = run(RecordFormat::Ctf, &ctf);
        assert_eq!(summary.events, 5);
        let meta = std::fs::read_to_string(ctf.join("metadata")).unwrap();
        assert!(meta.contains("vmtsync:span_end"));
        // The phase never ends: its span_begin and its span_unfinished (open at the end) name
        // it (babeltrace2 reads these classes in tests/tests/tier2/span_outputs.rs).
        let stream = std::fs::read(ctf.join("vcpu3")).unwrap();
        assert_eq!(stream.windows(5).filter(|w| *w == b"boot\0").count(), 2);
    }
}
