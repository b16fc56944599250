//! Tier 2: the C guest (`tests/c-guest/`) on two vCPUs. QEMU `-smp 2`: the BSP starts the
//! AP (INIT-SIPI-SIPI, `entry.S`'s real-mode trampoline), each vCPU records `events=N` events
//! and its beacons on its own ring of the one recorder, in ring 3, and the guest prints one
//! line per vCPU on COM1. `vmtsync record --from-memory --trust-raw-tsc` drains both rings
//! into trace.dat; `trace-cmd report` must show every event of both vCPUs, each vCPU's on its
//! own trace CPU in sequence, as many as the guest says it recorded, and the reader must count
//! nothing lost (overwritten, refused or corrupt).

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use vmtsync_launch::agent::{Guest, guest_elf};
use vmtsync_tests::ChildGuard;
use vmtsync_tests::require;
use vmtsync_tests::truth::truth_mapping;
use vmtsync_tests::vmm::qemu::{self, Machine};

use crate::util::{
    count_before, have_program, have_trace_cmd, report_cpu_ts, scratch, seq_of, text, trace_cmd,
    vm_ready, vmtsync, wait_vcpu_thread,
};

crate::trials!(c_guest_smp_ready; c_guest_on_two_vcpus_records_both_rings_into_trace_dat);

/// vCPUs, and events each records (under the built-in 32 Ki-record stop-when-full ring with
/// its beacons, so no ring refuses any).
const VCPUS: u32 = 2;
const EVENTS: u64 = 20_000;
const BEACONS: u64 = EVENTS / 1000 + 2;
/// The C guest's event id (tests/c-guest/main.c's `EVENT_ID`).
const EVENT_ID: &str = "id=3073 ";

/// [`vm_ready`], gcc (the guest is C) and trace-cmd.
fn c_guest_smp_ready(test: &str) -> bool {
    vm_ready(test)
        && require(
            test,
            have_program("gcc"),
            "gcc is missing (apt-get install gcc, or cargo xtask setup)",
        )
        && have_trace_cmd(test)
}

