//! One linear piece of a timeline: `host = floor(host_anchor + (guest - guest_anchor) * slope)`.
//!
//! A segment does not store its anchor. It stores the *exact* host value at its own first guest
//! tick, split into an integer part `base` and a fraction `frac / 2^shift` (`frac < 2^shift`),
//! which is representable without loss because `(start - guest_anchor) * mul` is an integer
//! multiple of `2^-shift`. Converting a guest tick `t >= start` is then
//!
//! ```text
//! host = base + ((t - start) * mul + frac) >> shift          (u128 intermediate)
//! ```
//!
//! which equals `floor(host_anchor + (t - guest_anchor) * mul / 2^shift)` exactly: the only
//! rounding of a segment is the floor of that one expression, wherever the anchor lies.
//! The intermediate never overflows: `mul < 2^63` and `frac < 2^shift <= 2^127` (see
//! [`Slope`]). The error against the *true* rate (the ratio or ppb the slope was built from)
//! comes only from the slope's own rounding, documented on [`Slope::try_from_ratio_floor`] and
//! on [`Segment::try_from_kvm`].

use super::slope::Slope;
use crate::units::{GuestTicks, HostTicks};

/// A linear guest→host mapping that a [`super::Timeline`] applies from [`Segment::start`] up to
/// the next segment's start.
///
/// Built once per sync result (an exact KVM relation, or an estimator's offset and drift), then
/// used for millions of conversions, so construction precomputes everything the hot loop needs:
/// the host value at the start and the longest guest distance that cannot overflow `u64`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Segment {
    /// First guest tick this segment is meant for (inclusive).
    pub(super) start: u64,
    /// Integer part of the exact host value at `start`.
    pub(super) base: u64,
    /// Fractional part of the host value at `start`, in units of `2^-shift`; `< 2^shift`.
    pub(super) frac: u128,
    /// Host ticks per guest tick.
    pub(super) slope: Slope,
    /// The largest `d` for which `base + ((d * mul + frac) >> shift)` fits a `u64`. The cursor's
    /// fast path relies on it to skip the overflow checks.
    pub(super) fast_span: u64,
}

impl Segment {
    /// The identity from `start` on: `host = guest`, exactly.
    ///
    /// This is the ground truth on machines where KVM cannot offset or scale the TSC.
    #[must_use]
    pub const fn identity(start: GuestTicks) -> Self {
        Self {
            start: start.0,
            base: start.0,
            frac: 0,
            slope: Slope::ONE,
            // base + d fits while d <= u64::MAX - base.
            fast_span: u64::MAX - start.0,
        }
    }

    /// A pure offset from `start` on: `host = guest + host_minus_guest`, exactly.
    ///
    /// Note the sign: KVM's `tsc-offset` is `guest - host`, so pass its negation (or use
    /// [`Segment::try_from_kvm`]). `None` if `start + host_minus_guest` is not a valid host tick.
    #[must_use]
    pub fn try_offset(start: GuestTicks, host_minus_guest: i64) -> Option<Self> {
        let base = start.0.checked_add_signed(host_minus_guest)?;
        Some(Self {
            start: start.0,
            base,
            frac: 0,
            slope: Slope::ONE,
            fast_span: u64::MAX - base,
        })
    }

    /// The line through `(guest_anchor, host_anchor)` with `slope`, used from `start` on.
    ///
    /// This is how an estimator result (an offset measured at some instant plus a drift) becomes
    /// a segment; the anchor may lie before, at, or after `start`. `None` if the host value at
    /// `start` is outside `0..=u64::MAX` or `start` and the anchor are `2^64` or more apart.
    #[must_use]
    pub fn try_from_anchor(
        start: GuestTicks,
        guest_anchor: GuestTicks,
        host_anchor: HostTicks,
        slope: Slope,
    ) -> Option<Self> {
        Self::try_new(
            start.0,
            i128::from(guest_anchor.0),
            i128::from(host_anchor.0),
            slope,
        )
    }

