//! Tier 2: the freestanding C guest (`tests/c-guest/`, built with the C recorder's sources,
//! `capi/`) boots under QEMU microvm/KVM, lays out and publishes a recorder in its own memory,
//! records `events=N` events and beacons through the C API, and ends through isa-debug-exit.
//!
//! What this checks is that the C recorder builds and runs on bare metal: QEMU's own exit status
//! (the guest writes 0 to isa-debug-exit only when every call returned VMTSYNC_OK) and the
//! guest's COM1 line, whose magic is read back out of the buffer by the C code through the
//! header struct. Reading the events from the host side is the memory reader's test; the
//! numbers below are the guest's (`tests/c-guest/main.c`).

use std::io::Read as _;
use std::process::Stdio;
use std::time::Duration;

use vmtsync_core::recorder::MAGIC;
use vmtsync_launch::agent::{Guest, guest_elf};
use vmtsync_tests::ChildGuard;
use vmtsync_tests::require;
use vmtsync_tests::vmm::qemu::{self, Machine, debug_exit_status};

use crate::util::{have_program, scratch, vm_ready};

/// Events asked for on the command line; the guest beacons once at each end and after every
/// 1000 events.
const EVENTS: u32 = 20_000;
const BEACONS: u32 = EVENTS / 1000 + 2;

/// The value after `key ` in the guest's summary line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let mut words = line.split_whitespace();
    words.find(|w| *w == key)?;
    words.next()
}

crate::trials!(c_guest_ready; c_guest_records_through_the_c_abi_and_exits_cleanly);

/// [`vm_ready`] and gcc (the guest is C).
fn c_guest_ready(test: &str) -> bool {
    vm_ready(test)
        && require(
            test,
            have_program("gcc"),
            "gcc is missing (apt-get install gcc, or cargo xtask setup)",
        )
}

fn c_guest_records_through_the_c_abi_and_exits_cleanly() {
    let test = "c_guest_records_through_the_c_abi_and_exits_cleanly";
    let elf = guest_elf(Guest::CGuest).expect("the C guest builds");
    let dir = scratch(test);
    let com2 = dir.path().join("com2.log");
    let child = qemu::command(Machine::Microvm, &elf, &format!("events={EVENTS}"), &com2)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu starts");
    let mut guard = ChildGuard::new(child);
    let mut stdout = guard.child().stdout.take().expect("stdout piped");
    let mut stderr = guard.child().stderr.take().expect("stderr piped");
    let status = guard
        .wait_timeout(Duration::from_secs(120))
        .expect("waitpid")
        .expect("the C guest ends within 120 s");
    let mut out = String::new();
    stdout.read_to_string(&mut out).expect("COM1 output");
    let mut err = String::new();
    let _ = stderr.read_to_string(&mut err);
    let line = out
        .lines()
        .find(|l| l.starts_with("c-guest: "))
        .unwrap_or_else(|| panic!("no summary line on COM1: {out:?}; stderr {err}"));
    assert_eq!(
        status.code(),
        Some(debug_exit_status(0)),
        "the guest did not end through isa-debug-exit 0: {line}; stderr {err}"
    );
    assert_eq!(field(line, "failed"), Some("0"), "{line}");
    assert_eq!(
        field(line, "events"),
        Some(EVENTS.to_string().as_str()),
        "{line}"
    );
    assert_eq!(
        field(line, "beacons"),
        Some(BEACONS.to_string().as_str()),
        "{line}"
    );
    assert_eq!(
        field(line, "magic"),
        Some(format!("{MAGIC:#x}").as_str()),
        "{line}"
    );
    let nonce =
        field(line, "nonce").and_then(|n| u64::from_str_radix(n.trim_start_matches("0x"), 16).ok());
    assert!(
        nonce.is_some_and(|n| n != 0),
        "a zero or missing nonce: {line}"
    );
    let at =
        field(line, "at").and_then(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).ok());
    assert!(at.is_some_and(|a| a % 64 == 0 && a >= 0x10_0000), "{line}");
}
