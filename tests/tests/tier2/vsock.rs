//! Tier 2: the agent's virtio-vsock transport, end to end under QEMU q35 + qboot with
//! `vhost-user-vsock-pci` and the `vhost-device-vsock` backend (installed on demand).
//!
//! Truth here (`vmtsync_tests::truth`): KVM's debugfs mapping of the VM's vCPU, followed by the
//! agent's software skew when it has one, so every probe's host bracket `[sent, received]`
//! must contain the host time of the guest's reported TSC, and the session's guaranteed bounds
//! must contain the true offset. Nothing assumes this host's offset 0 (docs/host-quirks.md).
//! The probes are driven by vmtsync's own `ProbeSession` over its socket transport. It prints
//! the RTT and the midpoint estimate's error against the truth.

use std::time::{Duration, Instant};

use vmtsync::probe::ProbeSummary;
use vmtsync_core::estimate::trace_cmd_histogram;
use vmtsync_core::proto::{Message, Transport};
use vmtsync_tests::truth::{GuestTruth, Skew, truth_ready};
use vmtsync_tests::vmm::agent_elf;
use vmtsync_tests::vmm::client::{probe_run, wait_ready};
use vmtsync_tests::vmm::defmt_log::decode_file_text;
use vmtsync_tests::vmm::qemu::{self, Machine, debug_exit_status, have_qemu};
use vmtsync_tests::vmm::vsock::{VsockRig, ensure_vhost_device_vsock};
use vmtsync_tests::{ChildGuard, require};

use crate::util::kvm_ready;

crate::trials!(
    qboot_truth_ready;
    vsock_probes_bracket_the_guest_tsc_under_qemu_q35,
    vsock_host_connects_to_a_listening_agent,
    vsock_probes_from_ring_0_bracket_the_guest_tsc,
    vsock_probes_under_qemu_microvm_over_virtio_mmio,
    vsock_agent_serves_a_new_session_after_the_host_hangs_up;
    qboot_vm_ready;
    vsock_without_a_device_fails_cleanly,
);

/// The prerequisites of a q35 VM booted by QEMU with qboot: `/dev/kvm`, QEMU and qboot.
fn qboot_vm_ready(test: &str) -> bool {
    kvm_ready(test)
        && require(
            test,
            have_qemu(),
            "qemu-system-x86_64 is missing (apt-get install qemu-system-x86)",
        )
        && require(
            test,
            std::path::Path::new(qemu::QBOOT).is_file(),
            "qboot.rom is missing (apt-get install qemu-system-x86)",
        )
}

/// [`qboot_vm_ready`] and the truth from debugfs.
fn qboot_truth_ready(test: &str) -> bool {
    qboot_vm_ready(test) && truth_ready(test)
}

const STEP: Duration = Duration::from_secs(20);
const PORT: u32 = 1234;
const PROBES: u32 = 200;
/// The agent's isa-debug-exit code when the vsock transport cannot be set up
/// (`vmtsync_agent::vsock::SETUP_FAILED_EXIT_CODE`; the agent crate is not a host dependency).
const SETUP_FAILED_EXIT_CODE: u8 = 0x7c;

fn vsock_probes_bracket_the_guest_tsc_under_qemu_q35() {
    session(Machine::Q35, 3, PORT, false, false);
}

/// The other direction: the agent listens (`vsock=listen`) and the host connects through the
/// backend's `CONNECT <port>` handshake, as a host tool would connect to a guest's CID.
fn vsock_host_connects_to_a_listening_agent() {
    session(Machine::Q35, 3, PORT + 2, true, false);
}

/// The same session with the protocol loop left in ring 0 (`ring=0`), where the project's
/// nested KVM emulates every guest instruction: slower, and it must still bracket the truth.
fn vsock_probes_from_ring_0_bracket_the_guest_tsc() {
    session(Machine::Q35, 0, PORT + 1, false, false);
}

/// QEMU microvm: `vhost-user-vsock-device` on virtio-mmio, found through the
/// `virtio_mmio.device=` word QEMU appends to the command line; no PCI, no BARs to place. The
/// agent also applies a software skew here ([`Skew::pick`]: an offset derived from the host
/// TSC and a rate != 1), so the truth the brackets must contain moves with time.
fn vsock_probes_under_qemu_microvm_over_virtio_mmio() {
    session(Machine::Microvm, 3, PORT + 4, false, true);
}

