//! `vmtsync record` as a user runs it, boot options against boot options (`--record`): the
//! bundled agent under QEMU microvm, its TSC 100 ppm fast through a software skew derived from
//! the host TSC ([`Skew::pick`]), a workload of events between exit-anchored sync rounds
//! (`vmtsync record --anchor kvm-pio --vm PID`, the CLI binary next to this one), once per
//! [`CONFIGS`] entry, all in one run.
//!
//! Per configuration: every round's guaranteed offset interval (the sync file's segments), every
//! event's guaranteed host interval (`host_lo..host_hi` of its JSON line), and every event's
//! error against the truth: the largest host tick at which the agent would have reported a
//! value at or below the event's guest TSC (KVM debugfs, then the skew, each inverted rounding
//! down), so the truth comes from the skew this run chose and the kernel, not from `record`.
//! An event whose interval misses the truth fails the run (exit code 3, like the probe rows).

use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;
use vmtsync_core::GuestTicks;
use vmtsync_launch::bench::{self, RecordBench, RecordSchema};
use vmtsync_tests::truth::{GuestTruth, Skew};
use vmtsync_tests::vmm::agent_elf;
use vmtsync_tests::vmm::qemu::have_qemu;
use vmtsync_tests::vmm::qemu::{self, Machine};
use vmtsync_tests::{ChildGuard, have_kvm};

use crate::STEP;

/// One way of running the agent and `record`: a name, the agent's boot options beyond the
/// transport, the skew and the workload, and `record`'s extra arguments.
pub struct Config {
    /// The row's name.
    pub name: &'static str,
    /// Agent boot options.
    pub boot: &'static str,
    /// `vmtsync record` arguments beyond the common ones.
    pub record: &'static [&'static str],
}

/// The configurations, in the table's order: the boot a user got before the tight default
/// (loop in ring 3, no sync port: UART-byte brackets) with `record`'s earlier one-sided
/// placement (before), then the default boot now (ring 0, sync port `0x2400`) with each
/// placement, and the old boot with the two-sided one, so each change shows on its own.
pub const CONFIGS: [Config; 4] = [
    Config {
        name: "before: ring=3 syncport=off, one-sided",
        boot: "ring=3 syncport=off",
        record: &["--placement", "one-sided"],
    },
    Config {
        name: "ring=3 syncport=off, two-sided",
        boot: "ring=3 syncport=off",
        record: &["--placement", "two-sided"],
    },
    Config {
        name: "default boot, one-sided",
        boot: "",
        record: &["--placement", "one-sided"],
    },
    Config {
        name: "after: default boot, two-sided (the defaults)",
        boot: "",
        record: &[],
    },
];

/// Events each configuration records, and the workload's rate (events per second).
const EVENTS: u64 = 2000;
const RATE: u64 = 400;
/// Milliseconds between sync rounds.
const RESYNC_MS: &str = "500";

/// One configuration's measurements, in host TSC ticks.
#[derive(Debug, Clone, Default)]
pub struct RecordRow {
    /// The configuration's name.
    pub name: String,
    /// Every round's guaranteed offset interval width.
    pub round_widths: Vec<u64>,
    /// Every event's guaranteed host interval width.
    pub event_widths: Vec<u64>,
    /// Every event's |host_tsc − truth|.
    pub errors: Vec<u64>,
    /// Events whose interval held the truth.
    pub inside: u64,
    /// The segments' anchors (`kvm-pio-uart`, `kvm-pio-sync-port`), distinct, in order.
    pub anchors: Vec<String>,
}

/// `--record`: every configuration of [`CONFIGS`], a table, then one JSON line; exit 3
/// when an event's guaranteed interval missed its truth.
pub fn main() -> ExitCode {
    let run = || -> Result<Vec<RecordRow>> {
        if !have_kvm() || !have_qemu() {
            bail!("needs /dev/kvm (root) and qemu-system-x86_64");
        }
        let elf = agent_elf().context("building the guest agent")?;
        let cli = std::env::current_exe()?.with_file_name("vmtsync");
        if !cli.exists() {
            bail!("{} is missing (cargo build --bin vmtsync)", cli.display());
        }
        run(&elf, &cli)
    };
    let rows = match run() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vmtsync-probe-bench: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let mut out = Vec::new();
    let mut unsound = false;
    for r in &rows {
        let max = |v: &[u64]| v.iter().copied().max().unwrap_or(0);
        let (rw, ew) = (&r.round_widths, &r.event_widths);
        let row = bench::RecordRow {
            name: r.name.clone(),
            anchors: r.anchors.clone(),
            rounds: rw.len() as u64,
            events: ew.len() as u64,
            inside: r.inside,
            round_width_median: crate::stats::median(rw),
            round_width_max: max(rw),
            event_width_median: crate::stats::median(ew),
            event_width_max: max(ew),
            err_median: crate::stats::median(&r.errors),
        };
        // Each row on its own line as it is measured, for a human watching; the reader takes
        // the result line after them.
        println!(
            "{}",
            serde_json::to_string(&row).expect("a record row serializes")
        );
        unsound |= r.inside != row.events;
        out.push(row);
    }
    println!(
        "{}",
        bench::to_line(&RecordBench {
            schema: RecordSchema,
            rows: out
        })
    );
    if unsound {
        eprintln!("vmtsync-probe-bench: an event's guaranteed interval missed its truth");
        return ExitCode::from(3);
    }
    ExitCode::SUCCESS
}

