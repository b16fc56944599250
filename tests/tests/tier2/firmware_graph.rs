//! Tier 2: SeaBIOS's function graph, read by two real readers that must agree. The
//! function-tracing build boots under `vmtsync record --from-memory --symbols rom.o -- qemu…`
//! into a trace.dat; `vmtsync export perfetto` turns the same file into a Perfetto trace.
//! trace-cmd's `report` prints the call graph (entries, closing braces with durations, leaves)
//! and Perfetto's trace processor holds the slices: for every closed span, both name the same
//! function at the same depth, and the start and duration trace-cmd prints are the trace
//! processor's host ticks through the file's own TSC2NSEC (as `trace-cmd dump --options`
//! prints it). Open spans (entered, never left) are open in both.

use std::path::Path;
use std::time::Duration;

use vmtsync_launch::firmware::{self, MEMORY_MIB, Variant};
use vmtsync_launch::qemu::command_firmware;

use crate::firmware::{launch_reader, seabios_ready, stop_reader, wait_log};
use crate::perfetto::{int, node_ready, sql, trace_processor};
use crate::span_outputs::graph_lines;
use crate::util::{have_trace_cmd, scratch, trace_cmd, vmtsync};

crate::trials!(
    ready; seabios_function_graph_agrees_in_trace_cmd_and_the_trace_processor;
);

fn ready(test: &str) -> bool {
    seabios_ready(test) && have_trace_cmd(test) && node_ready(test)
}

/// One span as a reader shows it: kind ("functions" or "phases"), name, depth, start and
/// duration in trace-cmd's nanoseconds (`None`: open), and the unit trace-cmd truncated the
/// duration to (1 ns below 10 ms; see `GraphLine::dur_unit`).
type Shown = (String, String, usize, u64, Option<u64>, u64);

