//! The one error type of the mapping constructors.

use core::fmt;

/// Why a mapping or conversion could not be built from the given parameters.
///
/// Every constructor in [`crate::mapping`] validates its invariants up front, so the
/// conversions themselves never divide by zero or shift by 64 or more; this enum says which
/// invariant the input broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum MappingError {
    /// The KVM scaling ratio is zero: it would collapse all host time onto one guest tick.
    ZeroRatio,
    /// `frac_bits` exceeds 63, so the identity ratio `1 << frac_bits` would not fit a `u64`.
    FracBitsTooLarge,
    /// The perf multiplier is zero: it would collapse all ticks onto one nanosecond value.
    ZeroMult,
    /// The perf shift exceeds 63, which no kernel produces and a `u64` cannot shift by.
    ShiftTooLarge,
}

impl fmt::Display for MappingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let msg = match self {
            Self::ZeroRatio => "TSC scaling ratio is zero",
            Self::FracBitsTooLarge => "TSC scaling frac_bits exceeds 63",
            Self::ZeroMult => "perf time multiplier is zero",
            Self::ShiftTooLarge => "perf time shift exceeds 63",
        };
        f.write_str(msg)
    }
}

impl core::error::Error for MappingError {}
