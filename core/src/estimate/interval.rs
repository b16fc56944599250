//! Our constant-offset estimator: intersect the intervals every probe proves, if the guest's
//! rate is exactly the host's.
//!
//! The guest read its TSC at some host instant `t` in `[host_send, host_recv]`. With a constant
//! offset and identity rate, `guest = t + offset`, hence
//! `guest - host_recv <= offset <= guest - host_send`. Each probe is therefore a guaranteed
//! interval, whatever the delays, queueing or asymmetry; the intersection over all probes is
//! the tightest statement the samples support, and the truth lies inside it by construction.
//! An empty intersection is a proof that no constant offset explains the samples (a step, a
//! migration, a rate change): a segment break, reported as an error, never a wrong number.
//!
//! The model is a constant offset at **exactly** identity rate, and the guarantee holds only
//! under it. A guest clock that drifts (even 100 ppm) or is scaled does not always contradict
//! it: while the drift over the span stays below a round trip the intersection is non-empty
//! yet can miss the true offset at any instant, most of all behind tight, asymmetric brackets
//! (`estimate_drifting_guest_constant_offset_interval_misses_but_hull_holds` in the
//! simulation tests shows it on every seed). Only a larger drift shows up as a segment break.
//! A bound that must hold for a guest whose rate is not known to be 1 comes from
//! [`DriftEstimator::offset_bounds_at_within`](super::DriftEstimator::offset_bounds_at_within),
//! which contains every offset this interval allows.
//!
//! State is four integers: O(1) per sample, no storage.

use super::sample::{EstimateError, ProbeSample, midpoint_floor};

/// The constant-offset interval and its centre: guaranteed only for a guest at exactly the
/// host's rate (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct OffsetEstimate {
    /// The interval's centre, `floor((min + max) / 2)`: the estimate minimising the worst case.
    pub offset: i64,
    /// The smallest offset (`guest - host`) consistent with every sample, inclusive.
    pub min: i64,
    /// The largest offset consistent with every sample, inclusive.
    pub max: i64,
    /// How many samples were intersected.
    pub samples: u32,
}

impl OffsetEstimate {
    /// `max - min` in ticks: the guaranteed error bound is half of it around `offset` (rounded
    /// up by the floor of the centre).
    #[must_use]
    pub const fn width(&self) -> u64 {
        self.max.abs_diff(self.min)
    }
}

/// Incremental intersection of per-probe offset intervals for one vCPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffsetInterval {
    min: i64,
    max: i64,
    samples: u32,
    vcpu: u32,
}

impl Default for OffsetInterval {
    fn default() -> Self {
        Self::new()
    }
}

impl OffsetInterval {
    /// An empty interval (no sample yet).
    #[must_use]
    pub const fn new() -> Self {
        Self {
            min: i64::MIN,
            max: i64::MAX,
            samples: 0,
            vcpu: 0,
        }
    }

    /// Intersects one more sample's interval.
    ///
    /// # Errors
    /// `SegmentBreak` if the intersection would become empty (the state is left unchanged, so
    /// the caller can close this segment and start the next one with this sample);
    /// `InvalidSample` if `host_recv < host_send`; `VcpuMismatch` if the vCPU differs from
    /// the first sample's; `Overflow` if a bound does not fit an `i64`.
    pub fn push(&mut self, s: &ProbeSample) -> Result<(), EstimateError> {
        if s.host_recv < s.host_send {
            return Err(EstimateError::InvalidSample);
        }
        if self.samples > 0 && s.vcpu != self.vcpu {
            return Err(EstimateError::VcpuMismatch);
        }
        let g = i128::from(s.guest.0);
        let lo =
            i64::try_from(g - i128::from(s.host_recv.0)).map_err(|_| EstimateError::Overflow)?;
        let hi =
            i64::try_from(g - i128::from(s.host_send.0)).map_err(|_| EstimateError::Overflow)?;
        let (min, max) = (self.min.max(lo), self.max.min(hi));
        if min > max {
            return Err(EstimateError::SegmentBreak);
        }
        self.min = min;
        self.max = max;
        self.vcpu = s.vcpu;
        self.samples = self.samples.saturating_add(1);
        Ok(())
    }

