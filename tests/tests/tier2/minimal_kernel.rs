//! The minimal kernel (`tests/minimal-kernel/`, docs/embedding.md): a guest we did not write
//! as the agent, embedding vmtsync-core.
//!
//! Tier 1 counts its glue: the non-blank, non-comment lines between its `vmtsync-glue: begin`
//! and `vmtsync-glue: end` markers must be at most 30. Tier 2 boots it under QEMU microvm/KVM
//! twice. Once recorded with exit-anchored sync rounds into a trace.dat, read back with
//! trace-cmd itself: every event the kernel records is there (ids and sequence numbers), each
//! within the recording's guaranteed width of the truth, which comes from KVM's debugfs
//! mapping of the VM (the kernel applies no skew of its own), and `vmtsync validate` checks
//! each against the host kernel's stamps of the kernel's own port exits. Once with its console
//! and the protocol on one UART from its first byte: the text arrives byte for byte and no
//! event is lost. The ids, counts and texts below are the kernel's
//! (`tests/minimal-kernel/src/main.rs`); a change there that is not made here fails a test.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use vmtsync_core::{GuestTicks, HostTicks};
use vmtsync_launch::agent::{Guest, guest_elf};
use vmtsync_tests::truth::{GuestTruth, truth_mapping};
use vmtsync_tests::vmm::qemu::debug_exit_status;

use crate::causality::run_validate;
use crate::tracedat::{assert_dump_ok, report};
use crate::util::{
    HostTrace, QemuAgent, anchor_ready, exact_host, host_trace_ready, read_jsonl, scratch, seq_of,
    text, u, vm_ready, wait_vcpu_thread,
};

crate::trials!(
    vm_ready;
    minimal_kernel_console_and_events_share_com1;
    anchored_trace_ready;
    minimal_kernel_events_land_in_trace_cmd_on_the_host_timeline;
    memory_mode_ready;
    minimal_kernel_in_memory_mode_is_read_from_guest_memory_at_its_exact_host_times,
);

/// The memory-mode test's prerequisites: exit anchoring ([`anchor_ready`]: the recording
/// without `--trust-raw-tsc` places by beacons bracketed by `kvm_pio` exits) and trace-cmd.
fn memory_mode_ready(test: &str) -> bool {
    anchor_ready(test) && crate::util::have_trace_cmd(test)
}

/// The trace-cmd test's prerequisites: exit anchoring ([`anchor_ready`]) and a host trace of
/// `kvm:kvm_pio`.
fn anchored_trace_ready(test: &str) -> bool {
    anchor_ready(test) && host_trace_ready(test, "kvm/kvm_pio")
}

/// The kernel's request count, event ids, doorbell port and progress interval.
const REQUESTS: u64 = 1000;

const REQUEST_START: u64 = 0x51;

const REQUEST_DONE: u64 = 0x52;

const DOORBELL: &str = "0x2402";

const PROGRESS_EVERY: u64 = 250;

/// One event of `trace-cmd report`: (timestamp, id, sequence number from the payload).
fn events(dat: &Path, how: &str) -> Vec<(u64, u64, u64)> {
    report(&[
        "report",
        how,
        crate::util::TICKS[0],
        crate::util::TICKS[1],
        "-i",
        dat.to_str().unwrap(),
    ])
    .into_iter()
    .filter(|l| l.rest.starts_with("event_data:"))
    .map(|l| {
        let field = |k: &str| {
            l.rest
                .split(k)
                .nth(1)
                .unwrap_or_else(|| panic!("no {k} in {}", l.rest))
                .to_string()
        };
        let id = field("id=")
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let hex: String = field("payload=").split_whitespace().collect();
        (l.ts, id, seq_of(&hex[..16]))
    })
    .collect()
}

