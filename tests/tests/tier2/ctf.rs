//! CTF 1.8 output (`vmtsync record --format ctf`, `vmtsync export ctf`) read back by the real
//! babeltrace2 2.0.4: its CLI (`--clock-cycles`) and its Python bindings (`bt2`, run with
//! `/usr/bin/python3`), which give every event's default clock snapshot in cycles and in ns
//! from origin. The truth is the input: JSON Lines written here or by `vmtsync record`, a
//! trace.dat as `trace-cmd report -t` reads it, and for live recordings the agent's known skew
//! (loopback) or KVM's debugfs mapping composed with it (QEMU).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::Value;
use vmtsync_core::{GuestTicks, HostTicks};
use vmtsync_tests::require;
use vmtsync_tests::truth::{GuestTruth, Skew, truth_mapping};

use crate::util::{
    HostTrace, Loopback, QemuAgent, export_ctf, have_program, have_trace_cmd, jsonl_line, loopback,
    qemu_pio_trace_ready, qemu_ready, read_jsonl, report_events, scratch, seq_of, text, trace_cmd,
    u,
};

crate::trials!(
    ctf_ready;
    export_of_synthetic_jsonl_reads_back_exactly_in_babeltrace2,
    record_ctf_from_the_loopback_agent_holds_the_truth;
    ctf_trace_cmd_ready;
    export_of_a_trace_dat_matches_trace_cmd_report;
    ctf_qemu_ready;
    qemu_recording_in_ctf_matches_jsonl_and_the_truth;
    ctf_qemu_pio_trace_ready;
    host_kvm_pio_and_guest_traces_line_up_in_babeltrace2,
);

/// A TSC frequency for exports made here (any integer works; the same one for traces meant
/// to line up).
const HZ: u64 = 2_299_998_000;

/// Reads trace directories with python3-bt2 and prints one JSON object per event message:
/// trace name, stream id, event name, clock snapshot (cycles, ns from origin), payload fields.
const BT2_READER: &str = r#"
import bt2, json, sys
for m in bt2.TraceCollectionMessageIterator(sys.argv[1:]):
    if type(m) is not bt2._EventMessageConst:
        continue
    e = m.event
    cs = m.default_clock_snapshot
    f = {}
    for k, v in e.payload_field.items():
        if isinstance(v, bt2._ArrayFieldConst):
            f[k] = [int(x) for x in v]
        elif isinstance(v, bt2._StringFieldConst):
            f[k] = str(v)
        else:
            f[k] = int(v)
    env = e.stream.trace.environment
    print(json.dumps({"trace": str(env["trace_name"]),
        "interval": str(env["vmtsync_interval"]) if "vmtsync_interval" in env else None,
        "stream": e.stream.id, "event": e.name, "cycles": cs.value,
        "ns": cs.ns_from_origin, "fields": f}))
"#;

fn have_bt2() -> bool {
    Command::new("/usr/bin/python3")
        .args(["-c", "import bt2"])
        .stdin(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The CTF tests' prerequisites: the babeltrace2 CLI and python3-bt2.
pub(crate) fn ctf_ready(test: &str) -> bool {
    require(
        test,
        have_program("babeltrace2"),
        "babeltrace2 is missing (apt-get install babeltrace2, or cargo xtask setup)",
    ) && require(
        test,
        have_bt2(),
        "python3-bt2 is missing for /usr/bin/python3 (apt-get install python3-bt2, or cargo xtask setup)",
    )
}

/// [`ctf_ready`] and trace-cmd.
fn ctf_trace_cmd_ready(test: &str) -> bool {
    ctf_ready(test) && have_trace_cmd(test)
}

/// [`ctf_ready`] and QEMU with the truth and trace-cmd.
fn ctf_qemu_ready(test: &str) -> bool {
    ctf_ready(test) && qemu_ready(test)
}

/// [`ctf_ready`] and QEMU with a host trace of `kvm:kvm_pio`.
fn ctf_qemu_pio_trace_ready(test: &str) -> bool {
    ctf_ready(test) && qemu_pio_trace_ready(test)
}

/// One event as python3-bt2 delivers it.
#[derive(Debug)]
pub(crate) struct BtEvent {
    pub(crate) trace: String,
    /// The trace's `env.vmtsync_interval` (`exact` for an exact recording), if any.
    pub(crate) interval: Option<String>,
    pub(crate) event: String,
    pub(crate) cycles: u64,
    pub(crate) ns: i64,
    pub(crate) fields: Value,
}

impl BtEvent {
    pub(crate) fn f(&self, k: &str) -> u64 {
        self.fields[k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k} in {:?}", self.fields))
    }

    pub(crate) fn payload(&self) -> Vec<u8> {
        self.fields["payload"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| u8::try_from(v.as_u64().unwrap()).unwrap())
            .collect()
    }
}

/// Every event of the trace directories, in babeltrace2's (muxed, time-sorted) order.
pub(crate) fn bt2_events(dirs: &[&Path]) -> Vec<BtEvent> {
    let out = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(BT2_READER)
        .args(dirs)
        .stdin(Stdio::null())
        .output()
        .expect("python3 runs");
    assert!(out.status.success(), "bt2: {}", text(&out.stderr));
    text(&out.stdout)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            BtEvent {
                trace: v["trace"].as_str().unwrap().to_owned(),
                interval: v["interval"].as_str().map(str::to_owned),
                event: v["event"].as_str().unwrap().to_owned(),
                cycles: v["cycles"].as_u64().unwrap(),
                ns: v["ns"].as_i64().unwrap(),
                fields: v["fields"].clone(),
            }
        })
        .collect()
}

