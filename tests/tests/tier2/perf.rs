//! Tier 2: `vmtsync export perf` fed to the real `perf inject --guest-data` (perf 6.1 from
//! Debian's `linux-perf`), its output read back with the real `perf script`.
//!
//! perf merges a guest's perf.data into a host's: it finds the VM's vCPU threads by their QEMU
//! names (`CPU N/KVM`, which `-name …,debug-threads=on` gives them) among the host file's COMM
//! records and copies the guest's side-band records (mmap, comm, task, context switch; never
//! its samples) onto the host's timeline as `(t − offset) / scale`. Here a stand-in "guest"
//! perf.data is recorded on this machine (as the attach tests stand in for a Linux guest with a
//! trace made here), the host perf.data while a real QEMU VM runs, and the argument comes from
//! `export perf --vm PID` reading that VM's live KVM mapping from debugfs, then from a fixture
//! tree naming the same VM with a non-zero offset and scale 2 (KVM here cannot run a guest with
//! either: docs/host-quirks.md). The truth is the input files' records (`perf script` on them)
//! and the mapping's values read from debugfs or written by the test; the printed argument is
//! only what is checked. What perf needs and what this machine cannot give: docs/perf.md.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vmtsync::kvm::hosttsc::read_host_tsc;
use vmtsync_tests::require;
use vmtsync_tests::truth::truth_mapping;

use crate::util::vmtsync;
use crate::util::{boot_qemu_with, have_program, scratch, text, vm_ready};

crate::trials!(
    perf_ready;
    perf_inject_moves_the_guests_records_exactly_as_export_perf_says,
);

/// KVM's debugfs, where the live VM's directory is.
const KVM_DEBUGFS: &str = "/sys/kernel/debug/kvm";

/// `perf script` options that print every side-band record perf inject copies from a guest
/// (context switches, comm/fork/exit, mmap), with the machine PID and vCPU of injected ones
/// and full nanoseconds. The CPU is left out: perf rewrites an injected record's CPU to the
/// host CPU its vCPU last ran on.
const SCRIPT_ARGS: &[&str] = &[
    "--show-switch-events",
    "--show-task-events",
    "--show-mmap-events",
    "-F",
    "machine_pid,vcpu,pid,tid,time",
    "--ns",
];

/// Runs `perf ARGS` to success (a failure shows perf's stderr) and returns its stdout.
/// The test's prerequisites: [`vm_ready`] and perf.
fn perf_ready(test: &str) -> bool {
    vm_ready(test)
        && require(
            test,
            have_program("perf"),
            "perf is missing (apt-get install linux-perf, or cargo xtask setup)",
        )
}

fn perf(args: &[&str]) -> String {
    let o = Command::new("perf")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("perf runs");
    assert!(
        o.status.success(),
        "perf {args:?}: {}{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    text(&o.stdout)
}

/// `perf record` of context switches and side-band records into `out` while `sleep` runs:
/// `-a` for the host (every thread's COMM, the VM's vCPU threads among them), `-C 0` for the
/// stand-in guest (every record on CPU 0, which perf takes for vCPU 0: a guest record on a CPU
/// the VM has no vCPU for is refused). `--sample-identifier` because perf inject needs the
/// guest's sample IDs to map them to new host ones.
fn perf_record(out: &Path, cpus: &str, sleep: &str) {
    let mut args = vec!["record", cpus];
    args.extend(["--switch-events", "--sample-identifier", "-o"]);
    args.extend([out.to_str().unwrap(), "--", "sleep", sleep]);
    perf(&args);
}

/// Whether `file` holds a TIME_CONV record (perf's TSC conversion of its timestamps).
fn has_time_conv(file: &Path) -> bool {
    perf(&["report", "-D", "-i", file.to_str().unwrap()]).contains("PERF_RECORD_TIME_CONV")
}

/// One side-band record as `perf script` prints it: its time in ns, `pid/tid`, and the text
/// after the time (`PERF_RECORD_… …`).
type Record = (u64, String, String);

/// The side-band records of `perf script` output: the host machine's (`vm` None) or those
/// injected for the VM of process `vm` on vCPU 0.
fn side_band(script: &str, vm: Option<u32>) -> Vec<Record> {
    let mut v: Vec<Record> = script
        .lines()
        .filter_map(|l| {
            // Injected records start `VM:  PID VCPU:NNN` (the PID padded to a width).
            let l = match (l.strip_prefix("VM:"), vm) {
                (Some(rest), Some(want)) => {
                    let (p, rest) = rest.trim_start().split_once(char::is_whitespace)?;
                    let (v, rest) = rest
                        .trim_start()
                        .strip_prefix("VCPU:")?
                        .split_once(char::is_whitespace)?;
                    if p.parse::<u32>().ok()? != want || v != "000" {
                        return None;
                    }
                    rest
                }
                (None, None) => l,
                _ => return None,
            };
            let at = l.find(": PERF_RECORD_")?;
            let mut head = l[..at].split_whitespace().rev();
            let time = head.next()?.replace('.', "").parse().ok()?;
            let who = head.next().unwrap_or("").to_owned();
            Some((time, who, l[at + 2..].trim_end().to_owned()))
        })
        .collect();
    v.sort();
    v
}

/// The live VM's debugfs directory name (`PID-FD`), once KVM has created it.
fn vm_dir(pid: u32) -> Option<String> {
    std::fs::read_dir(KVM_DEBUGFS)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .find(|n| {
            n.starts_with(&format!("{pid}-"))
                && Path::new(KVM_DEBUGFS).join(n).join("vcpu0").is_dir()
        })
}

/// Whether process `pid` has a thread QEMU named `CPU 0/KVM`.
fn has_vcpu_thread(pid: u32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|d| {
        d.filter_map(Result::ok).any(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "CPU 0/KVM")
        })
    })
}

