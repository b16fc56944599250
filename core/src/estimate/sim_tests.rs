//! Seeded simulations comparing our estimators with trace-cmd's on the same samples.
//!
//! Every run is reproducible from its seed; a failing assertion prints the seed.

use std::println;
use std::vec::Vec;

use super::{
    DriftEstimator, EstimateError, OffsetInterval, ProbeSample, estimate_drift, estimate_offset,
    trace_cmd_fastest, trace_cmd_histogram,
};
use crate::HostTicks;
use crate::sim::{self, Delay, GuestClock, Link, Sim, SplitMix64};

const PROBES: usize = 64;

fn median(v: &mut [u64]) -> u64 {
    sim::median(v).expect("every run produces samples")
}

/// Heavy-tailed jitter that is much larger in one direction, plus rare huge outliers.
fn asymmetric_link(forward_heavy: bool) -> Link {
    let heavy = Delay::Exponential {
        min: 400,
        mean: 1_500,
    };
    let light = Delay::Exponential {
        min: 400,
        mean: 150,
    };
    let (forward, backward) = if forward_heavy {
        (heavy, light)
    } else {
        (light, heavy)
    };
    Link {
        forward,
        backward,
        outlier_ppm: 20_000,
        outlier: Delay::Uniform {
            min: 10_000,
            max: 2_000_000,
        },
        gap: Delay::Uniform {
            min: 1_000,
            max: 50_000,
        },
    }
}

/// A simulation whose offset, start time and link direction are drawn from `seed`.
fn sim_for(seed: u64, clock: impl FnOnce(i64) -> GuestClock) -> Sim {
    let mut params = SplitMix64::new(seed ^ 0x5EED_0000_0000_0000);
    let offset = i64::try_from(params.below(1 << 41)).unwrap() - (1 << 40);
    let start = HostTicks((1 << 41) + params.below(1 << 40));
    let link = asymmetric_link(params.below(2) == 0);
    Sim::new(seed, start, clock(offset), link, 0)
}

#[test]
fn estimate_constant_offset_10k_runs_vs_trace_cmd() {
    const RUNS: u64 = 10_000;
    let mut ours = Vec::new();
    let mut fastest = Vec::new();
    let mut hist = Vec::new();
    let mut widths = Vec::new();
    let mut samples = [ProbeSample::default(); PROBES];
    for seed in 0..RUNS {
        let mut sim = sim_for(seed, GuestClock::constant);
        sim.fill(&mut samples).expect("simulated time fits u64");
        let truth = sim.clock.offset;
        let e = estimate_offset(&samples).unwrap_or_else(|err| panic!("seed {seed}: {err:?}"));
        assert!(
            e.min <= truth && truth <= e.max,
            "seed {seed}: truth {truth} outside [{}, {}]",
            e.min,
            e.max
        );
        let tc = trace_cmd_fastest(&samples).unwrap_or_else(|err| panic!("seed {seed}: {err:?}"));
        let th = trace_cmd_histogram(&samples).unwrap_or_else(|err| panic!("seed {seed}: {err:?}"));
        ours.push(e.offset.abs_diff(truth));
        fastest.push(tc.offset.abs_diff(truth));
        hist.push(th.offset.abs_diff(truth));
        widths.push(e.width());
    }
    let (m_ours, m_fast, m_hist) = (median(&mut ours), median(&mut fastest), median(&mut hist));
    let m_width = median(&mut widths);
    println!(
        "constant offset, {RUNS} runs x {PROBES} probes: median |error| ours {m_ours} ticks, \
         trace-cmd fastest {m_fast}, trace-cmd histogram {m_hist}; median interval width {m_width}; \
         truth inside our interval in 100% of runs"
    );
    println!(
        "p90 |error|: ours {}, fastest {}, histogram {}; max ours {}, max fastest {}",
        ours[ours.len() * 9 / 10],
        fastest[fastest.len() * 9 / 10],
        hist[hist.len() * 9 / 10],
        ours[ours.len() - 1],
        fastest[fastest.len() - 1],
    );
    assert!(
        m_ours <= m_fast,
        "our median error {m_ours} exceeds trace-cmd fastest's {m_fast}"
    );
}

