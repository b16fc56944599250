//! Our drift estimator: exact bounds on rate and offset from convex hulls of the probes
//! (Duda, Harrus, Haddad, Bernard 1987, "Estimating global time in distributed systems"; the
//! incremental form is Trace Compass's `SyncAlgorithmFullyIncremental`).
//!
//! In the plane `x = host`, `y = guest`, the true clock is a line `y = a·x + b` with `a > 0`
//! (KVM's guest TSC is `offset + floor(host·ratio >> frac)`: the reading is the line rounded
//! **down**). A probe's guest reading happened at a host instant `t` in `[send, recv]`, so
//! `a·send + b <= a·t + b < guest + 1` and `a·recv + b >= a·t + b >= guest`. Each probe gives a
//! point `(send, guest + 1)` the line passes on or below and a point `(recv, guest)` it passes
//! on or above. Only the lower convex hull of the former and the upper convex hull of the
//! latter constrain the line, so those hulls are all we keep.
//!
//! The feasible `(a, b)` set is a convex polygon. Eliminating `b` pairwise (Fourier–Motzkin)
//! gives the exact slope interval `[rate_min, rate_max]` as rationals; eliminating `a` at a
//! reference host time `T` gives the exact offset interval there, rounded outward to whole
//! ticks. The estimate is the centre of each interval. Every reported bound contains the truth
//! under integer rounding, by construction, not by tuning.
//!
//! Until two probes do not overlap in host time the samples alone bound neither the rate nor
//! the offset (`Unbounded`). [`DriftEstimator::offset_bounds_at_within`] and
//! [`DriftEstimator::rate_bounds_within`] add the two rows `rate >= min` and `rate <= max` of
//! a [`RateLimits`] to the same elimination: bounded from the first sample, never wider than
//! without the limits, and exactly as trustworthy as the assumption that the rate lies within
//! them.
//!
//! Arithmetic: coordinates are stored relative to the first sample and must stay within
//! `±2^62` (about 47 years of a 3 GHz TSC); then every product fits an `i128` and the checked
//! operations never fail in practice. Anything outside is `Overflow`, never a wrong answer.
//!
//! Fixed capacity `N` per hull: when a hull is full after popping, its oldest interior vertex
//! (index 1) is dropped. Dropping a constraint only enlarges the feasible set, so all bounds
//! stay sound (wider); `DriftEstimate::saturated` reports it. The first vertex is kept because
//! the longest baseline carries the most rate information.
//!
//! Samples must arrive in host-time order (`host_send` and `host_recv` non-decreasing), as a
//! ping-pong protocol produces them; that keeps hull maintenance amortised O(1) per sample.
//! Infeasibility (a segment break) is detected by [`DriftEstimator::estimate`], which costs
//! O(h²) in the hull sizes `h`.

use heapless::Vec;

use super::sample::{
    EstimateError, ProbeSample, RateLimits, Ratio, div_ceil, div_floor, midpoint_floor,
};
use crate::HostTicks;

/// Relative coordinates stay strictly inside `±LIMIT` so products of differences fit `i128`.
const LIMIT: i128 = 1 << 62;

/// A hull vertex in coordinates relative to the first sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Point {
    x: i64,
    y: i64,
}

/// `(a - o) × (b - o)`: positive when `o → a → b` turns counter-clockwise.
fn cross(o: Point, a: Point, b: Point) -> i128 {
    let (ax, ay) = (
        i128::from(a.x) - i128::from(o.x),
        i128::from(a.y) - i128::from(o.y),
    );
    let (bx, by) = (
        i128::from(b.x) - i128::from(o.x),
        i128::from(b.y) - i128::from(o.y),
    );
    // |differences| < 2^63, so each product < 2^126 and their difference < 2^127.
    ax * by - ay * bx
}

/// Drops a vertex to make room; sound because removing a constraint only widens the bounds.
fn make_room<const N: usize>(hull: &mut Vec<Point, N>) -> bool {
    if !hull.is_full() {
        return false;
    }
    let idx = usize::from(hull.len() > 1);
    if idx < hull.len() {
        hull.remove(idx);
    }
    true
}

/// Appends `p` to a lower hull (the line must pass on or below every point), x non-decreasing.
fn push_lower<const N: usize>(hull: &mut Vec<Point, N>, p: Point) -> bool {
    if let Some(last) = hull.last()
        && last.x == p.x
    {
        if p.y >= last.y {
            return false;
        }
        hull.pop();
    }
    while let [.., a, b] = hull.as_slice() {
        if cross(*a, *b, p) > 0 {
            break;
        }
        hull.pop();
    }
    let saturated = make_room(hull);
    // make_room guarantees space.
    let _ = hull.push(p);
    saturated
}

