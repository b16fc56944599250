//! `cargo xtask demo [--json] [--vmm auto|qemu|builtin|sim]`: one command from a fresh clone
//! that boots the guest agent, reads its vCPUs' exact TSC mapping from KVM debugfs, measures
//! the offset with probes, and prints both next to the truth.
//!
//! xtask does not link `vmtsync`: it builds and runs the real `vmtsync` binary (`vmtsync kvm
//! --json`, `vmtsync probe --json`) and parses their schema-1 JSON. That keeps xtask at two
//! dependencies (anyhow, serde_json) and makes the demo exercise exactly what a user runs.
//!
//! Truth: the vCPU's `tsc_offset` as KVM debugfs reports it (exact: it is what the hardware
//! adds), read by `vmtsync kvm --json` while the VM runs; in the simulation, the skew the
//! loopback agent is started with. The demo fails (non-zero exit) when the truth lies outside
//! the probe row's guaranteed interval `[bound_lo, bound_hi]`.
//!
//! VMM choice (`auto`): QEMU (`-M microvm`, COM1 on a Unix socket chardev that `vmtsync probe
//! --connect unix:PATH` talks to) when `qemu-system-x86_64` runs and `/dev/kvm` opens; else the
//! built-in VMM (`vmtsync-vmm`, COM1 on its stdio, relayed here to a Unix socket); else a
//! simulation (the loopback agent `vmtsync-fake-agent`: no VM, so no KVM row). Every process
//! started here is killed by its PID when it outlives its use, also on error.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::{agent, cargo, display, root, sh};

/// The isa-debug-exit code the agent is told to exit with after the probe's shutdown.
const EXIT_CODE: u8 = 9;
/// The skew (guest TSC - host TSC) the simulation's loopback agent adds: its truth.
const SIM_SKEW: i64 = 12_345_678;
/// The longest wait for the VM to appear in debugfs, and for the agent's replies.
const STEP: Duration = Duration::from_secs(20);

/// Which VMM runs the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Vmm {
    Qemu,
    Builtin,
    Sim,
}

impl Vmm {
    fn name(self) -> &'static str {
        match self {
            Self::Qemu => "qemu",
            Self::Builtin => "builtin",
            Self::Sim => "sim",
        }
    }
}

/// Kills (SIGKILL, by PID) and reaps its child when dropped.
struct Guard {
    child: Option<Child>,
    what: &'static str,
}

impl Guard {
    fn spawn(what: &'static str, c: &mut Command) -> Result<Self> {
        eprintln!("$ {}", display(c));
        let child = c
            .spawn()
            .with_context(|| format!("could not start {what}: `{}`", display(c)))?;
        Ok(Self {
            child: Some(child),
            what,
        })
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("child present until drop")
    }