/// trace-cmd's view of drift: one fastest-RTT PTP sample per half of the probes, and the
/// reader's linear interpolation between them (docs/trace-cmd.md), as a slope in ppb.
fn trace_cmd_interpolated_drift_ppb(samples: &[ProbeSample]) -> i64 {
    let (a, b) = samples.split_at(samples.len() / 2);
    let (a, b) = (trace_cmd_fastest(a).unwrap(), trace_cmd_fastest(b).unwrap());
    let d_off = i128::from(b.offset) - i128::from(a.offset);
    let d_ts = i128::from(b.at.0) - i128::from(a.at.0);
    i64::try_from(d_off * 1_000_000_000 / d_ts).unwrap()
}

#[test]
fn estimate_drift_50ppm_bounds_contain_truth() {
    const RUNS: u64 = 10_000;
    let mut drift_err = Vec::new();
    let mut drift_width = Vec::new();
    let mut tc_drift_err = Vec::new();
    let mut offset_err = Vec::new();
    let mut samples = [ProbeSample::default(); PROBES];
    for seed in 0..RUNS {
        // Alternate +50 ppm and -50 ppm; probes 1M..10M ticks apart (~0.1 s span at 3 GHz).
        let ppb = if seed % 2 == 0 { 50_000 } else { -50_000 };
        let mut sim = sim_for(seed, |off| GuestClock::with_drift_ppb(off, ppb).unwrap());
        sim.link.gap = Delay::Uniform {
            min: 1_000_000,
            max: 10_000_000,
        };
        sim.fill(&mut samples).expect("simulated time fits u64");
        let mut acc = DriftEstimator::<32>::new();
        for s in &samples {
            acc.push(s)
                .unwrap_or_else(|err| panic!("seed {seed}: {err:?}"));
        }
        let e = acc
            .estimate()
            .unwrap_or_else(|err| panic!("seed {seed}: {err:?}"));
        let c = sim.clock;
        assert_eq!(
            c.drift_ppb_within(e.drift_ppb_min, e.drift_ppb_max),
            Some(true),
            "seed {seed}: drift {ppb} outside [{}, {}]",
            e.drift_ppb_min,
            e.drift_ppb_max
        );
        // The point estimate is within the half-width it reports of the truth (it is the
        // midpoint rounded down, so this holds exactly when the truth is inside the bounds).
        let half_width = e.drift_ppb_max.abs_diff(e.drift_ppb_min).div_ceil(2);
        assert!(
            e.drift_ppb.abs_diff(ppb) <= half_width,
            "seed {seed}: drift {} is {} ppb from the truth {ppb}, more than half the bound width \
             {half_width}",
            e.drift_ppb,
            e.drift_ppb.abs_diff(ppb)
        );
        assert_eq!(
            c.offset_within(e.at, e.offset_min, e.offset_max),
            Some(true),
            "seed {seed}: {e:?}"
        );
        // Likewise the offset: the truth at `at` is within half the reported width of it.
        let half_width = i64::try_from(e.offset_max.abs_diff(e.offset_min).div_ceil(2)).unwrap();
        assert_eq!(
            c.offset_within(e.at, e.offset - half_width, e.offset + half_width),
            Some(true),
            "seed {seed}: {e:?}"
        );
        assert!(
            !e.saturated,
            "seed {seed}: 32 vertices should hold 64 probes' hulls"
        );
        // Anywhere in (and beyond) the sampled span, the offset bounds hold too.
        let first = samples[0].host_send.0;
        let last = samples[PROBES - 1].host_recv.0;
        for host in [
            first - 1_000_000,
            first,
            (first + last) / 2 + 12_345,
            last,
            last + 10_000_000,
        ] {
            let (lo, hi) = acc
                .offset_bounds_at(HostTicks(host))
                .unwrap_or_else(|err| panic!("seed {seed}: {err:?}"));
            assert_eq!(
                c.offset_within(HostTicks(host), lo, hi),
                Some(true),
                "seed {seed} at {host}"
            );
        }
        drift_err.push(e.drift_ppb.abs_diff(ppb));
        tc_drift_err.push(trace_cmd_interpolated_drift_ppb(&samples).abs_diff(ppb));
        drift_width.push(e.drift_ppb_max.abs_diff(e.drift_ppb_min));
        offset_err.push(e.offset_max.abs_diff(e.offset_min));
    }
    let (m_err, m_width, m_off) = (
        median(&mut drift_err),
        median(&mut drift_width),
        median(&mut offset_err),
    );
    let m_tc = median(&mut tc_drift_err);
    println!(
        "drift ±50 ppm, {RUNS} runs x {PROBES} probes: median |drift error| ours {m_err} ppb, \
         trace-cmd (fastest per half, interpolated) {m_tc} ppb; median drift bound width {m_width} \
         ppb, median offset bound width {m_off} ticks; truth inside all bounds"
    );
    assert!(
        m_err <= m_tc,
        "our median drift error {m_err} exceeds trace-cmd's {m_tc}"
    );
}

