//! Reading `validate`'s inputs: the sync file, the guest trace (a trace.dat `vmtsync record`
//! wrote, raw guest TSC), the probe log (`--probe-log`) and the host trace (`trace-cmd
//! extract`, `kvm:kvm_pio` records).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use thiserror::Error;

use super::check::{IoEvent, Numbering, Side, ValidateReport, check};
use super::probes::{ProbeChecker, ports_of, read_probe_log};
use crate::ftrace::format::{EventFormat, FormatError, KVM_PIO, KvmPioLayout};
use crate::probe::anchor::PioExit;
use crate::syncfile::{LineRead, SyncFile, SyncFileError, read_line_bounded};
use crate::tracedat::consts::option;
use crate::tracedat::{TraceDatError, for_each_record, read_event_formats, read_layout};

/// Event id the agent's workload records right before its `out`
/// (`guest-agent/src/events.rs`, `WORKLOAD_EVENT`).
pub const BEFORE_OUT_EVENT: u32 = 0x100;
/// Event id the agent's workload records right after its `in`
/// (`guest-agent/src/events.rs`, `WORKLOAD_AFTER_IN_EVENT`).
pub const AFTER_IN_EVENT: u32 = 0x101;

/// What to check.
#[derive(Clone, Debug)]
pub struct ValidateOptions {
    /// The sync file.
    pub sync: PathBuf,
    /// The host trace.
    pub host_trace: PathBuf,
    /// The guest trace (its workload events are checked), with the workload's port.
    pub guest_trace: Option<(PathBuf, u16)>,
    /// The probe log (its probes are checked).
    pub probe_log: Option<PathBuf>,
    /// vCPU → host thread, when neither the host trace's GUEST option nor a single thread on
    /// the port says it.
    pub threads: BTreeMap<u32, u32>,
    /// How the host's steps are paired with the guest's sequence numbers.
    pub numbering: Numbering,
}

/// Why `validate` could not check.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ValidateError {
    /// The sync file.
    #[error(transparent)]
    SyncFile(#[from] SyncFileError),
    /// A trace file.
    #[error(transparent)]
    TraceDat(#[from] TraceDatError),
    /// The host trace's `kvm_pio` format.
    #[error("{path}: {source}")]
    Format {
        /// The host trace.
        path: PathBuf,
        /// The cause.
        source: FormatError,
    },
    /// The host trace has no `kvm:kvm_pio` format.
    #[error(
        "{0}: no kvm:kvm_pio event in this trace: enable events/kvm/kvm_pio in the traced instance (x86-tsc clock) before `trace-cmd extract`"
    )]
    NoKvmPio(PathBuf),
    /// The guest trace's timestamps are not raw guest TSCs.
    #[error(
        "{0}: its timestamps were pre-converted to host time by `vmtsync record` (the guest's rate is not the host's), so it no longer holds the guest ticks to check: validate a recording at the host's rate"
    )]
    Preconverted(PathBuf),
    /// A guest JSON Lines file (`record --format jsonl`) has a line that is not an event.
    #[error("{path}: line {line}: {why}")]
    GuestLine {
        /// The file.
        path: PathBuf,
        /// The 1-based line.
        line: u64,
        /// What is wrong.
        why: String,
    },
    /// The guest trace could not be read.
    #[error("{path}: {source}")]
    GuestIo {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The guest trace has no workload event next to I/O.
    #[error(
        "{0}: no workload event recorded next to port I/O (ids 0x100/0x101): boot the agent with workload=RATE,COUNT,PORT"
    )]
    NoEvents(PathBuf),
    /// A probe log line is not a probe exchange.
    #[error("{path}: line {line}: {why}")]
    ProbeLine {
        /// The file.
        path: PathBuf,
        /// The 1-based line.
        line: u64,
        /// What is wrong.
        why: String,
    },
    /// The probe log could not be read.
    #[error("{path}: {source}")]
    ProbeLogIo {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Neither a guest trace nor a probe log: nothing to check.
    #[error("nothing to check: give --guest-trace (with --port) or --probe-log, or both")]
    NothingToCheck,
    /// vCPU threads cannot be told apart.
    #[error(
        "cannot tell which host thread runs vCPU {vcpu}: threads {threads} did I/O on port {port:#x}; give --thread {vcpu}=PID (vmtsync kvm shows each vCPU's thread)"
    )]
    Threads {
        /// The vCPU.
        vcpu: u32,
        /// The threads seen.
        threads: String,
        /// The port.
        port: u16,
    },
}

