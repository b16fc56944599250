//! Tier 2: the same guest-agent ELF under QEMU (microvm and q35+qboot) on KVM, driven by
//! vmtsync's `ProbeSession` over QEMU's stdio (COM1).
//!
//! Truth: KVM's mapping of QEMU's vCPU, read from debugfs (`vmtsync_tests::truth`); the agent
//! has no skew here. Every TSC it reports must be what that mapping gives inside the host
//! bracket of its exchange; nothing assumes this host's guest TSC == host TSC.

use std::process::Stdio;
use std::time::{Duration, Instant};

use vmtsync::probe::ProbeSession;
use vmtsync_core::HostTicks;
use vmtsync_core::proto::{Features, Message, Transport};
use vmtsync_core::sim::median;
use vmtsync_tests::truth::GuestTruth;
use vmtsync_tests::vmm::client::{PipeTransport, wait_ready};
use vmtsync_tests::vmm::defmt_log::{DefmtLog, LogLine};
use vmtsync_tests::vmm::qemu::{self, Machine, debug_exit_status};
use vmtsync_tests::vmm::{agent_elf, tsc::host_tsc};
use vmtsync_tests::{ChildGuard, require};

use crate::util::vm_ready;

crate::trials!(
    vm_ready;
    qemu_microvm_boots_agent_elf;
    qboot_ready;
    qemu_q35_qboot_boots_agent_elf,
);

/// The q35 test's prerequisites: [`vm_ready`] and QEMU's qboot firmware.
fn qboot_ready(test: &str) -> bool {
    vm_ready(test)
        && require(
            test,
            std::path::Path::new(qemu::QBOOT).is_file(),
            "qboot.rom is missing",
        )
}

const STEP: Duration = Duration::from_secs(20);

/// The decoded COM2 line at `level` whose message is exactly `text`, if any.
fn line<'a>(lines: &'a [LogLine], level: &str, text: &str) -> Option<&'a LogLine> {
    lines
        .iter()
        .find(|l| l.level == Some(level) && l.text == text)
}

fn boots_under(machine: Machine, test: &str) {
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
    let mut t = PipeTransport::new(
        guard.child().stdin.take().expect("stdin"),
        guard.child().stdout.take().expect("stdout"),
    );

    assert!(
        wait_ready(&mut t, Instant::now() + STEP).is_ok(),
        "no ready beacon; COM2 log:\n{}",
        com2_text()
    );
    let boot_time = started.elapsed();
    let ready_seen_tsc = host_tsc();
    // After the beacon QEMU has created its VM and vCPU: read the truth.
    let truth = GuestTruth::read(guard.pid(), 0, None).expect("truth from debugfs");
    let g = |h: u64| truth.guest_at(HostTicks(h)).expect("no overflow").0;
    // The agent logs "ready" just before its beacon; QEMU's file chardev writes COM2 bytes
    // synchronously, so the line is in the file by now.
    let early = com2_lines();
    let ready = line(&early.lines, "info", "ready: postcard on COM1, vcpu 0")
        .unwrap_or_else(|| panic!("no decoded ready line; COM2 log:\n{}", early.text()));
    let ready_tsc = ready.tsc.expect("timestamped");
    // The host TSC before QEMU started precedes the vCPU: `guest_floor_at`.
    let (lo, hi) = (
        truth
            .guest_floor_at(HostTicks(started_tsc), HostTicks(ready_seen_tsc))
            .0,
        g(ready_seen_tsc),
    );
    assert!(
        lo <= ready_tsc && ready_tsc <= hi,
        "ready line TSC {ready_tsc} outside [{lo}, {hi}] ({truth:?})"
    );
    // The session's hello checks the protocol version (a mismatch fails it).
    let mut c = ProbeSession::hello(t, STEP)
        .unwrap_or_else(|e| panic!("expected capabilities ({e}); COM2 log:\n{}", com2_text()));
    let k = *c.info();
    assert_eq!(k.transport, Transport::Uart16550);
    assert!(
        k.features.contains(Features::PVCLOCK),
        "COM2 log:\n{}",
        com2_text()
    );
    // Host TSC right before the request's write(2) and right after the reply's read(2).
    let (reply, at) = c.request(&Message::PvclockRequest).expect("pvclock report");
    let (before, after) = (at.send.0, at.recv.0);
    let Message::PvclockReport(p) = reply else {
        panic!("expected a pvclock report, got {reply:?}")
    };
    assert!(p.version > 0 && p.version % 2 == 0, "{p:?}");
    assert!(
        truth.in_bracket(at.send, p.tsc, at.recv),
        "{p:?} outside [{}, {}] ({truth:?})",
        g(before),
        g(after)
    );
    let mut widths = Vec::new();
    for seq in 0..10u16 {
        // Full-width probes (no unwrap reference); the session checks seq and vCPU.
        c.forget_reference();
        let r = c
            .probe()
            .expect("probe reply")
            .unwrap_or_else(|| panic!("probe {seq} lost: {:?}", c.stats()));
        let (before, after) = (r.host_send.0, r.host_recv.0);
        assert!(
            truth.in_bracket(r.host_send, r.guest, r.host_recv),
            "guest TSC {} outside host bracket [{before}, {after}], by the truth [{}, {}] \
             ({truth:?})",
            r.guest.0,
            g(before),
            g(after)
        );
        widths.push(after - before);
    }
    let median_width = median(&mut widths).unwrap_or_default();
    assert_eq!(
        c.request(&Message::Shutdown).expect("exiting").0,
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
        median_width,
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
        // Ring 0 is the agent's default (guest-agent/src/options.rs).
        line(&decoded.lines, "info", "serving at CPL 0").is_some(),
        "COM2 log:\n{log}"
    );
    assert!(
        line(
            &decoded.lines,
            "info",
            "shutdown after 10 probes, 13 messages, 0 bad frames, 0 events (0 workload, 0 sent, \
             0 dropped): isa-debug-exit 9"
        )
        .is_some(),
        "COM2 log:\n{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn qemu_microvm_boots_agent_elf() {
    boots_under(Machine::Microvm, "qemu_microvm_boots_agent_elf");
}

fn qemu_q35_qboot_boots_agent_elf() {
    boots_under(Machine::Q35, "qemu_q35_qboot_boots_agent_elf");
}
