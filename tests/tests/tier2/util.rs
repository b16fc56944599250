//! The tier-2 target's helpers: the set-up both targets share (`it/util.rs`, included here,
//! not copied) and what only tier-2 tests need: their prerequisite checks (each a
//! `fn(&str) -> bool` built from [`require`], for `trials!`), trace-cmd, QEMU boots of the
//! agent for `vmtsync record` sessions ([`QemuAgent`]) and host traces made the way this
//! machine's lockdown kernel allows ([`HostTrace`]: a private tracefs instance on `x86-tsc`,
//! then `trace-cmd extract`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use vmtsync::ftrace::Instance;
use vmtsync_tests::truth::truth_ready;
use vmtsync_tests::vmm::agent_elf;
use vmtsync_tests::vmm::qemu::{self, Machine, have_qemu};
use vmtsync_tests::{ChildGuard, have_kvm, is_root, require};

// The shared half; this target uses only some of it.
#[allow(dead_code)]
#[path = "../it/util.rs"]
mod shared;
pub(crate) use shared::*;

/// `trace-cmd report` arguments that show host ticks, not nanoseconds: `vmtsync record`'s
/// trace.dat carries a TSC2NSEC option (seconds on the host's clock), and a frequency of
/// 1 GHz makes trace-cmd's conversion the identity, so a test can compare with TSC truths.
pub(crate) const TICKS: [&str; 2] = ["--ts2secs", "1000000000"];

/// `(timestamp, seq)` of every `vmtsync` event line `trace-cmd report` printed.
pub(crate) fn report_events(out: &Output) -> Vec<(u64, u64)> {
    text(&out.stdout)
        .lines()
        .filter(|l| l.contains("payload="))
        .map(|l| {
            // `<idle>-0 [000] 1234.5678: event_data: id=256 len=8 payload=00 01 …`.
            let (_, ts) = report_cpu_ts(l);
            let hex: String = l
                .split("payload=")
                .nth(1)
                .unwrap()
                .split_whitespace()
                .collect();
            (ts, seq_of(&hex[..16]))
        })
        .collect()
}

/// trace-cmd with a closed stdin and its output captured.
pub(crate) fn trace_cmd(args: &[&str]) -> Output {
    Command::new("trace-cmd")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run trace-cmd")
}

/// The CPU and timestamp of one event line of `trace-cmd report`:
/// `comm-pid [CPU] 1234.567890: event: …`, or with `--raw-ts` `[CPU]12345:`. The timestamp is
/// its digits with the `.` removed (raw ticks, or nanoseconds with `-t`).
pub(crate) fn report_cpu_ts(line: &str) -> (usize, u64) {
    let (head, rest) = line
        .split_once(']')
        .unwrap_or_else(|| panic!("no [CPU] in {line}"));
    let cpu = head
        .rsplit('[')
        .next()
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("CPU in {line}"));
    let ts: String = rest
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let ts = ts
        .replace('.', "")
        .parse()
        .unwrap_or_else(|_| panic!("timestamp in {line}"));
    (cpu, ts)
}

/// Whether trace-cmd is installed; `false` (after [`require`] said why) when not.
pub(crate) fn have_trace_cmd(test: &str) -> bool {
    let ok = Command::new("trace-cmd")
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("trace-cmd version"));
    require(
        test,
        ok,
        "trace-cmd is not installed (apt-get install trace-cmd, or cargo xtask setup)",
    )
}