#[test]
fn estimate_kvm_scaling_ratio_is_bounded() {
    // A 1.5x scaled guest TSC (ratio 3<<47, frac 48): the "drift" is +500_000_000 ppb.
    for seed in 0..200 {
        let mut sim = sim_for(seed, |off| {
            GuestClock::with_kvm_scaling(off, 3 << 47, 48).unwrap()
        });
        sim.link.gap = Delay::Uniform {
            min: 20_000,
            max: 200_000,
        };
        let mut samples = [ProbeSample::default(); PROBES];
        sim.fill(&mut samples).expect("simulated time fits u64");
        let e = estimate_drift::<32>(&samples).unwrap_or_else(|err| panic!("seed {seed}: {err:?}"));
        assert_eq!(
            sim.clock.drift_ppb_within(e.drift_ppb_min, e.drift_ppb_max),
            Some(true),
            "seed {seed}"
        );
        assert_eq!(
            sim.clock.offset_within(e.at, e.offset_min, e.offset_max),
            Some(true),
            "seed {seed}"
        );
    }
}

/// A clock for the tight-probe runs: drift up to ±1000 ppm, or a KVM-scaled rate within ±6 %
/// of the host's on VMX or SVM, with an offset of either sign.
fn tight_clock(r: &mut SplitMix64) -> GuestClock {
    let offset = i64::try_from(r.below(1 << 31)).unwrap() - (1 << 30);
    match r.below(3) {
        0 => {
            let ppb = i64::try_from(r.below(2_000_001)).unwrap() - 1_000_000;
            GuestClock::with_drift_ppb(offset, ppb).unwrap()
        }
        kind => {
            let frac = if kind == 1 { 48 } else { 32 };
            let d = 1u64 << frac;
            let six_percent = d / 100 * 6;
            let ratio = d - six_percent + r.below(2 * six_percent + 1);
            GuestClock::with_kvm_scaling(offset, ratio, frac).unwrap()
        }
    }
}

/// Tight probes: one-way delays of 0 to 2 ticks, so the bounds are a few ticks wide and every
/// integer rounding in the hull (the `+1` of a guest reading that only says "at or after this
/// tick") decides whether the truth stays inside. Gaps are tight too in half the runs.
fn tight_run<const N: usize>(seed: u64) -> Result<bool, std::string::String> {
    let mut params = SplitMix64::new(seed ^ 0x7167_4700_0000_0000);
    let clock = tight_clock(&mut params);
    let gap = if params.below(2) == 0 {
        Delay::Uniform { min: 0, max: 2 }
    } else {
        Delay::Uniform {
            min: 0,
            max: 100_000,
        }
    };
    let probes = usize::try_from(2 + params.below(63)).unwrap();
    let start = HostTicks((1 << 40) + params.below(1 << 30));
    let link = Link {
        forward: Delay::Uniform { min: 0, max: 2 },
        backward: Delay::Uniform { min: 0, max: 2 },
        outlier_ppm: 0,
        outlier: Delay::Constant(0),
        gap,
    };
    let mut sim = Sim::new(seed, start, clock, link, 0);
    let mut acc = DriftEstimator::<N>::new();
    for _ in 0..probes {
        let s = sim.probe().ok_or("simulated time left u64")?;
        acc.push(&s).map_err(|e| std::format!("push: {e:?}"))?;
    }
    let e = match acc.estimate() {
        Ok(e) => e,
        // Two probes a tick apart may not bound the rate: a refusal, not a wrong answer.
        Err(EstimateError::Unbounded) => return Ok(false),
        Err(err) => return Err(std::format!("estimate: {err:?}")),
    };
    if clock.drift_ppb_within(e.drift_ppb_min, e.drift_ppb_max) != Some(true) {
        return Err(std::format!("drift outside bounds: {clock:?} {e:?}"));
    }
    if clock.offset_within(e.at, e.offset_min, e.offset_max) != Some(true) {
        return Err(std::format!("offset outside bounds: {clock:?} {e:?}"));
    }
    for ahead in [0u64, 1, 1_000, 1 << 20, 1 << 33] {
        let host = HostTicks(e.at.0 + ahead);
        let (lo, hi) = acc
            .offset_bounds_at(host)
            .map_err(|err| std::format!("bounds at +{ahead}: {err:?}"))?;
        if clock.offset_within(host, lo, hi) != Some(true) {
            return Err(std::format!(
                "offset at +{ahead} outside [{lo}, {hi}]: {clock:?}"
            ));
        }
    }
    Ok(true)
}