/// Reads the inputs and runs [`check`] on the guest trace's events and the probe log's
/// checks ([`ProbeChecker`]) on its probes.
///
/// # Errors
/// [`ValidateError`].
pub fn validate(opts: &ValidateOptions) -> Result<ValidateReport, ValidateError> {
    if opts.guest_trace.is_none() && opts.probe_log.is_none() {
        return Err(ValidateError::NothingToCheck);
    }
    let sync = SyncFile::read(&opts.sync)?;
    // The ports the probes' exits are on, from a first pass over the log: the host trace's
    // exits are read once, and only theirs are kept.
    let mut ports = vec![false; usize::from(u16::MAX) + 1];
    if let Some((_, port)) = &opts.guest_trace {
        ports[usize::from(*port)] = true;
    }
    if let Some(log) = &opts.probe_log {
        read_probe_log(log, |e| {
            for p in ports_of(e) {
                ports[usize::from(p)] = true;
            }
        })?;
    }
    let (mut exits, guest_option) = host_exits(&opts.host_trace, |p| ports[usize::from(p)])?;
    exits.sort_by_key(|e| e.ts);
    let mut threads = guest_option;
    threads.extend(opts.threads.iter().map(|(&v, &p)| (v, p)));
    let mut report = match &opts.guest_trace {
        Some((guest, port)) => {
            let events = guest_events(guest)?;
            let on_port: Vec<PioExit> = exits
                .iter()
                .filter(|e| e.pio.port == *port)
                .copied()
                .collect();
            let threads = event_threads(&events, &on_port, threads.clone(), *port)?;
            check(&events, &on_port, &sync.segments, &threads, opts.numbering)
        }
        None => check(&[], &[], &sync.segments, &threads, opts.numbering),
    };
    if let Some(log) = &opts.probe_log {
        // With the VM's threads known, another VM's identical I/O is not taken for its own.
        if !threads.is_empty() {
            exits.retain(|e| threads.values().any(|&p| p == e.pio.pid));
        }
        let mut checker = ProbeChecker::new(&exits, &sync.segments);
        let cut = read_probe_log(log, |e| checker.check(e))?;
        let mut probes = checker.finish();
        probes.cut_bytes = cut;
        report.probes = Some(probes);
    }
    Ok(report)
}

/// Each vCPU's host thread for the events: `known` (the GUEST option, `--thread`), else the
/// only thread that did I/O on the port when the events are of one vCPU.
fn event_threads(
    events: &[IoEvent],
    exits: &[PioExit],
    mut known: BTreeMap<u32, u32>,
    port: u16,
) -> Result<BTreeMap<u32, u32>, ValidateError> {
    let vcpus: BTreeSet<u32> = events.iter().map(|e| e.vcpu).collect();
    let pids: BTreeSet<u32> = exits.iter().map(|e| e.pio.pid).collect();
    for &vcpu in &vcpus {
        if known.contains_key(&vcpu) {
            continue;
        }
        // One vCPU and one thread doing I/O on the port: that thread is the vCPU's.
        match (vcpus.len(), pids.iter().next()) {
            (1, Some(&pid)) if pids.len() == 1 => {
                known.insert(vcpu, pid);
            }
            _ => {
                return Err(ValidateError::Threads {
                    vcpu,
                    threads: format!("{pids:?}"),
                    port,
                });
            }
        }
    }
    Ok(known)
}

/// The workload events of a guest recording: `vmtsync record`'s JSON Lines (a file starting
/// with `{`) or its trace.dat (raw guest TSC timestamps).
///
/// # Errors
/// [`ValidateError::Preconverted`], [`ValidateError::NoEvents`],
/// [`ValidateError::GuestLine`], or the file's.
pub fn guest_events(path: &Path) -> Result<Vec<IoEvent>, ValidateError> {
    let io = |source| ValidateError::GuestIo {
        path: path.to_owned(),
        source,
    };
    let mut input = BufReader::new(File::open(path).map_err(io)?);
    let events = if input.fill_buf().map_err(io)?.first() == Some(&b'{') {
        jsonl_events(path, input)?
    } else {
        trace_dat_events(path)?
    };
    if events.is_empty() {
        return Err(ValidateError::NoEvents(path.to_owned()));
    }
    Ok(events)
}