/// Whether `program --version` runs and succeeds (an installed tool).
pub(crate) fn have_program(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Tier 2 prerequisite of a test that runs a VM in-process (the tests' own VMM): `/dev/kvm`.
/// `false` (after [`require`] said why) when it is missing.
pub(crate) fn kvm_ready(test: &str) -> bool {
    require(test, have_kvm(), "/dev/kvm is not accessible read-write")
}

/// Tier 2 prerequisites of a test that runs a VM in-process and reads its truth from debugfs:
/// [`kvm_ready`], root and a mounted debugfs.
pub(crate) fn kvm_truth_ready(test: &str) -> bool {
    kvm_ready(test) && truth_ready(test)
}

/// Tier 2 prerequisites of a test that runs a QEMU VM and reads its truth from debugfs:
/// `/dev/kvm`, QEMU, root and a mounted debugfs. `false` (after [`require`] said why) when
/// one is missing.
pub(crate) fn vm_ready(test: &str) -> bool {
    kvm_ready(test)
        && require(
            test,
            have_qemu(),
            "qemu-system-x86_64 is missing (apt-get install qemu-system-x86)",
        )
        && truth_ready(test)
}

/// Tier 2 prerequisites of exit-anchored probing of a QEMU VM: [`vm_ready`] and a tracefs
/// with `kvm:kvm_pio`.
pub(crate) fn anchor_ready(test: &str) -> bool {
    vm_ready(test)
        && require(
            test,
            vmtsync::ftrace::find_tracefs(None, vmtsync::exits::EVENT).is_ok(),
            "no tracefs with events/kvm/kvm_pio (mount tracefs, load kvm)",
        )
}

/// Tier 2 prerequisites for the QEMU recording tests: [`vm_ready`] and trace-cmd.
pub(crate) fn qemu_ready(test: &str) -> bool {
    vm_ready(test) && have_trace_cmd(test)
}

/// Boots the agent under QEMU microvm (COM1 on `sock`), waits for the socket.
pub(crate) fn boot_qemu(dir: &Path, append: &str) -> (ChildGuard, PathBuf) {
    boot_qemu_with(dir, append, &[])
}

/// [`boot_qemu`] with `extra` QEMU arguments appended (such as `-name N,debug-threads=on`).
pub(crate) fn boot_qemu_with(dir: &Path, append: &str, extra: &[&str]) -> (ChildGuard, PathBuf) {
    let elf = agent_elf().expect("agent builds");
    boot_elf(&elf, dir, append, extra, false)
}

/// [`boot_qemu_with`] for any guest ELF (the minimal kernel: `vmtsync_launch::agent::Guest`).
/// With `wait`, QEMU starts the guest only once a client has connected to COM1
/// (`qemu::command_com1_socket_waiting`), so that client gets every byte from the first.
pub(crate) fn boot_elf(
    elf: &Path,
    dir: &Path,
    append: &str,
    extra: &[&str],
    wait: bool,
) -> (ChildGuard, PathBuf) {
    let sock = dir.join("com1.sock");
    let com2 = dir.join("com2.log");
    let mut c = if wait {
        qemu::command_com1_socket_waiting(Machine::Microvm, elf, append, &com2, &sock)
    } else {
        qemu::command_com1_socket(Machine::Microvm, elf, append, &com2, &sock)
    };
    let child = c
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu starts");
    let guard = ChildGuard::new(child);
    let end = Instant::now() + Duration::from_secs(20);
    while !sock.exists() {
        assert!(
            Instant::now() < end,
            "QEMU did not create {}",
            sock.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // QEMU creates its chardevs before its VM: a reader that names the VM by QEMU's PID right
    // away can find no VM yet on a loaded host. Wait for KVM's debugfs directory too (with
    // `wait`, QEMU creates it only once a client has connected).
    let kvm = Path::new("/sys/kernel/debug/kvm");
    while !wait && kvm.is_dir() && !qemu::kvm_has_vcpu0(kvm, guard.pid()) {
        assert!(
            Instant::now() < end,
            "QEMU {} created no KVM VM with a vCPU 0",
            guard.pid()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    (guard, sock)
}

/// The real agent under QEMU microvm with COM1 on a socket, for `vmtsync record` sessions.
pub(crate) struct QemuAgent {
    /// QEMU; dropping it ends the VM.
    pub(crate) guard: ChildGuard,
    /// The `--connect` address of COM1.
    pub(crate) addr: String,
}

impl QemuAgent {
    /// Boots the agent with `append` as its command line ([`boot_qemu`]).
    pub(crate) fn boot(dir: &Path, append: &str) -> Self {
        let (guard, sock) = boot_qemu(dir, append);
        Self::booted(guard, &sock)
    }

    /// Boots any guest ELF `elf` ([`boot_elf`]) for `vmtsync record` sessions; with `wait`,
    /// the guest starts when the first session connects.
    pub(crate) fn boot_elf(elf: &Path, dir: &Path, wait: bool) -> Self {
        let (guard, sock) = boot_elf(elf, dir, "", &[], wait);
        Self::booted(guard, &sock)
    }

    fn booted(guard: ChildGuard, sock: &Path) -> Self {
        Self {
            guard,
            addr: format!("unix:{}", sock.display()),
        }
    }

    /// `vmtsync record --connect ADDR --out OUT --events N --duration 120 --resync MS
    /// --timeout 10000` and `extra` (the format, `--shutdown`, anchoring) to completion.
    pub(crate) fn record(&self, out: &Path, events: u64, resync_ms: u32, extra: &[&str]) -> Output {
        let (n, resync) = (events.to_string(), resync_ms.to_string());
        let mut args = vec!["--connect", &self.addr, "--out", out.to_str().unwrap()];
        args.extend(["--events", &n, "--duration", "120", "--resync", &resync]);
        args.extend(["--timeout", "10000"]);
        args.extend_from_slice(extra);
        record(&args)
    }
}

/// Tier 2 prerequisites of a host trace ([`HostTrace`]) of `event` (`system/name`): root,
/// trace-cmd and a tracefs that has the event. `false` (after [`require`] said why) when one
/// is missing.
pub(crate) fn host_trace_ready(test: &str, event: &'static str) -> bool {
    have_trace_cmd(test)
        && require(test, is_root(), "needs root (tracefs instances)")
        && require(
            test,
            vmtsync::ftrace::find_tracefs(None, event).is_ok(),
            &format!("no tracefs with events/{event} at /sys/kernel/{{debug/,}}tracing"),
        )
}

/// Tier 2 prerequisites of a QEMU test that traces the guest's port I/O exits on the host:
/// [`qemu_ready`] and a host trace of `kvm:kvm_pio` ([`host_trace_ready`]).
pub(crate) fn qemu_pio_trace_ready(test: &str) -> bool {
    qemu_ready(test) && host_trace_ready(test, "kvm/kvm_pio")
}

/// A host trace in the making: a private tracefs instance (`vmtsync::ftrace::Instance`) on
/// the `x86-tsc` clock, so its timestamps are host TSC ticks, removed when dropped or
/// extracted.
pub(crate) struct HostTrace {
    inst: Instance,
    name: String,
}

impl HostTrace {
    /// Creates the instance for `purpose` in the tracefs that has `event` (`system/name`);
    /// the test's gate checked the prerequisites ([`host_trace_ready`]).
    pub(crate) fn start(purpose: &str, event: &'static str) -> Self {
        let tracefs = vmtsync::ftrace::find_tracefs(None, event).expect("a tracefs with the event");
        let inst = Instance::create(&tracefs, purpose).expect("create tracefs instance");
        assert!(inst.tsc_clock(), "the instance clock must be x86-tsc");
        let name = inst
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        Self { inst, name }
    }

    /// The instance, to enable events, set filters or read its files.
    pub(crate) fn instance(&mut self) -> &mut Instance {
        &mut self.inst
    }

    /// The instance directory.
    pub(crate) fn path(&self) -> &Path {
        self.inst.path()
    }

    /// Sets the instance's per-CPU buffer size (room for every event of a longer run).
    pub(crate) fn buffer_kb(&self, kb: u32) {
        std::fs::write(self.path().join("buffer_size_kb"), kb.to_string()).expect("buffer size");
    }

    /// Stops tracing.
    pub(crate) fn stop(&self) {
        std::fs::write(self.path().join("tracing_on"), "0").unwrap();
    }

    /// Stops tracing, writes the instance's buffer to `out` with `trace-cmd extract -B` (a v7
    /// trace.dat with zstd-compressed sections here) and removes the instance.
    pub(crate) fn extract(self, out: &Path) {
        self.stop();
        let o = Command::new("trace-cmd")
            .args(["extract", "-B", &self.name, "-o", out.to_str().unwrap()])
            .current_dir(out.parent().unwrap())
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(o.status.success(), "extract: {}", text(&o.stderr));
    }
}

/// The host thread of the VM's first vCPU, once `vmtsync kvm` shows it.
pub(crate) fn vcpu_thread(pid: u32) -> Option<u64> {
    let o = guarded_output(
        vmtsync().args(["kvm", "--json", "--vm", &pid.to_string()]),
        b"",
    );
    let v: Value = serde_json::from_slice(&o.stdout).unwrap_or(Value::Null);
    v["vms"][0]["vcpus"][0]["thread_pid"]
        .as_u64()
        .filter(|&t| t != 0)
}

/// The host thread of the VM's first vCPU (QEMU `pid`), waiting (at most 20 s) until KVM
/// debugfs names it: it does once the vCPU has run, a little after QEMU's socket appears, and
/// anchoring and the truth need it.
pub(crate) fn wait_vcpu_thread(pid: u32) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(t) = vcpu_thread(pid) {
            return t;
        }
        assert!(
            Instant::now() < deadline,
            "vcpu0's thread never appeared in KVM debugfs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The exact host TSC of guest TSC `g` under KVM's mapping `kvm`: its inverse's floor and
/// ceiling must agree (the mapping is an offset, ratio 1, on these hosts), so there is one.
pub(crate) fn exact_host(kvm: &vmtsync_core::mapping::KvmTscMapping, g: u64) -> u64 {
    use vmtsync_core::GuestTicks;
    let lo = kvm.try_host_from_guest_ceil(GuestTicks(g)).expect("maps").0;
    let hi = kvm
        .try_host_from_guest_floor(GuestTicks(g))
        .expect("maps")
        .0;
    assert_eq!(lo, hi, "KVM's inverse of guest tick {g} is one host tick");
    lo
}

/// Parses the JSON Lines of a recording.
pub(crate) fn lines_of(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .expect("jsonl written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// The number before `what` in a memory recording's summary line.
pub(crate) fn count_before(stderr: &str, what: &str) -> u64 {
    let at = stderr
        .rfind(what)
        .unwrap_or_else(|| panic!("{what:?} in {stderr}"));
    let head = stderr[..at].trim_end();
    let from = head
        .rfind(|c: char| !c.is_ascii_digit())
        .map_or(0, |k| k + 1);
    head[from..]
        .parse()
        .unwrap_or_else(|_| panic!("a count before {what:?}: {stderr}"))
}
