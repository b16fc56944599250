//! Tier 2: the flight recorder read by a slow host (issue 16). The bundled agent with
//! `transport=none flight=1` (docs/memory-layout.md, mode 1) overwrites its ring's oldest
//! records; a host that reads too slowly misses some, and `vmtsync record --from-memory`
//! must say exactly how many.
//!
//! The guest runs with `beacons=0`, so its ring holds only workload events and record number
//! `n` is workload event `n`, whose payload is `n` (u64 LE): each delivered record's payload
//! names its position in the ring's sequence. The truth comes from outside the reader: the
//! ring's head (records the guest produced) and its slots, read by this test itself from
//! QEMU's `/proc/PID/mem` with the oracle of `memory_agent.rs` (written from the layout
//! document alone), and each record's exact host time from KVM's debugfs
//! (`vmtsync_tests::truth`).

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_tests::ChildGuard;
use vmtsync_tests::truth::truth_mapping;

use crate::memory_agent::{Booted, boot_and_find, find_headers, le64, read_at};
use crate::util::{boot_qemu, exact_host, read_jsonl, scratch, seq_of, u, vm_ready, vmtsync};

crate::trials!(vm_ready;
    flight_recorder_read_late_counts_every_overwritten_record_exactly,
    flight_recorder_read_by_a_slow_host_counts_every_overwritten_record_exactly);

/// The agent's ring capacity with `transport=none` (guest-agent/src/main.rs, `MEM_RING`).
const CAPACITY: u64 = 16 * 1024;
/// The agent's workload event id (guest-agent/src/events.rs).
const WORKLOAD_EVENT: u64 = 0x100;

/// The ring's head (ring 0's first word): records the guest has produced.
fn head(b: &mut Booted) -> u64 {
    le64(
        &read_at(&mut b.mem, b.base + 128, 8).expect("ring header"),
        0,
    )
}

