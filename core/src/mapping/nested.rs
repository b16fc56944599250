//! Nested virtualization: the L0→L2 TSC mapping KVM derives from L0→L1 and L1→L2.
//!
//! See [`KvmTscMapping::try_compose_nested`] for the kernel formula and
//! [`KvmTscMapping::try_nested_deviation_bound`] for how far it is from applying the two
//! mappings one after the other.

use super::KvmTscMapping;
use crate::HostTicks;

/// How far host→L1→L2 applied one after the other can stray from the composed L0→L2 mapping.
///
/// Returned by [`KvmTscMapping::try_nested_deviation_bound`]: for a host tick `h`, the
/// sequential L2 tick lies in `[composed - below, composed + above]` (modulo 2^64).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct NestedDeviation {
    /// The sequential L2 tick is at most this many ticks below the composed one.
    pub below: u64,
    /// The sequential L2 tick is at most this many ticks above the composed one.
    pub above: u64,
}

/// The low 64 bits of a 128-bit value: the same truncation a C `u64` assignment performs.
///
/// Used only where the kernel's arithmetic is modulo 2^64 on purpose (the nested offset).
#[inline]
const fn low_u64(x: u128) -> u64 {
    // The truncation is the point: the value is a residue modulo 2^64.
    #[allow(clippy::cast_possible_truncation)]
    let low = x as u64;
    low
}

impl KvmTscMapping {
    /// The L0→L2 mapping KVM programs while a vCPU runs a nested guest.
    ///
    /// `l01` maps the host (L0) TSC to the L1 guest; `l12` is what L1 programmed for its own
    /// guest L2. Bit for bit as arch/x86/kvm/x86.c `kvm_calc_nested_tsc_offset` and
    /// `kvm_calc_nested_tsc_multiplier`:
    ///
    /// - `offset_02 = trunc(offset_01 * ratio_12 / 2^frac) + offset_12 (mod 2^64)`, where
    ///   `trunc` rounds toward zero: the kernel's `mul_s64_u64_shr` multiplies the magnitude,
    ///   shifts, and negates. Its 64-bit truncation is harmless because the offset is a residue
    ///   modulo 2^64 anyway, so this never fails.
    /// - `ratio_02 = floor(ratio_01 * ratio_12 / 2^frac)` (`mul_u64_u64_shr`).
    ///
    /// The kernel's shortcut for `ratio_12 == 1 << frac` gives the same bits as the formula.
    /// Returns `None` if the `frac_bits` differ, or if `ratio_02` does not fit a `u64` or is
    /// zero (the kernel would silently truncate; such a ratio is not a usable mapping).
    ///
    /// The composition is what the hardware really runs, but it differs slightly from
    /// applying `l01` and then `l12`, because each of the kernel's shifts floors (or
    /// truncates). [`Self::try_nested_deviation_bound`] gives the exact bound; the derivation
    /// is there.
    #[must_use]
    pub fn try_compose_nested(l01: &Self, l12: &Self) -> Option<Self> {
        if l01.frac_bits() != l12.frac_bits() {
            return None;
        }
        let frac = l01.frac_bits();
        // |offset_01| <= 2^63 and ratio_12 < 2^64, so the signed product fits an i128; Rust's
        // i128 division truncates toward zero, which is what mul_s64_u64_shr does.
        let product = i128::from(l01.offset()) * i128::from(l12.ratio());
        let scaled_offset = low_u64((product / (1i128 << frac)).cast_unsigned());
        let offset = scaled_offset
            .wrapping_add(l12.offset().cast_unsigned())
            .cast_signed();
        let ratio =
            u64::try_from((u128::from(l01.ratio()) * u128::from(l12.ratio())) >> frac).ok()?;
        Self::try_new(offset, ratio, frac).ok()
    }

