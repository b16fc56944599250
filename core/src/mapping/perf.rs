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