/// Checks that `got` holds every event the kernel records exactly once, as `(id, seq)` in
/// the kernel's order (one ring, one producer: a request's start before its done).
fn assert_every_event_once(got: &[(u64, u64)], what: &str) {
    let mut want: BTreeSet<(u64, u64)> = (0..REQUESTS)
        .flat_map(|s| [(REQUEST_START, s), (REQUEST_DONE, s)])
        .collect();
    for &(id, seq) in got {
        assert!(
            want.remove(&(id, seq)),
            "{what}: event {id:#x} #{seq} twice or unknown"
        );
    }
    assert!(want.is_empty(), "{what}: missing {want:?}");
    let order: Vec<(u64, u64)> = got.iter().map(|&(id, seq)| (seq, id)).collect();
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "{what}: events out of order"
    );
}

/// Ends the kernel's session with a second, short recording (the first kept the VM running
/// so the truth could be read from debugfs), which must find no event beyond the kernel's
/// 2,000, and waits for the kernel to end the VM through isa-debug-exit with 0.
fn shut_down(vm: &mut QemuAgent, dir: &Path, extra: &[&str]) {
    let rest = dir.join("rest.jsonl");
    let mut args = vec!["--connect", &vm.addr, "--out", rest.to_str().unwrap()];
    args.extend(["--format", "jsonl", "--duration", "1", "--timeout", "10000"]);
    args.push("--shutdown");
    args.extend_from_slice(extra);
    let end = crate::util::record(&args);
    assert_eq!(end.status.code(), Some(0), "{}", text(&end.stderr));
    assert_eq!(
        std::fs::read_to_string(&rest).unwrap(),
        "",
        "events beyond the kernel's {}",
        2 * REQUESTS
    );
    let status = vm
        .guard
        .wait_timeout(Duration::from_secs(20))
        .unwrap()
        .expect("the kernel ends the VM after the shutdown");
    assert_eq!(status.code(), Some(debug_exit_status(0)));
}

/// The text the kernel prints on COM1 (`tests/minimal-kernel/src/main.rs`): its boot log,
/// then a progress line every [`PROGRESS_EVERY`] requests.
fn console_text() -> String {
    let mut t = String::from("minimal-kernel: long mode, PVH start info ok\n");
    t.push_str(&format!(
        "minimal-kernel: {REQUESTS} requests, events {REQUEST_START:#x}/{REQUEST_DONE:#x}, \
         doorbell port {DOORBELL}\n"
    ));
    for n in (PROGRESS_EVERY..=REQUESTS).step_by(usize::try_from(PROGRESS_EVERY).unwrap()) {
        t.push_str(&format!("minimal-kernel: {n} requests done\n"));
    }
    t
}

/// Tier 2: the minimal kernel under QEMU microvm/KVM, its console and the protocol on one
/// UART. QEMU starts the guest only once `vmtsync record --console FILE` has connected, so
/// the recording sees COM1 from the kernel's first byte: FILE holds the kernel's boot log and
/// its progress lines (printed between frames while events drain) byte for byte, and the
/// JSON Lines hold every one of its 2,000 events, each interval holding its true host tick
/// (KVM debugfs, read while the VM runs).
fn minimal_kernel_console_and_events_share_com1() {
    let elf = guest_elf(Guest::MinimalKernel).expect("the minimal kernel builds");
    let dir = scratch("minimal-kernel-console");
    let mut vm = QemuAgent::boot_elf(&elf, dir.path(), true);
    let jsonl = dir.path().join("events.jsonl");
    let console = dir.path().join("console.txt");
    let n = 2 * REQUESTS;
    let out = vm.record(
        &jsonl,
        n,
        200,
        &["--format", "jsonl", "--console", console.to_str().unwrap()],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let truth = GuestTruth::new(
        truth_mapping(vm.guard.pid(), 0).expect("debugfs truth"),
        None,
    );
    let rest = dir.path().join("rest.txt");
    shut_down(&mut vm, dir.path(), &["--console", rest.to_str().unwrap()]);
    println!("minimal kernel, console on COM1: {}", stderr.trim());

    let got = std::fs::read(&console).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&got),
        console_text(),
        "the console text, byte for byte"
    );
    let lines = read_jsonl(&jsonl);
    let events: Vec<(u64, u64)> = lines
        .iter()
        .map(|v| (u(v, "id"), seq_of(v["payload"].as_str().unwrap())))
        .collect();
    assert_every_event_once(&events, "JSON Lines");
    let misses = lines
        .iter()
        .filter(|v| {
            let (g, lo, hi) = (u(v, "guest_tsc"), u(v, "host_lo"), u(v, "host_hi"));
            !truth.in_bracket(HostTicks(lo), GuestTicks(g), HostTicks(hi))
        })
        .count();
    assert_eq!(misses, 0, "intervals that miss the debugfs truth");
}