    /// How far `l12(l01(host))` can be from `try_compose_nested(l01, l12)(host)`.
    ///
    /// With `D = 2^frac`, `m2 = l12.ratio()`, and `h` the host tick, the sequential L2 tick minus
    /// the composed one lies in `[-(1 + ceil(m2 / D)), 1 + ceil(h / D)]` (modulo 2^64), for
    /// every `l01` with the same `frac_bits`, provided the L1 tick `offset_01 + F_01(h)` does
    /// not wrap (lies in `[0, 2^64)` as an integer) and no step overflows.
    ///
    /// Derivation. Let `o1, m1` be `l01`'s offset and ratio, `X = o1 * m2 / D`,
    /// `A = floor(h * m1 / D) = h * m1 / D - a` and `m = floor(m1 * m2 / D) = m1 * m2 / D - b`
    /// with `a, b` in `[0, 1)`. Then, dropping `offset_12` from both sides,
    /// sequential `= floor(X + A * m2 / D)` and composed `= trunc(X) + floor(h * m / D)`.
    /// Now `A * m2 / D - h * m / D = h * b / D - a * m2 / D =: e`, which lies in
    /// `(-m2 / D, h / D)`. With `x = X - trunc(X)` in `(-1, 1)` and `z = frac(h * m / D)` in
    /// `[0, 1)`, the difference is `floor(x + z + e)` with `x + z + e` in
    /// `(-1 - m2 / D, 2 + h / D)`, hence the bound. The `h / D` term is the floored combined
    /// ratio losing up to one unit per `D` host ticks: about one tick per 26 hours of a 3 GHz
    /// host for VMX, but one tick per 1.4 s for SVM.
    ///
    /// Returns `None` only if a bound does not fit a `u64` (`frac_bits == 0` with a huge
    /// ratio or host tick).
    #[must_use]
    pub fn try_nested_deviation_bound(l12: &Self, host: HostTicks) -> Option<NestedDeviation> {
        let frac = l12.frac_bits();
        let d_minus_1 = (1u128 << frac) - 1;
        let below = 1 + ((u128::from(l12.ratio()) + d_minus_1) >> frac);
        let above = 1 + ((u128::from(host.0) + d_minus_1) >> frac);
        Some(NestedDeviation {
            below: u64::try_from(below).ok()?,
            above: u64::try_from(above).ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    // The naive references below work in i128/u128 and narrow only after range checks.
    #![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

    use super::super::test_support::*;
    use super::*;
    use crate::mapping::{FRAC_BITS_SVM, FRAC_BITS_VMX};
    use proptest::prelude::*;
    use std::println;

    /// The kernel's `mul_u64_u64_shr`: 128-bit product, shift, keep the low 64 bits.
    fn k_mul_u64_u64_shr(a: u64, b: u64, shift: u32) -> u64 {
        ((u128::from(a) * u128::from(b)) >> shift) as u64
    }

    /// The kernel's `mul_s64_u64_shr`: magnitude, multiply, shift, negate (wrapping, -fwrapv).
    fn k_mul_s64_u64_shr(a: i64, b: u64, shift: u32) -> u64 {
        let ret = k_mul_u64_u64_shr(a.unsigned_abs(), b, shift);
        if a < 0 {
            ret.cast_signed().wrapping_neg().cast_unsigned()
        } else {
            ret
        }
    }

    /// `kvm_calc_nested_tsc_offset` and `kvm_calc_nested_tsc_multiplier`, step by step,
    /// including the shortcuts for a default L2 multiplier.
    fn k_nested(l1_off: u64, l1_mult: u64, l2_off: u64, l2_mult: u64, frac: u32) -> (u64, u64) {
        let default = 1u64 << frac;
        let nested_off = if l2_mult == default {
            l1_off
        } else {
            k_mul_s64_u64_shr(l1_off.cast_signed(), l2_mult, frac)
        };
        let off = nested_off.wrapping_add(l2_off);
        let mult = if l2_mult != default {
            k_mul_u64_u64_shr(l1_mult, l2_mult, frac)
        } else {
            l1_mult
        };
        (off, mult)
    }

    #[test]
    fn compose_known_values() {
        // Like the kernel selftest vmx_nested_tsc_scaling_test: L1 at half rate, L2 at 4x L1.
        let l01 = m(-1000, 1 << 47, 48);
        let l12 = m(-33_125_236_320_908, 4 << 48, 48);
        let c = KvmTscMapping::try_compose_nested(&l01, &l12).expect("composes");
        assert_eq!(c, m(-4000 - 33_125_236_320_908, 2 << 48, 48));
        // The offset multiply truncates toward zero: -3 * 1.5 = -4.5 -> -4 (floor gives -5).
        let l01 = m(-3, 1 << 48, 48);
        let l12 = m(0, 3 << 47, 48);
        let c = KvmTscMapping::try_compose_nested(&l01, &l12).expect("composes");
        assert_eq!(c.offset(), -4);
        // frac_bits must agree.
        assert_eq!(
            KvmTscMapping::try_compose_nested(
                &KvmTscMapping::IDENTITY_VMX,
                &KvmTscMapping::IDENTITY_SVM
            ),
            None
        );
        // A combined multiplier that would not fit u64 is refused, not truncated.
        let big = m(0, u64::MAX, 48);
        assert_eq!(KvmTscMapping::try_compose_nested(&big, &big), None);
        // A combined multiplier that floors to zero is refused too.
        let tiny = m(0, 1, 48);
        assert_eq!(KvmTscMapping::try_compose_nested(&tiny, &tiny), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn compose_matches_kernel_bit_for_bit(
            (l01, l12) in frac().prop_flat_map(|f| (offset(), ratio_for(f), offset(), ratio_for(f), Just(f)))
                .prop_map(|(o1, r1, o2, r2, f)| (m(o1, r1, f), m(o2, r2, f))),
        ) {
            let f = l01.frac_bits();
            let (k_off, k_mult) = k_nested(
                l01.offset().cast_unsigned(), l01.ratio(), l12.offset().cast_unsigned(), l12.ratio(), f,
            );
            match KvmTscMapping::try_compose_nested(&l01, &l12) {
                Some(c) => {
                    prop_assert_eq!(c.offset().cast_unsigned(), k_off);
                    prop_assert_eq!(c.ratio(), k_mult);
                    prop_assert_eq!(c.frac_bits(), f);
                }
                None => {
                    // Only when the kernel's multiplier truncates or comes out zero.
                    let exact = (u128::from(l01.ratio()) * u128::from(l12.ratio())) >> f;
                    prop_assert!(exact > u128::from(u64::MAX) || exact == 0);
                }
            }
        }
    }

    /// Sequential L2 tick minus composed L2 tick, or `None` when a precondition of the bound
    /// fails (L1 tick wraps, a step overflows).
    fn nested_deviation(l01: KvmTscMapping, l12: KvmTscMapping, h: u64) -> Option<i64> {
        let a = ref_scaled(l01, u128::from(h));
        let g1 = i128::from(l01.offset()) + i128::try_from(a).ok()?;
        let g1 = u64::try_from(g1).ok()?;
        let seq = l12.try_guest_from_host(HostTicks(g1))?;
        let c = KvmTscMapping::try_compose_nested(&l01, &l12)?;
        let comp = c.try_guest_from_host(HostTicks(h))?;
        Some(seq.0.wrapping_sub(comp.0).cast_signed())
    }

    fn check_bound(
        l01: KvmTscMapping,
        l12: KvmTscMapping,
        h: u64,
    ) -> Option<(i64, NestedDeviation)> {
        let d = nested_deviation(l01, l12, h)?;
        let b = KvmTscMapping::try_nested_deviation_bound(&l12, HostTicks(h))?;
        assert!(
            i128::from(d) >= -i128::from(b.below) && i128::from(d) <= i128::from(b.above),
            "deviation {d} outside [-{}, {}] for {l01:?} {l12:?} h={h}",
            b.below,
            b.above
        );
        Some((d, b))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// Realistic nested setups: ratios within ±10 % (and exact default), offsets up to
        /// 2^60, hosts up to 2^60. The bound holds for every host tick.
        #[test]
        fn compose_vs_sequential_within_bound(
            (l01, l12) in frac().prop_flat_map(|f| (
                -(1i64 << 40)..(1i64 << 60), ratio_for(f), offset(), ratio_for(f), Just(f),
            )).prop_map(|(o1, r1, o2, r2, f)| (m(o1, r1, f), m(o2, r2, f))),
            h in (1u64 << 41)..(1u64 << 60),
        ) {
            let r = check_bound(l01, l12, h);
            // With the ranges above only the tiny/huge ratio arms can break a precondition.
            let plain = |x: KvmTscMapping| x.ratio() > 16 && x.ratio() < u64::MAX - 1000;
            if plain(l01) && plain(l12) && l01.ratio() < 2 * l01.default_ratio() && l12.ratio() < 2 * l12.default_ratio() {
                prop_assert!(r.is_some(), "precondition unexpectedly failed");
            }
        }

        /// Any frac in 0..=63, ratios from a quarter to three times the identity (narrower where
        /// their product would not fit or would floor to zero), offsets
        /// from -2^40 to 2^61, hosts from 2^42 to 2^59: ranges in which every precondition
        /// holds, so every case really checks the bound.
        #[test]
        fn compose_vs_sequential_within_bound_any_frac(
            (l01, l12) in (0u32..=63).prop_flat_map(|f| {
                let d = 1u128 << f;
                // At least sqrt(d) so that the composed ratio does not floor to zero.
                let lo = u64::try_from((d / 4).max((d - 1).isqrt() + 1)).expect("small");
                // Also keep r1 * r2 / d below 2^64 so that the composed ratio exists.
                let hi = u64::try_from((3 * d).min((d << 64).isqrt())).unwrap_or(u64::MAX);
                (-(1i64 << 40)..(1i64 << 61), lo..=hi, offset(), lo..=hi, Just(f))
            }).prop_map(|(o1, r1, o2, r2, f)| (m(o1, r1, f), m(o2, r2, f))),
            h in (1u64 << 42)..(1u64 << 59),
        ) {
            prop_assert!(check_bound(l01, l12, h).is_some(), "precondition failed");
        }
    }

    /// A deterministic sweep: the bound is never exceeded, and the extremes it allows are
    /// actually approached (so the bound is not vacuous). Prints what it saw.
    #[test]
    fn compose_deviation_sweep() {
        // Deterministic: a failure names the mapping values, which reproduce it.
        let mut rng = crate::sim::SplitMix64::new(0x9E37_79B9_7F4A_7C15);
        let mut next = move || rng.next_u64();
        for frac in [FRAC_BITS_SVM, FRAC_BITS_VMX] {
            let d = 1u64 << frac;
            let (mut lo, mut hi) = (i64::MAX, i64::MIN);
            // The least room left under each end of the bound over the whole sweep.
            let (mut slack_below, mut slack_above) = (u64::MAX, u64::MAX);
            for _ in 0..20_000 {
                let r1 = d - d / 10 + next() % (d / 5);
                let r2 = d - d / 10 + next() % (d / 5);
                let o1 = (next() % (1 << 50)).cast_signed() - (1 << 40);
                let o2 = next().cast_signed();
                let h = (1 << 41) + next() % (1 << 50);
                let (l01, l12) = (m(o1, r1, frac), m(o2, r2, frac));
                let (dev, b) = check_bound(l01, l12, h).expect("preconditions hold here");
                lo = lo.min(dev);
                hi = hi.max(dev);
                let dev = i128::from(dev);
                slack_below = slack_below.min((i128::from(b.below) + dev) as u64);
                slack_above = slack_above.min((i128::from(b.above) - dev) as u64);
            }
            println!(
                "frac {frac}: 20000 nested cases, sequential - composed in [{lo}, {hi}]; \
                 least slack under the bound: {slack_below} below, {slack_above} above"
            );
            assert!(
                lo < 0 || hi > 0,
                "rounding never showed: the sweep is too weak"
            );
        }
    }
}
