//! `vmtsync-ingest-bench`: sustained event ingest from the real agent over virtio-vsock (QEMU
//! microvm + vhost-device-vsock), the figure `cargo xtask bench` reports.
//!
//! The agent runs its workload (`workload=RATE,0`: events at RATE per second with an 8-byte
//! counter payload, until shutdown) and serves the protocol on vsock; the host runs
//! `vmtsync record` (the library, `run_record_on`, JSON Lines into a temporary file) over the
//! rig's connection for the given time, each drain asking for at most `--drain-max` events, and
//! counts every byte it received. It prints one JSON line, a
//! [`vmtsync_launch::bench::IngestBench`] (schema `vmtsync-ingest-bench/1`).
//!
//! `events` arrived and were written, `sent` is the agent's own count (its shutdown line),
//! `dropped` what its ring refused (it fills whenever the host drains slower than the workload
//! records), `bytes` everything the host read (probe replies of the sync rounds included, so
//! `bytes_per_event` is an upper bound of the event batches' cost) and `packets` the vsock
//! packets the agent sent (its shutdown line).
//!
//! With `--drain-only` the host only drains (one hello, back-to-back `EventsRequest`s, no
//! output file) and the line also has `"drains"`, `"fill_ms"` and `"link_events_per_s"`:
//! events over the time spent inside drains. With `--fill-ms N` it pauses N ms before each
//! drain, so every drain finds the ring full: that figure is then the link's own ceiling.
//!
//! Usage: `vmtsync-ingest-bench [--elf PATH] [--seconds S] [--drain-max M] [--rate R]
//! [--drain-only [--fill-ms N]]`.
//! Exit codes: 0; 1 when it could not run or an event was lost; 2 on usage errors.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use vmtsync::link::{FrameStamps, ProbeAddr, Received, StampedTransport, TransportError};
use vmtsync::probe::{ProbeOptions, Progress};
use vmtsync::record::{DRAIN_MAX, OutputOptions, RecordFormat, RecordOptions, run_record_on};
use vmtsync_core::HostTicks;
use vmtsync_launch::bench::{self, IngestBench, IngestSchema};
use vmtsync_tests::vmm::agent_elf;
use vmtsync_tests::vmm::qemu::{Machine, debug_exit_status};
use vmtsync_tests::vmm::vsock::{VsockRig, VsockTransport, ensure_vhost_device_vsock};

const USAGE: &str = "usage: vmtsync-ingest-bench [--elf PATH] [--seconds S] [--drain-max M] \
                     [--rate R] [--drain-only [--fill-ms N]]";
/// The guest port the agent listens on.
const PORT: u32 = 5_700;
/// The longest any wait may take.
const STEP: Duration = Duration::from_secs(30);

/// The rig's transport, counting the bytes it received.
struct Counting {
    inner: VsockTransport,
    bytes: u64,
}

impl StampedTransport for Counting {
    fn send(&mut self, frame: &[u8]) -> Result<HostTicks, TransportError> {
        self.inner.send(frame)
    }

    fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> Result<Received, TransportError> {
        let r = self.inner.recv(buf, deadline)?;
        self.bytes += r.len as u64;
        Ok(r)
    }

    fn refine(&mut self, stamps: FrameStamps) -> Option<FrameStamps> {
        self.inner.refine(stamps)
    }
}

struct Args {
    /// `--drain-only`: back-to-back drains, the events counted and dropped (the link's
    /// ceiling); otherwise `vmtsync record` writing JSON Lines.
    drain_only: bool,
    /// `--fill-ms`: with `--drain-only`, a pause before each drain, so each finds the ring full
    /// and `link_events_per_s` (events over the time spent inside drains) is the link's ceiling.
    fill: Duration,
    elf: Option<PathBuf>,
    seconds: f64,
    drain_max: u32,
    rate: u64,
}

