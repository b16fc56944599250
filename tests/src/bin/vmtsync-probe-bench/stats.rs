//! Per-session evaluation of the estimators against the known truth, and aggregation over
//! sessions.
//!
//! Every estimator sees the same [`ProbeSample`]s; the truth is the clock relation the guest
//! really had (KVM's debugfs mapping of the vCPU, composed with the agent's software skew
//! where it has one), so each estimate has an exact error.

use vmtsync::sync::RATE_LIMITS;
use vmtsync_core::HostTicks;
use vmtsync_core::estimate::{
    DriftEstimator, EstimateError, ProbeSample, Ratio, estimate_offset, trace_cmd_fastest,
    trace_cmd_histogram,
};

/// Hull capacity of the drift estimator: at least the probes per session, so no vertex is ever
/// dropped and its bounds are as tight as the samples allow.
pub const HULL: usize = 256;

/// The clock relation the guest really had: `guest = offset + ((host * ratio) >> frac)`
/// (wrapping add, like KVM's `tsc_offset`, and the agent's `skew=` option).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Truth {
    /// Added after scaling, wrapping.
    pub offset: u64,
    /// Fixed-point rate with `frac` fractional bits.
    pub ratio: u64,
    /// Fractional bits of `ratio`.
    pub frac: u32,
}

impl Truth {
    /// Guest TSC == host TSC, for the unit tests; real runs take their truth from debugfs.
    #[cfg(test)]
    pub const IDENTITY: Self = Self {
        offset: 0,
        ratio: 1,
        frac: 0,
    };

    /// The guest TSC the truth gives at host TSC `host` (the agent's own formula).
    #[must_use]
    pub fn guest_at(self, host: u64) -> u64 {
        // The agent keeps the low 64 bits of the shifted product, as KVM does.
        #[allow(clippy::cast_possible_truncation)]
        let scaled = ((u128::from(host) * u128::from(self.ratio)) >> self.frac) as u64;
        scaled.wrapping_add(self.offset)
    }

    /// The host TSC at which the guest read `guest`, to within the rate's change of the offset
    /// over the probe's delay (a tick or two at 100 ppm): the offset taken at `near` (a host
    /// tick close to the reading, e.g. the probe's send), then once more at that estimate.
    #[must_use]
    pub fn host_of(self, guest: u64, near: u64) -> u64 {
        let t0 = guest.wrapping_sub(self.offset_at(near).cast_unsigned());
        guest.wrapping_sub(self.offset_at(t0).cast_unsigned())
    }

    /// The true offset `guest - host` at host TSC `host`, as a wrapped signed difference.
    #[must_use]
    pub fn offset_at(self, host: u64) -> i64 {
        self.guest_at(host).wrapping_sub(host).cast_signed()
    }

    /// Whether the rate differs from 1, so the offset changes with time and only the drift
    /// estimator's model fits.
    #[must_use]
    pub fn drifts(self) -> bool {
        1_u128.checked_shl(self.frac) != Some(u128::from(self.ratio))
    }

    /// Whether the truth's rate lies in `[lo, hi]`; `None` on overflow.
    #[must_use]
    pub fn rate_within(self, lo: Ratio, hi: Ratio) -> Option<bool> {
        let den = 1_i128.checked_shl(self.frac)?;
        let r = i128::from(self.ratio);
        let ge_lo = lo.num.checked_mul(den)? <= r.checked_mul(lo.den)?;
        let le_hi = r.checked_mul(hi.den)? <= hi.num.checked_mul(den)?;
        Some(ge_lo && le_hi)
    }
}

