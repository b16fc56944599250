//! The memory reader on a live guest (issue 16): `vmtsync record --from-memory` against the C
//! guest (`tests/c-guest/`, the C ABI's `MemRecorder`) under QEMU microvm on KVM.
//!
//! 1. The ceiling: the guest prefills one large stop-when-full ring and halts (`hold`); the
//!    reader drains it into trace.dat, several times on the same guest (it only reads).
//! 2. 1 M events/s produced (TSC-paced by the guest) into a 64 Ki-record ring while the reader
//!    drains, for several seconds: what the guest achieved (first and last event's stamps in
//!    the trace, read back by `trace-cmd report`) and what the reader counted as lost.
//! 3. The reader process's own CPU time (`wait4`'s rusage) per million events, both runs.
//! 4. The scan for the header in a 4 GiB guest (`examples/mem_scan`, timing
//!    `vmtsync::guestmem::find` without an address).
//!
//! Every trace.dat written here is read by trace-cmd, which must report every event in
//! sequence; every guest must report no failed call on COM1.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use vmtsync_launch::ChildGuard;
use vmtsync_launch::agent::{Guest, guest_elf};
use vmtsync_launch::qemu::{self, Machine};

use super::format::{rate, sig3, thousands, verdict};
use super::{Plan, Section, Stat, machine, rel};

/// Issue 16's goal for the reader's ceiling into trace.dat.
const CEILING_GOAL: f64 = 20e6;
/// The production rate of run 2, events per second, and its ring.
const PRODUCED_RATE: u64 = 1_000_000;
const RATE_RING: u64 = 65_536;
/// The C guest records a beacon every this many events and one at each end (main.c), in the
/// same ring.
const BEACON_EVERY: u64 = 1000;
/// The scanned guest's RAM.
const SCAN_MIB: u32 = 4096;
/// The C guest's event id (main.c's `EVENT_ID`).
const EVENT_ID: u64 = 0x0C01;

/// How large this run is.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    /// Records in the prefilled ring, and how many times the reader drains it.
    ceiling_ring: u64,
    ceiling_runs: usize,
    /// Events produced at [`PRODUCED_RATE`].
    rate_events: u64,
    /// Timed scans.
    scan_runs: usize,
}

impl Sizes {
    fn new(plan: &Plan) -> Self {
        if plan.quick {
            Self {
                ceiling_ring: 1 << 18,
                ceiling_runs: 1,
                rate_events: 500_000,
                scan_runs: 1,
            }
        } else {
            Self {
                ceiling_ring: 1 << 22,
                ceiling_runs: 3,
                rate_events: 5_000_000,
                scan_runs: 5,
            }
        }
    }
}

/// The most events a stop-when-full ring of `ring` records holds with the C guest's beacons
/// (one every [`BEACON_EVERY`] events and one at each end).
fn events_filling(ring: u64) -> u64 {
    let mut n = ring - 2;
    while n + n / BEACON_EVERY + 2 > ring {
        n -= 1;
    }
    n
}

/// The C guest under QEMU, killed by PID when dropped.
struct CGuest {
    guard: ChildGuard,
    com1: PathBuf,
}

/// The C guest's summary line on COM1 (tests/c-guest/main.c).
#[derive(Debug, Clone, PartialEq, Eq)]
struct GuestLine {
    text: String,
    events: u64,
    refused: u64,
    beacons: u64,
    failed: u64,
    nonce: u64,
    tsc0: u64,
    tsc1: u64,
}

impl GuestLine {
    fn parse(line: &str) -> Option<Self> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let field = |key: &str| {
            let v = words
                .iter()
                .position(|w| *w == key)
                .and_then(|i| words.get(i + 1))?;
            match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok(),
                None => v.parse().ok(),
            }
        };
        Some(Self {
            text: line.to_owned(),
            events: field("events")?,
            refused: field("refused")?,
            beacons: field("beacons")?,
            failed: field("failed")?,
            nonce: field("nonce")?,
            tsc0: field("tsc0")?,
            tsc1: field("tsc1")?,
        })
    }
}

