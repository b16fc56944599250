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
    HostTrace, QemuAgent, anchor_ready, host_trace_ready, read_jsonl, scratch, seq_of, text, u,
    vm_ready, wait_vcpu_thread,
};

crate::trials!(
    vm_ready;
    minimal_kernel_console_and_events_share_com1;
    anchored_trace_ready;
    minimal_kernel_events_land_in_trace_cmd_on_the_host_timeline,
);

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
    report(&["report", how, "-i", dat.to_str().unwrap()])
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
