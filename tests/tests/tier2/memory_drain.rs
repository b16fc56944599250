//! Tier 2: `vmtsync record --from-memory` attached late (issue 24, defect 2). The bundled
//! agent (`transport=none`) runs its whole workload, beacons included, and halts; only then
//! does a beacon-mode reader attach. None of the beacons it reads can be bracketed (they were
//! emitted before its trace started), so no beacon segment exists:
//! - a raw-TSC guest's events are placed by KVM's mapping alone (width 0), said to be not
//!   verified, each at its exact host time by the truth (debugfs, read by the test itself);
//! - a skewed guest's events cannot be placed at all: the reader fails with exit code 10
//!   instead of writing an empty file with success.

use vmtsync_core::GuestTicks;
use vmtsync_tests::truth::{Skew, truth_mapping};

use crate::util::{anchor_ready, boot_qemu, scratch, seq_of, text, u, vmtsync};

crate::trials!(
    anchor_ready; late_attach_places_a_raw_tsc_guest_by_kvms_mapping,
        late_attach_fails_when_nothing_can_place_the_events;
);

/// The workload: events per second and how many (fewer than the agent's ring), a beacon
/// every 100.
const RATE: u64 = 200_000;
const COUNT: u64 = 2_000;

/// Runs `vmtsync record --from-memory` on QEMU `pid` with `extra` flags into JSON Lines
/// `out`, for `COUNT` events (bounded by a generous duration).
fn record(pid: u32, out: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let mut c = vmtsync();
    c.args(["record", "--from-memory", "--vm", &pid.to_string()])
        .args(extra)
        .args(["--format", "jsonl", "--events", &COUNT.to_string()])
        .args(["--duration", "60", "--no-progress", "--out"])
        .arg(out);
    crate::util::guarded_output(&mut c, &[])
}

/// The JSON Lines of a recording.
fn lines_of(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .expect("jsonl written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn late_attach_places_a_raw_tsc_guest_by_kvms_mapping() {
    let test = "late_attach_places_a_raw_tsc_guest_by_kvms_mapping";
    let dir = scratch(test);
    let (mut guard, _sock) = boot_qemu(
        dir.path(),
        &format!("transport=none workload={RATE},{COUNT} beacons=100"),
    );
    let pid = guard.child().id();
    // A first reader waits for the whole workload (exact mode needs no beacon), so the guest
    // has recorded everything and emitted every beacon before the one under test attaches.
    let first = record(pid, &dir.path().join("first.jsonl"), &["--trust-raw-tsc"]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let out = dir.path().join("late.jsonl");
    let o = record(pid, &out, &[]);
    let stderr = text(&o.stderr);
    println!("record --from-memory, late, beacon mode: {}", stderr.trim());
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("recorded {COUNT} events")),
        "{stderr}"
    );
    assert!(
        stderr.contains("not verified") && stderr.contains("0 bracketed by kvm_pio exits"),
        "the summary says how they were placed: {stderr}"
    );
    let kvm = truth_mapping(pid, 0).expect("truth from debugfs");
    let lines = lines_of(&out);
    assert_eq!(lines.len() as u64, COUNT, "every event recovered");
    for (i, v) in lines.iter().enumerate() {
        assert_eq!(seq_of(v["payload"].as_str().unwrap()), i as u64, "{v}");
        let exact = kvm
            .try_host_from_guest_floor(GuestTicks(u(v, "guest_tsc")))
            .expect("in range")
            .0;
        assert_eq!(
            (u(v, "host_tsc"), u(v, "host_lo"), u(v, "host_hi")),
            (exact, exact, exact),
            "event {i} at its exact host time, width 0: {v}"
        );
    }
    drop(guard);
}

fn late_attach_fails_when_nothing_can_place_the_events() {
    let test = "late_attach_fails_when_nothing_can_place_the_events";
    let dir = scratch(test);
    let skew = Skew::pick();
    let (mut guard, _sock) = boot_qemu(
        dir.path(),
        &format!(
            "transport=none workload={RATE},{COUNT} beacons=100 {}",
            skew.agent_option()
        ),
    );
    let pid = guard.child().id();
    // A first beacon-mode reader, attached while the guest boots, places the skewed events
    // by their beacons and waits for the whole workload.
    let first = record(pid, &dir.path().join("first.jsonl"), &[]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert_eq!(
        lines_of(&dir.path().join("first.jsonl")).len() as u64,
        COUNT
    );
    // Attached late, no beacon is bracketed and the header says clock 1: nothing places them.
    let o = record(pid, &dir.path().join("late.jsonl"), &[]);
    let stderr = text(&o.stderr);
    println!("record --from-memory, late, skewed: {}", stderr.trim());
    assert_eq!(o.status.code(), Some(10), "{stderr}");
    assert!(
        stderr.contains(&format!("read {COUNT} events"))
            && stderr.contains("could place none on the host timeline"),
        "{stderr}"
    );
    drop(guard);
}
