//! The guest keeps its console on the protocol's UART (tier 2): the real agent under QEMU
//! microvm (one serial port) with `console=1` prints a line on COM1 between frames after every
//! message it handles, under the shared-UART wire rule (a `0x00` before each frame as well as
//! after it). `vmtsync record --console FILE`, exit-anchored on the same UART, must get every
//! event the agent sent (their payloads count the agent's messages, so a lost batch shows)
//! and every console line, whole and in order, in FILE; its sync rounds must hold the truth
//! (KVM debugfs composed with the agent's software skew), so the console's `out`s between
//! frames did not confuse the exit matcher.

use serde_json::Value;
use vmtsync_core::HostTicks;
use vmtsync_tests::truth::{GuestTruth, Skew};

use crate::util::{QemuAgent, qemu_ready, text, wait_vcpu_thread};

crate::trials!(
    qemu_ready;
    record_console_keeps_every_frame_and_every_console_line,
);

/// Events to record: one per agent poll that handled messages.
const EVENTS: u64 = 150;

fn record_console_keeps_every_frame_and_every_console_line() {
    let test = "console::record_console_keeps_every_frame_and_every_console_line";
    let dir = tempfile::Builder::new()
        .prefix("vmtsync-console-")
        .tempdir()
        .unwrap();
    let skew = Skew(vmtsync_core::mapping::KvmTscMapping::offset_only(
        Skew::pick().0.offset(),
    ));
    let append = format!(
        "transport=uart exit=0 console=1 syncport=off events={EVENTS} {}",
        skew.agent_option()
    );
    eprintln!("{test}: agent options {append}");
    let vm = QemuAgent::boot(dir.path(), &append);
    wait_vcpu_thread(vm.guard.pid());
    let truth = GuestTruth::read(vm.guard.pid(), 0, Some(skew)).expect("truth from debugfs");
    let (guest, sync, console) = (
        dir.path().join("guest.jsonl"),
        dir.path().join("sync.jsonl"),
        dir.path().join("console.txt"),
    );
    let pid = vm.guard.pid().to_string();
    let out = vm.record(
        &guest,
        EVENTS,
        300,
        &[
            "--format",
            "jsonl",
            "--sync-out",
            sync.to_str().unwrap(),
            "--console",
            console.to_str().unwrap(),
            "--anchor",
            "kvm-pio",
            "--vm",
            &pid,
            "--no-progress",
        ],
    );
    let stderr = text(&out.stderr);
    eprintln!("{test}: {stderr}");
    assert_eq!(out.status.code(), Some(0), "record: {stderr}");
    drop(vm);

    // Every event: the agent's payload is its count of messages handled, which grows with
    // every event it records, so a batch lost to the text would leave a gap the summary
    // counts and the payloads show out of order.
    assert!(!stderr.contains("lost in transit"), "{stderr}");
    let counts: Vec<u64> = std::fs::read_to_string(&guest)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["id"] == 1)
        .map(|v| {
            // Lowercase hex of the little-endian count.
            let hex = v["payload"].as_str().unwrap();
            (0..hex.len() / 2).rev().fold(0u64, |n, i| {
                n << 8 | u64::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap()
            })
        })
        .collect();
    assert_eq!(counts.len() as u64, EVENTS, "{stderr}");
    assert!(counts.windows(2).all(|w| w[0] < w[1]), "{counts:?}");

    // Every console line the agent printed while the session ran, whole and in order: each
    // run of text is one line it wrote between two frames, so the file is whole lines, and
    // their message counts only grow.
    let text_bytes = std::fs::read(&console).unwrap();
    assert!(
        stderr.contains(&format!(
            "{} bytes of the guest's console text appended to",
            text_bytes.len()
        )),
        "{stderr}"
    );
    let lines = String::from_utf8(text_bytes).expect("the agent prints UTF-8");
    assert!(lines.ends_with('\n'), "a cut line: {lines:?}");
    let mut seen = Vec::new();
    for l in lines.lines() {
        assert!(
            l.starts_with("vmtsync-agent"),
            "not the agent's line: {l:?}"
        );
        if let Some(n) = l
            .strip_prefix("vmtsync-agent: ")
            .and_then(|r| r.split_once(" messages, "))
            .and_then(|(n, _)| n.parse::<u64>().ok())
        {
            seen.push(n);
        }
    }
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    // One line per message (console=1), each poll at most one: as many lines as the polls
    // that handled messages, at least one per event recorded.
    assert!(seen.len() as u64 >= EVENTS, "{} lines: {lines}", seen.len());
    eprintln!(
        "{test}: {} console lines ({} bytes), {EVENTS} events",
        lines.lines().count(),
        lines.len()
    );

    // The sync rounds were anchored on the UART's exits and hold the truth.
    let segments: Vec<Value> = std::fs::read_to_string(&sync)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &Value| v["type"] == "segment")
        .collect();
    assert!(!segments.is_empty());
    for s in &segments {
        assert_eq!(s["anchor"], "kvm-pio-uart", "{s}");
        let at = HostTicks(s["host_anchor"].as_u64().unwrap());
        let (lo, hi) = (
            s["offset_lo"].as_i64().unwrap(),
            s["offset_hi"].as_i64().unwrap(),
        );
        truth.check(at, lo, hi).unwrap();
    }
}
