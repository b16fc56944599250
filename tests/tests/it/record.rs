//! `vmtsync record`: events from an agent into JSON Lines and trace.dat, checked against the
//! truth and against the real trace-cmd 3.1.6.
//!
//! Tier 1 uses the loopback agent (`vmtsync_tests::fake_agent`): its events are stamped with
//! the host TSC plus a known skew, so each event's true host tick is its guest tick minus the
//! skew, exactly. Tier 2 (the `tier2` target) boots the real agent under QEMU with a workload and a software skew
//! derived from the host TSC (rate 1.0001 or 1), and takes the truth from KVM's debugfs
//! mapping composed with that skew (`vmtsync_tests::truth`).

use std::process::Stdio;
use std::time::{Duration, Instant};

use vmtsync_tests::ChildGuard;
use vmtsync_tests::fake_agent::WORKLOAD_EVENT;

use crate::util::{Loopback, loopback, read_jsonl, seq_of, text, u, vmtsync};

/// Tier 1: JSON Lines from the loopback agent: every event, in order, each one's guaranteed
/// host interval holding its true host tick (guest − skew, exactly).
#[test]
fn jsonl_events_carry_intervals_that_hold_the_truth() {
    let n = 20_000;
    let lb = loopback("jsonl", n, 200_000);
    let out_path = lb.dir.path().join("events.jsonl");
    let out = lb.record(&out_path, n, 30, &["--format", "jsonl"]);
    let Loopback {
        dir, skew, agent, ..
    } = lb;
    let dropped = agent.join().unwrap();
    let lines = read_jsonl(&out_path);
    assert_eq!(
        lines.len() as u64,
        n - dropped,
        "stderr: {}",
        text(&out.stderr)
    );
    assert!(!dir.path().join("events.jsonl.partial").exists());
    let mut prev_seq = None;
    let mut misses = 0;
    let mut widths = Vec::new();
    for v in &lines {
        assert_eq!(
            (u(v, "schema"), u(v, "vcpu"), u(v, "id")),
            (1, 0, u64::from(WORKLOAD_EVENT))
        );
        let (g, h, lo, hi) = (
            u(v, "guest_tsc"),
            u(v, "host_tsc"),
            u(v, "host_lo"),
            u(v, "host_hi"),
        );
        let truth = g.wrapping_sub(skew.cast_unsigned());
        if !(lo <= truth && truth <= hi) {
            misses += 1;
        }
        assert!(lo <= h && h <= hi, "{v}");
        widths.push(hi - lo);
        let seq = seq_of(v["payload"].as_str().unwrap());
        assert!(prev_seq.is_none_or(|p| seq > p), "order broken at {v}");
        prev_seq = Some(seq);
    }
    widths.sort_unstable();
    println!(
        "record jsonl: {} events, {dropped} dropped, widths min {} median {} max {}; {}",
        lines.len(),
        widths[0],
        widths[widths.len() / 2],
        widths[widths.len() - 1],
        text(&out.stderr).trim()
    );
    assert_eq!(misses, 0, "events whose interval misses the truth");
    assert!(text(&out.stderr).contains(&format!("recorded {} events", lines.len())));
}

/// Tier 1: SIGINT ends a recording with no event limit cleanly: exit 0 and a complete file
/// holding every event received.
#[test]
fn sigint_ends_a_recording_with_a_complete_file() {
    let Loopback {
        dir,
        addr,
        skew: _,
        agent,
    } = loopback("sigint", 1_000_000, 20_000);
    let out_path = dir.path().join("events.jsonl");
    let mut guard = ChildGuard::new(
        vmtsync()
            .args([
                "record",
                "--connect",
                &addr,
                "--out",
                out_path.to_str().unwrap(),
            ])
            .args(["--format", "jsonl", "--resync", "50", "--shutdown"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // Let some events arrive, then interrupt.
    let partial = dir.path().join("events.jsonl.partial");
    let end = Instant::now() + Duration::from_secs(20);
    while std::fs::metadata(&partial).map_or(0, |m| m.len()) < 10_000 {
        assert!(Instant::now() < end, "no events arrived");
        std::thread::sleep(Duration::from_millis(20));
    }
    guard.signal(libc::SIGINT).unwrap();
    let status = loop {
        if let Some(s) = guard.child().try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < end + Duration::from_secs(10),
            "ignored SIGINT"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(guard.child().stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(err.contains("ended by a signal"), "{err}");
    let lines = read_jsonl(&out_path);
    assert!(!lines.is_empty());
    assert!(
        err.contains(&format!("recorded {} events", lines.len())),
        "{err}"
    );
    // The sequence numbers are the first events, without a gap.
    for (i, v) in lines.iter().enumerate() {
        assert_eq!(seq_of(v["payload"].as_str().unwrap()), i as u64);
    }
    drop(guard);
    // The agent thread ends when the session does (shutdown sent).
    let _ = agent.join();
}
