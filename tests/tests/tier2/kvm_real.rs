//! Tier 2: `vmtsync kvm` against real KVM VMs created by the `idle-vmm` child process.
//!
//! Truth: what the child VMM itself read and printed, never this host's quirks (offset 0 on
//! nested KVM, a large negative offset on an ordinary host): the vCPU thread TIDs, and each
//! vCPU's guest TSC (`KVM_GET_MSRS`) between two host TSC reads, which the reported mapping
//! must reproduce.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;
use vmtsync::kvm::debugfs::DEFAULT_KVM_DEBUGFS;
use vmtsync::kvm::hosttsc::read_host_tsc;
use vmtsync_core::HostTicks;
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_tests::idle_vmm::IdleVmmChild;
use vmtsync_tests::{ChildGuard, have_kvm, is_root, require};

use crate::util::vmtsync;

crate::trials!(
    prerequisites;
    finds_real_vms_with_exact_vcpus_threads_and_their_true_mapping,
    watch_reports_vm_gone_and_exits_zero,
    unmounted_debugfs_is_explained_and_mounted_on_request,
    watch_survives_vms_killed_mid_read;
    trace_events_ready;
    trace_events_see_offset_writes_and_clean_up,
);

fn idle_vmm() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_idle-vmm"))
}

/// The module's tier-2 prerequisites: root and `/dev/kvm`; then mounts debugfs through
/// `--mount-debugfs` if needed, which must succeed.
fn prerequisites(test: &str) -> bool {
    if !require(test, is_root(), "needs root (KVM debugfs is root-only)")
        || !require(test, have_kvm(), "/dev/kvm is not accessible read-write")
    {
        return false;
    }
    let o = vmtsync()
        .args(["kvm", "--json", "--mount-debugfs"])
        .output()
        .expect("run vmtsync");
    require(
        test,
        o.status.success() && Path::new(DEFAULT_KVM_DEBUGFS).is_dir(),
        &format!(
            "KVM debugfs unavailable: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

/// [`prerequisites`] and a tracefs with `kvm:kvm_write_tsc_offset`.
fn trace_events_ready(test: &str) -> bool {
    prerequisites(test)
        && require(
            test,
            vmtsync::ftrace::find_tracefs(None, vmtsync::ftrace::tsc_offset::EVENT).is_ok(),
            "no tracefs with kvm:kvm_write_tsc_offset",
        )
}

/// `vmtsync kvm --json --vm PID`, polled until every vCPU has run (its `pid` file is set).
fn scan_until_threads_known(pid: u32, vcpus: usize) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let o = vmtsync()
            .args(["kvm", "--json", "--vm", &pid.to_string()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        let known = v["vms"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|vm| vm["vcpus"].as_array().unwrap())
            .filter(|c| !c["thread_pid"].is_null())
            .count();
        if known == vcpus {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "vCPU threads not all in debugfs after 15 s: {v}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn finds_real_vms_with_exact_vcpus_threads_and_their_true_mapping() {
    // Two VMs in one process, with sparse vCPU ids: 0, 1 and 5.
    let ids = [0u32, 1, 5];
    let mut vmm = IdleVmmChild::spawn(idle_vmm(), 2, &ids).expect("start idle-vmm");
    let t0 = read_host_tsc().0;
    let v = scan_until_threads_known(vmm.pid(), 2 * ids.len());
    let t1 = read_host_tsc().0;
    let vms = v["vms"].as_array().unwrap();
    assert_eq!(v["schema"], 1);
    assert_eq!(vms.len(), 2, "{v}");
    for (vm, child_vm) in vms.iter().zip(&vmm.vms) {
        assert_eq!(vm["pid"], vmm.pid());
        assert_eq!(vm["fd"], child_vm.fd, "debugfs <pid>-<fd> is the VM fd");
        assert_eq!(vm["name"], "idle-vmm");
        let vcpus = vm["vcpus"].as_array().unwrap();
        assert_eq!(vcpus.len(), ids.len());
        for (c, &(id, tid)) in vcpus.iter().zip(&child_vm.vcpus) {
            assert_eq!(c["vcpu"], id);
            assert_eq!(
                c["thread_pid"], tid,
                "vcpu{id} runs on the thread the VMM reported"
            );
            // The truth from the VMM: the guest TSC it read through KVM_GET_MSRS between two
            // host TSC reads must be what the reported mapping gives inside that bracket.
            let t = child_vm
                .tsc
                .iter()
                .find(|t| t.vcpu == id)
                .expect("a reading");
            let m = KvmTscMapping::try_new(
                c["tsc_offset"].as_i64().unwrap(),
                c["tsc_scaling_ratio"].as_u64().unwrap(),
                u32::try_from(c["tsc_frac_bits"].as_u64().unwrap()).unwrap(),
            )
            .unwrap();
            let at = |h| m.try_guest_from_host(HostTicks(h)).unwrap().0;
            assert!(
                at(t.host_before) <= t.guest && t.guest <= at(t.host_after),
                "vcpu{id}: {c} maps [{}, {}] to [{}, {}], but the VMM read guest TSC {}",
                t.host_before,
                t.host_after,
                at(t.host_before),
                at(t.host_after),
                t.guest
            );
            assert_eq!(c["guest_mode"], false);
            let (b, a) = (
                c["host_tsc_before"].as_u64().unwrap(),
                c["host_tsc_after"].as_u64().unwrap(),
            );
            assert!(
                t0 <= b && b <= a && a <= t1,
                "bracket {b}..{a} outside {t0}..{t1}"
            );
        }
    }
    // --vm by the process name finds the same VMs (among possibly others).
    let o = vmtsync()
        .args(["kvm", "--json", "--vm", "idle-vmm"])
        .output()
        .unwrap();
    let by_name: Value = serde_json::from_slice(&o.stdout).unwrap();
    let ours = by_name["vms"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|vm| vm["pid"] == vmm.pid())
        .count();
    assert_eq!(ours, 2);
    vmm.shutdown().expect("idle-vmm exits cleanly");
}

/// Reads lines from a child's stdout on a thread, so waits can have deadlines.
fn line_reader(stdout: std::process::ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Serializes the tests that watch the whole KVM debugfs tree: the kill-mid-read stress test
/// churns VMs (and `kvm_write_tsc_offset` events) fast enough to delay the other watchers'
/// events past their deadlines on a loaded 2-core machine. Poisoning is ignored: the lock only
/// orders the tests.
static WATCHERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn watchers_lock() -> std::sync::MutexGuard<'static, ()> {
    WATCHERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How long a watch test waits for an event it expects. A liveness bound, not a speed claim:
/// alone each arrives within a poll (20 ms), but under the whole tier-2 suite (other tests'
/// spinning vCPUs on two cores) a `vm_gone` once took over 10 s to come.
const WATCH_WAIT_S: u64 = 60;

/// Next JSON event satisfying `pred`, within `secs`.
fn next_event(
    rx: &mpsc::Receiver<String>,
    secs: u64,
    mut pred: impl FnMut(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .unwrap_or_else(|e| panic!("no matching watch event within {secs} s: {e}"));
        let v: Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad JSON line {line}: {e}"));
        assert_eq!(v["schema"], 1, "{line}");
        if pred(&v) {
            return v;
        }
    }
}

fn watch_reports_vm_gone_and_exits_zero() {
    let _serial = watchers_lock();
    let mut vmm = IdleVmmChild::spawn(idle_vmm(), 2, &[0, 3]).expect("start idle-vmm");
    let pid = vmm.pid();
    scan_until_threads_known(pid, 4);
    let mut watch = ChildGuard::new(
        vmtsync()
            .args([
                "kvm",
                "--watch",
                "--interval",
                "20",
                "--vm",
                &pid.to_string(),
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let rx = line_reader(watch.child().stdout.take().unwrap());
    next_event(&rx, WATCH_WAIT_S, |v| v["event"] == "watch_started");
    for child_vm in &vmm.vms {
        let v = next_event(&rx, WATCH_WAIT_S, |v| {
            v["event"] == "vm_found" && v["fd"] == child_vm.fd
        });
        assert_eq!(v["pid"], pid);
        assert_eq!(v["vcpus"].as_array().unwrap().len(), 2);
    }
    vmm.shutdown().expect("idle-vmm exits cleanly");
    let mut gone = Vec::new();
    for _ in 0..2 {
        let v = next_event(&rx, WATCH_WAIT_S, |v| v["event"] == "vm_gone");
        assert_eq!(v["pid"], pid);
        assert!(v["host_tsc_before"].as_u64().unwrap() <= v["host_tsc_after"].as_u64().unwrap());
        gone.push(v["fd"].as_u64().unwrap());
    }
    gone.sort_unstable();
    let mut fds: Vec<u64> = vmm.vms.iter().map(|v| u64::from(v.fd)).collect();
    fds.sort_unstable();
    assert_eq!(gone, fds);
    // The stream ends by itself with status 0 once its VMs are gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = watch.child().try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "watch did not exit after its VMs were gone"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
}

fn trace_events_see_offset_writes_and_clean_up() {
    let _serial = watchers_lock();
    let tracefs = vmtsync::ftrace::find_tracefs(None, vmtsync::ftrace::tsc_offset::EVENT);
    let mut watch = ChildGuard::new(
        vmtsync()
            .args(["kvm", "--watch", "--interval", "20", "--trace-events"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let watch_pid = watch.pid();
    let instance = tracefs
        .unwrap()
        .join("instances")
        .join(format!("vmtsync-watch-{watch_pid}"));
    let rx = line_reader(watch.child().stdout.take().unwrap());
    let started = next_event(&rx, WATCH_WAIT_S, |v| v["event"] == "watch_started");
    assert_eq!(started["trace_events"], true);
    assert!(
        instance.is_dir(),
        "private tracefs instance exists while watching"
    );

    let mut vmm = IdleVmmChild::spawn(idle_vmm(), 1, &[0, 2]).expect("start idle-vmm");
    let pid = vmm.pid();
    scan_until_threads_known(pid, 2);
    // Collect everything up to this VMM's vm_gone; the order of trace and poll events between
    // them is not fixed. The watch polls, so a VM that comes and goes between two of its scans
    // is never listed (and never gone): the VMM ends only once the watch has listed it. (Ended
    // at once, it sometimes lived less than a scan interval: no vm_added, no vm_gone.)
    let mut seen = Vec::new();
    next_event(&rx, WATCH_WAIT_S, |v| {
        seen.push(v.clone());
        (v["event"] == "vm_added" || v["event"] == "vm_found") && v["pid"] == pid
    });
    vmm.shutdown().unwrap();
    let gone = next_event(&rx, WATCH_WAIT_S, |v| {
        seen.push(v.clone());
        v["event"] == "vm_gone" && v["pid"] == pid
    });
    assert!(gone["host_tsc_before"].as_u64() <= gone["host_tsc_after"].as_u64());
    // KVM writes each vCPU's offset when the VMM creates it, on the VMM's creating thread.
    for id in [0, 2] {
        let w = seen
            .iter()
            .find(|v| v["event"] == "tsc_offset_written" && v["thread"] == pid && v["vcpu"] == id)
            .unwrap_or_else(|| panic!("no kvm_write_tsc_offset for vcpu{id}: {seen:?}"));
        assert_eq!(w["host_tsc_clock"], true);
        assert!(w["host_tsc"].as_u64().unwrap() >= started["host_tsc"].as_u64().unwrap());
    }
    // `vm_found` when the watch's first scan (emitted after watch_started, and slow while
    // other tests' VMs come and go) already lists the new VM; `vm_added` otherwise.
    assert!(
        seen.iter()
            .any(|v| (v["event"] == "vm_added" || v["event"] == "vm_found") && v["pid"] == pid),
        "{seen:?}"
    );

    // SIGTERM ends watch mode cleanly: status 0 and the tracefs instance removed.
    watch.signal(libc::SIGTERM).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = watch.child().try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "watch ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
    assert!(!instance.exists(), "tracefs instance left behind");
}

/// Runs `vmtsync args…` in a private mount namespace where debugfs is unmounted, so the
/// "not mounted" advice and `--mount-debugfs` are tested for real without touching the host's
/// mounts.
fn in_unmounted_namespace(args: &[&str]) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let mut c = vmtsync();
    c.args(args);
    // SAFETY: the closure runs between fork and exec and only makes raw syscalls (no
    // allocation, no locks), which is what pre_exec requires.
    unsafe {
        c.pre_exec(|| {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Keep our mount changes out of the parent namespace.
            if libc::mount(
                c"none".as_ptr(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // Detach every mount stacked on the debugfs mount point.
            while libc::umount2(c"/sys/kernel/debug".as_ptr(), libc::MNT_DETACH) == 0 {}
            Ok(())
        });
    }
    c.output().expect("run vmtsync in a new mount namespace")
}

fn unmounted_debugfs_is_explained_and_mounted_on_request() {
    let o = in_unmounted_namespace(&["kvm", "--json"]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&o.stderr),
        "vmtsync: /sys/kernel/debug/kvm does not exist: debugfs is not mounted (as root: mount -t debugfs none /sys/kernel/debug, or rerun with --mount-debugfs)\n"
    );
    let mut vmm = IdleVmmChild::spawn(idle_vmm(), 1, &[0]).expect("start idle-vmm");
    let o = in_unmounted_namespace(&[
        "kvm",
        "--json",
        "--mount-debugfs",
        "--vm",
        &vmm.pid().to_string(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["vms"][0]["pid"], vmm.pid());
    assert_eq!(v["vms"][0]["vcpus"][0]["vcpu"], 0);
    vmm.shutdown().unwrap();
    assert!(
        Path::new(DEFAULT_KVM_DEBUGFS).is_dir(),
        "the host's debugfs mount is untouched"
    );
}

/// VMs killed (SIGKILL, by PID) while an unselected `--watch --interval 1` reads them: the
/// kernel tears a VM's debugfs directory down under the reader, whose reads then fail with
/// EIO/ENOENT. That is a VM exiting (a `vm_gone` event), not an error: the watch must outlive
/// 40 rounds of four kills and still end cleanly on SIGTERM. Before the fix it died with exit 1
/// "Input/output error" within a few kills.
fn watch_survives_vms_killed_mid_read() {
    let _serial = watchers_lock();
    let mut watch = ChildGuard::new(
        vmtsync()
            .args(["kvm", "--watch", "--interval", "1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let rx = line_reader(watch.child().stdout.take().unwrap());
    next_event(&rx, WATCH_WAIT_S, |v| v["event"] == "watch_started");
    let mut gone = 0;
    for round in 0..40 {
        // Four at a time, so teardowns overlap the watch's reads more often.
        let vmms: Vec<IdleVmmChild> = (0..4)
            .map(|_| {
                IdleVmmChild::spawn(idle_vmm(), 2, &[0, 1, 2, 3, 4, 5, 6, 7])
                    .expect("start idle-vmm")
            })
            .collect();
        let pids: Vec<u32> = vmms.iter().map(IdleVmmChild::pid).collect();
        // Dropping each guard sends SIGKILL to exactly its PID and reaps it.
        drop(vmms);
        if let Some(s) = watch.child().try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(watch.child().stderr.as_mut().unwrap(), &mut err)
                .unwrap();
            panic!("watch died at round {round} (idle-vmm {pids:?}): {s}: {err}");
        }
        while let Ok(l) = rx.try_recv() {
            let v: Value = serde_json::from_str(&l).unwrap();
            gone += usize::from(v["event"] == "vm_gone" && pids.iter().any(|&p| v["pid"] == p));
        }
    }
    println!("160 kills survived; {gone} vm_gone events seen in passing");
    watch.signal(libc::SIGTERM).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = watch.child().try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "watch ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
}
