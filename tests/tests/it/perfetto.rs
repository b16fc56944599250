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

use vmtsync::hosttsc::read_host_tsc;

use crate::util::export_perfetto;
use crate::util::scratch;

/// A recording from another boot (host TSCs past this host's TSC now) is refused, and the
/// target is not created.
#[test]
fn export_refuses_a_recording_from_another_boot() {
    let dir = scratch("perfetto-otherboot");
    let jsonl = dir.path().join("events.jsonl");
    let future = read_host_tsc().0 + 1_000_000_000_000_000;
    std::fs::write(
        &jsonl,
        format!(
            "{{\"schema\":1,\"vcpu\":0,\"id\":1,\"guest_tsc\":{future},\"host_tsc\":{future},\
             \"host_lo\":{future},\"host_hi\":{future},\"payload\":\"\",\"round\":0}}\n"
        ),
    )
    .unwrap();
    let trace = dir.path().join("t.perfetto-trace");
    let out = export_perfetto(&jsonl, &trace);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{stderr}");
    assert!(stderr.contains("another boot"), "{stderr}");
    assert!(!trace.exists());
}
