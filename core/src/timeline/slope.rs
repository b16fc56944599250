//! The fixed-point rate of a segment: host ticks per guest tick, `mul / 2^shift`.
//!
//! A slope is stored as a binary fixed-point number with a per-slope shift, like perf's
//! `time_mult`/`time_shift` and pvclock's `tsc_to_system_mul`/`tsc_shift`, but with a 63-bit
//! multiplier: `mul < 2^63` and `shift <= 127`. That keeps `d * mul + frac` below `2^128`
//! for every 64-bit guest distance `d` and every fraction `frac < 2^shift`, so the hot path
//! of the timeline needs one 64×64→128 multiply, one 128-bit add and one shift, and never
//! overflows the intermediate.
//!
//! Slopes built from a ratio are *normalized*: `2^62 <= mul < 2^63`, which gives a relative
//! precision of `2^-62` (about 2.2e-10 ppb) whatever the magnitude of the slope. A slope that
//! is a dyadic rational with few enough bits (1, 2^k, KVM's default `2^frac / 2^frac`) is
//! stored exactly.

/// A positive rate `mul / 2^shift` (host ticks per guest tick), with `0 < mul < 2^63` and
/// `shift <= 127`.
///
/// The invariant is what lets [`crate::timeline::Segment`] convert with a single 128-bit
/// product and no overflow check on the intermediate; it is enforced by every constructor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Slope {
    mul: u64,
    shift: u32,
}

/// `2^62`: the lower bound of a normalized multiplier.
const MUL_MIN_NORMALIZED: u64 = 1 << 62;
/// `2^63`: the exclusive upper bound of every multiplier.
const MUL_LIMIT: u64 = 1 << 63;
/// The largest shift a slope may carry (the product `d * mul` is at most 127 bits wide).
const SHIFT_MAX: u32 = 127;
/// One billion, the denominator of a parts-per-billion rate.
const PPB_DEN: u64 = 1_000_000_000;

impl Slope {
    /// Exactly one host tick per guest tick (`2^62 / 2^62`): identity and offset segments use it
    /// and convert without any rounding.
    pub const ONE: Self = Self {
        mul: MUL_MIN_NORMALIZED,
        shift: 62,
    };

    /// A slope from its raw parts, `mul / 2^shift`; `None` unless `0 < mul < 2^63` and
    /// `shift <= 127`.
    ///
    /// This is the lossless way to restore a slope that was stored or sent with
    /// [`Slope::mul`] and [`Slope::shift`].
    #[must_use]
    pub const fn try_from_raw(mul: u64, shift: u32) -> Option<Self> {
        if mul == 0 || mul >= MUL_LIMIT || shift > SHIFT_MAX {
            None
        } else {
            Some(Self { mul, shift })
        }
    }

    /// The slope `num / den`, rounded down to a normalized `mul / 2^shift`.
    ///
    /// The stored slope `s'` satisfies `s' <= num/den < s' + 2^-shift` with `2^-shift <= s' *
    /// 2^-62`: the relative error is below `2^-62`, and it is zero when `num/den` is a dyadic
    /// rational of at most 62 significant bits (for example 1). `None` if `num` or `den` is 0,
    /// or for an absurd slope above `2^62` that cannot be normalized (no clock pair runs at
    /// such a ratio; every slope below `2^62` is accepted).
    #[must_use]
    pub const fn try_from_ratio_floor(num: u64, den: u64) -> Option<Self> {
        if num == 0 || den == 0 {
            return None;
        }
        let num_bits = u64::BITS - num.leading_zeros();
        let den_bits = u64::BITS - den.leading_zeros();
        // num/den lies in (2^(num_bits-1-den_bits), 2^(num_bits-den_bits+1)), so with
        // shift = 62 - (num_bits - den_bits) the scaled quotient lies in [2^61, 2^63): at most
        // one doubling normalizes it.
        let shift = 62 + den_bits;
        if num_bits > shift {
            return None;
        }
        let shift = shift - num_bits;
        let mul = scaled_quotient_floor(num, den, shift);
        if mul >= MUL_MIN_NORMALIZED {
            Some(Self { mul, shift })
        } else {
            Some(Self {
                mul: scaled_quotient_floor(num, den, shift + 1),
                shift: shift + 1,
            })
        }
    }

