//! The guest rates every bound assumes: `[1/2, 2]` guest ticks per host tick. The probe
//! session unwraps compact replies inside that window (docs/probe.md), and the guaranteed
//! bounds of a round, a segment and a placement hold for every constant rate within it, so
//! they add no assumption of their own (ARCHITECTURE.md, "Bounds always contain the truth").

use vmtsync_core::estimate::{RateLimits, Ratio};

/// The slowest guest TSC rate against the host's, as `(num, den)`.
pub const RATE_MIN: (u64, u64) = (1, 2);

/// The fastest guest TSC rate against the host's, as `(num, den)`.
pub const RATE_MAX: (u64, u64) = (2, 1);

/// `[RATE_MIN, RATE_MAX]` as the estimators take it.
pub const RATE_LIMITS: RateLimits = match RateLimits::new(ratio(RATE_MIN), ratio(RATE_MAX)) {
    Some(l) => l,
    None => panic!("RATE_MIN and RATE_MAX must be positive and ordered"),
};

/// Vertices per hull of the drift estimator (bounds stay sound when it saturates).
pub const HULL_CAPACITY: usize = 64;

/// A `(num, den)` rate constant as a [`Ratio`] (u64 always fits i128; `From` is not const).
#[allow(clippy::cast_lossless)]
const fn ratio((num, den): (u64, u64)) -> Ratio {
    Ratio {
        num: num as i128,
        den: den as i128,
    }
}

/// The limits as drift bounds, rounded outward: what a segment says while its samples do not
/// bound the rate yet.
#[must_use]
pub fn limits_ppb() -> (Option<i64>, Option<i64>) {
    (
        RATE_LIMITS.min().drift_ppb_floor(),
        RATE_LIMITS.max().drift_ppb_ceil(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limits_are_a_half_and_two() {
        // Reports spell the limits out ("[1/2, 2]", -500000000..1000000000 ppb): they must
        // change with them.
        assert_eq!((RATE_MIN, RATE_MAX), ((1, 2), (2, 1)));
        assert_eq!(RATE_LIMITS.min(), Ratio { num: 1, den: 2 });
        assert_eq!(RATE_LIMITS.max(), Ratio { num: 2, den: 1 });
        assert_eq!(limits_ppb(), (Some(-500_000_000), Some(1_000_000_000)));
    }
}