fn parse(args: &[String]) -> Result<Args, String> {
    let mut a = Args {
        drain_only: false,
        fill: Duration::ZERO,
        elf: None,
        seconds: 3.0,
        drain_max: DRAIN_MAX,
        rate: 1_000_000,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--elf" => a.elf = Some(PathBuf::from(value()?)),
            "--drain-only" => a.drain_only = true,
            "--fill-ms" => {
                a.fill =
                    Duration::from_millis(value()?.parse().map_err(|e| format!("{flag}: {e}"))?);
            }
            "--seconds" => a.seconds = value()?.parse().map_err(|e| format!("{flag}: {e}"))?,
            "--drain-max" => a.drain_max = value()?.parse().map_err(|e| format!("{flag}: {e}"))?,
            "--rate" => a.rate = value()?.parse().map_err(|e| format!("{flag}: {e}"))?,
            other => return Err(format!("unexpected argument `{other}`")),
        }
    }
    if !(a.seconds.is_finite() && a.seconds > 0.0) || a.drain_max == 0 || a.rate == 0 {
        return Err("need --seconds > 0, --drain-max >= 1 and --rate >= 1".into());
    }
    Ok(a)
}

/// `--drain-only`: one hello, then back-to-back `drain_events` for the run's time; every
/// batch's `first` index must follow on from the last (nothing lost), then `Shutdown`.
fn drain_only(a: &Args, link: Counting, rig: &mut VsockRig) -> Result<IngestBench> {
    let mut session = vmtsync::probe::ProbeSession::hello(link, STEP)?;
    let started = Instant::now();
    let (mut events, mut drains, mut dropped) = (0u64, 0u64, 0u64);
    let mut busy = Duration::ZERO;
    while started.elapsed().as_secs_f64() < a.seconds {
        if !a.fill.is_zero() {
            std::thread::sleep(a.fill);
        }
        let t = Instant::now();
        let answer = session.drain_events(a.drain_max)?;
        busy += t.elapsed();
        for b in answer {
            ensure!(
                b.first == events,
                "batch at {} after {events} events",
                b.first
            );
            events += b.records.len() as u64;
            dropped = dropped.max(b.dropped);
        }
        drains += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    let bytes = session.transport().bytes;
    let (bye, _) = session.request(&vmtsync_core::proto::Message::Shutdown)?;
    ensure!(
        bye == vmtsync_core::proto::Message::Exiting,
        "shutdown answered with {bye:?}"
    );
    let status = rig.wait_exit(STEP)?;
    if status.code() != Some(debug_exit_status(0)) {
        bail!("QEMU exited with {status}\n{}", rig.diagnostics());
    }
    let log = rig.com2_log();
    #[allow(clippy::cast_precision_loss)] // Displayed rates of counts far below 2^52.
    let (per_s, per_event) = (events as f64 / secs, bytes as f64 / events.max(1) as f64);
    #[allow(clippy::cast_precision_loss)]
    let link_per_s = events as f64 / busy.as_secs_f64().max(1e-9);
    Ok(IngestBench {
        schema: IngestSchema,
        mode: "drain-only".into(),
        drain_max: a.drain_max,
        rate: a.rate,
        seconds: secs,
        events,
        events_per_s: per_s,
        dropped,
        sent: shutdown_count(&log, " sent,"),
        bytes,
        bytes_per_event: per_event,
        packets: shutdown_count(&log, " packets"),
        drains: Some(drains),
        link_events_per_s: Some(link_per_s),
        fill_ms: Some(u64::try_from(a.fill.as_millis()).unwrap_or(u64::MAX)),
    })
}

/// The number before `word` in the agent's shutdown line (`… 383 packets, …`).
fn shutdown_count(log: &str, word: &str) -> Option<u64> {
    let line = log.lines().find(|l| l.contains("shutdown after"))?;
    let before = line.get(..line.find(word)?)?;
    before
        .rsplit(|c: char| !c.is_ascii_digit())
        .find(|s| !s.is_empty())?
        .parse()
        .ok()
}

fn run(a: &Args) -> Result<IngestBench> {
    let backend = ensure_vhost_device_vsock()?;
    let elf = match &a.elf {
        Some(e) => e.clone(),
        None => agent_elf().context("building the guest agent")?,
    };
    // Ring 3: the workload is bulk work, native there and emulated in the agent's default
    // ring 0 on these nested hosts.
    let append = format!(
        "transport=vsock vsock=listen port={PORT} ring=3 exit=0 workload={},0",
        a.rate
    );
    let mut rig = VsockRig::start(Machine::Microvm, &backend, &elf, &append, PORT, STEP)?;
    let fail =
        |rig: &VsockRig, e: &dyn std::fmt::Display| anyhow::anyhow!("{e}\n{}", rig.diagnostics());
    rig.wait_log(&format!("vsock: listening on port {PORT}"), STEP)
        .map_err(|e| fail(&rig, &e))?;
    let inner = rig.connect(PORT, STEP).map_err(|e| fail(&rig, &e))?;
    let mut link = Counting { inner, bytes: 0 };
    let dir = tempfile::tempdir().context("scratch directory")?;
    let mut probe = ProbeOptions::new(ProbeAddr::parse("tcp:127.0.0.1:1").expect("an address"));
    probe.timeout = Duration::from_secs(10);
    probe.shutdown = true;
    let opts = RecordOptions {
        probe,
        output: OutputOptions {
            out: dir.path().join("events.jsonl"),
            format: RecordFormat::Jsonl,
            file_version: vmtsync::formats::tracedat::FileVersion::V7,
            events: None,
            duration: Some(Duration::from_secs_f64(a.seconds)),
            sync_out: None,
        },
        resync: Duration::from_millis(500),
        drain_max: a.drain_max,
        placement: vmtsync::sync::Placement::default(),
        spans: vmtsync::spans::SpanConfig::default(),
    };
    if a.drain_only {
        return drain_only(a, link, &mut rig);
    }
    let started = Instant::now();
    let summary =
        run_record_on(&mut link, &opts, &mut Progress::hidden()).map_err(|e| fail(&rig, &e))?;
    let secs = started.elapsed().as_secs_f64();
    let status = rig.wait_exit(STEP).map_err(|e| fail(&rig, &e))?;
    let log = rig.com2_log();
    let sent = shutdown_count(&log, " sent,")
        .with_context(|| format!("no shutdown line in the agent's log:\n{log}"))?;
    ensure!(
        summary.events == sent && summary.lost == 0,
        "events lost: {} arrived, {sent} sent, {} lost in transit",
        summary.events,
        summary.lost
    );
    if status.code() != Some(debug_exit_status(0)) {
        bail!("QEMU exited with {status}\n{}", rig.diagnostics());
    }
    #[allow(clippy::cast_precision_loss)] // Displayed rates of counts far below 2^52.
    let (per_s, per_event) = (
        summary.events as f64 / secs,
        link.bytes as f64 / summary.events.max(1) as f64,
    );
    Ok(IngestBench {
        schema: IngestSchema,
        mode: "record".into(),
        drain_max: a.drain_max,
        rate: a.rate,
        seconds: secs,
        events: summary.events,
        events_per_s: per_s,
        dropped: summary.dropped,
        sent: Some(sent),
        bytes: link.bytes,
        bytes_per_event: per_event,
        packets: shutdown_count(&log, " packets"),
        drains: None,
        link_events_per_s: None,
        fill_ms: None,
    })
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let args = match parse(&argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("vmtsync-ingest-bench: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(line) => {
            println!("{}", bench::to_line(&line));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vmtsync-ingest-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_reads_the_shutdown_line() {
        let a = parse(&[]).unwrap();
        assert_eq!((a.drain_max, a.rate), (DRAIN_MAX, 1_000_000));
        let v: Vec<String> = ["--drain-max", "64", "--seconds", "0.5"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let a = parse(&v).unwrap();
        assert_eq!((a.drain_max, a.seconds), (64, 0.5));
        assert!(parse(&["--rate".to_owned(), "0".to_owned()]).is_err());
        assert!(parse(&["--bogus".to_owned()]).is_err());
        let log = "x info  shutdown after 3 probes, 5 messages, 0 bad frames, 0 events (383 \
                   packets, 0 credit waits, 0 refused sends, 0 link errors; 9 workload, 61440 \
                   sent, 7 dropped): isa-debug-exit 0";
        assert_eq!(shutdown_count(log, " packets"), Some(383));
        assert_eq!(shutdown_count(log, " sent,"), Some(61440));
        assert_eq!(shutdown_count("nothing", " sent,"), None);
        assert_eq!(
            shutdown_count("shutdown after 3 probes: isa-debug-exit 0", " packets"),
            None,
            "an older agent's line without the word"
        );
    }
}
