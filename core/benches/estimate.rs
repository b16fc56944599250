//! Estimator cost per sample, all four estimators on the same simulated samples.
//!
//! Throughput is reported in elements (samples) per second; ns per sample is its inverse.
//! Compare estimators within one run: the machine is shared and absolute times are noisy.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use vmtsync_core::HostTicks;
use vmtsync_core::estimate::{
    ProbeSample, estimate_drift, estimate_offset, trace_cmd_fastest, trace_cmd_histogram,
};
use vmtsync_core::sim::{Delay, GuestClock, Link, Sim};

/// The link of the simulation tests: heavy-tailed asymmetric jitter plus 2 % outliers.
fn samples(n: usize, seed: u64) -> Vec<ProbeSample> {
    let link = Link {
        forward: Delay::Exponential {
            min: 400,
            mean: 1_500,
        },
        backward: Delay::Exponential {
            min: 400,
            mean: 150,
        },
        outlier_ppm: 20_000,
        outlier: Delay::Uniform {
            min: 10_000,
            max: 2_000_000,
        },
        gap: Delay::Uniform {
            min: 1_000_000,
            max: 10_000_000,
        },
    };
    let clock = GuestClock::with_drift_ppb(123_456_789, 0).expect("positive rate");
    let mut sim = Sim::new(seed, HostTicks(1 << 40), clock, link, 0);
    (0..n)
        .map(|_| sim.probe().expect("time fits u64"))
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("estimate");
    // 64: our default round; 339: trace-cmd's PTP_SYNC_LOOP.
    for n in [64_usize, 339] {
        let s = samples(n, 7);
        g.throughput(Throughput::Elements(u64::try_from(n).expect("small")));
        g.bench_with_input(BenchmarkId::new("trace_cmd_fastest", n), &s, |b, s| {
            b.iter(|| trace_cmd_fastest(black_box(s)));
        });
        g.bench_with_input(BenchmarkId::new("trace_cmd_histogram", n), &s, |b, s| {
            b.iter(|| trace_cmd_histogram(black_box(s)));
        });
        g.bench_with_input(BenchmarkId::new("ours_offset_interval", n), &s, |b, s| {
            b.iter(|| estimate_offset(black_box(s)));
        });
        g.bench_with_input(BenchmarkId::new("ours_drift_hull32", n), &s, |b, s| {
            b.iter(|| estimate_drift::<32>(black_box(s)));
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
