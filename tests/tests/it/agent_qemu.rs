//! Tier 2: the same guest-agent ELF under QEMU (microvm and q35+qboot) on KVM.

use std::io::{Read, Write};
use std::process::Stdio;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use vmtsync_core::proto::{
    Features, Feed, FrameReceiver, Hello, MAX_FRAME_SIZE, Message, PROTOCOL_VERSION, Transport,
    encode_frame,
};
use vmtsync_tests::vmm::defmt_log::{DefmtLog, LogLine};
use vmtsync_tests::vmm::qemu::{self, Machine, debug_exit_status, have_qemu};
use vmtsync_tests::vmm::{agent_elf, tsc::host_tsc};
use vmtsync_tests::{ChildGuard, have_kvm, require};

const STEP: Duration = Duration::from_secs(20);

/// The decoded COM2 line at `level` whose message is exactly `text`, if any.
fn line<'a>(lines: &'a [LogLine], level: &str, text: &str) -> Option<&'a LogLine> {
    lines
        .iter()
        .find(|l| l.level == Some(level) && l.text == text)
}

/// Reads COM1 bytes from QEMU's stdout in a thread.
fn reader(mut out: impl Read + Send + 'static) -> Receiver<u8> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let mut b = [0u8; 1];
        while matches!(out.read(&mut b), Ok(1)) {
            if tx.send(b[0]).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits for the agent's ready beacon (a lone `0x00`).
fn wait_ready(rx: &Receiver<u8>) -> bool {
    let end = Instant::now() + STEP;
    while let Ok(b) = rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
        if b == 0 {
            return true;
        }
    }
    false
}

/// Sends `msg` as a frame and returns the next message from the guest.
fn exchange(
    stdin: &mut impl Write,
    rx: &Receiver<u8>,
    frames: &mut FrameReceiver,
    msg: &Message,
) -> Message {
    let mut buf = [0u8; MAX_FRAME_SIZE];
    let frame = encode_frame(msg, &mut buf).expect("encodes");
    stdin.write_all(frame).expect("write request");
    stdin.flush().expect("flush request");
    let end = Instant::now() + STEP;
    loop {
        let b = rx
            .recv_timeout(end.saturating_duration_since(Instant::now()))
            .expect("reply in time");
        match frames.feed(&[b]) {
            Feed::Consumed => {}
            Feed::Message { msg, .. } => return msg,
            Feed::Error { error, .. } => panic!("bad frame from the agent: {error:?}"),
        }
    }
}

fn boots_under(machine: Machine, test: &str) {
    if !require(test, have_kvm(), "/dev/kvm is not accessible read-write")
        || !require(
            test,
            have_qemu(),
            "qemu-system-x86_64 is missing (apt-get install qemu-system-x86)",
        )
    {
        return;
    }
    if machine == Machine::Q35
        && !require(
            test,
            std::path::Path::new(qemu::QBOOT).is_file(),
            "qboot.rom is missing",
        )
    {
        return;
    }
    let elf = agent_elf().expect("agent builds");
    let dir = std::env::temp_dir().join(format!("vmtsync-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let com2 = dir.join("com2.log");
    let decoder = DefmtLog::from_elf_path(&elf).expect("the agent ELF has defmt data");
    let com2_lines = || decoder.decode(&std::fs::read(&com2).unwrap_or_default());
    let com2_text = || com2_lines().text();
    let started = Instant::now();
    let started_tsc = host_tsc();
    let child = qemu::command(machine, &elf, "transport=uart exit=9", &com2)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu starts");
    let mut guard = ChildGuard::new(child);
    let rx = reader(guard.child().stdout.take().expect("stdout"));
    let mut stdin = guard.child().stdin.take().expect("stdin");

    assert!(
        wait_ready(&rx),
        "no ready beacon; COM2 log:\n{}",
        com2_text()
    );
    let boot_time = started.elapsed();
    let ready_seen_tsc = host_tsc();
    // The agent logs "ready" just before its beacon; QEMU's file chardev writes COM2 bytes
    // synchronously, so the line is in the file by now.
    let early = com2_lines();
    let ready = line(&early.lines, "info", "ready: postcard on COM1, vcpu 0")
        .unwrap_or_else(|| panic!("no decoded ready line; COM2 log:\n{}", early.text()));
    let ready_tsc = ready.tsc.expect("timestamped");
    assert!(
        started_tsc <= ready_tsc && ready_tsc <= ready_seen_tsc,
        "ready line TSC {ready_tsc} outside [{started_tsc}, {ready_seen_tsc}]"
    );
    let mut frames = FrameReceiver::new();
    let hello = Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        features: Features::NONE,
    });
    let Message::Capabilities(k) = exchange(&mut stdin, &rx, &mut frames, &hello) else {
        panic!("expected capabilities; COM2 log:\n{}", com2_text())
    };
    assert_eq!(
        (k.version, k.transport),
        (PROTOCOL_VERSION, Transport::Uart16550)
    );
    assert!(
        k.features.contains(Features::PVCLOCK),
        "COM2 log:\n{}",
        com2_text()
    );
    let before = host_tsc();
    let reply = exchange(&mut stdin, &rx, &mut frames, &Message::PvclockRequest);
    let after = host_tsc();
    let Message::PvclockReport(p) = reply else {
        panic!("expected a pvclock report, got {reply:?}")
    };
    assert!(p.version > 0 && p.version % 2 == 0, "{p:?}");
    assert!(
        before <= p.tsc.0 && p.tsc.0 <= after,
        "{p:?} outside [{before}, {after}]"
    );
    let mut widths = Vec::new();
    for seq in 0..10u8 {
        let before = host_tsc();
        let reply = exchange(&mut stdin, &rx, &mut frames, &Message::ProbeFull { seq });
        let after = host_tsc();
        let Message::ProbeReplyFull(r) = reply else {
            panic!("probe {seq}: unexpected reply {reply:?}")
        };
        assert_eq!(r.seq, seq);
        assert!(
            before <= r.tsc && r.tsc <= after,
            "guest TSC {} outside host bracket [{before}, {after}]",
            r.tsc
        );
        widths.push(after - before);
    }
    widths.sort_unstable();
    assert_eq!(
        exchange(&mut stdin, &rx, &mut frames, &Message::Shutdown),
        Message::Exiting
    );
    let end = Instant::now() + STEP;
    let status = loop {
        if let Some(s) = guard.child().try_wait().expect("wait qemu") {
            break s;
        }
        assert!(Instant::now() < end, "QEMU did not exit after shutdown");
        std::thread::sleep(Duration::from_millis(10));
    };
    let decoded = com2_lines();
    let log = decoded.text();
    eprintln!(
        "{machine:?}: ready after {boot_time:?}, median host bracket over stdio {} cycles, \
         exit status {status}, total {:?}",
        widths[widths.len() / 2],
        started.elapsed()
    );
    assert_eq!(
        status.code(),
        Some(debug_exit_status(9)),
        "COM2 log:\n{log}"
    );
    assert_eq!(decoded.malformed, 0, "COM2 log:\n{log}");
    assert!(
        decoded
            .lines
            .iter()
            .any(|l| l.text.ends_with(" cmdline \"transport=uart exit=9\"")),
        "COM2 log:\n{log}"
    );
    assert!(
        line(&decoded.lines, "info", "serving at CPL 3").is_some(),
        "COM2 log:\n{log}"
    );
    assert!(
        line(
            &decoded.lines,
            "info",
            "shutdown after 10 probes, 13 messages, 0 bad frames, 0 events: isa-debug-exit 9"
        )
        .is_some(),
        "COM2 log:\n{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn qemu_microvm_boots_agent_elf() {
    boots_under(Machine::Microvm, "qemu_microvm_boots_agent_elf");
}

#[test]
fn qemu_q35_qboot_boots_agent_elf() {
    boots_under(Machine::Q35, "qemu_q35_qboot_boots_agent_elf");
}
