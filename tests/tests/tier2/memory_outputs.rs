//! Tier 2: the CTF and Perfetto outputs of `vmtsync record --from-memory --trust-raw-tsc`
//! (issue 16), read by their real readers: babeltrace2 (its CLI and python3-bt2, the helpers
//! of `ctf.rs`) and Perfetto's trace processor (the helpers of `perfetto.rs`). The guest is
//! the bundled agent with `transport=none` under QEMU microvm/KVM, unskewed, so its records
//! hold the raw TSC.
//!
//! The truth comes from outside the reader and the writers: KVM's mapping of vCPU 0 through
//! `vmtsync_tests::truth` (the test's own reads of debugfs), and the event sequence from the
//! agent's payloads (its workload numbers events 0, 1, 2, ...).

use std::path::Path;

use vmtsync_core::{GuestTicks, HostTicks};
use vmtsync_tests::truth::{GuestTruth, Skew, truth_mapping};

use crate::ctf::{assert_ns, bt2_events, cli_events, ctf_ready, metadata_hz};
use crate::perfetto::{
    boottime_ns, mapped, mapped_streamed, node_ready, slices, snapshots, trace_processor,
};
use crate::util::{anchor_ready, boot_qemu, exact_host, qemu_ready, scratch, text, vmtsync};

crate::trials!(
    ctf_memory_ready; record_from_memory_into_ctf_reads_back_exactly_in_babeltrace2;
    perfetto_memory_ready; record_from_memory_into_perfetto_reads_back_exactly_in_the_trace_processor;
    beacon_outputs_ready; beacon_mode_streams_ctf_and_perfetto_whose_intervals_hold_the_truth;
);

/// Both readers, and the host's `kvm_pio` tracepoint (beacon mode traces it).
fn beacon_outputs_ready(test: &str) -> bool {
    ctf_ready(test) && node_ready(test) && anchor_ready(test)
}

/// [`ctf_ready`] (babeltrace2, python3-bt2) and QEMU with the debugfs truth.
fn ctf_memory_ready(test: &str) -> bool {
    ctf_ready(test) && qemu_ready(test)
}

/// [`node_ready`] (the trace processor) and QEMU with the debugfs truth.
fn perfetto_memory_ready(test: &str) -> bool {
    node_ready(test) && qemu_ready(test)
}

/// The workload: events per second and how many (fewer than the agent's 16 Ki-record ring,
/// so its stop-when-full ring refuses none), and the agent's workload event id.
const RATE: u64 = 200_000;
const COUNT: u64 = 10_000;
const WORKLOAD_EVENT: u64 = 0x100;

/// Boots the agent with its workload in memory (`extra`: more of its options); returns
/// QEMU's guard.
fn boot(dir: &Path, extra: &str) -> vmtsync_tests::ChildGuard {
    let (guard, _sock) = boot_qemu(
        dir,
        &format!("transport=none workload={RATE},{COUNT} beacons=100 {extra}"),
    );
    guard
}

/// `vmtsync record --from-memory --trust-raw-tsc` of QEMU `pid` into `out` as `format`, which
/// must succeed in exact mode with every workload event; returns its summary.
fn record_memory(pid: u32, out: &Path, format: &str) -> String {
    let mut c = vmtsync();
    c.args(["record", "--from-memory", "--trust-raw-tsc", "--vm"])
        .arg(pid.to_string())
        .args(["--format", format, "--events", &COUNT.to_string()])
        .args(["--duration", "60", "--no-progress", "--out"])
        .arg(out);
    let o = crate::util::guarded_output(&mut c, &[]);
    let stderr = text(&o.stderr);
    assert!(o.status.success(), "record --format {format}: {stderr}");
    assert!(stderr.contains("host time exact (KVM debugfs)"), "{stderr}");
    assert!(stderr.contains("across 0 mapping"), "{stderr}");
    assert!(
        stderr.contains(&format!("recorded {COUNT} events")),
        "{stderr}"
    );
    stderr
}

/// A workload payload's sequence number (u64 LE).
fn seq(payload: &[u8]) -> u64 {
    u64::from_le_bytes(payload.try_into().expect("an 8-byte payload"))
}