/// Appends `p` to an upper hull (the line must pass on or above every point), x non-decreasing.
fn push_upper<const N: usize>(hull: &mut Vec<Point, N>, p: Point) -> bool {
    if let Some(last) = hull.last()
        && last.x == p.x
    {
        if p.y <= last.y {
            return false;
        }
        hull.pop();
    }
    while let [.., a, b] = hull.as_slice() {
        if cross(*a, *b, p) < 0 {
            break;
        }
        hull.pop();
    }
    let saturated = make_room(hull);
    let _ = hull.push(p);
    saturated
}

/// Rate and offset bounds with their centres, from [`DriftEstimator::estimate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct DriftEstimate {
    /// The host time the offsets refer to: the middle of the sampled span, where they are
    /// tightest.
    pub at: HostTicks,
    /// Centre of `[offset_min, offset_max]`, rounded down (`guest - host` at `at`).
    pub offset: i64,
    /// Smallest offset at `at` consistent with every sample, rounded down (outward).
    pub offset_min: i64,
    /// Largest offset at `at` consistent with every sample, rounded up (outward).
    pub offset_max: i64,
    /// Smallest rate (guest ticks per host tick) consistent with every sample, exact.
    pub rate_min: Ratio,
    /// Largest rate consistent with every sample, exact.
    pub rate_max: Ratio,
    /// Centre of `[drift_ppb_min, drift_ppb_max]`, rounded down: `(rate - 1)·1e9`.
    pub drift_ppb: i64,
    /// `rate_min` as drift in ppb, rounded down (outward).
    pub drift_ppb_min: i64,
    /// `rate_max` as drift in ppb, rounded up (outward).
    pub drift_ppb_max: i64,
    /// How many samples went in.
    pub samples: u32,
    /// A hull hit capacity and dropped a vertex: bounds are sound but may be wider.
    pub saturated: bool,
}

/// Incremental convex-hull bounds on (rate, offset) for one vCPU, `N` vertices per hull.
#[derive(Clone, Debug)]
pub struct DriftEstimator<const N: usize> {
    origin_host: u64,
    origin_guest: u64,
    last_send: u64,
    last_recv: u64,
    below: Vec<Point, N>,
    above: Vec<Point, N>,
    samples: u32,
    vcpu: u32,
    saturated: bool,
}

impl<const N: usize> Default for DriftEstimator<N> {
    fn default() -> Self {
        Self::new()
    }
}

/// One Fourier–Motzkin row `c·a + e·y <= d` with `e = ±1`.
type Row = (i128, i128, i128);

impl<const N: usize> DriftEstimator<N> {
    /// An empty estimator. `N` must be at least 2 (checked at compile time).
    #[must_use]
    pub const fn new() -> Self {
        const { assert!(N >= 2, "a hull needs room for two vertices") };
        Self {
            origin_host: 0,
            origin_guest: 0,
            last_send: 0,
            last_recv: 0,
            below: Vec::new(),
            above: Vec::new(),
            samples: 0,
            vcpu: 0,
            saturated: false,
        }
    }

    /// Number of samples accepted so far.
    #[must_use]
    pub const fn samples(&self) -> u32 {
        self.samples
    }

    /// Adds one sample. The state is unchanged on error.
    ///
    /// # Errors
    /// `InvalidSample` if `host_recv < host_send`; `VcpuMismatch`; `OutOfOrder` if
    /// `host_send` or `host_recv` goes backwards; `Overflow` if the sample lies more than
    /// `2^62` ticks from the first one.
    pub fn push(&mut self, s: &ProbeSample) -> Result<(), EstimateError> {
        if s.host_recv < s.host_send {
            return Err(EstimateError::InvalidSample);
        }
        // The first sample becomes the origin, but only once every check below has passed:
        // until then it lives in locals, so an error leaves the state untouched.
        let (origin_host, origin_guest) = if self.samples == 0 {
            (s.host_send.0, s.guest.0)
        } else if s.vcpu != self.vcpu {
            return Err(EstimateError::VcpuMismatch);
        } else if s.host_send.0 < self.last_send || s.host_recv.0 < self.last_recv {
            return Err(EstimateError::OutOfOrder);
        } else {
            (self.origin_host, self.origin_guest)
        };
        let send = rel(i128::from(s.host_send.0) - i128::from(origin_host))?;
        let recv = rel(i128::from(s.host_recv.0) - i128::from(origin_host))?;
        let y = i128::from(s.guest.0) - i128::from(origin_guest);
        let below = Point {
            x: send,
            y: rel(y + 1)?,
        };
        let above = Point {
            x: recv,
            y: rel(y)?,
        };
        self.origin_host = origin_host;
        self.origin_guest = origin_guest;
        let full_b = push_lower(&mut self.below, below);
        let full_a = push_upper(&mut self.above, above);
        self.saturated |= full_b || full_a;
        self.last_send = s.host_send.0;
        self.last_recv = s.host_recv.0;
        self.vcpu = s.vcpu;
        self.samples = self.samples.saturating_add(1);
        Ok(())
    }

