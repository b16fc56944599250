//! trace.dat writing speed (goal: at least 20 M events/s in-process).
//!
//! `push` times only [`TraceDatWriter::push`] of 1 Mi events (pages fill and are written to a
//! temporary file as they would be in `vmtsync record`); `push_and_finish` also includes
//! `finish` (spill append, options, fsync and the full read-back verification). Events
//! alternate between two vCPUs, half carry an 8-byte payload, every 1000th gap needs a time
//! extend. Memory: see `examples/tracedat_write.rs` (max RSS for 1 M vs 10 M events).

mod common;

use std::hint::black_box;

use common::{EVENTS, time_pushes, writer_group};
use criterion::{Criterion, criterion_group, criterion_main};
use vmtsync::formats::tracedat::{FileVersion, TraceDatWriter, WriterOptions};

fn push_all(w: &mut TraceDatWriter, n: u64) {
    let mut ts = [1_000_000u64; 2];
    for i in 0..n {
        let cpu = u32::from(i & 1 == 1);
        let t = &mut ts[cpu as usize];
        *t += if i % 1000 == 999 { 1 << 30 } else { 700 };
        let payload = i.to_le_bytes();
        let payload: &[u8] = if i & 2 == 0 { &[] } else { &payload };
        let id = u32::try_from(i & 0xffff_ffff).unwrap_or(0);
        w.push(cpu, *t, id, black_box(payload)).unwrap();
    }
}

fn bench_write(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bench.dat");
    let mut g = writer_group(c, "tracedat");
    for (name, version) in [("v7", FileVersion::V7), ("v6", FileVersion::V6)] {
        g.bench_function(format!("push_{name}"), |b| {
            b.iter_custom(|iters| {
                time_pushes(
                    iters,
                    || {
                        let mut opts = WriterOptions::new(2, 1);
                        opts.version = version;
                        TraceDatWriter::create(&path, opts).unwrap()
                    },
                    |w| push_all(w, EVENTS),
                    |w| {
                        w.finish(None).unwrap();
                    },
                )
            });
        });
        g.bench_function(format!("push_and_finish_{name}"), |b| {
            b.iter(|| {
                let mut opts = WriterOptions::new(2, 1);
                opts.version = version;
                let mut w = TraceDatWriter::create(&path, opts).unwrap();
                push_all(&mut w, EVENTS);
                w.finish(None).unwrap()
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench_write);
criterion_main!(benches);
