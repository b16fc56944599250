//! Tier 2: the guest agent under the built-in VMM on real KVM.
//!
//! Truth: KVM's mapping of the VM's vCPU, read from debugfs (`vmtsync_tests::truth`), then
//! the agent's software skew when it has one. Every TSC the agent reports must be what that
//! truth gives between the host TSCs of the VM exits that bracket the exchange: the exit where
//! the guest read the request's last byte and the exit where it wrote the reply's first byte.
//! Nothing assumes this host's guest TSC == host TSC (docs/host-quirks.md).

use std::time::{Duration, Instant};

use vmtsync::probe::{AgentInfo, ProbeSession};
use vmtsync_core::proto::{Features, Message, Transport};
use vmtsync_core::pvclock::PvclockVcpuTimeInfo;
use vmtsync_core::sim::median;
use vmtsync_core::{GuestTicks, HostTicks};
use vmtsync_tests::truth::{GuestTruth, Skew, truth_mapping_of};
use vmtsync_tests::vmm::client::{Com1Transport, wait_ready};
use vmtsync_tests::vmm::defmt_log::{DefmtLog, LogLine, MALFORMED};
use vmtsync_tests::vmm::{SerialByte, Vm, VmConfig, VmExit, agent_elf};

use crate::util::{kvm_ready, kvm_truth_ready};

crate::trials!(
    kvm_truth_ready;
    builtin_vmm_agent_answers_probes_within_the_exit_bracket_ring3,
    builtin_vmm_agent_answers_probes_within_the_exit_bracket_ring0,
    builtin_vmm_agent_applies_software_skew,
    builtin_vmm_line_mode_probe_then_panic_logs_and_exits_with_failure_code,
    builtin_vmm_watchdog_ends_a_guest_that_spins_without_exits,
    builtin_vmm_agent_log_is_defmt_decoded_with_tsc_timestamps;
    kvm_ready;
    builtin_vmm_rejects_an_elf_without_pvh_note,
    vmtsync_vmm_binary_bridges_com1_to_stdio_and_returns_the_exit_code,
);

const STEP: Duration = Duration::from_secs(20);

/// The decoded COM2 line at `level` whose message is exactly `text`, if any.
fn line<'a>(lines: &'a [LogLine], level: &str, text: &str) -> Option<&'a LogLine> {
    lines
        .iter()
        .find(|l| l.level == Some(level) && l.text == text)
}

fn text(line: &[SerialByte]) -> String {
    line.iter().map(|b| char::from(b.byte)).collect()
}

fn boot(cmdline: &str, timeout: Duration) -> Vm {
    let elf = agent_elf().expect("agent builds");
    let cfg = VmConfig {
        cmdline: cmdline.into(),
        timeout,
        ..VmConfig::default()
    };
    Vm::boot(&elf, &cfg).expect("VM boots")
}

/// The truth for the VM's vcpu0 with the agent's `skew` (debugfs; the VM exists once booted).
fn truth(vm: &Vm, skew: Option<Skew>) -> GuestTruth {
    GuestTruth::new(
        truth_mapping_of(vm.debugfs_id(), 0).expect("truth from debugfs"),
        skew,
    )
}

/// The guest TSC the truth gives at host TSC `h`.
fn guest_at(t: &GuestTruth, h: u64) -> u64 {
    t.guest_at(HostTicks(h)).expect("no overflow").0
}

/// Waits for the agent's beacon on COM1 and greets it through vmtsync's probe session (which
/// checks the protocol version: a mismatch fails the hello).
fn greet<'a>(vm: &'a Vm) -> ProbeSession<Com1Transport<'a>> {
    let mut t = Com1Transport::new(vm.com1());
    assert!(
        wait_ready(&mut t, Instant::now() + STEP).is_ok(),
        "no ready beacon; COM2 log:\n{}",
        vm.log_text()
    );
    ProbeSession::hello(t, STEP).expect("capabilities")
}

