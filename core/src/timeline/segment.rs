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
//! comes only from the slope's own rounding, documented on [`Slope::try_from_ratio_floor`].
//!
//! A KVM segment ([`Segment::try_from_kvm`]) is the exception: it also keeps the
//! [`KvmTscMapping`] and converts with that mapping's exact inverse,
//! [`KvmTscMapping::try_host_from_guest_ceil`]. Its line (through `(tsc_offset, 0)` with the
//! reciprocal slope rounded down) is only the estimate the batch kernel starts from and then
//! corrects (see the `exact_inverse` module).

use super::slope::Slope;
use crate::mapping::KvmTscMapping;
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
    /// fast path relies on it to skip the overflow checks. For a KVM segment it is the largest
    /// `d` for which the batch kernel's corrected estimate is exact (see the `exact_inverse` module).
    pub(super) fast_span: u64,
    /// The exact relation of a KVM segment, whose inverse this segment computes; `ratio` 0
    /// for a linear segment. Stored as raw fields rather than an `Option<KvmTscMapping>`
    /// because that would add a tag and grow every segment from 80 to 96 bytes, which the
    /// per-event binary search over the segments pays for in cache misses.
    pub(super) kvm: KvmParts,
}

/// A [`KvmTscMapping`]'s fields, or `ratio == 0` for none (a mapping's ratio is never 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub(super) struct KvmParts {
    offset: i64,
    ratio: u64,
    frac_bits: u32,
}

impl KvmParts {
    /// A linear segment's marker.
    const NONE: Self = Self {
        offset: 0,
        ratio: 0,
        frac_bits: 0,
    };

    pub(super) const fn of(map: KvmTscMapping) -> Self {
        Self {
            offset: map.offset(),
            ratio: map.ratio(),
            frac_bits: map.frac_bits(),
        }
    }

    /// The mapping back; only `NONE` (ratio 0) has none, since the fields came from a valid
    /// mapping.
    const fn get(self) -> Option<KvmTscMapping> {
        match KvmTscMapping::try_new(self.offset, self.ratio, self.frac_bits) {
            Ok(map) => Some(map),
            Err(_) => None,
        }
    }
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
            kvm: KvmParts::NONE,
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
            kvm: KvmParts::NONE,
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

    /// A linear segment from the parts returned by [`Segment::start`],
    /// [`Segment::host_at_start`], [`Segment::host_frac_at_start`] and [`Segment::slope`]: the
    /// lossless way to store or send a linear segment (store a KVM segment as its start and
    /// [`Segment::kvm`] instead). `None` unless `frac < 2^slope.shift()`.
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
            kvm: KvmParts::NONE,
        })
    }

    /// Shared constructor: anchors are `i128` so that a KVM offset (a signed guest tick) fits.
    pub(super) fn try_new(
        start: u64,
        guest_anchor: i128,
        host_anchor: i128,
        slope: Slope,
    ) -> Option<Self> {
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
            kvm: KvmParts::NONE,
        })
    }

    /// First guest tick of this segment (inclusive).
    #[must_use]
    pub const fn start(&self) -> GuestTicks {
        GuestTicks(self.start)
    }

    /// The host tick of [`Segment::start`] on this segment's line, rounded down (for a KVM
    /// segment: on the reciprocal estimate's line, which may be up to two ticks below
    /// [`Segment::try_convert_floor`] of the start).
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

    /// Host ticks per guest tick (for a KVM segment: the reciprocal of its ratio, rounded down).
    #[must_use]
    pub const fn slope(&self) -> Slope {
        self.slope
    }

    /// The KVM relation a segment built by [`Segment::try_from_kvm`] inverts; `None` for a
    /// linear segment.
    #[must_use]
    pub const fn kvm(&self) -> Option<KvmTscMapping> {
        self.kvm.get()
    }

    /// The host tick of `guest`, for any `guest`, before `start` too (that is how a timeline
    /// extrapolates backwards).
    ///
    /// A linear segment returns its line rounded down: `floor(host_at_start +
    /// host_frac_at_start / 2^shift + (guest - start) * slope)`, `None` if that is below 0 or
    /// above `u64::MAX`. A KVM segment returns exactly
    /// [`KvmTscMapping::try_host_from_guest_ceil`]: the earliest host tick the guest could have
    /// read `guest` at, i.e. the floor of the instant in host time.
    #[must_use]
    pub fn try_convert_floor(&self, guest: GuestTicks) -> Option<HostTicks> {
        if self.kvm.ratio != 0 {
            return self.try_convert_kvm(guest);
        }
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

    /// A KVM segment's single conversion: the mapping's exact inverse. Kept out of line so
    /// that the linear path of [`Segment::try_convert_floor`] stays small enough to inline into
    /// the per-event loops.
    #[inline(never)]
    fn try_convert_kvm(&self, guest: GuestTicks) -> Option<HostTicks> {
        self.kvm.get()?.try_host_from_guest_ceil(guest)
    }
}

/// `2^shift - 1` for `shift <= 127`.
const fn low_mask(shift: u32) -> u128 {
    (1u128 << shift) - 1
}

/// The largest `d: u64` with `base + ((d * mul + frac) >> shift) <= u64::MAX`.
fn fast_span(base: u64, frac: u128, slope: Slope) -> u64 {
    fast_span_up_to(u64::MAX, base, frac, slope).unwrap_or(0)
}

/// The largest `d: u64` with `base + ((d * mul + frac) >> shift) <= top`; `None` if even
/// `d = 0` exceeds it (`base > top`).
///
/// With `room = top + 1 - base`, the condition is `d * mul + frac < room * 2^shift`. When
/// `room * 2^shift >= 2^128` it holds for every `d` (the left side is below `2^128`).
pub(super) fn fast_span_up_to(top: u64, base: u64, frac: u128, slope: Slope) -> Option<u64> {
    let room = u128::from(top.checked_sub(base)?) + 1;
    let shift = slope.shift();
    if room.leading_zeros() < shift {
        return Some(u64::MAX);
    }
    // room << shift > frac (room >= 1, frac < 2^shift), so this is at least 0.
    let limit = (room << shift) - frac - 1;
    Some(u64::try_from(limit / u128::from(slope.mul())).unwrap_or(u64::MAX))
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
        // Guest runs at twice the host rate: guest = offset + 2 * host, so a guest tick converts
        // to the first host tick whose image reaches it, ceil((guest - offset) / 2).
        let s = Segment::try_from_kvm(GuestTicks(10), 10, 1 << 33, 32).unwrap();
        assert_eq!(s.try_convert_floor(GuestTicks(10)), Some(HostTicks(0)));
        assert_eq!(s.try_convert_floor(GuestTicks(12)), Some(HostTicks(1)));
        assert_eq!(s.try_convert_floor(GuestTicks(13)), Some(HostTicks(2)));
        assert_eq!(s.try_convert_floor(GuestTicks(14)), Some(HostTicks(2)));
        // Guest ticks before tsc_offset precede host tick 0.
        assert_eq!(Segment::try_from_kvm(GuestTicks(9), 10, 1 << 33, 32), None);
        assert_eq!(Segment::try_from_kvm(GuestTicks(9), 0, 0, 32), None);
        // A reciprocal slope of 2^63 cannot be stored.
        assert_eq!(Segment::try_from_kvm(GuestTicks(9), 0, 1, 63), None);
    }

    #[test]
    fn kvm_fields_do_not_grow_segments_past_80_bytes() {
        // The per-event binary search touches one segment per step: keep them compact.
        assert!(core::mem::size_of::<Segment>() <= 80);
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
    }
}
