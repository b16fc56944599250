//! The KVM per-vCPU TSC relation, its exact inverse and nested composition.
//!
//! See the [module docs](crate::mapping) for the relation, the sign conventions and why
//! every function rounds the way it does.

use serde::{Deserialize, Serialize};

use super::MappingError;
use crate::{GuestTicks, HostTicks};

/// Fraction bits of the KVM TSC multiplier on Intel VMX.
///
/// Source: arch/x86/kvm/vmx/vmx.c `hardware_setup()`,
/// `kvm_caps.tsc_scaling_ratio_frac_bits = 48` (the VMCS TSC multiplier is a 16.48 value).
pub const FRAC_BITS_VMX: u32 = 48;

/// Fraction bits of the KVM TSC ratio on AMD SVM.
///
/// Source: arch/x86/kvm/svm/svm.c `svm_hardware_setup()`,
/// `kvm_caps.tsc_scaling_ratio_frac_bits = 32` (MSR_AMD64_TSC_RATIO is an 8.32 value).
pub const FRAC_BITS_SVM: u32 = 32;

/// The largest `frac_bits` a [`KvmTscMapping`] accepts.
///
/// The identity ratio is `1 << frac_bits` in a `u64`, so 63 is the largest value for which the
/// identity is representable; KVM itself only ever uses 32 or 48.
pub const MAX_FRAC_BITS: u32 = 63;

/// One vCPU's KVM TSC relation: `guest = offset + ((host * ratio) >> frac_bits)`.
///
/// This is exactly what KVM programs into the hardware (arch/x86/kvm/x86.c `kvm_scale_tsc`,
/// `kvm_read_l1_tsc`): the product is 128 bits wide and the shift floors; the addition of the
/// offset is modulo 2^64. The fields are private so that every value, including one decoded
/// from the wire, satisfies `ratio >= 1` and `frac_bits <= 63`, which is what lets the
/// conversions be total (no division by zero, no oversized shift).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "KvmTscMappingRepr", into = "KvmTscMappingRepr")]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct KvmTscMapping {
    offset: i64,
    ratio: u64,
    frac_bits: u32,
}

/// The unchecked wire form of [`KvmTscMapping`]; decoding goes through `try_new`.
#[derive(Clone, Copy, Serialize, Deserialize, postcard::experimental::max_size::MaxSize)]
struct KvmTscMappingRepr {
    offset: i64,
    ratio: u64,
    frac_bits: u32,
}

impl TryFrom<KvmTscMappingRepr> for KvmTscMapping {
    type Error = MappingError;

    fn try_from(r: KvmTscMappingRepr) -> Result<Self, MappingError> {
        Self::try_new(r.offset, r.ratio, r.frac_bits)
    }
}

impl From<KvmTscMapping> for KvmTscMappingRepr {
    fn from(m: KvmTscMapping) -> Self {
        Self {
            offset: m.offset,
            ratio: m.ratio,
            frac_bits: m.frac_bits,
        }
    }
}

