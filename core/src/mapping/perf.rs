//! Ticks → nanoseconds in perf's mult/shift form (`perf_event_mmap_page`, trace-cmd TSC2NSEC).

use serde::{Deserialize, Serialize};

use super::MappingError;
use crate::Nanos;

/// `NSEC_PER_MSEC` (include/vdso/time64.h): x86 computes its TSC scale per kHz, i.e. per ms.
const NSEC_PER_MSEC: u32 = 1_000_000;

/// The largest shift a [`PerfTimeConv`] accepts, so that `1 << shift` fits a `u64`.
pub const MAX_PERF_SHIFT: u32 = 63;

/// perf's TSC→ns conversion: `ns = ((tsc * mult) >> shift) + zero`.
///
/// The values are `perf_event_mmap_page.{time_mult, time_shift, time_zero}`
/// (include/uapi/linux/perf_event.h); trace-cmd stores `mult` and `shift` in its TSC2NSEC
/// option (with its `offset` field always 0, and a reader that assumes `shift <= 32`). The
/// product here is 128 bits wide, so unlike perf's documented 64-bit split it never wraps;
/// results that do not fit return `None`. Fields are private so that decoding from the wire
/// checks `mult != 0` and `shift <= 63` like [`Self::try_new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "PerfTimeConvRepr", into = "PerfTimeConvRepr")]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PerfTimeConv {
    mult: u32,
    shift: u32,
    zero: u64,
}

/// The unchecked wire form of [`PerfTimeConv`]; decoding goes through `try_new`.
#[derive(Clone, Copy, Serialize, Deserialize, postcard::experimental::max_size::MaxSize)]
struct PerfTimeConvRepr {
    mult: u32,
    shift: u32,
    zero: u64,
}

impl TryFrom<PerfTimeConvRepr> for PerfTimeConv {
    type Error = MappingError;

    fn try_from(r: PerfTimeConvRepr) -> Result<Self, MappingError> {
        Self::try_new(r.mult, r.shift, r.zero)
    }
}

impl From<PerfTimeConv> for PerfTimeConvRepr {
    fn from(c: PerfTimeConv) -> Self {
        Self {
            mult: c.mult,
            shift: c.shift,
            zero: c.zero,
        }
    }
}

impl postcard::experimental::max_size::MaxSize for PerfTimeConv {
    const POSTCARD_MAX_SIZE: usize = PerfTimeConvRepr::POSTCARD_MAX_SIZE;
}

/// The kernel's `clocks_calc_mult_shift` (kernel/time/clocksource.c), returning `(mult, shift)`.
///
/// Finds the largest `shift <= 32` whose rounded `mult = (to << shift + from / 2) / from`
/// leaves enough headroom that `maxsec` seconds of a `from` Hz counter can be multiplied
/// without overflowing 64 bits. Returns `None` for `from == 0`, and where the kernel's
/// loop would run out of shifts and hand back a truncated multiplier (only for a `maxsec`
/// so large that no shift satisfies it).
#[must_use]
pub fn clocks_calc_mult_shift(from: u32, to: u32, maxsec: u32) -> Option<(u32, u32)> {
    if from == 0 {
        return None;
    }
    let (from, to) = (u64::from(from), u64::from(to));
    // Each bit of `maxsec * from` above bit 31 costs the multiplier one bit of width.
    let range = (u64::from(maxsec) * from) >> 32;
    let sftacc = 32 - (u64::BITS - range.leading_zeros());
    (1..=32u32).rev().find_map(|sft| {
        let mult = ((to << sft) + from / 2) / from;
        // mult >> sftacc == 0 means mult < 2^sftacc <= 2^32, so the conversion cannot fail.
        if (mult >> sftacc) == 0 {
            u32::try_from(mult).ok().map(|m| (m, sft))
        } else {
            None
        }
    })
}

impl PerfTimeConv {
    /// Builds a conversion from perf's `time_mult`, `time_shift` and `time_zero`.
    ///
    /// # Errors
    /// [`MappingError::ZeroMult`] if `mult == 0` (no inverse exists);
    /// [`MappingError::ShiftTooLarge`] if `shift > 63`.
    pub const fn try_new(mult: u32, shift: u32, zero: u64) -> Result<Self, MappingError> {
        if mult == 0 {
            return Err(MappingError::ZeroMult);
        }
        if shift > MAX_PERF_SHIFT {
            return Err(MappingError::ShiftTooLarge);
        }
        Ok(Self { mult, shift, zero })
    }

