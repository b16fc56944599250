//! Causality on the merged timeline (tier 2): the real agent under QEMU records an event right
//! before each `out` to a workload port and right after the `in` that follows; the host traces
//! those exits (`kvm:kvm_pio`, `x86-tsc`) in a private tracefs instance; `vmtsync record`
//! (exit-anchored sync rounds) writes the guest trace.dat and its sync file. Truth comes from
//! the host kernel's exit stamps, not from vmtsync: in `trace-cmd report -i host -i guest`,
//! every before-event must precede its `out` and every after-event follow its `in`; and
//! `vmtsync validate` must agree (zero violations, on the events and on the sync probes
//! `record --probe-log` logged, paired with their own UART exits) and catch a sync file
//! shifted by one bracket width. Why the offset `record` writes decides this:
//! docs/validate.md.

use std::path::{Path, PathBuf};

use serde_json::Value;
use vmtsync::exits::DEFAULT_SYNC_PORT;
use vmtsync_tests::truth::{GuestTruth, Skew};

use crate::util::{HostTrace, QemuAgent, qemu_pio_trace_ready, text, trace_cmd, wait_vcpu_thread};
use crate::util::{guarded_output, vmtsync};

crate::trials!(
    qemu_pio_trace_ready;
    merged_report_puts_each_workload_event_on_the_right_side_of_its_exit,
    a_drifting_guest_keeps_every_bound_and_a_shift_is_caught,
);

/// The workload's port: unused on QEMU microvm (no floppy controller), so QEMU answers an
/// `in` with 0xff and ignores an `out`, both through a userspace exit `kvm_pio` stamps.
pub(crate) const PORT: &str = "0x3f0";
/// Events to record (before- and after-events together): the bar is 1,000.
const EVENTS: u64 = 1200;

/// Where each workload step and event sits in `trace-cmd report`'s merged order.
#[derive(Debug, Default)]
pub(crate) struct Order {
    /// Line index of the k-th `out` to the port (step k).
    pub(crate) writes: Vec<usize>,
    /// Line index of the k-th `in` from the port.
    pub(crate) reads: Vec<usize>,
    /// The low byte each `out` wrote.
    pub(crate) write_vals: Vec<u32>,
    /// (line index, seq) of before-events (id 256) and after-events (id 257).
    pub(crate) before: Vec<(usize, u64)>,
    pub(crate) after: Vec<(usize, u64)>,
}

/// Reads the merged report: host `kvm_pio` lines of vCPU thread `thread` (other tests' VMs
/// may run at the same time) and guest `event_data` lines, in order.
pub(crate) fn merged_order(host: &Path, guest: &Path, thread: u64) -> Order {
    // In ticks: the guest file's TSC2NSEC would put it in nanoseconds beside a raw host
    // extract's ticks (a 1 GHz `--ts2secs` makes both files ticks again).
    let o = trace_cmd(&[
        "report",
        crate::util::TICKS[0],
        crate::util::TICKS[1],
        "-i",
        host.to_str().unwrap(),
        "-i",
        guest.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "report: {}", text(&o.stderr));
    let mut ord = Order::default();
    // Each line is one event, in the merged order: "NAME:  COMM-PID [CPU] TS: EVENT: FIELDS".
    let stdout = String::from_utf8_lossy(&o.stdout);
    for (i, l) in stdout.lines().enumerate() {
        let field = |k: &str| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .map(str::to_owned)
        };
        if l.contains(" kvm_pio: ") && l.contains(&format!("at {PORT} ")) {
            // Only this VM's vCPU thread (the comm-pid column ends in "-PID ").
            if !l.contains(&format!("-{thread} ")) {
                continue;
            }
            if l.contains("pio_write") {
                ord.writes.push(i);
                let val = l.rsplit("val 0x").next().unwrap().trim();
                ord.write_vals.push(u32::from_str_radix(val, 16).unwrap());
            } else {
                ord.reads.push(i);
            }
        } else if l.contains(" event_data: ") {
            // payload=b0 b1 ...: the sequence number, u64 little-endian.
            let bytes: Vec<u8> = l
                .split("payload=")
                .nth(1)
                .unwrap_or("")
                .split_whitespace()
                .take(8)
                .map(|b| u8::from_str_radix(b, 16).unwrap())
                .collect();
            let Ok(le) = <[u8; 8]>::try_from(bytes.as_slice()) else {
                continue;
            };
            let seq = u64::from_le_bytes(le);
            match field("id=").as_deref() {
                Some("256") => ord.before.push((i, seq)),
                Some("257") => ord.after.push((i, seq)),
                _ => {}
            }
        }
    }
    ord
}

