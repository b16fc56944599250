//! The memory reader on a live guest (issue 16): `vmtsync record --from-memory` against the C
//! guest (`tests/c-guest/`, the C ABI's `MemRecorder`) under QEMU microvm on KVM.
//!
//! 1. The ceiling: the guest prefills one large stop-when-full ring and halts (`hold`); the
//!    reader drains it into each format it writes (trace.dat, Perfetto, CTF), several times
//!    on the same guest (it only reads), each drain after a few times the last-level cache
//!    was written elsewhere. Then, on that same guest, `examples/mem_copy`: a raw copy of the
//!    rings' bytes out of the VMM with `pread` on `/proc/PID/mem` and with
//!    `process_vm_readv`, in chunks of several sizes, with the rings in the cache and from
//!    memory (after the same writing elsewhere, like the drains), and the drain's per-round costs
//!    (`Drainer::poll` with and without new records), from which the section works out the
//!    cost of many vCPUs. Last, the output's write alone: as many bytes as the ceiling's
//!    trace.dat written into a fresh file beside it (the least the drain's own write costs).
//! 2. 1 M events/s produced (TSC-paced by the guest) into a 64 Ki-record ring while the reader
//!    drains, for several seconds: what the guest achieved (first and last event's stamps in
//!    the trace, read back by `trace-cmd report`) and what the reader counted as lost.
//! 3. The reader process's own CPU time and peak RSS (`wait4`'s rusage): per million events,
//!    every run; RSS draining a prefilled ring of ~1 M and of ~10 M events.
//! 4. The scan for the header in a 4 GiB guest (`examples/mem_scan`, timing
//!    `vmtsync::guestmem::find` without an address).
//!
//! Every output of the ceiling is read back by its real reader: trace.dat by `trace-cmd
//! report` (every event in sequence), Perfetto by the trace processor (a slice per event),
//! CTF by babeltrace2 (its event counter); every guest must report no failed call on COM1.

use std::collections::BTreeMap;
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

use super::format::{rate, sig3, thousands, time_ns, verdict};
use super::{Plan, Section, Stat, machine, rel};

/// Issue 27's goals: the whole run (start to written file) into trace.dat, and into Perfetto
/// or CTF, events per second.
const WHOLE_GOAL: f64 = 20e6;
const WHOLE_GOAL_OTHER: f64 = 15e6;
/// Issue 27's goal for the drain rate as a share of a raw copy of the same bytes.
const DRAIN_SHARE_GOAL: f64 = 0.25;
/// Issue 27's goal for the reader's CPU time per million events, seconds.
const CPU_GOAL: f64 = 0.05;
/// Issue 27's goal for the peak RSS at ~10 M events over ~1 M (within 10 %).
const RSS_GROWTH_GOAL: f64 = 1.10;
/// The formats the reader writes, as `--format` names them, and how the text names them.
const FORMATS: [(&str, &str); 3] = [
    ("trace-cmd", "trace.dat"),
    ("perfetto", "Perfetto"),
    ("ctf", "CTF"),
];
/// The raw copy's chunk sizes, bytes: a page, 64 KiB, the drainer's default round (16,384
/// records of 32 bytes), its largest round (65,536 records), and 16 MiB.
const COPY_CHUNKS: [u64; 5] = [4096, 65_536, 524_288, 2_097_152, 16_777_216];
/// The drainer's default round in bytes (`DEFAULT_MAX_PER_ROUND` × 32).
const ROUND_BYTES: u64 = 524_288;
/// What is written elsewhere to push the rings out of the cache before each timed ceiling
/// drain and each raw copy "from memory": this many times the largest cache, at least
/// [`EVICT_MIN_MIB`].
const EVICT_TIMES_CACHE: u64 = 4;
const EVICT_MIN_MIB: u64 = 256;
/// The many-vCPU estimate: vCPUs and per-vCPU rates.
const MANY_VCPUS: u64 = 64;
const PER_VCPU_RATES: [f64; 3] = [10e3, 100e3, 1e6];
/// `vmtsync record --poll-ms`'s default: the wait after a round that found nothing more.
const POLL_S: f64 = 0.002;
/// The production rate of run 2, events per second, and its ring.
const PRODUCED_RATE: u64 = 1_000_000;
const RATE_RING: u64 = 65_536;
/// Run 2 on several vCPUs: the vCPU counts tried, in order (the next only when the one before
/// lost nothing), each vCPU at [`PRODUCED_RATE`] into its own [`RATE_RING`]-record ring.
const SMP_VCPUS: [u32; 2] = [2, 3];
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
    /// Records in the prefilled ring, and how many times the reader drains it (five: on this
    /// VM a reader's CPU moved by 1.7× between runs minutes apart, so a median needs several).
    ceiling_ring: u64,
    ceiling_runs: usize,
    /// Events produced at [`PRODUCED_RATE`].
    rate_events: u64,
    /// Timed scans.
    scan_runs: usize,
    /// Passes of the raw copy and of the drain's costs (`mem_copy`).
    copy_passes: usize,
    /// The two RSS runs: (ring records, events).
    rss: [(u64, u64); 2],
}