/// Tier 2 (babeltrace2): `record --from-memory --format ctf` of a live agent. babeltrace2's
/// python bindings show every workload event exactly once, in sequence, each one's clock
/// snapshot (cycles of the trace's clock, which is the host TSC) equal to its exact host
/// time from debugfs, its ns the exact conversion, its `host_tsc` (from `guest_tsc`) the
/// same, and the trace's environment declaring every interval exact (no interval fields);
/// the babeltrace2 CLI shows the same cycles.
fn record_from_memory_into_ctf_reads_back_exactly_in_babeltrace2() {
    let dir = scratch("memory-outputs-ctf");
    let mut guard = boot(dir.path(), "");
    let pid = guard.child().id();
    let out = dir.path().join("trace");
    let stderr = record_memory(pid, &out, "ctf");
    // The truth, read by the test after the run (the agent never writes its TSC, and the
    // summary says no mapping change was seen).
    let kvm = truth_mapping(pid, 0).expect("truth from debugfs");
    drop(guard);
    println!("record --from-memory ctf: {}", stderr.trim());

    let hz = metadata_hz(&out);
    let bt = bt2_events(&[&out]);
    assert_eq!(bt.len() as u64, COUNT, "every event in babeltrace2");
    let mut want = Vec::with_capacity(bt.len());
    for (i, e) in bt.iter().enumerate() {
        assert_eq!(e.event, "vmtsync:event", "{e:?}");
        assert_eq!((e.f("vcpu"), e.f("id")), (0, WORKLOAD_EVENT), "{e:?}");
        assert_eq!(seq(&e.payload()), i as u64, "event {i} in sequence: {e:?}");
        let host = exact_host(&kvm, e.f("guest_tsc"));
        assert_eq!(e.cycles, host, "event {i}'s clock snapshot: {e:?}");
        assert_ns(e.ns, host, hz, &format!("event {i}"));
        // An exact recording's interval is its host_tsc alone: the trace says so, and no
        // field repeats it.
        assert_eq!(e.f("host_tsc"), host, "event {i}'s host_tsc: {e:?}");
        assert_eq!(
            e.interval.as_deref(),
            Some("exact"),
            "the trace's env: {e:?}"
        );
        assert!(
            e.fields.get("host_lo").is_none(),
            "event {i}'s fields: {e:?}"
        );
        want.push((host, 0, host));
    }
    let cli = cli_events(&[&out]);
    assert_eq!(
        cli, want,
        "the babeltrace2 CLI's cycles, vCPUs and host_tsc"
    );
    println!(
        "babeltrace2: {} events at {hz} Hz, each at its exact host TSC ({}..{})",
        bt.len(),
        want[0].0,
        want[want.len() - 1].0
    );
}

/// Tier 2 (the trace processor): `record --from-memory --format perfetto` of a live agent.
/// The trace processor shows every workload event exactly once, in sequence, on vCPU 0's
/// track of the guest machine, between the test's own BOOTTIME readings before and after,
/// its `host_tsc` argument the exact host TSC from debugfs, and its timestamp that exact
/// time on BOOTTIME through the trace's own TSC/BOOTTIME snapshots (recomputed here, 1 ns of
/// rounding; the writer streams, so through the snapshots written before the event), its
/// interval that instant widened on both sides by the snapshots' error.
fn record_from_memory_into_perfetto_reads_back_exactly_in_the_trace_processor() {
    let tp = trace_processor();
    let dir = scratch("memory-outputs-perfetto");
    let before = boottime_ns();
    let mut guard = boot(dir.path(), "");
    let pid = guard.child().id();
    let trace = dir.path().join("guest.perfetto-trace");
    let stderr = record_memory(pid, &trace, "perfetto");
    let after = boottime_ns();
    let kvm = truth_mapping(pid, 0).expect("truth from debugfs");
    drop(guard);
    println!("record --from-memory perfetto: {}", stderr.trim());

    let snaps = snapshots(&tp, &trace);
    let mut all = slices(&tp, &trace);
    assert_eq!(all.len() as u64, COUNT, "every event is a slice");
    // The trace processor orders by timestamp; a tie keeps no particular order, so put the
    // events in the guest's order (its TSC, then its sequence number).
    let key = |s: &crate::perfetto::Slice| {
        let p = s.payload.as_deref().expect("payload argument");
        (
            s.guest_tsc.expect("guest_tsc argument"),
            u64::from_str_radix(p, 16)
                .expect("hex payload")
                .swap_bytes(),
        )
    };
    all.sort_by_key(key);
    let mut widening = 0;
    for (i, s) in all.iter().enumerate() {
        assert_eq!((s.track.as_str(), s.machine), ("vCPU 0", Some(1)), "{s:?}");
        assert_eq!(key(s).1, i as u64, "event {i} in sequence: {s:?}");
        assert!(
            i128::from(before) <= s.ts && s.ts <= i128::from(after),
            "{s:?} outside the recording's BOOTTIME [{before}, {after}]"
        );
        let g = u64::try_from(s.guest_tsc.unwrap()).unwrap();
        let host = i128::from(exact_host(&kvm, g));
        assert_eq!(s.host_tsc, Some(host), "event {i}'s host TSC: {s:?}");
        // Streamed: through the snapshots written before the event (docs/perfetto.md).
        let t = mapped(&snaps, host);
        assert!(
            mapped_streamed(&snaps, host)
                .iter()
                .any(|w| (s.ts - w).abs() <= 1),
            "event {i}: ts {} ns, exact host time {t} ns (through the snapshots around it): \
             {s:?}",
            s.ts
        );
        // A width-0 interval, widened on both sides by the snapshots' error (docs/perfetto.md),
        // holding the host time through the snapshots around it too.
        let (lo, hi) = (s.lo_ns.unwrap(), s.hi_ns.unwrap());
        assert!(
            lo <= t && t <= hi,
            "event {i}: {t} ns outside its interval: {s:?}"
        );
        assert_eq!(
            s.ts - lo,
            hi - s.ts,
            "event {i}: a width-0 interval, widened: {s:?}"
        );
        widening = widening.max(hi - s.ts);
    }
    println!(
        "trace processor: {} events on BOOTTIME {}..{} ns, each its exact host time; \
         intervals widened by at most {widening} ns (the snapshots' error)",
        all.len(),
        all[0].ts,
        all[all.len() - 1].ts
    );
}