/// `vmtsync validate ARGS --json`: its exit code, JSON report and stderr.
pub(crate) fn run_validate(args: &[&str]) -> (Option<i32>, Value, String) {
    let o = guarded_output(vmtsync().arg("validate").args(args).arg("--json"), b"");
    let v = serde_json::from_slice(&o.stdout).unwrap_or(Value::Null);
    (o.status.code(), v, text(&o.stderr))
}

/// `vmtsync validate` of the run's workload events and its sync probes (`--probe-log`).
fn validate(sync: &Path, run: &Run) -> (Option<i32>, Value, String) {
    validate_placed(sync, run, "two-sided")
}

/// [`validate`] with `--placement HOW`.
fn validate_placed(sync: &Path, run: &Run, how: &str) -> (Option<i32>, Value, String) {
    run_validate(&[
        "--placement",
        how,
        "--sync",
        sync.to_str().unwrap(),
        "--host-trace",
        run.host.to_str().unwrap(),
        "--guest-trace",
        run.guest.to_str().unwrap(),
        "--port",
        PORT,
        "--probe-log",
        run.probes.to_str().unwrap(),
        "--thread",
        &format!("0={}", run.thread),
        // The host trace began before the VM: pair by position, not through the sync.
        "--from-boot",
    ])
}

/// A copy of the sync file at `from` with every segment's offset (and its bounds) moved by
/// `by` ticks, the line through the anchor moved with it.
pub(crate) fn shifted(from: &Path, to: &Path, by: i64) {
    let mut out = String::new();
    for line in std::fs::read_to_string(from).unwrap().lines() {
        let mut v: Value = serde_json::from_str(line).unwrap();
        if v["type"] == "segment" {
            for k in ["offset", "offset_lo", "offset_hi"] {
                v[k] = (v[k].as_i64().unwrap() + by).into();
            }
            v["guest_anchor"] = (v["guest_anchor"]
                .as_u64()
                .unwrap()
                .checked_add_signed(by)
                .unwrap())
            .into();
        }
        out.push_str(&v.to_string());
        out.push('\n');
    }
    std::fs::write(to, out).unwrap();
}

/// One recording: the host's `kvm_pio` trace of the port (from before boot), the guest's
/// recording in `format`, the sync file `record` used, the vCPU thread.
pub(crate) struct Run {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) host: PathBuf,
    pub(crate) guest: PathBuf,
    pub(crate) sync: PathBuf,
    /// Every sync probe `record` used (`--probe-log`).
    pub(crate) probes: PathBuf,
    pub(crate) thread: u64,
    /// The guest's true clock: KVM debugfs (read while the VM ran) under the agent's skew.
    pub(crate) truth: GuestTruth,
}

/// Boots the agent with `skew` and the workload, records `EVENTS` events in `format` with
/// exit-anchored sync rounds, and extracts the host's trace of the workload port. Its tests'
/// gate is [`qemu_pio_trace_ready`].
pub(crate) fn recorded_run(purpose: &str, skew: &Skew, format: &str) -> Run {
    let dir = tempfile::Builder::new()
        .prefix(&format!("vmtsync-{purpose}-"))
        .tempdir()
        .unwrap();
    // The host's record of the workload's exits: enabled before the VM boots, so the k-th
    // `out` in it is step k; a buffer large enough that no exit is overwritten. The UART's
    // exits too (its data port and status registers) and the agent's default sync port, for
    // the sync probes' own brackets.
    let mut trace = HostTrace::start(purpose, "kvm/kvm_pio");
    trace.buffer_kb(8192);
    trace
        .instance()
        .set_filter(
            "kvm/kvm_pio",
            &format!(
                "port == {PORT} || (port >= 0x3f8 && port <= 0x3ff) || port == {DEFAULT_SYNC_PORT:#x}"
            ),
        )
        .unwrap();
    trace.instance().enable("kvm/kvm_pio").unwrap();
    let append = format!(
        "transport=uart exit=0 workload=400,0,{PORT} {}",
        skew.agent_option()
    );
    let vm = QemuAgent::boot(dir.path(), &append);
    let thread = wait_vcpu_thread(vm.guard.pid());
    let truth = GuestTruth::read(vm.guard.pid(), 0, Some(*skew)).expect("truth from debugfs");
    let guest = dir.path().join(if format == "jsonl" {
        "guest.jsonl"
    } else {
        "guest.dat"
    });
    let sync = dir.path().join("sync.jsonl");
    let probes = dir.path().join("probes.jsonl");
    let pid = vm.guard.pid().to_string();
    let out = vm.record(
        &guest,
        EVENTS,
        500,
        &[
            "--format",
            format,
            "--sync-out",
            sync.to_str().unwrap(),
            "--probe-log",
            probes.to_str().unwrap(),
            "--anchor",
            "kvm-pio",
            "--vm",
            &pid,
        ],
    );
    assert_eq!(out.status.code(), Some(0), "record: {}", text(&out.stderr));
    drop(vm);
    let host = dir.path().join("host.dat");
    trace.extract(&host);
    Run {
        dir,
        host,
        guest,
        sync,
        probes,
        thread,
        truth,
    }
}