/// `babeltrace2 --clock-cycles DIR...`: (cycles, vcpu, host_tsc) of every event line.
pub(crate) fn cli_events(dirs: &[&Path]) -> Vec<(u64, u64, u64)> {
    let out = Command::new("babeltrace2")
        .arg("--clock-cycles")
        .args(dirs)
        .stdin(Stdio::null())
        .output()
        .expect("babeltrace2 runs");
    assert!(out.status.success(), "babeltrace2: {}", text(&out.stderr));
    let field = |l: &str, k: &str| -> u64 {
        l.split(&format!(" {k} = "))
            .nth(1)
            .and_then(|s| s.split([',', ' ']).next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{k} in {l}"))
    };
    text(&out.stdout)
        .lines()
        .filter(|l| l.contains("vmtsync:event"))
        .map(|l| {
            let cycles = l[1..].split(']').next().unwrap().parse().unwrap();
            (cycles, field(l, "vcpu"), field(l, "host_tsc"))
        })
        .collect()
}

/// Checks the ns babeltrace2 derived from `cycles` on our clock (offset 0) against the exact
/// `floor(cycles · 1e9 / freq)`. babeltrace2 2.0 computes it in double precision, so it may
/// differ by one ns, and by 2^-52 of the value beyond 2^53 ns (about 104 days).
pub(crate) fn assert_ns(ns: i64, cycles: u64, hz: u64, what: &dyn std::fmt::Display) {
    let exact = i64::try_from(u128::from(cycles) * 1_000_000_000 / u128::from(hz)).unwrap();
    let tolerance = 1 + (exact >> 52);
    assert!(
        ns.abs_diff(exact) <= tolerance.cast_unsigned(),
        "{what}: ns {ns}, exact {exact}"
    );
}

/// The expected stream of one vCPU: its events in input order with the timestamp babeltrace2
/// must show (the host time, raised to the previous one where it steps back).
fn expected_by_vcpu(lines: &[Value]) -> BTreeMap<u64, Vec<(u64, &Value)>> {
    let mut m: BTreeMap<u64, Vec<(u64, &Value)>> = BTreeMap::new();
    for v in lines {
        let s = m.entry(u(v, "vcpu")).or_default();
        let ts = s.last().map_or(0, |&(t, _)| t).max(u(v, "host_tsc"));
        s.push((ts, v));
    }
    m
}

/// Checks a CTF trace against the JSON Lines it was made from: event count, per-vCPU order,
/// every clock snapshot (cycles and ns) and every field, in both babeltrace2 readers. Returns
/// how many timestamps were raised.
fn check_against_jsonl(dir: &Path, lines: &[Value], hz: u64) -> u64 {
    let want = expected_by_vcpu(lines);
    let bt = bt2_events(&[dir]);
    assert_eq!(bt.len(), lines.len(), "bt2 event count");
    let mut got: BTreeMap<u64, Vec<&BtEvent>> = BTreeMap::new();
    let mut last = 0;
    for e in &bt {
        assert_eq!(e.event, "vmtsync:event");
        assert_eq!(e.trace, dir.file_name().unwrap().to_str().unwrap());
        assert!(e.cycles >= last, "bt2's muxed order is by time");
        last = e.cycles;
        got.entry(e.f("vcpu")).or_default().push(e);
    }
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    let mut raised = 0;
    for (vcpu, w) in &want {
        let g = &got[vcpu];
        assert_eq!(g.len(), w.len(), "vCPU {vcpu} count");
        for (e, &(ts, v)) in g.iter().zip(w) {
            assert_eq!(e.cycles, ts, "vCPU {vcpu}: clock snapshot of {v}");
            assert_ns(e.ns, ts, hz, &format!("vCPU {vcpu}: {v}"));
            for k in ["id", "host_tsc", "guest_tsc", "host_lo", "host_hi"] {
                assert_eq!(e.f(k), u(v, k), "vCPU {vcpu}: {k} of {v}");
            }
            let hex: String = e.payload().iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(hex, v["payload"].as_str().unwrap(), "payload of {v}");
            raised += u64::from(ts != u(v, "host_tsc"));
        }
    }
    // The CLI agrees, event for event (its muxed order; per vCPU the input's).
    let cli = cli_events(&[dir]);
    assert_eq!(cli.len(), lines.len(), "babeltrace2 CLI event count");
    let mut by: BTreeMap<u64, Vec<(u64, u64)>> = BTreeMap::new();
    for &(c, vcpu, host) in &cli {
        by.entry(vcpu).or_default().push((c, host));
    }
    for (vcpu, w) in &want {
        let exp: Vec<(u64, u64)> = w.iter().map(|&(t, v)| (t, u(v, "host_tsc"))).collect();
        assert_eq!(by[vcpu], exp, "CLI, vCPU {vcpu}");
    }
    raised
}

/// Synthetic JSON Lines (three vCPUs interleaved, host times far up the 64-bit range, steps
/// back at segment changes, payloads of every length) exported to CTF: babeltrace2 shows every
/// event with the input's host time in cycles, the matching ns, and every field.
fn export_of_synthetic_jsonl_reads_back_exactly_in_babeltrace2() {
    let dir = scratch("ctf-synthetic");
    // A varied but reproducible sequence (xorshift from a fixed seed).
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut host = [1u64 << 40, 1 << 62, 5_000];
    let vcpus = [0u64, 1, 5];
    let mut text_in = String::new();
    for i in 0..12_000u64 {
        let k = (i % 3) as usize;
        host[k] += next() % 10_000 + 1;
        if i % 997 == 5 {
            // A segment change that moves the host time back.
            host[k] -= next() % 5_000 + 10_001;
        }
        let h = host[k];
        let (lo, hi) = (h - next() % 1_000, h + next() % 1_000);
        let payload: Vec<u8> = (0..(i % 17))
            .map(|j| u8::try_from((i + j) % 256).unwrap())
            .collect();
        text_in.push_str(&jsonl_line(
            vcpus[k],
            i % 65_536,
            h.wrapping_add(123_456_789),
            h,
            lo,
            hi,
            &payload,
        ));
        text_in.push('\n');
    }
    let input = dir.path().join("synthetic.jsonl");
    std::fs::write(&input, &text_in).unwrap();
    let out = dir.path().join("trace");
    let o = export_ctf(&[
        "--from",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--tsc-hz",
        &HZ.to_string(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let lines = read_jsonl(&input);
    let raised = check_against_jsonl(&out, &lines, HZ);
    assert!(raised > 0, "the steps back were raised");
    assert!(
        text(&o.stderr).contains(&format!("{raised} timestamps raised")),
        "{}",
        text(&o.stderr)
    );
    println!(
        "ctf synthetic: {} events, {raised} raised; {}",
        lines.len(),
        text(&o.stderr).trim()
    );
}

/// `vmtsync record --format ctf` from the loopback agent: babeltrace2 shows every event the
/// agent sent, in order, each one's guaranteed interval holding its true host tick (guest −
/// skew, exactly) and its clock snapshot equal to its `host_tsc` field.
fn record_ctf_from_the_loopback_agent_holds_the_truth() {
    let n = 20_000;
    let lb = loopback("ctf", n, 200_000);
    let out = lb.dir.path().join("trace");
    let o = lb.record(&out, n, 30, &["--format", "ctf"]);
    let Loopback { skew, agent, .. } = lb;
    let dropped = agent.join().unwrap();
    let bt = bt2_events(&[&out]);
    assert_eq!(bt.len() as u64, n - dropped, "{}", text(&o.stderr));
    let mut prev = None;
    let mut misses = 0;
    let mut raised = 0;
    for e in &bt {
        let truth = e.f("guest_tsc").wrapping_sub(skew.cast_unsigned());
        if !(e.f("host_lo") <= truth && truth <= e.f("host_hi")) {
            misses += 1;
        }
        // The clock is the recorded host time (raised only where it steps back).
        assert!(e.cycles >= e.f("host_tsc"), "{e:?}");
        raised += u64::from(e.cycles != e.f("host_tsc"));
        let seq = u64::from_le_bytes(e.payload().try_into().unwrap());
        assert!(prev.is_none_or(|p| seq > p), "order broken at {e:?}");
        prev = Some(seq);
    }
    assert_eq!(misses, 0, "intervals that miss the truth");
    println!(
        "record ctf (loopback): {} events, {dropped} dropped, {raised} raised; {}",
        bt.len(),
        text(&o.stderr).trim()
    );
}

/// A trace.dat from `vmtsync record` exported to CTF: babeltrace2's clock snapshots equal the
/// host times the real `trace-cmd report -t` gives the same events (TIME_SHIFT applied, or
/// pre-converted), event for event.
fn export_of_a_trace_dat_matches_trace_cmd_report() {
    let n = 3_000;
    let lb = loopback("ctf-dat", n, 100_000);
    let dat = lb.dir.path().join("guest.dat");
    lb.record(&dat, n, 30, &[]);
    let Loopback { dir, agent, .. } = lb;
    let _ = agent.join();
    let out = dir.path().join("trace");
    let e = export_ctf(&[
        "--from",
        dat.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--tsc-hz",
        &HZ.to_string(),
    ]);
    assert_eq!(e.status.code(), Some(0), "{}", text(&e.stderr));
    let report = report_events(&trace_cmd(&[
        "report",
        "-t",
        crate::util::TICKS[0],
        crate::util::TICKS[1],
        "-i",
        dat.to_str().unwrap(),
    ]));
    let bt = bt2_events(&[&out]);
    assert_eq!(report.len(), bt.len());
    assert!(!bt.is_empty());
    for (&(ts, seq), b) in report.iter().zip(&bt) {
        assert_eq!(b.cycles, ts, "event {seq}");
        assert_eq!(b.f("host_tsc"), ts, "event {seq}");
        assert_eq!(u64::from_le_bytes(b.payload().try_into().unwrap()), seq);
        assert_ns(b.ns, ts, HZ, &seq);
    }
    let shifted = text(&e.stderr).contains("guest TSC and host TSC");
    println!(
        "ctf from trace.dat ({}): {} events match trace-cmd report -t; {}",
        if shifted {
            "TIME_SHIFT"
        } else {
            "pre-converted"
        },
        bt.len(),
        text(&e.stderr).trim()
    );
}

/// Tier 2: the real agent under QEMU with a workload and a software skew (rate 1.0001, then 1):
/// `record --format jsonl` and `export ctf` of it agree event for event in babeltrace2; then
/// `record --format ctf` in the same session puts every event's guaranteed interval around its
/// debugfs+skew truth.
fn qemu_recording_in_ctf_matches_jsonl_and_the_truth() {
    let picked = Skew::pick();
    let identity = Skew(vmtsync_core::mapping::KvmTscMapping::offset_only(
        picked.0.offset(),
    ));
    for (name, skew) in [("rate 1.0001", picked), ("rate 1", identity)] {
        let dir = scratch("ctf-qemu");
        let append = format!(
            "transport=uart exit=0 workload=300,0 {}",
            skew.agent_option()
        );
        let vm = QemuAgent::boot(dir.path(), &append);
        let jsonl = dir.path().join("events.jsonl");
        let o = vm.record(&jsonl, 400, 200, &["--format", "jsonl"]);
        assert_eq!(o.status.code(), Some(0), "{name}: {}", text(&o.stderr));
        // The truth, read while the VM runs (the next recording ends it).
        let pid = vm.guard.pid();
        let truth = GuestTruth::new(truth_mapping(pid, 0).expect("debugfs truth"), Some(skew));
        let ctf = dir.path().join("trace");
        let o2 = vm.record(&ctf, 150, 200, &["--format", "ctf", "--shutdown"]);
        drop(vm);
        assert_eq!(o2.status.code(), Some(0), "{name}: {}", text(&o2.stderr));

        let lines = read_jsonl(&jsonl);
        assert_eq!(lines.len(), 400, "{name}");
        let exported = dir.path().join("exported");
        let e = export_ctf(&[
            "--from",
            jsonl.to_str().unwrap(),
            "--out",
            exported.to_str().unwrap(),
        ]);
        assert_eq!(e.status.code(), Some(0), "{name}: {}", text(&e.stderr));
        let hz: u64 = std::fs::read_to_string(exported.join("metadata"))
            .unwrap()
            .split("freq = ")
            .nth(1)
            .and_then(|s| s.split(';').next())
            .and_then(|s| s.parse().ok())
            .expect("metadata has freq");
        let raised = check_against_jsonl(&exported, &lines, hz);

        let bt = bt2_events(&[&ctf]);
        assert_eq!(bt.len(), 150, "{name}: {}", text(&o2.stderr));
        let mut misses = 0;
        let mut prev = None;
        for b in &bt {
            let (g, lo, hi) = (b.f("guest_tsc"), b.f("host_lo"), b.f("host_hi"));
            if !truth.in_bracket(HostTicks(lo), GuestTicks(g), HostTicks(hi)) {
                misses += 1;
            }
            assert!(b.cycles >= b.f("host_tsc"));
            let seq = seq_of(
                &b.payload()
                    .iter()
                    .map(|x| format!("{x:02x}"))
                    .collect::<String>(),
            );
            assert!(prev.is_none_or(|p| seq > p), "{name}: order at {b:?}");
            prev = Some(seq);
        }
        assert_eq!(
            misses, 0,
            "{name}: intervals that miss the debugfs+skew truth"
        );
        println!(
            "ctf under QEMU, {name}: jsonl {} events = export in babeltrace2 ({raised} raised); \
             record --format ctf {} events inside the truth; {}",
            lines.len(),
            bt.len(),
            text(&o2.stderr).trim()
        );
    }
}

/// `(raw timestamp, port)` of every `kvm_pio` line of `trace-cmd report --raw-ts`.
fn report_pio(host_dat: &Path) -> Vec<(u64, u16)> {
    let o = trace_cmd(&["report", "--raw-ts", "-i", host_dat.to_str().unwrap()]);
    assert!(o.status.success(), "report: {}", text(&o.stderr));
    text(&o.stdout)
        .lines()
        .filter(|l| l.contains(" kvm_pio: "))
        .map(|l| {
            let (_, ts) = crate::util::report_cpu_ts(l);
            let port = l
                .split(" at 0x")
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
                .and_then(|s| u16::from_str_radix(s, 16).ok())
                .unwrap_or_else(|| panic!("port in {l}"));
            (ts, port)
        })
        .collect()
}

/// The `freq` of a CTF trace's clock.
pub(crate) fn metadata_hz(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join("metadata"))
        .unwrap()
        .split("freq = ")
        .nth(1)
        .and_then(|s| s.split(';').next())
        .and_then(|s| s.parse().ok())
        .expect("metadata has freq")
}

/// Tier 2: two traces on one timeline. A private tracefs instance (x86-tsc) records the host's
/// `kvm:kvm_pio` exits while `vmtsync record --format ctf` records the real agent's workload
/// under QEMU (events sent over COM1, so every event leaves through port 0x3f8 writes after it
/// happened). `vmtsync export ctf --host-events kvm_pio` turns `trace-cmd extract`'s file into
/// a CTF trace whose exits match `trace-cmd report --raw-ts` exactly; babeltrace2 reads both
/// traces at once (both clocks absolute, same frequency) and the merged timeline holds every
/// event of both in time order, the guest's events among the VM's COM1 exits, each one's
/// guaranteed interval starting before a COM1 write of the VM's vCPU thread.
fn host_kvm_pio_and_guest_traces_line_up_in_babeltrace2() {
    let mut trace = HostTrace::start("ctf", "kvm/kvm_pio");
    // Other VMs on this machine exit too: room for all of them for the recording's seconds.
    trace.buffer_kb(16_384);
    trace
        .instance()
        .enable("kvm/kvm_pio")
        .expect("enable kvm_pio");

    let dir = scratch("ctf-lineup");
    let skew = Skew::pick();
    let append = format!(
        "transport=uart exit=0 workload=300,0 {}",
        skew.agent_option()
    );
    let vm = QemuAgent::boot(dir.path(), &append);
    let guest = dir.path().join("guest");
    let o = vm.record(&guest, 300, 200, &["--format", "ctf"]);
    // The VM's threads (its vCPU thread makes its exits), read while it still runs (the
    // agent keeps serving without --shutdown).
    let tasks: std::collections::BTreeSet<u64> =
        std::fs::read_dir(format!("/proc/{}/task", vm.guard.pid()))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
    trace.stop();
    drop(vm);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let host_dat = dir.path().join("host.dat");
    trace.extract(&host_dat);

    let host = dir.path().join("host");
    let e = export_ctf(&[
        "--from",
        host_dat.to_str().unwrap(),
        "--host-events",
        "kvm_pio",
        "--out",
        host.to_str().unwrap(),
    ]);
    assert_eq!(e.status.code(), Some(0), "{}", text(&e.stderr));
    assert_eq!(metadata_hz(&host), metadata_hz(&guest), "one clock");
    let hz = metadata_hz(&host);

    // The host trace alone: exactly trace-cmd's kvm_pio exits.
    let mut want = report_pio(&host_dat);
    let mut got: Vec<(u64, u16)> = bt2_events(&[&host])
        .iter()
        .map(|b| (b.cycles, u16::try_from(b.f("port")).unwrap()))
        .collect();
    want.sort_unstable();
    got.sort_unstable();
    assert!(!want.is_empty(), "no kvm_pio exits recorded");
    assert_eq!(got, want, "kvm_pio exits: CTF vs trace-cmd report");

    // Both at once.
    let merged = bt2_events(&[&guest, &host]);
    let guest_name = guest.file_name().unwrap().to_str().unwrap();
    let host_name = host.file_name().unwrap().to_str().unwrap();
    let (g, h): (Vec<_>, Vec<_>) = merged.iter().partition(|b| b.trace == guest_name);
    assert_eq!(g.len(), 300, "guest events in the merged timeline");
    assert_eq!(h.len(), want.len(), "host events in the merged timeline");
    assert!(
        h.iter()
            .all(|b| b.trace == host_name && b.event == "kvm:kvm_pio")
    );
    let mut last = i64::MIN;
    for b in &merged {
        assert!(b.ns >= last, "merged order by time at {b:?}");
        last = b.ns;
        assert_ns(b.ns, b.cycles, hz, &b.trace);
    }
    let com1 = |b: &BtEvent| {
        b.trace == host_name
            && b.f("port") == 0x3f8
            && b.f("rw") == 1
            && tasks.contains(&b.f("pid"))
    };
    let last_com1 = merged
        .iter()
        .filter(|b| com1(b))
        .map(|b| b.cycles)
        .max()
        .unwrap_or_else(|| {
            let mut seen = BTreeMap::new();
            for b in &h {
                *seen.entry((b.f("port"), b.f("pid"))).or_insert(0) += 1;
            }
            panic!("no COM1 write by the VM's threads {tasks:?}; (port, pid): {seen:?}")
        });
    let first_g = merged.iter().position(|b| b.trace == guest_name).unwrap();
    let last_g = merged.iter().rposition(|b| b.trace == guest_name).unwrap();
    let between = merged[first_g..last_g].iter().filter(|b| com1(b)).count();
    let mut late = 0;
    for b in &g {
        assert_eq!(b.event, "vmtsync:event");
        assert!(b.cycles >= b.f("host_tsc"));
        // Sent over COM1 after it happened, so after its interval's start.
        if b.f("host_lo") >= last_com1 {
            late += 1;
        }
    }
    assert_eq!(
        late, 0,
        "guest events with no COM1 write of their VM after them"
    );
    assert!(
        between > 0,
        "the guest's events interleave with its VM's COM1 exits on one timeline"
    );
    println!(
        "ctf line-up: {} guest events and {} kvm_pio exits ({} COM1 writes of the VM among the \
         guest's events) in one babeltrace2 timeline at {hz} Hz; {}",
        g.len(),
        h.len(),
        between,
        text(&e.stderr).trim()
    );
}
