//! `vmtsync validate --before ID:PORT --after ID:PORT` on a real run (tier 2): the rules a
//! foreign guest gives for its own events, here spelled out for the bundled agent's workload
//! (`workload=RATE,COUNT,PORT`: event 0x100 before each `out` to PORT, 0x101 after the `in`
//! that follows), checked with the sync file and without one (the conversion `record
//! --format jsonl` wrote beside each event). Truth comes from the host kernel's `kvm_pio`
//! stamps of the workload's exits, recorded from before boot in a private tracefs instance,
//! and the guest's true clock from KVM debugfs under the agent's software skew: a sync file
//! of the truth must pass with 0 violations and be caught shifted or with the rules swapped;
//! the run's own sync file and recording must keep every guaranteed bound (whether their
//! centres land on the right side of each exit depends on the brackets' widths against the
//! workload's exit gaps: docs/validate.md, "Which offset decides the merged order").

use std::path::Path;

use serde_json::Value;
use vmtsync_tests::truth::Skew;

use crate::causality::{PORT, Run, anchored_segments, recorded_run, run_validate, shifted};
use crate::util::qemu_pio_trace_ready;

crate::trials!(
    qemu_pio_trace_ready;
    before_and_after_rules_check_a_guests_own_events_with_and_without_a_sync_file,
);

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