/// `vmtsync export perf ARGS` to success: the one line it prints.
fn export_perf(args: &[&str]) -> String {
    let o = vmtsync()
        .args(["export", "perf"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run vmtsync");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    text(&o.stdout)
}

/// Checks that `export perf` printed `--guest-data=GUEST,PID,OFFSET[,SCALE]` for the mapping
/// `(offset, scale)` (the truth: debugfs or the fixture written), runs the real
/// `perf inject -i HOST ARG -o OUT` with the argument exactly as printed and checks with
/// `perf script`: the host's records are all there unchanged, and the guest's side-band
/// records appear as the VM's, each at `(t − offset) / scale` of its time in the guest file
/// (perf leaves time 0, the records synthesized at the start, at 0).
fn check_inject(
    dir: &Path,
    name: &str,
    (host, host_in): (&Path, &[Record]),
    (guest, guest_in): (&Path, &[Record]),
    (printed, pid, offset, scale): (&str, u32, i64, u64),
) {
    let scale_arg = if scale == 1 {
        String::new()
    } else {
        format!(",{scale}")
    };
    let arg = format!("--guest-data={},{pid},{offset}{scale_arg}", guest.display());
    assert_eq!(
        printed,
        format!("{arg}\n"),
        "{name}: export perf's argument"
    );
    // perf gets the argument exactly as printed, not the test's own rendering of it.
    let arg = printed.trim_end();
    let out = dir.join(format!("{name}.data"));
    perf(&[
        "inject",
        "-i",
        host.to_str().unwrap(),
        arg,
        "-o",
        out.to_str().unwrap(),
    ]);
    let script = perf(&[&["script", "-i", out.to_str().unwrap()][..], SCRIPT_ARGS].concat());
    assert_eq!(
        side_band(&script, None),
        host_in,
        "{name}: the host's records"
    );
    let mut want: Vec<Record> = guest_in
        .iter()
        .map(|(t, who, what)| {
            let moved = t.wrapping_sub(offset.cast_unsigned());
            // perf divides in double precision: exact, and so comparable with integer
            // division, while the dividend fits in a double's 53-bit mantissa.
            assert!(
                *t == 0 || moved < 1 << 53,
                "{name}: {t} − {offset} beyond 2^53"
            );
            let host_t = if *t == 0 { 0 } else { moved / scale };
            (host_t, who.clone(), what.clone())
        })
        .collect();
    want.sort();
    let got = side_band(&script, Some(pid));
    let moved = guest_in.iter().filter(|r| r.0 != 0).count();
    if got != want {
        let missing: Vec<_> = want.iter().filter(|r| !got.contains(r)).take(3).collect();
        let extra: Vec<_> = got.iter().filter(|r| !want.contains(r)).take(3).collect();
        panic!(
            "{name}: {} guest records injected, {} expected; expected but missing {missing:?}; \
             injected but not expected {extra:?}; perf script's first VM lines: {:?}",
            got.len(),
            want.len(),
            script
                .lines()
                .filter(|l| l.starts_with("VM:"))
                .take(3)
                .collect::<Vec<_>>()
        );
    }
    let first = want.iter().find(|r| r.0 != 0).expect("a moved record");
    println!(
        "perf inject {arg}: {} guest records as VM {pid}'s ({moved} moved, e.g. {} -> {} ns), \
         {} host records unchanged",
        got.len(),
        guest_in.iter().find(|r| r.0 != 0).unwrap().0,
        first.0,
        host_in.len()
    );
}

/// Tier 2 (KVM, QEMU, perf, root): the argument `export perf --vm PID` prints for a running
/// QEMU VM is its debugfs mapping (offset, no scale for identity), and the real `perf inject`
/// given it puts every side-band record of a guest perf.data on the host's timeline exactly as
/// that mapping says; then the same through a fixture tree for the same VM with a negative
/// offset derived from the host TSC and scale 2 (`--guest-data=…,PID,-O,2`), which checks
/// the sign and scale format against perf's own arithmetic.
fn perf_inject_moves_the_guests_records_exactly_as_export_perf_says() {
    let dir = scratch("perf");
    let (qemu_guard, _sock) = boot_qemu_with(
        dir.path(),
        "transport=uart",
        &["-name", "vmtsync-perf,debug-threads=on"],
    );
    let pid = qemu_guard.pid();
    let end = Instant::now() + Duration::from_secs(20);
    let vm = loop {
        if let Some(vm) = vm_dir(pid).filter(|_| has_vcpu_thread(pid)) {
            break vm;
        }
        assert!(
            Instant::now() < end,
            "QEMU {pid}: no VM in debugfs or no CPU 0/KVM thread"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let host = dir.path().join("host.data");
    let guest = dir.path().join("guest.data");
    perf_record(&host, "-a", "0.3");
    perf_record(&guest, "-C0", "0.2");
    // Without TIME_CONV perf applies the offset and scale to the records' own timestamps
    // (perf_clock ns), which is what this test models; with it perf would convert through
    // the TSC first (docs/perf.md).
    assert!(
        !has_time_conv(&host) && !has_time_conv(&guest),
        "perf wrote TIME_CONV here: this kernel's perf clock is the native TSC sched_clock, \
         so perf converts through the TSC and this test's model of perf's times needs it too"
    );
    let script =
        |f: &Path| perf(&[&["script", "-i", f.to_str().unwrap()][..], SCRIPT_ARGS].concat());
    let guest_in = side_band(&script(&guest), None);
    let host_in = side_band(&script(&host), None);
    assert!(
        guest_in.iter().filter(|r| r.0 != 0).count() >= 10,
        "the stand-in guest recorded too few timed records: {guest_in:?}"
    );
    let guest_s = guest.to_str().unwrap();

    // The live mapping: what debugfs holds for vcpu0 (offset 0, identity scaling here).
    let truth = truth_mapping(pid, 0).expect("debugfs truth");
    let one = 1u64 << truth.frac_bits();
    assert_eq!(
        truth.ratio() % one,
        0,
        "an integer TSC ratio (no scaling on KVM here)"
    );
    let k = truth.ratio() / one;
    let printed = export_perf(&["--vm", &pid.to_string(), "--perf-data", guest_s]);
    check_inject(
        dir.path(),
        "live",
        (&host, &host_in),
        (&guest, &guest_in),
        (&printed, pid, truth.offset(), k),
    );

    // A fixture tree for the same VM: guest = offset + 2 host, the offset negative and derived
    // from the host TSC now (never a constant), every other file as debugfs has it.
    let offset = -i64::try_from(read_host_tsc().0 / 3).unwrap() - 12_345;
    let live = Path::new(KVM_DEBUGFS).join(&vm).join("vcpu0");
    let fixture: PathBuf = dir.path().join("kvm");
    let vcpu = fixture.join(&vm).join("vcpu0");
    std::fs::create_dir_all(&vcpu).unwrap();
    for f in ["pid", "guest_mode"] {
        std::fs::copy(live.join(f), vcpu.join(f)).unwrap();
    }
    let files: BTreeMap<&str, String> = [
        ("tsc-offset", offset.to_string()),
        ("tsc-scaling-ratio", (2u64 << 48).to_string()),
        ("tsc-scaling-ratio-frac-bits", "48".to_owned()),
    ]
    .into();
    for (f, v) in &files {
        std::fs::write(vcpu.join(f), format!("{v}\n")).unwrap();
    }
    let printed = export_perf(&[
        "--vm",
        &pid.to_string(),
        "--perf-data",
        guest_s,
        "--debugfs-root",
        fixture.to_str().unwrap(),
    ]);
    check_inject(
        dir.path(),
        "scaled",
        (&host, &host_in),
        (&guest, &guest_in),
        (&printed, pid, offset, 2),
    );
    drop(qemu_guard);
}
