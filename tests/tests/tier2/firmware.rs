//! Tier 2: SeaBIOS traced end to end. Debian's SeaBIOS source, patched with the C recorder
//! (`tests/firmware/seabios/`, built by `vmtsync_launch::firmware`), boots under QEMU `-M pc`
//! with KVM, started paused so that the readers attach before its first instruction.
//! `vmtsync record --from-memory` reads its ring at guest-physical 16 MiB, located by the scan,
//! while it runs, once with `--trust-raw-tsc` and once in beacon mode; the recordings end
//! (SIGINT, after the last drain) once SeaBIOS has tried every boot device.
//!
//! The truth is the firmware's and KVM's, never the reader's: the firmware prints its ring's
//! own produced and refused counts on its debug console at each boot attempt, so every record
//! it stored is accounted for (events delivered + beacons read + overwritten = produced); and
//! KVM's mapping of vCPU 0, read here from debugfs after the run (SeaBIOS never writes the TSC),
//! gives each event's exact host time, which its interval must hold.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use vmtsync_core::GuestTicks;
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_launch::firmware::{
    self, BOOT_EVENT, BOOTING_LINE, FW_CFG_CTL_EVENTS, FW_CFG_DMA_EVENTS, MEMORY_MIB, PHASE_BEGIN,
    PHASE_END, PHASES, Variant,
};
use vmtsync_launch::qemu::{command_firmware, paused_with_qmp, qmp_cont};
use vmtsync_tests::truth::truth_mapping;
use vmtsync_tests::{ChildGuard, require};

use crate::util::{
    anchor_ready, count_before, have_trace_cmd, lines_of, scratch, text, trace_cmd, u, vmtsync,
};

crate::trials!(
    seabios_ready; seabios_every_post_phase_and_boot_attempt_is_recorded_at_its_host_time,
    seabios_started_by_the_reader_brackets_every_beacon_from_the_first;
);

/// [`anchor_ready`] (QEMU, KVM, debugfs, the `kvm_pio` tracepoint for beacon mode), trace-cmd,
/// and a SeaBIOS build: its cached source (`cargo xtask setup`) and its tools.
pub(crate) fn seabios_ready(test: &str) -> bool {
    let build = firmware::build_ready();
    anchor_ready(test)
        && have_trace_cmd(test)
        && require(
            test,
            build.is_ok(),
            &build.err().map_or_else(String::new, |e| e.to_string()),
        )
}

/// A `vmtsync record --from-memory` reader of QEMU `pid` with `extra` flags into `out` (JSON
/// Lines), its stderr in `out.stderr`; it runs until SIGINT (or 120 s).
fn spawn_reader(pid: u32, out: &Path, extra: &[&str]) -> ChildGuard {
    let err = std::fs::File::create(out.with_extension("stderr")).unwrap();
    let child = vmtsync()
        .args(["record", "--from-memory", "--vm", &pid.to_string()])
        .args(extra)
        .args(["--format", "jsonl", "--duration", "120", "--no-progress"])
        .arg("--out")
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .expect("vmtsync starts");
    ChildGuard::new(child)
}

/// Ends reader `rec` as a user would (SIGINT: it drains the rings up to their heads at that
/// moment, then writes), and returns its success and stderr.
pub(crate) fn stop_reader(mut rec: ChildGuard, out: &Path) -> (bool, String) {
    rec.signal(libc::SIGINT).expect("SIGINT the reader");
    let status = rec
        .wait_timeout(Duration::from_secs(60))
        .expect("waitpid")
        .expect("the reader ends within 60 s of SIGINT");
    let stderr = std::fs::read_to_string(out.with_extension("stderr")).unwrap();
    (status.success(), stderr)
}

