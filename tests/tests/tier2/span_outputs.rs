//! Tier 2: a synthetic recording's spans in every output, read back by the real readers:
//! trace-cmd 3.1.6's function graph, Perfetto's trace processor (`slice` table) and
//! babeltrace2.
//!
//! Truth is the recording itself: [`recording`] lists the span records with the spans they
//! make (name, depth, start, end in host ticks), chosen by hand so each case appears once: a
//! nested call, a leaf, phases beside functions, two vCPUs, a frame an outer exit abandons,
//! an exit without its entry and frames still open at the end.

use std::sync::Arc;

use vmtsync::formats::tracedat::{FileVersion, SpanGraph, TraceDatWriter, Tsc2Nsec, WriterOptions};
use vmtsync::formats::{Bound, ExportEvent, Payload};
use vmtsync::spans::{SpanConfig, Symbols};

use crate::ctf::{bt2_events, ctf_ready};
use crate::perfetto::{int, node_ready, sql, trace_processor};
use crate::util::{have_trace_cmd, trace_cmd};

crate::trials!(
    have_trace_cmd;
    trace_cmd_prints_the_call_graph_with_names_depths_and_durations;
    node_ready;
    the_trace_processor_holds_every_span_as_a_slice_or_an_open_mark;
    ctf_ready;
    babeltrace2_reads_span_events_with_durations_only_for_closed_spans,
);

const SPAN_BEGIN: u16 = 0xFF01;
const SPAN_END: u16 = 0xFF02;
const FUNC_ENTRY: u16 = 0xFF03;
const FUNC_EXIT: u16 = 0xFF04;

/// The image's functions: (address, size, name).
const SYMBOLS: [(u64, u64, &str); 6] = [
    (0x1000, 0x100, "startBoot"),
    (0x2000, 0x100, "memset"),
    (0x3000, 0x100, "helper"),
    (0x4000, 0x100, "inner"),
    (0x5000, 0x100, "waitForever"),
    (0x6000, 0x100, "smpEntry"),
];

fn ev(vcpu: u32, id: u16, payload: &[u8], t: u64) -> ExportEvent {
    ExportEvent {
        vcpu,
        id,
        guest_tsc: Some(t + 1_000_000),
        host_tsc: t,
        bound: Some(Bound {
            lo: t - 3,
            hi: t + 4,
        }),
        payload: Payload::new(payload).unwrap(),
    }
}

fn func(vcpu: u32, id: u16, addr: u32, t: u64) -> ExportEvent {
    let mut p = [0u8; 8];
    p[..4].copy_from_slice(&addr.to_le_bytes());
    p[4..].copy_from_slice(&0x9999u32.to_le_bytes());
    ev(vcpu, id, &p, t)
}

/// What a span must look like in every output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Truth {
    vcpu: u32,
    phase: bool,
    name: &'static str,
    depth: u32,
    begin: Option<u64>,
    end: Option<u64>,
    /// Open because an outer frame's exit came first (else open at the end).
    abandoned: bool,
}

const fn closed(vcpu: u32, phase: bool, name: &'static str, depth: u32, b: u64, e: u64) -> Truth {
    Truth {
        vcpu,
        phase,
        name,
        depth,
        begin: Some(b),
        end: Some(e),
        abandoned: false,
    }
}

