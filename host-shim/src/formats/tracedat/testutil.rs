//! Fixtures the trace.dat modules' tests share.

use std::path::{Path, PathBuf};

use super::reader::{Event, for_each_event, read_layout};
use super::writer::{FileVersion, TraceDatWriter, WriterOptions};

/// A stand-in trace written by our own writer (the tier-2 tests use real `trace-cmd` files):
/// `dir/{name}{version:?}.dat`, trace id `trace_id`, 2 CPUs taking turns, `n` events without
/// payload `step` ticks apart from `first` on.
pub(super) fn two_cpu_trace(
    dir: &Path,
    name: &str,
    version: FileVersion,
    trace_id: u64,
    (n, first, step): (u64, u64, u64),
) -> PathBuf {
    let path = dir.join(format!("{name}{version:?}.dat"));
    let mut opts = WriterOptions::new(2, trace_id);
    opts.version = version;
    let mut w = TraceDatWriter::create(&path, opts).unwrap();
    for i in 0..n {
        w.push(u32::from(i % 2 == 1), first + i * step, 0, &[])
            .unwrap();
    }
    w.finish(None).unwrap();
    path
}

/// Every event of the trace at `path`, buffer by buffer in file order: what a copy or a rewrite
/// of a trace must keep.
pub(super) fn all_events(path: &Path) -> Vec<Event> {
    let l = read_layout(path).unwrap();
    let mut v = Vec::new();
    for b in 0..l.buffers.len() {
        for_each_event(path, &l, b, |e| v.push(*e)).unwrap();
    }
    v
}
