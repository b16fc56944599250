//! Tier 2: `vmtsync record --from-memory` attached late (issue 24, defect 2). The bundled
//! agent (`transport=none`) runs its whole workload, beacons included, and halts; only then
//! does a beacon-mode reader attach. None of the beacons it reads can be bracketed (they were
//! emitted before its trace started), so no beacon segment exists:
//! - a raw-TSC guest's events are placed by KVM's mapping alone (width 0), said to be not
//!   verified, each at its exact host time by the truth (debugfs, read by the test itself);
//! - a skewed guest's events cannot be placed at all: the reader fails with exit code 10
//!   instead of writing an empty file with success.
//!
//! And a memory recording checked by `vmtsync validate` (defect 5) and read in seconds
//! (defect 4): `--sync-out` gives the segments it used, `--host-trace/--host-output` the host
//! copy, and trace-cmd's merged report shows both files in nanoseconds of the host's clock.

use vmtsync_core::GuestTicks;
use vmtsync_tests::truth::{Skew, truth_mapping};

use crate::util::{anchor_ready, boot_qemu, lines_of, scratch, seq_of, text, u, vmtsync};

crate::trials!(
    anchor_ready; late_attach_places_a_raw_tsc_guest_by_kvms_mapping,
        late_attach_fails_when_nothing_can_place_the_events;
    validate_ready; memory_recording_validates_and_reads_in_host_seconds;
);

/// [`anchor_ready`] and a host trace of `kvm_pio`.
fn validate_ready(test: &str) -> bool {
    anchor_ready(test) && crate::util::host_trace_ready(test, "kvm/kvm_pio")
}

/// The workload: events per second and how many (fewer than the agent's ring), a beacon
/// every 100.
const RATE: u64 = 200_000;
const COUNT: u64 = 2_000;

/// Runs `vmtsync record --from-memory` on QEMU `pid` with `extra` flags into JSON Lines
/// `out`, for `COUNT` events (bounded by a generous duration).
fn record(pid: u32, out: &std::path::Path, extra: &[&str]) -> std::process::Output {
    record_as(pid, out, "jsonl", extra, COUNT)
}

/// [`record`] in `format`, for `events` events.
fn record_as(
    pid: u32,
    out: &std::path::Path,
    format: &str,
    extra: &[&str],
    events: u64,
) -> std::process::Output {
    let mut c = vmtsync();
    c.args(["record", "--from-memory", "--vm", &pid.to_string()])
        .args(extra)
        .args(["--format", format, "--events", &events.to_string()])
        .args(["--duration", "60", "--no-progress", "--out"])
        .arg(out);
    crate::util::guarded_output(&mut c, &[])
}

fn late_attach_places_a_raw_tsc_guest_by_kvms_mapping() {
    let test = "late_attach_places_a_raw_tsc_guest_by_kvms_mapping";
    let dir = scratch(test);
    let (mut guard, _sock) = boot_qemu(
        dir.path(),
        &format!("transport=none workload={RATE},{COUNT} beacons=100"),
    );
    let pid = guard.child().id();
    // A first reader waits for the whole workload (exact mode needs no beacon), so the guest
    // has recorded everything and emitted every beacon before the one under test attaches.
    let first = record(pid, &dir.path().join("first.jsonl"), &["--trust-raw-tsc"]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let out = dir.path().join("late.jsonl");
    let o = record(pid, &out, &[]);
    let stderr = text(&o.stderr);
    println!("record --from-memory, late, beacon mode: {}", stderr.trim());
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("recorded {COUNT} events")),
        "{stderr}"
    );
    assert!(
        stderr.contains("not verified") && stderr.contains("0 bracketed by kvm_pio exits"),
        "the summary says how they were placed: {stderr}"
    );
    let kvm = truth_mapping(pid, 0).expect("truth from debugfs");
    let lines = lines_of(&out);
    assert_eq!(lines.len() as u64, COUNT, "every event recovered");
    for (i, v) in lines.iter().enumerate() {
        assert_eq!(seq_of(v["payload"].as_str().unwrap()), i as u64, "{v}");
        let exact = kvm
            .try_host_from_guest_floor(GuestTicks(u(v, "guest_tsc")))
            .expect("in range")
            .0;
        assert_eq!(
            (u(v, "host_tsc"), u(v, "host_lo"), u(v, "host_hi")),
            (exact, exact, exact),
            "event {i} at its exact host time, width 0: {v}"
        );
    }
    drop(guard);
}

