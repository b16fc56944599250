//! End to end through the real `vmtsync` program: `probe` and `convert --sync` against the
//! loopback agent (tier 1), then the guest agent under QEMU on real KVM (tier 2): a software
//! skew recovered by probes and undone by `convert`, the KVM debugfs mapping checked against
//! the agent's own TSC readings, and a VM killed in the middle of a probe run.
//!
//! Truth in tier 2 (`vmtsync_tests::truth`): the vCPU's KVM mapping read from debugfs, then the
//! agent's `skew=O,R,F` boot option (its reported TSC is `O + (tsc * R) >> F` of the TSC KVM
//! shows it), with the skew picked from the host TSC at the time. No test assumes this host's
//! offset 0: on an ordinary KVM host the guest TSC starts near zero and they hold all the same.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use vmtsync::link::connect::connect;
use vmtsync::link::{ConnectOptions, ProbeAddr};
use vmtsync::probe::{ProbeSession, ProbeSummary, Progress};
use vmtsync_core::estimate::ProbeSample;
use vmtsync_tests::truth::{GuestTruth, Skew, truth_mapping};
use vmtsync_tests::vmm::agent_elf;
use vmtsync_tests::vmm::defmt_log::decode_file_text;
use vmtsync_tests::vmm::qemu::{self, Machine, have_qemu};
use vmtsync_tests::{ChildGuard, require};

use crate::util::{kvm_ready, scratch, text, vm_ready, vmtsync};

crate::trials!(
    vm_ready;
    qemu_software_skew_is_recovered_and_converted_back,
    qemu_kvm_mapping_from_debugfs_maps_agent_readings_into_their_brackets;
    qemu_vm_ready;
    qemu_killed_mid_probe_ends_vmtsync_with_a_clear_error,
);

/// Tier 2 prerequisites of the QEMU test that reads no truth: `/dev/kvm` and QEMU.
fn qemu_vm_ready(test: &str) -> bool {
    kvm_ready(test)
        && require(
            test,
            have_qemu(),
            "qemu-system-x86_64 is missing (apt-get install qemu-system-x86)",
        )
}

/// The agent under QEMU microvm with COM1 on a Unix socket QEMU listens on (the guest boots
/// without waiting for a client) and COM2 (the agent's log) in `com2`.
fn boot_qemu(elf: &Path, sock: &Path, com2: &Path, append: &str) -> ChildGuard {
    let _ = std::fs::remove_file(sock);
    let child = qemu::command_com1_socket(Machine::Microvm, elf, append, com2, sock)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu starts");
    ChildGuard::new(child)
}

/// Opens a probe session on QEMU's COM1 socket (the library's own connect and hello).
fn session(sock: &Path) -> ProbeSession<Box<dyn vmtsync::link::StampedTransport + Send>> {
    let addr = ProbeAddr::parse(&format!("unix:{}", sock.display())).unwrap();
    let t = connect(
        &addr,
        &ConnectOptions {
            connect_timeout: Duration::from_secs(20),
            io_timeout: Duration::from_secs(20),
        },
    )
    .expect("connects to QEMU's COM1 socket");
    ProbeSession::hello(t, Duration::from_secs(20)).expect("hello")
}

/// Pipes each sample's guest stamp through `vmtsync args…` and checks that every host value
/// printed lies in the host bracket `[host_send, host_recv]` of its probe.
fn converted_inside_brackets(args: &[&str], samples: &[ProbeSample]) -> Vec<(u64, u64, u64)> {
    let input: String = samples.iter().map(|s| format!("{}\n", s.guest.0)).collect();
    let out = crate::util::run(args, input.as_bytes());
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    let lines: Vec<u64> = text(&out.stdout)
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(lines.len(), samples.len());
    let mut got = Vec::new();
    for (s, &h) in samples.iter().zip(&lines) {
        assert!(
            s.host_send.0 <= h && h <= s.host_recv.0,
            "guest {} -> host {h}, outside its probe's bracket [{}, {}]",
            s.guest.0,
            s.host_send.0,
            s.host_recv.0
        );
        got.push((s.host_send.0, h, s.host_recv.0));
    }
    got
}

