//! Tier 2: the same guest-agent ELF under QEMU (microvm and q35+qboot) on KVM.

use std::io::{Read, Write};
use std::process::Stdio;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use vmtsync_tests::vmm::qemu::{self, Machine, debug_exit_status, have_qemu};
use vmtsync_tests::vmm::{agent_elf, tsc::host_tsc};
use vmtsync_tests::{ChildGuard, have_kvm, require};

const STEP: Duration = Duration::from_secs(20);

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

fn line(rx: &Receiver<u8>) -> String {
    let end = Instant::now() + STEP;
    let mut s = String::new();
    while let Ok(b) = rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
        s.push(char::from(b));
        if b == b'\n' {
            break;
        }
    }
    s
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
    let started = Instant::now();
    let child = qemu::command(machine, &elf, "transport=uart exit=9", &com2)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu starts");
    let mut guard = ChildGuard::new(child);
    let rx = reader(guard.child().stdout.take().expect("stdout"));
    let mut stdin = guard.child().stdin.take().expect("stdin");

    let hello = line(&rx);
    let boot_time = started.elapsed();
    assert_eq!(
        hello,
        "H vmtsync-agent\n",
        "COM2 log: {}",
        std::fs::read_to_string(&com2).unwrap_or_default()
    );
    for round in 0..3 {
        let before = host_tsc();
        stdin.write_all(b"p").expect("write probe");
        stdin.flush().expect("flush probe");
        let s = line(&rx);
        let after = host_tsc();
        assert!(s.starts_with('T') && s.len() == 18, "answer {s:?}");
        let guest = u64::from_str_radix(&s[1..17], 16).expect("hex TSC");
        eprintln!(
            "{machine:?} round {round}: host {before} guest {guest} host {after} \
             (bracket {} cycles)",
            after - before
        );
        assert!(
            before <= guest && guest <= after,
            "guest TSC {guest} outside host bracket [{before}, {after}]"
        );
    }
    stdin.write_all(b"q").expect("write quit");
    stdin.flush().expect("flush quit");
    assert_eq!(line(&rx), "Q\n");
    let end = Instant::now() + STEP;
    let status = loop {
        if let Some(s) = guard.child().try_wait().expect("wait qemu") {
            break s;
        }
        assert!(Instant::now() < end, "QEMU did not exit after quit");
        std::thread::sleep(Duration::from_millis(10));
    };
    let log = std::fs::read_to_string(&com2).expect("COM2 log");
    eprintln!(
        "{machine:?}: hello after {boot_time:?}, exit status {status}, total {:?}",
        started.elapsed()
    );
    assert_eq!(
        status.code(),
        Some(debug_exit_status(9)),
        "COM2 log:\n{log}"
    );
    assert!(
        log.contains("cmdline \"transport=uart exit=9\""),
        "COM2 log:\n{log}"
    );
    assert!(log.contains("quit: isa-debug-exit 9"), "COM2 log:\n{log}");
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
