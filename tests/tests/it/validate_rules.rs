//! `vmtsync validate --before ID:PORT --after ID:PORT` on a real run (tier 2): the rules a
//! foreign guest gives for its own events, here spelled out for the bundled agent's workload
//! (`workload=RATE,COUNT,PORT`: event 0x100 before each `out` to PORT, 0x101 after the `in`
//! that follows), checked with the sync file and without one (the conversion `record
//! --format jsonl` wrote beside each event). Truth comes from the host kernel's `kvm_pio`
//! stamps of the workload's exits, recorded from before boot in a private tracefs instance;
//! a conversion shifted by one bracket width, and the rules swapped, must be caught.

use std::path::Path;

use serde_json::Value;
use vmtsync_tests::truth::Skew;

use crate::causality::{PORT, Run, anchored_segments, recorded_run, run_validate, shifted};

/// `validate --json` of the run's guest recording with `extra` (the rules, the sync file),
/// its threads and from-boot numbering.
fn validate(run: &Run, guest: &Path, extra: &[&str]) -> (Option<i32>, Value, String) {
    let thread = format!("0={}", run.thread);
    let mut args = vec![
        "--host-trace",
        run.host.to_str().unwrap(),
        "--guest-trace",
        guest.to_str().unwrap(),
        "--thread",
        &thread,
        // The host trace began before the VM: pair by position, not through the sync.
        "--from-boot",
    ];
    args.extend_from_slice(extra);
    run_validate(&args)
}

/// A copy of `record`'s JSON Lines at `from` with every event's conversion (its host time
/// and its guaranteed interval) moved by `by` ticks.
fn shifted_recording(from: &Path, to: &Path, by: i64) {
    let mut out = String::new();
    for line in std::fs::read_to_string(from).unwrap().lines() {
        let mut v: Value = serde_json::from_str(line).unwrap();
        for k in ["host_tsc", "host_lo", "host_hi"] {
            v[k] = v[k]
                .as_u64()
                .unwrap()
                .checked_add_signed(by)
                .unwrap()
                .into();
        }
        out.push_str(&v.to_string());
        out.push('\n');
    }
    std::fs::write(to, out).unwrap();
}

#[test]
fn before_and_after_rules_check_a_guests_own_events_with_and_without_a_sync_file() {
    let test = "validate_rules::before_and_after_rules_check_a_guests_own_events_with_and_without_a_sync_file";
    let skew = Skew(vmtsync_core::mapping::KvmTscMapping::offset_only(
        Skew::pick().0.offset(),
    ));
    let Some(run) = recorded_run(test, "validate-rules", &skew, "jsonl") else {
        return;
    };
    let segments = anchored_segments(&run.sync);
    let before = format!("0x100:{PORT}");
    let after = format!("0x101:{PORT}");
    let rules = ["--before", before.as_str(), "--after", after.as_str()];
    let sync = run.sync.to_str().unwrap();

    // With the sync file: the rules give what --port gives for the workload.
    let (code, v, err) = validate(&run, &run.guest, &[&["--sync", sync][..], &rules].concat());
    eprintln!("{test}: --before/--after with the sync file: {v}");
    assert_eq!(code, Some(0), "{err} {v}");
    let checked = v["checked"].as_u64().unwrap();
    assert!(checked >= 1000, "{v}");
    assert_eq!(
        (v["violations"].as_u64(), v["conversion"].as_str()),
        (Some(0), Some("sync-file"))
    );
    let (code, by_port, err) = validate(&run, &run.guest, &["--sync", sync, "--port", PORT]);
    assert_eq!(code, Some(0), "{err}");
    for k in ["checked", "before_out", "after_in", "violations", "lag"] {
        assert_eq!(v[k], by_port[k], "{k}: rules {v} vs --port {by_port}");
    }

    // Without it: record's own conversion of each event, checked against the same exits.
    let (code, r, err) = validate(&run, &run.guest, &rules);
    eprintln!("{test}: --before/--after without a sync file: {r}");
    assert_eq!(code, Some(0), "{err} {r}");
    assert_eq!(r["conversion"], "recorded");
    assert_eq!(
        (r["checked"].as_u64(), r["violations"].as_u64()),
        (Some(checked), Some(0))
    );
    assert_eq!(r["bound_violations"], 0);

    // A mapping shifted by the widest segment's bracket width, either way, in the sync file
    // and in the recording: caught.
    let width = segments
        .iter()
        .map(|s| s["offset_hi"].as_i64().unwrap() - s["offset_lo"].as_i64().unwrap())
        .max()
        .unwrap();
    for by in [width, -width] {
        let bad = run.dir.path().join(format!("shifted{by}.jsonl"));
        shifted(&run.sync, &bad, by);
        let (code, v, err) = validate(
            &run,
            &run.guest,
            &[&["--sync", bad.to_str().unwrap()][..], &rules].concat(),
        );
        eprintln!(
            "{test}: sync shifted by {by}: {} violations",
            v["violations"]
        );
        assert_eq!(code, Some(9), "shifted by {by}: {err} {v}");
        assert!(v["violations"].as_u64().unwrap() > 0);
        // Offset = guest − host: a larger offset converts earlier, so the recording's host
        // times move the other way.
        let bad = run.dir.path().join(format!("recording{by}.jsonl"));
        shifted_recording(&run.guest, &bad, -by);
        let (code, v, err) = validate(&run, &bad, &rules);
        eprintln!(
            "{test}: recording shifted by {}: {} violations",
            -by, v["violations"]
        );
        assert_eq!(code, Some(9), "recording shifted by {}: {err} {v}", -by);
        assert!(v["violations"].as_u64().unwrap() > 0);
    }

    // The rules swapped: each after-event follows its step's `out`, so as a before-event it
    // is a violation, every one.
    let swapped = [
        "--before",
        after.as_str(),
        "--after",
        before.as_str(),
        "--sync",
        sync,
    ];
    let (code, v, err) = validate(&run, &run.guest, &swapped);
    eprintln!(
        "{test}: rules swapped: {} of {} violations",
        v["violations"], v["checked"]
    );
    assert_eq!(code, Some(9), "{err} {v}");
    assert!(v["violations"].as_u64().unwrap() >= checked / 2, "{v}");
}
