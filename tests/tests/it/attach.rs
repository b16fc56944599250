//! Tier 2: real trace.dat files made here by `trace-cmd extract` (zstd-compressed v7, x86-tsc),
//! read by our reader and rewritten by `vmtsync trace-cmd attach`, checked with trace-cmd 3.1.6.
//!
//! Truth comes from trace-cmd itself: `trace-cmd report` of the input gives every event's CPU,
//! raw timestamp and name; `dump --events` lists the stored formats. An attached copy must show
//! every event moved by exactly what the known mapping says.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use vmtsync::tracedat::{for_each_record, read_event_formats, read_layout};
use vmtsync_tests::{is_root, require};

use crate::tracedat::{Instance, have_trace_cmd, report, trace_cmd};

/// Makes a real trace here: a private tracefs instance on `x86-tsc` with the scheduler events
/// on while this process sleeps and writes markers, then `trace-cmd extract` (v7, zstd). `None`
/// (after `require` said why) when trace-cmd, root or tracefs is missing.
pub(crate) fn real_trace(test: &str, dir: &Path, file: &str) -> Option<PathBuf> {
    if !have_trace_cmd(test) || !require(test, is_root(), "needs root (tracefs instances)") {
        return None;
    }
    let tracefs = vmtsync::ftrace::find_tracefs(None, "sched/sched_switch");
    if !require(
        test,
        tracefs.is_ok(),
        "no tracefs at /sys/kernel/{debug/,}tracing",
    ) {
        return None;
    }
    let name = format!(
        "vmtsync_attach_{}_{}",
        std::process::id(),
        file.replace('.', "_")
    );
    let inst = Instance(tracefs.unwrap().join("instances").join(&name));
    std::fs::create_dir(&inst.0).expect("create tracefs instance");
    std::fs::write(inst.0.join("trace_clock"), "x86-tsc").expect("set x86-tsc");
    for ev in ["sched/sched_switch", "sched/sched_wakeup"] {
        std::fs::write(inst.0.join("events").join(ev).join("enable"), "1").expect(ev);
    }
    for k in 0..40 {
        std::thread::sleep(std::time::Duration::from_millis(2));
        std::fs::write(inst.0.join("trace_marker"), format!("vmtsync-attach {k}")).unwrap();
    }
    std::fs::write(inst.0.join("tracing_on"), "0").unwrap();
    let out = dir.join(file);
    let o = Command::new("trace-cmd")
        .args(["extract", "-B", &name, "-o", out.to_str().unwrap()])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "extract: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    drop(inst);
    Some(out)
}

/// `(cpu, raw ts, event name)` of every event `trace-cmd report` shows.
fn reported_events(path: &Path) -> Vec<(u32, u64, String)> {
    let mut v: Vec<_> = report(&["report", "-t", "--raw-ts", "-i", path.to_str().unwrap()])
        .into_iter()
        .map(|l| {
            let name = l.rest.split(':').next().unwrap_or("").trim().to_string();
            (l.cpu, l.ts, name)
        })
        .collect();
    v.sort();
    v
}

#[test]
fn the_reader_decompresses_a_real_extract_like_trace_cmd_report() {
    let test = "attach::the_reader_decompresses_a_real_extract_like_trace_cmd_report";
    let dir = tempfile::tempdir().unwrap();
    let Some(path) = real_trace(test, dir.path(), "host.dat") else {
        return;
    };
    let dir6 = dir.path().join("host6.dat");
    let o = trace_cmd(&[
        "convert",
        "--file-version",
        "6",
        "-i",
        path.to_str().unwrap(),
        "-o",
        dir6.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = reported_events(&path);
    assert!(want.len() > 40, "too few events to compare: {}", want.len());
    for file in [&path, &dir6] {
        let layout = read_layout(file).unwrap();
        if file == &path {
            assert_eq!(layout.compression.as_deref(), Some("zstd"));
            assert!(layout.buffers.iter().any(|b| b.compressed));
        }
        let formats = read_event_formats(file, &layout).unwrap();
        let names: std::collections::BTreeMap<u16, String> = formats
            .iter()
            .filter_map(|f| Some((f.id?, f.name.clone())))
            .collect();
        // Every stored format, as `trace-cmd dump --events` lists them (name and ID lines).
        let dump = trace_cmd(&["dump", "--events", "-i", file.to_str().unwrap()]);
        let text = String::from_utf8_lossy(&dump.stdout);
        let dumped: BTreeSet<(String, u16)> = text
            .split("\nname: ")
            .skip(1)
            .filter_map(|b| {
                let name = b.lines().next()?.trim().to_string();
                let id = b
                    .lines()
                    .nth(1)?
                    .strip_prefix("ID: ")?
                    .trim()
                    .parse()
                    .ok()?;
                Some((name, id))
            })
            .collect();
        let ours: BTreeSet<(String, u16)> = formats
            .iter()
            .filter(|f| f.system != "ftrace")
            .filter_map(|f| Some((f.name.clone(), f.id?)))
            .collect();
        assert!(
            dumped.len() > 100,
            "dump --events: {} formats",
            dumped.len()
        );
        assert_eq!(ours, dumped, "{}", file.display());
        assert!(
            formats
                .iter()
                .any(|f| f.system == "sched" && f.name == "sched_switch")
        );
        let mut got = Vec::new();
        for b in 0..layout.buffers.len() {
            for_each_record(file, &layout, b, |cpu, ts, data| {
                let ty = u16::from_le_bytes([data[0], data[1]]);
                got.push((cpu, ts, names.get(&ty).cloned().unwrap_or_default()));
            })
            .unwrap();
        }
        got.sort();
        assert_eq!(got, want, "{}", file.display());
    }
}