#[test]
fn estimate_tight_probes_keep_truth_inside_bounds() {
    const RUNS: u64 = 8_000;
    let (mut bounded, mut failures) = (0u32, Vec::new());
    for seed in 0..RUNS {
        for (capacity, result) in [(64, tight_run::<64>(seed)), (3, tight_run::<3>(seed))] {
            match result {
                Ok(b) => bounded += u32::from(b),
                Err(msg) => failures.push(std::format!("seed {seed} capacity {capacity}: {msg}")),
            }
        }
    }
    println!(
        "tight probes (0-2 tick delays), {RUNS} runs x capacities 64 and 3: {bounded} bounded \
         estimates, {} failures",
        failures.len()
    );
    for f in failures.iter().take(5) {
        println!("{f}");
    }
    assert!(
        failures.is_empty(),
        "tight-probe run failed: {}",
        failures[0]
    );
    assert!(
        bounded > u32::try_from(RUNS).unwrap(),
        "most runs should bound the rate"
    );
}

#[test]
fn estimate_step_change_is_a_segment_break() {
    for seed in 0..100 {
        let mut sim = sim_for(seed, GuestClock::constant);
        let mut acc = OffsetInterval::new();
        let mut hull = DriftEstimator::<32>::new();
        for _ in 0..32 {
            let s = sim.probe().unwrap();
            acc.push(&s)
                .unwrap_or_else(|err| panic!("seed {seed}: {err:?}"));
            hull.push(&s).unwrap();
        }
        assert!(hull.estimate().is_ok(), "seed {seed}");
        // Larger than any RTT the link can produce (outliers stay below 2.1M each way).
        sim.clock.offset += 100_000_000;
        let s = sim.probe().unwrap();
        assert_eq!(
            acc.push(&s),
            Err(EstimateError::SegmentBreak),
            "seed {seed}"
        );
        hull.push(&s).unwrap();
        assert_eq!(
            hull.estimate().map(|_| ()),
            Err(EstimateError::SegmentBreak),
            "seed {seed}"
        );
        // The interval estimator kept the old segment intact.
        let e = acc.estimate().unwrap();
        assert!(e.min <= sim.clock.offset - 100_000_000 && sim.clock.offset - 100_000_000 <= e.max);
    }
}

#[test]
fn estimate_identical_samples_all_exact() {
    // Constant symmetric delays: every probe is identical relative to its send time, so the
    // histogram's |offset| spread is 0 (trace-cmd would divide by zero).
    let mut sim = Sim::new(
        1,
        HostTicks(1 << 40),
        GuestClock::constant(-777),
        Link::constant(500, 1_000),
        0,
    );
    let mut samples = [ProbeSample::default(); PROBES];
    sim.fill(&mut samples).unwrap();
    assert_eq!(trace_cmd_histogram(&samples).map(|e| e.offset), Ok(-777));
    assert_eq!(trace_cmd_fastest(&samples).map(|e| e.offset), Ok(-777));
    let e = estimate_offset(&samples).unwrap();
    assert_eq!((e.offset, e.min, e.max), (-777, -1_277, -277));
}

