//! `vmtsync-demo` (run by `cargo xtask demo`): boots the guest agent with a software skew,
//! reads its vCPU's exact TSC mapping from KVM debugfs (`vmtsync kvm --json`), measures the
//! offset with probes (`vmtsync probe --json`), and prints both next to the truth.
//!
//! Usage: `vmtsync-demo [--json] [--vmm auto|qemu|builtin|sim] [--no-skew] [--smp N]`, or
//! `vmtsync-demo --firmware`: SeaBIOS traced live from guest memory (`firmware.rs`).
//!
//! The demo runs the real `vmtsync` program (the binary next to this one), so it shows exactly
//! what a user runs. The agent boots with a skew picked from the host TSC now
//! (`vmtsync_tests::truth::Skew::pick`: a large positive offset, rate 1.0001), so the probe
//! has a non-trivial answer to find and a sign or rate error shows.
//!
//! Under QEMU the guest has `--smp N` vCPUs (default 2; the other VMMs run one): the agent
//! brings up the others, each vCPU gets its own skew (`Skew::pick_per_vcpu`, `skewN=`), and
//! `vmtsync probe --all-vcpus` syncs each on itself, so the table has a KVM row and probe
//! rows per vCPU, each probe row checked against its own vCPU's truth (docs/smp.md).
//!
//! Truth: KVM's mapping of the vCPU read from debugfs by `vmtsync_tests::truth` while the VM
//! runs, followed by the agent's skew, at the host TSC the probe's estimate refers to
//! (`at_host_tsc`); in the simulation, the loopback agent's offset. The demo exits 1 when the
//! truth lies outside the probe's guaranteed interval `[bound_lo, bound_hi]`.
//!
//! VMM choice (`auto`): QEMU (`-M microvm`, COM1 on a Unix socket chardev that `vmtsync probe
//! --connect unix:PATH` talks to), installed with apt when missing and root; else the
//! built-in VMM (`vmtsync-vmm`, COM1 on its stdio, relayed here to a Unix socket); else (no
//! `/dev/kvm`, or not root so debugfs cannot be read) a simulation with the loopback agent
//! `vmtsync-fake-agent` and no KVM row. Under `CI=true` the demo never falls back to the
//! simulation: a missing prerequisite fails it. Every process started here is held by a
//! `ChildGuard` and killed by its PID when it outlives its use, also on error.
//!
//! `--json` prints one line, schema 1: `{"schema":1,"vmm","transport","skew":{"offset",
//! "ratio","frac_bits"}|null,"vcpus":[{"vcpu","method":"kvm"|"probe","offset_ticks",
//! "bound_lo","bound_hi","truth_ticks","error_ticks","at_host_tsc","anchor"}]}` (`skew`,
//! `at_host_tsc` and `anchor` were added to schema 1 without breaking its earlier keys;
//! `at_host_tsc` and `anchor` are null on the kvm rows, whose offset holds at every instant;
//! a key `"skews"`, every vCPU's skew in vCPU order, follows `vcpus`; `skew` is vCPU 0's).
//! With a VM there are two probe rows: `probe`, what `vmtsync probe` does by default
//! (exit-anchored through `kvm:kvm_pio` when it can be, `anchor` says), and `probe-ip`, the
//! same probing stamped in the vmtsync process (`--anchor none`), so both widths show; the
//! truth must lie inside both.
//!
//! Exit codes: 0 when the truth lies inside the bounds; 1 when it does not or the demo could
//! not run; 2 on usage errors.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde_json::Value;
use vmtsync_core::HostTicks;
use vmtsync_launch::agent::BuildOutput;
use vmtsync_launch::prereq::{display, ensure_qemu};
use vmtsync_launch::qemu::{self, Machine, debug_exit_code};
use vmtsync_launch::{ChildGuard, have_kvm, is_ci, is_root};
use vmtsync_tests::truth::{GuestTruth, Skew};

const USAGE: &str =
    "usage: vmtsync-demo [--json] [--vmm auto|qemu|builtin|sim] [--no-skew] [--smp N] | --firmware";

#[path = "vmtsync-demo/firmware.rs"]
mod firmware;