/// Boots the agent with `cmdline` (which must set `exit=5`), runs hello, 40 probes (full and
/// compact alternating) and shutdown, and checks every reported TSC against the exit bracket.
fn probe_session(cmdline: &str) {
    let vm = boot(cmdline, Duration::from_secs(60));
    let mut t = Com1Transport::new(vm.com1());
    assert!(
        wait_ready(&mut t, Instant::now() + STEP).is_ok(),
        "no ready beacon; COM2 log:\n{}",
        vm.log_text()
    );
    let truth = truth(&vm, None);
    let g = |h: u64| guest_at(&truth, h);
    let lines = vm.log_lines();
    let log = vm.log_text();
    assert!(
        lines
            .iter()
            .any(|l| l.text.ends_with(&format!(" cmdline \"{cmdline}\""))),
        "COM2 log:\n{log}"
    );
    assert!(
        line(&lines, "info", "ready: postcard on COM1, vcpu 0").is_some(),
        "COM2 log:\n{log}"
    );

    // The session's hello checks the protocol version (a mismatch fails it).
    let mut c = ProbeSession::hello(t, STEP).expect("capabilities");
    let k = *c.info();
    assert_eq!(k.transport, Transport::Uart16550);
    assert_eq!(k.vcpu, 0);
    let caps = c.transport().last_exchange();
    assert!(
        truth.in_bracket(
            HostTicks(caps.request_read),
            k.hello_tsc,
            HostTicks(caps.first_byte)
        ),
        "hello TSC {} outside [{}, {}] ({truth:?})",
        k.hello_tsc.0,
        g(caps.request_read),
        g(caps.first_byte)
    );
    // The session's stamps are the transport's refined exit bracket.
    assert_eq!(
        (k.hello_stamps.send.0, k.hello_stamps.recv.0),
        (caps.request_read, caps.first_byte)
    );

    let (mut before, mut tight, mut after) = (Vec::new(), Vec::new(), Vec::new());
    let (mut full_bytes, mut compact_bytes) = (Vec::new(), Vec::new());
    for seq in 0..40u8 {
        let full = seq % 2 == 0;
        if full {
            // With no reference the session asks with ProbeFull; otherwise it asks compact and
            // unwraps the reply in its window (the session also checks seq and vCPU).
            c.forget_reference();
        }
        let sample = c
            .probe()
            .expect("probe reply")
            .unwrap_or_else(|| panic!("probe {seq} lost: {:?}", c.stats()));
        let ex = c.transport().last_exchange();
        let (lo, hi, prev) = (ex.request_read, ex.first_byte, ex.prev_exit);
        if full {
            full_bytes.push(ex.received);
        } else {
            compact_bytes.push(ex.received);
        }
        assert_eq!((sample.host_send.0, sample.host_recv.0), (lo, hi));
        let guest = sample.guest.0;
        // The exits' host TSCs in guest time, through the truth.
        let (lo, prev, hi) = (g(lo), g(prev), g(hi));
        assert!(
            lo <= guest && guest <= hi,
            "probe {seq}: guest TSC {guest} outside the exit bracket [{lo}, {hi}] ({truth:?})"
        );
        // No exit between the agent's TSC read and its first reply byte: the two exits
        // around that byte bracket the read.
        assert!(
            lo <= prev && prev <= guest,
            "probe {seq}: guest TSC {guest} before the exit preceding its reply ({prev})"
        );
        before.push(guest - lo);
        tight.push(guest - prev);
        after.push(hi - guest);
    }
    // Half the replies were compact (the low 32 bits only, unwrapped), half full.
    assert_eq!(c.stats().compact_samples, 20, "{:?}", c.stats());
    assert!(
        compact_bytes.iter().max() < full_bytes.iter().min(),
        "compact {compact_bytes:?} vs full {full_bytes:?}"
    );
    eprintln!(
        "{cmdline:?}: 40 probes, median guest cycles: request-read exit -> guest TSC {}, \
         previous exit -> guest TSC {}, guest TSC -> reply's first-byte exit {}",
        median(&mut before).unwrap_or_default(),
        median(&mut tight).unwrap_or_default(),
        median(&mut after).unwrap_or_default()
    );

    check_pvclock_against_kvm_get_clock(&vm, &truth, &mut c, &k);

    let (bye, _) = c.request(&Message::Shutdown).expect("exiting");
    assert_eq!(bye, Message::Exiting);
    let out = vm.wait().expect("run ends");
    eprintln!(
        "{cmdline:?}: exit {:?} after {} I/O exits in {:?}",
        out.exit, out.io_exits, out.run_time
    );
    assert_eq!(out.exit, VmExit::DebugExit(5), "log:\n{}", out.log);
    assert!(
        line(
            &out.log_lines,
            "info",
            "shutdown after 40 probes, 43 messages, 0 bad frames, 0 events (0 workload, 0 sent, \
             0 dropped): isa-debug-exit 5"
        )
        .is_some(),
        "log:\n{}",
        out.log
    );
    // Ring 0 is the agent's default.
    let cpl = if cmdline.contains("ring=3") { 3 } else { 0 };
    assert!(
        line(&out.log_lines, "info", &format!("serving at CPL {cpl}")).is_some(),
        "log:\n{}",
        out.log
    );
}

