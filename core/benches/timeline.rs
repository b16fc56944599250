//! Guest→host conversion throughput of a long trace: streaming cursor vs per-event binary search.
//!
//! The workload is one vCPU's trace of ~12 s after vmtsync: 4096 segments (one re-sync every
//! ~3 ms of a 3 GHz TSC, each with its own offset step and drift of up to ±20 000 ppb) and
//! 1 Mi guest timestamps in non-decreasing order spread over all of them (~256 per segment). Every variant converts the same buffer in the same run, so the ratio between
//! them is meaningful on a noisy shared machine even where absolute times are not.
//!
//! - `cursor_batch`: [`Cursor::try_convert_slice_floor`], the streaming fast path.
//! - `cursor_per_event`: [`Cursor::try_convert_floor`] called once per event.
//! - `binary_search_per_event`: `Timeline::try_convert_floor` per event — a binary search
//!   over the segment starts plus the checked linear mapping, which is trace-cmd's per-event
//!   approach (docs/trace-cmd.md); the baseline.
//! - `binary_search_dense_starts_per_event`: the same baseline searching a dense `Vec<u64>` of
//!   segment starts instead of the segments themselves: the strongest per-event binary search.
//! - `memory_floor_add_one`: not a converter; adds 1 to every tick of the same buffer, the
//!   cost of just streaming it through the cache hierarchy, for scale.
//!
//! A second group, `timeline_kvm_guest_to_host`, converts the same number of events on one
//! exact KVM segment (ratio 1.1 on VMX): `cursor_batch` there runs the corrected reciprocal
//! kernel, `binary_search_per_event` the mapping's exact division per event.
//!
//! Throughput is reported in events (elements) per second.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_core::sim::SplitMix64;
use vmtsync_core::timeline::{Cursor, Segment, Timeline};
use vmtsync_core::{GuestTicks, HostTicks};

/// Number of segments in the timeline.
const SEGMENTS: u64 = 4096;
/// Guest ticks between re-syncs: 3 ms at 3 GHz.
const RESYNC_TICKS: u64 = 9_000_000;
/// Number of events converted per iteration.
const EVENTS: usize = 1 << 20;

/// A value in `-range..range` from the fixed-seed generator, so every run converts the same
/// data.
fn signed(rng: &mut SplitMix64, range: u64) -> i64 {
    i64::try_from(rng.below(2 * range)).expect("range < 2^62")
        - i64::try_from(range).expect("range < 2^62")
}

/// Segments as an estimator would produce them: at each re-sync, the host tick of the start
/// continues the previous line plus a small measured step, with a fresh drift estimate.
fn segments(rng: &mut SplitMix64) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut guest = 1_000_000_000_000u64; // The guest booted ~5 minutes before tracing.
    let mut host = 7_000_000_000_000u64;
    for _ in 0..SEGMENTS {
        let ppb = signed(rng, 20_000);
        let step = signed(rng, 2_000);
        let start_host = host.checked_add_signed(step).expect("host tick in range");
        let segment = Segment::try_from_anchor_ppb(
            GuestTicks(guest),
            GuestTicks(guest),
            HostTicks(start_host),
            ppb,
        )
        .expect("segment in range");
        out.push(segment);
        let len = RESYNC_TICKS + rng.below(RESYNC_TICKS / 4);
        let next_guest = guest + len;
        host = segment
            .try_convert_floor(GuestTicks(next_guest))
            .expect("host tick in range")
            .get();
        guest = next_guest;
    }
    out
}

/// `EVENTS` sorted guest timestamps spread uniformly from the first segment start to one
/// re-sync interval after the last.
fn events(rng: &mut SplitMix64, segs: &[Segment]) -> Vec<u64> {
    let first = segs.first().expect("segments").start().get();
    let last = segs.last().expect("segments").start().get() + RESYNC_TICKS;
    let mut out: Vec<u64> = (0..EVENTS)
        .map(|_| first + rng.below(last - first))
        .collect();
    out.sort_unstable();
    out
}

fn convert_batch(timeline: Timeline<'_>, buf: &mut [u64]) {
    timeline
        .cursor()
        .try_convert_slice_floor(buf)
        .expect("every event maps");
}

fn convert_cursor_per_event(timeline: Timeline<'_>, buf: &mut [u64]) {
    let mut cursor: Cursor<'_> = timeline.cursor();
    for tick in buf.iter_mut() {
        *tick = cursor
            .try_convert_floor(GuestTicks(*tick))
            .expect("every event maps")
            .get();
    }
}

