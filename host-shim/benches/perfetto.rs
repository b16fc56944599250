//! Perfetto trace writing speed (goal: at least 20 M events/s in-process).
//!
//! `push` times only [`PerfettoWriter::push`] of 1 Mi events (packets encoded one by one and
//! streamed to a temporary file, as `vmtsync export perfetto` and `record --format perfetto`
//! do); `push_and_finish` adds `finish` (flush, fsync, rename). Events alternate between two
//! vCPUs over 8 ids, each with its guest TSC and guaranteed interval (the JSON Lines case, the
//! most arguments), every other one with an 8-byte payload; `push_host_only` writes events as
//! a pre-converted trace.dat gives them (host TSC and id only). Memory: see
//! `examples/perfetto_write.rs` (max RSS for 1 M vs 10 M events).

mod common;

use std::hint::black_box;

use common::{EVENTS, time_pushes, writer_group};
use criterion::{Criterion, criterion_group, criterion_main};
use vmtsync::formats::perfetto::clock::{BootClock, ClockSnapshot};
use vmtsync::formats::perfetto::{PerfettoOptions, PerfettoWriter};
use vmtsync::formats::{Bound, ExportEvent, Payload};

fn options() -> PerfettoOptions {
    let s = |tsc, ns| ClockSnapshot {
        tsc,
        boottime_ns: ns,
        resolution: 40,
    };
    PerfettoOptions {
        machine_id: 1,
        guest_name: "bench".into(),
        // 2.3 ticks per ns, as on the benchmark machine.
        clock: BootClock::new(vec![
            s(1 << 40, 1 << 39),
            s((1 << 40) + 23_000_000_000, (1 << 39) + 10_000_000_000),
        ])
        .unwrap(),
    }
}

/// `full`: every argument (the JSON Lines case); else the host TSC only (a pre-converted
/// trace.dat: no guest TSC, no interval, no payload).
fn push_all(w: &mut PerfettoWriter, n: u64, full: bool) {
    let mut host = 1u64 << 40;
    let empty = Payload::default();
    for i in 0..n {
        host += 700;
        let bytes = i.to_le_bytes();
        let e = if full {
            ExportEvent {
                vcpu: u32::from(i & 1 == 1),
                id: u16::try_from(i & 7).unwrap_or(0),
                guest_tsc: Some(host + 12_345),
                host_tsc: host,
                bound: Some(Bound {
                    lo: host - 5_000,
                    hi: host + 5_000,
                }),
                payload: Payload::new(if i & 2 == 0 { &[] } else { &bytes }).unwrap(),
            }
        } else {
            ExportEvent {
                vcpu: u32::from(i & 1 == 1),
                id: u16::try_from(i & 7).unwrap_or(0),
                guest_tsc: None,
                host_tsc: host,
                bound: None,
                payload: empty,
            }
        };
        w.push(black_box(&e)).unwrap();
    }
}

fn bench_write(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bench.perfetto-trace");
    let mut g = writer_group(c, "perfetto");
    for (name, full) in [("push", true), ("push_host_only", false)] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                time_pushes(
                    iters,
                    || PerfettoWriter::create(&path, options()).unwrap(),
                    |w| push_all(w, EVENTS, full),
                    |w| {
                        w.finish().unwrap();
                    },
                )
            });
        });
    }
    g.bench_function("push_and_finish", |b| {
        b.iter(|| {
            let mut w = PerfettoWriter::create(&path, options()).unwrap();
            push_all(&mut w, EVENTS, true);
            w.finish().unwrap()
        });
    });
    g.finish();
}

criterion_group!(benches, bench_write);
criterion_main!(benches);
