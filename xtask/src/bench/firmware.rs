//! SeaBIOS's boot, stock against traced (issues 24 and 25): what recording its POST phases,
//! and every function call of its 32-bit code, costs the firmware. The images are built from
//! the same Debian source by `vmtsync_launch::firmware`: stock, with POST phases as spans (the
//! 19-line patch and the C recorder), and with function tracing (`-finstrument-functions` on
//! the 32-bit flat code, a flight ring), and booted the same way: QEMU `-M pc` started paused,
//! resumed over QMP, and timed from the `cont` reply to the first `Booting from` line on
//! SeaBIOS's debug console (its first boot attempt, after the boot menu's wait; SeaBIOS prints
//! no boot-menu line unless the menu is enabled). The traced runs have `vmtsync record
//! --from-memory` (beacon mode) attached before the first instruction, so they pay for every
//! event and beacon as a user's would. The images take turns in a rotating order; the ratios
//! are of the medians.

use std::fmt::Write as _;
use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use vmtsync_launch::ChildGuard;
use vmtsync_launch::firmware::{self, BOOTING_LINE, MEMORY_MIB, Variant};
use vmtsync_launch::qemu::{command_firmware, paused_with_qmp, qmp_cont};

use super::format::{ratio, sig3, thousands};
use super::{Plan, Section, Stat};

/// The longest wait for SeaBIOS's first boot attempt.
const BOOT_LIMIT: Duration = Duration::from_secs(180);

/// One boot.
struct Run {
    /// Seconds from QMP `cont` to the first `Booting from` line.
    secs: f64,
    /// QEMU's CPU time (user + system, all threads) by then: the work the boot took, which a
    /// loaded machine changes far less than the wall clock (a vCPU waiting for a core uses none).
    cpu: f64,
    /// The reader's counts (traced runs): events recorded, records lost, median interval width
    /// in ticks.
    recorded: Option<(u64, u64, u64)>,
    /// The firmware's own counts when the reader stopped (its last counts line): records
    /// produced and refused.
    firmware: Option<(u64, u64)>,
}