/// Asks for a pvclock report and checks it against the host's own view of the same clock:
/// `KVM_GET_CLOCK` gives kvmclock ns at a host TSC; with that host TSC taken to guest time
/// through KVM's mapping (`t`, no skew) and a stable clock, the guest's pvclock ns at its TSC
/// must match kvmclock extrapolated to that guest TSC.
fn check_pvclock_against_kvm_get_clock(
    vm: &Vm,
    t: &GuestTruth,
    c: &mut ProbeSession<Com1Transport<'_>>,
    caps: &AgentInfo,
) {
    let features = caps.features;
    assert!(
        features.contains(Features::PVCLOCK),
        "agent did not register a pvclock page; log:\n{}",
        vm.log_text()
    );
    // The agent answers `Unsupported` also when its seqlock read stayed contended for all of
    // its attempts (KVM rewriting the page under it: with ring-0 code emulated instruction by
    // instruction on a loaded nested host, an attempt is slow). A page it registered (the
    // capability above) must yield a report within a few requests.
    let mut tries = 0;
    let (reply, ex) = loop {
        tries += 1;
        let (reply, ex) = c.request(&Message::PvclockRequest).expect("pvclock report");
        match reply {
            Message::Error(vmtsync_core::proto::ErrorCode::Unsupported) if tries < 5 => {
                eprintln!("pvclock read contended (try {tries}); asking again");
            }
            r => break (r, ex),
        }
    };
    let Message::PvclockReport(p) = reply else {
        panic!("expected a pvclock report, got {reply:?} after {tries} tries")
    };
    assert_eq!(p.version % 2, 0, "{p:?}");
    assert!(p.version > 0, "{p:?}");
    // The refined stamps: the exit of the request's read, the exit of the reply's first byte.
    assert!(
        t.in_bracket(ex.send, p.tsc, ex.recv),
        "pvclock TSC {} outside the exit bracket {ex:?} ({t:?})",
        p.tsc.0
    );
    let fields = PvclockVcpuTimeInfo {
        version: p.version,
        tsc_timestamp: p.tsc_timestamp,
        system_time: p.system_time,
        tsc_to_system_mul: p.mul,
        tsc_shift: p.shift,
        flags: p.flags,
        ..PvclockVcpuTimeInfo::default()
    }
    .fields();
    let guest_ns = fields.try_ns_at_floor(p.tsc).expect("pvclock ns").0;
    // The TSC frequency the agent read from CPUID (the VMM's timing leaf, from
    // KVM_GET_TSC_KHZ) agrees with the one implied by KVM's pvclock scale.
    let caps_khz = u64::from(caps.tsc_khz.expect("agent reports the TSC frequency"));
    let pvclock_khz = fields
        .scale
        .try_tsc_khz_floor()
        .expect("pvclock scale gives a frequency");
    eprintln!("TSC kHz: CPUID {caps_khz}, pvclock scale {pvclock_khz}");
    assert!(
        caps_khz.abs_diff(pvclock_khz) <= 2,
        "{caps_khz} vs {pvclock_khz} kHz"
    );
    let clock = vm.kvm_clock().expect("KVM_GET_CLOCK");
    eprintln!(
        "pvclock v{} flags {:#x} mul {:#x} shift {}; KVM_GET_CLOCK flags {:#x}",
        p.version, p.flags, p.mul, p.shift, clock.flags
    );
    // KVM_CLOCK_HOST_TSC: `clock` is kvmclock at host TSC `host_tsc`, which KVM's mapping
    // takes to the guest TSC the pvclock scale applies to.
    if clock.flags & 8 != 0 {
        let clock_tsc = t
            .kvm
            .try_guest_from_host(HostTicks(clock.host_tsc))
            .expect("maps")
            .0;
        // kvmclock extrapolated from (clock_tsc, clock) to the guest's TSC with the same scale.
        let host_ns_at_guest_tsc = if p.tsc.0 >= clock_tsc {
            fields
                .scale
                .try_scale_floor(p.tsc.0 - clock_tsc)
                .map(|d| clock.clock + d)
        } else {
            fields
                .scale
                .try_scale_floor(clock_tsc - p.tsc.0)
                .map(|d| clock.clock - d)
        }
        .expect("scales");
        let diff = i128::from(guest_ns) - i128::from(host_ns_at_guest_tsc);
        eprintln!(
            "pvclock at guest TSC {}: {guest_ns} ns; KVM_GET_CLOCK extrapolated: \
             {host_ns_at_guest_tsc} ns; difference {diff} ns",
            p.tsc.0
        );
        assert!(
            diff.abs() < 1_000,
            "pvclock and KVM_GET_CLOCK differ by {diff} ns"
        );
    } else {
        assert!(
            guest_ns <= clock.clock,
            "pvclock {guest_ns} ns ahead of KVM_GET_CLOCK"
        );
    }
}