/// Tier 2 (a): a software skew with a non-identity rate, recovered by probes and undone by
/// `vmtsync convert --offset O --ratio R --frac-bits F --to host` with the true mapping.
///
/// The truth is KVM's debugfs mapping of the VM's vCPU followed by the skew
/// ([`GuestTruth`]). With rate R/2^48 != 1, `guest - host` changes with time, so the truth is
/// compared where the estimate refers to it: at the summary's `at_host_tsc`. The mapping
/// floors (`(tsc * R) >> 48`), so the true offset at any instant is the line's value minus
/// less than one tick; the check allows that one tick.
fn qemu_software_skew_is_recovered_and_converted_back() {
    let skew = Skew::pick();
    let scratch_dir = scratch("skew");
    let dir = scratch_dir.path();
    let (sock, com2) = (dir.join("com1.sock"), dir.join("com2.log"));
    let elf = agent_elf().expect("agent builds");
    let append = format!("transport=uart exit=9 {}", skew.agent_option());
    let qemu = boot_qemu(&elf, &sock, &com2, &append);
    let mut s = session(&sock);
    // After the hello QEMU has created its VM and vCPU: read KVM's side of the truth.
    let truth = GuestTruth::read(qemu.pid(), 0, Some(skew)).expect("truth from debugfs");
    let info = *s.info();
    let samples = s
        .probe_round(64, Duration::ZERO, &mut Progress::hidden())
        .unwrap_or_else(|e| panic!("{e}; COM2:\n{}", decode_file_text(&elf, &com2)));
    let stats = s.shutdown();
    let sum = ProbeSummary::from_samples(&info, &samples, stats).expect("estimates");
    let at = sum.at_host;
    let truth_at = truth.offset_at(at).expect("no overflow");
    println!(
        "{} over KVM {:?}: model {:?}, offset {} at host {} (truth {truth_at}, error {:+}), bounds [{}, {}] width {}, drift {:?} ppb (truth ~100000)",
        skew.agent_option(),
        truth.kvm,
        sum.model,
        sum.offset,
        at.0,
        i128::from(sum.offset) - truth_at,
        sum.bound_lo,
        sum.bound_hi,
        sum.width(),
        sum.drift.map(|d| (d.lo, d.hi)),
    );
    truth
        .check(at, sum.bound_lo, sum.bound_hi)
        .unwrap_or_else(|e| panic!("{e}"));
    // The true mapping, inverted by the CLI, puts each guest stamp inside its probe.
    let m = truth
        .composed()
        .expect("the skew composes with KVM's mapping");
    let (o, r, f) = (
        m.offset().to_string(),
        m.ratio().to_string(),
        m.frac_bits().to_string(),
    );
    let args = [
        "convert",
        "--offset",
        &o,
        "--ratio",
        &r,
        "--frac-bits",
        &f,
        "--to",
        "host",
    ];
    let got = converted_inside_brackets(&args, &samples);
    let (send, h, recv) = got[got.len() / 2];
    println!(
        "convert: guest -> host {h}, {} ticks after send, {} before receive",
        h - send,
        recv - h
    );
}

/// Tier 2 (b): `vmtsync kvm --json --vm <QEMU PID>` finds the VM's one vCPU with the mapping
/// KVM debugfs holds (whatever it is on this host), and the agent's TSC readings, mapped to
/// host time through that mapping by `vmtsync convert --vm PID --vcpu 0`, lie inside the host
/// brackets of their probes.
fn qemu_kvm_mapping_from_debugfs_maps_agent_readings_into_their_brackets() {
    let scratch_dir = scratch("kvm");
    let dir = scratch_dir.path();
    let (sock, com2) = (dir.join("com1.sock"), dir.join("com2.log"));
    let elf = agent_elf().expect("agent builds");
    let qemu = boot_qemu(&elf, &sock, &com2, "transport=uart exit=9");
    let pid = qemu.pid().to_string();
    // Hello first: by then QEMU has created its VM and vCPU.
    let mut s = session(&sock);
    let out = crate::util::run(&["kvm", "--json", "--vm", &pid], b"");
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let vms = v["vms"].as_array().unwrap();
    assert_eq!(vms.len(), 1, "{v}");
    assert_eq!(vms[0]["pid"].as_u64(), Some(u64::from(qemu.pid())));
    let vcpus = vms[0]["vcpus"].as_array().unwrap();
    assert_eq!(vcpus.len(), 1, "-smp 1: {v}");
    println!("vmtsync kvm: {}", vcpus[0]);
    assert_eq!(vcpus[0]["vcpu"], 0);
    let truth = truth_mapping(qemu.pid(), 0).expect("truth from debugfs");
    assert_eq!(vcpus[0]["tsc_offset"].as_i64(), Some(truth.offset()), "{v}");
    assert_eq!(vcpus[0]["tsc_scaling_ratio"].as_u64(), Some(truth.ratio()));
    assert_eq!(
        vcpus[0]["tsc_frac_bits"].as_u64(),
        Some(u64::from(truth.frac_bits()))
    );

    let samples = s
        .probe_round(32, Duration::ZERO, &mut Progress::hidden())
        .expect("probes");
    assert_eq!(s.info().vcpu, 0);
    // While the VM still runs: convert through its live debugfs mapping.
    let got = converted_inside_brackets(&["convert", "--vm", &pid, "--vcpu", "0"], &samples);
    s.shutdown();
    let widths: Vec<u64> = got.iter().map(|(a, _, b)| b - a).collect();
    println!(
        "{} agent readings inside their brackets; bracket widths min {} max {} ticks",
        got.len(),
        widths.iter().min().unwrap(),
        widths.iter().max().unwrap()
    );
}