/// The recording (events in each vCPU's order, host ticks) and its spans.
pub(crate) fn recording() -> (Vec<ExportEvent>, Vec<Truth>) {
    let events = vec![
        ev(0, SPAN_BEGIN, b"post", 500),
        func(0, FUNC_ENTRY, 0x1000, 1_000),
        func(0, FUNC_ENTRY, 0x2000, 2_000),
        func(0, FUNC_EXIT, 0x2000, 5_000),
        func(0, FUNC_ENTRY, 0x3000, 6_000),
        ev(0, 7, b"x", 6_200),
        func(0, FUNC_ENTRY, 0x4000, 6_500),
        func(0, FUNC_EXIT, 0x4000, 7_000),
        func(0, FUNC_EXIT, 0x3000, 9_000),
        ev(0, SPAN_BEGIN, b"clear memory", 9_500),
        ev(0, SPAN_END, b"clear memory", 1_509_500),
        func(0, FUNC_EXIT, 0x1000, 2_000_000),
        ev(0, SPAN_END, b"post", 2_500_000),
        func(0, FUNC_ENTRY, 0x5000, 3_000_000),
        // helper's exit again: its entry is not on the stack (an orphan).
        func(0, FUNC_EXIT, 0x3000, 3_100_000),
        ev(1, SPAN_BEGIN, b"smp init", 1_500),
        func(1, FUNC_ENTRY, 0x6000, 2_000),
        func(1, FUNC_ENTRY, 0x2000, 2_500),
        func(1, FUNC_ENTRY, 0x4000, 3_000),
        func(1, FUNC_EXIT, 0x4000, 3_500),
        // smpEntry's exit abandons memset (its exit never comes).
        func(1, FUNC_EXIT, 0x6000, 4_000),
    ];
    let open = |vcpu, phase, name, depth, b, abandoned| Truth {
        vcpu,
        phase,
        name,
        depth,
        begin: Some(b),
        end: None,
        abandoned,
    };
    let truth = vec![
        closed(0, true, "post", 0, 500, 2_500_000),
        closed(0, false, "startBoot", 0, 1_000, 2_000_000),
        closed(0, false, "memset", 1, 2_000, 5_000),
        closed(0, false, "helper", 1, 6_000, 9_000),
        closed(0, false, "inner", 2, 6_500, 7_000),
        closed(0, true, "clear memory", 1, 9_500, 1_509_500),
        open(0, false, "waitForever", 0, 3_000_000, false),
        Truth {
            vcpu: 0,
            phase: false,
            name: "helper",
            depth: 1,
            begin: None,
            end: Some(3_100_000),
            abandoned: false,
        },
        open(1, true, "smp init", 0, 1_500, false),
        closed(1, false, "smpEntry", 0, 2_000, 4_000),
        open(1, false, "memset", 1, 2_500, true),
        // Inside the abandoned memset: depth 2 in the guest's stack.
        closed(1, false, "inner", 2, 3_000, 3_500),
    ];
    (events, truth)
}

fn config() -> SpanConfig {
    SpanConfig {
        symbols: Some(Arc::new(Symbols::from_pairs(&SYMBOLS))),
        relocs: Vec::new(),
    }
}

/// The recording as a trace.dat on host time (1 GHz: ticks are nanoseconds), through the
/// writer `vmtsync record` uses, events merged in host-time order per CPU.
fn write_trace_dat(path: &std::path::Path, version: FileVersion) {
    let (mut events, _) = recording();
    events.sort_by_key(|e| e.host_tsc);
    let mut wo = WriterOptions::new(2, 0x5a5a);
    wo.version = version;
    wo.tsc2nsec = Tsc2Nsec::for_hz(1_000_000_000);
    let mut g = SpanGraph::new(&config(), wo.tsc2nsec);
    let mut w = TraceDatWriter::create(path, wo).unwrap();
    for e in &events {
        g.push(&mut w, e.vcpu, e.host_tsc, e).unwrap();
    }
    g.finish(&mut w, 2);
    w.finish(None).unwrap();
}

/// One function-graph line of `trace-cmd report`: who (comm), CPU, timestamp in ns, the
/// duration in ns if printed, the indentation (2 per depth) and the text after it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct GraphLine {
    pub(crate) comm: String,
    pub(crate) cpu: u32,
    pub(crate) ts: u64,
    pub(crate) dur: Option<u64>,
    /// The nanoseconds the printed duration is truncated to: trace-cmd, like the kernel,
    /// prints at most 7 digits of microseconds and fraction together (1 for a duration under
    /// 10 ms, 1000 for one of 1 s or more).
    pub(crate) dur_unit: u64,
    pub(crate) depth: usize,
    pub(crate) text: String,
}