/// The workload events of `record --format jsonl` output (`docs/record.md`), line by line
/// with a bounded line length.
fn jsonl_events(path: &Path, mut input: impl BufRead) -> Result<Vec<IoEvent>, ValidateError> {
    let mut out = Vec::new();
    let mut line = Vec::new();
    let mut n = 0_u64;
    loop {
        line.clear();
        let r =
            read_line_bounded(&mut input, &mut line).map_err(|source| ValidateError::GuestIo {
                path: path.to_owned(),
                source,
            })?;
        n += 1;
        let bad = |why: String| ValidateError::GuestLine {
            path: path.to_owned(),
            line: n,
            why,
        };
        match r {
            LineRead::Eof => break,
            LineRead::TooLong => return Err(bad("too long for an event".into())),
            // A last line without its newline: `record` renames the file only when complete.
            LineRead::Partial { .. } => return Err(bad("cut short (no newline)".into())),
            LineRead::Line => {}
        }
        let v: serde_json::Value = serde_json::from_slice(&line).map_err(|e| bad(e.to_string()))?;
        let num = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
        let side = match num("id").and_then(|id| u32::try_from(id).ok()) {
            Some(BEFORE_OUT_EVENT) => Side::BeforeOut,
            Some(AFTER_IN_EVENT) => Side::AfterIn,
            Some(_) => continue,
            None => return Err(bad("no numeric \"id\"".into())),
        };
        let (Some(vcpu), Some(guest_tsc)) = (num("vcpu"), num("guest_tsc")) else {
            return Err(bad("no numeric \"vcpu\" or \"guest_tsc\"".into()));
        };
        let hex = v
            .get("payload")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("");
        let seq = hex
            .get(..16)
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .map(|be| be.swap_bytes())
            .ok_or_else(|| bad(format!("payload {hex:?} holds no 8-byte sequence number")))?;
        out.push(IoEvent {
            vcpu: u32::try_from(vcpu).map_err(|_| bad(format!("vcpu {vcpu}")))?,
            guest_tsc,
            side,
            seq,
        });
    }
    Ok(out)
}

/// The workload events of a guest trace.dat (raw guest TSC timestamps).
fn trace_dat_events(path: &Path) -> Result<Vec<IoEvent>, ValidateError> {
    let layout = read_layout(path)?;
    // `record` says in the UNAME option when it wrote host times instead of guest ticks.
    if layout
        .options_with(option::UNAME)
        .any(|o| String::from_utf8_lossy(&o.data).contains("pre-converted"))
    {
        return Err(ValidateError::Preconverted(path.to_owned()));
    }
    let mut out = Vec::new();
    for b in 0..layout.buffers.len() {
        crate::tracedat::reader::for_each_event(path, &layout, b, |e| {
            let side = match e.id {
                BEFORE_OUT_EVENT => Side::BeforeOut,
                AFTER_IN_EVENT => Side::AfterIn,
                _ => return,
            };
            let Some(seq) = e.payload.get(..8).filter(|_| e.len >= 8) else {
                return;
            };
            let mut le = [0u8; 8];
            le.copy_from_slice(seq);
            out.push(IoEvent {
                vcpu: e.cpu,
                guest_tsc: e.ts,
                side,
                seq: u64::from_le_bytes(le),
            });
        })?;
    }
    Ok(out)
}

/// The `kvm_pio` exits of the ports `keep` accepts in a host trace.dat (every buffer), and the
/// vCPU → thread map of its GUEST option if it has one (`vmtsync record --host-output` writes
/// it).
///
/// # Errors
/// [`ValidateError::NoKvmPio`], [`ValidateError::Format`], or the file's.
pub fn host_exits(
    path: &Path,
    keep: impl Fn(u16) -> bool,
) -> Result<(Vec<PioExit>, BTreeMap<u32, u32>), ValidateError> {
    let layout = read_layout(path)?;
    let formats = read_event_formats(path, &layout)?;
    let stored = formats
        .iter()
        .find(|f| f.system == "kvm" && f.name == KVM_PIO)
        .ok_or_else(|| ValidateError::NoKvmPio(path.to_owned()))?;
    let format_err = |source| ValidateError::Format {
        path: path.to_owned(),
        source,
    };
    let pio = KvmPioLayout::new(&EventFormat::parse(&stored.format).map_err(format_err)?)
        .map_err(format_err)?;
    let mut exits = Vec::new();
    for b in 0..layout.buffers.len() {
        for_each_record(path, &layout, b, |_cpu, ts, data| {
            if let Some(p) = pio.decode(data).filter(|p| keep(p.port)) {
                exits.push(PioExit { ts, pio: p });
            }
        })?;
    }
    let threads = layout
        .options_with(option::GUEST)
        .find_map(|o| guest_threads(&o.data))
        .unwrap_or_default();
    Ok((exits, threads))
}

