//! The exact KVM inverse on the batch path: a reciprocal estimate, then at most two steps up.
//!
//! A KVM segment must return what [`KvmTscMapping::try_host_from_guest_ceil`] returns: with
//! `s = guest - tsc_offset` and `F(h) = floor(h * ratio / 2^frac_bits)`, the smallest `h` with
//! `F(h) >= s`, which is `c = ceil(x)` for the real `x = s * 2^frac_bits / ratio` (`F(h) >= s`
//! holds exactly when `h * ratio / 2^frac_bits >= s`, because `s` is an integer). That is a
//! 128-by-64-bit division per tick; the kernel avoids it.
//!
//! The segment's line goes through `(tsc_offset, 0)` with slope `S'`, the reciprocal
//! `2^frac_bits / ratio` rounded down to a normalized fixed-point number
//! ([`super::Slope::try_from_kvm_ratio_floor`]), so the linear kernel yields exactly
//! `h0 = floor(s * S')`. Why two steps up from `h0` reach `c`:
//!
//! - `S' <= 2^frac_bits / ratio`, so `h0 <= floor(x) <= c`: the estimate is never above.
//! - Normalization gives `x - s * S' < s * S' * 2^-62 <= x * 2^-62`.
//! - While `h0 <= 2^62 - 2` ([`ESTIMATE_MAX`]), `s * S' < 2^62 - 1`, so
//!   `x * (1 - 2^-62) < 2^62 - 1`, i.e. `x < 2^62`; then `x - s * S' < 1` and
//!   `c < x + 1 < s * S' + 2 < h0 + 3`, so `c <= h0 + 2`.
//! - `F(h) < s` holds exactly for `h < c` (`F` is monotone), so `c = h0 + [F(h0) < s] +
//!   [F(h0 + 1) < s]` for any `h0` in `c - 2..=c`, and `c <= 2^62` cannot overflow. The kernel
//!   tests `F(h) < s` as `h * ratio < s * 2^frac_bits`, which is the same for integer `s`.
//!
//! The fast range of a KVM segment is therefore capped where the estimate passes
//! [`ESTIMATE_MAX`] (48 years of a 3 GHz TSC) and where `s` would leave `u64` (beyond it the
//! mapping wraps `s` modulo `2^64`); past either, and for every single conversion, the segment
//! calls the mapping itself. An identity ratio has `S' = 1` exactly, so `h0 = s = c` and the
//! correction is skipped.

use super::fast;
use super::segment::{KvmParts, Segment, fast_span_up_to};
use super::slope::Slope;
use crate::mapping::KvmTscMapping;
use crate::units::GuestTicks;

/// The largest estimate for which two correction steps are proved enough (see the module docs).
const ESTIMATE_MAX: u64 = (1 << 62) - 2;

/// KVM segments: built here, next to the proof that their batch kernel is exact.
impl Segment {
    /// The exact inverse of a KVM vCPU relation `guest = tsc_offset + ((host * ratio) >>
    /// frac_bits)` (see [`crate::mapping`]), used from `start` on: [`Segment::try_from_kvm_mapping`] with
    /// the three values KVM prints in debugfs (`tsc-offset` is signed).
    ///
    /// `None` if they do not form a [`KvmTscMapping`] (`ratio` 0, `frac_bits > 63`) or for the
    /// reasons given on [`Segment::try_from_kvm_mapping`].
    #[must_use]
    pub fn try_from_kvm(
        start: GuestTicks,
        tsc_offset: i64,
        ratio: u64,
        frac_bits: u32,
    ) -> Option<Self> {
        let map = KvmTscMapping::try_new(tsc_offset, ratio, frac_bits).ok()?;
        Self::try_from_kvm_mapping(start, map)
    }