/// Parses `comm-pid [CPU] TS: funcgraph_entry|exit: [+] DUR us | <indent>text`.
pub(crate) fn graph_lines(report: &str) -> Vec<GraphLine> {
    report
        .lines()
        .filter(|l| l.contains(": funcgraph_") || l.contains(": span_orphan:"))
        .map(|l| {
            let (head, rest) = l.split_once(']').unwrap();
            let (who, cpu) = head.trim().rsplit_once('[').unwrap();
            let comm = who.trim().rsplit_once('-').unwrap().0.to_owned();
            let (ts, rest) = rest.trim_start().split_once(':').unwrap();
            let ts: u64 = ts.replace('.', "").parse().unwrap();
            let (_, body) = rest.trim_start().split_once(':').unwrap();
            let (dur, text) = match body.split_once('|') {
                Some((d, t)) => (d, t.strip_prefix("  ").unwrap_or(t)),
                None => ("", body.trim_start()),
            };
            let mut dur_unit = 1;
            let dur = dur
                .trim()
                .trim_start_matches(['+', '!', '#', '$', '@', '*'])
                .trim()
                .strip_suffix("us")
                .map(|d| {
                    let (us, frac) = d.trim().split_once('.').unwrap_or((d.trim(), ""));
                    dur_unit = 10u64.pow(3 - u32::try_from(frac.len()).unwrap());
                    us.parse::<u64>().unwrap() * 1000 + frac.parse::<u64>().unwrap_or(0) * dur_unit
                });
            let depth = text.len() - text.trim_start().len();
            GraphLine {
                comm,
                cpu: cpu.parse().unwrap(),
                ts,
                dur,
                dur_unit,
                depth: depth / 2,
                text: text.trim().to_owned(),
            }
        })
        .collect()
}

fn trace_cmd_prints_the_call_graph_with_names_depths_and_durations() {
    for version in [FileVersion::V7, FileVersion::V6] {
        call_graph_of(version);
    }
}

/// The checks of the test above on one file version.
fn call_graph_of(version: FileVersion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("spans.dat");
    write_trace_dat(&path, version);
    crate::tracedat::assert_dump_ok(&path);
    let o = trace_cmd(&["report", "-t", "-i", path.to_str().unwrap()]);
    let report = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "trace-cmd report: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let got = graph_lines(&report);
    let (_, truth) = recording();
    // Every closed span: an entry line at its start, and its duration on the leaf line or on
    // the closing brace at its end; open ones: an opening line and nothing else.
    for t in &truth {
        let comm = if t.phase { "phases" } else { "functions" };
        let mine = |l: &&GraphLine| l.comm == comm && l.cpu == t.vcpu;
        match (t.begin, t.end) {
            (Some(b), Some(e)) => {
                // kallsyms names are one token: a phase's spaces show as `_`.
                let name = t.name.replace(' ', "_");
                let leaf = format!("{name}();");
                let open = format!("{name}() {{");
                let entry = got
                    .iter()
                    .filter(mine)
                    .find(|l| l.ts == b && (l.text == leaf || l.text == open))
                    .unwrap_or_else(|| panic!("no entry line for {t:?}"));
                assert_eq!(entry.depth, t.depth as usize, "{t:?}");
                let dur = if entry.text == leaf {
                    entry.dur
                } else {
                    let close = got
                        .iter()
                        .filter(mine)
                        .find(|l| l.ts == e && l.text == "}" && l.depth == t.depth as usize)
                        .unwrap_or_else(|| panic!("no closing line for {t:?}"));
                    close.dur
                };
                assert_eq!(dur, Some(e - b), "{t:?}");
            }
            (Some(b), None) => {
                let entry = got
                    .iter()
                    .filter(mine)
                    .find(|l| l.ts == b && l.text == format!("{}() {{", t.name.replace(' ', "_")))
                    .unwrap_or_else(|| panic!("no open line for {t:?}"));
                assert_eq!((entry.depth, entry.dur), (t.depth as usize, None));
            }
            (None, Some(e)) => {
                let l = got
                    .iter()
                    .filter(mine)
                    .find(|l| l.ts == e && l.text.contains("entry not seen"))
                    .unwrap_or_else(|| panic!("no orphan line for {t:?}"));
                assert!(l.text.starts_with(t.name), "{l:?}");
                assert_eq!(l.dur, None);
            }
            (None, None) => unreachable!(),
        }
    }
    // No duration anywhere but on the closed spans' lines.
    let closed_durs: Vec<u64> = truth
        .iter()
        .filter_map(|t| Some(t.end? - t.begin?))
        .collect();
    let mut durs: Vec<u64> = got.iter().filter_map(|l| l.dur).collect();
    durs.sort_unstable();
    let mut want = closed_durs.clone();
    want.sort_unstable();
    assert_eq!(durs, want, "every duration printed is a closed span's");
}