fn builtin_vmm_agent_answers_probes_within_the_exit_bracket_ring3() {
    // The UART's own exits are under test: no sync-port exit between read and reply.
    probe_session("transport=uart ring=3 syncport=off exit=5");
}

fn builtin_vmm_agent_answers_probes_within_the_exit_bracket_ring0() {
    probe_session("transport=uart ring=0 syncport=off exit=5");
}

fn builtin_vmm_agent_applies_software_skew() {
    // reported = offset + ((tsc * ratio) >> frac) of the TSC KVM shows the guest, with the
    // offset derived from the host TSC now and a rate != 1.
    let skew = Skew::pick();
    let vm = boot(
        &format!("{} exit=0", skew.agent_option()),
        Duration::from_secs(60),
    );
    let t = truth(&vm, Some(skew));
    let mut c = greet(&vm);
    let k = *c.info();
    let caps = c.transport().last_exchange();
    // The skew is monotonic, so the exit bracket maps through it.
    assert!(
        t.in_bracket(
            HostTicks(caps.request_read),
            k.hello_tsc,
            HostTicks(caps.first_byte)
        ),
        "hello TSC {} outside [{}, {}] ({t:?})",
        k.hello_tsc.0,
        guest_at(&t, caps.request_read),
        guest_at(&t, caps.first_byte)
    );
    // A full-width probe: no reference to unwrap against.
    c.forget_reference();
    let p = c.probe().expect("probe").expect("not lost");
    let ex = c.transport().last_exchange();
    assert!(
        t.in_bracket(
            HostTicks(ex.request_read),
            p.guest,
            HostTicks(ex.first_byte)
        ),
        "reported {} outside [{}, {}] ({t:?})",
        p.guest.0,
        guest_at(&t, ex.request_read),
        guest_at(&t, ex.first_byte)
    );
    assert_eq!(
        c.request(&Message::Shutdown).expect("bye").0,
        Message::Exiting
    );
    assert_eq!(vm.wait().expect("run ends").exit, VmExit::DebugExit(0));
}

/// Boots in `wire=line` mode and reads the hello line.
fn boot_line(timeout: Duration) -> Vm {
    // No sync port (on by default): the test checks that no exit lies between read and 'T'.
    let vm = boot("wire=line syncport=off", timeout);
    let hello = vm.com1().recv_line(STEP).expect("hello on COM1");
    assert_eq!(text(&hello), "H vmtsync-agent\n");
    vm
}

