//! The probe sample every estimator consumes, the errors they share and exact rationals.
//!
//! A probe is one host→guest→host round trip: the host reads its TSC, sends, the guest reads
//! its TSC and answers, the host reads its TSC again when the answer arrives. The guest
//! reading therefore happened at some host instant in `[host_send, host_recv]`: that single
//! fact is what the bounded estimators build on.

use crate::{GuestTicks, HostTicks};

/// One host→guest→host probe: the guest TSC reading bracketed by two host TSC readings.
///
/// Offsets in this module follow KVM's `tsc-offset` sign: `offset = guest - host`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct ProbeSample {
    /// Host TSC read just before the probe left the host.
    pub host_send: HostTicks,
    /// Guest TSC read by the agent while answering the probe.
    pub guest: GuestTicks,
    /// Host TSC read just after the answer arrived.
    pub host_recv: HostTicks,
    /// The vCPU that took the guest reading; estimators never mix vCPUs.
    pub vcpu: u32,
}

impl ProbeSample {
    /// Round-trip time in host ticks, or `None` if `host_recv` precedes `host_send`.
    #[inline]
    #[must_use]
    pub const fn rtt(&self) -> Option<u64> {
        self.host_recv.0.checked_sub(self.host_send.0)
    }
}

/// A sample from raw tick counts, for the estimators' unit tests.
#[cfg(test)]
pub(crate) const fn test_sample(send: u64, guest: u64, recv: u64, vcpu: u32) -> ProbeSample {
    ProbeSample {
        host_send: HostTicks(send),
        guest: GuestTicks(guest),
        host_recv: HostTicks(recv),
        vcpu,
    }
}

/// Why an estimator produced no result. Small and `Copy` so no_std callers can match on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum EstimateError {
    /// No sample was given, so there is nothing to estimate.
    NoSamples,
    /// A sample's `host_recv` precedes its `host_send`: it brackets nothing.
    InvalidSample,
    /// Samples from different vCPUs were mixed; each vCPU has its own offset.
    VcpuMismatch,
    /// A sample's host readings go backwards relative to the previous sample.
    OutOfOrder,
    /// No constant relation fits all samples: the offset (or rate) changed, start a new segment.
    SegmentBreak,
    /// A value leaves the integer range the exact arithmetic is proven for.
    Overflow,
    /// The samples do not bound the rate yet (it needs two non-overlapping probes).
    Unbounded,
}

/// An exact rational `num / den` with `den > 0`, used for rates (guest ticks per host tick).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Ratio {
    /// Numerator (any sign).
    pub num: i128,
    /// Denominator, always positive.
    pub den: i128,
}

impl Ratio {
    /// `num / den` normalised to a positive denominator, or `None` if `den == 0` or negating
    /// overflows.
    #[must_use]
    pub fn new(num: i128, den: i128) -> Option<Self> {
        if den > 0 {
            Some(Self { num, den })
        } else if den < 0 {
            Some(Self {
                num: num.checked_neg()?,
                den: den.checked_neg()?,
            })
        } else {
            None
        }
    }

    /// `self < other`, or `None` if the cross products overflow `i128`.
    #[must_use]
    pub fn try_lt(&self, other: &Self) -> Option<bool> {
        Some(self.num.checked_mul(other.den)? < other.num.checked_mul(self.den)?)
    }

    /// Drift against identity, `(num/den - 1) * 1e9`, rounded down (None on overflow).
    #[must_use]
    pub fn drift_ppb_floor(&self) -> Option<i64> {
        let n = self.num.checked_sub(self.den)?.checked_mul(1_000_000_000)?;
        i64::try_from(div_floor(n, self.den)?).ok()
    }

    /// Drift against identity, `(num/den - 1) * 1e9`, rounded up (None on overflow).
    #[must_use]
    pub fn drift_ppb_ceil(&self) -> Option<i64> {
        let n = self.num.checked_sub(self.den)?.checked_mul(1_000_000_000)?;
        i64::try_from(div_ceil(n, self.den)?).ok()
    }
}

/// Rates assumed possible before any sample is seen: `0 < min <= rate <= max`.
///
/// The drift estimator's bounds need two probes that do not overlap in host time before the
/// samples alone bound the rate; until then (and always, as a safety net) a caller can state
/// the rates it considers possible, and the offset bounds hold for every constant rate in
/// `[min, max]` consistent with the samples. The bounds are as trustworthy as this assumption:
/// choose it wide (the host's probe session assumes `[1/2, 2]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct RateLimits {
    min: Ratio,
    max: Ratio,
}

impl RateLimits {
    /// `[min, max]`, or `None` unless both denominators are positive and `0 < min <= max`
    /// (or the comparison overflows). A `const fn`, so fixed limits are checked at compile
    /// time.
    #[must_use]
    pub const fn new(min: Ratio, max: Ratio) -> Option<Self> {
        if min.den <= 0 || max.den <= 0 || min.num <= 0 {
            return None;
        }
        match (max.num.checked_mul(min.den), min.num.checked_mul(max.den)) {
            (Some(a), Some(b)) if a >= b => Some(Self { min, max }),
            _ => None,
        }
    }

    /// The smallest rate assumed possible.
    #[must_use]
    pub const fn min(&self) -> Ratio {
        self.min
    }

    /// The largest rate assumed possible.
    #[must_use]
    pub const fn max(&self) -> Ratio {
        self.max
    }
}

/// `floor(n / d)` for any signs; `None` when `d == 0` or the quotient overflows.
pub(crate) fn div_floor(n: i128, d: i128) -> Option<i128> {
    let q = n.checked_div(d)?;
    let r = n.checked_rem(d)?;
    if r != 0 && ((r < 0) != (d < 0)) {
        q.checked_sub(1)
    } else {
        Some(q)
    }
}

