//! A guest's spans as ftrace function-graph records, so that `trace-cmd report` prints its call
//! graph: `name() {` at an entry, `}` with the duration at the exit, `name();` with the
//! duration for a call with nothing recorded inside it (docs/trace-dat.md, "Spans").
//!
//! trace-cmd 3.1.6 prints the records of `ftrace:funcgraph_entry` and `ftrace:funcgraph_exit`
//! itself (`lib/trace-cmd/trace-ftrace.c`), reading them by field name:
//! - an entry prints `func` named through the file's kallsyms, indented by `2 * depth`;
//! - an exit prints `}` indented by `2 * depth` and the duration `rettime - calltime` in
//!   nanoseconds (as `us` with three decimals);
//! - an entry whose next record in the whole file (all CPUs, by time) is an exit of the same
//!   `func` and `common_pid` is a leaf: printed as `func();` with that exit's duration, and the
//!   exit is consumed.
//!
//! So each (trace CPU, [`SpanKind`]) is its own graph with its own `common_pid`
//! ([`graph_pid`]; the saved command lines name them `functions` and `phases`): a leaf is
//! never paired with another vCPU's or another kind's exit. Names are exact: every `func`
//! written is an address the kallsyms text names exactly ([`GraphNames`]), because
//! libtraceevent names an address by the nearest symbol below it. Phases get addresses of
//! their own, one per name, beyond any function's.
//!
//! A span without its exit (abandoned, or open at the end) is an entry with no exit: trace-cmd
//! prints `name() {` and never a duration for it. An exit without its entry is not a graph
//! exit (trace-cmd would print a duration from a `calltime` nobody knows): it is a
//! `vmtsync:span_orphan` record that names the function. Every span record also stays in the
//! file as its `vmtsync:event_data` record, so the file still reads back as the recording.

use std::collections::{BTreeMap, HashMap};

use super::consts::Tsc2Nsec;
use super::error::TraceDatError;
use super::format::{ENTRY_SIZE, EXIT_SIZE, FUNCGRAPH_ENTRY_ID, FUNCGRAPH_EXIT_ID, SPAN_ORPHAN_ID};
use super::writer::TraceDatWriter;
use crate::formats::ExportEvent;
use crate::spans::{Span, SpanConfig, SpanKind, SpanStep, SpanTracker};

/// The most names the graph adds to the image's symbols (phases, unnamed addresses, names at
/// an address another name holds): the guest chooses them, and each costs host memory. A
/// span whose name finds no room is left out of the graph (its `vmtsync:event_data` record
/// stays) and counted ([`SpanGraph::left_out`]).
pub const MAX_GRAPH_NAMES: usize = 1 << 16;

/// Where the addresses the graph gives phases (and names that meet another at the same
/// address) start: a non-canonical x86-64 address, so no code runs there.
const SYNTHETIC_BASE: u64 = 0xfff0_0000_0000_0000;

/// The `common_pid` of trace CPU `cpu`'s graph of `kind`: functions `2 * cpu + 1`, phases
/// `2 * cpu + 2` (never 0, the pid of the `vmtsync:event` records).
#[must_use]
pub fn graph_pid(cpu: u32, kind: SpanKind) -> i32 {
    let base = i64::from(cpu) * 2;
    let pid = match kind {
        SpanKind::Function => base + 1,
        SpanKind::Phase => base + 2,
    };
    i32::try_from(pid).unwrap_or(i32::MAX)
}

/// The saved command lines naming every graph's pid for `cpus` trace CPUs.
#[must_use]
pub fn cmdlines(cpus: u32) -> String {
    let mut s = String::new();
    for cpu in 0..cpus {
        for kind in [SpanKind::Function, SpanKind::Phase] {
            let name = match kind {
                SpanKind::Function => "functions",
                SpanKind::Phase => "phases",
            };
            s.push_str(&format!("{} {name}\n", graph_pid(cpu, kind)));
        }
    }
    s
}