/// The file's TSC2NSEC (multiplier, shift, offset) from `trace-cmd dump --options`.
fn tsc2nsec(dat: &Path) -> (u128, u32, i128) {
    let o = trace_cmd(&["dump", "--options", "-i", dat.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let line = text
        .lines()
        .find(|l| l.contains("[multiplier, shift, offset]"))
        .unwrap_or_else(|| panic!("no TSC2NSEC option in the guest trace.dat:\n{text}"));
    let v: Vec<&str> = line.split_whitespace().collect();
    (
        v[0].parse().unwrap(),
        v[1].parse().unwrap(),
        v[2].parse().unwrap(),
    )
}

/// trace-cmd's call graph as spans: an entry line opens one (a leaf `f();` closes it at once
/// with its duration), a `}` closes its pid's open entry of the same depth.
fn trace_cmd_spans(dat: &Path) -> Vec<Shown> {
    let o = trace_cmd(&["report", "-t", "-i", dat.to_str().unwrap()]);
    assert!(
        o.status.success(),
        "trace-cmd report: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let report = String::from_utf8_lossy(&o.stdout).into_owned();
    let mut open: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
    let mut spans: Vec<Shown> = Vec::new();
    for l in graph_lines(&report) {
        if let Some(name) = l.text.strip_suffix("();") {
            spans.push((
                l.comm.clone(),
                name.to_owned(),
                l.depth,
                l.ts,
                l.dur,
                l.dur_unit,
            ));
        } else if let Some(name) = l.text.strip_suffix("() {") {
            open.entry(l.comm.clone()).or_default().push(spans.len());
            spans.push((l.comm.clone(), name.to_owned(), l.depth, l.ts, None, 1));
        } else if l.text == "}" {
            // A brace closes the entry of its depth; entries left above it were abandoned
            // (their exits never came) and stay open.
            let stack = open.entry(l.comm.clone()).or_default();
            while stack.last().is_some_and(|&i| spans[i].2 > l.depth) {
                stack.pop();
            }
            let i = stack
                .pop()
                .unwrap_or_else(|| panic!("a closing brace with nothing open: {l:?}"));
            assert_eq!(spans[i].2, l.depth, "a brace closes its own depth: {l:?}");
            spans[i].4 = Some(l.dur.expect("a closing brace prints its duration"));
            spans[i].5 = l.dur_unit;
        }
    }
    spans
}

/// The trace processor's slices on the guest's span tracks as spans, in trace-cmd's
/// nanoseconds (its host-tick arguments through the file's TSC2NSEC).
fn trace_processor_spans(trace: &Path, conv: (u128, u32, i128)) -> Vec<Shown> {
    let (mult, shift, offset) = conv;
    let ns = |tsc: i128| -> u64 {
        let v = i128::try_from((u128::try_from(tsc).unwrap() * mult) >> shift).unwrap() + offset;
        u64::try_from(v).unwrap()
    };
    let rows = sql(
        &trace_processor(),
        trace,
        &[
            "select t.name, s.name, extract_arg(s.arg_set_id, 'debug.depth'), \
           extract_arg(s.arg_set_id, 'debug.host_tsc'), \
           extract_arg(s.arg_set_id, 'debug.end_host_tsc') \
           from slice s join track t on s.track_id = t.id \
           where t.name like 'vCPU % phases' or t.name like 'vCPU % functions' \
           order by s.ts",
        ],
    )
    .remove(0);
    rows.iter()
        .filter_map(|r| {
            let track = r[0].as_str().unwrap_or_default();
            let kind = if track.ends_with("phases") {
                "phases"
            } else {
                "functions"
            };
            let name = r[1].as_str().unwrap_or_default();
            // An orphan exit is no entry of the graph's (trace-cmd shows it as a plain
            // event); an abandoned entry is an open one in both (an entry without a brace).
            if name.ends_with(" (entry not seen)") {
                return None;
            }
            let name = name.strip_suffix(" (exit not seen)").unwrap_or(name);
            let begin = ns(int(&r[3]));
            let dur = (!r[4].is_null()).then(|| ns(int(&r[4])) - begin);
            let depth = usize::try_from(int(&r[2])).unwrap();
            Some((
                kind.to_owned(),
                name.replace(' ', "_"),
                depth,
                begin,
                dur,
                1,
            ))
        })
        .collect()
}

fn seabios_function_graph_agrees_in_trace_cmd_and_the_trace_processor() {
    let test = "seabios_function_graph_agrees_in_trace_cmd_and_the_trace_processor";
    let out = firmware::build(Variant::Functions).expect("the function-tracing SeaBIOS builds");
    let rom = out.join("rom.o");
    let dir = scratch(test);
    let log = dir.path().join("debug.log");
    let dat = dir.path().join("guest.dat");
    let qemu = command_firmware(&out.join("bios.bin"), &log, MEMORY_MIB);
    let rec = launch_reader(
        &qemu,
        &dat,
        &["--duration", "900", "--symbols", rom.to_str().unwrap()],
        &[],
    );
    wait_log(&log, "No bootable device", Duration::from_secs(600));
    let (ok, stderr) = stop_reader(rec, &dat);
    assert!(ok, "record --from-memory -- qemu: {stderr}");
    let pftrace = dir.path().join("guest.perfetto-trace");
    let o = vmtsync()
        .args(["export", "perfetto", "--from"])
        .arg(&dat)
        .arg("--out")
        .arg(&pftrace)
        .arg("--symbols")
        .arg(&rom)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "export perfetto: {}",
        String::from_utf8_lossy(&o.stderr)
    );

    let mut graph = trace_cmd_spans(&dat);
    let mut slices = trace_processor_spans(&pftrace, tsc2nsec(&dat));
    graph.sort();
    slices.sort();
    let closed = graph.iter().filter(|s| s.4.is_some()).count();
    let open: Vec<&Shown> = graph.iter().filter(|s| s.4.is_none()).collect();
    println!(
        "SeaBIOS's function graph: {} spans in trace-cmd's report ({closed} closed, {} open), \
         {} in the trace processor's slice table",
        graph.len(),
        open.len(),
        slices.len()
    );
    assert!(closed > 1000, "{closed} closed spans");
    assert_eq!(graph.len(), slices.len(), "one slice per span of the graph");
    for (g, s) in graph.iter().zip(&slices) {
        // The duration as trace-cmd prints it: truncated to its unit.
        let unit = g.5;
        let s = (
            s.0.clone(),
            s.1.clone(),
            s.2,
            s.3,
            s.4.map(|d| d / unit * unit),
            unit,
        );
        assert_eq!(*g, s, "trace-cmd's span and the trace processor's");
    }
}
