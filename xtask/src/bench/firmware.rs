//! SeaBIOS's boot, stock against traced (issue 24): what recording its POST phases costs the
//! firmware. Both images are built from the same Debian source by `vmtsync_launch::firmware`
//! (the traced one with the 19-line patch and the C recorder) and booted the same way: QEMU
//! `-M pc` started paused, resumed over QMP, and timed from the `cont` reply to the first
//! `Booting from` line on SeaBIOS's debug console (its first boot attempt, after the boot
//! menu's wait). The traced runs have `vmtsync record --from-memory` (beacon mode) attached
//! before the first instruction, so they pay for every event and beacon as a user's would.
//! Stock and traced runs alternate; the ratio is of the medians.

use std::fmt::Write as _;
use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use vmtsync_launch::ChildGuard;
use vmtsync_launch::firmware::{self, BOOTING_LINE, MEMORY_MIB, Variant};
use vmtsync_launch::qemu::{command_firmware, paused_with_qmp, qmp_cont};

use super::format::{ratio, sig3};
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
            let pid = libc::pid_t::try_from(g.pid())?;
            // SAFETY: kill(2) with our own child's PID, unreaped (the guard holds it).
            let sent = unsafe { libc::kill(pid, libc::SIGINT) };
            ensure!(
                sent == 0,
                "SIGINT vmtsync: {}",
                std::io::Error::last_os_error()
            );
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
    Ok(Run {
        secs,
        cpu,
        recorded,
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

pub(super) fn firmware(plan: &Plan, work: &Path) -> Result<Section> {
    let pairs = if plan.quick { 1 } else { 5 };
    firmware::ensure_source()?;
    let stock = firmware::build(Variant::Stock)?.join("bios.bin");
    let traced = firmware::build(Variant::Traced)?.join("bios.bin");
    let vmtsync = plan.bin_dir.join("vmtsync");
    let dir = work.join("firmware");
    let (mut s, mut t) = (Vec::new(), Vec::new());
    for i in 0..pairs {
        // Alternate which goes first, so a drift in the machine's load hits both alike.
        for traced_turn in [i % 2 == 1, i % 2 == 0] {
            if traced_turn {
                let r = boot(&traced, &dir.join("traced"), Some(&vmtsync))?;
                eprintln!("firmware: traced boot {:.3} s {:?}", r.secs, r.recorded);
                t.push(r);
            } else {
                let r = boot(&stock, &dir.join("stock"), None)?;
                eprintln!("firmware: stock boot {:.3} s", r.secs);
                s.push(r);
            }
        }
    }
    let secs = |v: &[Run]| Stat::of(&v.iter().map(|r| r.secs).collect::<Vec<_>>());
    let cpu = |v: &[Run]| Stat::of(&v.iter().map(|r| r.cpu).collect::<Vec<_>>());
    let (ss, ts) = (
        secs(&s).context("no stock run")?,
        secs(&t).context("no traced run")?,
    );
    let (sc, tc) = (
        cpu(&s).context("no stock run")?,
        cpu(&t).context("no traced run")?,
    );
    let rc = tc.median / sc.median;
    let rec: Vec<(u64, u64, u64)> = t.iter().filter_map(|r| r.recorded).collect();
    let events = rec.iter().map(|r| r.0).min().unwrap_or(0);
    let lost: u64 = rec.iter().map(|r| r.1).sum();
    let width = Stat::of(&rec.iter().map(|r| r.2 as f64).collect::<Vec<_>>());
    let r = ts.median / ss.median;
    let s3 = |v: f64| format!("{} s", sig3(v));
    let mut body = String::new();
    let _ = writeln!(
        body,
        "SeaBIOS 1.16.2 (Debian's source), `-M pc`, {MEMORY_MIB} MiB, time from QMP `cont` to \
         its first boot attempt (the debug console's first `{BOOTING_LINE}` line), {pairs} \
         stock and {pairs} traced boots alternating:\n"
    );
    let _ = writeln!(
        body,
        "| image | boots | time to first boot attempt (min / median / max) | QEMU's CPU time by then | events recorded per boot | records lost |\n|---|---:|---:|---:|---:|---:|"
    );
    let _ = writeln!(
        body,
        "| stock | {} | {} | {} | — | — |",
        s.len(),
        ss.show(s3),
        sc.show(s3)
    );
    let _ = writeln!(
        body,
        "| POST phases recorded, reader attached | {} | {} | {} | {events} | {lost} |",
        t.len(),
        ts.show(s3),
        tc.show(s3)
    );
    let _ = writeln!(
        body,
        "\nTraced / stock: **{}** in QEMU's CPU time, {} in wall-clock time (medians; the wall \
         clock also holds the waits for a core on a loaded machine). Each event is followed by a beacon (two port \
         exits); ring 0 is emulated on this nested host, so each costs tens of µs. Median \
         guaranteed interval per boot (beacon mode, ticks): {}.",
        ratio(rc),
        ratio(r),
        width.map_or_else(|| "—".into(), |w| w.show(|v| format!("{v:.0}")))
    );
    Ok(Section {
        command: "cargo xtask bench --only firmware".into(),
        body,
        summary: vec![[
            "SeaBIOS to first boot attempt, POST phases recorded vs stock".into(),
            "— (measured)".into(),
            format!(
                "{} in QEMU's CPU time ({} vs {}); {} wall clock",
                ratio(rc),
                s3(tc.median),
                s3(sc.median),
                ratio(r)
            ),
            if lost == 0 {
                "every event recovered"
            } else {
                "events lost"
            }
            .into(),
        ]],
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