/// The sync file's segments; each must be exit-anchored, by the sync port the agent enables
/// without a boot option (the tight path by default).
pub(crate) fn anchored_segments(sync: &Path) -> Vec<Value> {
    let segments: Vec<Value> = std::fs::read_to_string(sync)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &Value| v["type"] == "segment")
        .collect();
    assert!(!segments.is_empty());
    assert!(
        segments.iter().all(|s| s["anchor"] == "kvm-pio-sync-port"),
        "{segments:?}"
    );
    segments
}

/// `validate` on the run, events and sync probes: no false bound ever, every probe paired
/// with its exits, and (when `exact` says the estimate must pass too) no violation; the sync
/// file shifted either way by more than a round's width and the events' distance from their
/// exits must do strictly worse on both (exit 9).
/// Returns the run's event violations.
fn validate_and_catch_a_shift(test: &str, run: &Run, segments: &[Value], exact: bool) -> u64 {
    let (code, v, err) = validate(&run.sync, run);
    eprintln!("{test}: validate: {v}");
    assert!(v["checked"].as_u64().unwrap() >= 1000, "{v} {err}");
    assert_eq!(
        v["bound_violations"], 0,
        "a guaranteed interval missed its exit: {v}"
    );
    let p = &v["probes"];
    assert!(p["checked"].as_u64().unwrap() >= 64, "{v} {err}");
    assert_eq!(
        p["checked"], p["logged"],
        "a sync probe without its exits: {v}"
    );
    assert_eq!(
        p["bound_violations"], 0,
        "a guaranteed interval missed a probe's exits: {v}"
    );
    let violations = v["violations"].as_u64().unwrap();
    let probe_violations = p["violations"].as_u64().unwrap();
    if exact {
        assert_eq!(code, Some(0), "validate: {err}");
        assert_eq!((violations, probe_violations), (0, 0));
    } else {
        eprintln!(
            "{test}: {probe_violations} of {} sync probes on the wrong side of their exits (reported, not a bar)",
            p["checked"]
        );
    }
    let width = segments
        .iter()
        .map(|s| s["offset_hi"].as_i64().unwrap() - s["offset_lo"].as_i64().unwrap())
        .max()
        .unwrap();
    // A shift must also exceed how far the events sit from their own exits (validate's lags,
    // 99th percentile): in ring 0, the agent's default, the workload's instructions between an
    // event and its exit run emulated, and that distance outgrows a round's width.
    let lag = ["lag_before_out", "lag_after_in"]
        .iter()
        .map(|k| v[*k]["p99"].as_i64().unwrap())
        .max()
        .unwrap();
    let by = width.max(lag) + 1;
    for by in [by, -by] {
        let bad = run.dir.path().join(format!("shifted{by}.jsonl"));
        shifted(&run.sync, &bad, by);
        let (code, v, err) = validate(&bad, run);
        assert_eq!(code, Some(9), "shifted by {by}: {err} {v}");
        assert!(
            v["violations"].as_u64().unwrap() > violations,
            "shifted by {by}: {v}"
        );
        assert!(
            v["probes"]["violations"].as_u64().unwrap() > probe_violations,
            "shifted by {by}: {v}"
        );
    }
    violations
}