/// Waits until ring 0's head reaches `count` (the guest's finite workload is done; it then
/// halts), at most 300 s (the agent records a few thousand events/s under nested KVM, fewer
/// when another VM shares the two cores).
fn wait_head(b: &mut Booted, count: u64) {
    let end = Instant::now() + Duration::from_secs(300);
    loop {
        let h = head(b);
        assert!(h <= count, "head {h} beyond the workload's {count} records");
        if h == count {
            return;
        }
        assert!(
            Instant::now() < end,
            "the guest produced {h} of {count} records in 300 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Ring 0's newest `CAPACITY` records as the test reads them itself, after the guest halted:
/// (index, guest TSC, payload sequence) of each, checked committed with its own stamp, as
/// workload event `index` with length 8.
fn final_window(b: &mut Booted, head: u64) -> Vec<(u64, u64, u64)> {
    let slots = read_at(
        &mut b.mem,
        b.base + 256,
        usize::try_from(32 * CAPACITY).unwrap(),
    )
    .expect("slots");
    (head - CAPACITY..head)
        .map(|n| {
            let s = &slots[usize::try_from(32 * (n % CAPACITY)).unwrap()..][..32];
            let meta = le64(s, 0);
            assert_eq!(meta >> 25, n + 1, "record {n}'s stamp");
            assert_eq!(meta & (1 << 24), 0, "record {n} not busy");
            assert_eq!(
                (meta & 0xffff, (meta >> 16) & 0xff),
                (WORKLOAD_EVENT, 8),
                "record {n}"
            );
            (n, le64(s, 8), le64(s, 16))
        })
        .collect()
}

/// The reader's exact counts from its summary: (recorded, beacons, overwritten, corrupt).
fn counts(stderr: &str) -> (u64, u64, u64, u64) {
    let before = |word: &str| -> u64 {
        stderr
            .split(&format!(" {word}"))
            .next()
            .and_then(|s| s.rsplit([' ', '(']).next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no \"N {word}\" in the summary: {stderr}"))
    };
    let recorded = stderr
        .split("recorded ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no \"recorded N\" in the summary: {stderr}"));
    (
        recorded,
        before("beacons ("),
        before("overwritten,"),
        before("corrupt,"),
    )
}

/// Checks what the reader delivered against the guest's `produced` records, the reader's
/// counts and the test's own reading of the final ring window: the counts add up to the
/// records the guest produced, exactly; every delivered record is intact (vCPU 0, the
/// workload id, a payload naming a position `< produced`, positions strictly rising, the
/// guest TSC rising with them, the exact host time from debugfs); one that is still in the
/// final window equals its slot. Returns (delivered, overwritten).
fn check_delivered(
    lines: &[Value],
    stderr: &str,
    produced: u64,
    window: &[(u64, u64, u64)],
    kvm: &KvmTscMapping,
) -> (u64, u64) {
    let (recorded, beacons, overwritten, corrupt) = counts(stderr);
    assert_eq!(
        recorded,
        lines.len() as u64,
        "the summary's count: {stderr}"
    );
    assert_eq!((beacons, corrupt), (0, 0), "{stderr}");
    assert_eq!(
        recorded + overwritten,
        produced,
        "delivered + overwritten = the records the guest produced: {stderr}"
    );
    let mut last: Option<(u64, u64)> = None;
    for v in lines {
        assert_eq!((u(v, "vcpu"), u(v, "id")), (0, WORKLOAD_EVENT), "{v}");
        let n = seq_of(v["payload"].as_str().unwrap());
        let g = u(v, "guest_tsc");
        assert!(n < produced, "record {n} was never produced: {v}");
        if let Some((pn, pg)) = last {
            assert!(n > pn && g > pg, "record {n} after {pn}: {v}");
        }
        last = Some((n, g));
        let host = exact_host(kvm, g);
        assert_eq!(
            (u(v, "host_tsc"), u(v, "host_lo"), u(v, "host_hi")),
            (host, host, host),
            "record {n}'s exact host time: {v}"
        );
        if let Some(first) = window.first()
            && n >= first.0
        {
            let (index, tsc, seq) = window[usize::try_from(n - first.0).unwrap()];
            assert_eq!(
                (index, tsc, seq),
                (n, g, n),
                "record {n} as its slot holds it"
            );
        }
    }
    (recorded, overwritten)
}

/// `vmtsync record --from-memory --trust-raw-tsc --vm PID --format jsonl` and `extra`, as a
/// guarded child with stderr piped.
fn spawn_record(pid: u32, out: &Path, extra: &[&str]) -> ChildGuard {
    let child = vmtsync()
        .args(["record", "--from-memory", "--trust-raw-tsc", "--vm"])
        .arg(pid.to_string())
        .args(["--format", "jsonl", "--no-progress"])
        .args(extra)
        .arg("--out")
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("vmtsync starts");
    ChildGuard::new(child)
}

/// Tier 2: a host that starts reading only after the guest has lapped its flight-recorder
/// ring 6 times (and halted): the reader delivers exactly the newest `CAPACITY - 1` records
/// (the reading rule cannot trust the oldest slot of a full overwriting ring), each as the
/// ring's slot holds it, and counts every older one overwritten.
fn flight_recorder_read_late_counts_every_overwritten_record_exactly() {
    const COUNT: u64 = 6 * CAPACITY + 123;
    let dir = scratch("memory-flight-late");
    let mut b = boot_and_find(
        dir.path(),
        &format!("transport=none flight=1 workload=1000000,{COUNT} beacons=0"),
    );
    let mode = u32::from_le_bytes(b.header[48..52].try_into().unwrap());
    assert_eq!(mode, 1, "the header says overwrite mode");
    let pid = b.guard.pid();
    wait_head(&mut b, COUNT);
    let window = final_window(&mut b, COUNT);
    let kvm = truth_mapping(pid, 0).expect("truth from debugfs");
    let out = dir.path().join("late.jsonl");
    // The guest is done: a few seconds read everything there is.
    let spawned = Instant::now();
    let mut rec = spawn_record(pid, &out, &["--duration", "3"]);
    let mut pipe = rec.child().stderr.take().expect("stderr piped");
    let status = rec
        .wait_timeout(Duration::from_secs(60))
        .expect("waitpid")
        .expect("record ends");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut pipe, &mut stderr).unwrap();
    assert!(status.success(), "{stderr}");
    println!("flight recorder read late: {}", stderr.trim());
    // The first round read the whole ring; every round after it found nothing new and waited
    // `--poll-ms` (2 ms) first. So no ring was read again sooner than 2 ms after the round
    // before, and none later than the recording lasted.
    let reread = reread_ms(&stderr);
    assert!(
        (2.0..=spawned.elapsed().as_secs_f64() * 1e3).contains(&reread),
        "each ring read again within {reread} ms: {stderr}"
    );
    let lines = read_jsonl(&out);
    let (delivered, overwritten) = check_delivered(&lines, &stderr, COUNT, &window, &kvm);
    // The layout's reading rule trusts record n only while head < n + CAPACITY: at head =
    // n + CAPACITY an overwriting producer may be writing record n + CAPACITY into n's slot.
    // So of a full flight ring a reader takes the newest CAPACITY - 1 records, and counts the
    // oldest one (here intact, as the guest halted; the reader cannot know that) overwritten.
    assert_eq!(
        (delivered, overwritten),
        (CAPACITY - 1, COUNT - CAPACITY + 1),
        "the newest ring-full but its oldest slot delivered, the rest overwritten"
    );
    assert_eq!(
        seq_of(lines[0]["payload"].as_str().unwrap()),
        COUNT - CAPACITY + 1,
        "the oldest record the reading rule trusts comes first"
    );
}