/// Waits (at most `limit`) until the debug log at `log` holds `what`; returns the log.
pub(crate) fn wait_log(log: &Path, what: &str, limit: Duration) -> String {
    let end = Instant::now() + limit;
    loop {
        let t = std::fs::read_to_string(log).unwrap_or_default();
        if t.contains(what) {
            return t;
        }
        assert!(
            Instant::now() < end,
            "SeaBIOS's debug log has no {what:?} after {limit:?}:\n{t}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The payload bytes of a JSON Lines event.
pub(crate) fn payload(v: &serde_json::Value) -> Vec<u8> {
    let hex = v["payload"].as_str().unwrap_or("");
    (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex payload"))
        .collect()
}

/// `vmtsync record --from-memory` that starts `qemu` itself, paused, and finds the traced
/// SeaBIOS's ring at its guest-physical address with its beacon port armed: `flags` are the
/// recording's own (format, duration, ...), `out` its output, `qemu_extra` arguments added
/// to QEMU's; its stderr goes to `out.stderr`.
pub(crate) fn launch_reader(
    qemu: &std::process::Command,
    out: &Path,
    flags: &[&str],
    qemu_extra: &[String],
) -> ChildGuard {
    let err = std::fs::File::create(out.with_extension("stderr")).unwrap();
    let child = vmtsync()
        .args(["record", "--from-memory", "--no-progress"])
        .args(["--guest-phys", &format!("{:#x}", firmware::RING_GPA)])
        .args(["--beacon-port", &format!("{:#x}", firmware::BEACON_PORT)])
        .args(flags)
        .arg("--out")
        .arg(out)
        .arg("--")
        .arg(qemu.get_program())
        .args(qemu.get_args())
        .args(qemu_extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .expect("vmtsync starts");
    ChildGuard::new(child)
}

/// The QEMU a reader started: its one child.
pub(crate) fn launched_qemu(rec: &ChildGuard) -> u32 {
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", rec.pid()))
        .expect("the reader's children");
    children
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the reader started QEMU")
}

/// Asserts that event `v`'s guaranteed interval holds its exact host time under `kvm` (KVM's
/// mapping from debugfs), and returns that time's range.
pub(crate) fn assert_holds_truth(
    v: &serde_json::Value,
    kvm: &KvmTscMapping,
    what: &str,
) -> (u64, u64) {
    let g = GuestTicks(u(v, "guest_tsc"));
    let lo = kvm.try_host_from_guest_ceil(g).expect("in range").0;
    let hi = kvm.try_host_from_guest_floor(g).expect("in range").0;
    let (exact_lo, exact_hi) = (lo.min(hi), lo.max(hi));
    assert!(
        u(v, "host_lo") <= exact_lo && exact_hi <= u(v, "host_hi"),
        "{what}: the interval misses the truth [{exact_lo}, {exact_hi}]: {v}"
    );
    (exact_lo, exact_hi)
}

/// A POST phase's begin or end event: `Some((true, name))` for a begin.
pub(crate) fn phase_event(v: &serde_json::Value) -> Option<(bool, String)> {
    let id = u16::try_from(u(v, "id")).ok()?;
    let name = || String::from_utf8_lossy(&payload(v)).into_owned();
    match id {
        PHASE_BEGIN => Some((true, name())),
        PHASE_END => Some((false, name())),
        _ => None,
    }
}

/// The phase events one POST records, in order: each phase's begin, then its end (which the
/// next phase's begin follows; the last one ends at the first boot attempt).
pub(crate) fn expected_phase_events() -> Vec<(bool, String)> {
    PHASES
        .iter()
        .flat_map(|p| [(true, (*p).to_owned()), (false, (*p).to_owned())])
        .collect()
}

/// Checks the events of one recording against the firmware's own account: each POST phase's
/// begin and end once and in order, then `boots` boot attempts 0, 1, ... (one per counts line
/// of the log).
fn assert_phases_then_boots(lines: &[serde_json::Value], boots: usize, what: &str) {
    // The events around fw_cfg's port writes are checked by firmware_validate.rs.
    let fw_cfg = [
        FW_CFG_CTL_EVENTS.0,
        FW_CFG_CTL_EVENTS.1,
        FW_CFG_DMA_EVENTS.0,
        FW_CFG_DMA_EVENTS.1,
    ]
    .map(u64::from);
    let lines: Vec<serde_json::Value> = lines
        .iter()
        .filter(|v| !fw_cfg.contains(&u(v, "id")))
        .cloned()
        .collect();
    assert!(!lines.is_empty(), "{what}: events");
    let phases: Vec<(bool, String)> = lines.iter().filter_map(phase_event).collect();
    assert_eq!(
        phases,
        expected_phase_events(),
        "{what}: every POST phase begins and ends once, in order"
    );
    let attempts: Vec<u32> = lines
        .iter()
        .filter(|v| u(v, "id") == u64::from(BOOT_EVENT))
        .map(|v| u32::from_le_bytes(payload(v).try_into().expect("a 4-byte attempt number")))
        .collect();
    let expected: Vec<u32> = (0..u32::try_from(boots).unwrap()).collect();
    assert_eq!(attempts, expected, "{what}: every boot attempt");
    let n = 2 * PHASES.len();
    assert_eq!(lines.len(), n + boots, "{what}: no other event");
    // The phases come first: the boot attempts are int 0x19's, after POST.
    assert!(
        lines[..n].iter().all(|v| phase_event(v).is_some()),
        "{what}"
    );
}

fn seabios_every_post_phase_and_boot_attempt_is_recorded_at_its_host_time() {
    let test = "seabios_every_post_phase_and_boot_attempt_is_recorded_at_its_host_time";
    let out = firmware::build(Variant::Traced).expect("the traced SeaBIOS builds");
    let dir = scratch(test);
    let log = dir.path().join("debug.log");
    let qmp = dir.path().join("qmp.sock");
    let child = command_firmware(&out.join("bios.bin"), &log, MEMORY_MIB)
        .args(paused_with_qmp(&qmp))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu starts");
    let qemu = ChildGuard::new(child);
    let pid = qemu.pid();
    // Paused before its first instruction: the readers find the VM, then wait for the header.
    crate::minimal_kernel::wait_paused_vcpu(pid);
    let exact_out: PathBuf = dir.path().join("exact.jsonl");
    let beacon_out: PathBuf = dir.path().join("beacons.jsonl");
    let exact = spawn_reader(pid, &exact_out, &["--trust-raw-tsc"]);
    let beacons = spawn_reader(pid, &beacon_out, &[]);
    qmp_cont(&qmp, Duration::from_secs(20)).expect("QEMU resumes");
    // With no bootable device, SeaBIOS tries each one and then waits for ever (QEMU's default
    // boot-fail wait): its last line. Emulated ring 0 makes POST take seconds here.
    let text_log = wait_log(&log, "No bootable device", Duration::from_secs(180));
    let counts = firmware::counts_in(&text_log);
    let &(last, produced, refused) = counts.last().expect("a counts line per boot attempt");
    let boots = counts.len();
    assert_eq!(usize::try_from(last).unwrap() + 1, boots, "{text_log}");
    assert_eq!(refused, 0, "the ring refused records: {text_log}");
    // Every attempt but the last (no device left) printed SeaBIOS's own line.
    assert_eq!(
        text_log.matches(BOOTING_LINE).count() + 1,
        boots,
        "{text_log}"
    );
    let (ok, exact_err) = stop_reader(exact, &exact_out);
    assert!(ok, "record --from-memory --trust-raw-tsc: {exact_err}");
    println!("SeaBIOS, --trust-raw-tsc: {}", exact_err.trim());
    let (ok, beacon_err) = stop_reader(beacons, &beacon_out);
    assert!(ok, "record --from-memory (beacons): {beacon_err}");
    println!("SeaBIOS, beacons: {}", beacon_err.trim());
    println!(
        "SeaBIOS: {boots} boot attempts, {produced} records produced by the firmware, {refused} refused"
    );
    let kvm = truth_mapping(pid, 0).expect("truth from debugfs");

    for (what, stderr, path) in [
        ("--trust-raw-tsc", &exact_err, &exact_out),
        ("beacons", &beacon_err, &beacon_out),
    ] {
        assert!(stderr.contains("across 0 mapping"), "{what}: {stderr}");
        let lines = lines_of(path);
        assert_phases_then_boots(&lines, boots, what);
        // Every record the firmware stored is accounted for.
        let read_beacons = count_before(stderr, "beacons (");
        let overwritten = count_before(stderr, "overwritten,");
        assert_eq!(
            lines.len() as u64 + read_beacons + overwritten,
            produced,
            "{what}: events + beacons + overwritten = the firmware's produced count: {stderr}"
        );
        assert_eq!(count_before(stderr, "refused,"), 0, "{what}: {stderr}");
        let mut widths = Vec::new();
        for v in &lines {
            let (exact_lo, exact_hi) = assert_holds_truth(v, &kvm, what);
            let (host_lo, host_hi) = (u(v, "host_lo"), u(v, "host_hi"));
            assert!(
                (exact_lo..=exact_hi).contains(&u(v, "host_tsc")),
                "{what}: the point is not the exact host time: {v}"
            );
            widths.push(host_hi - host_lo);
        }
        widths.sort_unstable();
        println!(
            "SeaBIOS, {what}: {} events, interval widths min {} median {} max {} ticks",
            lines.len(),
            widths[0],
            widths[widths.len() / 2],
            widths[widths.len() - 1]
        );
        if what == "beacons" {
            assert!(stderr.contains("in intervals from the beacons"), "{stderr}");
            assert!(stderr.contains("0 disagree with KVM's mapping"), "{stderr}");
        } else {
            assert!(stderr.contains("host time exact (KVM debugfs)"), "{stderr}");
            assert_eq!(widths[widths.len() - 1], 0, "exact mode is width 0");
        }
    }

    // SeaBIOS now waits for ever with its ring intact: a last reader writes the same records
    // into trace.dat, and trace-cmd reads every event back.
    let dat = dir.path().join("seabios.dat");
    let events = lines_of(&exact_out).len();
    let o = crate::util::guarded_output(
        vmtsync()
            .args([
                "record",
                "--from-memory",
                "--trust-raw-tsc",
                "--vm",
                &pid.to_string(),
            ])
            .args([
                "--events",
                &events.to_string(),
                "--duration",
                "60",
                "--no-progress",
            ])
            .args(["--format", "trace-cmd", "--out"])
            .arg(&dat),
        b"",
    );
    assert!(
        o.status.success(),
        "record (trace.dat): {}",
        text(&o.stderr)
    );
    let rep = trace_cmd(&["report", "-i", dat.to_str().unwrap()]);
    assert!(
        rep.status.success(),
        "trace-cmd report: {}",
        text(&rep.stderr)
    );
    let report = text(&rep.stdout);
    let ids: Vec<&str> = report
        .lines()
        .filter(|l| l.contains("payload="))
        .filter_map(|l| l.split("id=").nth(1)?.split_whitespace().next())
        .filter(|id| {
            ![FW_CFG_CTL_EVENTS, FW_CFG_DMA_EVENTS]
                .iter()
                .any(|&(b, a)| *id == b.to_string() || *id == a.to_string())
        })
        .collect();
    let mut expected: Vec<String> = expected_phase_events()
        .iter()
        .map(|(begin, _)| if *begin { PHASE_BEGIN } else { PHASE_END }.to_string())
        .collect();
    expected.extend(vec![BOOT_EVENT.to_string(); boots]);
    assert_eq!(ids, expected, "trace-cmd report of trace.dat:\n{report}");
    drop(qemu);
}

/// `vmtsync record --from-memory --guest-phys … --beacon-port … -- qemu-system-x86_64 …`: the
/// reader starts QEMU itself, paused, arms the `kvm_pio` trace of the beacon port, then
/// resumes it, so the firmware's first beacons are bracketed too (before, the first three
/// never were: the trace started only once the header naming the port was found). The
/// recorder is located at its guest-physical address, which it is published at only after
/// the reader attached (the reader waits for it there).
fn seabios_started_by_the_reader_brackets_every_beacon_from_the_first() {
    let test = "seabios_started_by_the_reader_brackets_every_beacon_from_the_first";
    let out = firmware::build(Variant::Traced).expect("the traced SeaBIOS builds");
    let dir = scratch(test);
    let log = dir.path().join("debug.log");
    let jsonl = dir.path().join("launched.jsonl");
    let qemu = command_firmware(&out.join("bios.bin"), &log, MEMORY_MIB);
    let rec = launch_reader(
        &qemu,
        &jsonl,
        &["--format", "jsonl", "--duration", "180"],
        &[],
    );
    let text_log = wait_log(&log, "No bootable device", Duration::from_secs(180));
    // The VMM is the reader's child: KVM's mapping of its vCPU 0 is the truth.
    let qemu_pid = launched_qemu(&rec);
    let kvm = truth_mapping(qemu_pid, 0).expect("truth from debugfs");
    let counts = firmware::counts_in(&text_log);
    let &(_, produced, refused) = counts.last().expect("a counts line per boot attempt");
    assert_eq!(refused, 0, "{text_log}");
    let (ok, stderr) = stop_reader(rec, &jsonl);
    assert!(ok, "record --from-memory -- qemu: {stderr}");
    println!("SeaBIOS, started by the reader: {}", stderr.trim());
    // The reader ended the VMM it started.
    assert!(
        !Path::new(&format!("/proc/{qemu_pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{qemu_pid}/stat"))
                .is_ok_and(|s| !s.contains("qemu")),
        "QEMU (PID {qemu_pid}) outlived the reader"
    );
    let lines = lines_of(&jsonl);
    assert_phases_then_boots(&lines, counts.len(), "launched");
    let read_beacons = count_before(&stderr, "beacons (");
    let bracketed = count_before(&stderr, "bracketed by kvm_pio exits");
    let early = count_before(&stderr, "before the trace saw them whole");
    let overwritten = count_before(&stderr, "overwritten,");
    assert_eq!(
        lines.len() as u64 + read_beacons + overwritten,
        produced,
        "events + beacons + overwritten = the firmware's produced count: {stderr}"
    );
    assert!(read_beacons > 0, "{stderr}");
    assert_eq!(early, 0, "no beacon before the trace: {stderr}");
    assert_eq!(bracketed, read_beacons, "every beacon bracketed: {stderr}");
    for v in &lines {
        assert_holds_truth(v, &kvm, "launched");
    }
}