/// Identity rate with a non-zero offset: `record` writes raw guest ticks and a TIME_SHIFT, and
/// `trace-cmd report -i host.dat -i guest.dat` does the merging.
fn merged_report_puts_each_workload_event_on_the_right_side_of_its_exit() {
    let test = "causality::merged_report_puts_each_workload_event_on_the_right_side_of_its_exit";
    let skew = Skew(vmtsync_core::mapping::KvmTscMapping::offset_only(
        Skew::pick().0.offset(),
    ));
    let run = recorded_run("causality-rate1", &skew, "trace-cmd");
    let (host, guest, thread) = (&run.host, &run.guest, run.thread);
    let segments = anchored_segments(&run.sync);

    let ord = merged_order(host, guest, thread);
    // Step k's `out` wrote k's low byte, and each `out` has its `in`: the host trace is whole.
    assert!(
        ord.write_vals
            .iter()
            .enumerate()
            .all(|(k, &v)| usize::try_from(v).ok() == Some(k & 0xff)),
        "the host trace lost exits"
    );
    // The VM is killed at any point, possibly between the last `out` and its `in`.
    assert!(
        ord.writes.len() - ord.reads.len() <= 1,
        "outs without their ins: {} outs, {} ins",
        ord.writes.len(),
        ord.reads.len()
    );
    let mut violations = Vec::new();
    let mut checked = 0;
    for &(line, seq) in &ord.before {
        let Some(&w) = usize::try_from(seq).ok().and_then(|k| ord.writes.get(k)) else {
            continue;
        };
        checked += 1;
        if line > w {
            violations.push(format!(
                "before-event {seq} at line {line} after its out at {w}"
            ));
        }
    }
    for &(line, seq) in &ord.after {
        let Some(&r) = usize::try_from(seq).ok().and_then(|k| ord.reads.get(k)) else {
            continue;
        };
        checked += 1;
        if line < r {
            violations.push(format!(
                "after-event {seq} at line {line} before its in at {r}"
            ));
        }
    }
    eprintln!(
        "{test}: {checked} events checked in trace-cmd's merged order ({} before-events, {} after-events, {} steps), {} violations",
        ord.before.len(),
        ord.after.len(),
        ord.writes.len(),
        violations.len()
    );
    assert!(checked >= 1000, "only {checked} events could be checked");
    assert!(violations.is_empty(), "{violations:#?}");

    // `validate` agrees on the same files, and catches a shifted sync file.
    validate_and_catch_a_shift(test, &run, &segments, true);
}

/// A guest TSC 100 ppm fast (the software skew `Skew::pick`): the sync must track the rate.
/// `record` pre-converts its trace.dat then, so the guest recording is JSON Lines, which keeps
/// the raw guest ticks. Guaranteed here: every event's interval meets its exit bracket, and a
/// shifted sync file does worse. Held as a bar too, with the agent's default boot (sync port,
/// ring 0) and `record`'s default two-sided placement: every event and every sync probe on its
/// own side of its exit from the first round on (issue 18).
fn a_drifting_guest_keeps_every_bound_and_a_shift_is_caught() {
    let test = "causality::a_drifting_guest_keeps_every_bound_and_a_shift_is_caught";
    let run = recorded_run("causality-skewed", &Skew::pick(), "jsonl");
    let segments = anchored_segments(&run.sync);
    // The rate is bounded away from identity once rounds accumulate.
    assert!(
        segments
            .iter()
            .any(|s| s["drift_ppb_lo"].as_i64().unwrap() > 0),
        "{segments:?}"
    );
    let violations = validate_and_catch_a_shift(test, &run, &segments, true);
    assert_eq!(violations, 0);
    // The same files placed one-sided (record's placement before two-sided placement): both
    // hold every bound; two-sided is never wider, and both are reported side by side.
    let (_, one, err) = validate_placed(&run.sync, &run, "one-sided");
    let (_, two, _) = validate(&run.sync, &run);
    assert_eq!(one["bound_violations"], 0, "{one} {err}");
    let (w1, w2) = (&one["widths"], &two["widths"]);
    for k in ["event_median", "event_max"] {
        assert!(
            w2[k].as_u64().unwrap() <= w1[k].as_u64().unwrap(),
            "{k}: {w1} {w2}"
        );
    }
    for (name, v) in [("one-sided", &one), ("two-sided", &two)] {
        let by_round: Vec<String> = v["segments"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| format!("round {}: {}", s["round"], s["wrong_side"]))
            .collect();
        eprintln!(
            "{test}: {name}: widths {}; wrong side by segment: {}",
            v["widths"],
            by_round.join(", ")
        );
    }
}