/// A copy of the sync file at `from` whose every segment says the truth: the constant offset
/// `truth`, exactly (zero width), at identity rate.
fn pinned(from: &Path, to: &Path, truth: i64) {
    let mut out = String::new();
    for line in std::fs::read_to_string(from).unwrap().lines() {
        let mut v: Value = serde_json::from_str(line).unwrap();
        if v["type"] == "segment" {
            for k in ["offset", "offset_lo", "offset_hi"] {
                v[k] = truth.into();
            }
            for k in ["drift_ppb", "drift_ppb_lo", "drift_ppb_hi"] {
                v[k] = 0.into();
            }
            v["guest_anchor"] = v["host_anchor"]
                .as_u64()
                .unwrap()
                .checked_add_signed(truth)
                .unwrap()
                .into();
        }
        out.push_str(&v.to_string());
        out.push('\n');
    }
    std::fs::write(to, out).unwrap();
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

fn before_and_after_rules_check_a_guests_own_events_with_and_without_a_sync_file() {
    let test = "validate_rules::before_and_after_rules_check_a_guests_own_events_with_and_without_a_sync_file";
    let skew = Skew(vmtsync_core::mapping::KvmTscMapping::offset_only(
        Skew::pick().0.offset(),
    ));
    let run = recorded_run("validate-rules", &skew, "jsonl");
    let segments = anchored_segments(&run.sync);
    let before = format!("0x100:{PORT}");
    let after = format!("0x101:{PORT}");
    let rules = ["--before", before.as_str(), "--after", after.as_str()];
    let with_sync = |sync: &Path, extra: &[&str]| {
        let mut args = vec!["--sync", sync.to_str().unwrap()];
        args.extend_from_slice(extra);
        validate(&run, &run.guest, &args)
    };

    // The truth, as a sync file: every event on its side of its exit, by physics.
    let truth = run.truth.constant_offset().expect("an identity-rate truth");
    let exact = run.dir.path().join("truth.jsonl");
    pinned(&run.sync, &exact, truth);
    let (code, v, err) = with_sync(&exact, &rules);
    eprintln!("{test}: the truth ({truth}) as a sync file: {v}");
    assert_eq!(code, Some(0), "{err} {v}");
    let checked = v["checked"].as_u64().unwrap();
    assert!(checked >= 1000, "{v}");
    assert_eq!(
        (v["violations"].as_u64(), v["conversion"].as_str()),
        (Some(0), Some("sync-file"))
    );
    // Shifted either way by more than the widest bracket of the run and the events' distance
    // from their exits (the truth's lags, 99th percentile: in the agent's default ring 0 the
    // workload's instructions run emulated, so that distance outgrows a round's width), it is
    // caught; and with the rules swapped every event is on the wrong side (each after-event
    // follows its step's `out`, each before-event precedes its `in`).
    let width = segments
        .iter()
        .map(|s| s["offset_hi"].as_i64().unwrap() - s["offset_lo"].as_i64().unwrap())
        .max()
        .unwrap();
    let lag = ["lag_before_out", "lag_after_in"]
        .iter()
        .map(|k| v[*k]["p99"].as_i64().unwrap())
        .max()
        .unwrap();
    let reach = width.max(lag) + 1;
    for by in [reach, -reach] {
        let bad = run.dir.path().join(format!("truth{by}.jsonl"));
        shifted(&exact, &bad, by);
        let (code, v, err) = with_sync(&bad, &rules);
        eprintln!(
            "{test}: the truth shifted by {by}: {} violations",
            v["violations"]
        );
        assert_eq!(code, Some(9), "shifted by {by}: {err} {v}");
        assert!(v["violations"].as_u64().unwrap() > 0);
    }
    let swapped = ["--before", after.as_str(), "--after", before.as_str()];
    let (code, v, err) = with_sync(&exact, &swapped);
    eprintln!(
        "{test}: rules swapped: {} of {} violations",
        v["violations"], v["checked"]
    );
    assert_eq!(code, Some(9), "{err} {v}");
    assert_eq!(v["violations"].as_u64(), Some(checked), "{v}");

    // The run's own sync file: the rules give exactly what --port gives for the workload,
    // and no guaranteed bound misses its exit.
    let (_, v, err) = with_sync(&run.sync, &rules);
    eprintln!("{test}: --before/--after with the run's sync file: {v}");
    assert_eq!(v["checked"].as_u64(), Some(checked), "{err} {v}");
    assert_eq!(v["bound_violations"], 0, "{v}");
    let (_, by_port, err) = with_sync(&run.sync, &["--port", PORT]);
    for k in [
        "checked",
        "before_out",
        "after_in",
        "violations",
        "lag",
        "segments",
    ] {
        assert_eq!(v[k], by_port[k], "{k}: rules {v} vs --port {by_port} {err}");
    }

    // Without a sync file: record's own conversion of each event, checked against the same
    // exits, finds what the sync file it came from finds.
    let (code, r, err) = validate(&run, &run.guest, &rules);
    eprintln!("{test}: --before/--after without a sync file: {r}");
    assert_eq!(r["conversion"], "recorded", "{err}");
    assert_eq!(r["bound_violations"], 0, "{r}");
    for k in ["checked", "before_out", "after_in", "violations", "lag"] {
        assert_eq!(r[k], v[k], "{k}: recorded {r} vs sync file {v}");
    }
    assert_eq!(
        code,
        Some(if r["violations"] == 0 { 0 } else { 9 }),
        "{err}"
    );
    // The recording's conversion moved as a sync file shifted by the widest bracket moves
    // it (offset = guest − host: host times move the other way) finds what that sync file
    // finds; moved ten times the reach above, either way, at least every event on the side it
    // moves towards is caught.
    for by in [width, -width] {
        let bad_sync = run.dir.path().join(format!("sync{by}.jsonl"));
        shifted(&run.sync, &bad_sync, by);
        let (_, s, _) = with_sync(&bad_sync, &rules);
        let bad = run.dir.path().join(format!("recording{by}.jsonl"));
        shifted_recording(&run.guest, &bad, -by);
        let (code, m, err) = validate(&run, &bad, &rules);
        eprintln!(
            "{test}: shifted by {by}: {} violations through the sync file, {} through the recording",
            s["violations"], m["violations"]
        );
        assert_eq!(m["violations"], s["violations"], "{m} vs {s}");
        assert_eq!(
            code,
            Some(if m["violations"] == 0 { 0 } else { 9 }),
            "{err}"
        );
    }
    for by in [10 * reach, -10 * reach] {
        let bad = run.dir.path().join(format!("far{by}.jsonl"));
        shifted_recording(&run.guest, &bad, by);
        let (code, m, err) = validate(&run, &bad, &rules);
        eprintln!(
            "{test}: the recording moved {by} ticks: {} of {checked} violations",
            m["violations"]
        );
        assert_eq!(code, Some(9), "{err} {m}");
        assert!(m["violations"].as_u64().unwrap() >= checked / 2, "{m}");
    }
}
