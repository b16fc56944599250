//! `vmtsync kvm` on fixture debugfs trees (`tests/fixtures/debugfs/*`): exact JSON (host TSC
//! brackets checked, then normalized) or exact error text and exit code.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::{Value, json};

use crate::util::{fixtures, guarded_output, vmtsync};

/// Runs `vmtsync kvm --json` on a fixture tree with its `proc/` (if any).
fn kvm_json(tree: &Path, extra: &[&str]) -> Output {
    let mut c = vmtsync();
    c.args(["kvm", "--json", "--debugfs-root"])
        .arg(tree.join("kvm"))
        .arg("--proc-root")
        .arg(tree.join("proc"))
        .args(extra);
    c.output().expect("run vmtsync")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).expect("utf-8 stdout")
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).expect("utf-8 stderr")
}

/// Parses the JSON, checks every bracket is non-empty and ordered, then zeroes the brackets.
pub fn normalized(o: &Output) -> Value {
    assert!(o.status.success(), "failed: {}", stderr(o));
    let mut v: Value = serde_json::from_str(&stdout(o)).expect("valid JSON");
    for vm in v["vms"].as_array_mut().expect("vms") {
        for c in vm["vcpus"].as_array_mut().expect("vcpus") {
            let (b, a) = (
                c["host_tsc_before"].as_u64().unwrap(),
                c["host_tsc_after"].as_u64().unwrap(),
            );
            assert!(b > 0 && b <= a, "bracket {b}..{a}");
            c["host_tsc_before"] = json!(0);
            c["host_tsc_after"] = json!(0);
        }
    }
    v
}

/// A vCPU object with a zeroed bracket.
fn vcpu(
    n: u32,
    off: i64,
    ratio: u64,
    frac: u32,
    present: bool,
    gm: Option<bool>,
    tid: Option<u32>,
) -> Value {
    json!({"vcpu": n, "tsc_offset": off, "tsc_scaling_ratio": ratio, "tsc_frac_bits": frac,
           "scaling_present": present, "guest_mode": gm, "thread_pid": tid,
           "host_tsc_before": 0, "host_tsc_after": 0})
}

#[test]
fn intel_tree_exact_json_and_names() {
    let tree = fixtures().join("intel");
    let o = kvm_json(&tree, &[]);
    let r = 351_843_720_888_320; // 1.25 * 2^48
    assert_eq!(
        normalized(&o),
        json!({"schema": 1, "vms": [
            {"pid": 1001, "fd": 11, "name": "web1", "vcpus": [
                vcpu(0, -123_456_789, r, 48, true, Some(false), Some(1010)),
                vcpu(1, -123_456_000, r, 48, true, Some(false), Some(1011))]},
            {"pid": 2002, "fd": 15, "name": "firecracker", "vcpus": [
                vcpu(0, 5000, 1 << 48, 48, true, Some(false), Some(2020))]}]})
    );
    assert_eq!(stderr(&o), "", "no warnings for a plain Intel tree");
    // --vm by QEMU name, by process name, by PID and by PID-FD.
    for (sel, pid) in [
        ("web1", 1001),
        ("firecracker", 2002),
        ("2002", 2002),
        ("1001-11", 1001),
    ] {
        let v = normalized(&kvm_json(&tree, &["--vm", sel]));
        let vms = v["vms"].as_array().unwrap();
        assert_eq!(vms.len(), 1, "{sel}");
        assert_eq!(vms[0]["pid"], json!(pid), "{sel}");
    }
    let o = kvm_json(&tree, &["--vm", "nope"]);
    assert_eq!(o.status.code(), Some(4));
    assert_eq!(
        stderr(&o),
        "vmtsync: no VM matches --vm nope; running VMs: 1001-11 (web1), 2002-15 (firecracker) (see `vmtsync kvm`)\n"
    );
}

#[test]
fn amd_tree_extreme_offsets_and_sparse_ids() {
    let o = kvm_json(&fixtures().join("amd"), &[]);
    let r = (1u64 << 32) - 65536;
    assert_eq!(
        normalized(&o),
        json!({"schema": 1, "vms": [{"pid": 3003, "fd": 9, "name": null, "vcpus": [
            vcpu(0, i64::MIN, r, 32, true, Some(false), Some(3030)),
            vcpu(2, i64::MAX, r, 32, true, Some(false), Some(3032)),
            vcpu(10, 0, r, 32, true, Some(false), None)]}]})
    );
}