/// Runs every configuration once with the `vmtsync` binary `cli`.
pub fn run(elf: &Path, cli: &Path) -> Result<Vec<RecordRow>> {
    CONFIGS.iter().map(|c| run_one(elf, cli, c)).collect()
}

fn run_one(elf: &Path, cli: &Path, c: &Config) -> Result<RecordRow> {
    let dir = tempfile::Builder::new()
        .prefix("vmtsync-record-bench-")
        .tempdir()?;
    let skew = Skew::pick();
    let append = format!(
        "transport=uart exit=0 workload={RATE},0 {} {}",
        skew.agent_option(),
        c.boot
    );
    let sock = dir.path().join("com1.sock");
    let child = qemu::command_com1_socket(
        Machine::Microvm,
        elf,
        &append,
        &dir.path().join("com2.log"),
        &sock,
    )
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .context("starting qemu-system-x86_64")?;
    let guard = ChildGuard::new(child);
    let deadline = Instant::now() + STEP;
    while !sock.exists() {
        if Instant::now() > deadline {
            bail!("{}: QEMU's COM1 socket never appeared", c.name);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // KVM debugfs lists the vCPU once QEMU created it; the truth is read while the VM runs.
    let truth = loop {
        match GuestTruth::read(guard.pid(), 0, Some(skew)) {
            Ok(t) => break t,
            Err(e) if Instant::now() > deadline => bail!("{}: truth from debugfs: {e}", c.name),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let (out, sync) = (
        dir.path().join("events.jsonl"),
        dir.path().join("sync.jsonl"),
    );
    let mut cmd = Command::new(cli);
    cmd.arg("record")
        .arg("--connect")
        .arg(format!("unix:{}", sock.display()))
        .arg("--out")
        .arg(&out)
        .args(["--format", "jsonl", "--events", &EVENTS.to_string()])
        .args(["--duration", "120", "--resync", RESYNC_MS, "--shutdown"])
        .args(["--anchor", "kvm-pio", "--vm", &guard.pid().to_string()])
        .arg("--sync-out")
        .arg(&sync)
        .args(c.record)
        .stdin(Stdio::null());
    let o = cmd.output().context("running vmtsync record")?;
    if !o.status.success() {
        bail!(
            "{}: vmtsync record exited with {}: {}",
            c.name,
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
    drop(guard);
    let mut row = RecordRow {
        name: c.name.into(),
        ..RecordRow::default()
    };
    for v in json_lines(&sync)? {
        if v["type"] != "segment" {
            continue;
        }
        let (lo, hi) = (v["offset_lo"].as_i64(), v["offset_hi"].as_i64());
        let (Some(lo), Some(hi)) = (lo, hi) else {
            bail!("{}: a segment without bounds: {v}", c.name);
        };
        row.round_widths.push(hi.abs_diff(lo));
        let anchor = v["anchor"].as_str().unwrap_or("?").to_owned();
        if !row.anchors.contains(&anchor) {
            row.anchors.push(anchor);
        }
    }
    for v in json_lines(&out)? {
        let field = |k: &str| {
            v[k].as_u64()
                .with_context(|| format!("{}: an event without {k}: {v}", c.name))
        };
        let (guest, host, lo, hi) = (
            field("guest_tsc")?,
            field("host_tsc")?,
            field("host_lo")?,
            field("host_hi")?,
        );
        let t = true_host(&truth, guest)
            .with_context(|| format!("{}: the truth of guest tick {guest}", c.name))?;
        row.event_widths.push(hi.saturating_sub(lo));
        row.errors.push(host.abs_diff(t));
        row.inside += u64::from(lo <= t && t <= hi);
    }
    if row.event_widths.is_empty() || row.round_widths.is_empty() {
        bail!("{}: no events or no rounds recorded", c.name);
    }
    Ok(row)
}

/// The largest host tick at which the agent reports a value at or below `guest`: the skew's
/// inverse, then KVM's, each rounding down (both maps are monotone, so the composition is).
fn true_host(truth: &GuestTruth, guest: u64) -> Option<u64> {
    let kvm_guest = truth.skew.try_host_from_guest_floor(GuestTicks(guest))?;
    let host = truth
        .kvm
        .try_host_from_guest_floor(GuestTicks(kvm_guest.0))?;
    Some(host.0)
}

fn json_lines(path: &Path) -> Result<Vec<Value>> {
    std::fs::read_to_string(path)
        .with_context(|| format!("reading {}", path.display()))?
        .lines()
        .map(|l| serde_json::from_str(l).with_context(|| format!("{}: {l}", path.display())))
        .collect()
}