/// The summary's longest wait between two reads of a ring, in ms.
fn reread_ms(stderr: &str) -> f64 {
    stderr
        .split("each ring read again within ")
        .nth(1)
        .and_then(|r| r.split(" ms").next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            panic!("no \"each ring read again within X ms\" in the summary: {stderr}")
        })
}

/// How long the slow host sleeps after a round that emptied the ring. Under nested KVM the
/// agent records a few thousand events/s (measured here: 338,703 in 60 s alone, about 2,200/s
/// beside another VM), so it produces at least two ring-fulls while the reader sleeps.
const POLL_MS: &str = "15000";

/// Tier 2: a slow host (`--poll-ms 15000`) reading while the guest produces 10 ring-fulls as
/// fast as it can. Once the guest's head reaches its workload's count (read by the test from
/// QEMU's memory), SIGINT ends it, and it reads what the guest stored until then: what it
/// delivered plus what it counts overwritten is exactly what the guest
/// produced; it did miss records (the guest lapped it); it read while the guest ran (it
/// delivered records older than the final ring window, which only a live reader can); and
/// every record it delivered is intact.
fn flight_recorder_read_by_a_slow_host_counts_every_overwritten_record_exactly() {
    const COUNT: u64 = 10 * CAPACITY;
    let dir = scratch("memory-flight-slow");
    let (mut guard, _sock) = boot_qemu(
        dir.path(),
        &format!("transport=none flight=1 workload=1000000,{COUNT} beacons=0"),
    );
    let pid = guard.pid();
    crate::util::wait_vcpu_thread(pid);
    let out = dir.path().join("slow.jsonl");
    // The reader waits for the header (up to 30 s) and drains while the guest produces.
    let mut rec = spawn_record(pid, &out, &["--poll-ms", POLL_MS, "--duration", "300"]);
    let mut mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("/proc/PID/mem");
    let end = Instant::now() + Duration::from_secs(30);
    let base = loop {
        let h = find_headers(pid, &mut mem);
        if let [one] = h[..] {
            break one;
        }
        assert!(h.len() <= 1 && Instant::now() < end, "headers {h:x?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut b = Booted {
        guard: std::mem::replace(&mut guard, ChildGuard(None)),
        mem,
        base,
        header: Vec::new(),
    };
    wait_head(&mut b, COUNT);
    // The guest is done; SIGINT now, while the reader most likely sleeps with a ring-full or
    // more waiting: it wakes at once, reads in rounds until it reaches the heads it saw at
    // the stop, and writes. (The JSON Lines stream to `OUT.partial` through a 256 KiB
    // buffer, so the test cannot watch the last record arrive.)
    let mut pipe = rec.child().stderr.take().expect("stderr piped");
    rec.signal(libc::SIGINT).unwrap();
    let status = rec
        .wait_timeout(Duration::from_secs(60))
        .expect("waitpid")
        .expect("the reader ends within 60 s of SIGINT");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut pipe, &mut stderr).unwrap();
    assert!(status.success(), "{stderr}");
    println!("flight recorder, slow host: {}", stderr.trim());
    let window = final_window(&mut b, COUNT);
    let kvm = truth_mapping(pid, 0).expect("truth from debugfs");
    let lines = read_jsonl(&out);
    let (delivered, overwritten) = check_delivered(&lines, &stderr, COUNT, &window, &kvm);
    assert!(
        overwritten > 0,
        "the guest lapped the slow reader: {stderr}"
    );
    let oldest = seq_of(lines[0]["payload"].as_str().unwrap());
    assert!(
        oldest < COUNT - CAPACITY,
        "the reader read while the guest ran (its oldest record {oldest} predates the final \
         window): {stderr}"
    );
    println!(
        "slow host: the guest produced {COUNT} records ({} ring-fulls); {delivered} delivered, \
         {overwritten} overwritten; oldest delivered {oldest}",
        COUNT / CAPACITY
    );
}