/// Boots the agent on `machine` with `transport=vsock port={port} ring={ring} exit=5` (and
/// `vsock=listen` when `listen`, a [`Skew::pick`] skew when `skew`), runs [`PROBES`] probes,
/// checks every bracket, the guaranteed bounds and (for a constant offset) the offset
/// interval against the truth (debugfs, then the skew), shuts down.
fn session(machine: Machine, ring: u8, port: u32, listen: bool, skew: bool) {
    let backend = ensure_vhost_device_vsock().expect("the vhost-device-vsock backend installs");
    let elf = agent_elf().expect("agent builds");
    let started = Instant::now();
    let mode = if listen { "listen" } else { "connect" };
    let mut append = format!("transport=vsock vsock={mode} port={port} ring={ring} exit=5");
    let skew = skew.then(Skew::pick);
    if let Some(s) = skew {
        append.push(' ');
        append.push_str(&s.agent_option());
    }
    let mut rig =
        VsockRig::start(machine, &backend, &elf, &append, port, STEP).expect("rig starts");
    let connection = if listen {
        rig.wait_log(&format!("vsock: listening on port {port}"), STEP)
            .and_then(|()| rig.connect(port, STEP))
    } else {
        rig.accept(STEP)
    };
    let mut client = match connection {
        Ok(c) => c,
        Err(e) => panic!("{e}\n{}", rig.diagnostics()),
    };
    let connected = started.elapsed();
    // Connected: QEMU has created its VM and vCPU, so KVM's side of the truth is readable.
    let truth = GuestTruth::read(rig.pids().0, 0, skew).expect("truth from debugfs");
    if let Err(e) = wait_ready(&mut client, Instant::now() + STEP) {
        panic!("{e}\n{}", rig.diagnostics());
    }

    // The session checks the protocol version in the hello (a mismatch is an error).
    let (mut session, run) = match probe_run(client, PROBES, STEP) {
        Ok(r) => r,
        Err(e) => panic!("{e}\n{}", rig.diagnostics()),
    };
    assert_eq!(run.info.transport, Transport::VirtioVsock);
    assert_eq!(
        run.samples.len(),
        usize::try_from(PROBES).unwrap(),
        "{:?}",
        run.stats
    );
    // Every probe's host bracket [sent, received] contains the host time of the guest's
    // reported TSC.
    let outside = run.outside_bracket(&truth);
    assert!(outside.is_empty(), "{truth:?}: outside {outside:?}");
    // The session's guaranteed bounds (drift-aware with a rate != 1) contain the true offset
    // where they refer to it.
    let sum = ProbeSummary::from_samples(&run.info, &run.samples, run.stats).expect("estimates");
    truth
        .check(sum.at_host, sum.bound_lo, sum.bound_hi)
        .unwrap_or_else(|e| panic!("{e}"));
    // A constant offset (no skew, no scaling): the offset interval (guest − host) every probe
    // allows contains it. With a rate != 1 the truth moves and the probes need not agree on
    // one offset.
    let interval = run.offset_interval();
    if let Some(c) = truth.constant_offset() {
        let (lo, hi) = interval.expect("consistent probes");
        assert!(
            lo <= c && c <= hi,
            "offset interval [{lo}, {hi}] misses the truth {c}"
        );
    }
    // trace-cmd's histogram estimator (what the probe bench compares with) on these real
    // samples: its answer is one probe's midpoint offset, and that probe's bracket contains
    // the truth, so it is within half that probe's round trip of the true offset.
    let hist = trace_cmd_histogram(&run.samples).expect("histogram of real samples");
    let chosen = run
        .samples
        .iter()
        .find(|s| {
            let mid = (u128::from(s.host_send.0) + u128::from(s.host_recv.0)) / 2;
            u128::from(hist.at.0) == mid
                && i128::from(s.guest.0) - i128::from(hist.at.0) == i128::from(hist.offset)
        })
        .unwrap_or_else(|| panic!("histogram result {hist:?} is no probe's midpoint offset"));
    assert!(
        truth.in_bracket(chosen.host_send, chosen.guest, chosen.host_recv),
        "{truth:?}: the histogram's probe {chosen:?}"
    );
    let rtts = run.rtts_sorted();
    let errors = run.midpoint_errors_sorted(&truth);

    let (bye, _) = session.request(&Message::Shutdown).expect("exiting");
    assert_eq!(bye, Message::Exiting);
    let status = rig.wait_exit(STEP).expect("QEMU exits");
    let log = rig.com2_log();
    for line in log.lines().filter(|l| l.starts_with("vsock:")) {
        eprintln!("agent: {line}");
    }
    let tsc_khz = run.info.tsc_khz.map_or(0, u64::from);
    let cycles_to_us = |c: u64| (c * 1000).checked_div(tsc_khz).unwrap_or(0);
    eprintln!(
        "vsock {machine:?} {mode} ring {ring}: connected after {connected:?}; {PROBES} probes: \
         RTT min {} / median {} cycles (~{} us median); midpoint |error| median {} cycles; \
         trace-cmd histogram {hist:?} from probe {chosen:?}; \
         truth {truth:?}, offset interval {interval:?}, bounds [{}, {}] (width {}); exit \
         {status}, total {:?}",
        rtts[0],
        rtts[rtts.len() / 2],
        cycles_to_us(rtts[rtts.len() / 2]),
        errors[errors.len() / 2],
        sum.bound_lo,
        sum.bound_hi,
        sum.width(),
        started.elapsed()
    );
    assert_eq!(
        status.code(),
        Some(debug_exit_status(5)),
        "{}",
        rig.diagnostics()
    );
    assert!(
        log.contains(&format!("serving at CPL {ring}")),
        "COM2 log:\n{log}"
    );
    assert!(
        log.contains(&format!("ready: postcard on vsock port {port}")),
        "COM2 log:\n{log}"
    );
    assert!(
        log.contains(&format!(
            "shutdown after {PROBES} probes, {} messages, 0 bad frames, 0 events ({} packets, \
             0 credit waits, 0 refused sends, 0 link errors; 0 workload, 0 sent, 0 dropped): \
             isa-debug-exit 5",
            PROBES + 2,
            // The ready beacon, the capabilities, one per probe reply, and `Exiting`.
            PROBES + 3
        )),
        "COM2 log:\n{log}"
    );
}

