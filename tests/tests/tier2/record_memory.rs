//! Tier 2: `vmtsync record --from-memory` (issue 16): the bundled agent with
//! `transport=none` runs its workload under QEMU microvm/KVM with no link at all; the host
//! reads its recorder out of QEMU's memory and places every event with KVM's debugfs mapping.
//!
//! The truth is read here, independently of the reader: KVM's mapping through
//! `vmtsync_tests::truth` (its own `std::fs` reads of debugfs), and the event sequence from
//! the agent's payloads. The agent runs unskewed (its clock is the raw TSC, which exact mode
//! needs); a skewed agent is refused with a clear error, also checked here.

use vmtsync_core::GuestTicks;
use vmtsync_tests::truth::truth_mapping;

use crate::util::{
    anchor_ready, boot_qemu, have_program, qemu_ready, scratch, text, trace_cmd, vm_ready, vmtsync,
};
use crate::util::{report_events, seq_of, u};
use vmtsync_tests::require;

crate::trials!(
    qemu_ready; record_from_memory_recovers_every_agent_event_with_its_exact_host_time;
    vm_ready; record_from_memory_refuses_a_skewed_guest_clock_in_exact_mode,
        record_from_memory_writes_what_it_read_when_the_vmm_exits;
    c_guest_ready; record_from_memory_recovers_every_c_guest_event_with_its_exact_host_time;
    validate_ready; record_from_memory_passes_validate_against_the_hosts_kvm_pio_exits;
);

/// [`vm_ready`] and gcc (the C guest).
fn c_guest_ready(test: &str) -> bool {
    vm_ready(test)
        && require(
            test,
            have_program("gcc"),
            "gcc is missing (apt-get install gcc, or cargo xtask setup)",
        )
}

/// [`anchor_ready`] and a host trace of `kvm_pio`.
fn validate_ready(test: &str) -> bool {
    anchor_ready(test) && crate::util::host_trace_ready(test, "kvm/kvm_pio")
}

/// The workload: events per second and how many (fewer than the agent's 16 Ki-record ring,
/// so its stop-when-full ring refuses none), and the beacon interval.
const RATE: u64 = 200_000;
const COUNT: u64 = 10_000;
const WORKLOAD_EVENT: u64 = 0x100;

/// Runs `vmtsync record --from-memory` against QEMU `pid` into `out`.
fn record_memory(pid: u32, out: &std::path::Path, format: &str) -> std::process::Output {
    let mut c = vmtsync();
    c.args([
        "record",
        "--from-memory",
        "--trust-raw-tsc",
        "--vm",
        &pid.to_string(),
        "--format",
        format,
    ])
    .args([
        "--events",
        &COUNT.to_string(),
        "--duration",
        "60",
        "--no-progress",
    ])
    .arg("--out")
    .arg(out);
    crate::util::guarded_output(&mut c, &[])
}

