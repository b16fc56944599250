//! Perfetto traces (`vmtsync export perfetto`, `vmtsync record --format perfetto`) read back by
//! Perfetto's own trace processor (v55.3, its wasm build under Node, through our glue
//! `tests/assets/trace_processor_query.mjs`), with SQL.
//!
//! Truth from outside the writer: this file reads CLOCK_BOOTTIME and the TSC itself (libc, not
//! vmtsync's snapshot code) to check that the trace's BOOTTIME is the host's, that a guest event
//! lines up with a host Perfetto event stamped with the test's own BOOTTIME reading, and that
//! events recorded between two readings land between them; the loopback agent's events have a
//! known true host tick (guest − skew), the QEMU agent's come from KVM's debugfs mapping
//! composed with the agent's software skew. The exporter's own numbers are checked against an
//! independent re-computation from the snapshots the trace processor reports.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use vmtsync::formats::perfetto::proto::{
    self, TracePacket, TrackDescriptor, TrackEvent, append_packet,
};
use vmtsync::kvm::hosttsc::read_host_tsc;
use vmtsync_core::GuestTicks;
use vmtsync_launch::trace_processor::{ensure_trace_processor, query_script};
use vmtsync_tests::require;
use vmtsync_tests::truth::{GuestTruth, Skew, truth_mapping};
use vmtsync_tests::vmm::agent_elf;

use crate::util::{QemuAgent, loopback, qemu_ready, scratch};
use crate::util::{export_perfetto, guarded_output};

crate::trials!(
    node_ready;
    exported_jsonl_reads_back_in_the_trace_processor_on_boottime,
    loopback_recording_in_perfetto_sits_on_the_host_boottime;
    node_qemu_ready;
    qemu_agent_in_perfetto_lines_up_with_the_host_boottime,
);

/// The trace processor's prerequisite: Node (the trace processor is its wasm build). The
/// trace processor itself is fetched by the test, like the agent it builds.
pub(crate) fn node_ready(test: &str) -> bool {
    let node = Command::new("node").arg("--version").output();
    require(
        test,
        node.is_ok_and(|o| o.status.success()),
        "node is missing (apt-get install nodejs; `cargo xtask setup`)",
    )
}

/// [`node_ready`] and QEMU with the truth and trace-cmd ([`qemu_ready`]).
fn node_qemu_ready(test: &str) -> bool {
    node_ready(test) && qemu_ready(test)
}

/// The trace processor's directory (fetched and checked on first use).
pub(crate) fn trace_processor() -> PathBuf {
    ensure_trace_processor().expect("Perfetto's trace processor")
}

/// Runs `queries` on `trace`; each query's rows (integers come as decimal strings).
pub(crate) fn sql(tp: &Path, trace: &Path, queries: &[&str]) -> Vec<Vec<Vec<Value>>> {
    let input = serde_json::to_vec(queries).unwrap();
    let out = guarded_output(
        Command::new("node").arg(query_script()).arg(tp).arg(trace),
        &input,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "trace processor failed: {stderr}");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("trace processor output ({e}): {stderr}"));
    v["results"]
        .as_array()
        .unwrap()
        .iter()
        .zip(queries)
        .map(|(r, q)| {
            assert!(r.get("error").is_none(), "{q}: {}", r["error"]);
            r["rows"]
                .as_array()
                .unwrap()
                .iter()
                .map(|row| row.as_array().unwrap().clone())
                .collect()
        })
        .collect()
}

/// An integer cell.
pub(crate) fn int(v: &Value) -> i128 {
    match v {
        Value::String(s) => s.parse().unwrap_or_else(|_| panic!("not an integer: {s}")),
        Value::Number(n) => i128::from(n.as_i64().unwrap()),
        _ => panic!("not an integer: {v}"),
    }
}

/// CLOCK_BOOTTIME, ns, read by the test itself.
pub(crate) fn boottime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &raw mut ts) };
    assert_eq!(r, 0, "clock_gettime(CLOCK_BOOTTIME)");
    u64::try_from(ts.tv_sec).unwrap() * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap()
}

/// The test's own TSC/BOOTTIME pair: BOOTTIME read between two TSC reads (the tightest of 32
/// tries): `(tsc_before, boottime, tsc_after)`.
fn own_pair() -> (u64, u64, u64) {
    (0..32)
        .map(|_| {
            let a = read_host_tsc().0;
            let ns = boottime_ns();
            (a, ns, read_host_tsc().0)
        })
        .min_by_key(|(a, _, b)| b - a)
        .unwrap()
}