/// The vCPU → host thread pairs of a GUEST option: a NUL-terminated name, `u64` trace id,
/// `u32` cpu count, then per CPU `u32` guest cpu, `u32` host pid. `None` when malformed.
fn guest_threads(data: &[u8]) -> Option<BTreeMap<u32, u32>> {
    let nul = data.iter().position(|&b| b == 0)?;
    let rest = data.get(nul + 1 + 8..)?;
    let u32_at = |at: usize| -> Option<u32> {
        Some(u32::from_le_bytes(rest.get(at..at + 4)?.try_into().ok()?))
    };
    let count = usize::try_from(u32_at(0)?).ok()?;
    // A count the option's bytes cannot hold is malformed, not an allocation to make.
    if rest.len() < 4 + count.checked_mul(8)? {
        return None;
    }
    (0..count)
        .map(|i| Some((u32_at(4 + 8 * i)?, u32_at(8 + 8 * i)?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_recordings_give_their_workload_events_and_bad_lines_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.jsonl");
        std::fs::write(
            &p,
            concat!(
                "{\"schema\":1,\"vcpu\":0,\"id\":256,\"guest_tsc\":10,\"host_tsc\":1,\"host_lo\":0,\"host_hi\":2,\"payload\":\"0201000000000000\",\"round\":0}\n",
                "{\"schema\":1,\"vcpu\":0,\"id\":7,\"guest_tsc\":11,\"payload\":\"\"}\n",
                "{\"schema\":1,\"vcpu\":1,\"id\":257,\"guest_tsc\":12,\"payload\":\"0201000000000000\"}\n",
            ),
        )
        .unwrap();
        let ev = guest_events(&p).unwrap();
        assert_eq!(
            ev,
            [
                IoEvent {
                    vcpu: 0,
                    guest_tsc: 10,
                    side: Side::BeforeOut,
                    seq: 0x102
                },
                IoEvent {
                    vcpu: 1,
                    guest_tsc: 12,
                    side: Side::AfterIn,
                    seq: 0x102
                },
            ]
        );
        std::fs::write(
            &p,
            "{\"vcpu\":0,\"id\":256,\"guest_tsc\":1,\"payload\":\"01\"}\n",
        )
        .unwrap();
        assert!(matches!(
            guest_events(&p),
            Err(ValidateError::GuestLine { line: 1, .. })
        ));
        std::fs::write(
            &p,
            "{\"vcpu\":0,\"id\":7,\"guest_tsc\":1,\"payload\":\"\"}\n",
        )
        .unwrap();
        assert!(matches!(guest_events(&p), Err(ValidateError::NoEvents(_))));
        std::fs::write(
            &p,
            format!("{{\"id\":256,\"x\":\"{}\"}}\n", "a".repeat(5000)),
        )
        .unwrap();
        assert!(matches!(
            guest_events(&p),
            Err(ValidateError::GuestLine { line: 1, .. })
        ));
    }

    #[test]
    fn guest_option_threads_parse_and_malformed_ones_are_refused() {
        let mut d = b"guest\0".to_vec();
        d.extend_from_slice(&7u64.to_le_bytes());
        d.extend_from_slice(&2u32.to_le_bytes());
        for (c, p) in [(0u32, 100u32), (1, 101)] {
            d.extend_from_slice(&c.to_le_bytes());
            d.extend_from_slice(&p.to_le_bytes());
        }
        assert_eq!(
            guest_threads(&d),
            Some(BTreeMap::from([(0, 100), (1, 101)]))
        );
        assert_eq!(guest_threads(&d[..d.len() - 1]), None, "cut short");
        let mut huge = b"g\0".to_vec();
        huge.extend_from_slice(&0u64.to_le_bytes());
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(guest_threads(&huge), None, "a count the bytes cannot hold");
        assert_eq!(guest_threads(b"no nul"), None);
    }
}
