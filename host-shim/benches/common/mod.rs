//! What the writer benches (trace.dat, CTF, Perfetto) share: the events an iteration writes,
//! the group settings, and the one way they time the pushes alone.

use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput};

/// Events one iteration writes.
pub const EVENTS: u64 = 1 << 20;

/// A group of writer benches: an iteration writes [`EVENTS`] events, so 10 samples are enough
/// and the throughput is in events.
pub fn writer_group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(10);
    g.throughput(Throughput::Elements(EVENTS));
    g
}

/// The time `push` takes over `iters` writers, each made by `create` and closed by `finish`
/// outside the clock, so that creating and finishing a file do not count.
pub fn time_pushes<W>(
    iters: u64,
    mut create: impl FnMut() -> W,
    mut push: impl FnMut(&mut W),
    mut finish: impl FnMut(W),
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let mut w = create();
        let t = Instant::now();
        push(&mut w);
        total += t.elapsed();
        finish(w);
    }
    total
}