/// BOOTTIME of host tick `t` in the Perfetto test: 1 tick = 1 ns, from 1 s.
const BOOT_BASE: u64 = 1_000_000_000;

/// The recording through the writer `vmtsync record --format perfetto` and `vmtsync export
/// perfetto` use, on a clock of one tick per nanosecond.
fn write_perfetto(path: &std::path::Path) {
    use vmtsync::formats::perfetto::clock::{BootClock, ClockSnapshot};
    use vmtsync::formats::perfetto::{PerfettoOptions, PerfettoWriter};
    let snap = |tsc: u64| ClockSnapshot {
        tsc,
        boottime_ns: BOOT_BASE + tsc,
        resolution: 0,
    };
    let clock = BootClock::new(vec![snap(0), snap(1_000_000_000)]).unwrap();
    let mut w = PerfettoWriter::create(
        path,
        PerfettoOptions {
            machine_id: 1,
            guest_name: "spans".into(),
            clock,
        },
    )
    .unwrap();
    w.set_spans(&config());
    let (events, _) = recording();
    for e in &events {
        w.push(e).unwrap();
    }
    w.finish().unwrap();
}

fn the_trace_processor_holds_every_span_as_a_slice_or_an_open_mark() {
    let tp = trace_processor();
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("spans.perfetto-trace");
    write_perfetto(&trace);
    let rows = sql(
        &tp,
        &trace,
        &["select s.name, s.depth, s.ts, s.dur, t.name, \
           extract_arg(s.arg_set_id, 'debug.depth'), \
           extract_arg(s.arg_set_id, 'debug.open'), \
           extract_arg(s.arg_set_id, 'debug.before_ns'), \
           extract_arg(s.arg_set_id, 'debug.after_ns'), \
           extract_arg(s.arg_set_id, 'debug.end_before_ns'), \
           extract_arg(s.arg_set_id, 'debug.end_after_ns') \
           from slice s join track t on s.track_id = t.id \
           where t.name like 'vCPU % phases' or t.name like 'vCPU % functions' \
           order by s.ts"],
    )
    .remove(0);
    let (_, truth) = recording();
    assert_eq!(rows.len(), truth.len(), "one slice per span: {rows:?}");
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    let opt = |v: &serde_json::Value| (!v.is_null()).then(|| int(v));
    for t in &truth {
        let track = format!(
            "vCPU {} {}",
            t.vcpu,
            if t.phase { "phases" } else { "functions" }
        );
        let (name, ts, dur) = match (t.begin, t.end) {
            (Some(b), Some(e)) => (t.name.to_owned(), b, i128::from(e - b)),
            // Open at the end: the trace processor's "did not end".
            (Some(b), None) if !t.abandoned => (t.name.to_owned(), b, -1),
            (Some(b), None) => (format!("{} (exit not seen)", t.name), b, 0),
            (None, Some(e)) => (format!("{} (entry not seen)", t.name), e, 0),
            (None, None) => unreachable!(),
        };
        let ts = i128::from(BOOT_BASE + ts);
        let row = rows
            .iter()
            .find(|r| text(&r[0]) == name && int(&r[2]) == ts && text(&r[4]) == track)
            .unwrap_or_else(|| panic!("no slice for {t:?} in {rows:?}"));
        assert_eq!(int(&row[3]), dur, "{t:?}");
        assert_eq!(
            int(&row[5]),
            i128::from(t.depth),
            "the guest's depth: {t:?}"
        );
        // The trace processor nests by its own stack: a span inside an abandoned frame (which
        // is no slice) sits one level higher there.
        let inside_abandoned = i128::from(t.vcpu == 1 && t.name == "inner");
        assert_eq!(
            int(&row[1]),
            i128::from(t.depth) - inside_abandoned,
            "{t:?}"
        );
        let open = t.end.is_none() || t.begin.is_none();
        assert_eq!(opt(&row[6]), open.then_some(1), "{t:?}");
        // The guaranteed interval of each end known ([t-3, t+4] ticks, each way at most one
        // ns wider by rounding).
        let near = |v: Option<i128>, want: i128| v.is_some_and(|v| v == want || v == want + 1);
        let begin_known = near(opt(&row[7]), 3) && near(opt(&row[8]), 4);
        let end_known = near(opt(&row[9]), 3) && near(opt(&row[10]), 4);
        assert_eq!(
            (begin_known, end_known),
            (t.begin.is_some(), t.end.is_some()),
            "{t:?}: {row:?}"
        );
    }
}