impl CGuest {
    fn boot(elf: &Path, dir: &Path, name: &str, append: &str, mib: u32) -> Result<Self> {
        let com1 = dir.join(format!("{name}.com1"));
        let stdout = File::create(&com1).with_context(|| format!("creating {}", com1.display()))?;
        let mut cmd = qemu::command_with_memory(
            Machine::Microvm,
            elf,
            append,
            &dir.join(format!("{name}.com2")),
            mib,
        );
        cmd.stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::null());
        eprintln!("$ {}", crate::display(&cmd));
        let child = cmd.spawn().context("starting QEMU")?;
        Ok(Self {
            guard: ChildGuard::new(child),
            com1,
        })
    }

    fn pid(&self) -> u32 {
        self.guard.pid()
    }

    /// Waits for KVM's debugfs directory of this VM's vCPU 0 (`<pid>-<fd>/vcpu0`), which the
    /// reader needs to start: QEMU creates it shortly after it starts.
    fn wait_vcpu(&mut self, limit: Duration) -> Result<()> {
        let end = Instant::now() + limit;
        let prefix = format!("{}-", self.pid());
        loop {
            let found = std::fs::read_dir("/sys/kernel/debug/kvm")
                .into_iter()
                .flatten()
                .flatten()
                .any(|e| {
                    e.file_name().to_string_lossy().starts_with(&prefix)
                        && e.path().join("vcpu0").is_dir()
                });
            if found {
                return Ok(());
            }
            if let Some(status) = self.guard.child().try_wait()? {
                bail!("QEMU exited ({status}) before its vCPU appeared in KVM debugfs");
            }
            ensure!(
                Instant::now() < end,
                "vCPU 0 of QEMU {} never appeared in KVM debugfs",
                self.pid()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Lowers every QEMU thread's priority to nice 19: a held guest's vCPU spins (ring 3
    /// cannot halt, tests/c-guest/entry.S), and it should not take CPU from the reader.
    fn renice(&self) -> Result<()> {
        let tasks = format!("/proc/{}/task", self.pid());
        for e in std::fs::read_dir(&tasks).with_context(|| format!("reading {tasks}"))? {
            let Ok(tid) = e?.file_name().to_string_lossy().parse::<libc::id_t>() else {
                continue;
            };
            // SAFETY: setpriority takes plain integers and touches no memory of ours.
            let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, 19) };
            ensure!(
                r == 0,
                "setpriority({tid}): {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    }

    /// Waits for the guest's summary line (it prints it when its events are recorded).
    fn line(&mut self, limit: Duration) -> Result<GuestLine> {
        let end = Instant::now() + limit;
        loop {
            let text = std::fs::read_to_string(&self.com1).unwrap_or_default();
            if let Some(l) = text
                .lines()
                .find(|l| l.starts_with("c-guest: ") && l.len() > 9)
            {
                // The line is complete once its newline is there.
                if text.contains(&format!("{l}\n")) {
                    let g = GuestLine::parse(l)
                        .with_context(|| format!("unreadable C guest line: {l}"))?;
                    ensure!(g.failed == 0, "the C guest reports failed calls: {l}");
                    return Ok(g);
                }
            }
            if let Some(status) = self.guard.child().try_wait()? {
                bail!("QEMU exited ({status}) before the guest's line; COM1: {text:?}");
            }
            ensure!(
                Instant::now() < end,
                "no C guest line within {limit:?}; COM1: {text:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// One `vmtsync record --from-memory` run: its wall time, its CPU time and its summary.
#[derive(Debug, Clone)]
struct ReaderRun {
    wall: Duration,
    cpu: Duration,
    drain_s: f64,
    m_records_per_s: f64,
    recorded: u64,
    overwritten: u64,
    refused: u64,
    corrupt: u64,
}

/// The number right before `word` in `text` (`…, 3 overwritten, …`).
fn before(text: &str, word: &str) -> Option<f64> {
    let at = text.find(word)?;
    text[..at]
        .split_whitespace()
        .next_back()?
        .trim_end_matches(',')
        .parse()
        .ok()
}

/// The number right after `word` in `text`.
fn after(text: &str, word: &str) -> Option<f64> {
    let at = text.find(word)? + word.len();
    text[at..].split_whitespace().next()?.parse().ok()
}

#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // Counts printed whole.
fn count(v: f64) -> u64 {
    v as u64
}

impl ReaderRun {
    fn parse(wall: Duration, cpu: Duration, stderr: String) -> Result<Self> {
        let field = |f: Option<f64>, what: &str| {
            f.with_context(|| format!("no {what} in the reader's summary: {stderr}"))
        };
        Ok(Self {
            drain_s: field(after(&stderr, "records read over "), "drain time")?,
            m_records_per_s: field(before(&stderr, "M records/s"), "rate")?,
            recorded: count(field(after(&stderr, "vmtsync: recorded "), "event count")?),
            overwritten: count(field(
                before(&stderr, " overwritten, "),
                "overwritten count",
            )?),
            refused: count(field(before(&stderr, " refused, "), "refused count")?),
            corrupt: count(field(before(&stderr, " corrupt, "), "corrupt count")?),
            wall,
            cpu,
        })
    }

    /// Reader CPU seconds per million events.
    #[allow(clippy::cast_precision_loss)] // Counts far below 2^52.
    fn cpu_per_million(&self) -> f64 {
        self.cpu.as_secs_f64() / (self.recorded as f64 / 1e6)
    }
}

/// Waits for `child` with `wait4`, returning its exit code (`None`: killed by a signal) and
/// its user + system CPU time.
fn wait_rusage(child: &Child) -> Result<(Option<i32>, Duration)> {
    let pid = libc::pid_t::try_from(child.id()).context("a PID out of range")?;
    let mut status = 0;
    // SAFETY: `rusage` is plain data for which all-zero bytes are a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our own unreaped child; both pointers are to live, writable locals.
    let r = unsafe { libc::wait4(pid, &raw mut status, 0, &raw mut usage) };
    ensure!(
        r == pid,
        "wait4({pid}): {}",
        std::io::Error::last_os_error()
    );
    let tv = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    Ok((code, tv(usage.ru_utime) + tv(usage.ru_stime)))
}

/// Runs `vmtsync record --from-memory --trust-raw-tsc` against `pid` into `out` (trace.dat).
fn record(
    vmtsync: &Path,
    pid: u32,
    events: u64,
    seconds: u64,
    out: &Path,
    log: &Path,
) -> Result<ReaderRun> {
    let mut cmd = Command::new(vmtsync);
    cmd.args(["record", "--from-memory", "--trust-raw-tsc", "--vm"])
        .arg(pid.to_string())
        .args(["--format", "trace-cmd", "--events"])
        .arg(events.to_string())
        .arg("--duration")
        .arg(seconds.to_string())
        .args(["--no-progress", "--out"])
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(log).with_context(|| format!("creating {}", log.display()))?);
    eprintln!("$ {}", crate::display(&cmd));
    let start = Instant::now();
    let child = cmd.spawn().context("starting vmtsync")?;
    let (code, cpu) = wait_rusage(&child)?;
    let wall = start.elapsed();
    let stderr = std::fs::read_to_string(log).unwrap_or_default();
    ensure!(
        code == Some(0),
        "vmtsync record exited with {code:?}: {stderr}"
    );
    eprintln!("{}", stderr.trim_end());
    ReaderRun::parse(wall, cpu, stderr)
}

/// What `trace-cmd report` shows of a trace.dat the C guest's events went into: the count of
/// its events (their sequence numbers checked to increase), the first and last sequence
/// numbers, and the first and last timestamps (raw TSC ticks: the file's clock is `x86-tsc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Report {
    events: u64,
    first_seq: u64,
    last_seq: u64,
    first: u64,
    last: u64,
}

impl Report {
    /// Whether the events are exactly sequence numbers `0..n`.
    fn is_complete(&self, n: u64) -> bool {
        self.events == n && n > 0 && self.first_seq == 0 && self.last_seq == n - 1
    }
}

fn report(dat: &Path) -> Result<Report> {
    let mut cmd = Command::new("trace-cmd");
    // Ticks, as before: a 1 GHz `--ts2secs` undoes the file's TSC2NSEC option, and `-t`
    // prints all nine decimals (without it trace-cmd cuts them to six: microticks).
    cmd.args(["report", "-t", "--ts2secs", "1000000000", "-i"])
        .arg(dat)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    eprintln!("$ {}", crate::display(&cmd));
    let mut child = ChildGuard::new(cmd.spawn().context("starting trace-cmd")?);
    let stdout = child.child().stdout.take().context("trace-cmd's stdout")?;
    let mut r = Report {
        events: 0,
        first_seq: 0,
        last_seq: 0,
        first: 0,
        last: 0,
    };
    let id = format!("id={EVENT_ID}");
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading trace-cmd report")?;
        // `<idle>-0 [000] 1234.5678: event_data: id=3073 len=8 payload=00 01 …`.
        let Some((_, payload)) = line.split_once("payload=") else {
            continue;
        };
        if !line.contains(&id) {
            continue;
        }
        let ts: String = line
            .split_once(']')
            .map_or("", |(_, rest)| rest)
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .filter(char::is_ascii_digit)
            .collect();
        let ts: u64 = ts
            .parse()
            .with_context(|| format!("no timestamp in `{line}`"))?;
        let bytes: Vec<u8> = payload
            .split_whitespace()
            .take(8)
            .map(|b| u8::from_str_radix(b, 16))
            .collect::<Result<_, _>>()
            .with_context(|| format!("payload in `{line}`"))?;
        let seq = u64::from_le_bytes(
            bytes
                .try_into()
                .map_err(|_| anyhow::anyhow!("short payload in `{line}`"))?,
        );
        ensure!(
            r.events == 0 || seq > r.last_seq,
            "trace-cmd shows sequence number {seq} after {}: `{line}`",
            r.last_seq
        );
        if r.events == 0 {
            r.first = ts;
            r.first_seq = seq;
        }
        r.last = ts;
        r.last_seq = seq;
        r.events += 1;
    }
    let status = child
        .wait_timeout(Duration::from_secs(600))?
        .context("trace-cmd report did not end")?;
    ensure!(
        status.success(),
        "trace-cmd report {}: {status}",
        dat.display()
    );
    Ok(r)
}

/// The scan example's line.
#[derive(Debug, Clone, PartialEq)]
struct ScanLine {
    nonce: u64,
    find_ms: Vec<f64>,
    bytes_mapped: u64,
    bytes_read: u64,
    pages_skipped: u64,
    pagemap: bool,
}

impl ScanLine {
    fn parse(stdout: &str) -> Option<Self> {
        let line = stdout.lines().find(|l| l.starts_with("mem-scan: "))?;
        let field = |key: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        };
        let int = |key: &str| field(key)?.parse::<u64>().ok();
        Some(Self {
            nonce: u64::from_str_radix(field("nonce")?.strip_prefix("0x")?, 16).ok()?,
            find_ms: field("find_ms")?
                .split(',')
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?,
            bytes_mapped: int("bytes_mapped")?,
            bytes_read: int("bytes_read")?,
            pages_skipped: int("pages_skipped")?,
            pagemap: field("pagemap")? == "true",
        })
    }
}

/// Everything the section shows.
#[derive(Debug, Clone)]
struct Measured {
    tsc_khz: u64,
    ceiling_ring: u64,
    ceiling_guest: GuestLine,
    ceiling: Vec<ReaderRun>,
    ceiling_report: Report,
    rate_guest: GuestLine,
    rate_run: ReaderRun,
    rate_report: Report,
    scan_guest: GuestLine,
    scan: ScanLine,
    scan_command: String,
}

pub(super) fn memory(plan: &Plan, work: &Path) -> Result<Section> {
    let sizes = Sizes::new(plan);
    let dir = work.join("memory");
    std::fs::create_dir_all(&dir)?;
    let tsc_khz = machine::Machine::now()
        .tsc_khz
        .map(|(k, _)| k)
        .context("the host's TSC rate is unknown (the C guest paces its events by it)")?;
    let elf = guest_elf(Guest::CGuest).context("building the C guest")?;
    let vmtsync = plan.bin_dir.join("vmtsync");
    let scanner = plan.bin_dir.join("examples/mem_scan");

    // 1. The ceiling: a prefilled ring, drained several times.
    let ring = sizes.ceiling_ring;
    let n = events_filling(ring);
    // The ring's bytes (32 per record) and 64 MiB for the rest.
    let mib = u32::try_from(ring * 32 / (1 << 20) + 64).context("ring too large")?;
    let mut guest = CGuest::boot(
        &elf,
        &dir,
        "ceiling",
        &format!("ring={ring} events={n} tsc_khz={tsc_khz} hold"),
        mib.max(qemu::DEFAULT_MEMORY_MIB),
    )?;
    let ceiling_guest = guest.line(Duration::from_secs(120))?;
    guest.renice()?;
    ensure!(
        ceiling_guest.events == n && ceiling_guest.refused == 0,
        "the prefill did not record every event: {}",
        ceiling_guest.text
    );
    let dat = dir.join("ceiling.dat");
    let mut ceiling = Vec::new();
    for k in 0..sizes.ceiling_runs {
        let run = record(
            &vmtsync,
            guest.pid(),
            n,
            120,
            &dat,
            &dir.join(format!("ceiling-{k}.log")),
        )?;
        ensure!(
            run.recorded == n,
            "run {k} recorded {} of {n}",
            run.recorded
        );
        ceiling.push(run);
    }
    let ceiling_report = report(&dat)?;
    ensure!(
        ceiling_report.is_complete(n),
        "trace-cmd report does not show events 0..{n} in sequence: {ceiling_report:?}"
    );
    drop(guest);
    let _ = std::fs::remove_file(&dat);

    // 2. 1 M events/s into a 64 Ki ring while the reader drains.
    let n2 = sizes.rate_events;
    let mut guest = CGuest::boot(
        &elf,
        &dir,
        "rate",
        &format!("ring={RATE_RING} events={n2} rate={PRODUCED_RATE} tsc_khz={tsc_khz} flight hold"),
        qemu::DEFAULT_MEMORY_MIB,
    )?;
    let dat2 = dir.join("rate.dat");
    // The reader starts while the guest boots (once KVM lists its vCPU); it waits for the
    // header.
    guest.wait_vcpu(Duration::from_secs(30))?;
    let rate_run = record(
        &vmtsync,
        guest.pid(),
        n2,
        n2 / PRODUCED_RATE + 10,
        &dat2,
        &dir.join("rate.log"),
    );
    let rate_guest = guest.line(Duration::from_secs(60));
    drop(guest);
    let rate_run = rate_run?;
    let rate_guest = rate_guest?;
    let rate_report = report(&dat2)?;
    ensure!(
        rate_report.events == rate_run.recorded,
        "trace-cmd report shows {} events, the reader recorded {}",
        rate_report.events,
        rate_run.recorded
    );
    // Offset-free check of the stamps against the guest's own TSC reads around its loop.
    ensure!(
        rate_report.last - rate_report.first <= rate_guest.tsc1 - rate_guest.tsc0,
        "the trace's events span more ticks than the guest's loop"
    );
    let _ = std::fs::remove_file(&dat2);

    // 4. The scan of a 4 GiB guest.
    let mut guest = CGuest::boot(&elf, &dir, "scan", "events=10000 hold", SCAN_MIB)?;
    let scan_guest = guest.line(Duration::from_secs(60))?;
    let mut cmd = Command::new(&scanner);
    cmd.arg(guest.pid().to_string())
        .arg(sizes.scan_runs.to_string());
    let scan_command = format!("{} QEMU_PID {}", rel(&scanner), sizes.scan_runs);
    eprintln!("$ {}", crate::display(&cmd));
    let o = cmd.output().context("starting mem_scan")?;
    drop(guest);
    let stdout = String::from_utf8_lossy(&o.stdout);
    ensure!(
        o.status.success(),
        "mem_scan: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let scan = ScanLine::parse(&stdout).with_context(|| format!("mem_scan printed {stdout}"))?;
    ensure!(
        scan.nonce == scan_guest.nonce,
        "the scan found a header with nonce {:#x}, the guest published {:#x}",
        scan.nonce,
        scan_guest.nonce
    );

    let m = Measured {
        tsc_khz,
        ceiling_ring: ring,
        ceiling_guest,
        ceiling,
        ceiling_report,
        rate_guest,
        rate_run,
        rate_report,
        scan_guest,
        scan,
        scan_command,
    };
    let mut section = memory_section(&m)?;
    section.command = format!(
        "vmtsync record --from-memory --trust-raw-tsc --vm QEMU_PID --format trace-cmd --events N \
         --no-progress --out OUT.dat; {}",
        m.scan_command
    );
    Ok(section)
}

#[allow(clippy::cast_precision_loss)] // Counts and ticks far below 2^52.
fn memory_section(m: &Measured) -> Result<Section> {
    let stat = |f: &dyn Fn(&ReaderRun) -> f64| {
        Stat::of(&m.ceiling.iter().map(f).collect::<Vec<_>>()).context("no ceiling run")
    };
    let drain = stat(&|r| r.m_records_per_s * 1e6)?;
    let whole = stat(&|r| r.recorded as f64 / r.wall.as_secs_f64())?;
    let wall = stat(&|r| r.wall.as_secs_f64())?;
    let drain_s = stat(&|r| r.drain_s)?;
    let cpu1 = stat(&ReaderRun::cpu_per_million)?;
    let n = m.ceiling_guest.events;
    let mut body = format!(
        "The C guest (`tests/c-guest/`, recording through the C ABI's `MemRecorder` in ring 3) \
         under QEMU microvm on KVM; the reader is `vmtsync record --from-memory --trust-raw-tsc \
         --format trace-cmd` (width-0 placement from KVM's debugfs mapping; the beacon mode \
         would add kvm_pio tracing and is not measured here). Every trace.dat below was read \
         back by `trace-cmd report`, which showed the events in sequence ({} events, \
         numbers 0 to N − 1, of the ceiling's last run). Host TSC {} kHz. The guest's options \
         are on its kernel command line: `ring=R events=N tsc_khz=K hold` for the ceiling, \
         `ring=65536 events=N rate=1000000 tsc_khz=K flight hold` for the 1 M/s run.\n\n\
         **Ceiling.** The guest prefilled one stop-when-full ring of {} records with {} events \
         (and {} beacons) and held (spinning); the reader then drained it into trace.dat {} time(s), \
         the guest's memory unchanged in between. *Drain* is the reader's own figure: records \
         (events and beacons) over the time from the start of the first drain round that \
         delivered records to the end of the last one, their records written. *Whole run* is \
         events over the reader process's wall time from its start to its exit (finding the \
         header by scanning, draining, writing and closing the file; the guest had recorded \
         before). The held guest's vCPU spins (ring 3 cannot halt), so QEMU's threads run at \
         nice 19 during these drains.\n\n\
         | figure | min / median / max |\n|---|---:|\n\
         | drain rate | {} |\n| drain time | {} s |\n| whole run (start to written file) | {} s |\n\
         | whole-run rate | {} |\n| reader CPU (user + system) per million events | {} s |\n",
        thousands(m.ceiling_report.events),
        thousands(m.tsc_khz),
        thousands(m.ceiling_ring),
        thousands(n),
        thousands(m.ceiling_guest.beacons),
        m.ceiling.len(),
        drain.show(rate),
        drain_s.show(sig3),
        wall.show(sig3),
        whole.show(rate),
        cpu1.show(|v| format!("{v:.3}")),
    );
    let vsock = 0.3e6;
    let _ = writeln!(
        body,
        "\nThe median drain rate is {} the ~0.3 M events/s vsock ingests (section 8). Goal ≥ \
         20 M events/s: {}.",
        super::format::ratio(drain.median / vsock),
        verdict(drain.median >= CEILING_GOAL)
    );

    let r = &m.rate_run;
    let rep = &m.rate_report;
    let span = rep.last.saturating_sub(rep.first);
    let hz = m.tsc_khz as f64 * 1e3;
    // Events the guest recorded between the first and the last one in the trace (by their
    // sequence numbers, so events lost in between count as produced), over their stamps.
    let achieved = if span > 0 {
        (rep.last_seq - rep.first_seq) as f64 * hz / span as f64
    } else {
        0.0
    };
    let lost = r.overwritten + r.refused + r.corrupt;
    let cpu2 = r.cpu_per_million();
    let _ = writeln!(
        body,
        "\n**1 M events/s.** The guest recorded {} events paced by its TSC at {} (`rate={} \
         tsc_khz={} flight`) into a flight-recorder ring of {} records (a reader that only \
         reads cannot free a stop-when-full ring's slots: it would refuse everything after its \
         first {} records) while the reader drained it; the reader started before the guest \
         published its header (the guest's vCPU busy-waits on the TSC between events, so it \
         keeps one host core busy throughout). Achieved: {} (sequence numbers {}..{} between the first and \
         the last event's stamps in the trace, {} ticks apart). The reader: {} overwritten, \
         {} refused (the guest counted {} refused), {} corrupt; {} events written (trace-cmd \
         shows {}); drain {} s at {} M records/s. Reader CPU (user + system): {} s in all, {:.3} s per million events (the \
         whole-run wall time {} s).\n\nGoal: 0 lost at 1 M events/s with a 64 Ki ring: {}.",
        thousands(m.rate_guest.events),
        rate(PRODUCED_RATE as f64),
        PRODUCED_RATE,
        thousands(m.tsc_khz),
        thousands(RATE_RING),
        thousands(RATE_RING),
        rate(achieved),
        thousands(rep.first_seq),
        thousands(rep.last_seq),
        thousands(span),
        r.overwritten,
        r.refused,
        m.rate_guest.refused,
        r.corrupt,
        thousands(r.recorded),
        thousands(rep.events),
        sig3(r.drain_s),
        sig3(r.m_records_per_s),
        sig3(r.cpu.as_secs_f64()),
        cpu2,
        sig3(r.wall.as_secs_f64()),
        verdict(lost == 0 && m.rate_guest.refused == 0 && achieved >= 0.99 * PRODUCED_RATE as f64),
    );

    let s = &m.scan;
    let find = Stat::of(&s.find_ms).context("no scan")?;
    let _ = writeln!(
        body,
        "\n**Scan.** QEMU with `-m {SCAN_MIB}` and the C guest (`events=10000 hold`, its \
         built-in ring); `{}` opens the VMM's memory and times `vmtsync::guestmem::find` \
         without an address, {} time(s): {} ms. One scan of the same mappings: {} MiB \
         writable mapped, {} KiB read, {} pages skipped as never written (page map {}). The \
         header found carries the nonce the guest printed ({:#x}).",
        m.scan_command,
        s.find_ms.len(),
        find.show(|v| format!("{v:.1}")),
        thousands(s.bytes_mapped >> 20),
        thousands(s.bytes_read >> 10),
        thousands(s.pages_skipped),
        if s.pagemap {
            "read"
        } else {
            "unreadable: every page read"
        },
        m.scan_guest.nonce,
    );

    let summary = vec![
        [
            "memory reader ceiling into trace.dat (prefilled ring, live guest)".into(),
            "≥ 20 M events/s".into(),
            format!(
                "{} drain (median); whole run {}",
                rate(drain.median),
                rate(whole.median)
            ),
            verdict(drain.median >= CEILING_GOAL),
        ],
        [
            "memory reader at 1 M events/s, 64 Ki ring".into(),
            "0 lost".into(),
            format!(
                "{} achieved; {} overwritten, {} refused",
                rate(achieved),
                r.overwritten,
                r.refused + m.rate_guest.refused
            ),
            verdict(
                lost == 0 && m.rate_guest.refused == 0 && achieved >= 0.99 * PRODUCED_RATE as f64,
            ),
        ],
        [
            "memory reader host CPU per million events".into(),
            "reported".into(),
            format!(
                "{:.3} s (ceiling, median); {cpu2:.3} s (1 M/s)",
                cpu1.median
            ),
            "—".into(),
        ],
        [
            format!("memory reader header scan, {} GiB guest", SCAN_MIB / 1024),
            "reported".into(),
            format!("{:.1} ms (median)", find.median),
            "—".into(),
        ],
    ];
    Ok(Section {
        command: String::new(),
        body,
        summary,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_ring_holds_the_events_and_their_beacons() {
        for ring in [1024, 65_536, 1 << 22] {
            let n = events_filling(ring);
            assert!(n + n / BEACON_EVERY + 2 <= ring, "{ring}: {n}");
            let m = n + 1;
            assert!(m + m / BEACON_EVERY + 2 > ring, "{ring}: {n} is the most");
        }
    }

    #[test]
    fn the_guest_line_and_the_reader_summary_parse() {
        let g = GuestLine::parse(
            "c-guest: recorder at 0x1000000 magic 0x474e495253544d56 nonce 0x93a2 events \
             3000000 refused 0 beacons 3002 tsc0 0x31eb7ad63bc2 tsc1 0x31ecf259cd36 failed 0",
        )
        .expect("parses");
        assert_eq!(
            (g.events, g.refused, g.beacons, g.failed, g.nonce),
            (3_000_000, 0, 3002, 0, 0x93a2)
        );
        assert_eq!(g.tsc1 - g.tsc0, 0x31ecf259cd36 - 0x31eb7ad63bc2);
        assert!(GuestLine::parse("c-guest: events 1").is_none());
        let r = ReaderRun::parse(
            Duration::from_secs(1),
            Duration::from_millis(500),
            "vmtsync: recorded 4190000 events to x.dat (ended by the requested number of \
             events); 0 dropped by the guest's ring; 1 KVM mapping segment(s); …\n\
             vmtsync: read the recorder at 0x7f00 (1 vCPU ring(s) of 4194304 records): host \
             time exact; 4192 beacons; 3 overwritten, 4 refused, 5 corrupt, 0 ambiguous across \
             0 mapping changes, 0 past --events; 1025 drain rounds, records read over 0.150 s \
             at 27.961 M records/s\n"
                .into(),
        )
        .expect("parses");
        assert_eq!(
            (r.recorded, r.overwritten, r.refused, r.corrupt),
            (4_190_000, 3, 4, 5)
        );
        assert_eq!((r.drain_s, r.m_records_per_s), (0.150, 27.961));
        assert!((r.cpu_per_million() - 0.5 / 4.19).abs() < 1e-9);
        assert!(ReaderRun::parse(Duration::ZERO, Duration::ZERO, "nothing".into()).is_err());
        let s = ScanLine::parse(
            "mem-scan: addr=0x7f0 nonce=0xab find_ms=29.5,31.0 regions=3 bytes_mapped=4096 \
             bytes_read=2048 pages_skipped=7 pagemap=true\n",
        )
        .expect("parses");
        assert_eq!(s.find_ms, [29.5, 31.0]);
        assert_eq!(
            (s.nonce, s.bytes_read, s.pages_skipped, s.pagemap),
            (0xab, 2048, 7, true)
        );
    }
}