#[test]
fn nested_vcpu_is_flagged_and_never_used_as_l1() {
    let tree = fixtures().join("nested");
    let o = kvm_json(&tree, &[]);
    assert_eq!(
        normalized(&o),
        json!({"schema": 1, "vms": [{"pid": 4004, "fd": 12, "name": null, "vcpus": [
            vcpu(0, -1000, 1, 0, false, Some(false), Some(4040)),
            vcpu(1, -777_000, 1, 0, false, Some(true), Some(4041))]}]})
    );
    assert!(
        stderr(&o).contains("vmtsync: warning: VM 4004-12 vcpu1 is running a nested guest (guest_mode=1): its tsc-offset and ratio are the combined L0->L2 mapping, not this VM's (L1) mapping\n"),
        "{}",
        stderr(&o)
    );
    // convert refuses the nested vCPU unless the input is declared to be L2 time.
    let convert = |extra: &[&str]| {
        let mut c = vmtsync();
        c.args(["convert", "--vm", "4004", "--debugfs-root"])
            .arg(tree.join("kvm"))
            .args(extra);
        guarded_output(&mut c, b"1777000\n")
    };
    let o = convert(&["--vcpu", "1"]);
    assert_eq!(o.status.code(), Some(6));
    assert_eq!(stdout(&o), "");
    assert!(
        stderr(&o)
            .starts_with("vmtsync: VM 4004-12 vcpu1 is running a nested guest (guest_mode=1)")
    );
    let o = convert(&["--vcpu", "1", "--nested-l2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), "2554000\n");
    let o = convert(&["--vcpu", "0"]);
    assert_eq!(stdout(&o), "1778000\n");
    let o = convert(&["--vcpu", "5"]);
    assert_eq!(o.status.code(), Some(4));
    assert_eq!(
        stderr(&o),
        "vmtsync: VM 4004-12 has no vcpu5; its vCPUs are: vcpu0, vcpu1\n"
    );
}

#[test]
fn missing_scaling_files_mean_identity_and_say_so() {
    let o = kvm_json(&fixtures().join("noscaling"), &[]);
    assert_eq!(
        normalized(&o),
        json!({"schema": 1, "vms": [{"pid": 5005, "fd": 7, "name": null, "vcpus": [
            vcpu(0, 0, 1, 0, false, Some(false), Some(5050)),
            vcpu(1, 0, 1, 0, false, None, None)]}]})
    );
    assert_eq!(
        stderr(&o),
        "vmtsync: warning: 2 vCPU(s) have no tsc-scaling-ratio files (this host has no TSC scaling): identity scaling assumed (ratio 1, frac bits 0)\n"
    );
}

/// Runs `vmtsync kvm --json` on a broken tree; returns (exit code, stderr).
fn failing(kvm_root: &Path) -> (Option<i32>, String) {
    let o = vmtsync()
        .args(["kvm", "--json", "--debugfs-root"])
        .arg(kvm_root)
        .output()
        .unwrap();
    assert_eq!(stdout(&o), "", "nothing on stdout when failing");
    (o.status.code(), stderr(&o))
}

#[test]
fn malformed_files_name_the_file_and_bytes() {
    let f = fixtures();
    let vcpu0 = |t: &str| f.join(t).join("kvm/6006-3/vcpu0");
    let cases: Vec<(&str, String)> = vec![
        (
            "bad-garbage",
            format!(
                "malformed {}/tsc-offset: expected a signed decimal integer, found \"12abc\\n\"",
                vcpu0("bad-garbage").display()
            ),
        ),
        (
            "bad-empty",
            format!(
                "malformed {}/tsc-offset: expected a signed decimal integer, found \"\"",
                vcpu0("bad-empty").display()
            ),
        ),
        (
            "bad-overlong",
            format!(
                "malformed {}/tsc-offset: expected a signed decimal integer, found \"{}...\"",
                vcpu0("bad-overlong").display(),
                "1".repeat(64)
            ),
        ),
        (
            "bad-nonutf8",
            format!(
                "malformed {}/tsc-offset: expected a signed decimal integer, found \"\\xff\\xfe\\x00-1\\n\"",
                vcpu0("bad-nonutf8").display()
            ),
        ),
        (
            "bad-guest-mode",
            format!(
                "malformed {}/guest_mode: expected 0 or 1, found \"2\\n\"",
                vcpu0("bad-guest-mode").display()
            ),
        ),
        (
            "bad-frac",
            format!(
                "malformed {}/tsc-scaling-ratio-frac-bits: expected an integer from 0 to 63, found \"64\\n\"",
                vcpu0("bad-frac").display()
            ),
        ),
        (
            "bad-ratio-zero",
            format!(
                "malformed {}/tsc-scaling-ratio: expected a non-zero unsigned decimal integer, found \"0\\n\"",
                vcpu0("bad-ratio-zero").display()
            ),
        ),
        (
            "bad-half-scaling",
            format!(
                "{0}/tsc-scaling-ratio exists but {0}/tsc-scaling-ratio-frac-bits does not: the kernel creates both or neither",
                vcpu0("bad-half-scaling").display()
            ),
        ),
        (
            "bad-missing-offset",
            format!(
                "{}/tsc-offset is missing: every KVM vCPU directory has it (is the debugfs root right?)",
                vcpu0("bad-missing-offset").display()
            ),
        ),
    ];
    for (tree, msg) in cases {
        let (code, err) = failing(&f.join(tree).join("kvm"));
        assert_eq!(code, Some(1), "{tree}: {err}");
        assert_eq!(err, format!("vmtsync: {msg}\n"), "{tree}");
    }
}

/// Copies a fixture tree into a fresh temp dir (files only; fixtures have no links).
fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dst);
        } else {
            fs::copy(e.path(), dst).unwrap();
        }
    }
}