    /// A segment that converts every guest tick with `map`'s exact inverse,
    /// [`KvmTscMapping::try_host_from_guest_ceil`]: the first host tick whose guest image is at
    /// or after the guest tick, so a guest TSC read taken during host tick `h` converts back to
    /// exactly `h` whenever the guest clock runs at least as fast as the host's (and to the
    /// first of the host ticks sharing its value otherwise). No rounding error at all.
    ///
    /// The hot path does not divide: the batch kernel multiplies by a reciprocal rounded down
    /// ([`Slope::try_from_kvm_ratio_floor`]), which can only land at or below the answer, and
    /// then steps up while the forward map of its guess is still below the guest tick (at most
    /// two steps, proved in the `exact_inverse` module). Single conversions use the mapping directly.
    ///
    /// `None` if `start` precedes host tick 0 (`start < tsc_offset`), if `start` maps beyond
    /// `u64::MAX`, or if the reciprocal slope exceeds `2^62` (a guest clock `2^62` times
    /// slower than the host's). Guest ticks before `start` convert exactly as the mapping says,
    /// wrapping included: one numerically below `tsc_offset` lies `2^64` ticks later.
    #[must_use]
    pub fn try_from_kvm_mapping(start: GuestTicks, map: KvmTscMapping) -> Option<Self> {
        let slope = Slope::try_from_kvm_ratio_floor(map.ratio(), map.frac_bits())?;
        let line = Self::try_new(start.0, i128::from(map.offset()), 0, slope)?;
        // try_new succeeded, so start >= offset (else the host value at start is negative) and
        // start - offset < 2^64.
        let scaled_at_start = u64::try_from(i128::from(start.0) - i128::from(map.offset())).ok()?;
        Some(Self {
            fast_span: exact_span(&line, scaled_at_start),
            kvm: KvmParts::of(map),
            ..line
        })
    }
}

/// The KVM fast span of `line` (a KVM segment's linear part) whose `s` at its start is
/// `scaled_at_start`: the largest `d` with an estimate at most [`ESTIMATE_MAX`] and
/// `scaled_at_start + d <= u64::MAX`. 0 when even the start's estimate is too large;
/// [`convert_run`] then converts nothing.
fn exact_span(line: &Segment, scaled_at_start: u64) -> u64 {
    fast_span_up_to(ESTIMATE_MAX, line.base, line.frac, line.slope)
        .map_or(0, |span| span.min(u64::MAX - scaled_at_start))
}

/// [`fast::convert_run`] for a KVM segment: the estimate, corrected to the mapping's exact
/// inverse. `span` must not exceed the segment's own fast span.
pub(super) fn convert_run(
    segment: &Segment,
    map: KvmTscMapping,
    span: u64,
    ticks: &mut [u64],
) -> usize {
    if segment.base > ESTIMATE_MAX {
        return 0;
    }
    if map.is_identity_ratio() {
        return fast::convert_run_with(segment, span, ticks, |_, host| host);
    }
    let ratio = u128::from(map.ratio());
    let frac_bits = map.frac_bits();
    // s = tick - offset: exact in u64 inside the fast range (see `exact_span`).
    let scaled_at_start = segment.start.wrapping_sub(map.offset().cast_unsigned());
    fast::convert_run_with(segment, span, ticks, move |d, host| {
        // F(h) < s exactly when h * ratio < s * 2^frac_bits (s is an integer), so both steps
        // compare against one threshold: h0 * ratio and (h0 + 1) * ratio, one multiply.
        // s < 2^64 and frac_bits <= 63: the threshold fits; h0 < 2^62: so does h0 * ratio + ratio.
        let threshold = u128::from(scaled_at_start.wrapping_add(d)) << frac_bits;
        let at_estimate = u128::from(host) * ratio;
        let steps = u64::from(at_estimate < threshold) + u64::from(at_estimate + ratio < threshold);
        // host <= ESTIMATE_MAX, so host + 2 cannot overflow.
        host.wrapping_add(steps)
    })
}

#[cfg(test)]
mod tests {
    use super::super::{Timeline, segment::Segment};
    use crate::mapping::{FRAC_BITS_SVM, FRAC_BITS_VMX, KvmTscMapping};
    use crate::units::{GuestTicks, HostTicks};
    use proptest::prelude::*;
    use std::vec::Vec;