/// What one session's samples gave each estimator, measured against the truth.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionEval {
    /// Ours, what `vmtsync probe` reports as guaranteed (the drift estimator's offset bounds
    /// at the middle of the span for any constant rate within the session's limits):
    /// |centre - truth| in ticks, `None` on a segment break.
    pub ours_err: Option<u64>,
    /// Ours: interval width `max - min` in ticks.
    pub ours_width: Option<u64>,
    /// Ours: the interval contains the truth (`false` also for a segment break).
    pub ours_contains: bool,
    /// `DriftEstimator`: |offset centre - truth| at its reference time.
    pub drift_err: Option<u64>,
    /// `DriftEstimator`: offset interval width at its reference time.
    pub drift_width: Option<u64>,
    /// `DriftEstimator`: offset and rate intervals both contain the truth.
    pub drift_contains: bool,
    /// trace-cmd's fastest-RTT estimator: |offset - truth at its midpoint| in ticks.
    pub tc_err: u64,
    /// Ours, signed: `centre - truth` (a constant sign across sessions is path asymmetry).
    pub ours_bias: Option<i64>,
    /// trace-cmd, signed: `offset - truth`.
    pub tc_bias: i64,
    /// trace-cmd's histogram estimator, signed: `offset - truth at its probe's midpoint`.
    pub hist_bias: i64,
    /// `DriftEstimator`: width of the drift interval in ppb.
    pub drift_ppb_width: Option<u64>,
    /// Round-trip (bracket) widths `host_recv - host_send` of every probe, in ticks.
    pub rtts: Vec<u64>,
    /// Our point estimate inside the guaranteed bounds at the middle of the span
    /// (`DriftEstimator::central_offset_at_within`), signed error.
    pub central_bias: Option<i64>,
    /// The constant-offset interval's centre (`estimate_offset`, exact only at rate 1), signed
    /// error against the truth at the middle of the span; `None` when it is empty.
    pub rate1_bias: Option<i64>,
    /// True one-way delays from the truth: `(forward, backward)` of every probe, i.e. host
    /// send to the guest's reading, and the reading to host receive (signed: a negative one
    /// would be a bracket that misses the truth).
    pub delays: Vec<(i64, i64)>,
}

/// Evaluates every estimator on `samples` against `truth`.
///
/// Our guaranteed bounds are measured against the truth at the middle of the session's host
/// span, where `vmtsync probe` reports them; they hold for any constant rate within the
/// limits, so a segment break (`None`) means the clock stepped.
///
/// # Errors
/// When trace-cmd's estimator or the drift estimator rejects the samples for a reason other
/// than the model not fitting (empty input, reversed or out-of-order samples).
pub fn evaluate(samples: &[ProbeSample], truth: Truth) -> Result<SessionEval, EstimateError> {
    let first = samples.first().ok_or(EstimateError::NoSamples)?;
    let last = samples.last().ok_or(EstimateError::NoSamples)?;
    let mid = first.host_send.0 + (last.host_recv.0 - first.host_send.0) / 2;
    let bias = |est: i64, at: u64| est.wrapping_sub(truth.offset_at(at));

    let mut drift = DriftEstimator::<HULL>::new();
    for s in samples {
        drift.push(s)?;
    }
    let (ours_bias, ours_width, ours_contains) =
        match drift.offset_bounds_at_within(HostTicks(mid), &RATE_LIMITS) {
            Ok((lo, hi)) => {
                let t = truth.offset_at(mid);
                let centre = lo + i64::try_from((i128::from(hi) - i128::from(lo)) / 2).unwrap_or(0);
                (
                    Some(bias(centre, mid)),
                    Some(hi.abs_diff(lo)),
                    lo <= t && t <= hi,
                )
            }
            Err(EstimateError::SegmentBreak) => (None, None, false),
            Err(e) => return Err(e),
        };

    let (drift_err, drift_width, drift_contains, drift_ppb_width) = match drift.estimate() {
        Ok(d) => {
            let t = truth.offset_at(d.at.0);
            let rate_ok = truth.rate_within(d.rate_min, d.rate_max) == Some(true);
            (
                Some(bias(d.offset, d.at.0).unsigned_abs()),
                Some(d.offset_max.abs_diff(d.offset_min)),
                d.offset_min <= t && t <= d.offset_max && rate_ok,
                Some(d.drift_ppb_max.abs_diff(d.drift_ppb_min)),
            )
        }
        Err(EstimateError::SegmentBreak | EstimateError::Unbounded) => (None, None, false, None),
        Err(e) => return Err(e),
    };

    let tc = trace_cmd_fastest(samples)?;
    let tc_bias = bias(tc.offset, tc.at.0);
    let hist = trace_cmd_histogram(samples)?;
    let hist_bias = bias(hist.offset, hist.at.0);
    let rate1_bias = estimate_offset(samples).ok().map(|e| bias(e.offset, mid));
    let central_bias = drift
        .central_offset_at_within(HostTicks(mid), &RATE_LIMITS)
        .ok()
        .map(|c| bias(c, mid));
    let delays = samples
        .iter()
        .map(|s| {
            let t = truth.host_of(s.guest.0, s.host_send.0);
            (
                t.wrapping_sub(s.host_send.0).cast_signed(),
                s.host_recv.0.wrapping_sub(t).cast_signed(),
            )
        })
        .collect();
    Ok(SessionEval {
        ours_err: ours_bias.map(i64::unsigned_abs),
        ours_width,
        ours_contains,
        drift_err,
        drift_width,
        drift_contains,
        tc_err: tc_bias.unsigned_abs(),
        ours_bias,
        tc_bias,
        hist_bias,
        drift_ppb_width,
        rtts: samples.iter().filter_map(ProbeSample::rtt).collect(),
        central_bias,
        rate1_bias,
        delays,
    })
}

