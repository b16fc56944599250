//! `vmtsync export perfetto`, tier 1: a recording from another boot is refused. The traces
//! read back by Perfetto's trace processor are the `tier2` target's `perfetto` module.

use vmtsync::kvm::hosttsc::read_host_tsc;

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