    /// Converts `ticks` with a one-segment timeline's batch path, `None` per failed element.
    fn batch(seg: Segment, ticks: &[u64]) -> Vec<Option<u64>> {
        let segs = [seg];
        let timeline = Timeline::new(&segs).unwrap();
        let mut out = ticks.to_vec();
        let mut failed = Vec::new();
        let mut from = 0;
        while let Some(rest) = out.get_mut(from..) {
            match timeline.cursor().try_convert_slice_floor(rest) {
                Ok(()) => break,
                Err(e) => {
                    failed.push(from + e.index);
                    from += e.index + 1;
                }
            }
        }
        out.iter()
            .enumerate()
            .map(|(i, &h)| (!failed.contains(&i)).then_some(h))
            .collect()
    }

    #[test]
    fn reviewer_case_lands_on_the_host_tick_it_was_read_at() {
        // Ratio 1.5 on SVM and 1.1 on VMX, guest booted 10^6 host ticks after the host: the
        // guest value read at host tick 2_000_000 converts back to exactly that tick (the
        // floored reciprocal alone gave 1_999_999).
        let tenth = (1u64 << 48) / 10;
        for (ratio, frac) in [(3u64 << 31, 32u32), ((1u64 << 48) + tenth, 48)] {
            let map = KvmTscMapping::try_new(-1_000_000, ratio, frac).unwrap();
            let seg = Segment::try_from_kvm(GuestTicks(0), -1_000_000, ratio, frac).unwrap();
            let h = HostTicks(2_000_000);
            let g = map.try_guest_from_host(h).unwrap();
            assert_eq!(map.try_host_from_guest_ceil(g), Some(h));
            assert_eq!(seg.try_convert_floor(g), Some(h), "ratio {ratio:#x}");
            assert_eq!(batch(seg, &[g.0]), [Some(h.0)], "ratio {ratio:#x}");
        }
    }

    #[test]
    fn every_host_tick_of_a_run_survives_the_round_trip() {
        // Four realistic ratios at and above the identity: each host tick's guest image must
        // come back as that host tick on the batch path, for a dense run of 10_000 ticks.
        let d48 = 1u64 << FRAC_BITS_VMX;
        let d32 = 1u64 << FRAC_BITS_SVM;
        for (ratio, frac) in [
            (3 << 31, FRAC_BITS_SVM),
            (d48 + d48 / 10, FRAC_BITS_VMX),
            (d48 + 1, FRAC_BITS_VMX),
            (d32, FRAC_BITS_SVM),
        ] {
            let map = KvmTscMapping::try_new(-123_456_789, ratio, frac).unwrap();
            let seg = Segment::try_from_kvm_mapping(GuestTicks(0), map).unwrap();
            let hosts: Vec<u64> = (5_000_000_000..5_000_010_000).collect();
            let guests: Vec<u64> = hosts
                .iter()
                .map(|&h| map.try_guest_from_host(HostTicks(h)).unwrap().0)
                .collect();
            let got = batch(seg, &guests);
            for (&h, got) in hosts.iter().zip(got) {
                assert_eq!(got, Some(h), "ratio {ratio:#x} frac {frac}");
            }
        }
    }

    #[test]
    fn wrapping_and_range_follow_the_mapping() {
        // A guest tick below the offset lies 2^64 ticks later, as KVM's wrapping addition says.
        let map = KvmTscMapping::try_new(1_000, 1 << 48, 48).unwrap();
        let seg = Segment::try_from_kvm_mapping(GuestTicks(1_000), map).unwrap();
        assert_eq!(seg.kvm(), Some(map));
        for g in [0, 999, 1_000, 1_001, u64::MAX] {
            let want = map.try_host_from_guest_ceil(GuestTicks(g));
            assert_eq!(seg.try_convert_floor(GuestTicks(g)), want, "guest {g}");
            assert_eq!(batch(seg, &[g]), [want.map(|h| h.0)], "guest {g}");
        }
        // A guest 8x faster with a large negative offset: from guest 3 * 2^62 on, `s` passes
        // 2^64 and the mapping wraps it, while the estimate's line does not; the fast range
        // must end there.
        let fast = KvmTscMapping::try_new(-(1 << 62), 8 << 32, 32).unwrap();
        let seg = Segment::try_from_kvm_mapping(GuestTicks(0), fast).unwrap();
        let ticks = [0, 1 << 62, (3 << 62) - 1, 3 << 62, u64::MAX];
        let want: Vec<Option<u64>> = ticks
            .iter()
            .map(|&g| fast.try_host_from_guest_ceil(GuestTicks(g)).map(|h| h.0))
            .collect();
        assert_eq!(want[4], Some(1 << 59));
        assert_eq!(batch(seg, &ticks), want);
        // A slower guest: the top guest ticks have no host tick.
        let slow = KvmTscMapping::try_new(0, (1 << 32) / 2, 32).unwrap();
        let seg = Segment::try_from_kvm_mapping(GuestTicks(0), slow).unwrap();
        assert_eq!(batch(seg, &[1 << 62, u64::MAX]), [Some(1 << 63), None]);
        // Starts before the offset or beyond the host range are refused.
        assert_eq!(Segment::try_from_kvm(GuestTicks(9), 10, 1 << 33, 32), None);
        assert_eq!(Segment::try_from_kvm(GuestTicks(u64::MAX), 0, 1, 32), None);
        assert_eq!(Segment::try_from_kvm(GuestTicks(9), 0, 0, 32), None);
        assert_eq!(Segment::try_from_kvm(GuestTicks(9), 0, 1, 64), None);
    }

