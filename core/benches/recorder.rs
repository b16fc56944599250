//! Recorder cost per event on the guest's code path: `RingRef::record` with the real ordered TSC
//! read (`lfence; rdtsc`, what the agent uses) against the TSC read alone, for a
//! stop-when-full ring and a flight recorder (through its `Producer` handle), plus the
//! consumer's cost per record; and side by side the two recorders over those rings, the
//! `static` `Recorder` and `MemRecorder` in caller-provided memory (what the C ABI's
//! `vmtsync_record` mirrors), each through its `ring(vcpu)` then `record` path on the same
//! shape.
//!
//! Run with `cargo bench -p vmtsync-core --bench recorder`. Compare the numbers of one run
//! with each other (the machine is shared); absolute times are only indicative.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use vmtsync_core::arch::Tsc;
use vmtsync_core::arch::x86_64::{NativeCpuid, NativeTsc};
use vmtsync_core::recorder::{MemRecorder, Mode, Recorder, Ring, Slot};

static RING: Ring<4096> = Ring::new();
static FLIGHT: Ring<4096> = Ring::new_flight();

/// One vCPU of 4096 records, the shape of `RING`, as a `Recorder` and in caller memory.
static RECORDER: Recorder<1, 4096> = Recorder::new();
const MEM_SLOTS: usize = match MemRecorder::storage_slots(1, 4096) {
    Some(n) => n,
    None => panic!("a valid shape"),
};
/// The caller-provided memory: 64-byte aligned, as `MemRecorder::init` requires.
#[repr(C, align(64))]
struct Storage([Slot; MEM_SLOTS]);
static MEM: Storage = Storage([const { Slot::new() }; MEM_SLOTS]);

fn bench_recorder(c: &mut Criterion) {
    let tsc = NativeTsc::detect(&NativeCpuid);
    let mut g = c.benchmark_group("recorder");
    g.throughput(Throughput::Elements(1));
    g.bench_function("tsc_read_alone", |b| {
        b.iter(|| black_box(tsc.read_ordered()))
    });
    let payload = 0xfeed_u64.to_le_bytes();
    // Record then pop: the ring never fills, so every iteration is a stored event.
    g.bench_function("record_8B_payload_then_pop", |b| {
        b.iter(|| {
            let _ = RING.view().record(&tsc, black_box(7), black_box(&payload));
            black_box(RING.view().pop())
        });
    });
    // Record only, draining outside the timed loop in batches, so the producer's path alone
    // is timed.
    g.bench_function("record_8B_payload", |b| {
        record_batched(b, drain_ring, || {
            let _ = RING.view().record(&tsc, black_box(7), black_box(&payload));
        });
    });
    g.bench_function("record_no_payload", |b| {
        record_batched(b, drain_ring, || {
            let _ = RING.view().record(&tsc, black_box(7), &[]);
        });
    });
    // The two recorders side by side, stop-when-full, drained outside the timed part.
    let rec_ring = RECORDER.ring(0).expect("vCPU 0");
    let drain_recorder = || while rec_ring.pop().is_some() {};
    g.bench_function("recorder_record_no_payload", |b| {
        record_batched(b, drain_recorder, || {
            let _ = RECORDER
                .ring(black_box(0))
                .map(|r| r.record(&tsc, black_box(7), &[]));
        });
    });
    g.bench_function("recorder_record_8B_payload", |b| {
        record_batched(b, drain_recorder, || {
            let _ = RECORDER
                .ring(black_box(0))
                .map(|r| r.record(&tsc, black_box(7), black_box(&payload)));
        });
    });
    let mem = MemRecorder::init(&MEM.0, 1, 4096, Mode::StopWhenFull).expect("lays out");
    let mem_ring = mem.ring(0).expect("vCPU 0");
    let drain_mem = || while mem_ring.pop().is_some() {};
    g.bench_function("mem_recorder_record_no_payload", |b| {
        record_batched(b, drain_mem, || {
            let _ = mem
                .ring(black_box(0))
                .map(|r| r.record(&tsc, black_box(7), &[]));
        });
    });
    g.bench_function("mem_recorder_record_8B_payload", |b| {
        record_batched(b, drain_mem, || {
            let _ = mem
                .ring(black_box(0))
                .map(|r| r.record(&tsc, black_box(7), black_box(&payload)));
        });
    });
    // A flight ring is never full: it laps itself, and every iteration is a stored event
    // (the first 4096 into empty slots, the rest overwriting), as in a guest nobody drains.
    let producer = FLIGHT.view().producer().expect("the bench's one producer");
    g.bench_function("flight_record_no_payload", |b| {
        b.iter(|| producer.record(&tsc, black_box(7), &[]));
    });
    g.bench_function("flight_record_8B_payload", |b| {
        b.iter(|| producer.record(&tsc, black_box(7), black_box(&payload)));
    });
    // The ring's own cost in both modes, with a clock that costs nothing (a constant), so the
    // difference between the modes is not buried under the TSC read's variance.
    let fixed = Fixed;
    // Both recorders' own cost, with the constant clock.
    g.bench_function("recorder_record_no_payload_fixed_clock", |b| {
        record_batched(b, drain_recorder, || {
            let _ = RECORDER
                .ring(black_box(0))
                .map(|r| r.record(&fixed, black_box(7), &[]));
        });
    });
    g.bench_function("mem_recorder_record_no_payload_fixed_clock", |b| {
        record_batched(b, drain_mem, || {
            let _ = mem
                .ring(black_box(0))
                .map(|r| r.record(&fixed, black_box(7), &[]));
        });
    });
    g.bench_function("record_no_payload_fixed_clock", |b| {
        record_batched(b, drain_ring, || {
            let _ = RING.view().record(&fixed, black_box(7), &[]);
        });
    });
    g.bench_function("flight_record_no_payload_fixed_clock", |b| {
        b.iter(|| producer.record(&fixed, black_box(7), &[]));
    });
    g.finish();
    assert_eq!(
        RING.view().dropped(),
        0,
        "the bench must never fill the ring"
    );
    assert_eq!(
        rec_ring.dropped(),
        0,
        "the bench must never fill the Recorder's ring"
    );
    assert_eq!(
        mem_ring.dropped(),
        0,
        "the bench must never fill the MemRecorder's ring"
    );
    assert_eq!(FLIGHT.view().refused(), 0, "a flight ring never refuses");
}

/// Empties `RING`.
fn drain_ring() {
    while RING.view().pop().is_some() {}
}

/// Times `record` (one record call) alone: it runs in batches of the ring's size and the
/// ring is drained by `drain` outside the timed part, so the producer's path is all that is
/// measured and the ring never fills.
fn record_batched(b: &mut criterion::Bencher<'_>, drain: impl Fn(), record: impl Fn()) {
    b.iter_custom(|iters| {
        let mut total = std::time::Duration::ZERO;
        let mut left = iters;
        while left > 0 {
            let n = left.min(4096);
            let start = std::time::Instant::now();
            for _ in 0..n {
                record();
            }
            total += start.elapsed();
            drain();
            left -= n;
        }
        total
    });
}

/// A clock that reads a constant: no fence, no `rdtsc`.
struct Fixed;

impl Tsc for Fixed {
    #[inline]
    fn read_ordered(&self) -> u64 {
        black_box(1)
    }
}

criterion_group!(benches, bench_recorder);
criterion_main!(benches);