/// The address every span name is written at, and the kallsyms text that names them exactly.
#[derive(Debug, Default)]
pub struct GraphNames {
    /// Address → name, the image's symbols and every name added.
    by_addr: BTreeMap<u64, String>,
    /// (kind, name) → the address given to a phase or to a function whose address another
    /// name holds.
    synthetic: HashMap<(SpanKind, String), u64>,
    next: u64,
    added: usize,
}

impl GraphNames {
    /// Names starting with the image's symbols, (link address, name).
    #[must_use]
    pub fn new(symbols: Vec<(u64, String)>) -> Self {
        Self {
            by_addr: symbols.into_iter().collect(),
            next: SYNTHETIC_BASE,
            ..Self::default()
        }
    }

    /// The address `span` is written at, adding its name when new; `None` when its name is
    /// new and [`MAX_GRAPH_NAMES`] are taken.
    pub fn addr_of(&mut self, span: &Span) -> Option<u64> {
        if let (SpanKind::Function, Some(a)) = (span.kind, span.addr) {
            match self.by_addr.get(&a) {
                Some(n) if *n == span.name => return Some(a),
                None if self.added < MAX_GRAPH_NAMES => {
                    self.added += 1;
                    self.by_addr.insert(a, span.name.clone());
                    return Some(a);
                }
                _ => {}
            }
        }
        let key = (span.kind, span.name.clone());
        if let Some(&a) = self.synthetic.get(&key) {
            return Some(a);
        }
        if self.added >= MAX_GRAPH_NAMES {
            return None;
        }
        while self.by_addr.contains_key(&self.next) {
            self.next += 1;
        }
        let a = self.next;
        self.next += 1;
        self.added += 1;
        self.by_addr.insert(a, span.name.clone());
        self.synthetic.insert(key, a);
        Some(a)
    }

    /// `/proc/kallsyms` lines for every address: `ADDR T NAME`. A name is one token there, so
    /// white space and control characters become `_` (and a leading `$`, which libtraceevent
    /// skips as an ARM mapping symbol, gets a `_` before it).
    #[must_use]
    pub fn kallsyms(&self) -> String {
        let mut s = String::new();
        for (a, n) in &self.by_addr {
            let mut name: String = n
                .chars()
                .map(|c| {
                    if c.is_whitespace() || c.is_control() {
                        '_'
                    } else {
                        c
                    }
                })
                .collect();
            if name.is_empty() || name.starts_with('$') {
                name.insert(0, '_');
            }
            s.push_str(&format!("{a:016x} T {name}\n"));
        }
        s
    }
}

/// A `funcgraph_entry` record.
#[must_use]
pub fn entry_record(pid: i32, func: u64, depth: u32) -> [u8; ENTRY_SIZE] {
    let mut r = [0u8; ENTRY_SIZE];
    r[..2].copy_from_slice(&FUNCGRAPH_ENTRY_ID.to_le_bytes());
    r[4..8].copy_from_slice(&pid.to_le_bytes());
    r[8..16].copy_from_slice(&func.to_le_bytes());
    r[16..20].copy_from_slice(&depth.to_le_bytes());
    r
}

/// A `funcgraph_exit` record: `calltime` and `rettime` in the file's nanoseconds.
#[must_use]
pub fn exit_record(
    pid: i32,
    func: u64,
    depth: u32,
    calltime: u64,
    rettime: u64,
) -> [u8; EXIT_SIZE] {
    let mut r = [0u8; EXIT_SIZE];
    r[..2].copy_from_slice(&FUNCGRAPH_EXIT_ID.to_le_bytes());
    r[4..8].copy_from_slice(&pid.to_le_bytes());
    r[8..16].copy_from_slice(&func.to_le_bytes());
    r[16..20].copy_from_slice(&depth.to_le_bytes());
    r[24..32].copy_from_slice(&calltime.to_le_bytes());
    r[32..40].copy_from_slice(&rettime.to_le_bytes());
    r
}

