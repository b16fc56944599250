//! `vmtsync-demo --firmware` (`cargo xtask demo --firmware`): SeaBIOS traced live. It fetches
//! and builds the traced SeaBIOS (`vmtsync_launch::firmware`: Debian's source, the 17-line
//! patch, the C recorder), boots it under QEMU `-M pc` paused, attaches `vmtsync record
//! --from-memory` (beacon mode: guaranteed intervals from the firmware's sync beacons,
//! bracketed by the host's own `kvm_pio` exits), resumes it, and once SeaBIOS has tried every
//! boot device prints each POST phase and boot attempt with its host time in seconds and its
//! guaranteed interval.
//!
//! Truth: KVM's mapping of vCPU 0 from debugfs (`vmtsync_tests::truth`), read after the run
//! (SeaBIOS never writes its TSC), and the firmware's own produced count on its debug console.
//! The demo fails (exit 1) when an interval misses its event's exact host time or a record the
//! firmware stored is not accounted for.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;
use vmtsync_core::GuestTicks;
use vmtsync_launch::firmware::{self, BOOT_EVENT, MEMORY_MIB, PHASE_EVENT, Variant};
use vmtsync_launch::prereq::ensure_qemu;
use vmtsync_launch::qemu::{command_firmware, paused_with_qmp, qmp_cont};
use vmtsync_launch::{ChildGuard, have_kvm, is_root};
use vmtsync_tests::truth::truth_mapping;

/// The longest wait for SeaBIOS to try every boot device (emulated ring 0 on nested KVM makes
/// POST take seconds; a floppy timeout alone takes several).
const BOOT_LIMIT: Duration = Duration::from_secs(180);

/// One recorded event, as the demo prints it.
struct Event {
    name: String,
    host: u64,
    lo: u64,
    hi: u64,
    exact: u64,
}

/// Runs the firmware demo with the `vmtsync` program at `vmtsync`.
pub(crate) fn run(vmtsync: &Path) -> Result<()> {
    if !have_kvm() || !is_root() {
        bail!(
            "--firmware needs /dev/kvm and root (debugfs and the guest's memory): run `sudo -E cargo xtask demo --firmware`"
        );
    }
    ensure_qemu()?;
    let t0 = Instant::now();
    firmware::ensure_source()?;
    let out = firmware::build(Variant::Traced)?;
    let built = t0.elapsed();
    eprintln!(
        "demo: traced SeaBIOS in {} ({:.1} s, cached by its inputs)",
        out.display(),
        built.as_secs_f64()
    );
    let dir = tempfile::Builder::new()
        .prefix("vmtsync-demo-firmware-")
        .tempdir()?;
    let log = dir.path().join("debug.log");
    let qmp = dir.path().join("qmp.sock");
    let mut c = command_firmware(&out.join("bios.bin"), &log, MEMORY_MIB);
    c.args(paused_with_qmp(&qmp))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    eprintln!("$ {}", vmtsync_launch::prereq::display(&c));
    let qemu = ChildGuard::new(c.spawn().context("starting QEMU")?);
    let pid = qemu.pid();
    wait_vm(vmtsync, pid)?;
    let jsonl = dir.path().join("seabios.jsonl");
    let err_path = dir.path().join("record.stderr");
    let mut rec = vmtsync_cmd(vmtsync, pid, &jsonl);
    rec.stderr(std::fs::File::create(&err_path)?);
    eprintln!("$ {}", vmtsync_launch::prereq::display(&rec));
    let mut rec = ChildGuard::new(rec.spawn().context("starting vmtsync record")?);
    qmp_cont(&qmp, Duration::from_secs(20))?;
    let started = Instant::now();
    let text = wait_log(&log, "No bootable device")?;
    let boot_secs = started.elapsed().as_secs_f64();
    let (_, produced, refused) = *firmware::counts_in(&text)
        .last()
        .context("the traced SeaBIOS printed no counts line")?;
    let rec_pid = libc::pid_t::try_from(rec.pid())?;
    // SAFETY: kill(2) with our own child's PID, unreaped (the guard holds it).
    if unsafe { libc::kill(rec_pid, libc::SIGINT) } != 0 {
        bail!(
            "could not stop vmtsync record: {}",
            std::io::Error::last_os_error()
        );
    }
    let status = rec
        .wait_timeout(Duration::from_secs(60))?
        .context("vmtsync record did not end within 60 s of SIGINT")?;
    let stderr = std::fs::read_to_string(&err_path)?;
    if !status.success() {
        bail!("vmtsync record failed ({status}): {stderr}");
    }
    let kvm = truth_mapping(pid, 0).context("KVM's mapping from debugfs")?;
    drop(qemu);

    let mut events = Vec::new();
    for line in std::fs::read_to_string(&jsonl)?.lines() {
        let v: Value = serde_json::from_str(line)?;
        let n = |k: &str| v[k].as_u64().with_context(|| format!("{k} in {v}"));
        let payload = hex(v["payload"].as_str().unwrap_or(""));
        let name = match u16::try_from(n("id")?)? {
            PHASE_EVENT => String::from_utf8_lossy(&payload).into_owned(),
            BOOT_EVENT => format!(
                "boot attempt {}",
                u32::from_le_bytes(payload.try_into().unwrap_or_default())
            ),
            other => format!("event {other}"),
        };
        let exact = kvm
            .try_host_from_guest_floor(GuestTicks(n("guest_tsc")?))
            .map(|h| h.0)
            .context("KVM's mapping places no host time")?;
        events.push(Event {
            name,
            host: n("host_tsc")?,
            lo: n("host_lo")?,
            hi: n("host_hi")?,
            exact,
        });
    }
    let beacons = count_before(&stderr, "beacons (").unwrap_or(0);
    let overwritten = count_before(&stderr, "overwritten,").unwrap_or(0);
    print_table(&events, boot_secs);
    println!(
        "firmware's own count: {produced} records stored, {refused} refused; read: {} events + \
         {beacons} beacons + {overwritten} overwritten",
        events.len()
    );
    let missed: Vec<&Event> = events
        .iter()
        .filter(|e| !(e.lo..=e.hi).contains(&e.exact))
        .collect();
    if !missed.is_empty() {
        bail!(
            "{} interval(s) miss their event's exact host time (first: {})",
            missed.len(),
            missed[0].name
        );
    }
    if events.len() as u64 + beacons + overwritten != produced || events.is_empty() {
        bail!("not every record the firmware stored was recovered: {stderr}");
    }
    println!(
        "every interval holds its event's exact host time (KVM's mapping from debugfs); every record recovered"
    );
    Ok(())
}

