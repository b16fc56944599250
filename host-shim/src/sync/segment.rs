//! The one step from a round's samples to a sync segment: the cumulative drift estimate over
//! every round since the last break (one per vCPU: every vCPU's TSC is its own clock,
//! docs/smp.md), and the segment it proves at the round's anchor. `probe --continuous`,
//! both front ends of `record` and the tests take it.

use vmtsync_core::estimate::{DriftEstimator, EstimateError, ProbeSample};

use super::rate::{HULL_CAPACITY, RATE_LIMITS, limits_ppb};
use super::round::Round;
use crate::syncfile::{AnchorKind, OffsetModel, SyncSegment};

/// The cumulative estimate across rounds since the last break.
#[derive(Debug)]
pub struct Cumulative {
    est: DriftEstimator<HULL_CAPACITY>,
    rounds: u64,
}

impl Default for Cumulative {
    fn default() -> Self {
        Self::new()
    }
}

impl Cumulative {
    /// No round yet.
    #[must_use]
    pub fn new() -> Self {
        Self {
            est: DriftEstimator::new(),
            rounds: 0,
        }
    }

    /// Round `r` (of `samples`, numbered `index`, its host brackets from `anchor`) added to
    /// the estimate, and the segment it makes: a break when no constant rate within the
    /// limits fits it together with the earlier rounds (the estimate then restarts from it).
    ///
    /// # Errors
    /// `Overflow` when the segment's guest anchor leaves `u64`; `NoSamples` without samples.
    pub fn add_round(
        &mut self,
        r: &Round,
        samples: &[ProbeSample],
        index: u64,
        anchor: AnchorKind,
    ) -> Result<SyncSegment, EstimateError> {
        let is_break = self.add(samples);
        self.segment(r, samples, index, is_break, anchor)
    }

    /// Adds a round; returns whether it broke the previous estimate (then the estimate
    /// restarts from this round alone).
    fn add(&mut self, samples: &[ProbeSample]) -> bool {
        let mut trial = self.est.clone();
        let fits = samples.iter().all(|s| trial.push(s).is_ok())
            && !matches!(trial.estimate(), Err(EstimateError::SegmentBreak));
        if fits {
            self.est = trial;
            self.rounds += 1;
            return false;
        }
        let had_rounds = self.rounds > 0;
        self.est = DriftEstimator::new();
        for s in samples {
            // A round the estimator refuses on its own leaves it empty; the round's own
            // offset bounds are used then.
            if self.est.push(s).is_err() {
                self.est = DriftEstimator::new();
                break;
            }
        }
        self.rounds = 1;
        had_rounds
    }