fn builtin_vmm_line_mode_probe_then_panic_logs_and_exits_with_failure_code() {
    let vm = boot_line(Duration::from_secs(60));
    vm.com1().send(b"p");
    let line = vm.com1().recv_line(STEP).expect("probe answer");
    let read = vm
        .com1()
        .delivered_timeout(STEP)
        .expect("probe byte was read");
    let s = text(&line);
    assert!(s.starts_with('T') && s.len() == 18, "answer {s:?}");
    let guest = u64::from_str_radix(&s[1..17], 16).expect("hex TSC");
    let t = truth(&vm, None);
    assert!(
        t.in_bracket(
            HostTicks(read.host_tsc),
            GuestTicks(guest),
            HostTicks(line[0].host_tsc)
        ),
        "{guest} outside [{}, {}] ({t:?})",
        guest_at(&t, read.host_tsc),
        guest_at(&t, line[0].host_tsc)
    );
    assert!(
        guest_at(&t, line[0].prev_exit_host_tsc) <= guest,
        "an exit between TSC read and 'T'"
    );

    vm.com1().send(b"!");
    let out = vm.wait().expect("run ends");
    assert_eq!(out.exit, VmExit::DebugExit(0x7e), "log:\n{}", out.log);
    let panic = out
        .log_lines
        .iter()
        .find(|l| l.text.starts_with("PANIC: panicked at "))
        .unwrap_or_else(|| panic!("no PANIC line; log:\n{}", out.log));
    assert_eq!(panic.level, Some("error"), "{panic:?}");
    assert!(panic.text.contains("host asked for a panic"), "{panic:?}");
}

fn builtin_vmm_watchdog_ends_a_guest_that_spins_without_exits() {
    let timeout = Duration::from_secs(3);
    let vm = boot_line(timeout);
    vm.com1().send(b"w");
    let ack = vm.com1().recv_line(STEP).expect("spin acknowledged");
    assert_eq!(text(&ack), "W\n");
    assert!(vm.wait_log(
        "info  spinning without exits until the host's watchdog ends the VM",
        STEP
    ));
    let out = vm.wait().expect("watchdog stops the vCPU");
    eprintln!(
        "watchdog: {:?} after {:?}, rip {:#x}",
        out.exit, out.run_time, out.rip
    );
    assert_eq!(out.exit, VmExit::Timeout, "log:\n{}", out.log);
    assert!(out.run_time >= timeout);
}

fn builtin_vmm_rejects_an_elf_without_pvh_note() {
    // The test binary itself is an ELF without a Xen PVH note.
    let me = std::env::current_exe().expect("own path");
    let err = Vm::boot(&me, &VmConfig::default()).expect_err("no PVH entry");
    assert!(err.to_string().contains("loading the guest ELF"), "{err}");
}