/// `vmtsync record --from-memory` of QEMU `pid` in beacon mode into `out` (JSON Lines), until
/// SIGINT.
fn vmtsync_cmd(vmtsync: &Path, pid: u32, out: &Path) -> std::process::Command {
    let mut c = std::process::Command::new(vmtsync);
    c.args(["record", "--from-memory", "--vm", &pid.to_string()])
        .args([
            "--format",
            "jsonl",
            "--duration",
            "300",
            "--no-progress",
            "--out",
        ])
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    c
}

/// Waits until KVM debugfs lists QEMU `pid`'s paused VM (`vmtsync kvm --json`).
fn wait_vm(vmtsync: &Path, pid: u32) -> Result<()> {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let o = std::process::Command::new(vmtsync)
            .args(["kvm", "--json", "--vm", &pid.to_string()])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()?;
        let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        if v["vms"][0]["vcpus"][0].is_object() {
            return Ok(());
        }
        if Instant::now() > end {
            bail!("QEMU {pid}'s VM never appeared in KVM debugfs");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until SeaBIOS's debug log holds `what`; returns the log.
fn wait_log(log: &Path, what: &str) -> Result<String> {
    let end = Instant::now() + BOOT_LIMIT;
    loop {
        let t = std::fs::read_to_string(log).unwrap_or_default();
        if t.contains(what) {
            return Ok(t);
        }
        if Instant::now() > end {
            bail!("SeaBIOS printed no {what:?} within {BOOT_LIMIT:?}:\n{t}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .filter_map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

/// The number before `what` in vmtsync's summary.
fn count_before(stderr: &str, what: &str) -> Option<u64> {
    let head = stderr[..stderr.rfind(what)?].trim_end();
    let from = head
        .rfind(|c: char| !c.is_ascii_digit())
        .map_or(0, |k| k + 1);
    head[from..].parse().ok()
}

/// Prints each event's host time (seconds after the first event, on the host's TSC) and its
/// guaranteed interval.
fn print_table(events: &[Event], boot_secs: f64) {
    let hz = vmtsync::formats::ctf::host_tsc_hz().ok();
    let Some(first) = events.first().map(|e| e.host) else {
        return;
    };
    // Seconds after the first event; ticks when the host's TSC rate is unknown.
    let secs = |t: u64| -> String {
        let d = i128::from(t) - i128::from(first);
        match hz {
            Some(hz) => format!("{:+.6}", d as f64 / hz as f64),
            None => format!("{d:+} ticks"),
        }
    };
    let width = |e: &Event| match hz {
        Some(hz) => format!("{:.0} µs", (e.hi - e.lo) as f64 * 1e6 / hz as f64),
        None => format!("{} ticks", e.hi - e.lo),
    };
    println!(
        "SeaBIOS, traced live from guest memory: host time of each event in seconds after the \
         first (host TSC{}), exact from KVM's mapping, inside its guaranteed interval from the \
         beacons",
        hz.map_or_else(String::new, |h| format!(" at {:.3} GHz", h as f64 / 1e9))
    );
    println!(
        "{:<16} {:>11}   {:<27} {:>9}",
        "event", "host (s)", "guaranteed interval (s)", "width"
    );
    for e in events {
        let interval = format!("[{}, {}]", secs(e.lo), secs(e.hi));
        println!(
            "{:<16} {:>11}   {interval:<27} {:>9}",
            e.name,
            secs(e.host),
            width(e)
        );
    }
    println!("QEMU resumed to SeaBIOS's \"No bootable device\": {boot_secs:.2} s (wall clock)");
}