    /// The round's segment from the cumulative estimate (constant rate since the last break,
    /// within [`RATE_LIMITS`]); when that estimate is empty (a round it refused on its own),
    /// from the round's own guaranteed bounds. Both hold for any constant rate within the
    /// limits that fits the samples, so the first round's segment is valid even before the
    /// samples bound the rate; its drift bounds are then the limits themselves, never
    /// "exactly 0".
    fn segment(
        &self,
        r: &Round,
        samples: &[ProbeSample],
        index: u64,
        is_break: bool,
        anchor: AnchorKind,
    ) -> Result<SyncSegment, EstimateError> {
        let at = r.at_host;
        let (lo, hi) = self
            .est
            .offset_bounds_at_within(at, &RATE_LIMITS)
            .unwrap_or((r.bound_lo, r.bound_hi));
        // Drift bounds to match: outward (the lower rate rounded down, the upper up), the
        // round's own when the cumulative estimate is empty, the limits when nothing tighter
        // is known.
        let (dlo, dhi) = match self.est.rate_bounds_within(&RATE_LIMITS) {
            Ok((a, b)) => (a.drift_ppb_floor(), b.drift_ppb_ceil()),
            Err(_) => r.drift.map_or(limits_ppb(), |d| (Some(d.lo), Some(d.hi))),
        };
        // Identity (KVM's default) when it fits; otherwise the centre of the bounds, which
        // halves the worst-case conversion error away from the anchor. The bound closest to
        // identity would convert a guest 100 ppm fast with the slowest rate that fits, early
        // by up to the whole drift width times the distance: measured, enough to put events
        // recorded after a port read before its exit (docs/validate.md).
        let used = match (dlo, dhi) {
            (Some(lo), Some(hi)) if lo > 0 || hi.max(lo) < 0 => {
                lo + i64::try_from((i128::from(hi.max(lo)) - i128::from(lo)) / 2).unwrap_or(0)
            }
            _ => 0,
        };
        let offset = lo + i64::try_from((i128::from(hi) - i128::from(lo)) / 2).unwrap_or(0);
        let guest_anchor =
            at.0.checked_add_signed(offset)
                .ok_or(EstimateError::Overflow)?;
        let first = samples.first().ok_or(EstimateError::NoSamples)?;
        let last = samples.last().ok_or(EstimateError::NoSamples)?;
        Ok(SyncSegment {
            vcpu: r.vcpu,
            round: index,
            guest_start: first.guest.0,
            host_anchor: at.0,
            guest_anchor,
            offset,
            offset_lo: lo,
            offset_hi: hi,
            drift_ppb: used,
            drift_ppb_lo: dlo,
            drift_ppb_hi: dhi,
            model: OffsetModel::Drift,
            probes: r.probes,
            rtt_min_ticks: r.rtt.min,
            host_first: first.host_send.0,
            host_last: last.host_recv.0,
            is_break,
            anchor,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmtsync_core::{GuestTicks, HostTicks};

    fn round(start: u64, n: u64, offset: u64) -> Vec<ProbeSample> {
        (0..n)
            .map(|i| {
                let send = start + i * 1000;
                ProbeSample {
                    host_send: HostTicks(send),
                    guest: GuestTicks(send + 100 + offset),
                    host_recv: HostTicks(send + 200),
                    vcpu: 0,
                }
            })
            .collect()
    }

    #[test]
    fn segments_of_a_drifting_guest_hold_the_truth_from_the_first_round() {
        use vmtsync_core::sim::{Delay, GuestClock, Link, Sim};
        // A guest 100 ppm fast behind tight asymmetric brackets (the exit-stamped shape). The
        // first round has one probe: the samples bound neither the rate nor, alone, the
        // offset, so the segment's bounds and drift come from the rate limits.
        let clock = GuestClock::with_drift_ppb(5_098_309_658_643, 100_000).unwrap();
        let link = Link::tight_asymmetric();
        let mut sim = Sim::new(7, HostTicks(1 << 41), clock, link, 0);
        let mut c = Cumulative::new();
        let mut centred = 0;
        for (round, probes) in [(0_u64, 1_usize), (1, 64), (2, 64)] {
            let samples: Vec<ProbeSample> = (0..probes).map(|_| sim.probe().unwrap()).collect();
            let r = Round::from_samples(&samples).unwrap();
            let seg = c
                .add_round(&r, &samples, round, AnchorKind::InProcess)
                .unwrap();
            assert!(!seg.is_break);
            assert_eq!(seg.model, OffsetModel::Drift);
            let at = HostTicks(seg.host_anchor);
            assert_eq!(
                clock.offset_within(at, seg.offset_lo, seg.offset_hi),
                Some(true),
                "round {round}: {seg:?}"
            );
            let (dlo, dhi) = (seg.drift_ppb_lo.unwrap(), seg.drift_ppb_hi.unwrap());
            assert_eq!(
                clock.drift_ppb_within(dlo, dhi),
                Some(true),
                "round {round}: {seg:?}"
            );
            if round == 0 {
                // Only the limits bound the first round's rate: [1/2, 2] as ppb.
                assert_eq!((dlo, dhi), (-500_000_000, 1_000_000_000));
            } else {
                assert!(dhi - dlo < 1_000_000, "round {round}: {seg:?}");
                // Identity while it fits; once it does not, the centre of the bounds, not an
                // end.
                if dlo > 0 {
                    assert!(
                        (seg.drift_ppb - (dlo + (dhi - dlo) / 2)).abs() <= 1,
                        "{seg:?}"
                    );
                    centred += 1;
                } else {
                    assert_eq!(seg.drift_ppb, 0, "{seg:?}");
                }
            }
        }
        assert_eq!(centred, 1, "round 2 excludes identity");
        // A one-probe round three host seconds later: the cumulative hull bounds it alone.
        sim.link.gap = Delay::Constant(3_000_000_000);
        let samples = [sim.probe().unwrap()];
        let r = Round::from_samples(&samples).unwrap();
        let seg = c.add_round(&r, &samples, 3, AnchorKind::InProcess).unwrap();
        assert!(!seg.is_break);
        assert_eq!(
            clock.offset_within(HostTicks(seg.host_anchor), seg.offset_lo, seg.offset_hi),
            Some(true),
            "{seg:?}"
        );
    }

    #[test]
    fn cumulative_estimate_tightens_and_detects_a_step() {
        let mut c = Cumulative::new();
        assert!(!c.add(&round(1_000_000, 16, 5_000)));
        let short = c.est.estimate().unwrap();
        assert!(!c.add(&round(1_000_000_000, 16, 5_000)));
        let long = c.est.estimate().unwrap();
        assert_eq!(c.rounds, 2);
        // A span a thousand times longer bounds the rate far more tightly.
        assert!(
            long.drift_ppb_max - long.drift_ppb_min
                < (short.drift_ppb_max - short.drift_ppb_min) / 100,
            "{short:?} {long:?}"
        );
        assert!(long.drift_ppb_min <= 0 && 0 <= long.drift_ppb_max);
        // The guest TSC jumps by a million ticks: a break, and the estimate restarts.
        assert!(c.add(&round(2_000_000_000, 16, 1_005_000)));
        assert_eq!(c.rounds, 1);
        let (lo, hi) = c.est.offset_bounds_at(HostTicks(2_000_000_000)).unwrap();
        assert!(lo <= 1_005_000 && 1_005_000 <= hi, "{lo} {hi}");
    }
}