/// The value after `key ` in a line of the guest's.
fn field(line: &str, key: &str) -> Option<u64> {
    let mut words = line.split_whitespace();
    words.find(|w| *w == key)?;
    let v = words.next()?;
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

fn c_guest_on_two_vcpus_records_both_rings_into_trace_dat() {
    let test = "c_guest_on_two_vcpus_records_both_rings_into_trace_dat";
    let elf = guest_elf(Guest::CGuest).expect("the C guest builds");
    let dir = scratch(test);
    let com1 = dir.path().join("com1.log");
    // `hold`: the guest spins when done instead of ending QEMU, so its rings stay readable.
    let child = qemu::command_with_memory_smp(
        Machine::Microvm,
        &elf,
        &format!("events={EVENTS} hold"),
        &dir.path().join("com2.log"),
        qemu::DEFAULT_MEMORY_MIB,
        VCPUS,
    )
    .stdin(Stdio::null())
    .stdout(std::fs::File::create(&com1).expect("COM1 log"))
    .stderr(Stdio::null())
    .spawn()
    .expect("qemu starts");
    let guard = ChildGuard::new(child);
    let pid = guard.pid();
    wait_vcpu_thread(pid);

    let dat = dir.path().join("trace.dat");
    let total = EVENTS * u64::from(VCPUS);
    let o = crate::util::guarded_output(
        vmtsync()
            .args(["record", "--from-memory", "--trust-raw-tsc", "--vm"])
            .arg(pid.to_string())
            .args(["--format", "trace-cmd", "--events"])
            .arg(total.to_string())
            .args(["--duration", "60", "--no-progress", "--out"])
            .arg(&dat),
        &[],
    );
    let stderr = text(&o.stderr);
    assert!(o.status.success(), "record failed: {stderr}");
    println!(
        "record --from-memory (C guest, {VCPUS} vCPUs): {}",
        stderr.trim()
    );

    // The guest's own counts: one line per vCPU, then the summary line, within 60 s.
    let end = Instant::now() + Duration::from_secs(60);
    let out = loop {
        let out = std::fs::read_to_string(&com1).unwrap_or_default();
        if out.lines().any(|l| l.starts_with("c-guest: ")) && out.ends_with('\n') {
            break out;
        }
        assert!(Instant::now() < end, "no summary line on COM1: {out:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    // Truth from outside the reader: each vCPU's mapping by the test's own debugfs read, taken
    // while the VM still runs (trace CPU N is vCPU N's ring).
    let kvm: Vec<_> = (0..VCPUS)
        .map(|v| truth_mapping(pid, v).expect("truth from debugfs"))
        .collect();
    drop(guard);
    let summary = out
        .lines()
        .find(|l| l.starts_with("c-guest: "))
        .expect("the summary line");
    assert_eq!(field(summary, "vcpus"), Some(u64::from(VCPUS)), "{out}");
    assert_eq!(field(summary, "failed"), Some(0), "{out}");
    let mut recorded = BTreeMap::new();
    for v in 0..VCPUS {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("c-guest vcpu {v}:")))
            .unwrap_or_else(|| panic!("no line of vCPU {v} on COM1: {out}"));
        assert_eq!(field(line, "failed"), Some(0), "{line}");
        assert_eq!(field(line, "refused"), Some(0), "{line}");
        assert_eq!(field(line, "beacons"), Some(BEACONS), "{line}");
        recorded.insert(v as usize, field(line, "events").expect("events"));
    }
    assert_eq!(
        recorded.values().copied().collect::<Vec<_>>(),
        [EVENTS; VCPUS as usize],
        "{out}"
    );

    // The reader: every event, nothing lost.
    assert!(
        stderr.contains(&format!("vmtsync: recorded {total} events")),
        "{stderr}"
    );
    assert!(stderr.contains("host time exact (KVM debugfs)"), "{stderr}");
    assert!(
        stderr.contains(&format!("{VCPUS} vCPU ring(s)")),
        "{stderr}"
    );
    for what in [" overwritten, ", " refused, ", " corrupt"] {
        assert_eq!(count_before(&stderr, what), 0, "{what}: {stderr}");
    }
    // Whether the ring->vCPU claim moved any host time, against the test's own debugfs read:
    // with one mapping for every vCPU it cannot have.
    let one_mapping = kvm.windows(2).all(|w| w[0] == w[1]);
    let said = if one_mapping {
        "every vCPU had one TSC mapping in every round"
    } else {
        "were placed while the vCPUs' TSC mappings differed"
    };
    assert!(stderr.contains(said), "mappings {kvm:?}: {stderr}");

    // trace-cmd: each vCPU's events on its own CPU, in sequence, as many as it recorded.
    let r = trace_cmd(&["report", "-i", dat.to_str().expect("UTF-8 path")]);
    assert!(r.status.success(), "trace-cmd report: {}", text(&r.stderr));
    let mut seen: BTreeMap<usize, u64> = BTreeMap::new();
    for line in text(&r.stdout).lines().filter(|l| l.contains(EVENT_ID)) {
        let (cpu, _) = report_cpu_ts(line);
        let hex: String = line
            .split("payload=")
            .nth(1)
            .unwrap_or_else(|| panic!("no payload in {line}"))
            .split_whitespace()
            .collect();
        let next = seen.entry(cpu).or_insert(0);
        assert_eq!(
            seq_of(&hex[..16]),
            *next,
            "CPU {cpu} out of sequence: {line}"
        );
        *next += 1;
    }
    assert_eq!(
        seen, recorded,
        "trace-cmd's events per CPU against the guest's counts per vCPU"
    );

    // Every event at its exact host time: trace-cmd's guest TSC (`--raw-ts`) through the test's
    // debugfs read of its vCPU gives what trace-cmd shows as its time (`-t`, in the file's
    // TSC2NSEC nanoseconds; ticks without one), CPU by CPU in order.
    let t = vmtsync::formats::tracedat::reader::read_layout(&dat)
        .expect("trace.dat layout")
        .tsc2nsec();
    let per_cpu = |args: &[&str]| {
        let r = trace_cmd(args);
        assert!(r.status.success(), "trace-cmd report: {}", text(&r.stderr));
        let mut by: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
        for line in text(&r.stdout).lines().filter(|l| l.contains(EVENT_ID)) {
            let (cpu, ts) = report_cpu_ts(line);
            by.entry(cpu).or_default().push(ts);
        }
        by
    };
    let path = dat.to_str().expect("UTF-8 path");
    let raw = per_cpu(&["report", "--raw-ts", "-i", path]);
    let shown = per_cpu(&["report", "-t", "-i", path]);
    for (cpu, guest) in &raw {
        let host = &shown[cpu];
        assert_eq!(guest.len(), host.len(), "CPU {cpu}");
        for (k, (&g, &h)) in guest.iter().zip(host).enumerate() {
            let exact = crate::util::exact_host(&kvm[*cpu], g);
            assert_eq!(
                h,
                t.map_or(exact, |t| t.nanos(exact)),
                "CPU {cpu} event {k}: guest tick {g} at its exact host time {exact}"
            );
        }
    }
}