    /// The interval so far and its centre.
    ///
    /// # Errors
    /// `NoSamples` before the first successful [`push`](Self::push).
    pub fn estimate(&self) -> Result<OffsetEstimate, EstimateError> {
        if self.samples == 0 {
            return Err(EstimateError::NoSamples);
        }
        Ok(OffsetEstimate {
            offset: midpoint_floor(self.min, self.max),
            min: self.min,
            max: self.max,
            samples: self.samples,
        })
    }
}

/// Intersects all samples' intervals (see [`OffsetInterval`]).
///
/// # Errors
/// As [`OffsetInterval::push`] and [`OffsetInterval::estimate`].
pub fn estimate_offset(samples: &[ProbeSample]) -> Result<OffsetEstimate, EstimateError> {
    let mut acc = OffsetInterval::new();
    for s in samples {
        acc.push(s)?;
    }
    acc.estimate()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(send: u64, guest: u64, recv: u64) -> ProbeSample {
        crate::estimate::sample::test_sample(send, guest, recv, 1)
    }

    #[test]
    fn intersects_and_centres() {
        // Offset 1000: readings at host 105 and 230.
        let s = [p(100, 1_105, 120), p(200, 1_230, 240)];
        // [985, 1005] ∩ [990, 1030] = [990, 1005].
        assert_eq!(
            estimate_offset(&s),
            Ok(OffsetEstimate {
                offset: 997,
                min: 990,
                max: 1_005,
                samples: 2
            })
        );
        assert_eq!(estimate_offset(&s).unwrap().width(), 15);
    }

    #[test]
    fn step_change_is_a_segment_break_and_keeps_state() {
        let mut acc = OffsetInterval::new();
        acc.push(&p(100, 1_105, 120)).unwrap();
        let before = acc;
        assert_eq!(
            acc.push(&p(200, 5_230, 240)),
            Err(EstimateError::SegmentBreak)
        );
        assert_eq!(acc, before);
        assert_eq!(acc.estimate().map(|e| e.samples), Ok(1));
    }

    #[test]
    fn rejects_bad_input() {
        assert_eq!(OffsetInterval::default(), OffsetInterval::new());
        let mut acc = OffsetInterval::default();
        assert_eq!(acc.estimate(), Err(EstimateError::NoSamples));
        assert_eq!(acc.push(&p(10, 0, 9)), Err(EstimateError::InvalidSample));
        assert_eq!(
            acc.push(&p(u64::MAX, 0, u64::MAX)),
            Err(EstimateError::Overflow)
        );
        acc.push(&p(1, 1, 2)).unwrap();
        let mut other = p(3, 3, 4);
        other.vcpu = 9;
        assert_eq!(acc.push(&other), Err(EstimateError::VcpuMismatch));
        assert_eq!(estimate_offset(&[]), Err(EstimateError::NoSamples));
    }

    proptest! {
        /// Against a naive reference: the interval is exactly max(guest - recv)..min(guest - send)
        /// and contains the true offset whenever each reading lies inside its bracket.
        #[test]
        fn matches_naive_reference(
            offset in -(1_i64 << 40)..(1_i64 << 40),
            probes in proptest::collection::vec((0_u64..1 << 40, 0_u64..1 << 20, 0_u64..1 << 20), 1..40),
        ) {
            let base = 1_u64 << 42;
            let samples: std::vec::Vec<ProbeSample> = probes
                .iter()
                .map(|&(start, fwd, back)| {
                    let send = base + start;
                    let t = send + fwd;
                    let guest = u64::try_from(i128::from(t) + i128::from(offset)).unwrap();
                    p(send, guest, t + back)
                })
                .collect();
            let e = estimate_offset(&samples).unwrap();
            let lo = samples.iter().map(|s| i128::from(s.guest.0) - i128::from(s.host_recv.0)).max().unwrap();
            let hi = samples.iter().map(|s| i128::from(s.guest.0) - i128::from(s.host_send.0)).min().unwrap();
            prop_assert_eq!(i128::from(e.min), lo);
            prop_assert_eq!(i128::from(e.max), hi);
            prop_assert!(e.min <= offset && offset <= e.max);
            prop_assert!(e.min <= e.offset && e.offset <= e.max);
        }
    }
}