/// A `vmtsync:span_orphan` record.
#[must_use]
pub fn orphan_record(pid: i32, func: u64, depth: u32) -> [u8; ENTRY_SIZE] {
    let mut r = entry_record(pid, func, depth);
    r[..2].copy_from_slice(&SPAN_ORPHAN_ID.to_le_bytes());
    r
}

/// Writes a recording's events into a [`TraceDatWriter`] with its spans as a function graph:
/// every event as before, and for the span records the graph records their steps make.
#[derive(Debug)]
pub struct SpanGraph {
    tracker: SpanTracker,
    names: GraphNames,
    tsc2nsec: Option<Tsc2Nsec>,
    steps: Vec<SpanStep>,
    left_out: u64,
}

impl SpanGraph {
    /// A graph naming functions with `cfg`; `calltime`/`rettime` are the host TSC through
    /// `tsc2nsec` (the TSC2NSEC the file carries, so they are the nanoseconds trace-cmd shows
    /// the timestamps in; raw ticks without one, like the timestamps).
    #[must_use]
    pub fn new(cfg: &SpanConfig, tsc2nsec: Option<Tsc2Nsec>) -> Self {
        let tracker = SpanTracker::new(cfg);
        let names = GraphNames::new(tracker.kallsyms());
        Self {
            tracker,
            names,
            tsc2nsec,
            steps: Vec::new(),
            left_out: 0,
        }
    }

    /// Writes `e` on trace CPU `cpu` at timestamp `ts` (the file's clock), and the graph
    /// records of its span steps at the same timestamp: after the event for an entry, before
    /// it for an exit, so an entry and the exit right after it are adjacent (trace-cmd's
    /// leaf).
    ///
    /// # Errors
    /// As [`TraceDatWriter::push`].
    pub fn push(
        &mut self,
        w: &mut TraceDatWriter,
        cpu: u32,
        ts: u64,
        e: &ExportEvent,
    ) -> Result<(), TraceDatError> {
        if !e.is_span_record() {
            return w.push(cpu, ts, u32::from(e.id), e.payload.as_slice());
        }
        self.steps.clear();
        let mut steps = std::mem::take(&mut self.steps);
        let span = self.tracker.push(e, &mut steps);
        let exit = steps
            .iter()
            .any(|s| matches!(s, SpanStep::Exit(_) | SpanStep::Orphan(_)));
        if !(span && exit) {
            w.push(cpu, ts, u32::from(e.id), e.payload.as_slice())?;
        }
        for step in &steps {
            self.write_step(w, cpu, ts, step)?;
        }
        if span && exit {
            w.push(cpu, ts, u32::from(e.id), e.payload.as_slice())?;
        }
        self.steps = steps;
        Ok(())
    }

    fn write_step(
        &mut self,
        w: &mut TraceDatWriter,
        cpu: u32,
        ts: u64,
        step: &SpanStep,
    ) -> Result<(), TraceDatError> {
        let s = step.span();
        let pid = graph_pid(cpu, s.kind);
        // An abandoned frame's entry is already written: it stays open.
        if matches!(step, SpanStep::Abandoned(_)) {
            return Ok(());
        }
        let Some(func) = self.names.addr_of(s) else {
            self.left_out += 1;
            return Ok(());
        };
        let ns = |t: u64| self.tsc2nsec.map_or(t, |c| c.nanos(t));
        match (step, s.begin, s.end) {
            (SpanStep::Enter(_), ..) => w.push_raw(cpu, ts, &entry_record(pid, func, s.depth)),
            (SpanStep::Exit(_), Some(b), Some(e)) => w.push_raw(
                cpu,
                ts,
                &exit_record(pid, func, s.depth, ns(b.host_tsc), ns(e.host_tsc)),
            ),
            (SpanStep::Orphan(_), ..) => w.push_raw(cpu, ts, &orphan_record(pid, func, s.depth)),
            _ => Ok(()),
        }
    }

    /// Span steps left out of the graph because their name found no room
    /// ([`MAX_GRAPH_NAMES`]).
    #[must_use]
    pub fn left_out(&self) -> u64 {
        self.left_out
    }