    fn rel_x(&self, host: u64) -> Result<i64, EstimateError> {
        rel(i128::from(host) - i128::from(self.origin_host))
    }

    /// Exact slope interval by eliminating `b` from every (below, above) vertex pair, within
    /// `limits` when given.
    fn rate_bounds(&self, limits: Option<&RateLimits>) -> Result<(Ratio, Ratio), EstimateError> {
        let mut lo: Option<Ratio> = limits.map(RateLimits::min);
        let mut hi: Option<Ratio> = limits.map(RateLimits::max);
        for p in &self.below {
            for q in &self.above {
                // a·p.x + b <= p.y and a·q.x + b >= q.y  ⇒  (p.x - q.x)·a <= p.y - q.y.
                let dx = i128::from(p.x) - i128::from(q.x);
                let dy = i128::from(p.y) - i128::from(q.y);
                if dx == 0 {
                    if dy < 0 {
                        return Err(EstimateError::SegmentBreak);
                    }
                    continue;
                }
                let r = Ratio::new(dy, dx).ok_or(EstimateError::Overflow)?;
                if dx > 0 {
                    if hi.map_or(Ok(true), |h| r.try_lt(&h).ok_or(EstimateError::Overflow))? {
                        hi = Some(r);
                    }
                } else if lo.map_or(Ok(true), |l| l.try_lt(&r).ok_or(EstimateError::Overflow))? {
                    lo = Some(r);
                }
            }
        }
        let (lo, hi) = (
            lo.ok_or(EstimateError::Unbounded)?,
            hi.ok_or(EstimateError::Unbounded)?,
        );
        if hi.try_lt(&lo).ok_or(EstimateError::Overflow)? {
            return Err(EstimateError::SegmentBreak);
        }
        Ok((lo, hi))
    }

    /// Row `i` of the system in `(a, y)` where `y` is the line's value at relative host `t`:
    /// the lower hull's vertices, the upper hull's, then the two rate limits if given.
    fn row(&self, i: usize, t: i128, limits: Option<&RateLimits>) -> Option<Row> {
        let (nb, na) = (self.below.len(), self.above.len());
        if let Some(p) = self.below.get(i) {
            // a·(p.x - t) + y <= p.y
            Some((i128::from(p.x) - t, 1, i128::from(p.y)))
        } else if let Some(q) = self.above.get(i - nb) {
            // a·(t - q.x) - y <= -q.y
            Some((t - i128::from(q.x), -1, -i128::from(q.y)))
        } else {
            let l = limits?;
            match i - nb - na {
                // a >= min.num / min.den  ⇔  -min.den·a <= -min.num (den > 0).
                0 => Some((-l.min().den, 0, -l.min().num)),
                // a <= max.num / max.den  ⇔  max.den·a <= max.num.
                1 => Some((l.max().den, 0, l.max().num)),
                _ => None,
            }
        }
    }

    /// Exact range of the line's value at relative host `t`, rounded outward, for the lines
    /// the samples (and `limits`, when given) allow.
    fn value_bounds(
        &self,
        t: i128,
        limits: Option<&RateLimits>,
    ) -> Result<(i128, i128), EstimateError> {
        const OVF: EstimateError = EstimateError::Overflow;
        let m = self.below.len() + self.above.len() + if limits.is_some() { 2 } else { 0 };
        let mut lo: Option<i128> = None;
        let mut hi: Option<i128> = None;
        let mut upper = |v: i128| hi = Some(hi.map_or(v, |h| h.min(v)));
        let mut lower = |v: i128| lo = Some(lo.map_or(v, |l| l.max(v)));
        for i in 0..m {
            let (ci, ei, di) = self.row(i, t, limits).ok_or(OVF)?;
            if ci == 0 {
                if ei > 0 {
                    upper(di);
                } else {
                    lower(-di);
                }
                continue;
            }
            if ci < 0 {
                continue;
            }
            for j in 0..m {
                let (cj, ej, dj) = self.row(j, t, limits).ok_or(OVF)?;
                if cj >= 0 {
                    continue;
                }
                // (-cj)·row_i + ci·row_j eliminates a: e·y <= r.
                let e = (-cj)
                    .checked_mul(ei)
                    .ok_or(OVF)?
                    .checked_add(ci.checked_mul(ej).ok_or(OVF)?)
                    .ok_or(OVF)?;
                let r = (-cj)
                    .checked_mul(di)
                    .ok_or(OVF)?
                    .checked_add(ci.checked_mul(dj).ok_or(OVF)?)
                    .ok_or(OVF)?;
                if e > 0 {
                    upper(div_ceil(r, e).ok_or(OVF)?);
                } else if e < 0 {
                    lower(div_floor(r, e).ok_or(OVF)?);
                } else if r < 0 {
                    return Err(EstimateError::SegmentBreak);
                }
            }
        }
        let (lo, hi) = (
            lo.ok_or(EstimateError::Unbounded)?,
            hi.ok_or(EstimateError::Unbounded)?,
        );
        if lo > hi {
            return Err(EstimateError::SegmentBreak);
        }
        Ok((lo, hi))
    }