/// vCPUs of the QEMU guest unless `--smp` says otherwise: the project's hosts have 2 cores,
/// and parked application processors cost nothing while nobody probes them.
const DEFAULT_SMP: u32 = 2;

/// The isa-debug-exit code the agent is told to exit with after the probe's shutdown.
const EXIT_CODE: u8 = 9;
/// The offset (guest TSC - host TSC) the simulation's loopback agent adds: its truth.
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

/// Options of the demo.
#[derive(Debug)]
struct DemoArgs {
    json: bool,
    vmm: Option<Vmm>,
    skew: bool,
    /// `--smp N` (QEMU only).
    smp: Option<u32>,
    /// `--firmware`: the traced SeaBIOS instead of the agent.
    firmware: bool,
}

fn parse_args(args: &[String]) -> Result<DemoArgs> {
    let mut d = DemoArgs {
        json: false,
        vmm: None,
        skew: true,
        smp: None,
        firmware: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => d.json = true,
            "--no-skew" => d.skew = false,
            "--firmware" => d.firmware = true,
            "--smp" => {
                d.smp = match it.next().and_then(|n| n.parse::<u32>().ok()) {
                    Some(n @ 1..=8) => Some(n),
                    other => bail!("--smp takes a vCPU count from 1 to 8, not {other:?}"),
                }
            }
            "--vmm" => {
                d.vmm = match it.next().map(String::as_str) {
                    Some("auto") => None,
                    Some("qemu") => Some(Vmm::Qemu),
                    Some("builtin") => Some(Vmm::Builtin),
                    Some("sim") => Some(Vmm::Sim),
                    other => bail!("--vmm takes auto|qemu|builtin|sim, not {other:?}"),
                }
            }
            other => bail!("unknown option `{other}`"),
        }
    }
    if d.firmware && (d.json || d.vmm.is_some() || !d.skew || d.smp.is_some()) {
        bail!("--firmware takes no other option");
    }
    Ok(d)
}

/// Picks the VMM and says why; installs QEMU when it can. Under CI a reason to simulate is
/// an error instead.
fn choose(forced: Option<Vmm>) -> Result<(Vmm, String)> {
    if let Some(v) = forced {
        return Ok((v, "chosen with --vmm".into()));
    }
    let simulate = if !have_kvm() {
        Some("/dev/kvm cannot be opened read-write: no VM possible")
    } else if !is_root() {
        Some("reading the truth from KVM debugfs needs root (run `sudo -E cargo xtask demo`)")
    } else {
        None
    };
    if let Some(why) = simulate {
        if is_ci() {
            bail!("{why}; under CI=true the demo does not fall back to a simulation");
        }
        return Ok((Vmm::Sim, format!("{why}: loopback agent instead")));
    }
    match ensure_qemu() {
        Ok(()) => Ok((
            Vmm::Qemu,
            "/dev/kvm opens and qemu-system-x86_64 runs".into(),
        )),
        Err(e) => Ok((
            Vmm::Builtin,
            format!("QEMU unavailable ({e}): the built-in VMM instead"),
        )),
    }
}

/// A sibling binary of this one (Cargo puts a workspace's binaries in one directory).
fn sibling(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating vmtsync-demo")?;
    let p = exe.with_file_name(name);
    if p.is_file() {
        Ok(p)
    } else {
        bail!(
            "{} is missing: build it first (`cargo xtask demo` does)",
            p.display()
        )
    }
}