    /// Waits up to `limit` for the child to exit on its own; kills it after that.
    fn wait_or_kill(&mut self, limit: Duration) -> Result<Option<std::process::ExitStatus>> {
        let end = Instant::now() + limit;
        loop {
            if let Some(s) = self.child().try_wait()? {
                self.child = None;
                return Ok(Some(s));
            }
            if Instant::now() > end {
                eprintln!(
                    "demo: {} (pid {}) still running after {limit:?}: killing it",
                    self.what,
                    self.pid()
                );
                return Ok(None);
            }
            thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `c` to completion (killed by PID past `limit`); returns (exit code, stdout, stderr).
fn run_bounded(c: &mut Command, limit: Duration) -> Result<(Option<i32>, String, String)> {
    c.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut g = Guard::spawn("vmtsync", c)?;
    let mut out = g.child().stdout.take().context("stdout")?;
    let mut err = g.child().stderr.take().context("stderr")?;
    let out_t = thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = g.wait_or_kill(limit)?;
    drop(g);
    let (out, err) = (
        out_t.join().unwrap_or_default(),
        err_t.join().unwrap_or_default(),
    );
    match status {
        Some(s) => Ok((s.code(), out, err)),
        None => bail!("`{}` did not finish within {limit:?}", display(c)),
    }
}

/// Options of `demo`.
struct DemoArgs {
    json: bool,
    vmm: Option<Vmm>,
}

fn parse_args(args: &[String]) -> Result<DemoArgs> {
    let mut d = DemoArgs {
        json: false,
        vmm: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => d.json = true,
            "--vmm" => {
                d.vmm = match it.next().map(String::as_str) {
                    Some("auto") => None,
                    Some("qemu") => Some(Vmm::Qemu),
                    Some("builtin") => Some(Vmm::Builtin),
                    Some("sim") => Some(Vmm::Sim),
                    other => bail!("--vmm takes auto|qemu|builtin|sim, not {other:?}"),
                }
            }
            other => bail!("demo: unknown option `{other}`\n\n{}", crate::HELP),
        }
    }
    Ok(d)
}

fn have_kvm() -> bool {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
}

fn have_qemu() -> bool {
    Command::new("qemu-system-x86_64")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Picks the VMM and says why.
fn choose(forced: Option<Vmm>) -> (Vmm, String) {
    let (kvm, qemu) = (have_kvm(), have_qemu());
    match forced {
        Some(v) => (v, "chosen with --vmm".into()),
        None if kvm && qemu => (
            Vmm::Qemu,
            "/dev/kvm opens and qemu-system-x86_64 runs".into(),
        ),
        None if kvm => (
            Vmm::Builtin,
            "qemu-system-x86_64 is missing (apt-get install qemu-system-x86): built-in VMM".into(),
        ),
        None => (
            Vmm::Sim,
            "/dev/kvm cannot be opened read-write: no VM possible, loopback agent instead".into(),
        ),
    }
}

/// The Cargo target directory the workspace builds into.
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from)
}

/// Waits until `path` exists (a socket QEMU or the fake agent creates).
fn wait_for_path(path: &Path, g: &mut Guard) -> Result<()> {
    let end = Instant::now() + STEP;
    while !path.exists() {
        if let Some(s) = g.child().try_wait()? {
            bail!("{} exited before creating {}: {s}", g.what, path.display());
        }
        if Instant::now() > end {
            bail!(
                "{} did not create {} within {STEP:?}",
                g.what,
                path.display()
            );
        }
        thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Accepts one connection on `sock` and copies bytes both ways between it and the built-in
/// VMM's COM1 (its stdin/stdout). The threads end when either side closes.
fn relay(sock: &Path, g: &mut Guard) -> Result<()> {
    let listener =
        UnixListener::bind(sock).with_context(|| format!("binding {}", sock.display()))?;
    let mut to_vm = g.child().stdin.take().context("vmtsync-vmm stdin")?;
    let mut from_vm = g.child().stdout.take().context("vmtsync-vmm stdout")?;
    thread::spawn(move || {
        let Ok((s, _)) = listener.accept() else {
            return;
        };
        let Ok(mut s2) = s.try_clone() else { return };
        let mut s = s;
        thread::spawn(move || {
            let mut b = [0u8; 256];
            while let Ok(n) = from_vm.read(&mut b) {
                if n == 0 || s2.write_all(&b[..n]).is_err() {
                    break;
                }
            }
            let _ = s2.shutdown(std::net::Shutdown::Both);
        });
        let mut b = [0u8; 256];
        while let Ok(n) = s.read(&mut b) {
            if n == 0
                || to_vm
                    .write_all(&b[..n])
                    .and_then(|()| to_vm.flush())
                    .is_err()
            {
                break;
            }
        }
    });
    Ok(())
}

/// Boots the agent under `vmm`, COM1 reachable at `sock`; returns its guard.
fn boot(vmm: Vmm, elf: &Path, sock: &Path, log: &Path) -> Result<Guard> {
    let append = format!("transport=uart exit={EXIT_CODE}");
    let log_file = || std::fs::File::create(log).context("creating the VMM log");
    let mut g = match vmm {
        Vmm::Qemu => {
            let mut c = Command::new("qemu-system-x86_64");
            c.args(["-M", "microvm", "-accel", "kvm"])
                // `-arch-capabilities`: QEMU's `host` model otherwise aborts on this nested KVM
                // with "failed to set MSR 0x10a"; `+invtsc` is the bit the agent checks.
                .args(["-cpu", "host,+invtsc,-arch-capabilities", "-m", "64M"])
                .args(["-smp", "1", "-display", "none", "-monitor", "none"])
                .arg("-no-reboot")
                .arg("-chardev")
                .arg(format!(
                    "socket,id=com1,path={},server=on,wait=off",
                    sock.display()
                ))
                .args(["-serial", "chardev:com1"])
                .args(["-device", "isa-serial,chardev=com2,iobase=0x2f8,irq=3"])
                .args(["-device", "isa-debug-exit,iobase=0xf4,iosize=4"])
                .arg("-chardev")
                .arg(format!("file,id=com2,path={}", log.display()))
                .arg("-kernel")
                .arg(elf)
                .arg("-append")
                .arg(&append)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let mut g = Guard::spawn("qemu-system-x86_64", &mut c)?;
            wait_for_path(sock, &mut g)?;
            g
        }
        Vmm::Builtin => {
            let bin = target_dir().join("debug/vmtsync-vmm");
            let mut c = Command::new(bin);
            c.arg(elf)
                .args(["--timeout", "60", "--"])
                .args(append.split(' '))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(log_file()?);
            let mut g = Guard::spawn("vmtsync-vmm", &mut c)?;
            relay(sock, &mut g)?;
            g
        }
        Vmm::Sim => {
            let bin = target_dir().join("debug/vmtsync-fake-agent");
            let mut c = Command::new(bin);
            c.arg(sock)
                .arg(SIM_SKEW.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log_file()?);
            let mut g = Guard::spawn("vmtsync-fake-agent", &mut c)?;
            wait_for_path(sock, &mut g)?;
            g
        }
    };
    if let Some(s) = g.child().try_wait()? {
        bail!(
            "{} exited at once ({s}); log:\n{}",
            g.what,
            std::fs::read_to_string(log).unwrap_or_default()
        );
    }
    Ok(g)
}

/// `vmtsync kvm --json --mount-debugfs --vm PID`, retried until the VM has vCPUs in debugfs.
/// Returns `(vcpu, tsc_offset)` pairs.
fn kvm_mapping(vmtsync: &Path, pid: u32) -> Result<Vec<(u64, i64)>> {
    let end = Instant::now() + STEP;
    loop {
        let mut c = Command::new(vmtsync);
        c.args(["kvm", "--json", "--mount-debugfs", "--vm", &pid.to_string()]);
        let (code, out, err) = run_bounded(&mut c, STEP)?;
        match code {
            Some(0) => {
                let v: Value = serde_json::from_str(&out)
                    .with_context(|| format!("vmtsync kvm --json printed: {out}"))?;
                let vcpus: Vec<(u64, i64)> = v["vms"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .flat_map(|vm| vm["vcpus"].as_array().into_iter().flatten())
                    .filter_map(|c| Some((c["vcpu"].as_u64()?, c["tsc_offset"].as_i64()?)))
                    .collect();
                if !vcpus.is_empty() {
                    return Ok(vcpus);
                }
            }
            // 4: no VM matches yet (QEMU creates the VM after its chardevs).
            Some(4) => {}
            _ => bail!("vmtsync kvm failed ({code:?}): {}", err.trim()),
        }
        if Instant::now() > end {
            bail!("VM of pid {pid} did not appear in KVM debugfs within {STEP:?}");
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// `vmtsync probe --connect unix:SOCK --json`: the parsed schema-1 object.
fn probe(vmtsync: &Path, sock: &Path) -> Result<Value> {
    let mut c = Command::new(vmtsync);
    c.args([
        "probe",
        "--json",
        "--no-progress",
        "--probes",
        "64",
        "--shutdown",
    ])
    .args(["--timeout", "20000", "--connect-timeout", "20000"])
    .arg("--connect")
    .arg(format!("unix:{}", sock.display()));
    let (code, out, err) = run_bounded(&mut c, STEP * 3)?;
    if code != Some(0) {
        bail!("vmtsync probe failed ({code:?}): {}", err.trim());
    }
    serde_json::from_str(&out).with_context(|| format!("vmtsync probe --json printed: {out}"))
}

/// The agent's COM2 log as text, for an error report. Under QEMU the file holds defmt frames,
/// decoded by the `vmtsync-defmt` tool against the agent ELF; the other VMMs log text.
fn agent_log_text(vmm: Vmm, elf: &Path, log: &Path) -> String {
    if vmm != Vmm::Qemu {
        return std::fs::read_to_string(log).unwrap_or_default();
    }
    let decoder = target_dir().join("debug/vmtsync-defmt");
    match Command::new(&decoder).arg(elf).arg(log).output() {
        Ok(out) => String::from_utf8_lossy(&out.stdout).into_owned(),
        Err(e) => format!("(could not run {}: {e})", decoder.display()),
    }
}

/// `cargo xtask demo [--json] [--vmm auto|qemu|builtin|sim]`.
pub(crate) fn demo(args: &[String]) -> Result<()> {
    let a = parse_args(args)?;
    let t0 = Instant::now();
    let (vmm, why) = choose(a.vmm);
    eprintln!("demo: VMM {} ({why})", vmm.name());
    let elf = if vmm == Vmm::Sim {
        PathBuf::new()
    } else {
        agent::build()?
    };
    let mut c = cargo();
    c.args(["build", "-q", "-p", "vmtsync", "--bin", "vmtsync"]);
    match vmm {
        Vmm::Builtin => {
            c.args(["-p", "vmtsync-tests", "--bin", "vmtsync-vmm"]);
        }
        Vmm::Sim => {
            c.args(["-p", "vmtsync-tests", "--bin", "vmtsync-fake-agent"]);
        }
        Vmm::Qemu => {
            // The agent logs defmt frames on COM2; this decodes them if the run fails.
            c.args(["-p", "vmtsync-tests", "--bin", "vmtsync-defmt"]);
        }
    }
    sh(&mut c)?;
    let vmtsync = target_dir().join("debug/vmtsync");
    let built = t0.elapsed();

    let dir = std::env::temp_dir().join(format!("vmtsync-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let sock = dir.join("com1.sock");
    let log = dir.join("agent.log");
    let _ = std::fs::remove_file(&sock);
    let result = run_vm(vmm, &elf, &vmtsync, &sock, &log);
    let log_text = agent_log_text(vmm, &elf, &log);
    let _ = std::fs::remove_dir_all(&dir);
    let (kvm, probe, timings) =
        result.with_context(|| format!("agent log (COM2):\n{}", log_text.trim_end()))?;
    let total = t0.elapsed();

    // The JSON gives the agent's transport as one token; the text says how it is reached.
    let (transport, path) = match vmm {
        Vmm::Qemu => ("uart", "COM1 16550 on a QEMU unix socket chardev"),
        Vmm::Builtin => (
            "uart",
            "COM1 16550 of vmtsync-vmm, relayed to a unix socket",
        ),
        Vmm::Sim => ("memory", "loopback agent over a unix socket; no VM"),
    };
    let mut rows = Vec::new();
    let probe_vcpu = probe["vcpu"].as_u64().context("probe JSON: vcpu")?;
    let get = |k: &str| {
        probe[k]
            .as_i64()
            .with_context(|| format!("probe JSON: {k}"))
    };
    let (off, lo, hi) = (get("offset_ticks")?, get("bound_lo")?, get("bound_hi")?);
    let truth = probe_truth(vmm, &kvm, probe_vcpu)?;
    let mut vcpus: Vec<u64> = kvm.iter().map(|&(v, _)| v).collect();
    if !vcpus.contains(&probe_vcpu) {
        vcpus.push(probe_vcpu);
    }
    for v in vcpus {
        if let Some(&(_, o)) = kvm.iter().find(|&&(c, _)| c == v) {
            // debugfs is the truth: this row shows what reading it gives (error 0 by
            // construction), next to what probing has to work out.
            rows.push(
                json!({"vcpu": v, "method": "kvm", "offset_ticks": o, "bound_lo": o,
                "bound_hi": o, "truth_ticks": o, "error_ticks": 0}),
            );
        }
        if v == probe_vcpu {
            rows.push(json!({"vcpu": v, "method": "probe", "offset_ticks": off,
                "bound_lo": lo, "bound_hi": hi, "truth_ticks": truth,
                "error_ticks": i128::from(off) - i128::from(truth)}));
        }
    }
    if a.json {
        println!("{}", json_line(vmm, transport, &rows));
    } else {
        println!("vmtsync demo: VMM {} ({why})", vmm.name());
        println!("transport: {transport} ({path})");
        if vmm == Vmm::Sim {
            println!("truth: the loopback agent's skew, {SIM_SKEW} ticks");
            println!("kvm: no VM in the simulation, so no debugfs mapping to read");
        } else {
            println!("truth: vcpu{probe_vcpu}'s tsc_offset in KVM debugfs, {truth} ticks (exact)");
        }
        println!(
            "{:>4}  {:<6} {:>14}  {:>31}  {:>10}  {:>5}  {:>8}",
            "vcpu", "method", "offset_ticks", "interval [lo, hi]", "width", "truth", "error"
        );
        for r in &rows {
            let lo = r["bound_lo"].as_i64().unwrap_or_default();
            let hi = r["bound_hi"].as_i64().unwrap_or_default();
            println!(
                "{:>4}  {:<6} {:>14}  {:>31}  {:>10}  {:>5}  {:>+8}",
                r["vcpu"].as_u64().unwrap_or_default(),
                r["method"].as_str().unwrap_or_default(),
                r["offset_ticks"].as_i64().unwrap_or_default(),
                format!("[{lo}, {hi}]"),
                i128::from(hi) - i128::from(lo),
                r["truth_ticks"].as_i64().unwrap_or_default(),
                r["error_ticks"].as_i64().unwrap_or_default()
            );
        }
        println!(
            "probe: {} probes, model {}, rtt min {} median {} ticks; trace-cmd fastest-RTT estimate {} ticks",
            probe["probes"],
            probe["model"].as_str().unwrap_or("?"),
            probe["rtt_min_ticks"],
            probe["rtt_median_ticks"],
            probe["tracecmd_fastest_rtt_offset"]
        );
    }
    eprintln!(
        "demo: builds {built:.1?}, boot until agent reachable {:.1?}, debugfs scan {:.1?}, probe {:.1?}, VM exit {:.1?}; total {total:.1?}",
        timings.boot, timings.scan, timings.probe, timings.exit
    );
    check_bounds(truth, lo, hi)
}

/// The probe row's truth: the probed vCPU's debugfs `tsc_offset` (a one-vCPU VM's only
/// vCPU when the agent's CPU number is not a debugfs id), or the simulation's skew.
fn probe_truth(vmm: Vmm, kvm: &[(u64, i64)], probe_vcpu: u64) -> Result<i64> {
    if vmm == Vmm::Sim {
        return Ok(SIM_SKEW);
    }
    match (kvm.iter().find(|&&(v, _)| v == probe_vcpu), kvm) {
        (Some(&(_, o)), _) | (None, &[(_, o)]) => Ok(o),
        (None, _) => bail!(
            "the agent answered as vCPU {probe_vcpu}, which is none of the VM's debugfs vCPUs {:?}: no truth to check against",
            kvm.iter().map(|&(v, _)| v).collect::<Vec<_>>()
        ),
    }
}

/// Fails the demo when the truth lies outside the probe's guaranteed interval.
fn check_bounds(truth: i64, lo: i64, hi: i64) -> Result<()> {
    if (lo..=hi).contains(&truth) {
        Ok(())
    } else {
        bail!(
            "FAILED: the true offset {truth} lies outside the probe's guaranteed interval [{lo}, {hi}]"
        )
    }
}

/// The `--json` line with keys in the documented order (serde_json's `Value` would sort them):
/// `{"schema":1,"vmm","transport","vcpus":[{"vcpu","method","offset_ticks","bound_lo",
/// "bound_hi","truth_ticks","error_ticks"}]}`.
fn json_line(vmm: Vmm, transport: &str, rows: &[Value]) -> String {
    const KEYS: [&str; 7] = [
        "vcpu",
        "method",
        "offset_ticks",
        "bound_lo",
        "bound_hi",
        "truth_ticks",
        "error_ticks",
    ];
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            let fields: Vec<String> = KEYS.iter().map(|k| format!("\"{k}\":{}", r[k])).collect();
            format!("{{{}}}", fields.join(","))
        })
        .collect();
    format!(
        "{{\"schema\":1,\"vmm\":{},\"transport\":{},\"vcpus\":[{}]}}",
        Value::from(vmm.name()),
        Value::from(transport),
        rows.join(",")
    )
}

/// `(vcpu, tsc_offset)` per vCPU from debugfs, the probe's JSON object, and the timings.
type Measured = (Vec<(u64, i64)>, Value, Timings);

/// How long each phase took.
struct Timings {
    boot: Duration,
    scan: Duration,
    probe: Duration,
    exit: Duration,
}

/// Boots, scans debugfs (not in the simulation), probes, and waits for the agent to exit.
fn run_vm(vmm: Vmm, elf: &Path, vmtsync: &Path, sock: &Path, log: &Path) -> Result<Measured> {
    let t = Instant::now();
    let mut g = boot(vmm, elf, sock, log)?;
    let boot = t.elapsed();
    let t = Instant::now();
    let kvm = if vmm == Vmm::Sim {
        Vec::new()
    } else {
        kvm_mapping(vmtsync, g.pid())?
    };
    let scan = t.elapsed();
    let t = Instant::now();
    let probe = probe(vmtsync, sock)?;
    let probe_time = t.elapsed();
    // The probe's shutdown makes the agent exit through isa-debug-exit.
    let t = Instant::now();
    let status = g.wait_or_kill(Duration::from_secs(10))?;
    let exit = t.elapsed();
    match (vmm, status.and_then(|s| s.code())) {
        (Vmm::Qemu, Some(c)) if c == (i32::from(EXIT_CODE) << 1) | 1 => {}
        (Vmm::Builtin, Some(c)) if c == i32::from(EXIT_CODE) => {}
        (Vmm::Sim, Some(0)) => {}
        (_, code) => eprintln!(
            "demo: warning: {} ended with {code:?}, not the agent's exit {EXIT_CODE}",
            g.what
        ),
    }
    Ok((
        kvm,
        probe,
        Timings {
            boot,
            scan,
            probe: probe_time,
            exit,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_line_keeps_the_documented_key_order_and_parses() {
        let rows = [
            json!({"error_ticks": 0, "truth_ticks": 0, "bound_hi": 0, "bound_lo": 0,
                   "offset_ticks": 0, "method": "kvm", "vcpu": 0}),
            json!({"vcpu": 0, "method": "probe", "offset_ticks": -5, "bound_lo": -9,
                   "bound_hi": 2, "truth_ticks": 0, "error_ticks": -5}),
        ];
        let line = json_line(Vmm::Qemu, "uart", &rows);
        assert!(
            line.starts_with(r#"{"schema":1,"vmm":"qemu","transport":"uart","vcpus":[{"vcpu":0,"method":"kvm","offset_ticks":0,"#),
            "{line}"
        );
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["vcpus"][1]["bound_lo"], -9);
        assert_eq!(v["vcpus"].as_array().map(Vec::len), Some(2));
    }

    #[test]
    fn args_parse_and_refuse_unknown_options() {
        let s = |v: &[&str]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
        let a = parse_args(&s(&["--json", "--vmm", "builtin"])).unwrap();
        assert!(a.json && a.vmm == Some(Vmm::Builtin));
        assert!(parse_args(&s(&["--vmm", "auto"])).unwrap().vmm.is_none());
        assert!(parse_args(&s(&["--vmm", "xen"])).is_err());
        assert!(parse_args(&s(&["--fast"])).is_err());
    }

    #[test]
    fn truth_comes_from_debugfs_and_must_lie_in_the_bounds() {
        let kvm = [(0, -5_000), (1, -6_000)];
        assert_eq!(probe_truth(Vmm::Qemu, &kvm, 1).unwrap(), -6_000);
        assert_eq!(probe_truth(Vmm::Qemu, &kvm[..1], 3).unwrap(), -5_000);
        assert!(probe_truth(Vmm::Qemu, &kvm, 3).is_err());
        assert_eq!(probe_truth(Vmm::Sim, &[], 0).unwrap(), SIM_SKEW);
        assert!(check_bounds(-6_000, -6_010, -6_000).is_ok());
        let e = check_bounds(0, -6_010, -5_990).unwrap_err().to_string();
        assert!(
            e.contains("0 lies outside") && e.contains("[-6010, -5990]"),
            "{e}"
        );
    }
}