/// The TSC/BOOTTIME snapshots the trace processor read from the trace: `(tsc, ns)` sorted
/// (snapshot ids are per machine, and the guest machine has its own snapshots).
pub(crate) fn snapshots(tp: &Path, trace: &Path) -> Vec<(i128, i128)> {
    let rows = sql(
        tp,
        trace,
        &[
            "select a.clock_value, b.clock_value from clock_snapshot a join clock_snapshot b \
           using (snapshot_id, machine_id) where a.clock_id = 64 and b.clock_id = 6 \
           order by a.clock_value",
        ],
    );
    rows[0].iter().map(|r| (int(&r[0]), int(&r[1]))).collect()
}

/// `tsc` on BOOTTIME through `snaps`, recomputed here: the line through the nearest snapshot at
/// or before it and the next (the first pair before the first, the last pair after the last).
pub(crate) fn mapped(snaps: &[(i128, i128)], tsc: i128) -> i128 {
    assert!(
        snaps.len() >= 2,
        "the trace carries {} snapshots",
        snaps.len()
    );
    let i = snaps.iter().take_while(|s| s.0 <= tsc).count();
    let a = i.saturating_sub(1).min(snaps.len() - 2);
    let ((t0, n0), (t1, n1)) = (snaps[a], snaps[a + 1]);
    n0 + ((tsc - t0) * (n1 - n0) * 2 + (t1 - t0)).div_euclid(2 * (t1 - t0))
}

/// `tsc` on BOOTTIME as a streaming writer may have converted it: through [`mapped`]'s pair,
/// or, written before the snapshot after it was taken, through the pair before (the line
/// extrapolated past its second snapshot). `record --from-memory` in exact mode streams
/// (docs/record.md, "Exact mode streams").
pub(crate) fn mapped_streamed(snaps: &[(i128, i128)], tsc: i128) -> Vec<i128> {
    let mut ways = vec![mapped(snaps, tsc)];
    let i = snaps.iter().take_while(|s| s.0 <= tsc).count();
    if (2..snaps.len()).contains(&i) {
        ways.push(mapped(&snaps[..i], tsc));
    }
    ways
}

/// Every slice with its track, machine and arguments.
const EVENTS: &str = "select s.ts, s.name, t.name, m.raw_id, \
    extract_arg(s.arg_set_id, 'debug.host_tsc'), extract_arg(s.arg_set_id, 'debug.guest_tsc'), \
    s.ts - extract_arg(s.arg_set_id, 'debug.before_ns'), \
    s.ts + extract_arg(s.arg_set_id, 'debug.after_ns'), \
    extract_arg(s.arg_set_id, 'debug.payload') \
    from slice s join track t on s.track_id = t.id left join machine m on t.machine_id = m.id \
    order by s.ts";

/// One slice as the trace processor reports it.
#[derive(Debug)]
pub(crate) struct Slice {
    pub(crate) ts: i128,
    pub(crate) name: String,
    pub(crate) track: String,
    pub(crate) machine: Option<i128>,
    pub(crate) host_tsc: Option<i128>,
    pub(crate) guest_tsc: Option<i128>,
    pub(crate) lo_ns: Option<i128>,
    pub(crate) hi_ns: Option<i128>,
    pub(crate) payload: Option<String>,
}

pub(crate) fn slices(tp: &Path, trace: &Path) -> Vec<Slice> {
    let opt = |v: &Value| (!v.is_null()).then(|| int(v));
    sql(tp, trace, &[EVENTS])[0]
        .iter()
        .map(|r| Slice {
            ts: int(&r[0]),
            name: r[1].as_str().unwrap_or_default().to_owned(),
            track: r[2].as_str().unwrap_or_default().to_owned(),
            machine: opt(&r[3]),
            host_tsc: opt(&r[4]),
            guest_tsc: opt(&r[5]),
            lo_ns: opt(&r[6]),
            hi_ns: opt(&r[7]),
            payload: r[8].as_str().map(str::to_owned),
        })
        .collect()
}

/// The `within N ns` figure of an export summary.
fn summary_error_ns(stderr: &str) -> i128 {
    stderr
        .split("within ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no error figure in the summary: {stderr}"))
}

