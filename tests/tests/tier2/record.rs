//! `vmtsync record`: events from an agent into JSON Lines and trace.dat, checked against the
//! truth and against the real trace-cmd 3.1.6.
//!
//! Tier 1 uses the loopback agent (`vmtsync_tests::fake_agent`): its events are stamped with
//! the host TSC plus a known skew, so each event's true host tick is its guest tick minus the
//! skew, exactly. Tier 2 boots the real agent under QEMU with a workload and a software skew
//! derived from the host TSC (rate 1.0001 or 1), and takes the truth from KVM's debugfs
//! mapping composed with that skew (`vmtsync_tests::truth`).

use std::path::Path;
use std::time::{Duration, Instant};

use vmtsync_core::GuestTicks;
use vmtsync_core::HostTicks;
use vmtsync_tests::fake_agent::{Late, Workload};
use vmtsync_tests::truth::{GuestTruth, Skew, truth_mapping};
use vmtsync_tests::vmm::agent_elf;
use vmtsync_tests::vmm::qemu::Machine;

use crate::util::{
    Loopback, QemuAgent, TICKS, have_trace_cmd, loopback_with, qemu_ready, read_jsonl,
    report_events, scratch, seq_of, text, trace_cmd, u,
};

crate::trials!(
    have_trace_cmd;
    trace_dat_v6_and_v7_read_back_in_trace_cmd_on_the_host_timeline;
    qemu_ready;
    qemu_agent_workload_is_recorded_on_the_true_host_timeline,
    qemu_flight_recorder_gives_the_newest_records_and_the_exact_overwritten_count,
    vsock_ingest_keeps_every_sent_event_and_counts_the_rest,
);

/// `(timestamp, seq)` of the events of one `trace-cmd report`.
type Reported = Vec<(u64, u64)>;

/// Checks `dat` with `trace-cmd dump -v`, then its events as `trace-cmd report --raw-ts`
/// (timestamps as stored) and `report -t` (TIME_SHIFT applied) show them.
fn raw_and_host_reports(dat: &Path) -> (Reported, Reported) {
    crate::tracedat::assert_dump_ok(dat);
    let p = dat.to_str().unwrap();
    (
        report_events(&trace_cmd(&["report", "--raw-ts", "-i", p])),
        report_events(&trace_cmd(&["report", "-t", TICKS[0], TICKS[1], "-i", p])),
    )
}