/// A fresh temp dir that is removed when the test ends, even when it fails.
fn temp_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("vmtsync-it-{tag}-"))
        .tempdir()
        .unwrap()
}

/// Unreadable files, as far as root can be refused: root reads mode-000 files, so we test
/// what root cannot read as a value (a directory or a FIFO where a file belongs), and a real
/// EACCES by running the CLI as user `nobody` against a root-only (0700) tree.
#[test]
fn unreadable_entries_are_errors_not_hangs() {
    let td = temp_dir("unreadable");
    let d = td.path();
    let kvm = d.join("kvm");
    copy_tree(&fixtures().join("noscaling/kvm"), &kvm);
    let off = kvm.join("5005-7/vcpu0/tsc-offset");
    fs::remove_file(&off).unwrap();
    fs::create_dir(&off).unwrap();
    let (code, err) = failing(&kvm);
    assert_eq!(code, Some(1));
    assert_eq!(
        err,
        format!(
            "vmtsync: {} is not a regular file (a directory): is the debugfs root right?\n",
            off.display()
        )
    );
    fs::remove_dir(&off).unwrap();
    fs::write(&off, "0\n").unwrap();

    // A FIFO with no writer: a blocking open would hang forever; we must report it.
    let gm = kvm.join("5005-7/vcpu0/guest_mode");
    fs::remove_file(&gm).unwrap();
    let c = std::ffi::CString::new(gm.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let (code, err) = failing(&kvm);
    assert_eq!(code, Some(1));
    assert_eq!(
        err,
        format!(
            "vmtsync: {} is not a regular file (a FIFO): is the debugfs root right?\n",
            gm.display()
        )
    );
    fs::remove_file(&gm).unwrap();

    if vmtsync_tests::is_root() {
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        fs::set_permissions(&kvm, fs::Permissions::from_mode(0o700)).unwrap();
        let o = vmtsync()
            .args(["kvm", "--debugfs-root"])
            .arg(&kvm)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
        assert_eq!(
            stderr(&o),
            format!(
                "vmtsync: permission denied reading {}: KVM debugfs is readable by root only (run as root, e.g. with sudo)\n",
                kvm.display()
            )
        );
    }
}

#[test]
fn missing_debugfs_says_how_to_mount() {
    let td = temp_dir("unmounted");
    let d = td.path();
    let (code, err) = failing(&d.join("kvm"));
    assert_eq!(code, Some(3));
    assert_eq!(
        err,
        format!(
            "vmtsync: {}/kvm does not exist: debugfs is not mounted (as root: mount -t debugfs none /sys/kernel/debug, or rerun with --mount-debugfs)\n",
            d.display()
        )
    );
    fs::write(d.join("other"), "").unwrap();
    let (code, err) = failing(&d.join("kvm"));
    assert_eq!(code, Some(3));
    assert!(err.contains("is the kvm module loaded"), "{err}");
}

#[test]
fn table_output_lists_every_vcpu() {
    let tree = fixtures().join("amd");
    let o = vmtsync()
        .args(["kvm", "--debugfs-root"])
        .arg(tree.join("kvm"))
        .output()
        .unwrap();
    assert!(o.status.success());
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "VM 3003-9  name: -  vcpus: 3");
    assert_eq!(lines.len(), 5, "{out}");
    assert!(lines[2].contains("-9223372036854775808") && lines[2].contains("4294901760"));
    assert!(lines[4].trim_start().starts_with("10 "), "{}", lines[4]);
}