/// Boots `bios` once; with `vmtsync`, records it from memory while it runs.
fn boot(bios: &Path, dir: &Path, vmtsync: Option<&Path>) -> Result<Run> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let (log, qmp) = (dir.join("debug.log"), dir.join("qmp.sock"));
    let mut c = command_firmware(bios, &log, MEMORY_MIB);
    c.args(paused_with_qmp(&qmp))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let qemu = ChildGuard::new(c.spawn().context("starting QEMU")?);
    let reader = match vmtsync {
        Some(v) => {
            wait_vm(v, qemu.pid())?;
            let err = dir.join("record.stderr");
            let mut r = Command::new(v);
            r.args(["record", "--from-memory", "--vm", &qemu.pid().to_string()])
                .args([
                    "--format",
                    "jsonl",
                    "--duration",
                    "300",
                    "--no-progress",
                    "--out",
                ])
                .arg(dir.join("seabios.jsonl"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(File::create(&err)?);
            Some((ChildGuard::new(r.spawn().context("starting vmtsync")?), err))
        }
        None => None,
    };
    qmp_cont(&qmp, Duration::from_secs(20))?;
    let t0 = Instant::now();
    loop {
        if std::fs::read_to_string(&log).is_ok_and(|t| t.contains(BOOTING_LINE)) {
            break;
        }
        if t0.elapsed() > BOOT_LIMIT {
            bail!(
                "SeaBIOS made no boot attempt within {BOOT_LIMIT:?} ({})",
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_secs(qemu.pid())?;
    let recorded = match reader {
        Some((mut g, err)) => {
            g.signal(libc::SIGINT).context("SIGINT vmtsync")?;
            let status = g
                .wait_timeout(Duration::from_secs(60))?
                .context("vmtsync record did not end within 60 s of SIGINT")?;
            let text = std::fs::read_to_string(&err)?;
            ensure!(status.success(), "vmtsync record failed: {text}");
            Some(counts(&text).with_context(|| format!("vmtsync's summary: {text}"))?)
        }
        None => None,
    };
    drop(qemu);
    let firmware = firmware::counts_in(&std::fs::read_to_string(&log).unwrap_or_default())
        .last()
        .map(|&(_, produced, refused)| (produced, refused));
    Ok(Run {
        secs,
        cpu,
        recorded,
        firmware,
    })
}

/// Process `pid`'s CPU time so far (utime + stime of /proc/PID/stat), in seconds.
fn cpu_secs(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').context("/proc/PID/stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5), the 12th and 13th after the name.
    let ticks: u64 =
        f.get(11).context("utime")?.parse::<u64>()? + f.get(12).context("stime")?.parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ensure!(hz > 0, "sysconf(_SC_CLK_TCK)");
    Ok(ticks as f64 / hz as f64)
}

/// Events recorded, records lost (dropped by the ring) and the median interval width from
/// `vmtsync record`'s summary.
fn counts(summary: &str) -> Option<(u64, u64, u64)> {
    let after = |what: &str| -> Option<u64> {
        let rest = &summary[summary.find(what)? + what.len()..];
        rest.split(|c: char| !c.is_ascii_digit())
            .find(|w| !w.is_empty())?
            .parse()
            .ok()
    };
    let before = |what: &str| -> Option<u64> {
        let head = summary[..summary.find(what)?].trim_end();
        let from = head
            .rfind(|c: char| !c.is_ascii_digit())
            .map_or(0, |k| k + 1);
        head[from..].parse().ok()
    };
    Some((
        after("recorded ")?,
        before(" dropped by the guest's ring")?,
        after("median ")?,
    ))
}

/// Waits until KVM debugfs lists QEMU `pid`'s paused VM (`vmtsync kvm --json`).
fn wait_vm(vmtsync: &Path, pid: u32) -> Result<()> {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let o = Command::new(vmtsync)
            .args(["kvm", "--json", "--vm", &pid.to_string()])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()?;
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        if v["vms"][0]["vcpus"][0].is_object() {
            return Ok(());
        }
        ensure!(
            Instant::now() < end,
            "QEMU {pid}'s VM never appeared in KVM debugfs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One image the section boots, and its runs.
struct Image {
    label: &'static str,
    /// A word for its scratch directory.
    dir: &'static str,
    bios: std::path::PathBuf,
    traced: bool,
    runs: Vec<Run>,
}

impl Image {
    fn stat(&self, f: impl Fn(&Run) -> f64) -> Result<Stat> {
        Stat::of(&self.runs.iter().map(f).collect::<Vec<_>>())
            .with_context(|| format!("no {} run", self.label))
    }

    /// The smallest count of events a run recorded, and the records the reader lost in all
    /// runs (refused, or overwritten before it read them).
    fn recorded(&self) -> (u64, u64) {
        let rec: Vec<(u64, u64, u64)> = self.runs.iter().filter_map(|r| r.recorded).collect();
        (
            rec.iter().map(|r| r.0).min().unwrap_or(0),
            rec.iter().map(|r| r.1).sum(),
        )
    }

    /// The firmware's own produced count (smallest over the runs) and refused count (all
    /// runs).
    fn produced(&self) -> (u64, u64) {
        let fw: Vec<(u64, u64)> = self.runs.iter().filter_map(|r| r.firmware).collect();
        (
            fw.iter().map(|f| f.0).min().unwrap_or(0),
            fw.iter().map(|f| f.1).sum(),
        )
    }
}

pub(super) fn firmware(plan: &Plan, work: &Path) -> Result<Section> {
    let rounds = if plan.quick { 1 } else { 5 };
    firmware::ensure_source()?;
    let mut images = Vec::new();
    for (label, dir, variant, traced) in [
        ("stock", "stock", Variant::Stock, false),
        ("POST phases as spans", "phases", Variant::Traced, true),
        (
            "every function call (`-finstrument-functions`)",
            "functions",
            Variant::Functions,
            true,
        ),
    ] {
        images.push(Image {
            label,
            dir,
            bios: firmware::build(variant)?.join("bios.bin"),
            traced,
            runs: Vec::new(),
        });
    }
    let vmtsync = plan.bin_dir.join("vmtsync");
    let n = images.len();
    for round in 0..rounds {
        // Rotate which goes first, so a drift in the machine's load hits every image alike.
        for k in 0..n {
            let im = &mut images[(round + k) % n];
            let r = boot(
                &im.bios,
                &work.join("firmware").join(im.dir),
                im.traced.then_some(vmtsync.as_path()),
            )?;
            eprintln!(
                "firmware: {} boot {:.3} s (QEMU CPU {:.3} s), reader {:?}, firmware {:?}",
                im.dir, r.secs, r.cpu, r.recorded, r.firmware
            );
            im.runs.push(r);
        }
    }
    let s3 = |v: f64| format!("{} s", sig3(v));
    let (stock_secs, stock_cpu, stock_cpu_max) = (
        images[0].stat(|r| r.secs)?.median,
        images[0].stat(|r| r.cpu)?.median,
        images[0].stat(|r| r.cpu)?.max,
    );
    let mut body = String::new();
    let _ = writeln!(
        body,
        "SeaBIOS 1.16.2 (Debian's source), `-M pc`, {MEMORY_MIB} MiB, time from QMP `cont` to \
         its first boot attempt (the debug console's first `{BOOTING_LINE}` line; SeaBIOS prints \
         no boot-menu line unless the menu is enabled), {rounds} boots of each image in rotating \
         order. Events recorded: the reader's count; produced: the firmware's own count of the \
         records its ring stored (events and beacons); lost: refused by the ring plus \
         overwritten before the reader read them.\n"
    );
    let _ = writeln!(
        body,
        "| image | boots | time to first boot attempt (min / median / max) | / stock | QEMU's CPU time by then | / stock | events recorded per boot | records produced | lost |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let mut summary = Vec::new();
    let mut costs = Vec::new();
    for im in &images {
        let (secs, cpu) = (im.stat(|r| r.secs)?, im.stat(|r| r.cpu)?);
        let (events, lost) = im.recorded();
        let (produced, refused) = im.produced();
        let (rw, rc) = (secs.median / stock_secs, cpu.median / stock_cpu);
        let counted = |v: u64| {
            if im.traced {
                thousands(v)
            } else {
                "—".into()
            }
        };
        let _ = writeln!(
            body,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            im.label,
            im.runs.len(),
            secs.show(s3),
            ratio(rw),
            cpu.show(s3),
            ratio(rc),
            counted(events),
            counted(produced),
            counted(lost + refused),
        );
        if !im.traced {
            continue;
        }
        // Traced minus stock, per event of one boot: only where the traced runs' CPU times all
        // lie above the stock runs' (else the difference is the machine's noise).
        let per = |d: f64| sig3(d / events.max(1) as f64 * 1e6);
        costs.push(if cpu.min > stock_cpu_max {
            format!(
                "{}: {} µs of QEMU's CPU time ({} µs wall clock) per event over {} events",
                im.dir,
                per(cpu.median - stock_cpu),
                per(secs.median - stock_secs),
                thousands(events)
            )
        } else {
            format!(
                "{}: not measurable over {} events (its CPU times overlap stock's)",
                im.dir,
                thousands(events)
            )
        });
        summary.push([
            format!("SeaBIOS to first boot attempt, {} vs stock", im.label),
            "— (measured)".into(),
            format!(
                "{} in QEMU's CPU time ({} vs {}); {} wall clock; {} events",
                ratio(rc),
                s3(cpu.median),
                s3(stock_cpu),
                ratio(rw),
                thousands(events)
            ),
            if lost + refused == 0 {
                "every event recovered".to_owned()
            } else {
                format!("{} lost", thousands(lost + refused))
            },
        ]);
    }
    let _ = writeln!(
        body,
        "\nWhat tracing adds (medians, traced minus stock, divided by one boot's events): {}. \
         Ring 0 is emulated on this nested host, so every instruction of a record costs far \
         more than on hardware; each phase event is also followed by a beacon (two port exits). \
         The function build records every entry and exit from the first phase to the first boot \
         attempt into a 65536-record flight ring that the live reader drains.",
        costs.join("; ")
    );
    Ok(Section {
        command: "cargo xtask bench --only firmware".into(),
        body,
        summary,
    })
}

#[cfg(test)]
mod tests {
    use super::counts;

    #[test]
    fn the_readers_summary_gives_its_counts() {
        let s = "vmtsync: recorded 11 events to /x/seabios.jsonl (ended by a signal); 0 dropped \
                 by the guest's ring; 10 beacon segments (0 breaks); guaranteed interval \
                 widths: min 139730, median 155703, max 192005 ticks\nvmtsync: read ...";
        assert_eq!(counts(s), Some((11, 0, 155_703)));
        assert_eq!(counts("nothing"), None);
    }
}