/// Tier 2 (trace-cmd): trace.dat v6 and v7 from the loopback agent: `trace-cmd dump -v`
/// accepts them, `report --raw-ts` shows every event with its raw guest TSC in order, and
/// `report -t` (TIME_SHIFT applied) puts each within the recording's widest guaranteed
/// interval of its true host tick. The first sync round is slow, as on a loaded host (every
/// probe reply 2 ms late: a wide box whose centre lies about 1 ms from the truth, outside the
/// next round's box, checked in the sync file), so a TIME_SHIFT taken from that round's own
/// offset would show its events far outside their intervals.
fn trace_dat_v6_and_v7_read_back_in_trace_cmd_on_the_host_timeline() {
    const PROBES: u32 = 16;
    for version in ["6", "7"] {
        let n = 5_000;
        let lb = loopback_with(
            "tracedat",
            Workload {
                count: n,
                rate: 50_000,
                late: Late {
                    probes: PROBES,
                    delay: Duration::from_millis(2),
                },
            },
        );
        let dat = lb.dir.path().join("guest.dat");
        let sync = lb.dir.path().join("sync.jsonl");
        let probes = PROBES.to_string();
        let out = lb.record(
            &dat,
            n,
            20,
            &[
                "--file-version",
                version,
                "--probes",
                &probes,
                "--sync-out",
                sync.to_str().unwrap(),
            ],
        );
        let segs: Vec<(i64, i64, i64)> = read_jsonl(&sync)
            .iter()
            .filter(|v| v["type"] == "segment")
            .map(|v| {
                let i = |k: &str| v[k].as_i64().expect("an offset");
                (i("offset_lo"), i("offset"), i("offset_hi"))
            })
            .collect();
        assert!(segs.len() >= 2, "v{version}: {segs:?}");
        let ((_, centre, _), (lo1, _, hi1)) = (segs[0], segs[1]);
        assert!(
            !(lo1..=hi1).contains(&centre),
            "v{version}: the slow round's centre {centre} lies outside the next box [{lo1}, {hi1}]"
        );
        let Loopback { skew, agent, .. } = lb;
        let dropped = agent.join().unwrap();
        let stderr = text(&out.stderr);
        let max_width: u64 = stderr
            .split("max ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.trim_end_matches(',').parse().ok())
            .unwrap_or_else(|| panic!("summary without widths: {stderr}"));
        let (raw, host) = raw_and_host_reports(&dat);
        assert_eq!(raw.len() as u64, n - dropped, "v{version}: {stderr}");
        assert_eq!(host.len(), raw.len());
        let mut misses = 0;
        let mut prev = None;
        for (&(g, seq), &(h, seq2)) in raw.iter().zip(&host) {
            assert_eq!(seq, seq2, "v{version}: the same event in both reports");
            assert!(
                prev.is_none_or(|p| seq > p),
                "v{version}: order broken at {seq}"
            );
            prev = Some(seq);
            let truth = g.wrapping_sub(skew.cast_unsigned());
            if h.abs_diff(truth) > max_width {
                misses += 1;
            }
        }
        assert!(
            raw.windows(2).all(|w| w[0].0 <= w[1].0),
            "raw TSCs out of order"
        );
        println!(
            "record trace.dat v{version}: {} events; {stderr}",
            raw.len()
        );
        assert_eq!(
            misses, 0,
            "v{version}: host times beyond the guaranteed width"
        );
    }
}

/// Tier 2: the real agent under QEMU emits a workload while answering probes; `vmtsync
/// record` writes JSON Lines and trace.dat. Truth: KVM's debugfs mapping of the VM composed
/// with the agent's skew (derived from the host TSC; once at rate 1.0001, once at rate 1).
/// Every event's guaranteed interval holds its true host tick; the trace.dat has every event
/// (its timestamps pre-converted at rate 1.0001, raw plus TIME_SHIFT at rate 1) and
/// `trace-cmd report -t` puts each within its interval.
fn qemu_agent_workload_is_recorded_on_the_true_host_timeline() {
    let picked = Skew::pick();
    let identity = Skew(vmtsync_core::mapping::KvmTscMapping::offset_only(
        picked.0.offset(),
    ));
    for (name, skew) in [("rate 1.0001", picked), ("rate 1", identity)] {
        let dir = scratch("qemu");
        // A rate COM1 carries with room to spare (each event is about 14 bytes on the wire).
        let n = 900;
        let append = format!(
            "transport=uart exit=0 workload=300,0 {}",
            skew.agent_option()
        );
        let vm = QemuAgent::boot(dir.path(), &append);
        let jsonl = dir.path().join("events.jsonl");
        let out = vm.record(&jsonl, n, 200, &["--format", "jsonl"]);
        assert_eq!(out.status.code(), Some(0), "{name}: {}", text(&out.stderr));
        let pid = vm.guard.pid();
        let truth = GuestTruth::new(truth_mapping(pid, 0).expect("debugfs truth"), Some(skew));
        let lines = read_jsonl(&jsonl);
        let mut misses = 0;
        for v in &lines {
            let (g, lo, hi) = (u(v, "guest_tsc"), u(v, "host_lo"), u(v, "host_hi"));
            if !truth.in_bracket(HostTicks(lo), GuestTicks(g), HostTicks(hi)) {
                misses += 1;
            }
        }
        // The same session goes on: a trace.dat of the next events.
        let dat = dir.path().join("guest.dat");
        let out2 = vm.record(&dat, 150, 200, &["--shutdown"]);
        drop(vm);
        let stderr = text(&out.stderr);
        println!(
            "record under QEMU, {name}: {} events; {}",
            lines.len(),
            stderr.trim()
        );
        assert_eq!(
            lines.len() as u64,
            n,
            "{name}: every event arrives (the ring never filled)"
        );
        assert_eq!(
            misses, 0,
            "{name}: intervals that miss the debugfs+skew truth"
        );
        let stderr2 = text(&out2.stderr);
        assert_eq!(out2.status.code(), Some(0), "{name}: {stderr2}");
        let (raw, host) = raw_and_host_reports(&dat);
        assert_eq!((raw.len(), host.len()), (150, 150), "{name}: {stderr2}");
        // Each event's host time (trace-cmd's, TIME_SHIFT applied or pre-converted) lies within
        // the widest guaranteed interval of the run from the truth's host tick of its raw
        // guest TSC (pre-converted files carry host ticks already).
        let max_width: u64 = stderr2
            .split("max ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.trim_end_matches(',').parse().ok())
            .unwrap_or_else(|| panic!("summary without widths: {stderr2}"));
        let exact = truth.composed().expect("truth composes");
        let preconverted = stderr2.contains("pre-converted");
        let mut far = 0;
        for (&(r, _), &(h, _)) in raw.iter().zip(&host) {
            if preconverted {
                assert_eq!(r, h, "a pre-converted file has no TIME_SHIFT");
                continue;
            }
            let t = exact
                .try_host_from_guest_ceil(GuestTicks(r))
                .expect("maps")
                .0;
            if h.abs_diff(t) > max_width {
                far += 1;
            }
        }
        assert_eq!(
            far, 0,
            "{name}: trace-cmd host times beyond the guaranteed width"
        );
        println!("  trace.dat: {} events; {}", host.len(), stderr2.trim());
    }
}

/// Tier 2: a flight recorder under QEMU. The agent's workload records 10x its ring's capacity
/// (4096 records) before `vmtsync record` attaches; the recording gets the newest 4096, in
/// order and contiguous, and reports exactly how many were overwritten. The truth of
/// "produced" is the guest's own sequence numbers in the payloads (the workload's count, and
/// the newest one received), never the code under test's counter; each event's interval is
/// checked against the debugfs+skew truth too.
fn qemu_flight_recorder_gives_the_newest_records_and_the_exact_overwritten_count() {
    const RING: u64 = 4096;
    const PRODUCED: u64 = 10 * RING;
    let skew = Skew(vmtsync_core::mapping::KvmTscMapping::offset_only(
        Skew::pick().0.offset(),
    ));
    let dir = scratch("qemu-flight");
    let append = format!(
        // Ring 3: the workload must outrun the drains, which it does only natively (the
        // default ring 0 is emulated on these nested hosts).
        "transport=uart ring=3 exit=0 flight=1 workload=10000000,{PRODUCED} {}",
        skew.agent_option()
    );
    let vm = QemuAgent::boot(dir.path(), &append);
    // At 10 M events/s the workload needs 4 ms of guest time (bursts of 64 between polls of
    // COM1); the host stays away for three seconds, boot included. A workload still running
    // when the host attaches would show below as sequence numbers short of the last one.
    std::thread::sleep(Duration::from_secs(3));
    // The truth is read while the VM surely runs: `--shutdown` ends it, and its debugfs
    // directory with it, as soon as the recording is done.
    let truth = GuestTruth::new(
        truth_mapping(vm.guard.pid(), 0).expect("debugfs truth"),
        Some(skew),
    );
    let jsonl = dir.path().join("events.jsonl");
    let out = vm.record(&jsonl, RING, 200, &["--format", "jsonl", "--shutdown"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    drop(vm);
    let lines = read_jsonl(&jsonl);
    let seqs: Vec<u64> = lines
        .iter()
        .map(|v| seq_of(v["payload"].as_str().unwrap()))
        .collect();
    let produced = seqs.last().map_or(0, |l| l + 1);
    println!(
        "flight recorder under QEMU: {} events received, {produced} produced; {}",
        seqs.len(),
        stderr.trim()
    );
    assert_eq!(
        produced, PRODUCED,
        "the workload had not finished: {stderr}"
    );
    assert_eq!(
        seqs,
        (PRODUCED - RING..PRODUCED).collect::<Vec<_>>(),
        "the newest records, contiguous, each once"
    );
    let overwritten = produced - seqs.len() as u64;
    assert!(
        stderr.contains(&format!("{overwritten} dropped by the guest's ring"))
            && stderr.contains(&format!(
                "({overwritten} overwritten by its flight recorder before they were sent, 0 refused"
            )),
        "the summary names the exact overwritten count {overwritten}: {stderr}"
    );
    assert!(!stderr.contains("lost in transit"), "{stderr}");
    let misses = lines
        .iter()
        .filter(|v| {
            let (g, lo, hi) = (u(v, "guest_tsc"), u(v, "host_lo"), u(v, "host_hi"));
            !truth.in_bracket(HostTicks(lo), GuestTicks(g), HostTicks(hi))
        })
        .count();
    assert_eq!(misses, 0, "intervals that miss the debugfs+skew truth");
}

/// Tier 2: sustained ingest over virtio-vsock (QEMU microvm + vhost-device-vsock): the agent's
/// workload asks for a million events per second; `vmtsync record` (the library, over the rig's
/// connection) drains for about three seconds. Every event the agent sent arrives, in order,
/// inside the guaranteed interval of its debugfs+skew truth; the measured rate and the ring's
/// drops are printed (the figure BENCHMARKS.md quotes).
fn vsock_ingest_keeps_every_sent_event_and_counts_the_rest() {
    use vmtsync::link::ProbeAddr;
    use vmtsync::probe::{ProbeOptions, Progress};
    use vmtsync::record::{OutputOptions, RecordFormat, RecordOptions, run_record_on};
    use vmtsync_tests::vmm::vsock::{VsockRig, ensure_vhost_device_vsock};

    let backend = ensure_vhost_device_vsock().expect("the vhost-device-vsock backend installs");
    let elf = agent_elf().expect("agent builds");
    let port = 5_400;
    let skew = Skew::pick();
    let append = format!(
        // Ring 3: a million events a second is bulk work, native there and emulated in the
        // default ring 0 on these nested hosts (guest-agent/src/options.rs).
        "transport=vsock vsock=listen port={port} ring=3 exit=0 workload=1000000,0 {}",
        skew.agent_option()
    );
    let step = Duration::from_secs(30);
    let mut rig =
        VsockRig::start(Machine::Microvm, &backend, &elf, &append, port, step).expect("rig starts");
    rig.wait_log(&format!("vsock: listening on port {port}"), step)
        .expect("agent listens");
    let transport = rig.connect(port, step).expect("connects");
    let (qemu_pid, _) = rig.pids();
    let truth = GuestTruth::new(
        truth_mapping(qemu_pid, 0).expect("debugfs truth"),
        Some(skew),
    );
    let dir = scratch("vsock");
    let out = dir.path().join("events.jsonl");
    let mut probe = ProbeOptions::new(ProbeAddr::parse("tcp:127.0.0.1:1").unwrap());
    probe.timeout = Duration::from_secs(10);
    probe.shutdown = true;
    let opts = RecordOptions {
        probe,
        output: OutputOptions {
            out: out.clone(),
            format: RecordFormat::Jsonl,
            file_version: vmtsync::formats::tracedat::FileVersion::V7,
            events: None,
            duration: Some(Duration::from_secs(3)),
            sync_out: None,
        },
        resync: Duration::from_millis(500),
        drain_max: vmtsync::record::DRAIN_MAX,
        placement: vmtsync::sync::Placement::default(),
        spans: vmtsync::spans::SpanConfig::default(),
    };
    let started = Instant::now();
    let summary = run_record_on(transport, &opts, &mut Progress::hidden())
        .unwrap_or_else(|e| panic!("{e}\n{}", rig.diagnostics()));
    let secs = started.elapsed().as_secs_f64();
    let _ = rig.wait_exit(step);
    let lines = read_jsonl(&out);
    assert_eq!(lines.len() as u64, summary.events);
    let mut misses = 0;
    let mut prev = None;
    for v in &lines {
        let (g, lo, hi) = (u(v, "guest_tsc"), u(v, "host_lo"), u(v, "host_hi"));
        if !truth.in_bracket(HostTicks(lo), GuestTicks(g), HostTicks(hi)) {
            misses += 1;
        }
        let seq = seq_of(v["payload"].as_str().unwrap());
        assert!(prev.is_none_or(|p| seq > p), "order broken at {v}");
        prev = Some(seq);
    }
    // The agent's own count of what it sent, from its shutdown line.
    let log = rig.com2_log();
    let sent: u64 = log
        .split(" sent,")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no shutdown line in the agent's log:\n{log}"));
    let shutdown = log
        .lines()
        .find(|l| l.contains("shutdown after"))
        .unwrap_or("");
    println!("agent: {}", shutdown.trim());
    println!(
        "vsock ingest: {} events in {secs:.2} s = {:.0} events/s, {} dropped by the guest's ring \
         ({} sent by the agent); widths {:?}",
        summary.events,
        summary.events as f64 / secs,
        summary.dropped,
        sent,
        summary.widths
    );
    assert_eq!(summary.events, sent, "every event the agent sent arrived");
    assert_eq!(misses, 0, "intervals that miss the truth");
    assert!(summary.events > 0);
}