/// Watch mode on a fixture tree changed under it: every kind of change gives exactly one
/// event with the old and new values.
#[test]
fn watch_reports_each_change_once() {
    use std::io::BufRead;
    use std::sync::mpsc;
    use std::time::Duration;

    let td = temp_dir("watch");
    let d = td.path();
    let kvm = d.join("kvm");
    copy_tree(&fixtures().join("noscaling/kvm"), &kvm);
    let mut guard = vmtsync_tests::ChildGuard::new(
        vmtsync()
            .args(["kvm", "--watch", "--interval", "10", "--debugfs-root"])
            .arg(&kvm)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let out = guard.child().stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    // Changes must be atomic, or the watcher could catch a half-written file (a real error).
    let write = |p: PathBuf, text: &str| {
        let tmp = p.with_extension("new");
        fs::write(&tmp, text).unwrap();
        fs::rename(&tmp, &p).unwrap();
    };
    let stage = d.join("stage");
    let next = || -> Value {
        let l = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a watch event within 10 s");
        serde_json::from_str(&l).unwrap()
    };
    assert_eq!(next()["event"], "watch_started");
    let found = next();
    assert_eq!(
        (found["event"].as_str(), found["pid"].as_u64()),
        (Some("vm_found"), Some(5005))
    );
    assert_eq!(found["vcpus"].as_array().unwrap().len(), 2);

    // Offset change: one vcpu_changed with the previous and new offsets.
    write(kvm.join("5005-7/vcpu1/tsc-offset"), "-42\n");
    let e = next();
    assert_eq!(e["event"], "vcpu_changed", "{e}");
    assert_eq!(
        (e["vcpu"]["vcpu"].as_u64(), e["vcpu"]["tsc_offset"].as_i64()),
        (Some(1), Some(-42))
    );
    assert_eq!(e["previous"]["tsc_offset"], 0);

    // Nested entry: guest_mode flips.
    write(kvm.join("5005-7/vcpu0/guest_mode"), "1\n");
    let e = next();
    assert_eq!(
        (e["event"].as_str(), e["vcpu"]["guest_mode"].as_bool()),
        (Some("vcpu_changed"), Some(true))
    );

    // vCPU added, then removed.
    let v3 = kvm.join("5005-7/vcpu3");
    fs::create_dir_all(stage.join("vcpu3")).unwrap();
    fs::write(stage.join("vcpu3/tsc-offset"), "7\n").unwrap();
    fs::rename(stage.join("vcpu3"), &v3).unwrap();
    let e = next();
    assert_eq!(
        (
            e["event"].as_str(),
            e["vcpu"]["vcpu"].as_u64(),
            e["vcpu"]["tsc_offset"].as_i64()
        ),
        (Some("vcpu_added"), Some(3), Some(7))
    );
    fs::rename(&v3, stage.join("vcpu3-gone")).unwrap();
    let e = next();
    assert_eq!(
        (e["event"].as_str(), e["vcpu"].as_u64()),
        (Some("vcpu_removed"), Some(3))
    );

    // A second VM appears, then the first goes.
    copy_tree(&kvm.join("5005-7"), &stage.join("6006-9"));
    fs::rename(stage.join("6006-9"), kvm.join("6006-9")).unwrap();
    let e = next();
    assert_eq!(
        (e["event"].as_str(), e["pid"].as_u64(), e["fd"].as_u64()),
        (Some("vm_added"), Some(6006), Some(9))
    );
    // Moved out in one rename: a recursive delete in place is not atomic, and a poll that
    // caught it half done would rightly report vCPUs removed before the VM is gone.
    fs::rename(kvm.join("5005-7"), stage.join("5005-7-gone")).unwrap();
    let e = next();
    assert_eq!(
        (e["event"].as_str(), e["pid"].as_u64()),
        (Some("vm_gone"), Some(5005))
    );
    assert!(e["host_tsc_before"].as_u64() <= e["host_tsc_after"].as_u64());

    // Nothing else happened, so nothing else is reported.
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "spurious event"
    );
    drop(guard);
}

/// `vcpu01` is not a name the kernel writes (`"vcpu%d"`): it is skipped, and the VM's real
/// vCPUs are still listed (it used to be read as `vcpu1`, which is absent, and the whole VM
/// vanished from the output as if it had exited).
#[test]
fn vcpu_names_with_leading_zeros_are_not_vcpus() {
    let td = temp_dir("leading-zero");
    let kvm = td.path().join("kvm");
    copy_tree(&fixtures().join("noscaling/kvm"), &kvm);
    fs::rename(kvm.join("5005-7/vcpu1"), kvm.join("5005-7/vcpu01")).unwrap();
    let o = kvm_json(td.path(), &[]);
    assert_eq!(
        normalized(&o),
        json!({"schema": 1, "vms": [{"pid": 5005, "fd": 7, "name": null, "vcpus": [
            vcpu(0, 0, 1, 0, false, Some(false), Some(5050))]}]})
    );
}