impl Sizes {
    fn new(plan: &Plan) -> Self {
        if plan.quick {
            Self {
                ceiling_ring: 1 << 18,
                ceiling_runs: 1,
                rate_events: 500_000,
                scan_runs: 1,
                copy_passes: 2,
                rss: [(1 << 15, 20_000), (1 << 18, 200_000)],
            }
        } else {
            Self {
                ceiling_ring: 1 << 22,
                ceiling_runs: 5,
                rate_events: 5_000_000,
                scan_runs: 5,
                copy_passes: 5,
                rss: [(1 << 20, 1_000_000), (1 << 24, 10_000_000)],
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
        Self::boot_smp(elf, dir, name, append, mib, 1)
    }

    /// [`CGuest::boot`] with `smp` vCPUs (QEMU's `-smp`): the guest records on each.
    fn boot_smp(
        elf: &Path,
        dir: &Path,
        name: &str,
        append: &str,
        mib: u32,
        smp: u32,
    ) -> Result<Self> {
        let com1 = dir.join(format!("{name}.com1"));
        let stdout = File::create(&com1).with_context(|| format!("creating {}", com1.display()))?;
        let mut cmd = qemu::command_with_memory_smp(
            Machine::Microvm,
            elf,
            append,
            &dir.join(format!("{name}.com2")),
            mib,
            smp,
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
        loop {
            if qemu::kvm_has_vcpu0(Path::new("/sys/kernel/debug/kvm"), self.pid()) {
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

    /// Stops the VMM (SIGSTOP) once a held guest has recorded: its vCPU cannot halt in ring
    /// 3 (tests/c-guest/entry.S) and would spin on one of this machine's two cores, where the
    /// scheduler left it while every reader thread shared the other core (seen with `perf
    /// sched`; lowering QEMU to nice 19 did not move them). A stopped VMM keeps its memory,
    /// which the reader and `mem_copy` read as before; the guard's SIGKILL ends it.
    fn stop(&self) -> Result<()> {
        self.guard
            .signal(libc::SIGSTOP)
            .with_context(|| format!("stopping QEMU ({})", self.pid()))
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

/// One vCPU's line of a C guest on several vCPUs (`c-guest vcpu V: events N refused R …`),
/// printed before its summary line.
#[derive(Debug, Clone, PartialEq, Eq)]
struct VcpuLine {
    vcpu: u32,
    events: u64,
    refused: u64,
    failed: u64,
    tsc0: u64,
    tsc1: u64,
}

impl VcpuLine {
    fn parse(line: &str) -> Option<Self> {
        let (head, rest) = line.strip_prefix("c-guest vcpu ")?.split_once(':')?;
        // The same words as the summary line's, without the recorder's address and nonce.
        let g = GuestLine::parse(&format!("nonce 0{rest}"))?;
        Some(Self {
            vcpu: head.parse().ok()?,
            events: g.events,
            refused: g.refused,
            failed: g.failed,
            tsc0: g.tsc0,
            tsc1: g.tsc1,
        })
    }

    /// Every vCPU's line in the COM1 text `com1`, in order.
    fn all(com1: &str) -> Vec<Self> {
        com1.lines().filter_map(Self::parse).collect()
    }
}

/// One `vmtsync record --from-memory` run: its wall time, its CPU time and its summary.
#[derive(Debug, Clone)]
struct ReaderRun {
    wall: Duration,
    cpu: Duration,
    /// Peak resident set, KiB (`ru_maxrss`).
    max_rss_kib: u64,
    drain_s: f64,
    m_records_per_s: f64,
    recorded: u64,
    overwritten: u64,
    refused: u64,
    corrupt: u64,
    /// The longest wait between two reads of a ring, ms (the summary's "each ring read again
    /// within X ms"; absent with a single round).
    reread_ms: Option<f64>,
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
    /// [`Self::reread_ms`] to a tenth of a ms, or a dash without it.
    fn reread_text(&self) -> String {
        self.reread_ms
            .map_or_else(|| "—".into(), |ms| format!("{ms:.1}"))
    }

    fn parse(wall: Duration, usage: Usage, stderr: String) -> Result<Self> {
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
            reread_ms: after(&stderr, "each ring read again within "),
            wall,
            cpu: usage.cpu,
            max_rss_kib: usage.max_rss_kib,
        })
    }

    /// Reader CPU seconds per million events.
    #[allow(clippy::cast_precision_loss)] // Counts far below 2^52.
    fn cpu_per_million(&self) -> f64 {
        self.cpu.as_secs_f64() / (self.recorded as f64 / 1e6)
    }

    /// Events over the process's wall time, start to exit.
    #[allow(clippy::cast_precision_loss)] // Counts far below 2^52.
    fn whole_rate(&self) -> f64 {
        self.recorded as f64 / self.wall.as_secs_f64()
    }
}

/// A reaped child's resource use (`wait4`).
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    /// User + system CPU time.
    cpu: Duration,
    /// Peak resident set, KiB.
    max_rss_kib: u64,
}

/// Waits for `child` with `wait4`, returning its exit code (`None`: killed by a signal) and
/// its resource use.
fn wait_rusage(child: &Child) -> Result<(Option<i32>, Usage)> {
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
    Ok((
        code,
        Usage {
            cpu: tv(usage.ru_utime) + tv(usage.ru_stime),
            // Linux counts ru_maxrss in KiB.
            max_rss_kib: u64::try_from(usage.ru_maxrss).unwrap_or(0),
        },
    ))
}

/// Runs `vmtsync record --from-memory --trust-raw-tsc` against `pid` into `out` as `format`
/// (a `--format` name).
fn record(
    vmtsync: &Path,
    pid: u32,
    format: &str,
    events: u64,
    seconds: u64,
    out: &Path,
    log: &Path,
) -> Result<ReaderRun> {
    let mut cmd = Command::new(vmtsync);
    cmd.args(["record", "--from-memory", "--trust-raw-tsc", "--vm"])
        .arg(pid.to_string())
        .args(["--format", format, "--events"])
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
    let (code, usage) = wait_rusage(&child)?;
    let wall = start.elapsed();
    let stderr = std::fs::read_to_string(log).unwrap_or_default();
    ensure!(
        code == Some(0),
        "vmtsync record exited with {code:?}: {stderr}"
    );
    eprintln!("{}", stderr.trim_end());
    ReaderRun::parse(wall, usage, stderr)
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
    let cpus = report_cpus(dat)?;
    ensure!(
        cpus.len() <= 1,
        "trace-cmd report shows events on {} CPUs, one expected",
        cpus.len()
    );
    Ok(cpus.into_values().next().unwrap_or(Report {
        events: 0,
        first_seq: 0,
        last_seq: 0,
        first: 0,
        last: 0,
    }))
}

/// [`report`] for each trace CPU (the reader writes vCPU N's ring as CPU N), the sequence
/// numbers checked to increase within each.
fn report_cpus(dat: &Path) -> Result<BTreeMap<u32, Report>> {
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
    let mut cpus = BTreeMap::new();
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
        let cpu: u32 = line
            .split_once('[')
            .and_then(|(_, rest)| rest.split_once(']'))
            .and_then(|(cpu, _)| cpu.trim().parse().ok())
            .with_context(|| format!("no CPU in `{line}`"))?;
        let r = cpus.entry(cpu).or_insert(Report {
            events: 0,
            first_seq: 0,
            last_seq: 0,
            first: 0,
            last: 0,
        });
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
    Ok(cpus)
}

/// The events Perfetto's trace processor shows in a trace the reader wrote: slices of the C
/// guest's event id (named `event <id>`), and slices in all.
fn perfetto_events(trace: &Path, dir: &Path) -> Result<(u64, u64)> {
    let tp = vmtsync_launch::trace_processor::ensure_trace_processor()
        .context("Perfetto's trace processor (cargo xtask setup)")?;
    let queries = dir.join("perfetto-queries.json");
    std::fs::write(
        &queries,
        serde_json::to_vec(&[format!(
            "select count(*), sum(name = 'event {EVENT_ID}') from slice"
        )])?,
    )?;
    let mut cmd = Command::new("node");
    cmd.arg(vmtsync_launch::trace_processor::query_script())
        .arg(&tp)
        .arg(trace)
        .stdin(File::open(&queries)?)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    eprintln!("$ {}", crate::display(&cmd));
    let out = cmd
        .output()
        .context("starting node (the trace processor)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "the trace processor failed on {}: {}",
        trace.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("trace processor output: {text}"))?;
    let row = &v["results"][0]["rows"][0];
    let int = |x: &serde_json::Value| -> Option<u64> {
        x.as_str()
            .and_then(|s| s.parse().ok())
            .or_else(|| x.as_u64())
    };
    let all = int(&row[0]).with_context(|| format!("no slice count in {text}"))?;
    let ours = int(&row[1]).unwrap_or(0);
    Ok((ours, all))
}

/// The events babeltrace2 reads in a CTF trace directory (its `sink.utils.counter`, which
/// prints its counts once at the end with `step=+0`).
fn ctf_events(dir: &Path) -> Result<u64> {
    let mut cmd = Command::new("babeltrace2");
    cmd.arg(dir)
        .args(["--component", "sink.utils.counter", "--params", "step=+0"])
        .stdin(Stdio::null());
    eprintln!("$ {}", crate::display(&cmd));
    let out = cmd.output().context("starting babeltrace2")?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "babeltrace2 failed on {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    counted_events(&text)
        .with_context(|| format!("no event count in babeltrace2's counter: {text}"))
}

/// The last `N Event messages` line of babeltrace2's counter.
fn counted_events(text: &str) -> Option<u64> {
    text.lines().rev().find_map(|l| {
        let n = l.trim().strip_suffix(" Event messages")?;
        n.trim().parse().ok()
    })
}

/// How one format's last ceiling output read back in its reader.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ReadBack {
    /// The C guest's events the reader shows.
    events: u64,
    /// What the reader is and what it showed, for the text.
    how: String,
}

/// Reads back the last ceiling output in `format` with its real reader; the events must be
/// exactly `n` (trace.dat: in sequence 0..n).
fn read_back(format: &str, out: &Path, dir: &Path, n: u64) -> Result<ReadBack> {
    match format {
        "trace-cmd" => {
            let r = report(out)?;
            ensure!(
                r.is_complete(n),
                "trace-cmd report does not show events 0..{n} in sequence: {r:?}"
            );
            Ok(ReadBack {
                events: r.events,
                how: "`trace-cmd report`: every event, sequence numbers 0 to N − 1 in order".into(),
            })
        }
        "perfetto" => {
            let (ours, all) = perfetto_events(out, dir)?;
            ensure!(
                ours == n && all == n,
                "the trace processor shows {ours} slices of event {EVENT_ID:#x} ({all} in all), \
                 not {n}"
            );
            Ok(ReadBack {
                events: ours,
                how: format!(
                    "Perfetto's trace processor ({}): one slice per event, each of the guest's \
                     event id",
                    vmtsync_launch::trace_processor::VERSION
                ),
            })
        }
        "ctf" => {
            let events = ctf_events(out)?;
            ensure!(events == n, "babeltrace2 counts {events} events, not {n}");
            Ok(ReadBack {
                events,
                how: "babeltrace2 (`sink.utils.counter`): the event count".into(),
            })
        }
        other => bail!("no reader for format {other}"),
    }
}

/// One `mem-copy:` line of `examples/mem_copy`.
#[derive(Debug, Clone, PartialEq)]
struct CopyLine {
    /// Timed from memory (`mem-copy-cold:`): each pass after the rings were pushed out of
    /// the cache.
    cold: bool,
    method: String,
    chunk: u64,
    bytes: u64,
    seconds: Vec<f64>,
    gbps: f64,
    records_per_s: f64,
}

/// A `mem-floor:` line of `examples/mem_copy`: the floor of a drain that writes an output of
/// `bytes` (a round's chunks copied, each slot's stamp checked, the output's bytes written
/// through the reader's own writer; nothing placed or formatted).
#[derive(Debug, Clone, PartialEq)]
struct FloorLine {
    method: String,
    /// The bytes written (one ceiling output's size).
    bytes: u64,
    records: u64,
    /// Slots whose commit stamp held.
    checked: u64,
    seconds: Vec<f64>,
    /// The example's CPU time (user + system, every thread) over each pass.
    cpu_seconds: Vec<f64>,
    records_per_s: f64,
}

impl FloorLine {
    fn parse(line: &str) -> Option<Self> {
        let line = line.strip_prefix("mem-floor: ")?;
        Some(Self {
            method: word(line, "method")?.to_owned(),
            bytes: word(line, "bytes")?.parse().ok()?,
            records: word(line, "records")?.parse().ok()?,
            checked: word(line, "checked")?.parse().ok()?,
            seconds: list(word(line, "seconds")?)?,
            cpu_seconds: list(word(line, "cpu_seconds")?)?,
            records_per_s: word(line, "records_per_s")?.parse().ok()?,
        })
    }
}

/// The `mem-poll:` line of `examples/mem_copy` (one per read method).
#[derive(Debug, Clone, PartialEq)]
struct PollLine {
    method: String,
    rings: u64,
    records: u64,
    drain_seconds: Vec<f64>,
    ns_per_record: f64,
    busy_round_ns: f64,
    idle_poll_ns: f64,
    head_bytewise_ns: f64,
    head_batched_ns: f64,
}

/// `key=value` of a line's words.
fn word<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

fn list(v: &str) -> Option<Vec<f64>> {
    v.split(',').map(str::parse).collect::<Result<_, _>>().ok()
}

impl CopyLine {
    fn parse(line: &str) -> Option<Self> {
        let (cold, line) = match line.strip_prefix("mem-copy-cold: ") {
            Some(rest) => (true, rest),
            None => (false, line.strip_prefix("mem-copy: ")?),
        };
        Some(Self {
            cold,
            method: word(line, "method")?.to_owned(),
            chunk: word(line, "chunk")?.parse().ok()?,
            bytes: word(line, "bytes")?.parse().ok()?,
            seconds: list(word(line, "seconds")?)?,
            gbps: word(line, "gbps")?.parse().ok()?,
            records_per_s: word(line, "records_per_s")?.parse().ok()?,
        })
    }
}

impl PollLine {
    fn parse(line: &str) -> Option<Self> {
        let line = line.strip_prefix("mem-poll: ")?;
        Some(Self {
            method: word(line, "method")?.to_owned(),
            rings: word(line, "rings")?.parse().ok()?,
            records: word(line, "records")?.parse().ok()?,
            drain_seconds: list(word(line, "drain_seconds")?)?,
            ns_per_record: word(line, "ns_per_record")?.parse().ok()?,
            busy_round_ns: word(line, "busy_round_ns")?.parse().ok()?,
            idle_poll_ns: word(line, "idle_poll_ns")?.parse().ok()?,
            head_bytewise_ns: word(line, "head_bytewise_ns")?.parse().ok()?,
            head_batched_ns: word(line, "head_batched_ns")?.parse().ok()?,
        })
    }
}

/// Everything `examples/mem_copy` printed.
#[derive(Debug, Clone, PartialEq)]
struct CopyRun {
    copies: Vec<CopyLine>,
    polls: Vec<PollLine>,
    /// One floor per ceiling output size, in [`FORMATS`]' order.
    floors: Vec<FloorLine>,
    /// Its `mem-kvm:` line: ns per read of KVM's mapping of one vCPU, as every round of a
    /// memory recording reads it for each vCPU.
    kvm_read_ns: f64,
    command: String,
}

impl CopyRun {
    fn parse(stdout: &str, command: String) -> Result<Self> {
        let copies: Vec<CopyLine> = stdout.lines().filter_map(CopyLine::parse).collect();
        let polls: Vec<PollLine> = stdout.lines().filter_map(PollLine::parse).collect();
        ensure!(
            !copies.is_empty() && !polls.is_empty(),
            "mem_copy printed no copy or poll line: {stdout}"
        );
        let kvm_read_ns = stdout
            .lines()
            .find_map(|l| word(l.strip_prefix("mem-kvm: ")?, "read_ns")?.parse().ok())
            .with_context(|| format!("mem_copy printed no mem-kvm line: {stdout}"))?;
        let floors: Vec<FloorLine> = stdout.lines().filter_map(FloorLine::parse).collect();
        ensure!(
            !floors.is_empty(),
            "mem_copy printed no mem-floor line: {stdout}"
        );
        for f in &floors {
            ensure!(
                f.checked == f.records,
                "mem_copy's floor found {} of {} slots committed in a held, full ring",
                f.checked,
                f.records
            );
        }
        Ok(Self {
            copies,
            polls,
            floors,
            kvm_read_ns,
            command,
        })
    }

    /// The copy with `method` in `chunk`-byte reads, with the rings in the cache or (`cold`)
    /// from memory.
    fn copy(&self, method: &str, chunk: u64, cold: bool) -> Result<&CopyLine> {
        self.copies
            .iter()
            .find(|c| c.method == method && c.chunk == chunk && c.cold == cold)
            .with_context(|| {
                format!(
                    "mem_copy printed no {method} copy of {chunk}-byte chunks {}",
                    if cold { "from memory" } else { "in the cache" }
                )
            })
    }

    /// The floor of a drain that writes `bytes`.
    fn floor(&self, bytes: u64) -> Result<&FloorLine> {
        self.floors
            .iter()
            .find(|f| f.bytes == bytes)
            .with_context(|| format!("mem_copy printed no floor of {bytes} bytes"))
    }

    fn poll(&self, method: &str) -> Result<&PollLine> {
        self.polls
            .iter()
            .find(|p| p.method == method)
            .with_context(|| format!("mem_copy printed no {method} poll line"))
    }
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

/// One format's ceiling runs and how its last output read back.
#[derive(Debug, Clone)]
struct FormatRuns {
    /// `--format`'s name and the text's.
    format: &'static str,
    label: &'static str,
    runs: Vec<ReaderRun>,
    read_back: ReadBack,
    /// As many bytes as the last run's output, written and then synced alone
    /// ([`WriteFloor::measure`] with `durable`): for scale beside the whole run, which syncs
    /// its output before it exits (`vmtsync record` does), overlapping the syncs with its
    /// writing.
    durable: WriteFloor,
}

/// One RSS run: the guest's ring and events, and the reader's run.
#[derive(Debug, Clone)]
struct RssRun {
    ring: u64,
    events: u64,
    run: ReaderRun,
}

/// The output's write alone: `bytes` (the ceiling's trace.dat) written into a fresh file in
/// [`WRITE_CHUNK`] writes of one reused buffer, `seconds` per pass (no sync, as the drain's
/// writes: the page cache's copy and its page allocation, the least any writer of the file
/// pays); or, `durable`, the same followed by `fdatasync` (the disk's part too).
#[derive(Debug, Clone)]
struct WriteFloor {
    bytes: u64,
    seconds: Vec<f64>,
}

/// The trace.dat writer's write size (its first CPU's pages go out a MiB at a time).
const WRITE_CHUNK: usize = 1 << 20;

impl WriteFloor {
    /// `passes` timed writes of `bytes` into `dir/write-floor.bin`, each into a fresh file
    /// (the last one removed and the filesystem synced first, outside the timing), after one
    /// untimed pass; with `durable`, each synced (`fdatasync`) inside its timing.
    fn measure(dir: &Path, bytes: u64, passes: usize, durable: bool) -> Result<Self> {
        use std::io::Write as _;
        let path = dir.join("write-floor.bin");
        let buf = vec![0x5a_u8; WRITE_CHUNK];
        let mut seconds = Vec::new();
        for pass in 0..=passes {
            let _ = std::fs::remove_file(&path);
            settle(dir)?;
            let start = Instant::now();
            let mut f =
                File::create(&path).with_context(|| format!("creating {}", path.display()))?;
            let mut left = bytes;
            while left > 0 {
                let n = usize::try_from(left.min(WRITE_CHUNK as u64))?;
                f.write_all(&buf[..n])
                    .with_context(|| format!("writing {}", path.display()))?;
                left -= n as u64;
            }
            if durable {
                f.sync_data()
                    .with_context(|| format!("syncing {}", path.display()))?;
            }
            drop(f);
            if pass > 0 {
                seconds.push(start.elapsed().as_secs_f64());
            }
        }
        let _ = std::fs::remove_file(&path);
        Ok(Self { bytes, seconds })
    }
}

/// Everything the section shows.
#[derive(Debug, Clone)]
struct Measured {
    tsc_khz: u64,
    ceiling_ring: u64,
    ceiling_guest: GuestLine,
    ceiling: Vec<FormatRuns>,
    /// The method `ProcMemory::open` chose (what the reader used).
    reader_method: String,
    /// The largest cache (MiB, when sysfs says), and what was written elsewhere before each
    /// timed ceiling drain and each copy from memory.
    cache_mib: Option<u64>,
    evict_mib: u64,
    /// The command that writes it (`mem_copy --evict MIB`).
    evict_command: String,
    copy: CopyRun,
    /// The kernel's write of the ceiling's trace.dat bytes into a fresh file, alone.
    write: WriteFloor,
    rss: Vec<RssRun>,
    rate_guest: GuestLine,
    rate_run: ReaderRun,
    rate_report: Report,
    smp: Vec<SmpRun>,
    /// Why the next vCPU count was not run, or how it failed.
    smp_note: Option<String>,
    scan_guest: GuestLine,
    scan: ScanLine,
    scan_command: String,
}

/// Run 2 on `vcpus` vCPUs: the guest's own lines, the reader's run and what trace-cmd shows
/// of each vCPU's ring (trace CPU N is vCPU N).
#[derive(Debug, Clone)]
struct SmpRun {
    vcpus: u32,
    guest: GuestLine,
    lines: Vec<VcpuLine>,
    run: ReaderRun,
    reports: BTreeMap<u32, Report>,
}

/// One vCPU of an [`SmpRun`]: its achieved rate and how many of its events are missing.
struct SmpVcpu {
    vcpu: u32,
    /// Events the guest says this vCPU recorded.
    recorded: u64,
    /// Its events trace-cmd shows.
    in_trace: u64,
    achieved: f64,
}

impl SmpRun {
    /// Each vCPU's figures: the achieved rate as run 2's (sequence numbers between the first
    /// and the last event in the trace over their stamps).
    #[allow(clippy::cast_precision_loss)] // Counts and ticks far below 2^52.
    fn per_vcpu(&self, tsc_khz: u64) -> Vec<SmpVcpu> {
        let hz = tsc_khz as f64 * 1e3;
        self.lines
            .iter()
            .map(|l| {
                let rep = self.reports.get(&l.vcpu);
                let span = rep.map_or(0, |r| r.last.saturating_sub(r.first));
                SmpVcpu {
                    vcpu: l.vcpu,
                    recorded: l.events,
                    in_trace: rep.map_or(0, |r| r.events),
                    achieved: match rep {
                        Some(r) if span > 0 => (r.last_seq - r.first_seq) as f64 * hz / span as f64,
                        _ => 0.0,
                    },
                }
            })
            .collect()
    }

    /// The reader's lost records: overwritten, refused and corrupt (its summary).
    fn reader_lost(&self) -> u64 {
        self.run.overwritten + self.run.refused + self.run.corrupt
    }

    /// 0 lost by every count (the reader's, the guest's refused, each vCPU's events against
    /// trace-cmd's), every vCPU within 1 % of the rate.
    #[allow(clippy::cast_precision_loss)] // A rate far below 2^52.
    fn clean(&self, tsc_khz: u64) -> bool {
        let v = self.per_vcpu(tsc_khz);
        self.reader_lost() == 0
            && self.guest.refused == 0
            && v.len() == self.vcpus as usize
            && v.iter()
                .all(|c| c.in_trace == c.recorded && c.achieved >= 0.99 * PRODUCED_RATE as f64)
    }
}

/// Run 2 on `vcpus` vCPUs: each records `events` events at [`PRODUCED_RATE`] into its own
/// flight ring of [`RATE_RING`] records while the reader drains them all into trace.dat.
fn smp_rate(
    elf: &Path,
    vmtsync: &Path,
    dir: &Path,
    tsc_khz: u64,
    vcpus: u32,
    events: u64,
) -> Result<SmpRun> {
    let name = format!("rate-smp{vcpus}");
    let mut guest = CGuest::boot_smp(
        elf,
        dir,
        &name,
        &format!(
            "ring={RATE_RING} events={events} rate={PRODUCED_RATE} tsc_khz={tsc_khz} flight hold"
        ),
        qemu::DEFAULT_MEMORY_MIB,
        vcpus,
    )?;
    let dat = dir.join(format!("{name}.dat"));
    guest.wait_vcpu(Duration::from_secs(30))?;
    let total = events * u64::from(vcpus);
    let run = record(
        vmtsync,
        guest.pid(),
        "trace-cmd",
        total,
        events / PRODUCED_RATE + 10,
        &dat,
        &dir.join(format!("{name}.log")),
    );
    let line = guest.line(Duration::from_secs(60));
    let com1 = std::fs::read_to_string(&guest.com1).unwrap_or_default();
    drop(guest);
    let run = run?;
    let guest = line?;
    let lines = VcpuLine::all(&com1);
    ensure!(
        lines.len() == vcpus as usize
            && lines
                .iter()
                .zip(0..)
                .all(|(l, v)| l.vcpu == v && l.failed == 0),
        "the C guest did not report {vcpus} vCPUs without failures: {com1}"
    );
    let reports = report_cpus(&dat)?;
    let shown: u64 = reports.values().map(|r| r.events).sum();
    ensure!(
        shown == run.recorded,
        "trace-cmd report shows {shown} events, the reader recorded {}",
        run.recorded
    );
    for l in &lines {
        if let Some(r) = reports.get(&l.vcpu) {
            ensure!(
                r.last - r.first <= l.tsc1 - l.tsc0,
                "vCPU {}'s events span more ticks in the trace than its loop",
                l.vcpu
            );
        }
    }
    let _ = std::fs::remove_file(&dat);
    Ok(SmpRun {
        vcpus,
        guest,
        lines,
        run,
        reports,
    })
}

/// Where `record` writes `format` for the run named `name` (CTF: a directory).
fn output_path(dir: &Path, name: &str, format: &str) -> PathBuf {
    match format {
        "perfetto" => dir.join(format!("{name}.perfetto-trace")),
        "ctf" => dir.join(format!("{name}-ctf")),
        _ => dir.join(format!("{name}.dat")),
    }
}

/// The bytes of an output: its file's, or the files' of its directory (CTF's).
fn output_bytes(out: &Path) -> Result<u64> {
    let m = std::fs::metadata(out).with_context(|| format!("reading {}", out.display()))?;
    if !m.is_dir() {
        return Ok(m.len());
    }
    let mut n = 0;
    for e in std::fs::read_dir(out).with_context(|| format!("listing {}", out.display()))? {
        n += output_bytes(&e?.path())?;
    }
    Ok(n)
}

fn remove_output(out: &Path) {
    let _ = std::fs::remove_dir_all(out);
    let _ = std::fs::remove_file(out);
}

/// Writes back everything the filesystem holding `dir` still has to write (`sync -f`), before
/// a timed run that writes and syncs a file there: the disk then works on that run's bytes
/// alone, not on what earlier sections (a build, the last pass's output) left behind.
fn settle(dir: &Path) -> Result<()> {
    let mut cmd = Command::new("sync");
    cmd.arg("-f").arg(dir);
    let status = cmd.status().context("starting sync")?;
    ensure!(
        status.success(),
        "{} failed: {status}",
        crate::display(&cmd)
    );
    Ok(())
}

/// MiB of guest RAM for a `ring`-record ring: its bytes (32 per record) and 64 MiB for the
/// rest.
fn guest_mib(ring: u64) -> Result<u32> {
    let mib = u32::try_from(ring * 32 / (1 << 20) + 64).context("ring too large")?;
    Ok(mib.max(qemu::DEFAULT_MEMORY_MIB))
}

/// The largest of CPU 0's caches (sysfs), MiB, rounded up; `None` when sysfs does not say.
fn largest_cache_mib() -> Option<u64> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("size")).ok())
        .filter_map(|t| cache_kib(&t))
        .max()
        .map(|kib| kib.div_ceil(1024))
}

/// A sysfs cache size ("307200K", "2M") in KiB.
fn cache_kib(text: &str) -> Option<u64> {
    let t = text.trim();
    if let Some(k) = t.strip_suffix('K') {
        return k.parse().ok();
    }
    if let Some(m) = t.strip_suffix('M') {
        return m.parse::<u64>().ok().map(|m| m * 1024);
    }
    t.parse::<u64>().ok().map(|b| b.div_ceil(1024))
}

/// Pushes the rings out of the cache before a timed drain as `mem_copy` does before each
/// copy from memory: `mem_copy --evict MIB` writes `mib` MiB elsewhere. In a process of its
/// own: a child's peak RSS (`wait4`) starts from its parent's peak when it is forked, so a
/// buffer this large in the bench's own process would show as every reader's.
fn evict(copier: &Path, mib: u64) -> Result<()> {
    let mut cmd = Command::new(copier);
    cmd.args(["--evict", &mib.to_string()]);
    let status = cmd
        .status()
        .context("starting mem_copy to push the rings out of the cache")?;
    ensure!(
        status.success(),
        "{} failed: {status}",
        crate::display(&cmd)
    );
    Ok(())
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
    let copier = plan.bin_dir.join("examples/mem_copy");

    // 1. The ceiling: a prefilled ring, drained several times into each format.
    let ring = sizes.ceiling_ring;
    let n = events_filling(ring);
    let mut guest = CGuest::boot(
        &elf,
        &dir,
        "ceiling",
        &format!("ring={ring} events={n} tsc_khz={tsc_khz} hold"),
        guest_mib(ring)?,
    )?;
    let ceiling_guest = guest.line(Duration::from_secs(120))?;
    guest.stop()?;
    ensure!(
        ceiling_guest.events == n && ceiling_guest.refused == 0,
        "the prefill did not record every event: {}",
        ceiling_guest.text
    );
    let mut runs: Vec<Vec<ReaderRun>> = vec![Vec::new(); FORMATS.len()];
    let cache_mib = largest_cache_mib();
    let evict_mib = cache_mib.map_or(EVICT_MIN_MIB, |c| {
        (c * EVICT_TIMES_CACHE).max(EVICT_MIN_MIB)
    });
    // Formats interleaved within each pass, so a slow moment of the host hits them alike.
    for k in 0..sizes.ceiling_runs {
        for (f, (format, _)) in FORMATS.iter().enumerate() {
            let out = output_path(&dir, "ceiling", format);
            remove_output(&out);
            settle(&dir)?;
            evict(&copier, evict_mib)?;
            let run = record(
                &vmtsync,
                guest.pid(),
                format,
                n,
                120,
                &out,
                &dir.join(format!("ceiling-{format}-{k}.log")),
            )?;
            ensure!(
                run.recorded == n,
                "{format} run {k} recorded {} of {n}",
                run.recorded
            );
            runs[f].push(run);
        }
    }
    // The raw copy of the same rings, the floor of a drain that writes each ceiling output and
    // the drain's round costs, on the same guest.
    let floor_bytes: Vec<String> = FORMATS
        .iter()
        .map(|(format, _)| Ok(output_bytes(&output_path(&dir, "ceiling", format))?.to_string()))
        .collect::<Result<_>>()?;
    let chunks: Vec<String> = COPY_CHUNKS.iter().map(u64::to_string).collect();
    let mut cmd = Command::new(&copier);
    cmd.arg(guest.pid().to_string())
        .arg(sizes.copy_passes.to_string())
        .arg(chunks.join(","))
        .arg(evict_mib.to_string())
        .arg(&dir)
        .arg(floor_bytes.join(","));
    let copy_command = format!(
        "{} QEMU_PID {} {} {evict_mib} OUT_DIR TRACE_DAT_BYTES,PERFETTO_BYTES,CTF_BYTES",
        rel(&copier),
        sizes.copy_passes,
        chunks.join(",")
    );
    eprintln!("$ {}", crate::display(&cmd));
    let o = cmd.output().context("starting mem_copy")?;
    drop(guest);
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    ensure!(
        o.status.success(),
        "mem_copy: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    eprint!("{stdout}");
    let reader_method = stdout
        .lines()
        .find_map(|l| l.strip_prefix("mem-open: method="))
        .with_context(|| format!("mem_copy named no method: {stdout}"))?
        .to_owned();
    let copy = CopyRun::parse(&stdout, copy_command)?;
    let mut ceiling = Vec::new();
    let mut tracedat_bytes = None;
    for ((format, label), runs) in FORMATS.iter().zip(runs) {
        let out = output_path(&dir, "ceiling", format);
        let read_back = read_back(format, &out, &dir, n)?;
        let bytes = output_bytes(&out)?;
        if *format == "trace-cmd" {
            tracedat_bytes = Some(bytes);
        }
        remove_output(&out);
        let durable = WriteFloor::measure(&dir, bytes, sizes.copy_passes, true)?;
        ceiling.push(FormatRuns {
            format,
            label,
            runs,
            read_back,
            durable,
        });
    }

    // The output's write alone, beside the drain's figures.
    let write = WriteFloor::measure(
        &dir,
        tracedat_bytes.context("no trace.dat ceiling")?,
        sizes.copy_passes,
        false,
    )?;

    // 3. Peak RSS draining ~1 M and ~10 M events.
    let mut rss = Vec::new();
    for (i, &(ring, events)) in sizes.rss.iter().enumerate() {
        let name = format!("rss{i}");
        let mut guest = CGuest::boot(
            &elf,
            &dir,
            &name,
            &format!("ring={ring} events={events} tsc_khz={tsc_khz} hold"),
            guest_mib(ring)?,
        )?;
        let g = guest.line(Duration::from_secs(300))?;
        guest.stop()?;
        ensure!(
            g.events == events && g.refused == 0,
            "the prefill did not record every event: {}",
            g.text
        );
        let out = output_path(&dir, &name, "trace-cmd");
        let run = record(
            &vmtsync,
            guest.pid(),
            "trace-cmd",
            events,
            300,
            &out,
            &dir.join(format!("{name}.log")),
        );
        drop(guest);
        remove_output(&out);
        let run = run?;
        ensure!(
            run.recorded == events,
            "the RSS run recorded {} of {events}",
            run.recorded
        );
        rss.push(RssRun { ring, events, run });
    }

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
        "trace-cmd",
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

    // 2b. The same rate on several vCPUs, each into its own ring, as long as run 2: 2 vCPUs,
    // then 3 if 2 lost nothing.
    let mut smp = Vec::new();
    let mut smp_note = None;
    for vcpus in SMP_VCPUS {
        if let Some(last) = smp.last().filter(|r: &&SmpRun| !r.clean(tsc_khz)) {
            smp_note = Some(format!(
                "{vcpus} vCPUs not run: {} vCPUs did not run clean",
                last.vcpus
            ));
            break;
        }
        match smp_rate(&elf, &vmtsync, &dir, tsc_khz, vcpus, n2) {
            Ok(r) => smp.push(r),
            Err(e) if !smp.is_empty() => {
                smp_note = Some(format!("{vcpus} vCPUs failed: {e:#}"));
                break;
            }
            Err(e) => return Err(e),
        }
    }

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
        reader_method,
        cache_mib,
        evict_mib,
        evict_command: format!("{} --evict {evict_mib}", rel(&copier)),
        copy,
        write,
        rss,
        rate_guest,
        rate_run,
        rate_report,
        smp,
        smp_note,
        scan_guest,
        scan,
        scan_command,
    };
    let mut section = memory_section(&m)?;
    section.command = format!(
        "vmtsync record --from-memory --trust-raw-tsc --vm QEMU_PID --format \
         trace-cmd|perfetto|ctf --events N --no-progress --out OUT; {}; {}",
        m.copy.command, m.scan_command
    );
    Ok(section)
}

/// The several-vCPU runs' paragraph and table (appended to `body`) and their summary rows.
#[allow(clippy::cast_precision_loss)] // Counts far below 2^52.
fn smp_text(m: &Measured, body: &mut String) -> Vec<[String; 4]> {
    let _ = write!(
        body,
        "\n**Several vCPUs at 1 M events/s each.** The same run on QEMU `-smp N`: the C guest's \
         BSP starts its APs (INIT-SIPI-SIPI, tests/c-guest/entry.S) and every vCPU records {} \
         events paced by its own TSC at {} (`ring={} events={} rate={} tsc_khz={} flight \
         hold`), in ring 3, into its own flight ring of {} records, while one reader drains \
         them all into trace.dat. The machine has {} host core(s) for N spinning vCPUs (each \
         busy-waits between events) and the reader. *In trace* is the vCPU's events trace-cmd \
         shows (trace CPU N is vCPU N), *recorded* the count the guest itself printed on COM1; \
         *lost* is recorded − in trace. The reader's own count of lost records (overwritten + \
         refused + corrupt, its summary) is for all rings together, and so is its longest wait \
         between two reads of a ring (its summary's \"each ring read again within\"): a ring of \
         {} records at {} holds {:.1} ms, so a longer wait loses records.\n\n\
         | vCPUs | vCPU | achieved | recorded (guest) | in trace | lost | reader: overwritten / \
         refused / corrupt | reader CPU (s; per million events) | reader's longest wait \
         between two reads (ms) |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        thousands(m.rate_guest.events),
        rate(PRODUCED_RATE as f64),
        RATE_RING,
        m.rate_guest.events,
        PRODUCED_RATE,
        m.tsc_khz,
        thousands(RATE_RING),
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
        thousands(RATE_RING),
        rate(PRODUCED_RATE as f64),
        RATE_RING as f64 / PRODUCED_RATE as f64 * 1e3,
    );
    let mut rows = Vec::new();
    for r in &m.smp {
        let per = r.per_vcpu(m.tsc_khz);
        for (i, v) in per.iter().enumerate() {
            let reader = if i == 0 {
                format!(
                    "{} / {} / {} | {} s ({:.3} s per million) | {}",
                    r.run.overwritten,
                    r.run.refused,
                    r.run.corrupt,
                    sig3(r.run.cpu.as_secs_f64()),
                    r.run.cpu_per_million(),
                    r.run.reread_text(),
                )
            } else {
                " |  | ".into()
            };
            let _ = writeln!(
                body,
                "| {} | {} | {} | {} | {} | {} | {reader} |",
                r.vcpus,
                v.vcpu,
                rate(v.achieved),
                thousands(v.recorded),
                thousands(v.in_trace),
                thousands(i128::from(v.recorded) - i128::from(v.in_trace)),
            );
        }
        let lost: u64 = per
            .iter()
            .map(|v| v.recorded.saturating_sub(v.in_trace))
            .sum::<u64>()
            .max(r.reader_lost());
        rows.push([
            format!(
                "memory reader, {} vCPUs × 1 M events/s each, 64 Ki ring each",
                r.vcpus
            ),
            "0 lost".into(),
            format!(
                "{} achieved; {} lost ({} overwritten, {} refused, {} corrupt; guest {} refused); \
                 reader CPU {} s; longest wait between reads {} ms",
                per.iter()
                    .map(|v| rate(v.achieved))
                    .collect::<Vec<_>>()
                    .join(", "),
                lost,
                r.run.overwritten,
                r.run.refused,
                r.run.corrupt,
                r.guest.refused,
                sig3(r.run.cpu.as_secs_f64()),
                r.run.reread_text(),
            ),
            verdict(r.clean(m.tsc_khz)),
        ]);
    }
    let most = m
        .smp
        .iter()
        .filter(|r| r.clean(m.tsc_khz))
        .map(|r| r.vcpus)
        .max();
    let _ = writeln!(
        body,
        "\nMost vCPUs at 1 M events/s each with 0 lost on this machine: {}.{}",
        most.map_or_else(|| "none of those tried".to_owned(), |n| n.to_string()),
        m.smp_note
            .as_ref()
            .map_or_else(String::new, |n| format!(" ({n}.)"))
    );
    rows
}

/// The reader's share of one core for `vcpus` rings each producing `per_vcpu` events/s,
/// drained in rounds that each cost `round_s` per ring plus `per_event_s` per event, with a
/// wait of `poll_s` after each round (every round finds fewer than a round's bound, so the
/// reader waits: `vmtsync record`'s loop). A round then lasts `T = (poll + V·round) / (1 −
/// V·R·event)` (the events that arrive during it are drained in it), and the reader works
/// `V·round + V·R·event·T` of it. `None` when `V·R·event ≥ 1`: more than a core, it falls
/// behind.
fn core_share(
    vcpus: f64,
    per_vcpu: f64,
    round_s: f64,
    per_event_s: f64,
    poll_s: f64,
) -> Option<f64> {
    let load = vcpus * per_vcpu * per_event_s;
    if load >= 1.0 {
        return None;
    }
    let period = (poll_s + vcpus * round_s) / (1.0 - load);
    Some(vcpus * round_s / period + load)
}

/// A share of a core as a percentage.
fn percent(v: f64) -> String {
    format!("{} %", sig3(v * 100.0))
}

#[allow(clippy::cast_precision_loss)] // Counts and ticks far below 2^52.
#[allow(clippy::too_many_lines)] // One section's text, in the order it reads.
fn memory_section(m: &Measured) -> Result<Section> {
    let stat = |runs: &[ReaderRun], f: &dyn Fn(&ReaderRun) -> f64| {
        Stat::of(&runs.iter().map(f).collect::<Vec<_>>()).context("no ceiling run")
    };
    struct Fig {
        label: &'static str,
        format: &'static str,
        drain: Stat,
        drain_s: Stat,
        wall: Stat,
        whole: Stat,
        cpu: Stat,
        rss: Stat,
        read_back: ReadBack,
        /// The output's bytes and their durable write alone (s).
        bytes: u64,
        durable: Stat,
    }
    let figs: Vec<Fig> = m
        .ceiling
        .iter()
        .map(|f| {
            Ok(Fig {
                label: f.label,
                format: f.format,
                drain: stat(&f.runs, &|r| r.m_records_per_s * 1e6)?,
                drain_s: stat(&f.runs, &|r| r.drain_s)?,
                wall: stat(&f.runs, &|r| r.wall.as_secs_f64())?,
                whole: stat(&f.runs, &ReaderRun::whole_rate)?,
                cpu: stat(&f.runs, &ReaderRun::cpu_per_million)?,
                rss: stat(&f.runs, &|r| r.max_rss_kib as f64)?,
                read_back: f.read_back.clone(),
                bytes: f.durable.bytes,
                durable: Stat::of(&f.durable.seconds).context("no durable write")?,
            })
        })
        .collect::<Result<_>>()?;
    let fig = |format: &str| {
        figs.iter()
            .find(|f| f.format == format)
            .with_context(|| format!("no {format} ceiling"))
    };
    let tc = fig("trace-cmd")?;
    let runs = m.ceiling.first().map_or(0, |f| f.runs.len());
    let n = m.ceiling_guest.events;
    let mut body = format!(
        "The C guest (`tests/c-guest/`, recording through the C ABI's `MemRecorder` in ring 3) \
         under QEMU microvm on KVM; the reader is `vmtsync record --from-memory --trust-raw-tsc \
         --format trace-cmd|perfetto|ctf` (width-0 placement from KVM's debugfs mapping; the \
         guest names a beacon port, so the reader also traces its kvm_pio exits to check the \
         mapping against its beacons, in a tracefs instance it sets up beside the drain and \
         removes at the end, inside the whole run; beacon mode's placement is not measured \
         here), reading the VMM's \
         memory with `{}` (what `ProcMemory::open` chose on this host). Host TSC {} kHz. The \
         guest's options are on its kernel command line: `ring=R events=N tsc_khz=K hold` for \
         the prefilled rings, `ring=65536 events=N rate=1000000 tsc_khz=K flight hold` for the \
         1 M/s run.\n\n\
         **Ceiling.** The guest prefilled one stop-when-full ring of {} records with {} events \
         (and {} beacons) and held; the reader then drained it into each format {} \
         time(s) (the formats in turn within each pass), the guest's memory unchanged in \
         between. *Drain* is the reader's own figure: records (events and beacons) over the time \
         from the start of the first drain round that delivered records to the end of the last \
         one, their records written. *Whole run* is events over the reader process's wall time \
         from its start to its exit (finding the header by scanning, draining, writing and \
         closing the output; the guest had recorded before). CPU (user + system) and peak RSS \
         are the reader process's own, from `wait4`. A held guest's vCPU cannot halt in ring 3 \
         and spins, and with it on one of this machine's two cores the scheduler kept every \
         reader thread on the other; so the VMM is stopped (SIGSTOP, its memory kept) once the \
         guest has recorded, for these drains and the raw copy below alike. Before each \
         drain, {} MiB are written elsewhere ({}; `{}`), so every drain \
         starts with the rings out of the cache, and the output's filesystem is synced \
         (`sync -f`), so the disk writes that drain's output alone.\n\n\
         | figure (min / median / max) |",
        m.reader_method,
        thousands(m.tsc_khz),
        thousands(m.ceiling_ring),
        thousands(n),
        thousands(m.ceiling_guest.beacons),
        runs,
        thousands(m.evict_mib),
        match m.cache_mib {
            Some(c) if c * EVICT_TIMES_CACHE == m.evict_mib => {
                format!(
                    "{EVICT_TIMES_CACHE} times the {} MiB last-level cache",
                    thousands(c)
                )
            }
            Some(c) => format!(
                "at least {EVICT_MIN_MIB} MiB; the last-level cache is {} MiB",
                thousands(c)
            ),
            None => format!("{EVICT_MIN_MIB} MiB: sysfs names no cache size"),
        },
        m.evict_command,
    );
    for f in &figs {
        let _ = write!(body, " {} |", f.label);
    }
    body.push_str("\n|---|");
    body.push_str(&"---:|".repeat(figs.len()));
    body.push('\n');
    type Cell<'a> = &'a dyn Fn(&Fig) -> String;
    let rows: [(&str, Cell<'_>); 9] = [
        ("drain rate", &|f| f.drain.show(rate)),
        ("drain time (s)", &|f| f.drain_s.show(sig3)),
        ("whole run, start to written output (s)", &|f| {
            f.wall.show(sig3)
        }),
        ("whole-run rate", &|f| f.whole.show(rate)),
        ("output (MiB)", &|f| sig3(f.bytes as f64 / 1048576.0)),
        ("its bytes written and synced alone (s)", &|f| {
            f.durable.show(sig3)
        }),
        ("a whole run that long (median)", &|f| {
            rate(n as f64 / f.durable.median)
        }),
        ("reader CPU per million events (s)", &|f| {
            f.cpu.show(|v| format!("{v:.3}"))
        }),
        ("reader peak RSS (MiB)", &|f| {
            f.rss.show(|v| sig3(v / 1024.0))
        }),
    ];
    for (label, cell) in rows {
        let _ = write!(body, "| {label} |");
        for f in &figs {
            let _ = write!(body, " {} |", cell(f));
        }
        body.push('\n');
    }
    body.push('\n');
    for f in &figs {
        let _ = writeln!(
            body,
            "- {}, the last run's output: {} ({} events).",
            f.label,
            f.read_back.how,
            thousands(f.read_back.events)
        );
    }
    let whole_goal = |f: &Fig| {
        if f.format == "trace-cmd" {
            WHOLE_GOAL
        } else {
            WHOLE_GOAL_OTHER
        }
    };
    let _ = writeln!(
        body,
        "\nThe reader syncs its output before it renames it into place and exits (with a \
         thread that syncs as it writes, every 16 MiB, into trace.dat and CTF from 50 ms after \
         the output's first write on, so the disk works beside the run but not beside its \
         opening drain): a whole run includes the disk's writing of the output. For scale, the rows above: the output's \
         bytes written into a fresh file in its directory and then synced (`fdatasync`), alone \
         (1 MiB writes of one buffer, the filesystem synced before each pass, medians of {} \
         passes after one untimed pass), and the \
         whole-run rate a run that long would have. (Not a strict floor: the reader's syncs \
         overlap its writing, which this one after the other does not.)",
        m.ceiling.first().map_or(0, |f| f.durable.seconds.len()),
    );
    let _ = write!(body, "\nGoals (medians):");
    for f in &figs {
        let _ = write!(
            body,
            " whole run into {} ≥ {}: {} ({});",
            f.label,
            rate(whole_goal(f)),
            rate(f.whole.median),
            verdict(f.whole.median >= whole_goal(f))
        );
    }
    let cpu_met = figs.iter().all(|f| f.cpu.median <= CPU_GOAL);
    let _ = writeln!(
        body,
        " reader CPU ≤ {CPU_GOAL} s per million events in every format: {} ({}).",
        figs.iter()
            .map(|f| format!("{:.3} s {}", f.cpu.median, f.label))
            .collect::<Vec<_>>()
            .join(", "),
        verdict(cpu_met)
    );
    let vsock = 0.3e6;
    let _ = writeln!(
        body,
        "\nThe median drain rate into trace.dat is {} the ~0.3 M events/s vsock ingests \
         (section 8).",
        super::format::ratio(tc.drain.median / vsock),
    );

    // The raw copy.
    let c = &m.copy;
    let cache = m
        .cache_mib
        .map_or("its size unknown to sysfs".to_owned(), |c| {
            format!("{} MiB here", thousands(c))
        });
    let _ = writeln!(
        body,
        "\n**Raw copy.** On the same held guest, `{}` copies every ring's slots ({} MiB) out \
         of the VMM in reads of one chunk size into one reused buffer, with each of \
         `vmtsync::guestmem::ProcMemory`'s read methods (`pread` on `/proc/PID/mem`; \
         `process_vm_readv`), methods and sizes interleaved; medians of {} passes (a record is \
         32 bytes). *In the cache*: the passes run one after another, after one untimed pass, \
         so the rings stay in the last-level cache ({cache}). *From memory*: before each pass \
         {} MiB are written elsewhere, as before each timed drain above, so the copy and the \
         drain both start with the rings out of the cache.\n\n\
         | chunk | in the cache: `pread` / `process_vm_readv` | from memory: `pread` / \
         `process_vm_readv` | records/s equivalent from memory (`pread` / \
         `process_vm_readv`) |\n|---:|---:|---:|---:|",
        c.command,
        thousands(c.copies.first().map_or(0, |l| l.bytes) >> 20),
        c.copies.first().map_or(0, |l| l.seconds.len()),
        thousands(m.evict_mib),
    );
    for chunk in COPY_CHUNKS {
        let p = c.copy("pread", chunk, false)?;
        let v = c.copy("process_vm_readv", chunk, false)?;
        let pc = c.copy("pread", chunk, true)?;
        let vc = c.copy("process_vm_readv", chunk, true)?;
        let _ = writeln!(
            body,
            "| {} KiB{} | {} / {} GB/s | {} / {} GB/s | {} / {} |",
            thousands(chunk >> 10),
            if chunk == ROUND_BYTES {
                " (a drain round)"
            } else {
                ""
            },
            sig3(p.gbps),
            sig3(v.gbps),
            sig3(pc.gbps),
            sig3(vc.gbps),
            rate(pc.records_per_s),
            rate(vc.records_per_s),
        );
    }
    let round_copy = c.copy(&m.reader_method, ROUND_BYTES, true)?;
    let round_cached = c.copy(&m.reader_method, ROUND_BYTES, false)?;
    let share = tc.drain.median / round_copy.records_per_s;
    let _ = writeln!(
        body,
        "\nThe reader drains into trace.dat at {} of a raw copy of the same bytes from memory \
         in a drain round's chunks with its method (`{}`, {}), the like-for-like comparison \
         (both start with the rings out of the cache), and at {} of the same copy in the cache \
         ({}). Goal ≥ ¼ of a raw copy: {}.",
        percent(share),
        m.reader_method,
        rate(round_copy.records_per_s),
        percent(tc.drain.median / round_cached.records_per_s),
        rate(round_cached.records_per_s),
        verdict(share >= DRAIN_SHARE_GOAL),
    );
    let w = &m.write;
    let write_s = Stat::of(&w.seconds).context("no write pass")?.median;
    let records = (m.ceiling_guest.events + m.ceiling_guest.beacons) as f64;
    let write_rate = records / write_s;
    let write_share = write_rate / round_copy.records_per_s;
    let goal_s = records / (DRAIN_SHARE_GOAL * round_copy.records_per_s);
    let _ = writeln!(
        body,
        "\n**The output's write.** The drain writes its output too, so the kernel's copy of \
         the file into the page cache is inside it. Alone (the {} MiB of the ceiling's \
         trace.dat written into a fresh file in its directory, in {} MiB writes of one reused \
         buffer, no sync; median of {} passes after one untimed pass) it takes {:.1} ms: {} in \
         the ceiling's records, {} of the raw copy from memory above. {} The drain into trace.dat runs at \
         {} of that write alone.",
        thousands(w.bytes >> 20),
        WRITE_CHUNK >> 20,
        w.seconds.len(),
        write_s * 1e3,
        rate(write_rate),
        percent(write_share),
        if write_share < DRAIN_SHARE_GOAL {
            "So no reader that writes this file reaches ¼ of a raw copy on this machine: the \
             write alone is below it."
                .to_owned()
        } else {
            format!(
                "¼ of a raw copy is a drain of {:.1} ms, so the reading, checking, placing \
                 and formatting would have to hide behind that write of {:.1} ms, on two cores.",
                goal_s * 1e3,
                write_s * 1e3
            )
        },
        percent(tc.drain.median / write_rate),
    );
    let _ = writeln!(
        body,
        "\n**The floor of a drain.** The same example then does only what no drain can skip, \
         once for each format's output: it copies the rings out of the VMM in a drain round's \
         chunks with the reader's method, checks each slot's commit stamp, and hands each chunk \
         to a second thread that writes its share of as many bytes as the ceiling's last output \
         of that format into a file in its directory, through the reader's own writer \
         (`BackgroundFile` on that thread, as trace.dat's and CTF's, with its thread that \
         syncs as it writes from 50 ms after the first write on); nothing is placed or \
         encoded. Timed from the first read to the last byte written, after the same writing \
         elsewhere as before each drain; CPU is the example's own (user + system, every \
         thread: `getrusage`), as the reader's is; medians of {} passes, the formats in turn \
         within each pass.\n\n| | trace.dat | Perfetto | CTF |\n|---|---:|---:|---:|",
        c.floors.first().map_or(0, |f| f.seconds.len()),
    );
    let floors = figs
        .iter()
        .map(|g| {
            // Every slot's stamp held: `CopyRun::parse` refuses any other floor.
            let f = c.floor(g.bytes)?;
            let s = Stat::of(&f.seconds).context("no floor pass")?.median;
            let cpu = Stat::of(&f.cpu_seconds).context("no floor pass")?.median / n as f64 * 1e6;
            Ok((g, f, s, cpu))
        })
        .collect::<Result<Vec<_>>>()?;
    // A format's figures, its floor, the floor's median time and CPU per million events.
    type FloorRow<'a> = (&'a Fig, &'a FloorLine, f64, f64);
    type FloorCell<'a> = &'a dyn Fn(&FloorRow<'_>) -> String;
    let rows: [(&str, FloorCell<'_>); 5] = [
        ("floor: time (rate)", &|r| {
            format!("{:.1} ms ({})", r.2 * 1e3, rate(r.1.records_per_s))
        }),
        ("floor vs the raw copy from memory", &|r| {
            percent(r.1.records_per_s / round_copy.records_per_s)
        }),
        ("floor: CPU per million events", &|r| {
            format!("{:.3} s", r.3)
        }),
        ("the reader's drain vs the floor", &|r| {
            percent(r.0.drain.median / r.1.records_per_s)
        }),
        (
            "the reader's CPU per million events beyond the floor's",
            &|r| format!("{:.3} s", r.0.cpu.median - r.3),
        ),
    ];
    for (name, cell) in rows {
        let _ = writeln!(
            body,
            "| {name} | {} |",
            floors.iter().map(cell).collect::<Vec<_>>().join(" | ")
        );
    }
    let trace_floor = floors
        .iter()
        .find(|r| r.0.format == "trace-cmd")
        .context("no trace.dat floor")?;
    let floor_share = trace_floor.1.records_per_s / round_copy.records_per_s;
    // A floor the reader itself beat (a faster drain, or less CPU) was slowed by something
    // else in that pass: it bounds nothing, so no verdict rests on it.
    let beaten = |r: &FloorRow<'_>| r.0.drain.median > r.1.records_per_s || r.0.cpu.median < r.3;
    let over: Vec<&str> = floors
        .iter()
        .filter(|r| r.3 > CPU_GOAL && !beaten(r))
        .map(|r| r.0.label)
        .collect();
    let unbounding: Vec<&str> = floors
        .iter()
        .filter(|r| beaten(r))
        .map(|r| r.0.label)
        .collect();
    let _ = writeln!(
        body,
        "\nThe floor of a drain into trace.dat is {} of the raw copy. {} {}{}",
        percent(floor_share),
        if beaten(trace_floor) {
            "The reader beat that floor in this run, so it is no floor and says nothing of \
             what ¼ of a raw copy needs."
        } else if floor_share < DRAIN_SHARE_GOAL {
            "So on this machine no drain that checks every record and writes this output with \
             this writer reaches ¼ of a raw copy: the floor itself is below it."
        } else {
            "So ¼ of a raw copy is within reach of a drain that writes this output: the \
             placing and encoding are what stand between the floor and the reader."
        },
        if over.is_empty() {
            format!(
                "{} within the goal of {CPU_GOAL} s per million events; what is left of it for \
                 placing and encoding an event: {}.",
                if unbounding.is_empty() {
                    "Every floor's CPU is"
                } else {
                    "The CPU of every floor that bounds is"
                },
                floors
                    .iter()
                    .filter(|r| !beaten(r))
                    .map(|r| format!("{:.1} ns {}", (CPU_GOAL - r.3) * 1e3, r.0.label))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        } else {
            format!(
                "The floor's CPU alone is above the goal of {CPU_GOAL} s per million events for \
                 {}: no reader that writes that output through this writer can meet it.",
                over.join(", ")
            )
        },
        if unbounding.is_empty() {
            String::new()
        } else {
            format!(
                " The reader drained faster or used less CPU than the floor of {}: those \
                 floors were slowed by something else in their passes and bound nothing.",
                unbounding.join(", ")
            )
        },
    );

    // The drain without a writer, the round costs and the many-vCPU estimate.
    let _ = writeln!(
        body,
        "\n**Rounds and many vCPUs.** The same example drains the ring with \
         `vmtsync::guestmem::Drainer::poll` alone (records counted, nothing written; default \
         round bound), then times 2,000 rounds of a drainer bounded to one record per round (a \
         round with news: the recorder header, the ring's counters, `head` a byte at a time \
         before the copy, the copy, `head` and the stop-when-full ring's `tail` a byte at a \
         time after it, the header again: some 28 reads) and 2,000 polls of the drained \
         drainer (a round with nothing new: the recorder header and one 32-byte read of the \
         ring's counters). \
         Per ring and round, medians of {} passes:\n\n\
         | method | drain, no writer | per record | round with one record | idle poll | `head` \
         read a byte at a time: 8 reads / one `read_many` |\n\
         |---|---:|---:|---:|---:|---:|",
        c.polls.first().map_or(0, |p| p.drain_seconds.len()),
    );
    for p in &c.polls {
        let d = Stat::of(&p.drain_seconds).context("no drain pass")?;
        let _ = writeln!(
            body,
            "| `{}` | {} | {} | {} | {} | {} / {} |",
            p.method,
            rate(p.records as f64 / d.median),
            time_ns(p.ns_per_record),
            time_ns(p.busy_round_ns),
            time_ns(p.idle_poll_ns),
            time_ns(p.head_bytewise_ns),
            time_ns(p.head_batched_ns),
        );
    }
    let poll = c.poll(&m.reader_method)?;
    let _ = writeln!(
        body,
        "\nA round with news is mostly one-byte reads (each word read a byte at a time, so a \
         torn read errs on the safe side). With `{}`, a word's 8 one-byte reads take {}; one \
         `GuestMemory::read_many` of the same 8 parts, in the same order, {} ({}).",
        m.reader_method,
        time_ns(poll.head_bytewise_ns),
        time_ns(poll.head_batched_ns),
        super::format::ratio(poll.head_bytewise_ns / poll.head_batched_ns),
    );
    // Every round also reads KVM's mapping of each vCPU (after its reads).
    let _ = writeln!(
        body,
        "\nAfter each round, the reader reads KVM's mapping of every vCPU from debugfs \
         (`VcpuDir::read_mapping`: its `tsc-offset`, `guest_mode` and, where KVM scales TSCs, \
         its scaling ratio, each file opened by name from the vCPU's directory held open): \
         {} per vCPU (`mem-kvm`, median of {} passes of 2,000 reads of vCPU 0). It is part of \
         every round's cost per ring below.",
        time_ns(c.kvm_read_ns),
        c.polls.first().map_or(0, |p| p.drain_seconds.len()),
    );
    let kvm_read_ns = c.kvm_read_ns;
    let round_s = (poll.busy_round_ns + kvm_read_ns) * 1e-9;
    let idle_s = (poll.idle_poll_ns + kvm_read_ns) * 1e-9;
    let v = MANY_VCPUS as f64;
    let idle_share = v * idle_s / (POLL_S + v * idle_s);
    let _ = write!(
        body,
        "\nThis machine runs a few vCPUs (the several-vCPU run below); {MANY_VCPUS} vCPUs are worked out from these per-ring \
         figures (`{}`). The reader polls every ring each round and waits {} ms \
         (`--poll-ms`'s default) after a round that found less than a round's bound, so a round \
         lasts T = ({} ms + V × r) / (1 − V × R × e) for V rings of R events/s each, r the \
         round cost with news above plus KVM's mapping read ({} per ring) and e the whole \
         reader's CPU per event (the ceiling's \
         medians: placement and writing included), and the reader works V × r / T + V × R × e \
         of a core. Idle ({MANY_VCPUS} rings with nothing new, polled every {} ms): {} of a \
         core.\n\n\
         | {MANY_VCPUS} vCPUs × events/s each |",
        m.reader_method,
        POLL_S * 1e3,
        POLL_S * 1e3,
        time_ns(round_s * 1e9),
        POLL_S * 1e3,
        percent(idle_share),
    );
    for f in &figs {
        let _ = write!(body, " {} |", f.label);
    }
    body.push_str("\n|---:|");
    body.push_str(&"---:|".repeat(figs.len()));
    body.push('\n');
    let mut share_1m = None;
    for r in PER_VCPU_RATES {
        let _ = write!(body, "| {} ({} in all) |", rate(r), rate(r * v));
        for f in &figs {
            let s = core_share(v, r, round_s, f.cpu.median / 1e6, POLL_S);
            if r >= 1e6 && f.format == "trace-cmd" {
                share_1m = Some(s);
            }
            let _ = write!(
                body,
                " {} |",
                s.map_or_else(|| "more than a core: falls behind".to_owned(), percent)
            );
        }
        body.push('\n');
    }

    // Resident memory.
    let (small, large) = match m.rss.as_slice() {
        [a, b] => (a, b),
        _ => bail!("expected two RSS runs"),
    };
    let growth = large.run.max_rss_kib as f64 / small.run.max_rss_kib.max(1) as f64;
    let _ = writeln!(
        body,
        "\n**Resident memory.** A guest per size prefilled a stop-when-full ring and held; the \
         reader drained it into trace.dat once (the event count is the reader's own; the \
         ceiling's trace.dat check above covers the format).\n\n\
         | events | ring (records) | reader peak RSS | whole run | reader CPU per million events |\n\
         |---:|---:|---:|---:|---:|"
    );
    for r in [small, large] {
        let _ = writeln!(
            body,
            "| {} | {} | {} MiB | {} s ({}) | {:.3} s |",
            thousands(r.events),
            thousands(r.ring),
            sig3(r.run.max_rss_kib as f64 / 1024.0),
            sig3(r.run.wall.as_secs_f64()),
            rate(r.run.whole_rate()),
            r.run.cpu_per_million(),
        );
    }
    let _ = writeln!(
        body,
        "\nPeak RSS at {} events is {} that at {}. Goal within 10 %: {}.",
        thousands(large.events),
        super::format::ratio(growth),
        thousands(small.events),
        verdict(growth <= RSS_GROWTH_GOAL),
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
    let rate_met =
        lost == 0 && m.rate_guest.refused == 0 && achieved >= 0.99 * PRODUCED_RATE as f64;
    let _ = writeln!(
        body,
        "\n**1 M events/s.** The guest recorded {} events paced by its TSC at {} (`rate={} \
         tsc_khz={} flight`) into a flight-recorder ring of {} records (a reader that only \
         reads cannot free a stop-when-full ring's slots: it would refuse everything after its \
         first {} records) while the reader drained it into trace.dat; the reader started \
         before the guest published its header (the guest's vCPU busy-waits on the TSC between \
         events, so it keeps one host core busy throughout). Achieved: {} (sequence numbers \
         {}..{} between the first and the last event's stamps in the trace, {} ticks apart). \
         The reader: {} overwritten, {} refused (the guest counted {} refused), {} corrupt; {} \
         events written (trace-cmd shows {}); drain {} s at {} M records/s. Reader CPU (user + \
         system): {} s in all, {:.3} s per million events (the whole-run wall time {} s); peak \
         RSS {} MiB.\n\nGoal: 0 lost at 1 M events/s with a 64 Ki ring: {}.",
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
        sig3(r.max_rss_kib as f64 / 1024.0),
        verdict(rate_met),
    );

    let smp_rows = smp_text(m, &mut body);

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

    let mut summary = Vec::new();
    for f in &figs {
        summary.push([
            format!(
                "memory reader whole run into {} (prefilled ring, its VMM stopped)",
                f.label
            ),
            format!("≥ {}", rate(whole_goal(f))),
            format!(
                "{} whole run (median); drain {}; its output's bytes written and synced alone: \
                 as long as a whole run at {}",
                rate(f.whole.median),
                rate(f.drain.median),
                rate(n as f64 / f.durable.median)
            ),
            verdict(f.whole.median >= whole_goal(f)),
        ]);
    }
    let round_pread = c.copy("pread", ROUND_BYTES, false)?;
    let round_vm = c.copy("process_vm_readv", ROUND_BYTES, false)?;
    summary.extend([
        [
            "memory reader drain vs a raw copy of the same bytes".into(),
            "≥ ¼".into(),
            format!(
                "{} ({} drain into trace.dat, {} copy from memory in 512 KiB chunks, `{}`; {} \
                 of the copy in the cache); the floor of a drain that writes this output, with \
                 nothing placed or formatted: {} of the copy",
                percent(share),
                rate(tc.drain.median),
                rate(round_copy.records_per_s),
                m.reader_method,
                percent(tc.drain.median / round_cached.records_per_s),
                percent(c.floor(tc.bytes)?.records_per_s / round_copy.records_per_s),
            ),
            verdict(share >= DRAIN_SHARE_GOAL),
        ],
        [
            "memory reader raw copy, `process_vm_readv` vs `pread`, 512 KiB chunks, in the cache"
                .into(),
            "reported".into(),
            format!(
                "{} GB/s vs {} GB/s ({})",
                sig3(round_vm.gbps),
                sig3(round_pread.gbps),
                super::format::ratio(round_vm.gbps / round_pread.gbps)
            ),
            "—".into(),
        ],
        [
            "memory reader host CPU per million events".into(),
            format!("≤ {CPU_GOAL} s"),
            format!(
                "{} (ceiling medians); {cpu2:.3} s (1 M/s); the floors' (copy, check and write \
                 alone): {}",
                figs.iter()
                    .map(|f| format!("{:.3} s {}", f.cpu.median, f.label))
                    .collect::<Vec<_>>()
                    .join(", "),
                floors
                    .iter()
                    .map(|r| format!("{:.3} s {}", r.3, r.0.label))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            verdict(cpu_met),
        ],
        [
            format!(
                "memory reader peak RSS, {} vs {} events",
                thousands(large.events),
                thousands(small.events)
            ),
            "within 10 %".into(),
            format!(
                "{} MiB vs {} MiB ({})",
                sig3(large.run.max_rss_kib as f64 / 1024.0),
                sig3(small.run.max_rss_kib as f64 / 1024.0),
                super::format::ratio(growth)
            ),
            verdict(growth <= RSS_GROWTH_GOAL),
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
            verdict(rate_met),
        ],
    ]);
    summary.extend(smp_rows);
    summary.extend([
        [
            format!(
                "memory reader at {MANY_VCPUS} vCPUs × 1 M events/s into trace.dat (worked out)"
            ),
            "reported".into(),
            format!(
                "{}; idle round {} per ring (poll {} + KVM's mapping {})",
                share_1m.flatten().map_or_else(
                    || "more than one core (falls behind)".to_owned(),
                    |v| format!("{} of a core", percent(v))
                ),
                time_ns(poll.idle_poll_ns + kvm_read_ns),
                time_ns(poll.idle_poll_ns),
                time_ns(kvm_read_ns)
            ),
            "—".into(),
        ],
        [
            format!("memory reader header scan, {} GiB guest", SCAN_MIB / 1024),
            "reported".into(),
            format!("{:.1} ms (median)", find.median),
            "—".into(),
        ],
    ]);
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
            Usage {
                cpu: Duration::from_millis(500),
                max_rss_kib: 2048,
            },
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
        assert!(ReaderRun::parse(Duration::ZERO, Usage::default(), "nothing".into()).is_err());
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

    #[test]
    fn the_vcpu_lines_parse() {
        let com1 = "c-guest vcpu 0: events 7 refused 1 beacons 3 tsc0 0x10 tsc1 0x20 failed 0\n\
                    c-guest vcpu 1: events 8 refused 0 beacons 3 tsc0 0x11 tsc1 0x21 failed 2 \
                    first error -100\n\
                    c-guest: recorder at 0x1000000 magic 0x1 nonce 0x2 events 15 refused 1 \
                    beacons 6 tsc0 0x10 tsc1 0x21 failed 2 first error -100 vcpus 2\n";
        let l = VcpuLine::all(com1);
        assert_eq!(
            l,
            [
                VcpuLine {
                    vcpu: 0,
                    events: 7,
                    refused: 1,
                    failed: 0,
                    tsc0: 0x10,
                    tsc1: 0x20
                },
                VcpuLine {
                    vcpu: 1,
                    events: 8,
                    refused: 0,
                    failed: 2,
                    tsc0: 0x11,
                    tsc1: 0x21
                }
            ]
        );
        let g = GuestLine::parse(com1.lines().last().expect("a line")).expect("parses");
        assert_eq!((g.events, g.failed), (15, 2));
    }

    #[test]
    fn the_copy_example_lines_parse() {
        let out = "mem-open: method=process_vm_readv\n\
            mem-copy: method=pread chunk=524288 bytes=134217728 seconds=0.050000,0.040000 \
            gbps=2.982 records_per_s=93206755\n\
            mem-copy: method=process_vm_readv chunk=524288 bytes=134217728 \
            seconds=0.020000,0.020000 gbps=6.711 records_per_s=209715200\n\
            mem-copy-cold: method=pread chunk=524288 bytes=134217728 seconds=0.070000,0.060000 \
            gbps=2.1 records_per_s=65000000\n\
            mem-poll: method=process_vm_readv rings=1 records=4194304 \
            drain_seconds=0.100000,0.110000 ns_per_record=25.03 busy_round_ns=9000 \
            idle_poll_ns=1200 head_bytewise_ns=5000 head_batched_ns=700\n\
            mem-kvm: reads=2000 read_ns=4400\n\
            mem-floor: method=process_vm_readv chunk=524288 bytes=118370890 records=4194304 \
            checked=4194304 seconds=0.056930,0.068646 cpu_seconds=0.09,0.1 \
            records_per_s=73674797\n";
        let c = CopyRun::parse(out, "cmd".into()).expect("parses");
        assert_eq!(c.kvm_read_ns, 4400.0);
        let floor = c.floor(118_370_890).expect("the floor line");
        assert_eq!(
            (floor.seconds.as_slice(), floor.cpu_seconds.as_slice()),
            (&[0.056_93, 0.068_646][..], &[0.09, 0.1][..])
        );
        assert_eq!(floor.records_per_s, 73_674_797.0);
        assert!(c.floor(1).is_err());
        // A floor that found a slot uncommitted in a held, full ring is not a floor.
        let torn = out.replace("checked=4194304", "checked=4194303");
        assert!(CopyRun::parse(&torn, "cmd".into()).is_err());
        let p = c.copy("pread", 524_288, false).expect("pread line");
        assert_eq!(
            (p.bytes, p.seconds.as_slice()),
            (134_217_728, &[0.05, 0.04][..])
        );
        let cold = c
            .copy("pread", 524_288, true)
            .expect("pread line from memory");
        assert_eq!(cold.seconds.as_slice(), &[0.07, 0.06][..]);
        assert!(c.copy("pread", 4096, false).is_err());
        assert!(c.copy("process_vm_readv", 524_288, true).is_err());
        let poll = c.poll("process_vm_readv").expect("poll line");
        assert_eq!(
            (
                poll.rings,
                poll.records,
                poll.busy_round_ns,
                poll.idle_poll_ns
            ),
            (1, 4_194_304, 9000.0, 1200.0)
        );
        assert!(c.poll("pread").is_err());
        assert!(CopyRun::parse("mem-open: method=pread\n", String::new()).is_err());
        assert_eq!(
            counted_events(
                "        9989 Event messages\n        4190112 Event messages\n              1 \
                 Stream beginning message\n        4196642 messages (TOTAL)\n"
            ),
            Some(4_190_112)
        );
        assert_eq!(counted_events("1 Stream end message"), None);
    }

    #[test]
    fn the_core_share_adds_rounds_and_events() {
        // No events: the round's cost over the round plus the wait.
        let s = core_share(64.0, 0.0, 1e-6, 1e-7, 0.002).expect("keeps up");
        assert!((s - 64e-6 / (0.002 + 64e-6)).abs() < 1e-12, "{s}");
        // Events only (free rounds): the event load itself.
        let s = core_share(64.0, 1e5, 0.0, 1e-7, 0.002).expect("keeps up");
        assert!((s - 0.64).abs() < 1e-12, "{s}");
        // Both: more than either alone, less than one core.
        let s = core_share(64.0, 1e5, 1e-6, 1e-7, 0.002).expect("keeps up");
        assert!(s > 0.64 && s < 1.0, "{s}");
        // 64 × 1 M/s at 0.1 µs per event is 6.4 cores.
        assert_eq!(core_share(64.0, 1e6, 1e-6, 1e-7, 0.002), None);
    }

    /// A reader run with the figures the section reads.
    fn run(events: u64, wall_s: f64, cpu_s: f64, rss_kib: u64) -> ReaderRun {
        ReaderRun {
            wall: Duration::from_secs_f64(wall_s),
            cpu: Duration::from_secs_f64(cpu_s),
            max_rss_kib: rss_kib,
            drain_s: wall_s / 2.0,
            m_records_per_s: events as f64 / (wall_s / 2.0) / 1e6,
            recorded: events,
            overwritten: 0,
            refused: 0,
            corrupt: 0,
            reread_ms: Some(3.0),
        }
    }

    /// The test ceiling's output size of `format`.
    fn test_bytes(format: &str) -> u64 {
        match format {
            "trace-cmd" => 118_370_890,
            "perfetto" => 310_077_594,
            _ => 146_799_741,
        }
    }

    #[test]
    fn the_section_renders_every_goal_with_a_verdict() {
        let guest = GuestLine::parse(
            "c-guest: recorder at 0x1000000 magic 0x1 nonce 0x93a2 events 4190112 refused 0 \
             beacons 4192 tsc0 0x10 tsc1 0x20000000 failed 0",
        )
        .expect("parses");
        let n = 4_190_112;
        let ceiling = FORMATS
            .iter()
            .map(|(format, label)| FormatRuns {
                format,
                label,
                // Perfetto's reader takes more CPU than its floor (0.22 s), as a floor's must be.
                runs: if *format == "perfetto" {
                    vec![run(n, 0.2, 0.3, 40_000), run(n, 0.25, 0.32, 41_000)]
                } else {
                    vec![run(n, 0.2, 0.1, 40_000), run(n, 0.25, 0.12, 41_000)]
                },
                read_back: ReadBack {
                    events: n,
                    how: "reader".into(),
                },
                durable: WriteFloor {
                    bytes: test_bytes(format),
                    seconds: vec![0.30, 0.32, 0.31],
                },
            })
            .collect();
        let out = "mem-open: method=process_vm_readv\n".to_owned()
            + &COPY_CHUNKS
                .iter()
                .flat_map(|c| {
                    ["pread", "process_vm_readv"].map(|m| {
                        format!(
                            "mem-copy: method={m} chunk={c} bytes=134217728 seconds=0.02 \
                             gbps=6.7 records_per_s=209715200\n\
                             mem-copy-cold: method={m} chunk={c} bytes=134217728 seconds=0.03 \
                             gbps=5.1 records_per_s=160000000\n"
                        )
                    })
                })
                .collect::<String>()
            + "mem-poll: method=process_vm_readv rings=1 records=4194304 drain_seconds=0.1 \
               ns_per_record=25 busy_round_ns=9000 idle_poll_ns=1200 head_bytewise_ns=5000 \
               head_batched_ns=700\nmem-kvm: reads=2000 read_ns=4400\n\
               mem-floor: method=process_vm_readv chunk=524288 bytes=118370890 records=4194304 \
               checked=4194304 seconds=0.05,0.06,0.055 cpu_seconds=0.09,0.08,0.1 \
               records_per_s=76260072\n\
               mem-floor: method=process_vm_readv chunk=524288 bytes=310077594 records=4194304 \
               checked=4194304 seconds=0.08,0.09,0.085 cpu_seconds=0.2,0.22,0.24 \
               records_per_s=49344753\n\
               mem-floor: method=process_vm_readv chunk=524288 bytes=146799741 records=4194304 \
               checked=4194304 seconds=0.06,0.06,0.06 cpu_seconds=0.1,0.1,0.1 \
               records_per_s=69905067\n";
        let report = Report {
            events: 5_000_000,
            first_seq: 0,
            last_seq: 4_999_999,
            first: 0,
            last: 10_499_997,
        };
        // 5 M events at 1 M/s, 2.1 G ticks each second.
        let smp_report = Report {
            last: 10_499_997_900,
            ..report
        };
        let m = Measured {
            tsc_khz: 2_100_000,
            ceiling_ring: 1 << 22,
            ceiling_guest: guest.clone(),
            ceiling,
            reader_method: "process_vm_readv".into(),
            cache_mib: Some(300),
            evict_mib: 1200,
            evict_command: "mem_copy --evict 1200".into(),
            copy: CopyRun::parse(&out, "mem_copy QEMU_PID 5 …".into()).expect("parses"),
            write: WriteFloor {
                bytes: 151_888_458,
                seconds: vec![0.022, 0.024, 0.023],
            },
            rss: vec![
                RssRun {
                    ring: 1 << 20,
                    events: 1_000_000,
                    run: run(1_000_000, 0.05, 0.04, 40_000),
                },
                RssRun {
                    ring: 1 << 24,
                    events: 10_000_000,
                    run: run(10_000_000, 0.5, 0.4, 43_000),
                },
            ],
            rate_guest: GuestLine {
                events: 5_000_000,
                ..guest.clone()
            },
            rate_run: run(5_000_000, 5.5, 0.7, 30_000),
            rate_report: report,
            smp: vec![SmpRun {
                vcpus: 2,
                guest: GuestLine {
                    events: 10_000_000,
                    ..guest.clone()
                },
                lines: VcpuLine::all(
                    "c-guest vcpu 0: events 5000000 refused 0 beacons 5002 tsc0 0x0 tsc1 \
                     0xa037a0 failed 0\n\
                     c-guest vcpu 1: events 5000000 refused 0 beacons 5002 tsc0 0x0 tsc1 \
                     0xa037a0 failed 0\n",
                ),
                run: run(10_000_000, 5.5, 1.4, 30_000),
                reports: [(0, smp_report), (1, smp_report)].into(),
            }],
            smp_note: None,
            scan_guest: guest,
            scan: ScanLine {
                nonce: 0x93a2,
                find_ms: vec![9.0],
                bytes_mapped: 1 << 32,
                bytes_read: 1 << 20,
                pages_skipped: 1000,
                pagemap: true,
            },
            scan_command: "mem_scan QEMU_PID 5".into(),
        };
        let s = memory_section(&m).expect("renders");
        let verdicts: Vec<&str> = s.summary.iter().map(|r| r[3].as_str()).collect();
        // Whole runs of ~18.6 M/s: under 20 M/s for trace.dat, over 15 M/s for the others;
        // the drain's median, 37.7 M records/s, is 24 % of a 160 M records/s copy from
        // memory (18 % of the 210 M records/s one in the cache);
        // 0.026 s of CPU per million events (Perfetto's 0.074 s); 43,000 KiB over 40,000 KiB
        // is 1.075.
        assert_eq!(
            verdicts,
            [
                "**not met**",
                "met",
                "met",
                "**not met**",
                "—",
                "**not met**",
                "met",
                "met",
                "met",
                "—",
                "—"
            ],
            "{:#?}",
            s.summary
        );
        assert!(
            s.summary[3][2].starts_with("23.6 % ") && s.summary[3][2].contains("18.0 % of"),
            "the goal is judged against the copy from memory: {:#?}",
            s.summary
        );
        // 4,190,112 events over the output's synced write alone, 0.31 s (median).
        assert!(
            s.summary[0][2].ends_with("as long as a whole run at 13.5 M/s")
                && s.body
                    .contains("| a whole run that long (median) | 13.5 M/s |"),
            "{:#?}",
            s.summary
        );
        assert!(
            s.summary[8][0].contains("2 vCPUs × 1 M events/s"),
            "{:#?}",
            s.summary
        );
        assert!(
            s.body
                .contains("| 2 | 1 | 1.00 M/s | 5,000,000 | 5,000,000 | 0 |"),
            "{}",
            s.body
        );
        assert!(s.body.contains("| 512 KiB (a drain round) |"), "{}", s.body);
        // The body's line that starts with `prefix`.
        let line = |prefix: &str| {
            s.body
                .lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("no line {prefix}: {}", s.body))
                .to_owned()
        };
        let table = |row: &str| line(&format!("| {row} |"));
        // The floors: 76.3, 49.3 and 69.9 M/s over the 160 M records/s copy from memory; CPU
        // 0.09, 0.22 and 0.1 s (medians) over 4,190,112 events.
        assert_eq!(
            table("floor vs the raw copy from memory"),
            "| floor vs the raw copy from memory | 47.7 % | 30.8 % | 43.7 % |"
        );
        assert_eq!(
            table("floor: CPU per million events"),
            "| floor: CPU per million events | 0.021 s | 0.053 s | 0.024 s |"
        );
        assert_eq!(
            table("floor: time (rate)"),
            "| floor: time (rate) | 55.0 ms (76.3 M/s) | 85.0 ms (49.3 M/s) | 60.0 ms (69.9 M/s) |"
        );
        let verdicts = line("The floor of a drain into trace.dat is ");
        assert!(
            verdicts.starts_with("The floor of a drain into trace.dat is 47.7 % of the raw copy.")
                && verdicts.contains("within reach")
                && verdicts.ends_with(
                    "above the goal of 0.05 s per million events for \
                     Perfetto: no reader that writes that output through this writer can meet it."
                ),
            "{verdicts}"
        );
        assert!(
            s.summary[3][2].ends_with("nothing placed or formatted: 47.7 % of the copy")
                && s.summary
                    .iter()
                    .any(|r| r[0] == "memory reader host CPU per million events"
                        && r[2]
                            .ends_with("alone): 0.021 s trace.dat, 0.053 s Perfetto, 0.024 s CTF")),
            "{:#?}",
            s.summary
        );
        let write = line("**The output's write.**");
        assert!(
            write.contains("it takes 23.0 ms: 182 M/s in the ceiling's records, 114 % of the raw")
                && write.contains("a drain of 104.9 ms")
                && write.ends_with("runs at 20.7 % of that write alone."),
            "{write}"
        );
        assert!(
            s.body.contains("| 1.00 M/s (64.0 M/s in all) |"),
            "{}",
            s.body
        );

        // A floor the reader beat bounds nothing: trace.dat's reader at 0.05 s of CPU, under
        // its floor's 0.09 s, and Perfetto's drain at 140 M/s, over its floor's 49.3 M/s.
        let mut beaten = m.clone();
        for f in &mut beaten.ceiling {
            match f.format {
                "trace-cmd" => f.runs = vec![run(n, 0.2, 0.05, 40_000); 2],
                "perfetto" => f.runs = vec![run(n, 0.06, 0.3, 40_000); 2],
                _ => {}
            }
        }
        let s = memory_section(&beaten).expect("renders");
        let verdicts = s
            .body
            .lines()
            .find(|l| l.starts_with("The floor of a drain into trace.dat is "))
            .expect("the verdicts");
        assert!(
            verdicts.contains("The reader beat that floor in this run, so it is no floor")
                && !verdicts.contains("within reach")
                && !verdicts.contains("can meet it")
                && verdicts.contains("left of it for placing and encoding an event: 26.1 ns CTF.")
                && verdicts.ends_with(
                    "than the floor of trace.dat, Perfetto: those floors were slowed by \
                     something else in their passes and bound nothing."
                ),
            "{verdicts}"
        );
    }
}