fn record_from_memory_recovers_every_agent_event_with_its_exact_host_time() {
    let test = "record_from_memory_recovers_every_agent_event_with_its_exact_host_time";
    let dir = scratch(test);
    // Recording starts while the guest boots: the reader waits for the header and drains
    // while the workload runs.
    let (mut guard, _sock) = boot_qemu(
        dir.path(),
        &format!("transport=none workload={RATE},{COUNT} beacons=100"),
    );
    let pid = guard.child().id();
    let jsonl = dir.path().join("events.jsonl");
    let o = record_memory(pid, &jsonl, "jsonl");
    let stderr = text(&o.stderr);
    assert!(o.status.success(), "record failed: {stderr}");
    println!("record --from-memory jsonl: {}", stderr.trim());
    assert!(stderr.contains("host time exact (KVM debugfs)"), "{stderr}");
    assert!(
        stderr.contains(&format!("recorded {COUNT} events")),
        "{stderr}"
    );
    // The truth: KVM's mapping of vCPU 0, read by the test itself after the run (the agent
    // never writes its TSC, so it held throughout; a change would show in the summary).
    let kvm = truth_mapping(pid, 0).expect("truth from debugfs");
    assert!(stderr.contains("across 0 mapping"), "{stderr}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&jsonl)
        .expect("jsonl written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len() as u64, COUNT, "every event recovered");
    for (i, v) in lines.iter().enumerate() {
        assert_eq!((u(v, "vcpu"), u(v, "id")), (0, WORKLOAD_EVENT), "{v}");
        assert_eq!(
            seq_of(v["payload"].as_str().unwrap()),
            i as u64,
            "event {i} in sequence: {v}"
        );
        let g = GuestTicks(u(v, "guest_tsc"));
        let lo = kvm.try_host_from_guest_ceil(g).expect("in range").0;
        let hi = kvm.try_host_from_guest_floor(g).expect("in range").0;
        assert_eq!(
            (u(v, "host_lo"), u(v, "host_hi")),
            (lo.min(hi), lo.max(hi)),
            "event {i}'s interval is KVM's exact inverse: {v}"
        );
        assert!(
            (lo.min(hi)..=lo.max(hi)).contains(&u(v, "host_tsc")),
            "event {i}'s host time: {v}"
        );
    }

    // The agent halted after its workload; its rings stay in QEMU's memory, so a second
    // reader drains the same records again, into trace.dat.
    let dat = dir.path().join("events.dat");
    let o = record_memory(pid, &dat, "trace-cmd");
    assert!(o.status.success(), "record failed: {}", text(&o.stderr));
    // The guest is done: this run's rate is the reader's own on a ring that is already full.
    println!(
        "record --from-memory trace-cmd (guest halted): {}",
        text(&o.stderr).trim()
    );
    let rep = trace_cmd(&["report", "-i", dat.to_str().unwrap()]);
    assert!(
        rep.status.success(),
        "trace-cmd report: {}",
        text(&rep.stderr)
    );
    let events = report_events(&rep);
    assert_eq!(events.len() as u64, COUNT, "every event in trace.dat");
    for (i, (_, seq)) in events.iter().enumerate() {
        assert_eq!(*seq, i as u64, "trace.dat event {i} in sequence");
    }
    // The other outputs go through the same writers: each is written whole.
    for (format, name) in [("perfetto", "events.pftrace"), ("ctf", "events.ctf")] {
        let path = dir.path().join(name);
        let o = record_memory(pid, &path, format);
        let stderr = text(&o.stderr);
        assert!(o.status.success(), "record --format {format}: {stderr}");
        assert!(
            stderr.contains(&format!("recorded {COUNT} events")),
            "{format}: {stderr}"
        );
        assert!(path.exists(), "{format}: {} written", path.display());
    }
    drop(guard);
}

fn record_from_memory_refuses_a_skewed_guest_clock_in_exact_mode() {
    let test = "record_from_memory_refuses_a_skewed_guest_clock_in_exact_mode";
    let dir = scratch(test);
    let (mut guard, _sock) = boot_qemu(
        dir.path(),
        &format!("transport=none workload={RATE},{COUNT} beacons=100 skew=1000,3,1"),
    );
    let pid = guard.child().id();
    let out = dir.path().join("skewed.jsonl");
    let o = record_memory(pid, &out, "jsonl");
    let stderr = text(&o.stderr);
    assert!(
        !o.status.success(),
        "a skewed clock must be refused: {stderr}"
    );
    assert!(stderr.contains("do not hold the raw TSC"), "{stderr}");
    assert!(!out.exists(), "no output for a refused recording");
    drop(guard);
}

/// The C guest's events (tests/c-guest/main.c): `events=N`, id 0x0C01, 8-byte sequence.
const C_EVENTS: u64 = 20_000;
const C_EVENT: u64 = 0x0C01;

fn record_from_memory_recovers_every_c_guest_event_with_its_exact_host_time() {
    use std::process::Stdio;
    use vmtsync_launch::agent::{Guest, guest_elf};
    use vmtsync_tests::ChildGuard;
    use vmtsync_tests::vmm::qemu::{self, Machine};

    let test = "record_from_memory_recovers_every_c_guest_event_with_its_exact_host_time";
    let elf = guest_elf(Guest::CGuest).expect("the C guest builds");
    let dir = scratch(test);
    // `hold`: the guest spins when done instead of ending QEMU, so its rings stay readable.
    let child = qemu::command(
        Machine::Microvm,
        &elf,
        &format!("events={C_EVENTS} hold"),
        &dir.path().join("com2.log"),
    )
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .expect("qemu starts");
    let mut guard = ChildGuard::new(child);
    let pid = guard.child().id();
    crate::util::wait_vcpu_thread(pid);
    let out = dir.path().join("c.jsonl");
    let mut c = vmtsync();
    c.args([
        "record",
        "--from-memory",
        "--trust-raw-tsc",
        "--vm",
        &pid.to_string(),
        "--format",
        "jsonl",
    ])
    .args([
        "--events",
        &C_EVENTS.to_string(),
        "--duration",
        "60",
        "--no-progress",
    ])
    .arg("--out")
    .arg(&out);
    let o = crate::util::guarded_output(&mut c, &[]);
    let stderr = text(&o.stderr);
    assert!(o.status.success(), "record failed: {stderr}");
    println!("record --from-memory (C guest): {}", stderr.trim());
    assert!(stderr.contains("host time exact (KVM debugfs)"), "{stderr}");
    assert!(stderr.contains("across 0 mapping"), "{stderr}");
    let kvm = truth_mapping(pid, 0).expect("truth from debugfs");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .expect("jsonl written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len() as u64, C_EVENTS, "every event recovered");
    for (i, v) in lines.iter().enumerate() {
        assert_eq!((u(v, "vcpu"), u(v, "id")), (0, C_EVENT), "{v}");
        assert_eq!(seq_of(v["payload"].as_str().unwrap()), i as u64, "{v}");
        let g = GuestTicks(u(v, "guest_tsc"));
        let lo = kvm.try_host_from_guest_ceil(g).expect("in range").0;
        let hi = kvm.try_host_from_guest_floor(g).expect("in range").0;
        assert_eq!(
            (u(v, "host_lo"), u(v, "host_hi")),
            (lo.min(hi), lo.max(hi)),
            "event {i}: {v}"
        );
    }
    drop(guard);
}

/// Workload steps of the validate run: each is event 0x100, an `out` to the port, an `in`
/// from it and event 0x101, so twice as many events (under the agent's 16 Ki ring).
const STEPS: u64 = 5_000;

fn record_from_memory_passes_validate_against_the_hosts_kvm_pio_exits() {
    use crate::causality::{PORT, run_validate};
    use crate::util::HostTrace;
    use crate::util::vcpu_thread;

    let test = "record_from_memory_passes_validate_against_the_hosts_kvm_pio_exits";
    let dir = scratch(test);
    // The host's record of the workload's exits, enabled before the VM boots so the k-th
    // `out` in it is step k; a buffer large enough that none is overwritten.
    let mut trace = HostTrace::start("record-memory", "kvm/kvm_pio");
    trace.buffer_kb(8192);
    trace
        .instance()
        .set_filter("kvm/kvm_pio", &format!("port == {PORT}"))
        .unwrap();
    trace.instance().enable("kvm/kvm_pio").unwrap();
    let (mut guard, _sock) = boot_qemu(
        dir.path(),
        &format!("transport=none workload=20000,{STEPS},{PORT} beacons=1000"),
    );
    let pid = guard.child().id();
    let guest = dir.path().join("guest.jsonl");
    let mut c = vmtsync();
    c.args([
        "record",
        "--from-memory",
        "--trust-raw-tsc",
        "--vm",
        &pid.to_string(),
        "--format",
        "jsonl",
    ])
    .args(["--events", &(2 * STEPS).to_string(), "--duration", "60"])
    .arg("--no-progress")
    .arg("--out")
    .arg(&guest);
    let o = crate::util::guarded_output(&mut c, &[]);
    assert!(o.status.success(), "record failed: {}", text(&o.stderr));
    let thread = vcpu_thread(pid).expect("vcpu0's thread in debugfs");
    drop(guard);
    let host = dir.path().join("host.dat");
    trace.extract(&host);
    let before = format!("0x100:{PORT}");
    let after = format!("0x101:{PORT}");
    let thread = format!("0={thread}");
    let (code, v, err) = run_validate(&[
        "--host-trace",
        host.to_str().unwrap(),
        "--guest-trace",
        guest.to_str().unwrap(),
        "--thread",
        &thread,
        "--from-boot",
        "--before",
        &before,
        "--after",
        &after,
    ]);
    println!("validate of record --from-memory: {v}");
    assert_eq!(v["conversion"], "recorded", "{err}");
    // Every event checked: each step's 0x100 against its `out`, its 0x101 against its `in`.
    assert_eq!(
        (
            v["checked"].as_u64(),
            v["before_out"].as_u64(),
            v["after_in"].as_u64()
        ),
        (Some(2 * STEPS), Some(STEPS), Some(STEPS)),
        "every event checked: {v} {err}"
    );
    assert_eq!(
        (v["violations"].as_u64(), v["bound_violations"].as_u64()),
        (Some(0), Some(0)),
        "{v} {err}"
    );
    assert_eq!(code, Some(0), "{err}");
}

fn record_from_memory_writes_what_it_read_when_the_vmm_exits() {
    use std::io::Read as _;
    use std::process::Stdio;
    use std::time::Duration;
    use vmtsync_tests::ChildGuard;

    let test = "record_from_memory_writes_what_it_read_when_the_vmm_exits";
    let dir = scratch(test);
    // An endless workload: only the VMM's exit ends this recording.
    let (qemu, _sock) = boot_qemu(dir.path(), "transport=none workload=20000,0 beacons=100");
    let pid = qemu.pid();
    crate::util::wait_vcpu_thread(pid);
    // The truth, read while the VM runs (nothing changes it: the agent never writes its TSC).
    let kvm = truth_mapping(pid, 0).expect("truth from debugfs");
    let out = dir.path().join("events.jsonl");
    let mut rec = ChildGuard::new(
        vmtsync()
            .args([
                "record",
                "--from-memory",
                "--trust-raw-tsc",
                "--vm",
                &pid.to_string(),
            ])
            .args(["--format", "jsonl", "--duration", "60", "--no-progress"])
            .arg("--out")
            .arg(&out)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("vmtsync starts"),
    );
    // Once the reader streams events (JSON Lines go to `OUT.partial` as they are placed), it
    // has found the recorder: let it drain a while, then end QEMU (the guard kills it by PID
    // and reaps it).
    let partial = dir.path().join("events.jsonl.partial");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::fs::metadata(&partial).map_or(true, |m| m.len() == 0) {
        assert!(
            std::time::Instant::now() < deadline,
            "record --from-memory wrote no event within 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));
    drop(qemu);
    let mut pipe = rec.child().stderr.take().expect("stderr piped");
    let status = rec
        .wait_timeout(Duration::from_secs(30))
        .expect("waitpid")
        .expect("record ends within 30 s of the VMM's exit");
    let mut stderr = String::new();
    pipe.read_to_string(&mut stderr).unwrap();
    println!("record --from-memory, VMM killed: {}", stderr.trim());
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("ended by the VMM exiting"), "{stderr}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .expect("what was read is written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert!(!lines.is_empty(), "events were read: {stderr}");
    for (i, v) in lines.iter().enumerate() {
        assert_eq!(seq_of(v["payload"].as_str().unwrap()), i as u64, "{v}");
        let g = GuestTicks(u(v, "guest_tsc"));
        let host = kvm.try_host_from_guest_floor(g).expect("in range").0;
        assert_eq!((u(v, "host_lo"), u(v, "host_hi")), (host, host), "{v}");
    }
    assert!(
        stderr.contains(&format!("recorded {} events", lines.len())),
        "{stderr}"
    );
}
