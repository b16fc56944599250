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
    /// skips (ratio above identity) rounds to the next host tick that reaches it. Note that a
    /// guest tick numerically below `offset` has a huge `s`: it lies 2^64 ticks later, as KVM's
    /// wrapping addition says. Identity ratios take a fast path without division.
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
        let ratio = u64::try_from((u128::from(l01.ratio) * u128::from(l12.ratio)) >> frac).ok()?;
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