    /// The slope `1 + ppb / 10^9`: the host clock runs `ppb` parts per billion faster than the
    /// guest clock (negative: slower). Rounded down like [`Slope::try_from_ratio_floor`].
    ///
    /// `None` unless `ppb > -10^9` (a non-positive rate is not a clock).
    #[must_use]
    pub const fn try_from_ppb_floor(ppb: i64) -> Option<Self> {
        // 10^9 + ppb as i128 cannot overflow; it must be positive and fit a u64.
        #[allow(clippy::cast_lossless)] // `i128::from` is not const.
        let num = PPB_DEN as i128 + ppb as i128;
        if num <= 0 || num > u64::MAX as i128 {
            return None;
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 0 < num <= u64::MAX.
        Self::try_from_ratio_floor(num as u64, PPB_DEN)
    }

    /// The inverse slope of a KVM TSC scaling ratio, `2^frac_bits / ratio` host ticks per guest
    /// tick, precomputed once as a reciprocal and rounded down.
    ///
    /// KVM scales `guest = offset + ((host * ratio) >> frac_bits)` (see [`crate::mapping`]); trace
    /// conversion needs the inverse. This rounded reciprocal is **not** that inverse (the
    /// floor of a line through it lands up to two ticks below
    /// [`crate::mapping::KvmTscMapping::try_host_from_guest_ceil`]); a KVM
    /// [`crate::timeline::Segment`] uses it only as the estimate it then corrects. `None` if
    /// `ratio` is 0, `frac_bits > 63` (KVM uses 48 on Intel and 32 on AMD), or the slope
    /// exceeds `2^62`.
    #[must_use]
    pub const fn try_from_kvm_ratio_floor(ratio: u64, frac_bits: u32) -> Option<Self> {
        if frac_bits > 63 {
            return None;
        }
        Self::try_from_ratio_floor(1 << frac_bits, ratio)
    }

    /// The multiplier: the slope is `mul / 2^shift`.
    #[must_use]
    pub const fn mul(self) -> u64 {
        self.mul
    }

    /// The shift: the slope is `mul / 2^shift`.
    #[must_use]
    pub const fn shift(self) -> u32 {
        self.shift
    }
}

/// `floor(num * 2^shift / den)` for `den != 0`, `shift <= 127`, when the result fits a `u64`.
///
/// `num * 2^shift` may need up to 191 bits, so the division is done in two steps: first with
/// up to 64 bits of the shift (the dividend then fits a `u128`), then the remainder (below
/// `den < 2^64`) is shifted by the rest (at most 63 bits) and divided again. The caller only
/// asks for shifts whose result is below `2^63`, so the final combination cannot overflow;
/// `wrapping_` spells out that the truncation is known to be lossless.
const fn scaled_quotient_floor(num: u64, den: u64, shift: u32) -> u64 {
    let first = if shift > 64 { 64 } else { shift };
    let rest = shift - first;
    #[allow(clippy::cast_lossless)] // `u128::from` is not const.
    let (num, den) = (num as u128, den as u128);
    let scaled = num << first;
    let q1 = scaled / den;
    let r1 = scaled % den;
    let q = (q1 << rest).wrapping_add((r1 << rest) / den);
    #[allow(clippy::cast_possible_truncation)] // Callers guarantee q < 2^63 (see above).
    let q = q as u64;
    q
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `num/den - mul/2^shift` scaled by `den * 2^shift`, i.e. `num * 2^shift - mul * den`.
    ///
    /// A normalized shift is about `62 + bits(den) - bits(num)`, so `num * 2^shift` has at most
    /// 127 bits and fits a u128; `None` would mean the shift is not the normalized one.
    fn exact_gap(num: u64, den: u64, s: Slope) -> Option<u128> {
        let lhs = u128::from(num).checked_shl(s.shift)?;
        if lhs >> s.shift != u128::from(num) {
            return None;
        }
        let rhs = u128::from(s.mul) * u128::from(den);
        lhs.checked_sub(rhs)
    }

    #[test]
    fn one_is_exact_and_normalized() {
        assert_eq!(Slope::try_from_ratio_floor(1, 1), Some(Slope::ONE));
        assert_eq!(Slope::try_from_ratio_floor(7, 7), Some(Slope::ONE));
        assert_eq!(Slope::try_from_ppb_floor(0), Some(Slope::ONE));
        assert_eq!(
            Slope::try_from_kvm_ratio_floor(1 << 48, 48),
            Some(Slope::ONE)
        );
        assert_eq!(
            Slope::try_from_kvm_ratio_floor(1 << 32, 32),
            Some(Slope::ONE)
        );
        assert_eq!(
            Slope::try_from_ratio_floor(2, 1),
            Some(Slope {
                mul: 1 << 62,
                shift: 61
            })
        );
    }

    #[test]
    fn rejects_degenerate_inputs() {
        assert_eq!(Slope::try_from_ratio_floor(0, 1), None);
        assert_eq!(Slope::try_from_ratio_floor(1, 0), None);
        assert_eq!(Slope::try_from_ratio_floor(1 << 63, 1), None);
        assert_eq!(Slope::try_from_ratio_floor(u64::MAX, 1), None);
        assert!(Slope::try_from_ratio_floor(1 << 62, 1).is_some());
        assert!(Slope::try_from_ratio_floor((1 << 62) - 1, 1).is_some());
        assert_eq!(Slope::try_from_ppb_floor(-1_000_000_000), None);
        assert_eq!(Slope::try_from_ppb_floor(i64::MIN), None);
        assert!(Slope::try_from_ppb_floor(i64::MAX).is_some());
        assert_eq!(Slope::try_from_kvm_ratio_floor(0, 48), None);
        assert_eq!(Slope::try_from_kvm_ratio_floor(1, 63), None);
        assert_eq!(Slope::try_from_kvm_ratio_floor(1 << 1, 64), None);
        assert_eq!(
            Slope::try_from_kvm_ratio_floor(1 << 63, 63),
            Some(Slope::ONE)
        );
        assert_eq!(Slope::try_from_raw(0, 3), None);
        assert_eq!(Slope::try_from_raw(1 << 63, 3), None);
        assert_eq!(Slope::try_from_raw(5, 128), None);
        assert_eq!(
            Slope::try_from_raw(5, 127).map(|s| (s.mul(), s.shift())),
            Some((5, 127))
        );
    }

    #[test]
    fn extreme_ratios_stay_in_range() {
        for (num, den) in [
            (1, u64::MAX),
            (u64::MAX, u64::MAX),
            ((1 << 62) - 1, 1),
            (1, (1 << 63) + 1),
        ] {
            let s = Slope::try_from_ratio_floor(num, den).unwrap();
            assert!(
                (MUL_MIN_NORMALIZED..MUL_LIMIT).contains(&s.mul),
                "{num}/{den}"
            );
            assert!(s.shift <= SHIFT_MAX, "{num}/{den}");
        }
        assert_eq!(Slope::try_from_ratio_floor(1, u64::MAX).unwrap().shift, 126);
    }

    proptest! {
        /// The stored slope is the floor of num/den at its shift: 0 <= num/den - mul/2^s <
        /// 2^-s, checked as 0 <= num*2^s - mul*den < den.
        #[test]
        fn ratio_is_floor_at_its_shift(
            num in 1u64..,
            den in 1u64..,
            num_cut in 0u32..64,
            den_cut in 0u32..64,
        ) {
            // Cut random bit widths off both so that slopes far from 1 are covered too.
            let (num, den) = ((num >> num_cut).max(1), (den >> den_cut).max(1));
            if let Some(s) = Slope::try_from_ratio_floor(num, den) {
                prop_assert!((MUL_MIN_NORMALIZED..MUL_LIMIT).contains(&s.mul));
                let gap = exact_gap(num, den, s);
                prop_assert!(gap.is_some_and(|g| g < u128::from(den)), "gap {gap:?} den {den}");
            } else {
                // Only slopes above 2^62 are refused.
                prop_assert!(u128::from(num) > u128::from(den) << 62);
            }
        }

        /// Small ratios reach shifts where the exact check fits: cover them densely.
        #[test]
        fn ratio_near_one_is_floor(num in 1u64..1 << 40, den in 1u64..1 << 40) {
            let s = Slope::try_from_ratio_floor(num, den).unwrap();
            let gap = exact_gap(num, den, s).unwrap();
            prop_assert!(gap < u128::from(den));
        }
    }
}