    /// The mult/shift pair the x86 kernel derives for a TSC of `tsc_khz` kHz.
    ///
    /// Reproduces arch/x86/kernel/tsc.c `__set_cyc2ns_scale`, which is where perf's
    /// `time_mult`/`time_shift` come from: `clocks_calc_mult_shift(khz, NSEC_PER_MSEC, 0)`,
    /// then a shift of 32 becomes 31 with `mult >>= 1` (perf's ABI promises `shift < 32`).
    /// The multiplier is rounded to nearest before that halving, so
    /// `|mult * tsc_khz - 10^6 * 2^shift| <= tsc_khz`: the rate `mult / 2^shift` is within
    /// `2^-shift` ns per tick of the true `10^6 / tsc_khz`. `zero` is `time_zero`;
    /// trace-cmd's TSC2NSEC uses 0. Returns `None` for `tsc_khz == 0`.
    #[must_use]
    pub fn try_from_tsc_khz(tsc_khz: u32, zero: u64) -> Option<Self> {
        let (mut mult, mut shift) = clocks_calc_mult_shift(tsc_khz, NSEC_PER_MSEC, 0)?;
        if shift == 32 {
            shift = 31;
            mult >>= 1;
        }
        Self::try_new(mult, shift, zero).ok()
    }

    /// perf's `time_mult`.
    #[must_use]
    pub const fn mult(self) -> u32 {
        self.mult
    }

    /// perf's `time_shift`.
    #[must_use]
    pub const fn shift(self) -> u32 {
        self.shift
    }

    /// perf's `time_zero`: the nanosecond value of tick 0.
    #[must_use]
    pub const fn zero(self) -> u64 {
        self.zero
    }

    /// The same mult/shift with a different `zero`.
    #[must_use]
    pub const fn with_zero(self, zero: u64) -> Self {
        Self { zero, ..self }
    }

    /// `floor(ticks * mult / 2^shift) + zero` in nanoseconds, or `None` if it exceeds `u64`.
    ///
    /// Accepts any tick newtype (`HostTicks`, `GuestTicks`) or a raw `u64`: perf's clock is
    /// whichever TSC the page was read on.
    #[inline]
    #[must_use]
    pub fn try_nanos_from_ticks<T: Into<u64>>(self, ticks: T) -> Option<Nanos> {
        let scaled = (u128::from(ticks.into()) * u128::from(self.mult)) >> self.shift;
        u64::try_from(scaled)
            .ok()?
            .checked_add(self.zero)
            .map(Nanos)
    }

    /// The earliest tick whose nanosecond value is at or after `ns`.
    ///
    /// The smallest integer `t >= 0` with `zero + floor(t * mult / 2^shift) >= ns`, i.e. 0
    /// when `ns <= zero` and `ceil((ns - zero) * 2^shift / mult)` otherwise; `None` if it
    /// exceeds `u64::MAX`. For every `ns` in the image of [`Self::try_nanos_from_ticks`],
    /// converting back gives `ns` again.
    #[inline]
    #[must_use]
    pub fn try_ticks_from_nanos_ceil<T: From<u64>>(self, ns: Nanos) -> Option<T> {
        let Some(rel) = ns.0.checked_sub(self.zero) else {
            return Some(T::from(0));
        };
        let num = u128::from(rel) << self.shift;
        u64::try_from(num.div_ceil(u128::from(self.mult)))
            .ok()
            .map(T::from)
    }