fn babeltrace2_reads_span_events_with_durations_only_for_closed_spans() {
    use vmtsync::formats::ctf::{CtfOptions, GuestCtf, GuestFields};
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ctf");
    let opts = CtfOptions {
        tsc_hz: 1_000_000_000,
        name: "spans".into(),
        env: Vec::new(),
    };
    let mut w = GuestCtf::create(&out, &opts, GuestFields::ALL).unwrap();
    w.set_spans(&config());
    let (events, truth) = recording();
    for e in &events {
        w.push(e).unwrap();
    }
    let summary = w.finish().unwrap();
    let all = bt2_events(&[&out]);
    assert_eq!(all.len() as u64, summary.events);
    // Every record is still a `vmtsync:event`.
    assert_eq!(
        all.iter().filter(|e| e.event == "vmtsync:event").count(),
        events.len()
    );
    let spans: Vec<_> = all
        .iter()
        .filter(|e| e.event.starts_with("vmtsync:span_"))
        .collect();
    let text = |e: &crate::ctf::BtEvent, k: &str| e.fields[k].as_str().unwrap().to_owned();
    let find = |class: &str, t: &Truth, at: u64| {
        spans
            .iter()
            .find(|e| {
                e.event == class
                    && e.cycles == at
                    && text(e, "name") == t.name
                    && e.f("vcpu") == u64::from(t.vcpu)
            })
            .unwrap_or_else(|| panic!("no {class} at {at} for {t:?}"))
    };
    let mut expected = 0;
    for t in &truth {
        let mine = |e: &&&crate::ctf::BtEvent| {
            text(e, "name") == t.name && e.f("vcpu") == u64::from(t.vcpu)
        };
        if let Some(b) = t.begin {
            let e = find("vmtsync:span_begin", t, b);
            assert_eq!(e.f("depth"), u64::from(t.depth), "{t:?}");
            assert_eq!(e.f("kind"), u64::from(!t.phase), "{t:?}");
            assert_eq!((e.f("host_lo"), e.f("host_hi")), (b - 3, b + 4));
            expected += 1;
        }
        match (t.begin, t.end) {
            (Some(b), Some(e)) => {
                let ev = find("vmtsync:span_end", t, e);
                assert_eq!(ev.f("duration"), e - b, "{t:?}");
                assert_eq!(ev.f("begin_host_tsc"), b);
                assert_eq!(
                    (ev.f("duration_lo"), ev.f("duration_hi")),
                    (e - b - 7, e - b + 7)
                );
                expected += 1;
            }
            (Some(_), None) => {
                let u = spans
                    .iter()
                    .filter(mine)
                    .find(|e| e.event == "vmtsync:span_unfinished")
                    .unwrap_or_else(|| panic!("not marked unfinished: {t:?}"));
                // Abandoned: at the outer exit (smpEntry's, 4000); open at the end: at its
                // stream's last event.
                let (state, at) = if t.abandoned {
                    (0, 4_000)
                } else {
                    let last = all
                        .iter()
                        .filter(|e| e.event == "vmtsync:event" && e.f("vcpu") == u64::from(t.vcpu))
                        .map(|e| e.cycles)
                        .max()
                        .unwrap();
                    (1, last)
                };
                assert_eq!((u.f("state"), u.cycles), (state, at), "{t:?}");
                assert_eq!(u.f("begin_host_tsc"), t.begin.unwrap());
                assert!(u.fields.get("duration").is_none());
                expected += 1;
            }
            (None, Some(e)) => {
                let o = find("vmtsync:span_orphan", t, e);
                assert_eq!(o.f("depth"), u64::from(t.depth));
                assert!(o.fields.get("duration").is_none());
                expected += 1;
            }
            (None, None) => unreachable!(),
        }
    }
    assert_eq!(spans.len(), expected, "no span event beyond the truth's");
}