fn convert_binary_search(timeline: Timeline<'_>, buf: &mut [u64]) {
    for tick in buf.iter_mut() {
        *tick = timeline
            .try_convert_floor(GuestTicks(*tick))
            .expect("every event maps")
            .get();
    }
}

/// The baseline with the search on a dense array of starts (8 bytes per segment instead of a
/// whole `Segment`), the most cache-friendly per-event binary search.
fn convert_binary_search_dense(timeline: Timeline<'_>, starts: &[u64], buf: &mut [u64]) {
    let segs = timeline.segments();
    for tick in buf.iter_mut() {
        let index = starts.partition_point(|&s| s <= *tick).saturating_sub(1);
        *tick = segs[index]
            .try_convert_floor(GuestTicks(*tick))
            .expect("every event maps")
            .get();
    }
}

/// A named way to convert a whole buffer of guest ticks to host ticks in place.
type Variant<'a> = (&'a str, &'a dyn Fn(&mut [u64]));

fn add_one(buf: &mut [u64]) {
    for tick in buf.iter_mut() {
        *tick = tick.wrapping_add(1);
    }
}

fn bench(c: &mut Criterion) {
    let mut rng = SplitMix64::new(0x5eed_7157_11fe_0001);
    let segs = segments(&mut rng);
    let timeline = Timeline::new(&segs).expect("sorted segments");
    let input = events(&mut rng, &segs);

    let starts: Vec<u64> = segs.iter().map(|s| s.start().get()).collect();
    let variants: [Variant<'_>; 5] = [
        ("cursor_batch", &|buf| convert_batch(timeline, buf)),
        ("cursor_per_event", &|buf| {
            convert_cursor_per_event(timeline, buf)
        }),
        ("binary_search_per_event", &|buf| {
            convert_binary_search(timeline, buf)
        }),
        ("binary_search_dense_starts_per_event", &|buf| {
            convert_binary_search_dense(timeline, &starts, buf);
        }),
        ("memory_floor_add_one", &add_one),
    ];

    // The converters must agree before their speed means anything.
    let mut reference = input.clone();
    convert_binary_search(timeline, &mut reference);
    for (name, convert) in &variants[..4] {
        let mut out = input.clone();
        convert(&mut out);
        assert!(out == reference, "{name} differs from the binary search");
    }

    let mut group = c.benchmark_group("timeline_guest_to_host_4096_segments");
    group.throughput(Throughput::Elements(u64::try_from(EVENTS).expect("fits")));
    group.sample_size(30);
    for (name, convert) in variants {
        group.bench_function(name, |b| {
            b.iter_batched_ref(
                || input.clone(),
                |buf| convert(black_box(buf.as_mut_slice())),
                BatchSize::LargeInput,
            );
        });
    }
    group.finish();
    bench_kvm(c, &input);
}

/// One exact KVM segment (guest booted 10^12 host ticks after the host, ratio 1.1 on VMX) and
/// guest readings spread over ~12 s of it.
fn bench_kvm(c: &mut Criterion, linear_input: &[u64]) {
    let ratio = (1u64 << 48) + (1u64 << 48) / 10;
    let map = KvmTscMapping::try_new(-1_000_000_000_000, ratio, 48).expect("valid mapping");
    let segs = [Segment::try_from_kvm_mapping(GuestTicks(0), map).expect("valid segment")];
    let timeline = Timeline::new(&segs).expect("one segment");
    // Reuse the sorted linear workload's spacing, moved to where the KVM guest clock is.
    let first = linear_input[0];
    let input: Vec<u64> = linear_input
        .iter()
        .map(|&t| t - first + 2_000_000_000_000)
        .collect();
    let mut reference = input.clone();
    convert_binary_search(timeline, &mut reference);
    let mut out = input.clone();
    convert_batch(timeline, &mut out);
    assert!(out == reference, "KVM batch differs from the exact inverse");

    let mut group = c.benchmark_group("timeline_kvm_guest_to_host");
    group.throughput(Throughput::Elements(u64::try_from(EVENTS).expect("fits")));
    group.sample_size(30);
    let variants: [Variant<'_>; 2] = [
        ("cursor_batch", &|buf| convert_batch(timeline, buf)),
        ("binary_search_per_event", &|buf| {
            convert_binary_search(timeline, buf)
        }),
    ];
    for (name, convert) in variants {
        group.bench_function(name, |b| {
            b.iter_batched_ref(
                || input.clone(),
                |buf| convert(black_box(buf.as_mut_slice())),
                BatchSize::LargeInput,
            );
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