fn vmtsync_vmm_binary_bridges_com1_to_stdio_and_returns_the_exit_code() {
    use std::io::{Read, Write};
    use std::process::{Command, Stdio};

    let elf = agent_elf().expect("agent builds");
    let child = Command::new(env!("CARGO_BIN_EXE_vmtsync-vmm"))
        .arg(&elf)
        .args(["--timeout", "60", "--", "wire=line", "exit=3"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("vmtsync-vmm starts");
    let mut guard = vmtsync_tests::ChildGuard::new(child);
    let mut stdin = guard.child().stdin.take().expect("stdin");
    // Bytes sent before the agent's UART init are dropped by its FIFO reset: wait for the hello
    // line first.
    let mut stdout = guard.child().stdout.take().expect("stdout");
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    while !got.ends_with(b"H vmtsync-agent\n") {
        assert_eq!(
            stdout.read(&mut b).expect("read stdout"),
            1,
            "EOF after {got:?}"
        );
        got.push(b[0]);
    }
    stdin.write_all(b"xpq").expect("write stdin");
    stdin.flush().expect("flush");
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).expect("read rest");
    let status = guard.child().wait().expect("wait");
    let mut err = String::new();
    guard
        .child()
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("read stderr");
    assert!(
        rest.starts_with("xT") && rest.ends_with("\nQ\n"),
        "stdout: {rest:?}"
    );
    assert_eq!(rest.len(), 2 + 16 + 1 + 2, "stdout: {rest:?}");
    assert_eq!(status.code(), Some(3), "stderr:\n{err}");
    // Decoded defmt text: the raw COM2 frames never contain the message in clear.
    assert!(
        err.contains(" info  quit: isa-debug-exit 3\n"),
        "stderr:\n{err}"
    );
    assert!(err.contains("DebugExit(3)"), "stderr:\n{err}");
}

fn builtin_vmm_agent_log_is_defmt_decoded_with_tsc_timestamps() {
    let before_boot = vmtsync_tests::vmm::tsc::host_tsc();
    let vm = boot("exit=0", Duration::from_secs(60));
    // In postcard mode the first COM1 byte is the ready beacon, sent right after the "ready"
    // log line: the line's TSC lies between the boot and the exit carrying the beacon.
    let beacon = vm.com1().recv_timeout(STEP).expect("ready beacon");
    assert_eq!(beacon.byte, 0);
    let lines = vm.log_lines();
    let log = vm.log_text();
    eprintln!("decoded COM2 log at the ready beacon:\n{log}");
    let ready = line(&lines, "info", "ready: postcard on COM1, vcpu 0")
        .unwrap_or_else(|| panic!("no ready line; log:\n{log}"));
    let ready_tsc = ready.tsc.expect("timestamped");
    // Log timestamps are the raw guest TSC: the truth (KVM's mapping) takes the host TSCs
    // before the boot (which precedes the vCPU: `guest_floor_at`) and at the beacon to guest
    // time.
    let t = truth(&vm, None);
    let at_beacon = guest_at(&t, beacon.host_tsc);
    let before_boot = t
        .guest_floor_at(HostTicks(before_boot), HostTicks(beacon.host_tsc))
        .0;
    assert!(
        before_boot <= ready_tsc && ready_tsc <= at_beacon,
        "ready line TSC {ready_tsc} outside [{before_boot}, {at_beacon}] ({t:?})"
    );
    assert!(
        lines[0].text.starts_with("vmtsync-agent ")
            && lines[0].text.contains(": long mode, start_info at 0x"),
        "first line {:?}",
        lines[0]
    );
    // Every line decoded, timestamped with the TSC, in order, within the boot.
    for w in lines.windows(2) {
        let (a, b) = (w[0].tsc.expect("tsc"), w[1].tsc.expect("tsc"));
        assert!(a <= b, "timestamps go back: {:?} then {:?}", w[0], w[1]);
    }
    assert!(lines.iter().all(|l| l.tsc.expect("tsc") >= before_boot));
    assert!(lines.iter().all(|l| l.text != MALFORMED), "{log}");
    // vmtsync-core's own log calls (its `defmt` feature) come out with the agent's.
    assert!(
        lines
            .iter()
            .any(|l| l.level == Some("info")
                && l.text.starts_with("pvclock: registering page at 0x")),
        "no core log line; log:\n{log}"
    );
    // Resync: a cut-short frame before the stream (what a panic inside a log call leaves) is
    // one malformed line, and a frame still being written is pending, not decoded.
    let decoder = DefmtLog::from_elf_path(&agent_elf().expect("agent builds")).expect("defmt");
    let bytes = vm.log_bytes();
    let end = bytes.iter().rposition(|&b| b == 0).expect("a delimiter") + 1;
    // defmt's encoder starts the stream with a separator, so a reboot's leftovers never
    // merge with the first frame.
    assert_eq!(bytes[0], 0, "{:02x?}", &bytes[..8]);
    let garbled = [&[0x55, 0x13, 0x00][..], &bytes[..end], &bytes[1..4]].concat();
    let d = decoder.decode(&garbled);
    assert_eq!(d.malformed, 1);
    assert_eq!(d.lines[0].text, MALFORMED);
    assert_eq!(d.pending_bytes, 3);
    assert_eq!(&d.lines[1..], &decoder.decode(&bytes[..end]).lines[..]);

    // The beacon was read above. The capabilities came (or the hello would have failed).
    let mut c = ProbeSession::hello(Com1Transport::new(vm.com1()), STEP).expect("capabilities");
    assert_eq!(
        c.request(&Message::Shutdown).expect("bye").0,
        Message::Exiting
    );
    let out = vm.wait().expect("run ends");
    assert_eq!(out.exit, VmExit::DebugExit(0), "log:\n{}", out.log);
    assert_eq!(
        out.log_lines.last().map(|l| l.text.as_str()),
        Some(
            "shutdown after 0 probes, 2 messages, 0 bad frames, 0 events (0 workload, 0 sent, \
             0 dropped): isa-debug-exit 0"
        )
    );
}