impl postcard::experimental::max_size::MaxSize for KvmTscMapping {
    const POSTCARD_MAX_SIZE: usize = KvmTscMappingRepr::POSTCARD_MAX_SIZE;
}

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
    /// Identity on Intel VMX: offset 0, ratio `1 << 48`.
    pub const IDENTITY_VMX: Self = Self {
        offset: 0,
        ratio: 1 << FRAC_BITS_VMX,
        frac_bits: FRAC_BITS_VMX,
    };

    /// Identity on AMD SVM: offset 0, ratio `1 << 32`.
    pub const IDENTITY_SVM: Self = Self {
        offset: 0,
        ratio: 1 << FRAC_BITS_SVM,
        frac_bits: FRAC_BITS_SVM,
    };

    /// Builds a mapping from the three values KVM exposes per vCPU in debugfs
    /// (`tsc-offset`, `tsc-scaling-ratio`, `tsc-scaling-ratio-frac-bits`).
    ///
    /// # Errors
    /// [`MappingError::ZeroRatio`] if `ratio == 0`; [`MappingError::FracBitsTooLarge`] if
    /// `frac_bits > 63`. Any other ratio is accepted, far from the default or not: KVM's own
    /// limits differ per vendor (VMX allows any `u64`, SVM below 2^40) and the math here
    /// is exact for all of them.
    pub const fn try_new(offset: i64, ratio: u64, frac_bits: u32) -> Result<Self, MappingError> {
        if ratio == 0 {
            return Err(MappingError::ZeroRatio);
        }
        if frac_bits > MAX_FRAC_BITS {
            return Err(MappingError::FracBitsTooLarge);
        }
        Ok(Self {
            offset,
            ratio,
            frac_bits,
        })
    }

    /// The identity mapping (offset 0, ratio `1 << frac_bits`) for the given fraction width.
    ///
    /// # Errors
    /// [`MappingError::FracBitsTooLarge`] if `frac_bits > 63`.
    pub const fn identity(frac_bits: u32) -> Result<Self, MappingError> {
        if frac_bits > MAX_FRAC_BITS {
            return Err(MappingError::FracBitsTooLarge);
        }
        Ok(Self {
            offset: 0,
            ratio: 1 << frac_bits,
            frac_bits,
        })
    }

    /// A mapping with only an offset (ratio 1, `frac_bits` 0), for hosts without TSC scaling.
    ///
    /// This is what a debugfs directory without `tsc-scaling-ratio` files means, and it
    /// converts exactly like any identity ratio; it compares unequal to, say,
    /// `IDENTITY_VMX.with_offset(offset)` because the fields differ.
    #[must_use]
    pub const fn offset_only(offset: i64) -> Self {
        Self {
            offset,
            ratio: 1,
            frac_bits: 0,
        }
    }

    /// The same scaling with a different offset.
    #[must_use]
    pub const fn with_offset(self, offset: i64) -> Self {
        Self { offset, ..self }
    }

    /// KVM's `tsc-offset`: for identity scaling this is `guest - host`.
    #[must_use]
    pub const fn offset(self) -> i64 {
        self.offset
    }

    /// KVM's `tsc-scaling-ratio`, a fixed-point number with [`Self::frac_bits`] fraction bits.
    #[must_use]
    pub const fn ratio(self) -> u64 {
        self.ratio
    }

    /// KVM's `tsc-scaling-ratio-frac-bits` (48 on VMX, 32 on SVM).
    #[must_use]
    pub const fn frac_bits(self) -> u32 {
        self.frac_bits
    }

    /// The ratio meaning "same rate as the host": `1 << frac_bits`.
    #[must_use]
    pub const fn default_ratio(self) -> u64 {
        // frac_bits <= 63 is an invariant of every constructor, so the shift is in range.
        1 << self.frac_bits
    }

    /// Whether the guest TSC runs at the host's rate (ratio equals `1 << frac_bits`).
    #[must_use]
    pub const fn is_identity_ratio(self) -> bool {
        self.ratio == self.default_ratio()
    }

    /// `floor(host * ratio / 2^frac_bits)`, or `None` if that exceeds `u64`.
    #[inline]
    fn try_scale(self, host: u64) -> Option<u64> {
        if self.is_identity_ratio() {
            return Some(host);
        }
        u64::try_from((u128::from(host) * u128::from(self.ratio)) >> self.frac_bits).ok()
    }

    /// The scaled value `s = (guest - offset) mod 2^64` that the inverse works on.
    #[inline]
    const fn scaled_of(self, guest: GuestTicks) -> u64 {
        guest.0.wrapping_sub(self.offset.cast_unsigned())
    }

    /// The guest TSC KVM shows the vCPU when the host TSC reads `host`.
    ///
    /// Computes `offset + floor(host * ratio / 2^frac_bits)` with a 128-bit product and the
    /// addition modulo 2^64, exactly like the hardware. Returns `None` when the scaled value
    /// alone exceeds `u64` (only possible for ratios above the identity, far in the future).
    #[inline]
    #[must_use]
    pub fn try_guest_from_host(self, host: HostTicks) -> Option<GuestTicks> {
        let scaled = self.try_scale(host.0)?;
        Some(GuestTicks(scaled.wrapping_add(self.offset.cast_unsigned())))
    }

    /// The earliest host tick whose guest image is at or after `guest`.
    ///
    /// With `s = (guest - offset) mod 2^64` and `F(h) = floor(h * ratio / 2^frac_bits)`, this is
    /// the smallest integer `h >= 0` with `F(h) >= s`, i.e. `ceil(s * 2^frac_bits / ratio)`;
    /// `None` if that `h` exceeds `u64::MAX`. "At or after" is therefore judged on the scaled
    /// value, not on the wrapped guest tick, which is what makes it agree with host order.
    ///
    /// Guarantees: for every `g` in the image of [`Self::try_guest_from_host`],
    /// `try_guest_from_host(try_host_from_guest_ceil(g)) == g`; when `ratio >= 2^frac_bits`
    /// every host tick survives host→guest→host unchanged. A guest tick that the forward map
    /// skips (ratio above identity) rounds to the next host tick that passes it; within
    /// `ratio / 2^frac_bits` of `s = 2^64` that host tick's own image no longer fits a `u64`.
    /// A guest tick numerically below `offset` has a huge `s`: it lies 2^64 ticks later, as
    /// KVM's wrapping addition says. Identity ratios take a fast path without division.
    #[inline]
    #[must_use]
    pub fn try_host_from_guest_ceil(self, guest: GuestTicks) -> Option<HostTicks> {
        let s = self.scaled_of(guest);
        if self.is_identity_ratio() {
            return Some(HostTicks(s));
        }
        let num = u128::from(s) << self.frac_bits;
        u64::try_from(num.div_ceil(u128::from(self.ratio)))
            .ok()
            .map(HostTicks)
    }

    /// The latest host tick whose guest image is at or before `guest`.
    ///
    /// With `s` and `F` as in [`Self::try_host_from_guest_ceil`], this is the largest integer
    /// `h >= 0` with `F(h) <= s`, i.e. `floor(((s + 1) * 2^frac_bits - 1) / ratio)`; `None` if
    /// that `h` exceeds `u64::MAX` (then even `u64::MAX` maps at or before `guest`).
    ///
    /// When `ratio >= 2^frac_bits` every host tick survives host→guest→host unchanged. For a
    /// slower guest clock several host ticks share one guest tick; this returns the last of
    /// them where `_ceil` returns the first, so the pair brackets the exact instant.
    #[inline]
    #[must_use]
    pub fn try_host_from_guest_floor(self, guest: GuestTicks) -> Option<HostTicks> {
        let s = self.scaled_of(guest);
        if self.is_identity_ratio() {
            return Some(HostTicks(s));
        }
        // (s + 1) <= 2^64 and frac_bits <= 63, so the numerator stays below 2^127.
        let num = ((u128::from(s) + 1) << self.frac_bits) - 1;
        u64::try_from(num / u128::from(self.ratio))
            .ok()
            .map(HostTicks)
    }

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
        if l01.frac_bits != l12.frac_bits {
            return None;
        }
        let frac = l01.frac_bits;
        // |offset_01| <= 2^63 and ratio_12 < 2^64, so the signed product fits an i128; Rust's
        // i128 division truncates toward zero, which is what mul_s64_u64_shr does.
        let product = i128::from(l01.offset) * i128::from(l12.ratio);
        let scaled_offset = low_u64((product / (1i128 << frac)).cast_unsigned());
        let offset = scaled_offset
            .wrapping_add(l12.offset.cast_unsigned())
            .cast_signed();
        let ratio =
            u64::try_from((u128::from(l01.ratio) * u128::from(l12.ratio)) >> frac).ok()?;
        Self::try_new(offset, ratio, frac).ok()
    }

    /// How far `l12(l01(host))` can be from `try_compose_nested(l01, l12)(host)`.
    ///
    /// With `D = 2^frac`, `m2 = l12.ratio`, and `h` the host tick, the sequential L2 tick minus
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
        let frac = l12.frac_bits;
        let d_minus_1 = (1u128 << frac) - 1;
        let below = 1 + ((u128::from(l12.ratio) + d_minus_1) >> frac);
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

    use super::*;
    use proptest::prelude::*;
    use std::println;

    const TWO_64: u128 = 1 << 64;

    fn m(offset: i64, ratio: u64, frac: u32) -> KvmTscMapping {
        KvmTscMapping::try_new(offset, ratio, frac).expect("valid test mapping")
    }

    /// `F(h) = floor(h * ratio / 2^frac)` over unbounded integers (h may be 2^64).
    fn ref_scaled(map: KvmTscMapping, h: u128) -> u128 {
        (h * u128::from(map.ratio())) >> map.frac_bits()
    }

    /// The forward relation, computed in i128 with an explicit Euclidean modulo.
    fn ref_forward(map: KvmTscMapping, h: u64) -> Option<u64> {
        let f = ref_scaled(map, u128::from(h));
        if f > u128::from(u64::MAX) {
            return None;
        }
        Some((i128::from(map.offset()) + f as i128).rem_euclid(TWO_64 as i128) as u64)
    }

    /// `s = (guest - offset) mod 2^64`.
    fn ref_s(map: KvmTscMapping, g: u64) -> u128 {
        (i128::from(g) - i128::from(map.offset())).rem_euclid(TWO_64 as i128) as u128
    }

    /// The largest host tick whose scaled value still fits a `u64`.
    fn max_host(map: KvmTscMapping) -> u64 {
        let lim = ((TWO_64 << map.frac_bits()) - 1) / u128::from(map.ratio());
        u64::try_from(lim).unwrap_or(u64::MAX)
    }

    fn frac() -> impl Strategy<Value = u32> {
        prop_oneof![Just(FRAC_BITS_SVM), Just(FRAC_BITS_VMX)]
    }

    /// Default, default ±10 %, tiny, huge, anything.
    fn ratio_for(frac: u32) -> impl Strategy<Value = u64> {
        let d = 1u64 << frac;
        let tenth = d / 10;
        prop_oneof![
            2 => Just(d),
            5 => (d - tenth)..=(d + tenth),
            1 => 1u64..=16,
            1 => (u64::MAX - 1000)..=u64::MAX,
            1 => 1u64..=u64::MAX,
        ]
    }

    /// Ratios at or above the identity: the forward map is injective.
    fn ratio_at_least_identity(frac: u32) -> impl Strategy<Value = u64> {
        let d = 1u64 << frac;
        prop_oneof![
            2 => Just(d),
            5 => d..=(d + d / 10),
            1 => (u64::MAX - 1000)..=u64::MAX,
            1 => d..=u64::MAX,
        ]
    }

    fn offset() -> impl Strategy<Value = i64> {
        prop_oneof![
            any::<i64>(),
            -(1i64 << 40)..(1i64 << 40),
            Just(i64::MIN),
            Just(i64::MAX),
            Just(0)
        ]
    }

    fn mapping() -> impl Strategy<Value = KvmTscMapping> {
        frac()
            .prop_flat_map(|f| (offset(), ratio_for(f), Just(f)))
            .prop_map(|(o, r, f)| m(o, r, f))
    }

    fn mapping_injective() -> impl Strategy<Value = KvmTscMapping> {
        frac()
            .prop_flat_map(|f| (offset(), ratio_at_least_identity(f), Just(f)))
            .prop_map(|(o, r, f)| m(o, r, f))
    }

    /// A host tick inside the forward map's domain, biased towards its two ends.
    fn host_in_domain(map: KvmTscMapping, pick: u64, which: u8) -> u64 {
        let top = max_host(map);
        match which % 8 {
            0 => 0,
            1 => top,
            2 => top.saturating_sub(pick % 1024),
            _ => (u128::from(pick) % (u128::from(top) + 1)) as u64,
        }
    }

    #[test]
    fn constructor_rejects_bad_parameters() {
        assert_eq!(
            KvmTscMapping::try_new(0, 0, 48),
            Err(MappingError::ZeroRatio)
        );
        assert_eq!(
            KvmTscMapping::try_new(0, 1, 64),
            Err(MappingError::FracBitsTooLarge)
        );
        assert_eq!(
            KvmTscMapping::identity(64),
            Err(MappingError::FracBitsTooLarge)
        );
        assert_eq!(KvmTscMapping::identity(48), Ok(KvmTscMapping::IDENTITY_VMX));
        assert_eq!(KvmTscMapping::identity(32), Ok(KvmTscMapping::IDENTITY_SVM));
        let top = KvmTscMapping::identity(63).expect("63 is allowed");
        assert_eq!(top.ratio(), 1 << 63);
        assert!(top.is_identity_ratio());
        assert!(KvmTscMapping::offset_only(-5).is_identity_ratio());
        assert_eq!(KvmTscMapping::IDENTITY_VMX.with_offset(-7).offset(), -7);
        assert_eq!(KvmTscMapping::IDENTITY_SVM.default_ratio(), 1 << 32);
    }

    #[test]
    fn forward_known_values() {
        // Ratio 1.5 on VMX, guest booted 1000 ticks after the host: offset -1000.
        let map = m(-1000, 3 << 47, 48);
        assert_eq!(
            map.try_guest_from_host(HostTicks(10_000)),
            Some(GuestTicks(14_000))
        );
        // The offset wraps modulo 2^64 exactly like KVM's addition.
        assert_eq!(
            map.try_guest_from_host(HostTicks(0)),
            Some(GuestTicks(u64::MAX - 999))
        );
        // Floor of the product: 3 * 1.5 = 4.5 -> 4.
        assert_eq!(m(0, 3 << 47, 48).try_guest_from_host(HostTicks(3)), Some(GuestTicks(4)));
        // The scaled value overflows u64 for a ratio of 2 at the top of the host range.
        assert_eq!(m(0, 2 << 48, 48).try_guest_from_host(HostTicks(u64::MAX)), None);
        // An identity ratio never overflows: offset_only is trace-cmd's normalized form.
        assert_eq!(
            KvmTscMapping::offset_only(-1).try_guest_from_host(HostTicks(u64::MAX)),
            Some(GuestTicks(u64::MAX - 1))
        );
    }

    #[test]
    fn inverse_known_values() {
        let map = m(-1000, 3 << 47, 48);
        let g = GuestTicks(14_000);
        assert_eq!(map.try_host_from_guest_ceil(g), Some(HostTicks(10_000)));
        assert_eq!(map.try_host_from_guest_floor(g), Some(HostTicks(10_000)));
        // 14_001 is skipped by the 1.5x clock: 10_000 -> 14_000, 10_001 -> 14_001 (floor
        // of 15_001.5 - 1000), 10_002 -> 14_003. Guest 14_002 is skipped.
        assert_eq!(
            map.try_host_from_guest_ceil(GuestTicks(14_002)),
            Some(HostTicks(10_002))
        );
        assert_eq!(
            map.try_host_from_guest_floor(GuestTicks(14_002)),
            Some(HostTicks(10_001))
        );
        // Half-rate guest: host 20 and 21 both map to guest 10.
        let half = m(0, 1 << 47, 48);
        assert_eq!(half.try_host_from_guest_ceil(GuestTicks(10)), Some(HostTicks(20)));
        assert_eq!(half.try_host_from_guest_floor(GuestTicks(10)), Some(HostTicks(21)));
        // Every host tick maps at or before a huge guest tick: the floor is beyond u64.
        assert_eq!(half.try_host_from_guest_floor(GuestTicks(u64::MAX)), None);
        // A half-rate guest never reaches the top guest ticks from a u64 host tick.
        assert_eq!(half.try_host_from_guest_ceil(GuestTicks(u64::MAX)), None);
        // A double-rate guest skips u64::MAX; the first host tick past it is 2^63, whose own
        // image (2^64) no longer fits: the documented edge at the very top of the range.
        let double = m(0, 2 << 48, 48);
        assert_eq!(
            double.try_host_from_guest_ceil(GuestTicks(u64::MAX)),
            Some(HostTicks(1 << 63))
        );
        assert_eq!(double.try_guest_from_host(HostTicks(1 << 63)), None);
    }

    #[test]
    fn trace_cmd_formula_is_wrong_for_scaled_guests() {
        // Guest runs 10 % faster than the host, VMX, guest booted 5e9 ticks after the host.
        let ratio = (1u64 << 48) + (1u64 << 48) / 10;
        let map = m(-5_000_000_000, ratio, 48);
        let host = HostTicks(3_000_000_000_000); // ~17 min of a 3 GHz host
        let guest = map.try_guest_from_host(host).expect("in range");
        assert_eq!(map.try_host_from_guest_ceil(guest), Some(host));
        // trace-cmd: ts = (ts * scaling) >> frac in 64 bits, then subtract tsc_offset.
        let tc = (guest.0.wrapping_mul(ratio) >> 48).wrapping_sub(map.offset().cast_unsigned());
        assert_ne!(tc, host.0, "trace-cmd's 64-bit forward formula cannot invert");
    }

    #[test]
    fn postcard_round_trip_and_checked_decode() {
        use postcard::experimental::max_size::MaxSize;
        let mut buf = [0u8; KvmTscMapping::POSTCARD_MAX_SIZE];
        assert_eq!(KvmTscMapping::POSTCARD_MAX_SIZE, 10 + 10 + 5);
        let extreme = m(i64::MIN, u64::MAX, 63);
        let used = postcard::to_slice(&extreme, &mut buf).expect("fits max size").len();
        let back: KvmTscMapping = postcard::from_bytes(&buf[..used]).expect("decodes");
        assert_eq!(back, extreme);

        let bad = KvmTscMappingRepr {
            offset: 1,
            ratio: 0,
            frac_bits: 48,
        };
        let used = postcard::to_slice(&bad, &mut buf).expect("fits").len();
        assert!(postcard::from_bytes::<KvmTscMapping>(&buf[..used]).is_err());
        let bad = KvmTscMappingRepr {
            offset: 1,
            ratio: 1,
            frac_bits: 64,
        };
        let used = postcard::to_slice(&bad, &mut buf).expect("fits").len();
        assert!(postcard::from_bytes::<KvmTscMapping>(&buf[..used]).is_err());
    }

    proptest! {
        #[test]
        fn forward_matches_reference(map in mapping(), h in any::<u64>(), pick in any::<u64>(), which in any::<u8>()) {
            prop_assert_eq!(map.try_guest_from_host(HostTicks(h)).map(GuestTicks::get), ref_forward(map, h));
            let h = host_in_domain(map, pick, which);
            prop_assert_eq!(map.try_guest_from_host(HostTicks(h)).map(GuestTicks::get), ref_forward(map, h));
        }

        /// ceil(g) = min{h >= 0 : F(h) >= s}, floor(g) = max{h >= 0 : F(h) <= s}; None iff
        /// that integer is above u64::MAX. Checked on guests near the image and anywhere.
        #[test]
        fn ceil_and_floor_definitions(
            map in mapping(), pick in any::<u64>(), which in any::<u8>(),
            delta in -3i64..=3, raw in any::<u64>(), use_raw in any::<bool>(),
        ) {
            let g = if use_raw {
                raw
            } else {
                let h = host_in_domain(map, pick, which);
                ref_forward(map, h).expect("in domain").wrapping_add(delta.cast_unsigned())
            };
            let s = ref_s(map, g);
            match map.try_host_from_guest_ceil(GuestTicks(g)) {
                Some(HostTicks(h)) => {
                    prop_assert!(ref_scaled(map, u128::from(h)) >= s);
                    prop_assert!(h == 0 || ref_scaled(map, u128::from(h) - 1) < s);
                }
                None => prop_assert!(ref_scaled(map, u128::from(u64::MAX)) < s),
            }
            match map.try_host_from_guest_floor(GuestTicks(g)) {
                Some(HostTicks(h)) => {
                    prop_assert!(ref_scaled(map, u128::from(h)) <= s);
                    prop_assert!(ref_scaled(map, u128::from(h) + 1) > s);
                }
                None => prop_assert!(ref_scaled(map, TWO_64) <= s),
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// ratio >= 2^frac: host -> guest -> host is the identity through both inverses.
        #[test]
        fn host_guest_host_round_trip(map in mapping_injective(), pick in any::<u64>(), which in any::<u8>()) {
            let h = HostTicks(host_in_domain(map, pick, which));
            let g = map.try_guest_from_host(h).expect("in domain");
            prop_assert_eq!(map.try_host_from_guest_ceil(g), Some(h));
            prop_assert_eq!(map.try_host_from_guest_floor(g), Some(h));
        }

        /// Any ratio: every guest tick in the image comes back exactly; the ceil is the first
        /// and the floor the last host tick of the (possibly several) that reach it.
        #[test]
        fn guest_host_guest_round_trip(map in mapping(), pick in any::<u64>(), which in any::<u8>()) {
            let h0 = HostTicks(host_in_domain(map, pick, which));
            let g = map.try_guest_from_host(h0).expect("in domain");
            let hc = map.try_host_from_guest_ceil(g).expect("g is in the image");
            prop_assert!(hc <= h0);
            prop_assert_eq!(map.try_guest_from_host(hc), Some(g));
            if let Some(hf) = map.try_host_from_guest_floor(g) {
                prop_assert!(hf >= h0);
                prop_assert_eq!(map.try_guest_from_host(hf), Some(g));
            } else {
                // Only a slower guest clock can have its last preimage beyond u64::MAX.
                prop_assert!(map.ratio() < map.default_ratio());
                prop_assert!(ref_scaled(map, TWO_64) <= ref_s(map, g.0));
            }
        }
    }

    // ---- nested composition -------------------------------------------------------------

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
            KvmTscMapping::try_compose_nested(&KvmTscMapping::IDENTITY_VMX, &KvmTscMapping::IDENTITY_SVM),
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

    fn check_bound(l01: KvmTscMapping, l12: KvmTscMapping, h: u64) -> Option<(i64, NestedDeviation)> {
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
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            // xorshift64*: deterministic, seed printed on failure via the mapping values.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            state.wrapping_mul(0x2545_F491_4F6C_DD1D)
        };
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
            assert!(lo < 0 || hi > 0, "rounding never showed: the sweep is too weak");
        }
    }
}