/// Runs `c` to completion (killed by PID past `limit`); returns (exit code, stdout, stderr).
fn run_bounded(c: &mut Command, limit: Duration) -> Result<(Option<i32>, String, String)> {
    c.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = c
        .spawn()
        .with_context(|| format!("could not start `{}`", display(c)))?;
    let mut g = ChildGuard::new(child);
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
    let status = g.wait_timeout(limit)?;
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

/// Waits until `path` exists (a socket QEMU or the fake agent creates).
fn wait_for_path(path: &Path, g: &mut ChildGuard, what: &str) -> Result<()> {
    let end = Instant::now() + STEP;
    while !path.exists() {
        if let Some(s) = g.child().try_wait()? {
            bail!("{what} exited before creating {}: {s}", path.display());
        }
        if Instant::now() > end {
            bail!("{what} did not create {} within {STEP:?}", path.display());
        }
        thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Accepts one connection on `sock` and copies bytes both ways between it and the built-in
/// VMM's COM1 (its stdin/stdout). The threads end when either side closes.
fn relay(sock: &Path, g: &mut ChildGuard) -> Result<()> {
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

/// What the agent runs on, and where.
struct Paths<'a> {
    elf: &'a Path,
    sock: &'a Path,
    log: &'a Path,
}

/// Boots the agent under `vmm` with one skew per vCPU (none: `skews` empty), COM1 reachable
/// at `p.sock`; returns its guard. `smp` vCPUs under QEMU; the other VMMs run one.
fn boot(vmm: Vmm, p: &Paths<'_>, skews: &[Skew], smp: u32) -> Result<ChildGuard> {
    // The agent's default boot is the tight path (docs/anchor.md): its sync port at 0x2400
    // (the host's `--sync-port` default), by which `--anchor auto` brackets each vCPU's
    // probes, and its loop in ring 0, where this project's nested KVM makes those exits cheap.
    let mut append = format!("transport=uart exit={EXIT_CODE}");
    for (v, s) in (0u32..).zip(skews) {
        append.push(' ');
        append.push_str(&if skews.len() == 1 {
            s.agent_option()
        } else {
            s.agent_option_for(v)
        });
    }
    let log_file = || std::fs::File::create(p.log).context("creating the VMM log");
    let spawn = |c: &mut Command| -> Result<ChildGuard> {
        eprintln!("$ {}", display(c));
        Ok(ChildGuard::new(c.spawn().with_context(|| {
            format!("could not start `{}`", display(c))
        })?))
    };
    let (mut g, what) = match vmm {
        Vmm::Qemu => {
            let mut c =
                qemu::command_com1_socket_smp(Machine::Microvm, p.elf, &append, p.log, p.sock, smp);
            c.stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let mut g = spawn(&mut c)?;
            wait_for_path(p.sock, &mut g, qemu::QEMU)?;
            (g, qemu::QEMU)
        }
        Vmm::Builtin => {
            let mut c = Command::new(sibling("vmtsync-vmm")?);
            c.arg(p.elf)
                .args(["--timeout", "60", "--"])
                .args(append.split(' '))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(log_file()?);
            let mut g = spawn(&mut c)?;
            relay(p.sock, &mut g)?;
            (g, "vmtsync-vmm")
        }
        Vmm::Sim => {
            let mut c = Command::new(sibling("vmtsync-fake-agent")?);
            c.arg(p.sock)
                .arg(SIM_SKEW.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log_file()?);
            let mut g = spawn(&mut c)?;
            wait_for_path(p.sock, &mut g, "vmtsync-fake-agent")?;
            (g, "vmtsync-fake-agent")
        }
    };
    if let Some(s) = g.child().try_wait()? {
        bail!(
            "{what} exited at once ({s}); log:\n{}",
            std::fs::read_to_string(p.log).unwrap_or_default()
        );
    }
    Ok(g)
}

/// One vCPU's mapping as `vmtsync kvm --json` printed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KvmRow {
    vcpu: u64,
    offset: i64,
    ratio: u64,
    frac_bits: u64,
}

/// `vmtsync kvm --json --mount-debugfs --vm PID`, retried until the VM has vCPUs in debugfs.
fn kvm_rows(vmtsync: &Path, pid: u32) -> Result<Vec<KvmRow>> {
    let end = Instant::now() + STEP;
    loop {
        let mut c = Command::new(vmtsync);
        c.args(["kvm", "--json", "--mount-debugfs", "--vm", &pid.to_string()]);
        let (code, out, err) = run_bounded(&mut c, STEP)?;
        match code {
            Some(0) => {
                let v: Value = serde_json::from_str(&out)
                    .with_context(|| format!("vmtsync kvm --json printed: {out}"))?;
                let rows: Vec<KvmRow> = v["vms"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .flat_map(|vm| vm["vcpus"].as_array().into_iter().flatten())
                    .filter_map(|c| {
                        Some(KvmRow {
                            vcpu: c["vcpu"].as_u64()?,
                            offset: c["tsc_offset"].as_i64()?,
                            ratio: c["tsc_scaling_ratio"].as_u64()?,
                            frac_bits: c["tsc_frac_bits"].as_u64()?,
                        })
                    })
                    .collect();
                if !rows.is_empty() {
                    return Ok(rows);
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

/// One `vmtsync probe --json` round with `--anchor anchor` (for `auto`, of the VM `vm`), of
/// every vCPU with `all_vcpus`, ending the agent when `shutdown`: one schema-2 object per vCPU.
fn probe(
    vmtsync: &Path,
    sock: &Path,
    anchor: &str,
    vm: Option<u32>,
    shutdown: bool,
    all_vcpus: bool,
) -> Result<Vec<Value>> {
    let mut c = Command::new(vmtsync);
    c.args(["probe", "--json", "--no-progress", "--probes", "64"])
        .args(["--anchor", anchor]);
    if all_vcpus {
        c.arg("--all-vcpus");
    }
    if let Some(pid) = vm {
        c.args(["--vm", &pid.to_string()]);
    }
    if shutdown {
        c.arg("--shutdown");
    }
    c.args(["--timeout", "20000", "--connect-timeout", "20000"])
        .arg("--connect")
        .arg(format!("unix:{}", sock.display()));
    let (code, out, err) = run_bounded(&mut c, STEP * 3)?;
    if code != Some(0) {
        bail!("vmtsync probe failed ({code:?}): {}", err.trim());
    }
    // `--anchor auto` says on stderr why it did not anchor: show it.
    for l in err.lines().filter(|l| l.contains("not exit-anchored")) {
        eprintln!("demo: {l}");
    }
    out.lines()
        .map(|l| {
            serde_json::from_str(l).with_context(|| format!("vmtsync probe --json printed: {out}"))
        })
        .collect()
}

/// The agent's COM2 log as text, for an error report. Under QEMU the file holds defmt frames,
/// decoded against the agent ELF; the other VMMs log text.
fn agent_log_text(vmm: Vmm, elf: &Path, log: &Path) -> String {
    if vmm == Vmm::Qemu {
        vmtsync_tests::vmm::defmt_log::decode_file_text(elf, log)
    } else {
        std::fs::read_to_string(log).unwrap_or_default()
    }
}

/// The truth of the probe row: what it is and its value at `at` (guest - host ticks).
#[derive(Debug, Clone)]
enum Truth {
    /// The VM's vCPU: KVM's debugfs mapping then the agent's skew.
    Vm(GuestTruth),
    /// The simulation's loopback agent: a constant offset.
    Sim(i64),
}

impl Truth {
    /// Checks `[lo, hi]` (referring to host TSC `at`) and returns the truth there.
    fn check(&self, at: HostTicks, lo: i64, hi: i64) -> Result<i128, String> {
        match self {
            Self::Vm(t) => t.check(at, lo, hi),
            Self::Sim(s) if (lo..=hi).contains(s) => Ok(i128::from(*s)),
            Self::Sim(s) => Err(format!(
                "the true offset {s} lies outside the guaranteed [{lo}, {hi}]"
            )),
        }
    }
}

/// One row of the result (JSON keys in declaration order).
#[derive(Debug, Clone, Serialize)]
struct Row {
    vcpu: u64,
    method: &'static str,
    offset_ticks: i64,
    bound_lo: i64,
    bound_hi: i64,
    truth_ticks: i128,
    error_ticks: i128,
    at_host_tsc: Option<u64>,
    /// Where a probe row's host brackets came from (`vmtsync probe`'s `anchor`); null on kvm
    /// rows.
    anchor: Option<String>,
}

/// The agent's skew in the JSON.
#[derive(Debug, Clone, Copy, Serialize)]
struct SkewJson {
    offset: i64,
    ratio: u64,
    frac_bits: u32,
}

impl SkewJson {
    fn of(s: Skew) -> Self {
        Self {
            offset: s.0.offset(),
            ratio: s.0.ratio(),
            frac_bits: s.0.frac_bits(),
        }
    }
}

/// The `--json` line.
#[derive(Debug, Serialize)]
struct Report<'a> {
    schema: u32,
    vmm: &'static str,
    transport: &'static str,
    skew: Option<SkewJson>,
    vcpus: &'a [Row],
    skews: Vec<SkewJson>,
}

/// How long each phase took.
struct Timings {
    boot: Duration,
    scan: Duration,
    probe: Duration,
    exit: Duration,
}

/// What one run measured.
struct Measured {
    kvm: Vec<KvmRow>,
    /// `vmtsync probe` as a user runs it: exit-anchored when it can be (`--anchor auto`); one
    /// object per vCPU.
    probe: Vec<Value>,
    /// The same probing stamped in the vmtsync process (`--anchor none`), for the widths side
    /// by side; empty in the simulation, where there are no exits.
    in_process: Vec<Value>,
    /// Each vCPU's truth, by vCPU id.
    truth: Vec<Truth>,
    timings: Timings,
}

/// Boots, scans debugfs (not in the simulation), probes, and waits for the agent to exit.
fn run_vm(vmm: Vmm, p: &Paths<'_>, vmtsync: &Path, skews: &[Skew], smp: u32) -> Result<Measured> {
    let t = Instant::now();
    let mut g = boot(vmm, p, skews, smp)?;
    let pid = g.pid();
    let boot_time = t.elapsed();
    let t = Instant::now();
    let (kvm, truth) = if vmm == Vmm::Sim {
        (Vec::new(), vec![Truth::Sim(SIM_SKEW)])
    } else {
        let kvm = kvm_rows(vmtsync, pid)?;
        // The truth's KVM side, read again here through the library's debugfs reader
        // independently of what `vmtsync kvm` printed.
        let truth = (0..smp)
            .map(|v| {
                let skew = skews.get(usize::try_from(v).unwrap_or(usize::MAX)).copied();
                GuestTruth::read(pid, v, skew)
                    .map(Truth::Vm)
                    .context("reading the truth from debugfs")
            })
            .collect::<Result<Vec<_>>>()?;
        (kvm, truth)
    };
    let all = smp > 1;
    let scan = t.elapsed();
    let t = Instant::now();
    let (in_process, probe) = if vmm == Vmm::Sim {
        (Vec::new(), probe(vmtsync, p.sock, "none", None, true, all)?)
    } else {
        // In-process first (the agent keeps serving), then what a user gets by default.
        let in_process = probe(vmtsync, p.sock, "none", None, false, all)?;
        (
            in_process,
            probe(vmtsync, p.sock, "auto", Some(pid), true, all)?,
        )
    };
    let probe_time = t.elapsed();
    // The probe's shutdown makes the agent exit through isa-debug-exit.
    let t = Instant::now();
    let status = g.wait_timeout(Duration::from_secs(10))?;
    let exit = t.elapsed();
    let code = status.and_then(|s| s.code());
    let clean = match vmm {
        Vmm::Qemu => code.and_then(debug_exit_code) == Some(i32::from(EXIT_CODE)),
        Vmm::Builtin => code == Some(i32::from(EXIT_CODE)),
        Vmm::Sim => code == Some(0),
    };
    if !clean {
        eprintln!(
            "demo: warning: the {} process ended with {code:?}, not the agent's exit {EXIT_CODE}",
            vmm.name()
        );
    }
    Ok(Measured {
        kvm,
        probe,
        in_process,
        truth,
        timings: Timings {
            boot: boot_time,
            scan,
            probe: probe_time,
            exit,
        },
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let a = match parse_args(&args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("vmtsync-demo: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match demo(&a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vmtsync-demo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn demo(a: &DemoArgs) -> Result<()> {
    if a.firmware {
        return firmware::run(&sibling("vmtsync")?);
    }
    let t0 = Instant::now();
    let (vmm, why) = choose(a.vmm)?;
    eprintln!("demo: VMM {} ({why})", vmm.name());
    let vmtsync = sibling("vmtsync")?;
    let elf = if vmm == Vmm::Sim {
        PathBuf::new()
    } else {
        vmtsync_launch::agent::build(BuildOutput::Shown)?
    };
    let built = t0.elapsed();
    let smp = match (vmm, a.smp) {
        (Vmm::Qemu, n) => n.unwrap_or(DEFAULT_SMP),
        (_, None | Some(1)) => 1,
        (other, Some(_)) => bail!("--smp needs QEMU; the {} VMM runs one vCPU", other.name()),
    };
    let skews = if a.skew && vmm != Vmm::Sim {
        if smp == 1 {
            vec![Skew::pick()]
        } else {
            Skew::pick_per_vcpu(smp)
        }
    } else {
        Vec::new()
    };
    let skew = skews.first().copied();

    let dir = tempfile::Builder::new()
        .prefix("vmtsync-demo-")
        .tempdir()
        .context("creating a scratch directory")?;
    let (sock, log) = (dir.path().join("com1.sock"), dir.path().join("agent.log"));
    let paths = Paths {
        elf: &elf,
        sock: &sock,
        log: &log,
    };
    let m = run_vm(vmm, &paths, &vmtsync, &skews, smp)
        .with_context(|| format!("agent log (COM2):\n{}", agent_log_text(vmm, &elf, &log)))?;
    let total = t0.elapsed();

    let mut rows: Vec<Row> = m
        .kvm
        .iter()
        .map(|k| Row {
            vcpu: k.vcpu,
            method: "kvm",
            offset_ticks: k.offset,
            bound_lo: k.offset,
            bound_hi: k.offset,
            // debugfs is KVM's side of the truth: this row shows what reading it gives
            // (error 0 by construction), next to what probing has to work out.
            truth_ticks: i128::from(k.offset),
            error_ticks: 0,
            at_host_tsc: None,
            anchor: None,
        })
        .collect();
    let mut failures = Vec::new();
    for (method, objects) in [("probe-ip", &m.in_process), ("probe", &m.probe)] {
        for json in objects {
            let (row, ok) = probe_row(method, json, &m.truth)?;
            if let Err(e) = ok {
                failures.push(format!("{method} vcpu {}: {e}", row.vcpu));
            }
            rows.push(row);
        }
    }
    if m.probe.len() != m.truth.len() {
        failures.push(format!(
            "{} vCPUs answered probes, the VM has {}",
            m.probe.len(),
            m.truth.len()
        ));
    }

    let (transport, path) = match vmm {
        Vmm::Qemu => ("uart", "COM1 16550 on a QEMU unix socket chardev"),
        Vmm::Builtin => (
            "uart",
            "COM1 16550 of vmtsync-vmm, relayed to a unix socket",
        ),
        Vmm::Sim => ("memory", "loopback agent over a unix socket; no VM"),
    };
    if a.json {
        let report = Report {
            schema: 1,
            vmm: vmm.name(),
            transport,
            skew: skew.map(SkewJson::of),
            vcpus: &rows,
            skews: skews.iter().copied().map(SkewJson::of).collect(),
        };
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_text(vmm, &why, transport, path, &skews, &m, &rows);
    }
    let t = &m.timings;
    eprintln!(
        "demo: agent build {built:.1?}, boot until agent reachable {:.1?}, debugfs scan {:.1?}, probe {:.1?}, VM exit {:.1?}; total {total:.1?}",
        t.boot, t.scan, t.probe, t.exit
    );
    if failures.is_empty() {
        Ok(())
    } else {
        bail!("FAILED: {}", failures.join("; "))
    }
}

/// A probe row from `vmtsync probe --json`, and whether its vCPU's truth lies in its bounds.
fn probe_row(
    method: &'static str,
    p: &Value,
    truths: &[Truth],
) -> Result<(Row, Result<i128, String>)> {
    let get = |k: &str| p[k].as_i64().with_context(|| format!("probe JSON: {k}"));
    let (off, lo, hi) = (get("offset_ticks")?, get("bound_lo")?, get("bound_hi")?);
    let at = p["at_host_tsc"]
        .as_u64()
        .context("probe JSON: at_host_tsc")?;
    let vcpu = p["vcpu"].as_u64().context("probe JSON: vcpu")?;
    let truth = usize::try_from(vcpu)
        .ok()
        .and_then(|v| truths.get(v))
        .with_context(|| format!("probe JSON: vcpu {vcpu} is not a vCPU of the VM"))?;
    let checked = truth.check(HostTicks(at), lo, hi);
    let t = match (&checked, truth) {
        (Ok(t), _) => *t,
        (Err(_), Truth::Vm(t)) => t.offset_at(HostTicks(at)).unwrap_or_default(),
        (Err(_), Truth::Sim(s)) => i128::from(*s),
    };
    let row = Row {
        vcpu,
        method,
        offset_ticks: off,
        bound_lo: lo,
        bound_hi: hi,
        truth_ticks: t,
        error_ticks: i128::from(off) - t,
        at_host_tsc: Some(at),
        anchor: p["anchor"].as_str().map(str::to_owned),
    };
    Ok((row, checked))
}

#[allow(clippy::too_many_arguments)] // One call site; the pieces are what the text shows.
fn print_text(
    vmm: Vmm,
    why: &str,
    transport: &str,
    path: &str,
    skews: &[Skew],
    m: &Measured,
    rows: &[Row],
) {
    println!("vmtsync demo: VMM {} ({why})", vmm.name());
    println!("transport: {transport} ({path})");
    for (v, truth) in m.truth.iter().enumerate() {
        match truth {
            Truth::Sim(s) => {
                println!("truth: the loopback agent's offset, {s} ticks; no VM, so no KVM row");
            }
            Truth::Vm(t) => {
                let kvm = t.kvm;
                println!(
                    "kvm: vcpu{v} guest TSC = {} + (host TSC * {}) >> {} (debugfs, exact)",
                    kvm.offset(),
                    kvm.ratio(),
                    kvm.frac_bits()
                );
                match skews.get(v) {
                    Some(s) => println!(
                        "skew: vcpu{v}'s agent reports {} + (its TSC * {}) >> {} (offset from the host TSC now, rate 1.0001)",
                        s.0.offset(),
                        s.0.ratio(),
                        s.0.frac_bits()
                    ),
                    None => println!("skew: none (--no-skew)"),
                }
            }
        }
    }
    if matches!(m.truth.first(), Some(Truth::Vm(_))) {
        println!(
            "truth: each vCPU's kvm mapping, then its skew, at each probe's host TSC (column truth)"
        );
    }
    println!(
        "{:>4}  {:<8} {:>14}  {:>31}  {:>10}  {:>14}  {:>8}  stamps",
        "vcpu", "method", "offset_ticks", "interval [lo, hi]", "width", "truth", "error"
    );
    for r in rows {
        println!(
            "{:>4}  {:<8} {:>14}  {:>31}  {:>10}  {:>14}  {:>+8}  {}",
            r.vcpu,
            r.method,
            r.offset_ticks,
            format!("[{}, {}]", r.bound_lo, r.bound_hi),
            i128::from(r.bound_hi) - i128::from(r.bound_lo),
            r.truth_ticks,
            r.error_ticks,
            r.anchor.as_deref().unwrap_or("debugfs")
        );
    }
    // vCPU 0's rows, the vCPU the agent itself runs on.
    let width = |method: &str| {
        rows.iter()
            .find(|r| r.method == method && r.vcpu == 0)
            .map(|r| i128::from(r.bound_hi) - i128::from(r.bound_lo))
    };
    if let (Some(ip), Some(p)) = (width("probe-ip"), width("probe")) {
        println!(
            "widths: probe {p} ticks ({}) vs probe-ip {ip} ticks (stamped in the vmtsync process): {:.1}x narrower",
            rows.iter()
                .find(|r| r.method == "probe")
                .and_then(|r| r.anchor.as_deref())
                .unwrap_or("?"),
            ip as f64 / p.max(1) as f64
        );
    }
    for p in &m.probe {
        println!(
            "probe vcpu {}: {} probes, model {}, rtt min {} median {} ticks; trace-cmd fastest-RTT estimate {} ticks",
            p["vcpu"],
            p["probes"],
            p["model"].as_str().unwrap_or("?"),
            p["rtt_min_ticks"],
            p["rtt_median_ticks"],
            p["tracecmd_fastest_rtt_offset"]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmtsync_core::mapping::KvmTscMapping;

    #[test]
    fn json_keeps_the_documented_key_order_and_parses() {
        let rows = [Row {
            vcpu: 0,
            method: "probe",
            offset_ticks: -5,
            bound_lo: -9,
            bound_hi: 2,
            truth_ticks: 0,
            error_ticks: -5,
            at_host_tsc: Some(7),
            anchor: Some("kvm-pio-uart".into()),
        }];
        let line = serde_json::to_string(&Report {
            schema: 1,
            vmm: "qemu",
            transport: "uart",
            skew: None,
            vcpus: &rows,
            skews: Vec::new(),
        })
        .unwrap();
        assert_eq!(
            line,
            r#"{"schema":1,"vmm":"qemu","transport":"uart","skew":null,"vcpus":[{"vcpu":0,"method":"probe","offset_ticks":-5,"bound_lo":-9,"bound_hi":2,"truth_ticks":0,"error_ticks":-5,"at_host_tsc":7,"anchor":"kvm-pio-uart"}],"skews":[]}"#
        );
    }

    #[test]
    fn args_parse_and_refuse_unknown_options() {
        let s = |v: &[&str]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
        let a = parse_args(&s(&["--json", "--vmm", "builtin"])).unwrap();
        assert!(a.json && a.vmm == Some(Vmm::Builtin) && a.skew);
        assert!(parse_args(&s(&["--vmm", "auto"])).unwrap().vmm.is_none());
        assert!(!parse_args(&s(&["--no-skew"])).unwrap().skew);
        assert!(parse_args(&s(&["--vmm", "xen"])).is_err());
        assert!(parse_args(&s(&["--fast"])).is_err());
        assert_eq!(parse_args(&s(&["--smp", "4"])).unwrap().smp, Some(4));
        assert!(parse_args(&s(&["--smp", "0"])).is_err());
        assert!(parse_args(&s(&["--smp", "9"])).is_err());
        assert!(parse_args(&s(&["--smp"])).is_err());
    }

    #[test]
    fn each_probe_row_is_checked_against_its_own_vcpus_truth() {
        let truths = [Truth::Sim(100), Truth::Sim(5_000)];
        let p = |vcpu: u64| {
            serde_json::json!({"vcpu": vcpu, "offset_ticks": 4_990, "bound_lo": 4_980,
                               "bound_hi": 5_010, "at_host_tsc": 1})
        };
        let (row, checked) = probe_row("probe", &p(1), &truths).unwrap();
        assert_eq!(
            (row.vcpu, row.truth_ticks, row.error_ticks),
            (1, 5_000, -10)
        );
        assert_eq!(checked, Ok(5_000));
        let (row, checked) = probe_row("probe", &p(0), &truths).unwrap();
        assert!(checked.is_err() && row.truth_ticks == 100, "{row:?}");
        assert!(
            probe_row("probe", &p(2), &truths).is_err(),
            "no vCPU 2 in the VM"
        );
    }

    #[test]
    fn the_truth_must_lie_in_the_bounds() {
        assert_eq!(Truth::Sim(5).check(HostTicks(0), 0, 9), Ok(5));
        let e = Truth::Sim(0)
            .check(HostTicks(0), -6_010, -5_990)
            .unwrap_err();
        assert!(
            e.contains("0 lies outside") && e.contains("[-6010, -5990]"),
            "{e}"
        );
        let t = Truth::Vm(GuestTruth::new(
            KvmTscMapping::offset_only(-1_000),
            Some(Skew(KvmTscMapping::offset_only(300))),
        ));
        assert_eq!(t.check(HostTicks(50), -700, -700), Ok(-700));
        assert!(t.check(HostTicks(50), -699, 0).is_err());
    }
}