    /// [`Segment::try_from_anchor`] with a rate in parts per billion: `1 + ppb/10^9` host ticks
    /// per guest tick (positive: the host clock runs faster). The rate is rounded down by less
    /// than `2^-62` relative (see [`Slope::try_from_ppb_floor`]).
    #[must_use]
    pub fn try_from_anchor_ppb(
        start: GuestTicks,
        guest_anchor: GuestTicks,
        host_anchor: HostTicks,
        ppb: i64,
    ) -> Option<Self> {
        Self::try_from_anchor(
            start,
            guest_anchor,
            host_anchor,
            Slope::try_from_ppb_floor(ppb)?,
        )
    }

    /// [`Segment::try_from_anchor`] with a rate of `num / den` host ticks per guest tick, rounded
    /// down by less than `2^-62` relative (see [`Slope::try_from_ratio_floor`]).
    #[must_use]
    pub fn try_from_anchor_ratio(
        start: GuestTicks,
        guest_anchor: GuestTicks,
        host_anchor: HostTicks,
        num: u64,
        den: u64,
    ) -> Option<Self> {
        Self::try_from_anchor(
            start,
            guest_anchor,
            host_anchor,
            Slope::try_from_ratio_floor(num, den)?,
        )
    }

    /// The inverse of a KVM vCPU relation `guest = tsc_offset + ((host * ratio) >> frac_bits)`
    /// (DESIGN §2), used from `start` on: `host ≈ ((guest - tsc_offset) << frac_bits) / ratio`.
    ///
    /// The division is replaced by a reciprocal precomputed here ([`Slope::try_from_kvm_ratio_floor`]),
    /// so the hot path only multiplies. Rounding, against `exact = floor(((guest - tsc_offset)
    /// << frac_bits) / ratio)` computed with unbounded integers: the result is never above
    /// `exact` and at most `1 + (exact >> 62)` below it, that is **at most one tick low for
    /// every host value below 2^62** (about 48 years of a 3 GHz TSC). It is exactly `exact`
    /// when `ratio` is a power of two (identity scaling included). Proof: the stored slope `s'`
    /// is below the true `s` by less than `2^-shift <= s'·2^-62`, so the real-valued results
    /// differ by less than `(guest - tsc_offset)·s'·2^-62 <= exact_real/2^62`.
    ///
    /// `tsc_offset` is the signed value KVM prints in debugfs `tsc-offset`. `None` if `ratio`
    /// is 0, `frac_bits >= 63`, or `start` maps outside the host range (in particular when
    /// `start < tsc_offset`: those guest ticks precede host tick 0).
    #[must_use]
    pub fn try_from_kvm(
        start: GuestTicks,
        tsc_offset: i64,
        ratio: u64,
        frac_bits: u32,
    ) -> Option<Self> {
        let slope = Slope::try_from_kvm_ratio_floor(ratio, frac_bits)?;
        Self::try_new(start.0, i128::from(tsc_offset), 0, slope)
    }

    /// A segment from the parts returned by [`Segment::start`], [`Segment::host_at_start`],
    /// [`Segment::host_frac_at_start`] and [`Segment::slope`]: the lossless way to store or
    /// send a segment. `None` unless `frac < 2^slope.shift()`.
    #[must_use]
    pub fn try_from_parts(
        start: GuestTicks,
        base: HostTicks,
        frac: u128,
        slope: Slope,
    ) -> Option<Self> {
        if frac >> slope.shift() != 0 {
            return None;
        }
        Some(Self {
            start: start.0,
            base: base.0,
            frac,
            slope,
            fast_span: fast_span(base.0, frac, slope),
        })
    }

