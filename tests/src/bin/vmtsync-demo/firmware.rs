//! `vmtsync-demo --firmware` (`cargo xtask demo --firmware`): SeaBIOS traced live. It fetches
//! and builds the traced SeaBIOS (`vmtsync_launch::firmware`: Debian's source, the 19-line
//! patch, the C recorder), and has `vmtsync record --from-memory --guest-phys … --beacon-port
//! … -- qemu-system-x86_64 …` start QEMU `-M pc` paused, arm its `kvm_pio` trace and resume it
//! (beacon mode: guaranteed intervals from the firmware's sync beacons, each bracketed by the
//! host's own `kvm_pio` exits from the first). Once SeaBIOS has tried every boot device it
//! prints each POST phase and boot attempt with its host time in seconds and its guaranteed
//! interval, and how many beacons were bracketed.
//!
//! Truth: KVM's mapping of vCPU 0 from debugfs (`vmtsync_tests::truth`), read after the run
//! (SeaBIOS never writes its TSC), and the firmware's own produced count on its debug console.
//! The demo fails (exit 1) when an interval misses its event's exact host time, a beacon was not
//! bracketed, or a record the firmware stored is not accounted for.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;
use vmtsync_core::GuestTicks;
use vmtsync_launch::firmware::{
    self, BOOT_EVENT, FW_CFG_CTL_EVENTS, FW_CFG_DMA_EVENTS, MEMORY_MIB, PHASE_BEGIN, PHASE_END,
    Variant,
};
use vmtsync_launch::prereq::ensure_qemu;
use vmtsync_launch::qemu::command_firmware;
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
    let jsonl = dir.path().join("seabios.jsonl");
    let err_path = dir.path().join("record.stderr");
    // The reader starts QEMU itself (paused), arms the kvm_pio trace of the beacon port, then
    // resumes it: every beacon from the first is bracketed.
    let qemu = command_firmware(&out.join("bios.bin"), &log, MEMORY_MIB);
    let mut rec = vmtsync_cmd(vmtsync, &jsonl);
    rec.arg("--").arg(qemu.get_program()).args(qemu.get_args());
    rec.stderr(std::fs::File::create(&err_path)?);
    eprintln!("$ {}", vmtsync_launch::prereq::display(&rec));
    let mut rec = ChildGuard::new(rec.spawn().context("starting vmtsync record")?);
    let started = Instant::now();
    let text = wait_log(&log, "No bootable device")?;
    let boot_secs = started.elapsed().as_secs_f64();
    let (_, produced, refused) = *firmware::counts_in(&text)
        .last()
        .context("the traced SeaBIOS printed no counts line")?;
    // The VMM is the reader's child; KVM's mapping of its vCPU 0 is read while it runs.
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", rec.pid()))?;
    let pid: u32 = children
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .context("vmtsync record started no QEMU")?;
    let kvm = truth_mapping(pid, 0).context("KVM's mapping from debugfs")?;
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

    let mut events = Vec::new();
    let mut fw_cfg = 0u64;
    let mut phase_ends = 0u64;
    for line in std::fs::read_to_string(&jsonl)?.lines() {
        let v: Value = serde_json::from_str(line)?;
        let n = |k: &str| v[k].as_u64().with_context(|| format!("{k} in {v}"));
        let payload = hex(v["payload"].as_str().unwrap_or(""));
        let name = match u16::try_from(n("id")?)? {
            // A phase's end is the next one's begin, moments earlier: the table shows begins.
            PHASE_BEGIN => String::from_utf8_lossy(&payload).into_owned(),
            PHASE_END => {
                phase_ends += 1;
                continue;
            }
            BOOT_EVENT => format!(
                "boot attempt {}",
                u32::from_le_bytes(payload.try_into().unwrap_or_default())
            ),
            id if [FW_CFG_CTL_EVENTS, FW_CFG_DMA_EVENTS]
                .iter()
                .any(|&(b, a)| id == b || id == a) =>
            {
                // Checked against the host's exits by `vmtsync validate` (tier 2); counted here.
                fw_cfg += 1;
                continue;
            }
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
    let bracketed = count_before(&stderr, "bracketed by kvm_pio exits").unwrap_or(0);
    let overwritten = count_before(&stderr, "overwritten,").unwrap_or(0);
    let read = events.len() as u64 + fw_cfg + phase_ends;
    print_table(&events, boot_secs);
    println!(
        "firmware's own count: {produced} records stored, {refused} refused; read: {read} events \
         ({} phase begins and boot attempts, {phase_ends} phase ends, {fw_cfg} around fw_cfg port \
         writes) + {beacons} beacons + \
         {overwritten} overwritten",
        events.len()
    );
    println!(
        "beacons: {bracketed} of {beacons} bracketed by the host's kvm_pio exits{}",
        if bracketed == beacons && beacons > 0 {
            " (every one, from the first)"
        } else {
            ""
        }
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
    if bracketed != beacons || beacons == 0 {
        bail!("not every beacon was bracketed by a kvm_pio exit: {stderr}");
    }
    if read + beacons + overwritten != produced || events.is_empty() {
        bail!("not every record the firmware stored was recovered: {stderr}");
    }
    println!(
        "every interval holds its event's exact host time (KVM's mapping from debugfs); every record recovered"
    );
    Ok(())
}

/// `vmtsync record --from-memory` at the traced build's guest-physical address and beacon
/// port into `out` (JSON Lines), until SIGINT; the caller adds `-- QEMU…`.
fn vmtsync_cmd(vmtsync: &Path, out: &Path) -> std::process::Command {
    let mut c = std::process::Command::new(vmtsync);
    c.args(["record", "--from-memory"])
        .args(["--guest-phys", &format!("{:#x}", firmware::RING_GPA)])
        .args(["--beacon-port", &format!("{:#x}", firmware::BEACON_PORT)])
        .args(["--format", "jsonl", "--duration", "300", "--no-progress"])
        .arg("--out")
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    c
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

/// Prints each event's host time (the host's TSC in seconds, and seconds after the first
/// event) and its guaranteed interval.
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
    // The host's clock in seconds, as trace-cmd's report of the host's trace shows it.
    let abs = |t: u64| -> String {
        match hz {
            Some(hz) => format!("{:.6}", t as f64 / hz as f64),
            None => format!("{t} ticks"),
        }
    };
    let width = |e: &Event| match hz {
        Some(hz) => format!("{:.0} µs", (e.hi - e.lo) as f64 * 1e6 / hz as f64),
        None => format!("{} ticks", e.hi - e.lo),
    };
    println!(
        "SeaBIOS, traced live from guest memory: host time of each event (the host's TSC{} in \
         seconds, as trace-cmd reports host traces, and seconds after the first event), exact \
         from KVM's mapping, inside its guaranteed interval from the beacons",
        hz.map_or_else(String::new, |h| format!(" at {:.3} GHz", h as f64 / 1e9))
    );
    println!(
        "{:<16} {:>15} {:>11}   {:<27} {:>9}",
        "event", "host clock (s)", "after first", "guaranteed interval (s)", "width"
    );
    for e in events {
        let interval = format!("[{}, {}]", secs(e.lo), secs(e.hi));
        println!(
            "{:<16} {:>15} {:>11}   {interval:<27} {:>9}",
            e.name,
            abs(e.host),
            secs(e.host),
            width(e)
        );
    }
    println!(
        "vmtsync record started to SeaBIOS's \"No bootable device\": {boot_secs:.2} s (wall clock)"
    );
}