    /// VMX or SVM fraction bits with a ratio within ±10 % of the identity (the identity itself
    /// and its neighbours often).
    fn mapping() -> impl Strategy<Value = KvmTscMapping> {
        (
            prop_oneof![Just(FRAC_BITS_SVM), Just(FRAC_BITS_VMX)],
            prop_oneof![
                1 => Just(0i64),
                1 => -1i64..=1,
                8 => -100_000i64..=100_000,
            ],
            any::<u64>(),
            prop_oneof![
                4 => -(1i64 << 50)..0,
                2 => 0i64..1 << 50,
                1 => any::<i64>(),
            ],
        )
            .prop_map(|(frac, ppm, wiggle, offset)| {
                let d = 1u64 << frac;
                // ppm in -10 %..=10 % of identity, plus a sub-ppm random part.
                let step = d / 1_000_000;
                let base = d
                    .checked_add_signed(ppm * i64::try_from(step).unwrap())
                    .unwrap();
                let ratio = if ppm == 0 { d } else { base + wiggle % step };
                KvmTscMapping::try_new(offset, ratio, frac).unwrap()
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1_000))]

        /// A KVM segment is the mapping's exact inverse, on the batch path and the single path:
        /// on the images of host ticks (where it gives back the host tick whenever the guest
        /// clock is not slower), one tick either side of them, and on arbitrary guest ticks.
        #[test]
        fn kvm_segment_equals_exact_ceil_inverse(
            map in mapping(),
            start_after in prop_oneof![Just(0u64), 0u64..1 << 40],
            hosts in prop::collection::vec(prop_oneof![0u64..1 << 20, 0u64..1 << 62, any::<u64>()], 1..64),
            guests in prop::collection::vec(any::<u64>(), 0..16),
        ) {
            let lowest = u64::try_from(map.offset().max(0)).unwrap();
            let start = lowest.saturating_add(start_after);
            let seg = Segment::try_from_kvm_mapping(GuestTicks(start), map);
            let Some(seg) = seg else {
                // Refused only when the start itself maps beyond the host range.
                prop_assert!(map.try_host_from_guest_ceil(GuestTicks(start)).is_none());
                return Ok(());
            };
            let mut ticks: Vec<u64> = Vec::new();
            for &h in &hosts {
                if let Some(g) = map.try_guest_from_host(HostTicks(h)) {
                    ticks.extend([g.0, g.0.wrapping_sub(1), g.0.wrapping_add(1)]);
                    let back = map.try_host_from_guest_ceil(g);
                    if map.ratio() >= map.default_ratio() {
                        prop_assert_eq!(back, Some(HostTicks(h)));
                    }
                }
            }
            ticks.extend(&guests);
            // Sorted, so the batch path stays in the segment's fast range as long as it can.
            ticks.sort_unstable();
            let got = batch(seg, &ticks);
            for (&g, got) in ticks.iter().zip(got) {
                let want = map.try_host_from_guest_ceil(GuestTicks(g));
                prop_assert_eq!(seg.try_convert_floor(GuestTicks(g)), want, "guest {}", g);
                prop_assert_eq!(got, want.map(|h| h.0), "batch, guest {}", g);
            }
        }
    }
}
