//! CTF writing speed (goal: at least 20 M events/s in-process).
//!
//! `push` times only [`GuestCtf::push`] of 1 Mi events with every field (vCPU, id, host TSC,
//! guest TSC, interval, payload), alternating between two vCPUs, half with an 8-byte payload;
//! packets are written to the stream files as they fill, as in `vmtsync record --format ctf`.
//! `push_and_finish` adds `finish` (last packets, metadata, fsync, rename). Memory: see
//! `examples/ctf_write.rs` (max RSS for 1 M vs 10 M events).

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::{EVENTS, time_pushes, writer_group};
use criterion::{Criterion, criterion_group, criterion_main};
use vmtsync::formats::ctf::{CtfOptions, GuestCtf, GuestFields};
use vmtsync::formats::{Bound, ExportEvent, Payload};

fn opts() -> CtfOptions {
    CtfOptions {
        tsc_hz: 2_300_000_000,
        name: "bench".into(),
        env: Vec::new(),
    }
}

fn push_all(w: &mut GuestCtf, n: u64) {
    let mut ts = [1_000_000u64; 2];
    for i in 0..n {
        let vcpu = u32::from(i & 1 == 1);
        let t = &mut ts[vcpu as usize];
        *t += 700;
        let bytes = i.to_le_bytes();
        let payload = Payload::new(if i & 2 == 0 { &[] } else { &bytes }).unwrap_or_default();
        let e = ExportEvent {
            vcpu,
            id: u16::try_from(i & 0xffff).unwrap_or(0),
            guest_tsc: Some(*t + 123_456),
            host_tsc: *t,
            bound: Some(Bound {
                lo: *t - 5_000,
                hi: *t + 5_000,
            }),
            payload,
        };
        w.push(black_box(&e)).unwrap();
    }
}

fn bench_write(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let mut g = writer_group(c, "ctf");
    let mut k = 0u64;
    let mut next = || {
        k += 1;
        dir.path().join(format!("t{k}"))
    };
    g.bench_function("push", |b| {
        b.iter_custom(|iters| {
            time_pushes(
                iters,
                || {
                    let out = next();
                    (
                        GuestCtf::create(&out, &opts(), GuestFields::ALL).unwrap(),
                        out,
                    )
                },
                |(w, _)| push_all(w, EVENTS),
                |(w, out)| {
                    w.finish().unwrap();
                    std::fs::remove_dir_all(&out).unwrap();
                },
            )
        });
    });
    g.bench_function("push_and_finish", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let out = next();
                let t = Instant::now();
                let mut w = GuestCtf::create(&out, &opts(), GuestFields::ALL).unwrap();
                push_all(&mut w, EVENTS);
                w.finish().unwrap();
                total += t.elapsed();
                std::fs::remove_dir_all(&out).unwrap();
            }
            total
        });
    });
    g.finish();
}

criterion_group!(benches, bench_write);
criterion_main!(benches);
