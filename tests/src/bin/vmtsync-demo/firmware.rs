//! `vmtsync-demo --firmware` (`cargo xtask demo --firmware`): SeaBIOS traced live. It fetches
//! and builds the function-tracing SeaBIOS (`vmtsync_launch::firmware`: Debian's source, the
//! phase patch, `-finstrument-functions` on its 32-bit flat code, the C recorder), and has
//! `vmtsync record --from-memory --guest-phys … --beacon-port … -- qemu-system-x86_64 …` start
//! QEMU `-M pc` paused, arm its `kvm_pio` trace and resume it (beacon mode: guaranteed
//! intervals from the firmware's sync beacons, each bracketed by the host's own `kvm_pio`
//! exits from the first). Once SeaBIOS has tried every boot device it prints each POST phase
//! and boot attempt with its host time in seconds and its guaranteed interval, and how many
//! beacons were bracketed. Then where the boot time went: `vmtsync spans` with the image's
//! symbols (the longest spans, each duration with its guaranteed interval; what was open at
//! the end; a picture with the host's own exits as ticks) and `vmtsync export perfetto`, left
//! in `target/demo-firmware/` with the recording and the host's trace.
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
use vmtsync_core::recorder::{FUNC_ENTRY_ID, FUNC_EXIT_ID, RELOC_ID};
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
    let out = firmware::build(Variant::Functions)?;
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
    // What a newcomer opens afterwards stays in target/demo-firmware/.
    let keep = keep_dir()?;
    let jsonl = keep.join("seabios.jsonl");
    let err_path = dir.path().join("record.stderr");
    // The reader starts QEMU itself (paused), arms the kvm_pio trace of the beacon port, then
    // resumes it: every beacon from the first is bracketed.
    let qemu = command_firmware(&out.join("bios.bin"), &log, MEMORY_MIB);
    // The host's own port-I/O exits, for the picture's ticks: a private tracefs instance on
    // the host's TSC clock, armed before the VMM starts.
    let host_trace = host_trace()?;
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
    rec.signal(libc::SIGINT)
        .context("could not stop vmtsync record")?;
    let status = rec
        .wait_timeout(Duration::from_secs(60))?
        .context("vmtsync record did not end within 60 s of SIGINT")?;
    let stderr = std::fs::read_to_string(&err_path)?;
    if !status.success() {
        bail!("vmtsync record failed ({status}): {stderr}");
    }
    let host_dat = keep.join("host.dat");
    extract(host_trace, &host_dat)?;

    let mut events = Vec::new();
    let mut fw_cfg = 0u64;
    let mut phase_ends = 0u64;
    let mut functions = 0u64;
    let mut function_misses = 0u64;
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
            // Function entries and exits, and the relocation of SeaBIOS's init code: checked
            // against KVM's mapping here, summed up by `vmtsync spans` below.
            FUNC_ENTRY_ID | FUNC_EXIT_ID | RELOC_ID => {
                functions += 1;
                let exact = kvm
                    .try_host_from_guest_floor(GuestTicks(n("guest_tsc")?))
                    .map(|h| h.0)
                    .context("KVM's mapping places no host time")?;
                function_misses += u64::from(!(n("host_lo")?..=n("host_hi")?).contains(&exact));
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
    let read = events.len() as u64 + fw_cfg + phase_ends + functions;
    print_table(&events, boot_secs);
    println!(
        "firmware's own count: {produced} records stored, {refused} refused; read: {read} events \
         ({} phase begins and boot attempts, {phase_ends} phase ends, {functions} function \
         entries, exits and relocations, {fw_cfg} around fw_cfg port writes) + {beacons} beacons + \
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
    if function_misses > 0 {
        bail!("{function_misses} function records' intervals miss their exact host time");
    }
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
    spans(vmtsync, &jsonl, &out.join("rom.o"), &host_dat, &keep)
}

/// Where the demo leaves what a newcomer opens afterwards: `target/demo-firmware/`.
fn keep_dir() -> Result<std::path::PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/demo-firmware");
    std::fs::create_dir_all(&dir)?;
    Ok(dir.canonicalize()?)
}

/// A private tracefs instance tracing every `kvm_pio` exit on the host's TSC clock.
fn host_trace() -> Result<vmtsync::ftrace::Instance> {
    let tracefs = vmtsync::ftrace::find_tracefs(None, "kvm/kvm_pio")?;
    let mut inst = vmtsync::ftrace::Instance::create(&tracefs, "demo-firmware")?;
    if !inst.tsc_clock() {
        bail!(
            "this kernel's tracefs has no x86-tsc clock: the host's exits cannot be drawn on its TSC"
        );
    }
    std::fs::write(inst.path().join("buffer_size_kb"), "8192")?;
    inst.enable("kvm/kvm_pio")?;
    Ok(inst)
}

/// Stops the instance and writes its buffer to `out` with `trace-cmd extract`; the instance
/// is removed when dropped.
fn extract(inst: vmtsync::ftrace::Instance, out: &Path) -> Result<()> {
    std::fs::write(inst.path().join("tracing_on"), "0")?;
    let name = inst
        .path()
        .file_name()
        .context("the instance's name")?
        .to_string_lossy()
        .into_owned();
    let o = std::process::Command::new("trace-cmd")
        .args(["extract", "-B", &name, "-o"])
        .arg(out)
        .current_dir(out.parent().context("the output's directory")?)
        .stdin(Stdio::null())
        .output()
        .context("trace-cmd extract (cargo xtask setup installs trace-cmd)")?;
    if !o.status.success() {
        bail!("trace-cmd extract: {}", String::from_utf8_lossy(&o.stderr));
    }
    Ok(())
}

/// Where the boot time went: `vmtsync spans` names the functions from SeaBIOS's image and
/// prints the longest spans with their guaranteed intervals and draws the picture, with the
/// host's exits of fw_cfg's ports and PCI configuration as ticks; `vmtsync export perfetto`
/// writes the trace for ui.perfetto.dev.
fn spans(vmtsync: &Path, jsonl: &Path, rom: &Path, host: &Path, keep: &Path) -> Result<()> {
    let svg = keep.join("seabios-boot.svg");
    let trace = keep.join("seabios.perfetto-trace");
    let mut c = std::process::Command::new(vmtsync);
    c.args(["spans", "--from"])
        .arg(jsonl)
        .arg("--symbols")
        .arg(rom)
        .args(["--top", "10", "--last", "0", "--svg"])
        .arg(&svg)
        .arg("--host-trace")
        .arg(host)
        .args([
            "--port", "0x510", "--port", "0x518", "--port", "0xcf8", "--port", "0xcfc",
        ]);
    println!("\n$ {}", vmtsync_launch::prereq::display(&c));
    let o = c.output()?;
    if !o.status.success() {
        bail!("vmtsync spans: {}", String::from_utf8_lossy(&o.stderr));
    }
    print!("{}", String::from_utf8_lossy(&o.stdout));
    let mut c = std::process::Command::new(vmtsync);
    c.args(["export", "perfetto", "--from"])
        .arg(jsonl)
        .arg("--out")
        .arg(&trace)
        .arg("--symbols")
        .arg(rom);
    println!("\n$ {}", vmtsync_launch::prereq::display(&c));
    let o = c.output()?;
    if !o.status.success() {
        bail!(
            "vmtsync export perfetto: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    println!(
        "\nthe recording: {}\nthe picture: {} (spans over host time, the host's exits as \
         ticks)\nthe trace: {} (open it in ui.perfetto.dev: a track per vCPU with nested phase \
         and function slices)",
        jsonl.display(),
        svg.display(),
        trace.display()
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