    /// Shared constructor: anchors are `i128` so that a KVM offset (a signed guest tick) fits.
    fn try_new(start: u64, guest_anchor: i128, host_anchor: i128, slope: Slope) -> Option<Self> {
        let delta = i128::from(start) - guest_anchor;
        let distance = delta.unsigned_abs();
        if distance > u128::from(u64::MAX) {
            return None;
        }
        let shift = slope.shift();
        // distance < 2^64 and mul < 2^63: the product fits 127 bits.
        let product = distance * u128::from(slope.mul());
        let whole = i128::try_from(product >> shift).ok()?;
        let part = product & low_mask(shift);
        let (host, frac) = if delta >= 0 {
            (host_anchor.checked_add(whole)?, part)
        } else if part == 0 {
            (host_anchor.checked_sub(whole)?, 0)
        } else {
            // anchor - (whole + part/2^s) = (anchor - whole - 1) + (2^s - part)/2^s.
            let one = 1u128 << shift;
            (host_anchor.checked_sub(whole)?.checked_sub(1)?, one - part)
        };
        let base = u64::try_from(host).ok()?;
        Some(Self {
            start,
            base,
            frac,
            slope,
            fast_span: fast_span(base, frac, slope),
        })
    }

    /// First guest tick of this segment (inclusive).
    #[must_use]
    pub const fn start(&self) -> GuestTicks {
        GuestTicks(self.start)
    }

    /// The host tick of [`Segment::start`], rounded down.
    #[must_use]
    pub const fn host_at_start(&self) -> HostTicks {
        HostTicks(self.base)
    }

    /// The fraction the floor in [`Segment::host_at_start`] dropped, in units of
    /// `2^-slope().shift()`. Kept so that the anchor's exact position survives.
    #[must_use]
    pub const fn host_frac_at_start(&self) -> u128 {
        self.frac
    }

    /// Host ticks per guest tick.
    #[must_use]
    pub const fn slope(&self) -> Slope {
        self.slope
    }

    /// This segment's line at `guest`, rounded down: `floor(host_at_start + host_frac_at_start /
    /// 2^shift + (guest - start) * slope)`, for any `guest`, before `start` too (that is how a
    /// timeline extrapolates backwards). `None` if the result is below 0 or above `u64::MAX`.
    #[must_use]
    pub fn try_convert_floor(&self, guest: GuestTicks) -> Option<HostTicks> {
        let mul = u128::from(self.slope.mul());
        let shift = self.slope.shift();
        if let Some(d) = guest.0.checked_sub(self.start) {
            // d * mul < 2^127 and frac < 2^127: no overflow.
            let whole = (u128::from(d) * mul + self.frac) >> shift;
            u64::try_from(whole)
                .ok()?
                .checked_add(self.base)
                .map(HostTicks)
        } else {
            let back = u128::from(self.start - guest.0) * mul;
            let Some(below) = back.checked_sub(self.frac) else {
                // base <= exact < base + 1.
                return Some(HostTicks(self.base));
            };
            // exact = base - below/2^s, whose floor is base - ceil(below/2^s).
            let ceil = (below >> shift) + u128::from(below & low_mask(shift) != 0);
            self.base
                .checked_sub(u64::try_from(ceil).ok()?)
                .map(HostTicks)
        }
    }
}

/// `2^shift - 1` for `shift <= 127`.
const fn low_mask(shift: u32) -> u128 {
    (1u128 << shift) - 1
}