/// The QEMU UART brackets side by side: in this process (`baseline`, today's QEMU path) and
/// exit-anchored, on the same probes.
#[derive(Debug, Clone)]
pub struct Anchoring {
    /// The row every other QEMU row is compared with.
    pub baseline: String,
    /// Per row: the median over sessions of the fewest leading probes whose interval is
    /// within twice the whole session's width.
    pub probes_to_2x: Vec<(String, Option<u64>)>,
}

/// The median of `v` (the upper one for an even count), `None` when empty.
#[must_use]
pub fn median(v: &[u64]) -> Option<u64> {
    let mut v = v.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

/// The median of signed values (the upper one for an even count), `None` when empty.
#[must_use]
pub fn median_signed(v: &[i64]) -> Option<i64> {
    let mut v = v.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

/// One benchmark row: every session of one transport and bracket, aggregated.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Short label of the path and bracket, e.g. `builtin/exit-tight`.
    pub name: String,
    /// The truth's rate is not 1 (the path's ratio is then the drift estimator's).
    pub drifting: bool,
    /// Sessions evaluated.
    pub sessions: usize,
    /// Probes per session.
    pub probes: usize,
    /// Median over sessions of our |error| in ticks (sessions with a segment break excluded).
    pub ours_median_err: Option<u64>,
    /// Largest of our per-session |errors|.
    pub ours_max_err: Option<u64>,
    /// Median of trace-cmd fastest-RTT's |error| in ticks.
    pub tc_median_err: u64,
    /// Largest of trace-cmd's per-session |errors|.
    pub tc_max_err: u64,
    /// Median of trace-cmd histogram's |error| in ticks.
    pub hist_median_err: u64,
    /// Median of trace-cmd histogram's signed error, ticks.
    pub hist_bias_median: i64,
    /// Median |error| of our central-rate point estimate.
    pub central_median_err: Option<u64>,
    /// `central_median_err / tc_median_err`.
    pub central_ratio: Option<f64>,
    /// Median |error| of the constant-offset interval's centre (sessions where it is empty
    /// excluded).
    pub rate1_median_err: Option<u64>,
    /// Medians over sessions of each session's smallest forward and smallest backward delay
    /// (truth-derived), ticks: half their difference is the error of any estimator that trusts
    /// the fastest paths to be symmetric.
    pub min_delay_median: Option<(i64, i64)>,
    /// Medians over all probes of the forward and backward delays, ticks.
    pub delay_median: Option<(i64, i64)>,
    /// Median over sessions of the fastest-RTT probe's `(forward - backward) / 2`: trace-cmd's
    /// signed error, from the truth's delays.
    pub fastest_asymmetry_median: Option<i64>,
    /// `ours_median_err / tc_median_err` (a figure; its old goal, <= 0.25, is retired).
    pub ratio: Option<f64>,
    /// `drift_median_err / tc_median_err`.
    pub drift_ratio: Option<f64>,
    /// Sessions where our |error| is at most trace-cmd's.
    pub ours_not_worse: usize,
    /// Median and largest width of our interval, ticks.
    pub width_median: Option<u64>,
    /// Largest width of our interval.
    pub width_max: Option<u64>,
    /// Sessions whose interval contained the truth.
    pub contains: usize,
    /// Sessions where not even a constant rate within the limits fit (no interval).
    pub segment_breaks: usize,
    /// Median of our signed error (`centre - truth`), ticks: the systematic part.
    pub ours_bias_median: Option<i64>,
    /// Smallest and largest of our signed errors: a narrow range far from 0 is a systematic
    /// path asymmetry, not noise.
    pub ours_bias_range: Option<(i64, i64)>,
    /// Median of trace-cmd's signed error, ticks.
    pub tc_bias_median: i64,
    /// Smallest and largest of trace-cmd's signed errors.
    pub tc_bias_range: (i64, i64),
    /// Median width of the drift estimator's rate interval, ppb.
    pub drift_ppb_width_median: Option<u64>,
    /// Median of the drift estimator's |error|.
    pub drift_median_err: Option<u64>,
    /// Median width of the drift estimator's offset interval.
    pub drift_width_median: Option<u64>,
    /// Sessions whose drift bounds (offset and rate) contained the truth.
    pub drift_contains: usize,
    /// Smallest probe bracket over all sessions, ticks.
    pub rtt_min: u64,
    /// Median probe bracket over all sessions, ticks.
    pub rtt_median: u64,
}

impl Row {
    /// Aggregates `evals` (at least one) under `name`; `truth` is what they were measured
    /// against.
    #[must_use]
    pub fn aggregate(name: &str, probes: usize, truth: Truth, evals: &[SessionEval]) -> Self {
        let ours: Vec<u64> = evals.iter().filter_map(|e| e.ours_err).collect();
        let tc: Vec<u64> = evals.iter().map(|e| e.tc_err).collect();
        let widths: Vec<u64> = evals.iter().filter_map(|e| e.ours_width).collect();
        let drift: Vec<u64> = evals.iter().filter_map(|e| e.drift_err).collect();
        let drift_w: Vec<u64> = evals.iter().filter_map(|e| e.drift_width).collect();
        let rtts: Vec<u64> = evals.iter().flat_map(|e| e.rtts.iter().copied()).collect();
        let ours_bias: Vec<i64> = evals.iter().filter_map(|e| e.ours_bias).collect();
        let tc_bias: Vec<i64> = evals.iter().map(|e| e.tc_bias).collect();
        let hist_bias: Vec<i64> = evals.iter().map(|e| e.hist_bias).collect();
        let hist: Vec<u64> = hist_bias.iter().map(|b| b.unsigned_abs()).collect();
        let central: Vec<u64> = evals
            .iter()
            .filter_map(|e| e.central_bias.map(i64::unsigned_abs))
            .collect();
        let rate1: Vec<u64> = evals
            .iter()
            .filter_map(|e| e.rate1_bias.map(i64::unsigned_abs))
            .collect();
        let (mut min_fwd, mut min_back, mut fwd, mut back, mut fastest) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for e in evals {
            if let (Some(f), Some(b)) = (
                e.delays.iter().map(|d| d.0).min(),
                e.delays.iter().map(|d| d.1).min(),
            ) {
                min_fwd.push(f);
                min_back.push(b);
            }
            fwd.extend(e.delays.iter().map(|d| d.0));
            back.extend(e.delays.iter().map(|d| d.1));
            // trace-cmd's choice: the first probe with the smallest round trip.
            if let Some((_, d)) = e
                .delays
                .iter()
                .enumerate()
                .min_by_key(|(i, d)| (d.0 + d.1, *i))
            {
                fastest.push((d.0 - d.1) / 2);
            }
        }
        let both = |a: &[i64], b: &[i64]| median_signed(a).zip(median_signed(b));
        let ppb: Vec<u64> = evals.iter().filter_map(|e| e.drift_ppb_width).collect();
        let ours_median_err = median(&ours);
        let tc_median_err = median(&tc).unwrap_or(0);
        #[allow(clippy::cast_precision_loss)] // A displayed ratio of tick counts far below 2^52.
        let over_tc = |o: Option<u64>| {
            o.filter(|_| tc_median_err > 0)
                .map(|o| o as f64 / tc_median_err as f64)
        };
        let drift_median_err = median(&drift);
        Self {
            name: name.to_owned(),
            drifting: truth.drifts(),
            sessions: evals.len(),
            probes,
            ours_median_err,
            ours_max_err: ours.iter().copied().max(),
            tc_median_err,
            tc_max_err: tc.iter().copied().max().unwrap_or(0),
            hist_median_err: median(&hist).unwrap_or(0),
            hist_bias_median: median_signed(&hist_bias).unwrap_or(0),
            central_median_err: median(&central),
            central_ratio: over_tc(median(&central)),
            rate1_median_err: median(&rate1),
            min_delay_median: both(&min_fwd, &min_back),
            delay_median: both(&fwd, &back),
            fastest_asymmetry_median: median_signed(&fastest),
            ratio: over_tc(ours_median_err),
            drift_ratio: over_tc(drift_median_err),
            ours_not_worse: evals
                .iter()
                .filter(|e| e.ours_err.is_some_and(|o| o <= e.tc_err))
                .count(),
            width_median: median(&widths),
            width_max: widths.iter().copied().max(),
            contains: evals.iter().filter(|e| e.ours_contains).count(),
            segment_breaks: evals.iter().filter(|e| e.ours_err.is_none()).count(),
            ours_bias_median: median_signed(&ours_bias),
            ours_bias_range: ours_bias
                .iter()
                .min()
                .copied()
                .zip(ours_bias.iter().max().copied()),
            tc_bias_median: median_signed(&tc_bias).unwrap_or(0),
            tc_bias_range: (
                tc_bias.iter().min().copied().unwrap_or(0),
                tc_bias.iter().max().copied().unwrap_or(0),
            ),
            drift_ppb_width_median: median(&ppb),
            drift_median_err,
            drift_width_median: median(&drift_w),
            drift_contains: evals.iter().filter(|e| e.drift_contains).count(),
            rtt_min: rtts.iter().copied().min().unwrap_or(0),
            rtt_median: median(&rtts).unwrap_or(0),
        }
    }

    /// `ours_median_err / hist_median_err`: ours against trace-cmd's histogram estimator.
    #[must_use]
    pub fn hist_ratio(&self) -> Option<f64> {
        #[allow(clippy::cast_precision_loss)] // A displayed ratio of tick counts far below 2^52.
        self.ours_median_err
            .filter(|_| self.hist_median_err > 0)
            .map(|o| o as f64 / self.hist_median_err as f64)
    }

    /// The ratio a path is shown with: ours over trace-cmd's median |error|, or the
    /// drift estimator's (the limit-free hull at its own reference time) when the rate is
    /// not 1.
    #[must_use]
    pub fn headline_ratio(&self) -> Option<f64> {
        if self.drifting {
            self.drift_ratio
        } else {
            self.ratio
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmtsync_core::{GuestTicks, HostTicks};

    fn p(send: u64, guest: u64, recv: u64) -> ProbeSample {
        ProbeSample {
            host_send: HostTicks(send),
            guest: GuestTicks(guest),
            host_recv: HostTicks(recv),
            vcpu: 0,
        }
    }

    #[test]
    fn truth_applies_the_agents_skew_formula() {
        let t = Truth {
            offset: (-1000_i64).cast_unsigned(),
            ratio: 3,
            frac: 1,
        };
        assert_eq!(t.guest_at(10_000), 14_000);
        assert_eq!(t.offset_at(10_000), 4_000);
        assert_eq!(Truth::IDENTITY.offset_at(123), 0);
        assert_eq!(
            t.rate_within(Ratio::new(4, 3).unwrap(), Ratio::new(2, 1).unwrap()),
            Some(true)
        );
        assert_eq!(
            t.rate_within(Ratio::new(8, 5).unwrap(), Ratio::new(2, 1).unwrap()),
            Some(false)
        );
    }

    /// Identical asymmetric delays: every probe reads the guest 10 ticks after send and 30
    /// before receive. trace-cmd's midpoint is off by (30 - 10) / 2 = 10; our bounds are
    /// `[guest - recv, guest - send + 1] = [-30, 11]` (the `+ 1`: a reading only says the
    /// guest clock was at or past that tick), centre -10: the same bias, because identical
    /// probes add no information.
    #[test]
    fn identical_asymmetric_probes_bias_both_estimators_equally() {
        let s: Vec<_> = (0..8u64)
            .map(|i| {
                let send = 1_000_000 + i * 1_000;
                p(send, send + 10, send + 40)
            })
            .collect();
        let e = evaluate(&s, Truth::IDENTITY).unwrap();
        assert_eq!(e.ours_err, Some(10));
        assert_eq!(e.ours_width, Some(41));
        assert!(e.ours_contains);
        assert_eq!(e.tc_err, 10);
        assert_eq!((e.ours_bias, e.tc_bias), (Some(-10), -10));
        assert_eq!(e.rtts, vec![40; 8]);
    }

    /// Varying delays: the fastest probe is asymmetric, but our bounds combine the smallest
    /// forward and the smallest backward delay from different probes and beat it.
    #[test]
    fn intersection_beats_the_fastest_probe_when_delays_vary() {
        let s = [
            p(1_000, 1_002, 1_030), // forward 2, back 28: rtt 30
            p(2_000, 2_020, 2_022), // forward 20, back 2: rtt 22, the fastest
            p(3_000, 3_003, 3_040), // forward 3, back 37: rtt 40
            p(4_000, 4_030, 4_033), // forward 30, back 3: rtt 33
        ];
        let e = evaluate(&s, Truth::IDENTITY).unwrap();
        // At rate exactly 1 the interval would be [-min back, min fwd] = [-2, 2]; allowing any
        // constant rate the samples fit (probes 1000 ticks apart) widens it to 7 ticks, centre
        // still within a tick of the truth.
        assert_eq!(e.ours_width, Some(7));
        assert!(e.ours_err.is_some_and(|x| x <= 1), "{e:?}");
        // trace-cmd: fastest is rtt 22 at mid 2_011, offset 9.
        assert_eq!(e.tc_err, 9);
        assert!(e.ours_contains && e.drift_contains);
        let row = Row::aggregate("t", 4, Truth::IDENTITY, &[e]);
        assert!(row.ratio.is_some_and(|r| r < 0.2), "{row:?}");
        assert_eq!((row.rtt_min, row.rtt_median), (22, 33));
        assert_eq!((row.contains, row.ours_not_worse), (1, 1));
    }

    /// A rate of 1.5: no constant offset fits, but our bounds (any constant rate) and the
    /// drift estimator's hold.
    #[test]
    fn skewed_rate_keeps_our_bounds_and_the_drift_bounds() {
        let t = Truth {
            offset: (-500_i64).cast_unsigned(),
            ratio: 3,
            frac: 1,
        };
        let s: Vec<_> = (0..16u64)
            .map(|i| {
                let send = 100_000 + i * 10_000;
                let at = send + 7;
                p(send, t.guest_at(at), send + 20)
            })
            .collect();
        let e = evaluate(&s, t).unwrap();
        assert!(e.ours_contains, "{e:?}");
        assert!(e.drift_contains, "{e:?}");
        let row = Row::aggregate("skew", 16, t, &[e]);
        assert_eq!(
            (row.segment_breaks, row.contains, row.drift_contains),
            (0, 1, 1)
        );
        assert!(row.drifting && !Truth::IDENTITY.drifts());
        assert_eq!(row.headline_ratio(), row.drift_ratio);
    }

    #[test]
    fn median_takes_the_upper_middle() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[5, 1, 3]), Some(3));
        assert_eq!(median(&[4, 1, 3, 2]), Some(3));
        assert_eq!(median_signed(&[-4, 1, -3]), Some(-3));
    }
}