/// A host that hangs up without `Shutdown` does not strand the agent: it accepts the next
/// connection and serves a fresh session (`vsock=listen`).
fn vsock_agent_serves_a_new_session_after_the_host_hangs_up() {
    let backend = ensure_vhost_device_vsock().expect("the vhost-device-vsock backend installs");
    let elf = agent_elf().expect("agent builds");
    let port = PORT + 3;
    let machine = Machine::Q35;
    let append = format!("transport=vsock vsock=listen port={port} exit=6");
    let mut rig =
        VsockRig::start(machine, &backend, &elf, &append, port, STEP).expect("rig starts");
    for session in 1..=2 {
        let listening = format!("vsock: listening on port {port}");
        // Session 2: the second `listening` line, after the agent saw the hang-up.
        let end = Instant::now() + STEP;
        while rig.com2_log().matches(&listening).count() < session {
            assert!(
                Instant::now() < end,
                "session {session}: {}",
                rig.diagnostics()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut client = rig
            .connect(port, STEP)
            .unwrap_or_else(|e| panic!("session {session}: {e}\n{}", rig.diagnostics()));
        wait_ready(&mut client, Instant::now() + STEP)
            .unwrap_or_else(|e| panic!("session {session}: {e}\n{}", rig.diagnostics()));
        let (mut probes, run) = probe_run(client, 10, STEP)
            .unwrap_or_else(|e| panic!("session {session}: {e}\n{}", rig.diagnostics()));
        let truth = GuestTruth::read(rig.pids().0, 0, None).expect("truth from debugfs");
        let outside = run.outside_bracket(&truth);
        assert!(
            outside.is_empty(),
            "session {session}, {truth:?}: {outside:?}"
        );
        if session == 2 {
            let (bye, _) = probes.request(&Message::Shutdown).expect("exiting");
            assert_eq!(bye, Message::Exiting);
        }
        // Session 1 ends by dropping the client: the host hangs up mid-session.
    }
    let status = rig.wait_exit(STEP).expect("QEMU exits");
    let log = rig.com2_log();
    assert_eq!(
        status.code(),
        Some(debug_exit_status(6)),
        "{}",
        rig.diagnostics()
    );
    assert!(
        log.contains("the host closed the stream") && log.contains("vsock: session 2:"),
        "COM2 log:\n{log}"
    );
}

/// Without a vsock device the agent says so on COM2 and exits with its setup-failure code,
/// instead of hanging: q35 with no `vhost-user-vsock-pci`, so PCI bus 0 has no socket device.
fn vsock_without_a_device_fails_cleanly() {
    let test = "vsock_without_a_device_fails_cleanly";
    let elf = agent_elf().expect("agent builds");
    let dir = std::env::temp_dir().join(format!("vmtsync-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let com2 = dir.join("com2.log");
    let child = qemu::command(Machine::Q35, &elf, "transport=vsock exit=5", &com2)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("qemu starts");
    let mut guard = ChildGuard::new(child);
    let end = Instant::now() + STEP;
    let status = loop {
        if let Some(s) = guard.child().try_wait().expect("wait qemu") {
            break s;
        }
        assert!(Instant::now() < end, "QEMU did not exit");
        std::thread::sleep(Duration::from_millis(10));
    };
    let log = decode_file_text(&elf, &com2);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        status.code(),
        Some(debug_exit_status(SETUP_FAILED_EXIT_CODE)),
        "COM2 log:\n{log}"
    );
    assert!(
        log.contains("vsock: PCI device setup failed: no virtio socket device found"),
        "COM2 log:\n{log}"
    );
}