/// The largest `d: u64` with `base + ((d * mul + frac) >> shift) <= u64::MAX`.
///
/// With `room = 2^64 - base`, the condition is `d * mul + frac < room * 2^shift`. When
/// `room * 2^shift >= 2^128` it holds for every `d` (the left side is below `2^128`).
fn fast_span(base: u64, frac: u128, slope: Slope) -> u64 {
    let room = u128::from(u64::MAX - base) + 1;
    let shift = slope.shift();
    if room.leading_zeros() < shift {
        return u64::MAX;
    }
    // room << shift > frac (room >= 1, frac < 2^shift), so this is at least 0.
    let limit = (room << shift) - frac - 1;
    u64::try_from(limit / u128::from(slope.mul())).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Naive reference: `floor(host_anchor + (guest - guest_anchor) * mul / 2^shift)` in i128,
    /// `None` outside the host range. `(guest - guest_anchor) * mul` fits: |Δ| < 2^65, mul <
    /// 2^63 is too wide in general, so callers keep |Δ| < 2^64; the arithmetic shift of an i128
    /// is a floor.
    fn reference(guest: u64, guest_anchor: i128, host_anchor: i128, slope: Slope) -> Option<u64> {
        let delta = i128::from(guest) - guest_anchor;
        let scaled = delta.checked_mul(i128::from(slope.mul()))? >> slope.shift();
        u64::try_from(host_anchor.checked_add(scaled)?).ok()
    }

    fn slope_strategy() -> impl Strategy<Value = Slope> {
        prop_oneof![
            Just(Slope::ONE),
            (-2_000_000i64..2_000_000).prop_map(|ppb| Slope::try_from_ppb_floor(ppb).unwrap()),
            (1u64.., 1u64.., 0u32..64).prop_map(|(n, d, cut)| {
                Slope::try_from_ratio_floor((n >> cut).max(1), d).unwrap_or(Slope::ONE)
            }),
            ((1u64 << 62)..(1 << 63), 0u32..=127)
                .prop_map(|(m, s)| Slope::try_from_raw(m, s).unwrap()),
        ]
    }

    #[test]
    fn identity_and_offset_are_exact() {
        let id = Segment::identity(GuestTicks(100));
        for g in [0, 1, 99, 100, 101, 1 << 40, u64::MAX] {
            assert_eq!(id.try_convert_floor(GuestTicks(g)), Some(HostTicks(g)));
        }
        let off = Segment::try_offset(GuestTicks(1_000), -400).unwrap();
        assert_eq!(off.host_at_start(), HostTicks(600));
        assert_eq!(
            off.try_convert_floor(GuestTicks(1_000)),
            Some(HostTicks(600))
        );
        assert_eq!(off.try_convert_floor(GuestTicks(400)), Some(HostTicks(0)));
        assert_eq!(off.try_convert_floor(GuestTicks(399)), None);
        assert_eq!(
            off.try_convert_floor(GuestTicks(u64::MAX)),
            Some(HostTicks(u64::MAX - 400))
        );
        let up = Segment::try_offset(GuestTicks(5), 7).unwrap();
        assert_eq!(
            up.try_convert_floor(GuestTicks(u64::MAX - 7)),
            Some(HostTicks(u64::MAX))
        );
        assert_eq!(up.try_convert_floor(GuestTicks(u64::MAX - 6)), None);
        assert_eq!(Segment::try_offset(GuestTicks(5), -6), None);
        assert_eq!(Segment::try_offset(GuestTicks(u64::MAX), 1), None);
        // An anchored unit slope is the same offset, exactly.
        let anchored = Segment::try_from_anchor(
            GuestTicks(1_000),
            GuestTicks(5_000),
            HostTicks(4_600),
            Slope::ONE,
        )
        .unwrap();
        assert_eq!(anchored, off);
    }

    #[test]
    fn anchor_fraction_survives_start() {
        // Slope 3/2 anchored at guest 1 → host 0: guest 0 maps to -1.5, floor -2 → None; guest
        // 2 → 1.5 → 1; guest 3 → 3. Starting the segment at 2 keeps the half in `frac`.
        let s = Segment::try_from_anchor_ratio(GuestTicks(2), GuestTicks(1), HostTicks(0), 3, 2)
            .unwrap();
        assert_eq!(s.host_at_start(), HostTicks(1));
        assert_eq!(s.host_frac_at_start(), 1u128 << (s.slope().shift() - 1));
        assert_eq!(s.try_convert_floor(GuestTicks(3)), Some(HostTicks(3)));
        assert_eq!(s.try_convert_floor(GuestTicks(4)), Some(HostTicks(4)));
        assert_eq!(s.try_convert_floor(GuestTicks(1)), Some(HostTicks(0)));
        assert_eq!(s.try_convert_floor(GuestTicks(0)), None);
        // Start before the anchor: guest 0 → -1.5 is not a host tick.
        assert_eq!(
            Segment::try_from_anchor_ratio(GuestTicks(0), GuestTicks(1), HostTicks(0), 3, 2),
            None
        );
        let back = Segment::try_from_anchor_ratio(GuestTicks(0), GuestTicks(1), HostTicks(2), 3, 2)
            .unwrap();
        assert_eq!(back.host_at_start(), HostTicks(0)); // 0.5
        assert_eq!(back.try_convert_floor(GuestTicks(1)), Some(HostTicks(2)));
        assert_eq!(back.try_convert_floor(GuestTicks(2)), Some(HostTicks(3))); // 3.5
        let parts = Segment::try_from_parts(
            back.start(),
            back.host_at_start(),
            back.host_frac_at_start(),
            back.slope(),
        );
        assert_eq!(parts, Some(back));
        assert_eq!(
            Segment::try_from_parts(GuestTicks(0), HostTicks(0), 1 << 62, Slope::ONE),
            None
        );
    }

    #[test]
    fn kvm_identity_and_power_of_two_are_exact() {
        let s = Segment::try_from_kvm(GuestTicks(0), -1_000, 1 << 48, 48).unwrap();
        assert_eq!(s.try_convert_floor(GuestTicks(0)), Some(HostTicks(1_000)));
        assert_eq!(
            s.try_convert_floor(GuestTicks(123_456)),
            Some(HostTicks(124_456))
        );
        // Guest runs at twice the host rate: host = (guest - offset) / 2, floored.
        let s = Segment::try_from_kvm(GuestTicks(10), 10, 1 << 33, 32).unwrap();
        assert_eq!(s.try_convert_floor(GuestTicks(10)), Some(HostTicks(0)));
        assert_eq!(s.try_convert_floor(GuestTicks(13)), Some(HostTicks(1)));
        assert_eq!(s.try_convert_floor(GuestTicks(14)), Some(HostTicks(2)));
        // Guest ticks before tsc_offset precede host tick 0.
        assert_eq!(Segment::try_from_kvm(GuestTicks(9), 10, 1 << 33, 32), None);
        assert_eq!(Segment::try_from_kvm(GuestTicks(9), 0, 0, 32), None);
        assert_eq!(Segment::try_from_kvm(GuestTicks(9), 0, 1, 63), None);
    }

    #[test]
    fn fast_span_is_the_overflow_edge() {
        let s = Segment::try_from_anchor_ppb(GuestTicks(0), GuestTicks(0), HostTicks(1 << 40), 500)
            .unwrap();
        let last = s.fast_span;
        assert!(s.try_convert_floor(GuestTicks(last)).is_some());
        assert_eq!(s.try_convert_floor(GuestTicks(last + 1)), None);
    }

    proptest! {
        /// Every constructor path agrees with the naive i128 floor of the anchored line, before
        /// and after `start`, and the fast span is exactly the last non-overflowing distance.
        #[test]
        fn anchored_matches_reference(
            start in any::<u64>(),
            anchor_off in -(1i64 << 40)..(1i64 << 40),
            host_anchor in any::<u64>(),
            slope in slope_strategy(),
            guest_far in any::<u64>(),
            offsets in prop::collection::vec(-(1i64 << 45)..(1i64 << 45), 8),
        ) {
            let guest_anchor = start.saturating_add_signed(anchor_off);
            let seg = Segment::try_from_anchor(
                GuestTicks(start), GuestTicks(guest_anchor), HostTicks(host_anchor), slope,
            );
            let ga = i128::from(guest_anchor);
            let ha = i128::from(host_anchor);
            let Some(seg) = seg else {
                prop_assert_eq!(reference(start, ga, ha, slope), None);
                return Ok(());
            };
            prop_assert_eq!(Some(seg.base), reference(start, ga, ha, slope));
            let mut guests: std::vec::Vec<u64> =
                offsets.iter().map(|&o| start.saturating_add_signed(o)).collect();
            guests.extend([start, guest_far, guest_anchor, start.saturating_add(seg.fast_span)]);
            for g in guests {
                if g.abs_diff(guest_anchor) < 1 << 63 {
                    prop_assert_eq!(
                        seg.try_convert_floor(GuestTicks(g)).map(|h| h.0),
                        reference(g, ga, ha, slope),
                        "guest {}", g
                    );
                }
            }
            if let Some(edge) = start.checked_add(seg.fast_span) {
                prop_assert!(seg.try_convert_floor(GuestTicks(edge)).is_some());
                if let Some(beyond) = edge.checked_add(1) {
                    prop_assert_eq!(seg.try_convert_floor(GuestTicks(beyond)), None);
                }
            }
        }

        /// KVM inverse: never above the exact `floor((g - off) * 2^frac / ratio)`, and at most
        /// `1 + (exact >> 62)` below it (at most one tick below 2^62).
        #[test]
        fn kvm_inverse_error_bound(
            tsc_offset in any::<i64>(),
            ratio_ppm in -300_000i64..300_000,
            ratio_raw in 1u64..,
            use_raw in any::<bool>(),
            frac_bits in prop_oneof![Just(32u32), Just(48u32), 1u32..63],
            guests in prop::collection::vec(any::<u64>(), 16),
            near_offset in prop::collection::vec(0u64..1 << 50, 16),
        ) {
            let ratio = if use_raw {
                ratio_raw
            } else {
                // A realistic ratio: within ±30 % of identity.
                let scaled = (1i128 << frac_bits) * (1_000_000 + i128::from(ratio_ppm)) / 1_000_000;
                u64::try_from(scaled.max(1)).unwrap_or(u64::MAX)
            };
            let lowest = u64::try_from(tsc_offset.max(0)).unwrap();
            let Some(seg) = Segment::try_from_kvm(GuestTicks(lowest), tsc_offset, ratio, frac_bits)
            else {
                // Refused only when the start itself maps beyond u64::MAX.
                let dist = u128::try_from(i128::from(lowest) - i128::from(tsc_offset)).unwrap();
                prop_assert!((dist << frac_bits) / u128::from(ratio) > u128::from(u64::MAX));
                return Ok(());
            };
            let mut all = guests;
            all.extend(near_offset.iter().map(|&n| lowest.saturating_add(n)));
            for g in all {
                let Some(dist) = u128::try_from(i128::from(g) - i128::from(tsc_offset)).ok() else {
                    continue;
                };
                // dist < 2^65, frac_bits < 63: dist << frac fits u128.
                let exact = (dist << frac_bits) / u128::from(ratio);
                let got = seg.try_convert_floor(GuestTicks(g));
                match u64::try_from(exact) {
                    Ok(exact) => {
                        // 0 <= result <= exact <= u64::MAX: it must be representable.
                        let got = got.map(|h| h.0);
                        prop_assert!(got.is_some(), "g {} exact {} got None", g, exact);
                        let got = got.unwrap_or(0);
                        prop_assert!(got <= exact, "g {} got {} > exact {}", g, got, exact);
                        prop_assert!(exact - got <= 1 + (exact >> 62),
                            "g {} got {} exact {}", g, got, exact);
                    }
                    // Out of range exactly; the floor below may still fit by the same bound.
                    Err(_) => prop_assert!(got.is_none_or(|h| h.0 >= u64::MAX - 1 - (u64::MAX >> 62))),
                }
            }
        }
    }
}
