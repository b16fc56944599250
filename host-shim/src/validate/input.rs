//! Reading `validate`'s inputs: the sync file, the guest trace (a trace.dat `vmtsync record`
//! wrote, raw guest TSC), the probe log (`--probe-log`) and the host trace (`trace-cmd
//! extract`, `kvm:kvm_pio` records).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use super::check::{EventRule, IoEvent, Numbering, Side, ValidateReport, check_placed};
use super::probes::{ProbeChecker, ports_of, read_probe_log};
use super::report::{LinesEnd, ValidateError, each_line};
use crate::exits::PioExit;
use crate::formats::tracedat::consts::option;
use crate::formats::tracedat::{for_each_record, read_event_formats, read_layout};
use crate::ftrace::format::{EventFormat, KVM_PIO, KvmPioLayout};
use crate::sync::Place;
use crate::syncfile::SyncFile;

/// Event id the agent's workload records right before its `out`
/// (`guest-agent/src/events.rs`, `WORKLOAD_EVENT`).
pub const BEFORE_OUT_EVENT: u16 = 0x100;
/// Event id the agent's workload records right after its `in`
/// (`guest-agent/src/events.rs`, `WORKLOAD_AFTER_IN_EVENT`).
pub const AFTER_IN_EVENT: u16 = 0x101;

/// The bundled agent's workload on `port` (`workload=RATE,COUNT,PORT`) as rules: 0x100 before
/// its `out`, 0x101 after its `in` (`--port PORT` alone).
#[must_use]
pub const fn workload_rules(port: u16) -> [EventRule; 2] {
    [
        EventRule {
            id: BEFORE_OUT_EVENT,
            port,
            side: Side::BeforeOut,
        },
        EventRule {
            id: AFTER_IN_EVENT,
            port,
            side: Side::AfterIn,
        },
    ]
}

/// What to check.
#[derive(Clone, Debug)]
pub struct ValidateOptions {
    /// The sync file; without it, the guest trace must be `record`'s JSON Lines, whose
    /// conversion is checked.
    pub sync: Option<PathBuf>,
    /// The host trace.
    pub host_trace: PathBuf,
    /// The guest trace: its events that `rules` name are checked.
    pub guest_trace: Option<PathBuf>,
    /// Which events are recorded next to which port's I/O ([`workload_rules`] for the
    /// bundled agent).
    pub rules: Vec<EventRule>,
    /// The probe log (its probes are checked).
    pub probe_log: Option<PathBuf>,
    /// vCPU → host thread, when neither the host trace's GUEST option nor a single thread on
    /// the port says it.
    pub threads: BTreeMap<u32, u32>,
    /// How the host's steps are paired with the guest's sequence numbers.
    pub numbering: Numbering,
    /// How events are placed with the sync file (`--placement`; `record`'s default is
    /// two-sided).
    pub placement: crate::sync::Placement,
}