/// True while `/proc/<pid>` exists (a running process or an unreaped zombie).
fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Tier 2 (c): QEMU killed in the middle of a long `vmtsync probe` run: vmtsync exits 7 with a
/// message naming the lost agent, well within its --timeout, and no process is left behind.
fn qemu_killed_mid_probe_ends_vmtsync_with_a_clear_error() {
    let scratch_dir = scratch("kill");
    let dir = scratch_dir.path();
    let (sock, com2) = (dir.join("com1.sock"), dir.join("com2.log"));
    let elf = agent_elf().expect("agent builds");
    let mut qemu = boot_qemu(&elf, &sock, &com2, "transport=uart exit=9");
    let addr = format!("unix:{}", sock.display());
    let probe = vmtsync()
        .args(["probe", "--connect", &addr, "--probes", "100000"])
        .args([
            "--interval",
            "1",
            "--timeout",
            "5000",
            "--connect-timeout",
            "20000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("vmtsync-cli starts");
    let mut probe = ChildGuard::new(probe);
    let (qemu_pid, probe_pid) = (qemu.pid(), probe.pid());
    // Let the session get going: wait for the agent to serve COM1, then for ~1 s of probes
    // (each ~1 ms plus the 1 ms interval), so the kill lands mid-run.
    let end = Instant::now() + Duration::from_secs(20);
    // COM2 carries defmt frames: decode them to look for the line.
    while !decode_file_text(&elf, &com2).contains("serving at CPL") {
        assert!(Instant::now() < end, "the agent did not start serving");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        probe.child().try_wait().unwrap().is_none(),
        "vmtsync ended before the kill"
    );
    let killed = Instant::now();
    qemu.child().kill().expect("kill QEMU by PID");
    let status = qemu.child().wait().expect("reap QEMU");
    assert!(
        status.code().is_none(),
        "QEMU was killed, not exited: {status}"
    );
    let end = killed + Duration::from_secs(15);
    let code = loop {
        if let Some(s) = probe.child().try_wait().unwrap() {
            break s.code();
        }
        assert!(
            Instant::now() < end,
            "vmtsync still running 15 s after the kill"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = killed.elapsed();
    let out = probe.0.take().unwrap().wait_with_output().unwrap();
    let err = text(&out.stderr);
    println!(
        "vmtsync exited {code:?} {took:?} after the kill: {}",
        err.trim()
    );
    assert_eq!(code, Some(7), "stderr: {err}");
    assert!(err.starts_with("vmtsync: "), "{err}");
    assert!(
        err.contains("the guest agent closed the connection")
            || err.contains("did not send") // a timeout, if the close went unnoticed
            || err.contains("timed out"),
        "{err}"
    );
    // Within the 5 s reply timeout (plus slack for a loaded machine), not the 100 s run.
    assert!(
        took < Duration::from_secs(7),
        "exit took {took:?}, --timeout is 5 s"
    );
    drop(qemu);
    assert!(!alive(qemu_pid), "QEMU {qemu_pid} still exists");
    assert!(!alive(probe_pid), "vmtsync {probe_pid} still exists");
}