    /// Gives `w` the kallsyms text and the graphs' command lines (before its `finish`).
    pub fn finish(self, w: &mut TraceDatWriter, cpus: u32) {
        w.set_kallsyms(self.names.kallsyms());
        w.set_cmdlines(cmdlines(cpus));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(kind: SpanKind, name: &str, addr: Option<u64>) -> Span {
        Span {
            vcpu: 0,
            kind,
            name: name.into(),
            addr,
            depth: 0,
            begin: None,
            end: None,
        }
    }

    #[test]
    fn every_written_address_is_named_exactly() {
        let mut n = GraphNames::new(vec![(0x1000, "startBoot".into()), (0x2000, "main".into())]);
        let f = SpanKind::Function;
        assert_eq!(n.addr_of(&span(f, "startBoot", Some(0x1000))), Some(0x1000));
        // Inside a symbol: its own entry, so the nearest-below lookup finds it exactly.
        assert_eq!(n.addr_of(&span(f, "main+0x10", Some(0x2010))), Some(0x2010));
        // An unnamed run-time address that a symbol's address holds gets one of its own.
        let other = n.addr_of(&span(f, "0x1000", Some(0x1000))).unwrap();
        assert!(other >= SYNTHETIC_BASE);
        let p = n
            .addr_of(&span(SpanKind::Phase, "post init", None))
            .unwrap();
        assert_ne!(p, other);
        assert_eq!(
            n.addr_of(&span(SpanKind::Phase, "post init", None)),
            Some(p)
        );
        let k = n.kallsyms();
        assert!(k.contains("0000000000001000 T startBoot\n"), "{k}");
        assert!(k.contains("0000000000002010 T main+0x10\n"), "{k}");
        assert!(k.contains(&format!("{other:016x} T 0x1000\n")), "{k}");
        assert!(k.contains(&format!("{p:016x} T post_init\n")), "{k}");
    }

    #[test]
    fn names_stop_at_the_cap_and_known_ones_still_resolve() {
        let mut n = GraphNames::new(Vec::new());
        for i in 0..MAX_GRAPH_NAMES {
            assert!(
                n.addr_of(&span(SpanKind::Phase, &i.to_string(), None))
                    .is_some()
            );
        }
        assert_eq!(n.addr_of(&span(SpanKind::Phase, "one more", None)), None);
        assert!(n.addr_of(&span(SpanKind::Phase, "7", None)).is_some());
    }

    #[test]
    fn records_have_the_kernels_field_offsets() {
        use crate::formats::tracedat::format::{
            FUNCGRAPH_ENTRY_FORMAT, FUNCGRAPH_EXIT_FORMAT, SPAN_ORPHAN_FORMAT,
        };
        let e = exit_record(3, 0xabc, 2, 100, 250);
        assert_eq!(u16::from_le_bytes([e[0], e[1]]), FUNCGRAPH_EXIT_ID);
        assert_eq!(i32::from_le_bytes(e[4..8].try_into().unwrap()), 3);
        assert_eq!(u64::from_le_bytes(e[8..16].try_into().unwrap()), 0xabc);
        assert_eq!(u32::from_le_bytes(e[16..20].try_into().unwrap()), 2);
        assert_eq!(u64::from_le_bytes(e[24..32].try_into().unwrap()), 100);
        assert_eq!(u64::from_le_bytes(e[32..40].try_into().unwrap()), 250);
        assert!(FUNCGRAPH_EXIT_FORMAT.contains(&format!("ID: {FUNCGRAPH_EXIT_ID}\n")));
        assert!(FUNCGRAPH_ENTRY_FORMAT.contains(&format!("ID: {FUNCGRAPH_ENTRY_ID}\n")));
        assert!(SPAN_ORPHAN_FORMAT.contains(&format!("ID: {SPAN_ORPHAN_ID}\n")));
        assert_eq!(graph_pid(0, SpanKind::Function), 1);
        assert_eq!(graph_pid(1, SpanKind::Phase), 4);
    }
}