/// Tier 2: the minimal kernel under QEMU microvm/KVM, recorded by `vmtsync record` with sync
/// rounds exit-anchored on the VM's `kvm_pio` exits, into a trace.dat. trace-cmd 3.1.6 reads
/// it back: `dump -v` accepts it, `report --raw-ts` shows every event the kernel recorded
/// exactly once and in order, and `report -t` puts each within the recording's widest
/// guaranteed interval of its true host tick (KVM debugfs). The host kernel's own stamps of
/// the kernel's doorbell exits (a private tracefs instance, on from before boot) then check
/// the conversion event by event: `vmtsync validate --before 0x51:0x2402 --after
/// 0x52:0x2402` finds every event's exit and 0 violations.
fn minimal_kernel_events_land_in_trace_cmd_on_the_host_timeline() {
    let elf = guest_elf(Guest::MinimalKernel).expect("the minimal kernel builds");
    let dir = scratch("minimal-kernel");
    // The doorbell's exits, from before the VM boots (so the k-th `out` is request k), in a
    // buffer no run of this size overwrites.
    let mut trace = HostTrace::start("minimal-kernel", "kvm/kvm_pio");
    trace.buffer_kb(4096);
    trace
        .instance()
        .set_filter("kvm/kvm_pio", &format!("port == {DOORBELL}"))
        .unwrap();
    trace.instance().enable("kvm/kvm_pio").unwrap();
    let mut vm = QemuAgent::boot_elf(&elf, dir.path(), false);
    let thread = wait_vcpu_thread(vm.guard.pid());
    let dat = dir.path().join("guest.dat");
    let sync = dir.path().join("sync.jsonl");
    let n = 2 * REQUESTS;
    let pid = vm.guard.pid().to_string();
    let out = vm.record(
        &dat,
        n,
        200,
        &[
            "--anchor",
            "kvm-pio",
            "--vm",
            &pid,
            "--sync-out",
            sync.to_str().unwrap(),
        ],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let truth = GuestTruth::new(
        truth_mapping(vm.guard.pid(), 0).expect("debugfs truth"),
        None,
    );
    shut_down(&mut vm, dir.path(), &[]);
    let host = dir.path().join("host.dat");
    trace.extract(&host);
    println!("minimal kernel recorded: {}", stderr.trim());

    assert_dump_ok(&dat);
    let raw = events(&dat, "--raw-ts");
    let host_times = events(&dat, "-t");
    assert_eq!(raw.len() as u64, n, "{stderr}");
    assert_eq!(host_times.len(), raw.len());
    let ids: Vec<(u64, u64)> = raw.iter().map(|&(_, id, seq)| (id, seq)).collect();
    assert_every_event_once(&ids, "trace-cmd report");
    assert!(raw.windows(2).all(|w| w[0].0 <= w[1].0), "raw TSCs go back");

    // The truth's rate is 1 (no TSC scaling, no skew), so a sound recording keeps identity
    // segments: raw guest TSCs plus TIME_SHIFT, which trace-cmd applies itself.
    assert!(
        !stderr.contains("pre-converted"),
        "identity truth but pre-converted: {stderr}"
    );
    let max_width: u64 = stderr
        .split("max ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.trim_end_matches(',').parse().ok())
        .unwrap_or_else(|| panic!("summary without widths: {stderr}"));
    let exact = truth.composed().expect("truth composes");
    let mut far = 0;
    let mut worst = 0;
    for (&(g, id, seq), &(h, id2, seq2)) in raw.iter().zip(&host_times) {
        assert_eq!((id, seq), (id2, seq2), "the same event in both reports");
        let t = exact
            .try_host_from_guest_ceil(GuestTicks(g))
            .expect("maps")
            .0;
        worst = worst.max(h.abs_diff(t));
        if h.abs_diff(t) > max_width {
            far += 1;
        }
    }
    println!(
        "trace-cmd: {} events, worst |host - truth| {worst} ticks, widest interval {max_width}",
        raw.len()
    );
    assert_eq!(far, 0, "trace-cmd host times beyond the guaranteed width");

    let before = format!("{REQUEST_START:#x}:{DOORBELL}");
    let after = format!("{REQUEST_DONE:#x}:{DOORBELL}");
    let thread = format!("0={thread}");
    let (code, v, err) = run_validate(&[
        "--sync",
        sync.to_str().unwrap(),
        "--host-trace",
        host.to_str().unwrap(),
        "--guest-trace",
        dat.to_str().unwrap(),
        "--before",
        &before,
        "--after",
        &after,
        "--thread",
        &thread,
        "--from-boot",
    ]);
    println!("validate --before {before} --after {after}: {v}");
    assert_eq!(code, Some(0), "{err} {v}");
    assert_eq!(v["checked"].as_u64(), Some(n), "{v}");
    assert_eq!(
        (v["violations"].as_u64(), v["bound_violations"].as_u64()),
        (Some(0), Some(0)),
        "{v}"
    );
}

/// The kernel's memory mode (`tests/minimal-kernel/src/memory.rs`): events between its sync
/// beacons, its beacon port, and its console lines of that mode.
const MEMORY_BEACON_EVERY: u64 = 100;

const MEMORY_BEACON_PORT: &str = "0x2400";

/// The console text of the kernel in memory mode: its boot log, the mode's line, the
/// application's progress lines, and its own count of events and beacons at the end (one
/// beacon before the first event, one after every [`MEMORY_BEACON_EVERY`], one after the last
/// unless it just had one).
fn memory_console_text() -> String {
    let mut t = String::from("minimal-kernel: long mode, PVH start info ok\n");
    t.push_str(&format!(
        "minimal-kernel: {REQUESTS} requests, events {REQUEST_START:#x}/{REQUEST_DONE:#x}, \
         doorbell port {DOORBELL}\n"
    ));
    t.push_str(&format!(
        "minimal-kernel: memory mode, recorder published, a beacon on port \
         {MEMORY_BEACON_PORT} every {MEMORY_BEACON_EVERY} events\n"
    ));
    for n in (PROGRESS_EVERY..=REQUESTS).step_by(usize::try_from(PROGRESS_EVERY).unwrap()) {
        t.push_str(&format!("minimal-kernel: {n} requests done\n"));
    }
    let beacons = 1 + (2 * REQUESTS).div_ceil(MEMORY_BEACON_EVERY);
    t.push_str(&format!(
        "minimal-kernel: memory mode done, {} events, {beacons} beacons; halting\n",
        2 * REQUESTS
    ));
    t
}

/// Waits (at most 20 s) until KVM debugfs lists vCPU 0 of QEMU `pid`'s VM (`vmtsync kvm`):
/// a VM started with `-S` has its vCPUs before it runs them (their threads show only then).
pub(crate) fn wait_paused_vcpu(pid: u32) {
    let end = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let o = crate::util::guarded_output(
            crate::util::vmtsync().args(["kvm", "--json", "--vm", &pid.to_string()]),
            b"",
        );
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        if v["vms"][0]["vcpus"][0].is_object() {
            return;
        }
        assert!(
            std::time::Instant::now() < end,
            "vCPU 0 of QEMU {pid} never appeared in KVM debugfs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `vmtsync record --from-memory --vm PID --format FORMAT` and `extra` of the kernel's events
/// into `out`, as a child whose stderr goes to `out.stderr`.
fn spawn_memory_record(
    pid: u32,
    out: &Path,
    format: &str,
    extra: &[&str],
) -> vmtsync_tests::ChildGuard {
    let err = std::fs::File::create(out.with_extension("stderr")).unwrap();
    let child = crate::util::vmtsync()
        .args(["record", "--from-memory", "--vm", &pid.to_string()])
        .args(["--events", &(2 * REQUESTS).to_string(), "--duration", "60"])
        .args(["--no-progress", "--format", format])
        .args(extra)
        .arg("--out")
        .arg(out)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(err)
        .spawn()
        .expect("vmtsync starts");
    vmtsync_tests::ChildGuard::new(child)
}

/// Waits for a [`spawn_memory_record`] child; its success and stderr.
fn wait_memory_record(mut rec: vmtsync_tests::ChildGuard, out: &Path) -> (bool, String) {
    let status = rec
        .wait_timeout(Duration::from_secs(90))
        .expect("waitpid")
        .expect("record --from-memory ends within 90 s");
    let stderr = std::fs::read_to_string(out.with_extension("stderr")).unwrap();
    (status.success(), stderr)
}

/// Tier 2: the minimal kernel in memory mode (`memory` on its command line) under QEMU
/// microvm/KVM, started paused (`-S`) so both readers below run before its first
/// instruction, then resumed over QMP. `record --from-memory --trust-raw-tsc` recovers every
/// one of its 2,000 events exactly once and in order, each at its exact host time from
/// KVM's debugfs (read here), and sees the beacons the kernel's own console counts; the
/// console (COM1, QEMU's stdout) holds the kernel's own text byte for byte. The same
/// recording without `--trust-raw-tsc` succeeds with every event's [host_lo, host_hi] holding
/// its exact host time (placement by beacons bracketed by `kvm_pio` exits) and that time as
/// its point.
/// A last reader, after the kernel halted, writes a trace.dat that `trace-cmd report` reads
/// back: every event, each at its exact host time.
fn minimal_kernel_in_memory_mode_is_read_from_guest_memory_at_its_exact_host_times() {
    use std::process::Stdio;
    use vmtsync_tests::vmm::qemu::{self, Machine};

    let elf = guest_elf(Guest::MinimalKernel).expect("the minimal kernel builds");
    let dir = scratch("minimal-kernel-memory");
    let console = dir.path().join("console.txt");
    let qmp = dir.path().join("qmp.sock");
    let child = qemu::command(
        Machine::Microvm,
        &elf,
        "memory",
        &dir.path().join("com2.log"),
    )
    .args(qemu::paused_with_qmp(&qmp))
    .stdin(Stdio::null())
    .stdout(std::fs::File::create(&console).unwrap())
    .stderr(Stdio::null())
    .spawn()
    .expect("qemu starts");
    let guard = vmtsync_tests::ChildGuard::new(child);
    let pid = guard.pid();
    wait_paused_vcpu(pid);
    let exact_out = dir.path().join("exact.jsonl");
    let loose_out = dir.path().join("beacons.jsonl");
    let exact = spawn_memory_record(pid, &exact_out, "jsonl", &["--trust-raw-tsc"]);
    let loose = spawn_memory_record(pid, &loose_out, "jsonl", &[]);
    qemu::qmp_cont(&qmp, Duration::from_secs(20)).expect("QEMU resumes");
    let (ok, stderr) = wait_memory_record(exact, &exact_out);
    assert!(ok, "record --from-memory --trust-raw-tsc: {stderr}");
    println!(
        "minimal kernel, memory mode, --trust-raw-tsc: {}",
        stderr.trim()
    );
    let (loose_ok, loose_stderr) = wait_memory_record(loose, &loose_out);
    // The truth: KVM's mapping of vCPU 0 (the kernel never writes its TSC; the summary says
    // whether the mapping changed while the reader ran).
    let kvm = truth_mapping(pid, 0).expect("debugfs truth");
    assert!(stderr.contains("host time exact (KVM debugfs)"), "{stderr}");
    assert!(stderr.contains("across 0 mapping"), "{stderr}");
    assert!(
        stderr.contains(&format!("recorded {} events", 2 * REQUESTS)),
        "{stderr}"
    );

    let lines = read_jsonl(&exact_out);
    let ids: Vec<(u64, u64)> = lines
        .iter()
        .map(|v| (u(v, "id"), seq_of(v["payload"].as_str().unwrap())))
        .collect();
    assert_every_event_once(&ids, "record --from-memory --trust-raw-tsc");
    for v in &lines {
        assert_eq!(u(v, "vcpu"), 0, "{v}");
        let host = exact_host(&kvm, u(v, "guest_tsc"));
        assert_eq!(
            (u(v, "host_tsc"), u(v, "host_lo"), u(v, "host_hi")),
            (host, host, host),
            "the exact host time from debugfs: {v}"
        );
    }

    // The kernel's own console, complete once it printed its count and halted.
    let want = memory_console_text();
    let end = std::time::Instant::now() + Duration::from_secs(30);
    let got = loop {
        let got = std::fs::read_to_string(&console).unwrap();
        if got.len() >= want.len() || std::time::Instant::now() > end {
            break got;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(got, want, "the kernel's console, byte for byte");

    // Without --trust-raw-tsc: placement by beacons bracketed by the host's kvm_pio exits;
    // every interval holds the exact host time, and KVM's mapping gives every point.
    assert!(loose_ok, "record --from-memory by beacons: {loose_stderr}");
    println!(
        "minimal kernel, memory mode, by beacons: {}",
        loose_stderr.trim()
    );
    assert!(
        loose_stderr.contains("host time exact points (KVM debugfs) in intervals from the beacons")
            && loose_stderr.contains(" 0 disagree with KVM's mapping"),
        "{loose_stderr}"
    );
    let lines_b = read_jsonl(&loose_out);
    let ids: Vec<(u64, u64)> = lines_b
        .iter()
        .map(|v| (u(v, "id"), seq_of(v["payload"].as_str().unwrap())))
        .collect();
    assert_every_event_once(&ids, "record --from-memory by beacons");
    let misses: Vec<&serde_json::Value> = lines_b
        .iter()
        .filter(|v| {
            let host = exact_host(&kvm, u(v, "guest_tsc"));
            !(u(v, "host_lo") <= host && host <= u(v, "host_hi") && u(v, "host_tsc") == host)
        })
        .collect();
    assert!(
        misses.is_empty(),
        "{} intervals miss the exact host time (or points differ), first {}",
        misses.len(),
        misses[0]
    );

    // The kernel halted with its rings in QEMU's memory: a last reader writes a trace.dat.
    let dat = dir.path().join("events.dat");
    let rec = spawn_memory_record(pid, &dat, "trace-cmd", &["--trust-raw-tsc"]);
    let (ok, dat_stderr) = wait_memory_record(rec, &dat);
    assert!(ok, "record --from-memory --format trace-cmd: {dat_stderr}");
    println!("minimal kernel halted, trace-cmd: {}", dat_stderr.trim());
    // The kernel is done: this reader sees every beacon its console counts.
    let beacons = 1 + (2 * REQUESTS).div_ceil(MEMORY_BEACON_EVERY);
    assert!(
        dat_stderr.contains(&format!("; {beacons} beacons (")),
        "the reader saw the {beacons} beacons the kernel counts: {dat_stderr}"
    );
    drop(guard);
    assert_dump_ok(&dat);
    let host_times = events(&dat, "-t");
    let ids: Vec<(u64, u64)> = host_times.iter().map(|&(_, id, seq)| (id, seq)).collect();
    assert_every_event_once(&ids, "trace-cmd report");
    for (&(ts, id, seq), v) in host_times.iter().zip(&lines) {
        assert_eq!(
            (id, seq),
            (u(v, "id"), seq_of(v["payload"].as_str().unwrap()))
        );
        assert_eq!(
            ts,
            exact_host(&kvm, u(v, "guest_tsc")),
            "trace-cmd's host time of {id:#x} #{seq}"
        );
    }
    println!(
        "trace-cmd report: {} events, each at its exact host time",
        host_times.len()
    );
}