/// Reads the inputs and runs [`check`] on the guest trace's events and the probe log's
/// checks ([`ProbeChecker`]) on its probes.
///
/// # Errors
/// [`ValidateError`].
pub fn validate(opts: &ValidateOptions) -> Result<ValidateReport, ValidateError> {
    if opts.guest_trace.is_none() && opts.probe_log.is_none()
        || opts.guest_trace.is_some() && opts.rules.is_empty()
    {
        return Err(ValidateError::NothingToCheck);
    }
    if opts.probe_log.is_some() && opts.sync.is_none() {
        return Err(ValidateError::ProbesNeedSync);
    }
    let sync = opts.sync.as_deref().map(SyncFile::read).transpose()?;
    let segments = sync.as_ref().map(|s| s.segments.as_slice());
    // The ports the probes' exits are on, from a first pass over the log: the host trace's
    // exits are read once, and only theirs are kept.
    let mut ports = vec![false; usize::from(u16::MAX) + 1];
    if opts.guest_trace.is_some() {
        for r in &opts.rules {
            ports[usize::from(r.port)] = true;
        }
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
        Some(guest) => {
            let events = guest_events(guest, &opts.rules)?;
            if segments.is_none() && events.iter().any(|e| e.recorded.is_none()) {
                return Err(ValidateError::NeedsSync(guest.clone()));
            }
            let mut rule_ports: Vec<u16> = opts.rules.iter().map(|r| r.port).collect();
            rule_ports.sort_unstable();
            rule_ports.dedup();
            let on_ports: Vec<PioExit> = exits
                .iter()
                .filter(|e| rule_ports.contains(&e.pio.port))
                .copied()
                .collect();
            let mut known = threads.clone();
            for &port in &rule_ports {
                let of_port: Vec<IoEvent> =
                    events.iter().filter(|e| e.port == port).copied().collect();
                let exits_of_port: Vec<PioExit> = on_ports
                    .iter()
                    .filter(|e| e.pio.port == port)
                    .copied()
                    .collect();
                known = event_threads(&of_port, &exits_of_port, known, port)?;
            }
            check_placed(
                &events,
                &on_ports,
                segments,
                &known,
                opts.numbering,
                &opts.rules,
                opts.placement,
            )
        }
        None => check_placed(
            &[],
            &[],
            segments,
            &threads,
            opts.numbering,
            &opts.rules,
            opts.placement,
        ),
    };
    if let Some(log) = &opts.probe_log {
        // With the VM's threads known, another VM's identical I/O is not taken for its own.
        if !threads.is_empty() {
            exits.retain(|e| threads.values().any(|&p| p == e.pio.pid));
        }
        let mut checker = ProbeChecker::new(&exits, segments.unwrap_or_default());
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

/// The events `rules` name in a guest recording: `vmtsync record`'s JSON Lines (a file
/// starting with `{`, each event with `record`'s conversion) or its trace.dat (raw guest TSC
/// timestamps). An event gets one [`IoEvent`] per rule naming its id. Its step number is its
/// payload's first bytes (up to 8, little-endian: the workload's sequence number); events
/// without a payload are numbered in order, per vCPU and id from 0, which is right only for
/// a recording that lost nothing from the guest's first such event on.
///
/// # Errors
/// [`ValidateError::Preconverted`], [`ValidateError::NoEvents`],
/// [`ValidateError::GuestLine`], or the file's.
pub fn guest_events(path: &Path, rules: &[EventRule]) -> Result<Vec<IoEvent>, ValidateError> {
    let io = |source| ValidateError::GuestIo {
        path: path.to_owned(),
        source,
    };
    let mut input = BufReader::new(File::open(path).map_err(io)?);
    let mut raw = if input.fill_buf().map_err(io)?.first() == Some(&b'{') {
        jsonl_events(path, input, rules)?
    } else {
        trace_dat_events(path, rules)?
    };
    if raw.is_empty() {
        let ids: BTreeSet<String> = rules.iter().map(|r| format!("{:#x}", r.id)).collect();
        return Err(ValidateError::NoEvents {
            path: path.to_owned(),
            ids: ids.into_iter().collect::<Vec<_>>().join("/"),
        });
    }
    // Payload-less events take their number from their order among their vCPU's events of
    // their id, in guest time.
    raw.sort_by_key(|e| (e.vcpu, e.id, e.guest_tsc));
    let mut out = Vec::with_capacity(raw.len());
    let mut ordinal = 0_u64;
    let mut last = None;
    for e in &raw {
        if last != Some((e.vcpu, e.id)) {
            ordinal = 0;
            last = Some((e.vcpu, e.id));
        }
        let seq = e.seq.unwrap_or(ordinal);
        ordinal += 1;
        for r in rules.iter().filter(|r| r.id == e.id) {
            out.push(IoEvent {
                vcpu: e.vcpu,
                guest_tsc: e.guest_tsc,
                side: r.side,
                port: r.port,
                seq,
                recorded: e.recorded,
            });
        }
    }
    Ok(out)
}

/// An event of a guest recording before rules give it a side and a number.
struct RawEvent {
    vcpu: u32,
    id: u16,
    guest_tsc: u64,
    /// From the payload, when it has one.
    seq: Option<u64>,
    recorded: Option<Place>,
}

/// The step number a payload carries: its first bytes, up to 8, little-endian.
fn seq_of(payload: &[u8]) -> Option<u64> {
    let n = payload.len().min(8);
    let mut le = [0u8; 8];
    le.get_mut(..n)?.copy_from_slice(payload.get(..n)?);
    (n > 0).then_some(u64::from_le_bytes(le))
}

/// The workload events of `record --format jsonl` output (`docs/record.md`), line by line
/// with a bounded line length.
fn jsonl_events(
    path: &Path,
    mut input: impl BufRead,
    rules: &[EventRule],
) -> Result<Vec<RawEvent>, ValidateError> {
    let mut out = Vec::new();
    let bad = |line: u64, why: String| ValidateError::GuestLine {
        path: path.to_owned(),
        line,
        why,
    };
    let io = |source| ValidateError::GuestIo {
        path: path.to_owned(),
        source,
    };
    let (end, n) = each_line(&mut input, io, |n, line| {
        let bad = |why: String| bad(n, why);
        let v: serde_json::Value = serde_json::from_slice(line).map_err(|e| bad(e.to_string()))?;
        let num = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
        let id = match num("id").map(u16::try_from) {
            Some(Ok(id)) if rules.iter().any(|r| r.id == id) => id,
            Some(_) => return Ok(()),
            None => return Err(bad("no numeric \"id\"".into())),
        };
        let (Some(vcpu), Some(guest_tsc)) = (num("vcpu"), num("guest_tsc")) else {
            return Err(bad("no numeric \"vcpu\" or \"guest_tsc\"".into()));
        };
        let hex = v
            .get("payload")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("");
        let payload =
            hex::decode(hex).map_err(|e| bad(format!("payload {hex:?} is not hex bytes: {e}")))?;
        // `record` writes its conversion on every line; all four or none.
        let recorded = match (
            num("host_tsc"),
            num("host_lo"),
            num("host_hi"),
            num("round"),
        ) {
            (Some(host), Some(lo), Some(hi), Some(round)) => Some(Place {
                host,
                lo,
                hi,
                round,
            }),
            (None, None, None, None) => None,
            _ => {
                return Err(bad(
                    "some of \"host_tsc\", \"host_lo\", \"host_hi\", \"round\" but not all".into(),
                ));
            }
        };
        out.push(RawEvent {
            vcpu: u32::try_from(vcpu).map_err(|_| bad(format!("vcpu {vcpu}")))?,
            id,
            guest_tsc,
            seq: seq_of(&payload),
            recorded,
        });
        Ok(())
    })?;
    match end {
        LinesEnd::Eof => Ok(out),
        LinesEnd::TooLong => Err(bad(n, "too long for an event".into())),
        // A last line without its newline: `record` renames the file only when complete.
        LinesEnd::Partial { .. } => Err(bad(n, "cut short (no newline)".into())),
    }
}

/// The events `rules` name in a guest trace.dat (raw guest TSC timestamps).
fn trace_dat_events(path: &Path, rules: &[EventRule]) -> Result<Vec<RawEvent>, ValidateError> {
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
        crate::formats::tracedat::reader::for_each_event(path, &layout, b, |e| {
            use crate::formats::tracedat::format::is_vmtsync_event;
            // Only the recording's events (not the function graph's records beside them).
            if !is_vmtsync_event(e.common_type) {
                return;
            }
            let Some(id) = u16::try_from(e.id)
                .ok()
                .filter(|id| rules.iter().any(|r| r.id == *id))
            else {
                return;
            };
            let len = usize::from(e.len).min(e.payload.len());
            out.push(RawEvent {
                vcpu: e.cpu,
                id,
                guest_tsc: e.ts,
                seq: seq_of(e.payload.get(..len).unwrap_or_default()),
                recorded: None,
            });
        })?;
    }
    Ok(out)
}

/// The `kvm_pio` exits of the ports `keep` accepts in a host trace.dat (every buffer), and the
/// vCPU → thread map of its GUEST option if it has one (`vmtsync record --host-out` writes
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
        let (_dir, p) = crate::testutil::temp_file(
            "vmtsync-validate-",
            "g.jsonl",
            concat!(
                "{\"schema\":1,\"vcpu\":0,\"id\":256,\"guest_tsc\":10,\"host_tsc\":1,\"host_lo\":0,\"host_hi\":2,\"payload\":\"0201000000000000\",\"round\":0}\n",
                "{\"schema\":1,\"vcpu\":0,\"id\":7,\"guest_tsc\":11,\"payload\":\"\"}\n",
                "{\"schema\":1,\"vcpu\":1,\"id\":257,\"guest_tsc\":12,\"payload\":\"0201000000000000\"}\n",
            ),
        );
        let rules = workload_rules(0x3f0);
        let ev = guest_events(&p, &rules).unwrap();
        assert_eq!(
            ev,
            [
                IoEvent {
                    vcpu: 0,
                    guest_tsc: 10,
                    side: Side::BeforeOut,
                    port: 0x3f0,
                    seq: 0x102,
                    recorded: Some(Place {
                        host: 1,
                        lo: 0,
                        hi: 2,
                        round: 0
                    }),
                },
                IoEvent {
                    vcpu: 1,
                    guest_tsc: 12,
                    side: Side::AfterIn,
                    port: 0x3f0,
                    seq: 0x102,
                    recorded: None,
                },
            ]
        );
        // Another guest's own ids: a one-byte payload is its step number; two rules on one
        // id give an event of each side.
        let mine = [
            EventRule {
                id: 7,
                port: 0x80,
                side: Side::BeforeOut,
            },
            EventRule {
                id: 7,
                port: 0x81,
                side: Side::AfterIn,
            },
        ];
        let ev = guest_events(&p, &mine).unwrap();
        assert_eq!(ev.len(), 2);
        assert_eq!(
            ev.iter()
                .map(|e| (e.port, e.side, e.seq))
                .collect::<Vec<_>>(),
            [(0x80, Side::BeforeOut, 0), (0x81, Side::AfterIn, 0)],
            "a payload-less event is numbered in order"
        );
        std::fs::write(
            &p,
            concat!(
                "{\"vcpu\":0,\"id\":256,\"guest_tsc\":1,\"payload\":\"05\"}\n",
                "{\"vcpu\":0,\"id\":256,\"guest_tsc\":3,\"payload\":\"\"}\n",
                "{\"vcpu\":0,\"id\":256,\"guest_tsc\":2,\"payload\":\"\"}\n",
            ),
        )
        .unwrap();
        let seqs: Vec<(u64, u64)> = guest_events(&p, &rules)
            .unwrap()
            .iter()
            .map(|e| (e.guest_tsc, e.seq))
            .collect();
        assert_eq!(seqs, [(1, 5), (2, 1), (3, 2)]);
        for bad in [
            "{\"vcpu\":0,\"id\":256,\"guest_tsc\":1,\"payload\":\"015\"}\n",
            "{\"vcpu\":0,\"id\":256,\"guest_tsc\":1,\"payload\":\"zz\"}\n",
            "{\"vcpu\":0,\"id\":256,\"guest_tsc\":1,\"payload\":\"\",\"host_tsc\":5}\n",
        ] {
            std::fs::write(&p, bad).unwrap();
            assert!(
                matches!(
                    guest_events(&p, &rules),
                    Err(ValidateError::GuestLine { line: 1, .. })
                ),
                "{bad}"
            );
        }
        std::fs::write(
            &p,
            "{\"vcpu\":0,\"id\":7,\"guest_tsc\":1,\"payload\":\"\"}\n",
        )
        .unwrap();
        assert!(matches!(
            guest_events(&p, &rules),
            Err(ValidateError::NoEvents { .. })
        ));
        std::fs::write(
            &p,
            format!("{{\"id\":256,\"x\":\"{}\"}}\n", "a".repeat(5000)),
        )
        .unwrap();
        assert!(matches!(
            guest_events(&p, &rules),
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