    /// The latest tick whose nanosecond value is at or before `ns`.
    ///
    /// The largest integer `t >= 0` with `zero + floor(t * mult / 2^shift) <= ns`, i.e.
    /// `floor(((ns - zero + 1) * 2^shift - 1) / mult)`; `None` when `ns < zero` (no tick is
    /// that early) or the result exceeds `u64::MAX`.
    #[inline]
    #[must_use]
    pub fn try_ticks_from_nanos_floor<T: From<u64>>(self, ns: Nanos) -> Option<T> {
        let rel = ns.0.checked_sub(self.zero)?;
        // (rel + 1) <= 2^64 and shift <= 63, so the numerator stays below 2^127.
        let num = ((u128::from(rel) + 1) << self.shift) - 1;
        u64::try_from(num / u128::from(self.mult)).ok().map(T::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GuestTicks, HostTicks};
    use proptest::prelude::*;

    /// `clocks_calc_mult_shift` written as the kernel's loop, step by step.
    fn k_clocks_calc_mult_shift(from: u32, to: u32, maxsec: u32) -> (u32, u32, bool) {
        let mut tmp: u64 = (u64::from(maxsec) * u64::from(from)) >> 32;
        let mut sftacc: u32 = 32;
        while tmp != 0 {
            tmp >>= 1;
            sftacc -= 1;
        }
        let mut sft: u32 = 32;
        let mut broke = false;
        while sft > 0 {
            tmp = u64::from(to) << sft;
            tmp += u64::from(from) / 2;
            tmp /= u64::from(from);
            if (tmp >> sftacc) == 0 {
                broke = true;
                break;
            }
            sft -= 1;
        }
        (
            u32::try_from(tmp & 0xffff_ffff).expect("masked"),
            sft,
            broke,
        )
    }

    /// `floor(t * mult / 2^shift) + zero` over unbounded integers.
    fn ref_nanos(c: PerfTimeConv, t: u128) -> u128 {
        ((t * u128::from(c.mult())) >> c.shift()) + u128::from(c.zero())
    }

    fn conv() -> impl Strategy<Value = PerfTimeConv> {
        (
            prop_oneof![1u32..=u32::MAX, (1u32 << 30)..(1u32 << 31), 1u32..=8],
            prop_oneof![0u32..=63, 20u32..=32],
            prop_oneof![Just(0u64), any::<u64>(), 0u64..(1 << 50)],
        )
            .prop_map(|(m, s, z)| PerfTimeConv::try_new(m, s, z).expect("valid"))
    }

    #[test]
    fn constructor_rejects_bad_parameters() {
        assert_eq!(PerfTimeConv::try_new(0, 10, 0), Err(MappingError::ZeroMult));
        assert_eq!(
            PerfTimeConv::try_new(1, 64, 0),
            Err(MappingError::ShiftTooLarge)
        );
        let c = PerfTimeConv::try_new(3, 63, 9).expect("valid");
        assert_eq!((c.mult(), c.shift(), c.zero()), (3, 63, 9));
        assert_eq!(c.with_zero(1).zero(), 1);
        assert_eq!(PerfTimeConv::try_from_tsc_khz(0, 0), None);
    }

    #[test]
    fn tsc_khz_known_values() {
        // 3 GHz: round(2^32 / 3) = 1431655765 at shift 32, halved to 715827882 at shift 31.
        let c = PerfTimeConv::try_from_tsc_khz(3_000_000, 0).expect("valid");
        assert_eq!((c.mult(), c.shift()), (715_827_882, 31));
        assert_eq!(
            c.try_nanos_from_ticks(3_000_000_000u64),
            Some(Nanos(999_999_999))
        );
        // 1 GHz: exactly 1 ns per tick, 2^31 at shift 31.
        let c = PerfTimeConv::try_from_tsc_khz(1_000_000, 0).expect("valid");
        assert_eq!((c.mult(), c.shift()), (1 << 31, 31));
        assert_eq!(
            c.try_nanos_from_ticks(HostTicks(12_345)),
            Some(Nanos(12_345))
        );
        // 2.5 GHz: round(0.4 * 2^32) = 1717986918, halved to 858993459.
        let c = PerfTimeConv::try_from_tsc_khz(2_500_000, 0).expect("valid");
        assert_eq!((c.mult(), c.shift()), (858_993_459, 31));
        // A 100 MHz counter stays below 32 bits of multiplier at shift 28 (10 * 2^28 < 2^32).
        assert_eq!(
            clocks_calc_mult_shift(100_000, NSEC_PER_MSEC, 0),
            Some((10 << 28, 28))
        );
        assert_eq!(clocks_calc_mult_shift(0, NSEC_PER_MSEC, 0), None);
    }

    #[test]
    fn conversions_known_values() {
        let c = PerfTimeConv::try_new(3, 1, 100).expect("valid"); // 1.5 ns per tick
        assert_eq!(c.try_nanos_from_ticks(GuestTicks(3)), Some(Nanos(104)));
        assert_eq!(c.try_ticks_from_nanos_ceil::<u64>(Nanos(105)), Some(4));
        assert_eq!(c.try_ticks_from_nanos_floor::<u64>(Nanos(105)), Some(3));
        assert_eq!(c.try_ticks_from_nanos_ceil::<u64>(Nanos(50)), Some(0));
        assert_eq!(c.try_ticks_from_nanos_floor::<u64>(Nanos(99)), None);
        assert_eq!(c.try_nanos_from_ticks(u64::MAX), None);
        let c = PerfTimeConv::try_new(1, 1, 0).expect("valid"); // 0.5 ns per tick
        assert_eq!(c.try_ticks_from_nanos_floor::<u64>(Nanos(u64::MAX)), None);
    }

    #[test]
    fn postcard_round_trip_and_checked_decode() {
        use postcard::experimental::max_size::MaxSize;
        let mut buf = [0u8; PerfTimeConv::POSTCARD_MAX_SIZE];
        let c = PerfTimeConv::try_new(u32::MAX, 63, u64::MAX).expect("valid");
        let used = postcard::to_slice(&c, &mut buf)
            .expect("fits max size")
            .len();
        assert_eq!(postcard::from_bytes::<PerfTimeConv>(&buf[..used]), Ok(c));
        for (mult, shift) in [(0, 10), (1, 64)] {
            let bad = PerfTimeConvRepr {
                mult,
                shift,
                zero: 0,
            };
            let used = postcard::to_slice(&bad, &mut buf).expect("fits").len();
            assert!(postcard::from_bytes::<PerfTimeConv>(&buf[..used]).is_err());
        }
    }

    proptest! {
        #[test]
        fn calc_mult_shift_matches_kernel_loop(from in 1u32..=u32::MAX, to in any::<u32>(), maxsec in prop_oneof![Just(0u32), 0u32..=3600, any::<u32>()]) {
            let (km, ks, broke) = k_clocks_calc_mult_shift(from, to, maxsec);
            match clocks_calc_mult_shift(from, to, maxsec) {
                Some((m, s)) => {
                    prop_assert!(broke);
                    prop_assert_eq!((m, s), (km, ks));
                    // The kernel's promise: maxsec seconds of counter times mult fit 64 bits.
                    prop_assert!(u128::from(m) * u128::from(maxsec) * u128::from(from) < (1u128 << 64));
                }
                None => prop_assert!(!broke),
            }
        }

        #[test]
        fn tsc_khz_accuracy(khz in prop_oneof![1u32..=u32::MAX, 100_000u32..=10_000_000]) {
            let c = PerfTimeConv::try_from_tsc_khz(khz, 0).expect("nonzero khz");
            prop_assert!(c.shift() <= 31);
            let err = (i128::from(c.mult()) * i128::from(khz)
                - (i128::from(NSEC_PER_MSEC) << c.shift())).abs();
            prop_assert!(err <= i128::from(khz), "err {} > khz {}", err, khz);
            // Maximal precision: one more shift bit would have needed a 33-bit multiplier
            // (shift 31 is the cap the kernel imposes for perf).
            if c.shift() < 31 {
                let next = ((u128::from(NSEC_PER_MSEC) << (c.shift() + 1)) + u128::from(khz / 2)) / u128::from(khz);
                prop_assert!(next >= (1u128 << 32));
            }
        }

        #[test]
        fn nanos_matches_reference(c in conv(), t in any::<u64>()) {
            let r = ref_nanos(c, u128::from(t));
            let want = u64::try_from(r).ok().map(Nanos);
            prop_assert_eq!(c.try_nanos_from_ticks(t), want);
        }

        /// ceil = min{t : ns(t) >= n}, floor = max{t : ns(t) <= n}; None iff not in u64.
        #[test]
        fn ceil_and_floor_definitions(c in conv(), n in any::<u64>(), t0 in any::<u64>(), near in any::<bool>(), delta in -2i64..=2) {
            let n = if near {
                match c.try_nanos_from_ticks(t0) {
                    Some(Nanos(v)) => v.wrapping_add(delta.cast_unsigned()),
                    None => n,
                }
            } else {
                n
            };
            let n128 = u128::from(n);
            match c.try_ticks_from_nanos_ceil::<u64>(Nanos(n)) {
                Some(t) => {
                    prop_assert!(ref_nanos(c, u128::from(t)) >= n128);
                    prop_assert!(t == 0 || ref_nanos(c, u128::from(t) - 1) < n128);
                }
                None => prop_assert!(ref_nanos(c, u128::from(u64::MAX)) < n128),
            }
            match c.try_ticks_from_nanos_floor::<u64>(Nanos(n)) {
                Some(t) => {
                    prop_assert!(ref_nanos(c, u128::from(t)) <= n128);
                    prop_assert!(ref_nanos(c, u128::from(t) + 1) > n128);
                }
                None => prop_assert!(ref_nanos(c, 0) > n128 || ref_nanos(c, 1u128 << 64) <= n128),
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Every nanosecond value in the image converts back to a tick that gives it again;
        /// with at least one ns per tick (mult >= 2^shift) ticks survive ticks->ns->ticks.
        #[test]
        fn round_trips(c in conv(), t in any::<u64>()) {
            if let Some(ns) = c.try_nanos_from_ticks(t) {
                let back: u64 = c.try_ticks_from_nanos_ceil(ns).expect("in image");
                prop_assert!(back <= t);
                prop_assert_eq!(c.try_nanos_from_ticks(back), Some(ns));
                if u64::from(c.mult()) >= (1u64 << c.shift()) {
                    prop_assert_eq!(back, t);
                    prop_assert_eq!(c.try_ticks_from_nanos_floor::<u64>(ns), Some(t));
                }
            }
        }
    }
}