/// A one-event host Perfetto trace (machine 0, BOOTTIME): the host side a user would merge.
fn host_trace(path: &Path, ts: u64) {
    let mut buf = Vec::new();
    append_packet(
        &TracePacket {
            trusted_packet_sequence_id: Some(1000),
            track_descriptor: Some(TrackDescriptor {
                uuid: Some(4242),
                name: Some("host marker".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        &mut buf,
    );
    append_packet(
        &TracePacket {
            trusted_packet_sequence_id: Some(1000),
            timestamp: Some(ts),
            track_event: Some(TrackEvent {
                r#type: Some(proto::TYPE_INSTANT),
                track_uuid: Some(4242),
                name: Some("host marker".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        &mut buf,
    );
    std::fs::write(path, buf).unwrap();
}

/// The marker event's id in the synthetic recording.
const MARKER: u64 = 999;

/// Synthetic recording, three vCPUs: `vmtsync export perfetto` from JSON Lines. The trace
/// processor sees every event on its vCPU's track on the guest machine, each timestamp equal
/// (within the 1 ns of rounding) to the JSON Lines host TSC mapped through the trace's own
/// snapshots, its arguments as recorded, its interval around it; the snapshots agree with the
/// test's own BOOTTIME reading; and a guest event at the TSC of that reading lines up with a
/// host Perfetto event stamped with it, in one merged trace.
fn exported_jsonl_reads_back_in_the_trace_processor_on_boottime() {
    let tp = trace_processor();
    let dir = scratch("perfetto-export");
    let jsonl = dir.path().join("events.jsonl");
    // Events over the last ~2e9 ticks (about a second here), and the marker at the test's own
    // clock reading.
    let (m_lo, m_ns, m_hi) = own_pair();
    let marker_tsc = m_lo + (m_hi - m_lo) / 2;
    let base = marker_tsc - 2_000_000_000;
    let n = 3000u64;
    let mut lines = String::new();
    let mut want: HashMap<(u32, i128), (u64, u64, u64, String)> = HashMap::new();
    for i in 0..=n {
        let (vcpu, id, host) = if i == n {
            (1, MARKER, marker_tsc)
        } else if i % 10 == 9 {
            // Earlier than the vCPU's previous event: the writer's timestamps go back.
            (
                u32::try_from(i % 3).unwrap(),
                i % 5,
                base + (i - 6) * 600_000 + 300_000,
            )
        } else {
            (
                u32::try_from(i % 3).unwrap(),
                i % 5,
                base + i * 600_000 + i % 7,
            )
        };
        let w = 50 + i % 1000;
        let payload = if i % 4 == 0 {
            format!("{:016x}", i.swap_bytes())
        } else {
            String::new()
        };
        let guest = host + 77_777;
        lines.push_str(&format!(
            "{{\"schema\":1,\"vcpu\":{vcpu},\"id\":{id},\"guest_tsc\":{guest},\"host_tsc\":{host},\
             \"host_lo\":{},\"host_hi\":{},\"payload\":\"{payload}\",\"round\":0}}\n",
            host - w,
            host + w
        ));
        want.insert((vcpu, i128::from(host)), (id, guest, w, payload));
    }
    std::fs::write(&jsonl, lines).unwrap();
    let trace = dir.path().join("guest.perfetto-trace");
    let out = export_perfetto(&jsonl, &trace);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "export: {stderr}");
    println!("{}", stderr.trim());
    let err_ns = summary_error_ns(&stderr);
    let (a_lo, a_ns, a_hi) = own_pair();

    let snaps = snapshots(&tp, &trace);
    assert!(snaps.len() >= 2, "{snaps:?}");
    // The trace's BOOTTIME is the host's: its snapshots predict the test's own readings, one
    // taken before the export and one after, within the export's stated error plus each
    // reading's own TSC gap (as ns, at most that many ticks).
    for (lo, ns, hi) in [(m_lo, m_ns, m_hi), (a_lo, a_ns, a_hi)] {
        let got = mapped(&snaps, i128::from(lo + (hi - lo) / 2));
        let slack = err_ns + i128::from(hi - lo);
        assert!(
            (got - i128::from(ns)).abs() <= slack,
            "snapshots map the test's TSC to {got}, its BOOTTIME read {ns} (slack {slack})"
        );
    }

    let all = slices(&tp, &trace);
    assert_eq!(all.len() as u64, n + 1, "every event is a slice");
    let mut per_track: HashMap<String, u64> = HashMap::new();
    for s in &all {
        *per_track.entry(s.track.clone()).or_default() += 1;
        assert_eq!(s.machine, Some(1), "guest events sit on machine 1: {s:?}");
        let host = s.host_tsc.expect("host_tsc argument");
        let vcpu: u32 = s.track.trim_start_matches("vCPU ").parse().unwrap();
        let (id, guest, w, payload) = want.get(&(vcpu, host)).expect("an event we wrote");
        assert_eq!(s.name, format!("event {id}"));
        assert_eq!(s.guest_tsc, Some(i128::from(*guest)));
        assert_eq!(s.payload.as_deref().unwrap_or(""), payload);
        let expect = mapped(&snaps, host);
        assert!(
            (s.ts - expect).abs() <= 1,
            "ts {} vs host TSC {host} mapped to {expect}",
            s.ts
        );
        let (lo, hi) = (s.lo_ns.unwrap(), s.hi_ns.unwrap());
        assert!(lo <= s.ts && s.ts <= hi, "{s:?}");
        // The interval is the recorded one mapped, widened by at most the stated error.
        let (rlo, rhi) = (
            mapped(&snaps, host - i128::from(*w)),
            mapped(&snaps, host + i128::from(*w)),
        );
        assert!(lo <= rlo && rlo - lo <= err_ns + 1, "{s:?} vs {rlo}");
        assert!(hi >= rhi && hi - rhi <= err_ns + 1, "{s:?} vs {rhi}");
    }
    assert_eq!(
        per_track,
        HashMap::from([
            ("vCPU 0".to_owned(), 1000),
            ("vCPU 1".to_owned(), 1001),
            ("vCPU 2".to_owned(), 1000)
        ])
    );

    // Merged with a host trace: the host marker at the test's BOOTTIME reading and the guest
    // marker at that reading's TSC line up.
    let host = dir.path().join("host.perfetto-trace");
    host_trace(&host, m_ns);
    let merged = dir.path().join("merged.perfetto-trace");
    let mut f = std::fs::File::create(&merged).unwrap();
    f.write_all(&std::fs::read(&host).unwrap()).unwrap();
    f.write_all(&std::fs::read(&trace).unwrap()).unwrap();
    drop(f);
    let rows = sql(
        &tp,
        &merged,
        &[
            "select ts, name from slice where name in ('host marker', 'event 999') order by name",
            "select count(*) from slice",
        ],
    );
    assert_eq!(int(&rows[1][0][0]), i128::from(n) + 2);
    let (guest_ts, host_ts) = (int(&rows[0][0][0]), int(&rows[0][1][0]));
    assert_eq!(
        host_ts,
        i128::from(m_ns),
        "the host event keeps its timestamp"
    );
    let slack = err_ns + i128::from(m_hi - m_lo);
    println!(
        "merged with a host trace: guest marker {guest_ts} ns, host marker {host_ts} ns, \
         {} ns apart (allowed {slack})",
        guest_ts - host_ts
    );
    assert!(
        (guest_ts - host_ts).abs() <= slack,
        "guest marker {guest_ts} vs host marker {host_ts}: not lined up within {slack} ns"
    );
}

/// Checks a trace written by `record --format perfetto` of the agent's `count` workload events
/// on vCPU 0, recorded between BOOTTIME readings `before` and `after`: every event on one track
/// of the guest machine, inside `[before, after]`, its timestamp its host TSC mapped through the
/// trace's snapshots, and its true host tick (`truth`, from the guest TSC) mapped the same way
/// inside its interval. Returns the slices.
fn check_recorded(
    tp: &Path,
    trace: &Path,
    count: u64,
    (before, after): (u64, u64),
    truth: &dyn Fn(u64) -> u64,
) -> Vec<Slice> {
    let snaps = snapshots(tp, trace);
    let all = slices(tp, trace);
    assert_eq!(all.len() as u64, count, "every event is a slice");
    let mut seqs = Vec::new();
    for s in &all {
        assert_eq!((s.track.as_str(), s.machine), ("vCPU 0", Some(1)), "{s:?}");
        assert!(
            i128::from(before) <= s.ts && s.ts <= i128::from(after),
            "{s:?} outside the recording's BOOTTIME [{before}, {after}]"
        );
        let host = s.host_tsc.unwrap();
        assert!((s.ts - mapped(&snaps, host)).abs() <= 1, "{s:?}");
        let g = u64::try_from(s.guest_tsc.unwrap()).unwrap();
        let t = mapped(&snaps, i128::from(truth(g)));
        // One ns of rounding on each side of the comparison.
        assert!(
            s.lo_ns.unwrap() - 1 <= t && t <= s.hi_ns.unwrap() + 1,
            "{s:?}: the true host time {t} ns is outside its interval"
        );
        let p = s.payload.as_deref().unwrap();
        seqs.push(u64::from_str_radix(p, 16).unwrap().swap_bytes());
    }
    seqs.sort_unstable();
    seqs.dedup();
    assert_eq!(seqs.len() as u64, count, "each workload event once");
    all
}

/// Tier 2 (node, the trace processor): `record --format perfetto` from the loopback agent (true host tick = guest − skew):
/// every event between the test's BOOTTIME readings before and after, its interval around the
/// truth.
fn loopback_recording_in_perfetto_sits_on_the_host_boottime() {
    let tp = trace_processor();
    let n = 2000;
    let lb = loopback("perfetto-loopback", n, 20_000);
    let trace = lb.dir.path().join("guest.perfetto-trace");
    let before = boottime_ns();
    let out = lb.record(&trace, n, 100, &["--format", "perfetto"]);
    let after = boottime_ns();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let _ = lb.agent.join();
    let skew = lb.skew;
    let all = check_recorded(&tp, &trace, n, (before, after), &|g| {
        g.wrapping_sub(skew.cast_unsigned())
    });
    println!(
        "record --format perfetto (loopback): {} events, BOOTTIME {}..{} ns; {}",
        all.len(),
        all[0].ts,
        all[all.len() - 1].ts,
        stderr.trim()
    );
}

/// Tier 2: the real agent under QEMU (a software skew at rate 1.0001, truth from debugfs
/// composed with it): `record --format jsonl` exported with `export perfetto`, then `record
/// --format perfetto` of the same session; both read back in the trace processor with every
/// event between the test's BOOTTIME readings and inside its interval around the truth.
fn qemu_agent_in_perfetto_lines_up_with_the_host_boottime() {
    let tp = trace_processor();
    let skew = Skew::pick();
    let dir = scratch("perfetto-qemu");
    let append = format!(
        "transport=uart exit=0 workload=300,0 {}",
        skew.agent_option()
    );
    let _ = agent_elf().expect("agent builds");
    let vm = QemuAgent::boot(dir.path(), &append);

    let jsonl = dir.path().join("events.jsonl");
    let before = boottime_ns();
    let out = vm.record(&jsonl, 300, 200, &["--format", "jsonl"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The truth while the VM runs (the second recording ends it).
    let pid = vm.guard.pid();
    let truth = GuestTruth::new(truth_mapping(pid, 0).expect("debugfs truth"), Some(skew));

    let direct = dir.path().join("direct.perfetto-trace");
    let out2 = vm.record(&direct, 150, 200, &["--format", "perfetto", "--shutdown"]);
    let after = boottime_ns();
    drop(vm);
    let stderr2 = String::from_utf8_lossy(&out2.stderr);
    assert_eq!(out2.status.code(), Some(0), "{stderr2}");
    let exact = truth.composed().expect("truth composes");
    let host_of = |g: u64| {
        exact
            .try_host_from_guest_ceil(GuestTicks(g))
            .expect("maps")
            .0
    };

    let exported = dir.path().join("exported.perfetto-trace");
    let out3 = export_perfetto(&jsonl, &exported);
    let stderr3 = String::from_utf8_lossy(&out3.stderr);
    assert!(out3.status.success(), "{stderr3}");
    let a = check_recorded(&tp, &exported, 300, (before, after), &host_of);
    let b = check_recorded(&tp, &direct, 150, (before, after), &host_of);
    // The direct recording goes on where the exported one stopped (the agent's sequence
    // numbers), so the true time of the first lies after the last's: each session's interval,
    // from its own sync rounds, must allow that (the last's lower bound at most the first's
    // upper one). How far apart they are depends on when the second session started, so the
    // intervals need not overlap.
    let seq = |s: &Slice| u64::from_str_radix(s.payload.as_deref().unwrap(), 16).unwrap();
    let (last, first) = (&a[a.len() - 1], &b[0]);
    assert_eq!(seq(last).swap_bytes() + 1, seq(first).swap_bytes());
    assert!(last.guest_tsc < first.guest_tsc);
    assert!(last.lo_ns <= first.hi_ns, "{last:?} {first:?}");
    println!(
        "QEMU agent: export perfetto {} events ({}), record --format perfetto {} events ({})",
        a.len(),
        stderr3.trim(),
        b.len(),
        stderr2.trim()
    );
}