/// Tier 2 (babeltrace2 and the trace processor): beacon mode streams CTF and Perfetto too
/// (docs/record.md, "Memory recordings stream"). The agent's clock is a software skew of the
/// raw TSC (derived from the host TSC when the test starts, +100 ppm), so its header says clock
/// 1 and only its beacons place it. Each reader shows every workload event once, in sequence,
/// its interval holding the host time at which the skewed clock read its value, by the truth
/// (KVM's mapping from debugfs, then the skew), and its point inside: babeltrace2 in host
/// ticks (`host_lo`, `host_hi`, `host_tsc`), the trace processor on BOOTTIME through the
/// trace's own snapshots.
fn beacon_mode_streams_ctf_and_perfetto_whose_intervals_hold_the_truth() {
    let tp = trace_processor();
    let skew = Skew::pick();
    for format in ["ctf", "perfetto"] {
        let dir = scratch(&format!("memory-outputs-beacons-{format}"));
        let mut guard = boot(dir.path(), &skew.agent_option());
        let pid = guard.child().id();
        let out = dir.path().join(format);
        let mut c = vmtsync();
        c.args(["record", "--from-memory", "--vm", &pid.to_string()])
            .args(["--format", format, "--events", &COUNT.to_string()])
            .args(["--duration", "60", "--no-progress", "--out"])
            .arg(&out);
        let o = crate::util::guarded_output(&mut c, &[]);
        let stderr = text(&o.stderr);
        assert!(o.status.success(), "record --format {format}: {stderr}");
        assert!(
            stderr.contains("host time beacons (kvm_pio brackets)")
                && stderr.contains(&format!("recorded {COUNT} events")),
            "{format}: {stderr}"
        );
        let truth = GuestTruth::read(pid, 0, Some(skew)).expect("truth from debugfs");
        drop(guard);
        println!("record --from-memory {format} (beacons): {}", stderr.trim());
        if format == "ctf" {
            let bt = bt2_events(&[&out]);
            assert_eq!(bt.len() as u64, COUNT, "every event in babeltrace2");
            for (i, e) in bt.iter().enumerate() {
                assert_eq!((e.f("vcpu"), e.f("id")), (0, WORKLOAD_EVENT), "{e:?}");
                assert_eq!(seq(&e.payload()), i as u64, "event {i} in sequence: {e:?}");
                assert_eq!(
                    e.interval, None,
                    "beacon mode claims no exact interval: {e:?}"
                );
                let (lo, hi, host) = (e.f("host_lo"), e.f("host_hi"), e.f("host_tsc"));
                assert!(
                    truth.in_bracket(HostTicks(lo), GuestTicks(e.f("guest_tsc")), HostTicks(hi)),
                    "event {i}'s interval misses the truth: {e:?}"
                );
                assert!((lo..=hi).contains(&host), "event {i}'s point: {e:?}");
            }
            println!(
                "babeltrace2: {} events, each interval holding the truth",
                bt.len()
            );
        } else {
            let exact = truth.composed().expect("the truth as one mapping");
            let snaps = snapshots(&tp, &out);
            let mut all = slices(&tp, &out);
            assert_eq!(all.len() as u64, COUNT, "every event is a slice");
            let key = |s: &crate::perfetto::Slice| {
                let p = s.payload.as_deref().expect("payload argument");
                u64::from_str_radix(p, 16)
                    .expect("hex payload")
                    .swap_bytes()
            };
            all.sort_by_key(key);
            for (i, s) in all.iter().enumerate() {
                assert_eq!(key(s), i as u64, "event {i} in sequence: {s:?}");
                let g = u64::try_from(s.guest_tsc.expect("guest_tsc")).unwrap();
                // The skewed clock floors: the truth lies within a tick of the floor.
                let host = exact
                    .try_host_from_guest_floor(GuestTicks(g))
                    .expect("in range")
                    .0;
                let (lo, hi) = (s.lo_ns.unwrap(), s.hi_ns.unwrap());
                let (t0, t1) = (
                    mapped(&snaps, i128::from(host)),
                    mapped(&snaps, i128::from(host) + 1),
                );
                assert!(
                    lo <= t1 && t0 <= hi,
                    "event {i}: its true host time ({t0}..{t1} ns) outside its interval: {s:?}"
                );
                assert!(lo <= s.ts && s.ts <= hi, "event {i}'s point: {s:?}");
            }
            println!(
                "trace processor: {} events, each interval holding the truth",
                all.len()
            );
        }
    }
}