    /// Guaranteed `(min, max)` of the offset `guest - host` at host time `host`, rounded
    /// outward. Valid anywhere, widening with distance from the samples.
    ///
    /// # Errors
    /// `NoSamples`; `SegmentBreak` if no constant-rate line fits; `Unbounded` if the samples do
    /// not bound it; `Overflow` if `host` is more than `2^62` ticks from the first sample.
    pub fn offset_bounds_at(&self, host: HostTicks) -> Result<(i64, i64), EstimateError> {
        self.offset_bounds(host, None)
    }

    /// Guaranteed `(min, max)` of the offset at `host` for every constant rate within
    /// `limits` that fits the samples, rounded outward: never `Unbounded`, one sample is
    /// enough. Contains nothing [`offset_bounds_at`](Self::offset_bounds_at) excludes (the
    /// limits only add constraints), so it is never wider; it is as trustworthy as the
    /// limits. At identity rate, it contains every constant offset the samples allow
    /// (the constant-offset interval of [`OffsetInterval`](super::OffsetInterval)) when 1
    /// lies within the limits.
    ///
    /// # Errors
    /// `NoSamples`; `SegmentBreak` if no line with a rate within `limits` fits; `Overflow` if
    /// `host` is more than `2^62` ticks from the first sample or a limit's products leave
    /// `i128`.
    pub fn offset_bounds_at_within(
        &self,
        host: HostTicks,
        limits: &RateLimits,
    ) -> Result<(i64, i64), EstimateError> {
        self.offset_bounds(host, Some(limits))
    }

    fn offset_bounds(
        &self,
        host: HostTicks,
        limits: Option<&RateLimits>,
    ) -> Result<(i64, i64), EstimateError> {
        if self.samples == 0 {
            return Err(EstimateError::NoSamples);
        }
        let t = i128::from(self.rel_x(host.0)?);
        let (lo, hi) = self.value_bounds(t, limits)?;
        let shift = i128::from(self.origin_guest) - i128::from(host.0);
        let to_i64 = |v: i128| i64::try_from(v + shift).map_err(|_| EstimateError::Overflow);
        Ok((to_i64(lo)?, to_i64(hi)?))
    }

    /// A point estimate of the offset at `host`, inside the guaranteed
    /// [`offset_bounds_at_within`](Self::offset_bounds_at_within) bounds: the centre of the
    /// offsets that fit every sample at one rate, the mediant of the feasible rate interval
    /// within `limits` (between its ends, so it fits; its terms stay as small as the ends',
    /// unlike the exact midpoint's). The guaranteed centre weighs every feasible rate, even
    /// rates far from any plausible clock; this one takes the rate the samples put in the
    /// middle, which on a round where delays vary (probes spread over a long span) is what
    /// the samples say about the offset. It is no bound: the bounds stay the guaranteed ones.
    ///
    /// # Errors
    /// As [`offset_bounds_at_within`](Self::offset_bounds_at_within) and
    /// [`rate_bounds_within`](Self::rate_bounds_within).
    pub fn central_offset_at_within(
        &self,
        host: HostTicks,
        limits: &RateLimits,
    ) -> Result<i64, EstimateError> {
        let (lo, hi) = self.rate_bounds_within(limits)?;
        let mediant = lo
            .num
            .checked_add(hi.num)
            .zip(lo.den.checked_add(hi.den))
            .and_then(|(n, d)| Ratio::new(n, d))
            .ok_or(EstimateError::Overflow)?;
        let at = RateLimits::new(mediant, mediant).ok_or(EstimateError::Overflow)?;
        let (omin, omax) = self.offset_bounds_at_within(host, &at)?;
        Ok(midpoint_floor(omin, omax))
    }

    /// Exact `(min, max)` rate consistent with the samples and within `limits`: never
    /// `Unbounded`, the limits themselves until two probes bound the rate.
    ///
    /// # Errors
    /// `NoSamples`; `SegmentBreak` if no rate within `limits` fits; `Overflow` if a comparison
    /// leaves `i128`.
    pub fn rate_bounds_within(&self, limits: &RateLimits) -> Result<(Ratio, Ratio), EstimateError> {
        if self.samples == 0 {
            return Err(EstimateError::NoSamples);
        }
        self.rate_bounds(Some(limits))
    }