/// `ceil(n / d)` for any signs; `None` when `d == 0` or the quotient overflows.
pub(crate) fn div_ceil(n: i128, d: i128) -> Option<i128> {
    let q = n.checked_div(d)?;
    let r = n.checked_rem(d)?;
    if r != 0 && ((r < 0) == (d < 0)) {
        q.checked_add(1)
    } else {
        Some(q)
    }
}

/// `floor((a + b) / 2)` without intermediate overflow, for centring an interval.
pub(crate) fn midpoint_floor(a: i64, b: i64) -> i64 {
    let m = (i128::from(a) + i128::from(b)).div_euclid(2);
    // The mean of two i64 values always lies between them, so it fits an i64.
    #[allow(clippy::cast_possible_truncation)]
    let m = m as i64;
    m
}

/// Checks that every sample comes from the same vCPU (the first one's).
pub(crate) fn same_vcpu(samples: &[ProbeSample]) -> Result<(), EstimateError> {
    match samples.first() {
        None => Err(EstimateError::NoSamples),
        Some(first) if samples.iter().all(|s| s.vcpu == first.vcpu) => Ok(()),
        Some(_) => Err(EstimateError::VcpuMismatch),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rtt_rejects_reversed() {
        let s = ProbeSample {
            host_send: HostTicks(10),
            guest: GuestTicks(0),
            host_recv: HostTicks(9),
            vcpu: 0,
        };
        assert_eq!(s.rtt(), None);
        let s = ProbeSample {
            host_recv: HostTicks(15),
            ..s
        };
        assert_eq!(s.rtt(), Some(5));
    }

    #[test]
    fn ratio_normalises_and_compares() {
        assert_eq!(Ratio::new(1, 0), None);
        assert_eq!(Ratio::new(3, -4), Some(Ratio { num: -3, den: 4 }));
        let a = Ratio::new(1, 3).unwrap();
        let b = Ratio::new(1, 2).unwrap();
        assert_eq!(a.try_lt(&b), Some(true));
        assert_eq!(b.try_lt(&a), Some(false));
        assert_eq!(Ratio::new(i128::MAX, 1).unwrap().try_lt(&b), None);
    }

    #[test]
    fn drift_rounds_outward() {
        // 1 + 1/3e9 → 1/3 ppb: floor 0, ceil 1.
        let r = Ratio::new(3_000_000_001, 3_000_000_000).unwrap();
        assert_eq!(r.drift_ppb_floor(), Some(0));
        assert_eq!(r.drift_ppb_ceil(), Some(1));
        let r = Ratio::new(2_999_999_999, 3_000_000_000).unwrap();
        assert_eq!(r.drift_ppb_floor(), Some(-1));
        assert_eq!(r.drift_ppb_ceil(), Some(0));
        let r = Ratio::new(1_000_050_000, 1_000_000_000).unwrap();
        assert_eq!(r.drift_ppb_floor(), Some(50_000));
        assert_eq!(r.drift_ppb_ceil(), Some(50_000));
    }

    #[test]
    fn rate_limits_need_a_positive_ordered_range() {
        let r = |n, d| Ratio::new(n, d).unwrap();
        let l = RateLimits::new(r(1, 2), r(2, 1)).unwrap();
        assert_eq!((l.min(), l.max()), (r(1, 2), r(2, 1)));
        // A denominator must be positive, as `Ratio::new` makes it.
        assert_eq!(RateLimits::new(Ratio { num: -1, den: -2 }, r(1, 1)), None);
        assert_eq!(
            RateLimits::new(
                r(1, 2),
                Ratio {
                    num: 1,
                    den: i128::MAX
                }
            ),
            None
        );
        assert_eq!(
            RateLimits::new(
                r(1, 2),
                Ratio {
                    num: i128::MAX,
                    den: 3
                }
            ),
            None
        );
        assert_eq!(RateLimits::new(r(0, 1), r(1, 1)), None);
        assert_eq!(RateLimits::new(r(-1, 1), r(1, 1)), None);
        assert_eq!(RateLimits::new(r(3, 2), r(1, 1)), None);
        assert_eq!(RateLimits::new(r(1, 1), Ratio { num: 1, den: 0 }), None);
        assert!(RateLimits::new(r(1, 1), r(1, 1)).is_some());
    }

    #[test]
    fn division_edges() {
        assert_eq!(div_floor(7, 0), None);
        assert_eq!(div_floor(i128::MIN, -1), None);
        assert_eq!(div_floor(-7, 2), Some(-4));
        assert_eq!(div_ceil(-7, 2), Some(-3));
        assert_eq!(div_floor(7, -2), Some(-4));
        assert_eq!(div_ceil(7, -2), Some(-3));
        assert_eq!(midpoint_floor(i64::MAX, i64::MAX), i64::MAX);
        assert_eq!(midpoint_floor(i64::MIN, i64::MAX), -1);
        assert_eq!(midpoint_floor(-3, 0), -2);
    }

    proptest! {
        #[test]
        fn floor_ceil_bracket_the_quotient(n in any::<i64>(), d in any::<i64>()) {
            prop_assume!(d != 0);
            let (n, d) = (i128::from(n), i128::from(d));
            let f = div_floor(n, d).unwrap();
            let c = div_ceil(n, d).unwrap();
            // f <= n/d < f + 1 and c - 1 < n/d <= c, checked by multiplying out with |d|.
            let (n2, d2) = if d < 0 { (-n, -d) } else { (n, d) };
            prop_assert!(f * d2 <= n2 && n2 < (f + 1) * d2);
            prop_assert!((c - 1) * d2 < n2 && n2 <= c * d2);
        }
    }
}
