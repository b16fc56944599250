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
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use vmtsync::link::connect::connect;
use vmtsync::link::transport::host_tsc_now;
use vmtsync::link::{ConnectOptions, ProbeAddr};
use vmtsync::probe::{ProbeSession, ProbeSummary, Progress};
use vmtsync::syncfile::{SyncFile, convert_with_sync};
use vmtsync_core::estimate::ProbeSample;
use vmtsync_tests::fake_agent::{self as fake, SkewedClock};
use vmtsync_tests::truth::{GuestTruth, Skew, truth_mapping, truth_ready};
use vmtsync_tests::vmm::agent_elf;
use vmtsync_tests::vmm::defmt_log::decode_file_text;
use vmtsync_tests::vmm::qemu::{self, Machine, have_qemu};
use vmtsync_tests::{ChildGuard, have_kvm, require};

use crate::util::vmtsync;

/// A scratch directory unique to this test and `test`, removed when the returned guard drops
/// (also when the test fails).
fn scratch(test: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("vmtsync-e2e-{test}-"))
        .tempdir()
        .unwrap()
}

/// Runs `vmtsync args…` with `input` on stdin ([`crate::util::run`]).
fn run(args: &[&str], input: &str) -> Output {
    crate::util::run(args, input.as_bytes())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Tier 1: `vmtsync probe --json` over TCP to the loopback agent (true offset = its skew).
#[test]
fn cli_probe_json_bounds_the_loopback_agents_skew() {
    let skew = -7_654_321_i64;
    let (port, agent) = fake::spawn_tcp(SkewedClock { skew, vcpu: 2 }).unwrap();
    let addr = format!("tcp:127.0.0.1:{port}");
    let out = run(
        &["probe", "--connect", &addr, "--json", "--probes", "40"],
        "",
    );
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    println!("cli probe: {v}");
    assert_eq!(v["schema"], 2);
    assert_eq!(v["vcpu"], 2);
    assert_eq!(v["probes"], 40);
    let (lo, hi) = (
        v["bound_lo"].as_i64().unwrap(),
        v["bound_hi"].as_i64().unwrap(),
    );
    assert!(
        lo <= skew && skew <= hi,
        "truth {skew} outside [{lo}, {hi}]"
    );
    let stats = agent.join().unwrap();
    assert!(stats.probes >= 40, "{stats:?}");
}

/// Tier 1: `vmtsync probe --json | head -c0`: stdout closed before the report is written is
/// not an error (exit 0, nothing on stderr), like any filter.
#[test]
fn cli_probe_into_a_closed_pipe_exits_0() {
    let (port, agent) = fake::spawn_tcp(SkewedClock { skew: 0, vcpu: 0 }).unwrap();
    let addr = format!("tcp:127.0.0.1:{port}");
    let mut guard = ChildGuard::new(
        vmtsync()
            .args(["probe", "--connect", &addr, "--json", "--probes", "8"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("vmtsync-cli starts"),
    );
    // Close the read end before vmtsync can write anything: its write fails with EPIPE.
    drop(guard.child().stdout.take());
    let mut stderr = Vec::new();
    std::io::Read::read_to_end(guard.child().stderr.as_mut().unwrap(), &mut stderr).unwrap();
    let status = guard.child().wait().unwrap();
    let out = Output {
        status,
        stdout: Vec::new(),
        stderr,
    };
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    assert!(agent.join().unwrap().probes >= 8);
}

/// Sends SIGINT to the guarded child by PID and waits (at most 10 s) for it to exit.
pub(crate) fn interrupt(guard: &mut ChildGuard) -> (Option<i32>, String) {
    let pid = libc::pid_t::try_from(guard.pid()).unwrap();
    // SAFETY: kill(2) on the PID of our own, not yet reaped, child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let end = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = guard.child().try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < end, "vmtsync ignored SIGINT for 10 s");
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(guard.child().stderr.as_mut().unwrap(), &mut err).unwrap();
    (status.code(), err)
}

/// Tier 1: SIGINT ends a one-shot `vmtsync probe` promptly with exit code 130, both in the
/// pause between probes (an hour-long --interval) and while retrying a connect (an hour-long
/// --connect-timeout). Before, the signal was swallowed until the interval had passed.
#[test]
fn cli_probe_sigint_exits_130_promptly() {
    let (port, _agent) = fake::spawn_tcp(SkewedClock { skew: 0, vcpu: 0 }).unwrap();
    let addr = format!("tcp:127.0.0.1:{port}");
    let spawn = |args: &[&str]| {
        ChildGuard::new(
            vmtsync()
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("vmtsync-cli starts"),
        )
    };
    let mut g = spawn(&[
        "probe",
        "--connect",
        &addr,
        "--probes",
        "4",
        "--interval",
        "3600000",
    ]);
    // Let it connect, greet and send its first probe; it then waits an hour for the next.
    std::thread::sleep(Duration::from_millis(500));
    let (code, err) = interrupt(&mut g);
    assert_eq!(code, Some(130), "stderr: {err}");
    assert_eq!(err, "vmtsync: interrupted\n");

    let scratch_dir = scratch("sigint");
    let addr = format!("unix:{}", scratch_dir.path().join("nobody.sock").display());
    let mut g = spawn(&["probe", "--connect", &addr, "--connect-timeout", "3600000"]);
    std::thread::sleep(Duration::from_millis(300));
    let (code, err) = interrupt(&mut g);
    assert_eq!(code, Some(130), "stderr: {err}");
    assert!(err.contains("interrupted while connecting"), "{err}");
}

/// Tier 1: nothing listening → exit 7 and a message that says what to check.
#[test]
fn cli_probe_without_an_agent_exits_7_with_a_clear_message() {
    let scratch_dir = scratch("noagent");
    let dir = scratch_dir.path();
    let sock = dir.join("nobody.sock");
    let addr = format!("unix:{}", sock.display());
    let out = run(
        &["probe", "--connect", &addr, "--connect-timeout", "300"],
        "",
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "stderr: {err}");
    assert!(err.starts_with("vmtsync: "), "{err}");
    assert!(err.contains("is the VM running"), "{err}");
    assert!(out.stdout.is_empty());
}

/// Tier 1: a sync file written by `vmtsync probe --continuous` is read back by `vmtsync
/// convert --sync`, which agrees exactly with the library and undoes the agent's skew within
/// the probe bounds; a vCPU without segments exits 4, a bad input line 5.
#[test]
fn cli_convert_sync_reads_what_cli_probe_continuous_wrote() {
    let skew = 123_456_789_i64;
    let scratch_dir = scratch("sync");
    let dir = scratch_dir.path();
    let file = dir.join("sync.jsonl");
    let (port, agent) = fake::spawn_tcp(SkewedClock { skew, vcpu: 0 }).unwrap();
    let addr = format!("tcp:127.0.0.1:{port}");
    let file_arg = file.to_str().unwrap();
    let out = run(
        &[
            "probe",
            "--connect",
            &addr,
            "--probes",
            "16",
            "--continuous",
            "--out",
            file_arg,
            "--rounds",
            "3",
            "--resync",
            "20",
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    agent.join().unwrap();
    let sync = SyncFile::read(&file).expect("a valid sync file");
    assert_eq!(sync.vcpus(), [0]);

    // Guest stamps the agent would have taken now: host TSC + skew.
    let (before, after) = (host_tsc_now().0, host_tsc_now().0 + 1_000_000);
    let guests: Vec<u64> = (0..50)
        .map(|i| before.wrapping_add_signed(skew) + i * 20_000)
        .collect();
    let input: String = guests.iter().map(|g| format!("{g}\n")).collect();
    let out = run(&["convert", "--sync", file_arg, "--vcpu", "0"], &input);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    let mut expect = Vec::new();
    convert_with_sync(&sync, 0, &mut input.as_bytes(), &mut expect, false).unwrap();
    assert_eq!(text(&out.stdout), text(&expect));
    // Each segment's offset is inside its probe bounds, which contain the skew, so the
    // conversion is off by at most the widest bound width.
    let width = sync
        .timeline(0)
        .unwrap()
        .records()
        .iter()
        .map(|s| s.offset_hi.abs_diff(s.offset_lo))
        .max()
        .unwrap();
    for (line, g) in text(&out.stdout).lines().zip(&guests) {
        let host: u64 = line.parse().unwrap();
        let exact = g.wrapping_add_signed(-skew);
        assert!(
            host.abs_diff(exact) <= width,
            "{g} -> {host}, exact {exact}, bound width {width}"
        );
        assert!(host + width >= before && host <= after + width);
    }

    let out = run(&["convert", "--sync", file_arg, "--vcpu", "5"], "1\n");
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("no segment for vCPU 5"));
    let out = run(&["convert", "--sync", file_arg, "--vcpu", "0"], "12x\n");
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    assert!(text(&out.stderr).starts_with("vmtsync: input line 1"));
}

/// Tier 2 prerequisites for the QEMU tests.
fn qemu_ready(test: &str) -> bool {
    require(test, have_kvm(), "/dev/kvm is not accessible read-write")
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
    let out = run(args, &input);
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
#[test]
fn qemu_software_skew_is_recovered_and_converted_back() {
    let test = "qemu_software_skew_is_recovered_and_converted_back";
    if !qemu_ready(test) || !truth_ready(test) {
        return;
    }
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
#[test]
fn qemu_kvm_mapping_from_debugfs_maps_agent_readings_into_their_brackets() {
    let test = "qemu_kvm_mapping_from_debugfs_maps_agent_readings_into_their_brackets";
    if !qemu_ready(test) || !truth_ready(test) {
        return;
    }
    let scratch_dir = scratch("kvm");
    let dir = scratch_dir.path();
    let (sock, com2) = (dir.join("com1.sock"), dir.join("com2.log"));
    let elf = agent_elf().expect("agent builds");
    let qemu = boot_qemu(&elf, &sock, &com2, "transport=uart exit=9");
    let pid = qemu.pid().to_string();
    // Hello first: by then QEMU has created its VM and vCPU.
    let mut s = session(&sock);
    let out = run(&["kvm", "--json", "--vm", &pid], "");
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
#[test]
fn qemu_killed_mid_probe_ends_vmtsync_with_a_clear_error() {
    let test = "qemu_killed_mid_probe_ends_vmtsync_with_a_clear_error";
    if !qemu_ready(test) {
        return;
    }
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