#[test]
fn estimate_tiny_capacity_saturates_soundly() {
    let mut saturated = 0;
    for seed in 0..300 {
        let mut sim = sim_for(seed, |off| GuestClock::with_drift_ppb(off, 50_000).unwrap());
        sim.link.gap = Delay::Uniform {
            min: 20_000,
            max: 200_000,
        };
        let mut samples = [ProbeSample::default(); PROBES];
        sim.fill(&mut samples).unwrap();
        let e = estimate_drift::<3>(&samples).unwrap_or_else(|err| panic!("seed {seed}: {err:?}"));
        saturated += u32::from(e.saturated);
        assert_eq!(
            sim.clock.drift_ppb_within(e.drift_ppb_min, e.drift_ppb_max),
            Some(true),
            "seed {seed}"
        );
        assert_eq!(
            sim.clock.offset_within(e.at, e.offset_min, e.offset_max),
            Some(true),
            "seed {seed}"
        );
    }
    println!("capacity 3: {saturated}/300 runs saturated, all bounds still contain the truth");
    assert!(saturated > 0, "the capacity path was never exercised");
}

/// One run of a +100 ppm guest behind tight, asymmetric brackets (the exit-stamped shape: a
/// long forward leg, the reply leaving right after the TSC read): `(old_missed, widths)` with
/// `old_missed` set when the constant-offset interval exists but misses the truth at the
/// middle of the span, and the widths of that interval (`None` when empty) and of the
/// drift estimator's bounds within the session's rate limits there.
fn drifting_tight_run(seed: u64) -> Result<(bool, Option<u64>, u64), std::string::String> {
    let mut params = SplitMix64::new(seed ^ 0x0D81_F700_0000_0000);
    let offset = i64::try_from(params.below(1 << 41)).unwrap() - (1 << 40);
    let clock = GuestClock::with_drift_ppb(offset, 100_000).unwrap();
    // About 64 × 150k = 10M ticks of span: 1000 ticks of drift, less than one round trip.
    let link = Link::tight_asymmetric();
    let start = HostTicks((1 << 41) + params.below(1 << 40));
    let mut sim = Sim::new(seed, start, clock, link, 0);
    let mut samples = [ProbeSample::default(); PROBES];
    sim.fill(&mut samples).ok_or("simulated time left u64")?;
    let limits = super::RateLimits::new(
        super::Ratio::new(1, 2).unwrap(),
        super::Ratio::new(2, 1).unwrap(),
    )
    .unwrap();
    let mut acc = DriftEstimator::<64>::new();
    for s in &samples {
        acc.push(s).map_err(|e| std::format!("push: {e:?}"))?;
    }
    let (first, last) = (samples[0].host_send.0, samples[PROBES - 1].host_recv.0);
    let at = HostTicks(first + (last - first) / 2);
    let (lo, hi) = acc
        .offset_bounds_at_within(at, &limits)
        .map_err(|e| std::format!("bounds: {e:?}"))?;
    if clock.offset_within(at, lo, hi) != Some(true) {
        return Err(std::format!(
            "truth outside [{lo}, {hi}] at {}: {clock:?}",
            at.0
        ));
    }
    let old = estimate_offset(&samples).ok();
    // The new bounds contain every constant offset the old interval allowed.
    if let Some(o) = old
        && !(lo <= o.min && o.max <= hi)
    {
        return Err(std::format!("[{lo}, {hi}] misses part of {o:?}"));
    }
    let missed = old.is_some_and(|o| clock.offset_within(at, o.min, o.max) == Some(false));
    Ok((missed, old.map(|o| o.width()), lo.abs_diff(hi)))
}

#[test]
fn estimate_drifting_guest_constant_offset_interval_misses_but_hull_holds() {
    const RUNS: u64 = 2_000;
    let (mut missed, mut old_widths, mut new_widths) = (0_u32, Vec::new(), Vec::new());
    for seed in 0..RUNS {
        let (m, old, new) =
            drifting_tight_run(seed).unwrap_or_else(|msg| panic!("seed {seed}: {msg}"));
        missed += u32::from(m);
        old_widths.extend(old);
        new_widths.push(new);
    }
    let kept = old_widths.len();
    println!(
        "+100 ppm, tight asymmetric brackets, {RUNS} runs x {PROBES} probes: the constant-offset \
         interval existed in {kept} runs and missed the truth in {missed}; the drift bounds \
         within [1/2, 2] held in all; median width constant-offset {} ticks, drift {} ticks",
        if kept > 0 { median(&mut old_widths) } else { 0 },
        median(&mut new_widths)
    );
    // The reason the constant-offset interval may not be called guaranteed: it misses here.
    assert!(
        missed > 0,
        "the drifting runs never exposed the interval's rate-1 assumption"
    );
}