    /// Rate and offset bounds with their centres; the offset refers to the middle of the
    /// sampled host span.
    ///
    /// # Errors
    /// `NoSamples`; `Unbounded` until two probes do not overlap in host time; `SegmentBreak`
    /// if no constant-rate line fits every sample; `Overflow` (not reachable within `2^62`).
    pub fn estimate(&self) -> Result<DriftEstimate, EstimateError> {
        if self.samples == 0 {
            return Err(EstimateError::NoSamples);
        }
        let (rate_min, rate_max) = self.rate_bounds(None)?;
        let span = self.last_recv - self.origin_host;
        let at = HostTicks(self.origin_host + span / 2);
        let (offset_min, offset_max) = self.offset_bounds_at(at)?;
        let drift_ppb_min = rate_min.drift_ppb_floor().ok_or(EstimateError::Overflow)?;
        let drift_ppb_max = rate_max.drift_ppb_ceil().ok_or(EstimateError::Overflow)?;
        Ok(DriftEstimate {
            at,
            offset: midpoint_floor(offset_min, offset_max),
            offset_min,
            offset_max,
            rate_min,
            rate_max,
            drift_ppb: midpoint_floor(drift_ppb_min, drift_ppb_max),
            drift_ppb_min,
            drift_ppb_max,
            samples: self.samples,
            saturated: self.saturated,
        })
    }
}

/// Checks a relative coordinate against `±2^62`.
fn rel(v: i128) -> Result<i64, EstimateError> {
    if -LIMIT < v && v < LIMIT {
        i64::try_from(v).map_err(|_| EstimateError::Overflow)
    } else {
        Err(EstimateError::Overflow)
    }
}