fn late_attach_fails_when_nothing_can_place_the_events() {
    let test = "late_attach_fails_when_nothing_can_place_the_events";
    let dir = scratch(test);
    let skew = Skew::pick();
    let (mut guard, _sock) = boot_qemu(
        dir.path(),
        &format!(
            "transport=none workload={RATE},{COUNT} beacons=100 {}",
            skew.agent_option()
        ),
    );
    let pid = guard.child().id();
    // A first beacon-mode reader, attached while the guest boots, places the skewed events
    // by their beacons and waits for the whole workload.
    let first = record(pid, &dir.path().join("first.jsonl"), &[]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert_eq!(
        lines_of(&dir.path().join("first.jsonl")).len() as u64,
        COUNT
    );
    // Attached late, no beacon is bracketed and the header says clock 1: nothing places them.
    let o = record(pid, &dir.path().join("late.jsonl"), &[]);
    let stderr = text(&o.stderr);
    println!("record --from-memory, late, skewed: {}", stderr.trim());
    assert_eq!(o.status.code(), Some(10), "{stderr}");
    assert!(
        stderr.contains(&format!("read {COUNT} events"))
            && stderr.contains("could place none on the host timeline"),
        "{stderr}"
    );
    drop(guard);
}

/// Port round trips of the validate workload (an event before each `out`, one after each
/// `in`).
const STEPS: u64 = 2_000;

/// `[CPU] ns` of every line of `trace-cmd ARGS` that contains `what`.
fn report_lines(args: &[&str], what: &str) -> Vec<(String, u64)> {
    let o = crate::util::trace_cmd(args);
    assert!(
        o.status.success(),
        "trace-cmd {args:?}: {}",
        text(&o.stderr)
    );
    text(&o.stdout)
        .lines()
        .filter(|l| l.contains(what))
        .map(|l| (l.to_owned(), crate::util::report_cpu_ts(l).1))
        .collect()
}

fn memory_recording_validates_and_reads_in_host_seconds() {
    use crate::causality::{PORT, merged_order, run_validate, shifted};
    use crate::util::{HostTrace, vcpu_thread};
    use vmtsync::formats::tracedat::reader::read_layout;

    let test = "memory_recording_validates_and_reads_in_host_seconds";
    let dir = scratch(test);
    let path = |name: &str| dir.path().join(name);
    let s = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    // The host's exits of the workload port, from before the VM boots (the k-th `out` is
    // step k), in a buffer none of them overwrites.
    let mut trace = HostTrace::start("memory-drain", "kvm/kvm_pio");
    trace.buffer_kb(8192);
    trace
        .instance()
        .set_filter("kvm/kvm_pio", &format!("port == {PORT}"))
        .unwrap();
    trace.instance().enable("kvm/kvm_pio").unwrap();
    let (mut guard, _sock) = boot_qemu(
        dir.path(),
        &format!("transport=none workload=20000,{STEPS},{PORT} beacons=100"),
    );
    let pid = guard.child().id();
    let (guest, sync) = (path("guest.jsonl"), path("run.sync"));
    let o = record_as(
        pid,
        &guest,
        "jsonl",
        &["--trust-raw-tsc", "--sync-out", &s(&sync)],
        2 * STEPS,
    );
    let stderr = text(&o.stderr);
    println!("record --from-memory --sync-out: {}", stderr.trim());
    assert!(o.status.success(), "{stderr}");
    let thread = vcpu_thread(pid).expect("vcpu0's thread in debugfs");
    let host = path("host.dat");
    trace.extract(&host);
    // The guest halted after its workload; a second reader takes the same records into
    // trace.dat with the host trace's copy beside it, its beacons traced in the tracefs named.
    let tracefs = vmtsync::ftrace::find_tracefs(None, "kvm/kvm_pio").expect("tracefs");
    let (dat, host_out) = (path("guest.dat"), path("host_out.dat"));
    let o = record_as(
        pid,
        &dat,
        "trace-cmd",
        &[
            "--tracefs",
            &s(&tracefs),
            "--host-trace",
            &s(&host),
            "--host-output",
            &s(&host_out),
        ],
        2 * STEPS,
    );
    let stderr = text(&o.stderr);
    println!("record --from-memory --host-trace: {}", stderr.trim());
    assert!(o.status.success(), "{stderr}");
    drop(guard);

    // Both files carry the host's TSC2NSEC, trace-cmd's own dump shows it.
    let t = read_layout(&dat)
        .unwrap()
        .tsc2nsec()
        .expect("TSC2NSEC in the guest file");
    let t_host = read_layout(&host_out).unwrap().tsc2nsec();
    assert_eq!(t_host, Some(t), "the same conversion in both files");
    for f in [&dat, &host_out] {
        let d = crate::util::trace_cmd(&["dump", "--options", "-i", &s(f)]);
        assert!(
            text(&d.stdout).to_lowercase().contains("tsc2nsec"),
            "{}: {}",
            f.display(),
            text(&d.stdout)
        );
    }
    // Guest events in the merged report: each at trace-cmd's nanoseconds of its exact host
    // tick (KVM's mapping, as the JSON Lines give it).
    let host_tsc: std::collections::HashMap<(u64, u64), u64> = lines_of(&guest)
        .iter()
        .map(|v| {
            let seq = seq_of(v["payload"].as_str().unwrap());
            ((u(v, "id"), seq), u(v, "host_tsc"))
        })
        .collect();
    let merged = ["report", "-t", "-i", &s(&host_out), "-i", &s(&dat)];
    let events = report_lines(&merged, " event_data: ");
    assert_eq!(events.len() as u64, 2 * STEPS, "every event in the report");
    for (l, ns) in &events {
        let id = if l.contains("id=256 ") { 0x100 } else { 0x101 };
        let hex: String = l
            .split("payload=")
            .nth(1)
            .unwrap()
            .split_whitespace()
            .collect();
        let seq = seq_of(&hex[..16]);
        let tick = host_tsc[&(id, seq)];
        assert_eq!(*ns, t.nanos(tick), "host tick {tick} in ns: {l}");
    }
    // Host exits: the same conversion of their raw stamps.
    let exits = |args: &[&str]| -> Vec<u64> {
        report_lines(args, " kvm_pio: ")
            .into_iter()
            .filter(|(l, _)| l.contains(&format!("-{thread} ")))
            .map(|(_, ts)| ts)
            .collect()
    };
    let raw = exits(&["report", "-t", "--raw-ts", "-i", &s(&host_out)]);
    let ns = exits(&["report", "-t", "-i", &s(&host_out)]);
    assert_eq!(raw.len(), ns.len());
    assert!(raw.len() as u64 >= 2 * STEPS, "the workload's exits");
    for (r, n) in raw.iter().zip(&ns) {
        assert_eq!(*n, t.nanos(*r), "host exit at {r}");
    }
    // Interleaved in the right order: each before-event ahead of its `out`, each after-event
    // behind its `in` (exact points: none out of place).
    let ord = merged_order(&host_out, &dat, thread);
    let mut wrong = 0;
    for &(line, seq) in &ord.before {
        wrong += u64::from(
            ord.writes
                .get(usize::try_from(seq).unwrap())
                .is_some_and(|&w| line > w),
        );
    }
    for &(line, seq) in &ord.after {
        wrong += u64::from(
            ord.reads
                .get(usize::try_from(seq).unwrap())
                .is_some_and(|&r| line < r),
        );
    }
    assert_eq!(
        (ord.before.len() + ord.after.len(), wrong),
        (usize::try_from(2 * STEPS).unwrap(), 0),
        "merged order"
    );

    // validate with the recording's own sync file: 0 violations; shifted, caught.
    let validate = |sync: &std::path::Path| {
        run_validate(&[
            "--sync",
            &s(sync),
            "--host-trace",
            &s(&host),
            "--guest-trace",
            &s(&guest),
            "--thread",
            &format!("0={thread}"),
            "--from-boot",
            "--before",
            &format!("0x100:{PORT}"),
            "--after",
            &format!("0x101:{PORT}"),
        ])
    };
    let (code, v, err) = validate(&sync);
    println!("validate --sync (record's own): {v}");
    assert_eq!(v["checked"].as_u64(), Some(2 * STEPS), "{v} {err}");
    assert_eq!(v["violations"].as_u64(), Some(0), "{v} {err}");
    assert_eq!(code, Some(0), "{err}");
    for by in [-1_000_000i64, 1_000_000] {
        let bad = path(&format!("shifted{by}.sync"));
        shifted(&sync, &bad, by);
        let (code, v, err) = validate(&bad);
        println!(
            "validate --sync (shifted by {by}): {} violations of {}",
            v["violations"], v["checked"]
        );
        assert!(v["violations"].as_u64().unwrap_or(0) > 0, "{v} {err}");
        assert_eq!(code, Some(9), "{err}");
    }
}