/// Runs a [`DriftEstimator`] with `N` vertices per hull over all samples.
///
/// # Errors
/// As [`DriftEstimator::push`] and [`DriftEstimator::estimate`].
pub fn estimate_drift<const N: usize>(
    samples: &[ProbeSample],
) -> Result<DriftEstimate, EstimateError> {
    let mut acc = DriftEstimator::<N>::new();
    for s in samples {
        acc.push(s)?;
    }
    acc.estimate()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::GuestClock;
    use proptest::prelude::*;
    use std::vec::Vec as StdVec;

    fn p(send: u64, guest: u64, recv: u64) -> ProbeSample {
        crate::estimate::sample::test_sample(send, guest, recv, 0)
    }

    /// Naive reference: Fourier–Motzkin over **all** samples' constraints, no hulls.
    fn naive_rate(samples: &[ProbeSample]) -> Option<(Ratio, Ratio)> {
        let mut lo: Option<Ratio> = None;
        let mut hi: Option<Ratio> = None;
        for a in samples {
            for b in samples {
                let dx = i128::from(a.host_send.0) - i128::from(b.host_recv.0);
                let dy = i128::from(a.guest.0) + 1 - i128::from(b.guest.0);
                if dx == 0 {
                    assert!(dy >= 0);
                    continue;
                }
                let r = Ratio::new(dy, dx).unwrap();
                if dx > 0 {
                    if hi.is_none_or(|h| r.try_lt(&h).unwrap()) {
                        hi = Some(r);
                    }
                } else if lo.is_none_or(|l| l.try_lt(&r).unwrap()) {
                    lo = Some(r);
                }
            }
        }
        Some((lo?, hi?))
    }

    fn naive_value(samples: &[ProbeSample], t: i128) -> (i128, i128) {
        naive_value_within(samples, t, None)
    }

    /// As [`naive_value`], with the rate limits as two more rows when given.
    fn naive_value_within(
        samples: &[ProbeSample],
        t: i128,
        limits: Option<&RateLimits>,
    ) -> (i128, i128) {
        let mut rows: StdVec<(i128, i128, i128)> = samples
            .iter()
            .flat_map(|s| {
                let g = i128::from(s.guest.0);
                [
                    (i128::from(s.host_send.0) - t, 1, g + 1),
                    (t - i128::from(s.host_recv.0), -1, -g),
                ]
            })
            .collect();
        if let Some(l) = limits {
            rows.push((-l.min().den, 0, -l.min().num));
            rows.push((l.max().den, 0, l.max().num));
        }
        let (mut lo, mut hi) = (i128::MIN, i128::MAX);
        for &(ci, ei, di) in &rows {
            if ci == 0 {
                if ei > 0 {
                    hi = hi.min(di);
                } else {
                    lo = lo.max(-di);
                }
            }
            for &(cj, ej, dj) in &rows {
                if ci > 0 && cj < 0 {
                    let e = -cj * ei + ci * ej;
                    let r = -cj * di + ci * dj;
                    if e > 0 {
                        hi = hi.min(div_ceil(r, e).unwrap());
                    } else if e < 0 {
                        lo = lo.max(div_floor(r, e).unwrap());
                    }
                }
            }
        }
        (lo, hi)
    }

    fn same(a: Ratio, b: Ratio) -> bool {
        a.num * b.den == b.num * a.den
    }

    #[test]
    fn exact_line_gives_tight_bounds() {
        // guest = 2·host + 7 exactly, zero-width probes at host 10 and 1010.
        let s = [p(10, 27, 10), p(1_010, 2_027, 1_010)];
        let e = estimate_drift::<8>(&s).unwrap();
        // a ∈ [(2027 - 28)/1000, (2028 - 27)/1000] = [1.999, 2.001].
        assert!(same(e.rate_min, Ratio::new(1_999, 1_000).unwrap()));
        assert!(same(e.rate_max, Ratio::new(2_001, 1_000).unwrap()));
        assert_eq!(
            (e.drift_ppb_min, e.drift_ppb_max),
            (999_000_000, 1_001_000_000)
        );
        assert_eq!(e.at, HostTicks(510));
        // Truth at 510: guest 1027 → offset 517.
        assert!(e.offset_min <= 517 && 517 <= e.offset_max, "{e:?}");
        assert!(!e.saturated);
    }

    #[test]
    fn needs_two_disjoint_probes() {
        let mut acc = DriftEstimator::<8>::new();
        assert_eq!(acc.estimate(), Err(EstimateError::NoSamples));
        acc.push(&p(100, 1_000, 200)).unwrap();
        assert_eq!(acc.estimate(), Err(EstimateError::Unbounded));
        acc.push(&p(150, 1_060, 250)).unwrap();
        assert_eq!(acc.estimate(), Err(EstimateError::Unbounded));
        acc.push(&p(300, 1_210, 320)).unwrap();
        assert!(acc.estimate().is_ok());
        assert_eq!(acc.samples(), 3);
    }

    #[test]
    fn rejects_bad_input_without_changing_state() {
        let mut acc = DriftEstimator::<4>::new();
        acc.push(&p(100, 1_000, 200)).unwrap();
        let before = acc.clone();
        assert_eq!(acc.push(&p(300, 0, 299)), Err(EstimateError::InvalidSample));
        assert_eq!(acc.push(&p(99, 0, 300)), Err(EstimateError::OutOfOrder));
        assert_eq!(acc.push(&p(100, 0, 199)), Err(EstimateError::OutOfOrder));
        let mut other = p(300, 1_200, 400);
        other.vcpu = 1;
        assert_eq!(acc.push(&other), Err(EstimateError::VcpuMismatch));
        assert_eq!(
            acc.push(&p(1 << 63, 0, 1 << 63)),
            Err(EstimateError::Overflow)
        );
        assert_eq!(acc.samples(), before.samples());
        assert_eq!(acc.below, before.below);
        assert_eq!(acc.above, before.above);
        assert_eq!(
            acc.offset_bounds_at(HostTicks(u64::MAX)),
            Err(EstimateError::Overflow)
        );
    }

    #[test]
    fn failed_first_push_leaves_no_origin() {
        // The first sample fails only after its origin is known (its receive lies 2^63 ticks
        // after its send): the estimator must stay exactly as new, origin included.
        let mut acc = DriftEstimator::<4>::new();
        assert_eq!(
            acc.push(&p(5, 7, (1 << 63) + 5)),
            Err(EstimateError::Overflow)
        );
        let fresh = DriftEstimator::<4>::new();
        assert_eq!(
            (acc.origin_host, acc.origin_guest, acc.samples()),
            (fresh.origin_host, fresh.origin_guest, fresh.samples())
        );
        assert_eq!((acc.below.len(), acc.above.len()), (0, 0));
    }

    #[test]
    fn step_is_a_segment_break() {
        let mut acc = DriftEstimator::<16>::new();
        for i in 0..10_u64 {
            let h = 1_000 + i * 1_000;
            acc.push(&p(h, h + 500 + 5, h + 10)).unwrap();
        }
        assert!(acc.estimate().is_ok());
        for i in 10..20_u64 {
            let h = 1_000 + i * 1_000;
            acc.push(&p(h, h + 50_000 + 5, h + 10)).unwrap();
        }
        assert_eq!(acc.estimate(), Err(EstimateError::SegmentBreak));
    }

    #[test]
    fn equal_x_keeps_the_binding_point() {
        let mut acc = DriftEstimator::<8>::new();
        acc.push(&p(100, 1_000, 200)).unwrap();
        acc.push(&p(100, 990, 200)).unwrap();
        acc.push(&p(100, 1_010, 200)).unwrap();
        assert_eq!(acc.below.len(), 1);
        assert_eq!(acc.below[0].y, -9);
        assert_eq!(acc.above.len(), 1);
        assert_eq!(acc.above[0].y, 10);
    }

    /// The limits the host's probe session assumes, `[1/2, 2]`.
    fn session_limits() -> RateLimits {
        RateLimits::new(Ratio::new(1, 2).unwrap(), Ratio::new(2, 1).unwrap()).unwrap()
    }

    #[test]
    fn one_probe_is_bounded_within_rate_limits() {
        // One probe: the samples alone bound neither the rate nor the offset.
        let mut acc = DriftEstimator::<8>::new();
        let l = session_limits();
        assert_eq!(
            acc.offset_bounds_at_within(HostTicks(150), &l),
            Err(EstimateError::NoSamples)
        );
        assert_eq!(acc.rate_bounds_within(&l), Err(EstimateError::NoSamples));
        acc.push(&p(100, 1_000, 200)).unwrap();
        assert_eq!(
            acc.offset_bounds_at(HostTicks(150)),
            Err(EstimateError::Unbounded)
        );
        // The reading happened at t in [100, 200] and a ∈ [1/2, 2]: at host 150 the line lies
        // in [1000 - 2·50, 1001 + 2·50], an offset (minus 150) in [750, 951].
        assert_eq!(
            acc.offset_bounds_at_within(HostTicks(150), &l),
            Ok((750, 951))
        );
        assert_eq!(acc.rate_bounds_within(&l), Ok((l.min(), l.max())));
        // Limits that exclude what the samples prove are a contradiction, not a bound.
        let mut acc = DriftEstimator::<8>::new();
        acc.push(&p(0, 0, 0)).unwrap();
        acc.push(&p(1_000, 3_000, 1_000)).unwrap();
        assert_eq!(
            acc.offset_bounds_at_within(HostTicks(500), &l),
            Err(EstimateError::SegmentBreak)
        );
        assert_eq!(acc.rate_bounds_within(&l), Err(EstimateError::SegmentBreak));
    }

    /// Samples of a drifting clock with per-probe jitter, in host order.
    fn drifting(
        offset: i64,
        ppm: i64,
        probes: &[(u64, u64, u64)],
    ) -> (GuestClock, StdVec<ProbeSample>) {
        let clock = GuestClock::with_drift_ppb(offset, ppm * 1_000).unwrap();
        // Start at 2^41 so that no offset in ±2^40 at a rate within ±500 ppm makes the guest
        // TSC negative (at 2^40, offset -1098979546140 at -484 ppm did).
        let mut now = 1_u64 << 41;
        let samples = probes
            .iter()
            .map(|&(gap, fwd, back)| {
                let send = now + gap;
                let t = send + fwd;
                now = t + back;
                ProbeSample {
                    host_send: HostTicks(send),
                    guest: clock.guest_at(HostTicks(t)).unwrap(),
                    host_recv: HostTicks(now),
                    vcpu: 0,
                }
            })
            .collect();
        (clock, samples)
    }

    /// Probes whose forward delay is long and backward short in one half, the other way round
    /// in the other: the central-rate point sits inside the guaranteed bounds and, at a rate
    /// the samples pin near 1, on the centre of the constant-offset interval.
    #[test]
    fn central_offset_lies_inside_the_guaranteed_bounds() {
        let limits = RateLimits::new(Ratio::new(1, 2).unwrap(), Ratio::new(2, 1).unwrap()).unwrap();
        let offset = 1_000_000_i64;
        let samples: StdVec<ProbeSample> = (0..64_u64)
            .map(|i| {
                let send = 10_000_000 + i * 1_000_000;
                let (fwd, back) = if i % 2 == 0 { (300, 40) } else { (60, 500) };
                let g = u64::try_from(i128::from(send + fwd) + i128::from(offset)).unwrap();
                p(send, g, send + fwd + back)
            })
            .collect();
        let mut acc = DriftEstimator::<64>::new();
        for s in &samples {
            acc.push(s).unwrap();
        }
        let mid = HostTicks(10_000_000 + 32 * 1_000_000);
        let (lo, hi) = acc.offset_bounds_at_within(mid, &limits).unwrap();
        let c = acc.central_offset_at_within(mid, &limits).unwrap();
        assert!(lo <= c && c <= hi, "{lo} <= {c} <= {hi}");
        // Constant-offset interval: [offset - 40, offset + 60 + 1]; centre offset + 10.
        assert!((c - (offset + 10)).abs() <= 2, "{c}");
        assert_eq!(
            DriftEstimator::<4>::new().central_offset_at_within(mid, &limits),
            Err(EstimateError::NoSamples)
        );
    }

    proptest! {
        /// Hull-based bounds equal the all-pairs reference exactly and contain the truth.
        #[test]
        fn hull_matches_naive_reference(
            offset in -(1_i64 << 40)..(1_i64 << 40),
            ppm in -500_i64..500,
            probes in proptest::collection::vec((0_u64..100_000, 0_u64..5_000, 0_u64..5_000), 2..48),
            probe_t in 0_u64..10_000_000,
        ) {
            let (clock, samples) = drifting(offset, ppm, &probes);
            let mut acc = DriftEstimator::<64>::new();
            for s in &samples {
                acc.push(s).unwrap();
            }
            let naive = naive_rate(&samples);
            match (acc.estimate(), naive) {
                (Ok(e), Some((lo, hi))) => {
                    prop_assert!(same(e.rate_min, lo) && same(e.rate_max, hi));
                    prop_assert_eq!(clock.drift_ppb_within(e.drift_ppb_min, e.drift_ppb_max), Some(true));
                    prop_assert_eq!(clock.offset_within(e.at, e.offset_min, e.offset_max), Some(true));
                    let t = HostTicks(samples[0].host_send.0 + probe_t);
                    let (omin, omax) = acc.offset_bounds_at(t).unwrap();
                    let (vlo, vhi) = naive_value(&samples, i128::from(t.0));
                    prop_assert_eq!(i128::from(omin), vlo - i128::from(t.0));
                    prop_assert_eq!(i128::from(omax), vhi - i128::from(t.0));
                    prop_assert_eq!(clock.offset_within(t, omin, omax), Some(true));
                }
                (Err(EstimateError::Unbounded), None) => {}
                (got, want) => prop_assert!(false, "hull {got:?} vs naive {want:?}"),
            }
        }

        /// Within rate limits the bounds equal the all-pairs reference with the limit rows,
        /// exist from the first sample on, lie inside the limit-free ones and contain the
        /// truth; so do the rate bounds.
        #[test]
        fn bounds_within_limits_match_naive_reference(
            offset in -(1_i64 << 40)..(1_i64 << 40),
            ppm in -500_i64..500,
            probes in proptest::collection::vec((0_u64..100_000, 0_u64..5_000, 0_u64..5_000), 1..24),
            probe_t in 0_u64..10_000_000,
        ) {
            let (clock, samples) = drifting(offset, ppm, &probes);
            let l = session_limits();
            let mut acc = DriftEstimator::<64>::new();
            for s in &samples {
                acc.push(s).unwrap();
            }
            let t = HostTicks(samples[0].host_send.0 + probe_t);
            let (omin, omax) = acc.offset_bounds_at_within(t, &l).unwrap();
            let (vlo, vhi) = naive_value_within(&samples, i128::from(t.0), Some(&l));
            prop_assert_eq!(i128::from(omin), vlo - i128::from(t.0));
            prop_assert_eq!(i128::from(omax), vhi - i128::from(t.0));
            prop_assert_eq!(clock.offset_within(t, omin, omax), Some(true));
            if let Ok((lo, hi)) = acc.offset_bounds_at(t) {
                prop_assert!(lo <= omin && omax <= hi, "{lo} {hi} vs {omin} {omax}");
            }
            let (rmin, rmax) = acc.rate_bounds_within(&l).unwrap();
            let (dmin, dmax) = (rmin.drift_ppb_floor().unwrap(), rmax.drift_ppb_ceil().unwrap());
            prop_assert_eq!(clock.drift_ppb_within(dmin, dmax), Some(true));
        }

        /// A tiny capacity drops vertices but the bounds still contain the truth.
        #[test]
        fn saturated_hulls_stay_sound(
            offset in -(1_i64 << 40)..(1_i64 << 40),
            ppm in -500_i64..500,
            probes in proptest::collection::vec((0_u64..100_000, 0_u64..5_000, 0_u64..5_000), 2..64),
        ) {
            let (clock, samples) = drifting(offset, ppm, &probes);
            if let Ok(e) = estimate_drift::<3>(&samples) {
                prop_assert_eq!(clock.drift_ppb_within(e.drift_ppb_min, e.drift_ppb_max), Some(true));
                prop_assert_eq!(clock.offset_within(e.at, e.offset_min, e.offset_max), Some(true));
            }
        }
    }

    proptest! {
        /// The central-rate point estimate always lies inside the guaranteed bounds.
        #[test]
        fn central_offset_is_inside_the_bounds(
            offset in -(1_i64 << 40)..(1_i64 << 40),
            ppm in -500_i64..500,
            probes in proptest::collection::vec((0_u64..100_000, 0_u64..5_000, 0_u64..5_000), 1..48),
            probe_t in 0_u64..10_000_000,
        ) {
            let limits = RateLimits::new(Ratio::new(1, 2).unwrap(), Ratio::new(2, 1).unwrap()).unwrap();
            let (_, samples) = drifting(offset, ppm, &probes);
            let mut acc = DriftEstimator::<64>::new();
            for s in &samples {
                acc.push(s).unwrap();
            }
            let t = HostTicks(samples[0].host_send.0 + probe_t);
            let (lo, hi) = acc.offset_bounds_at_within(t, &limits).unwrap();
            let c = acc.central_offset_at_within(t, &limits).unwrap();
            prop_assert!(lo <= c && c <= hi, "{} <= {} <= {}", lo, c, hi);
        }
    }
}
