//! The KVM per-vCPU TSC relation and its exact inverse (nested composition is in `nested.rs`).
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
}

#[cfg(test)]
mod tests {
    // The naive references below work in i128/u128 and narrow only after range checks.
    #![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

    use super::*;
    use proptest::prelude::*;

    use super::super::test_support::*;

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
        assert_eq!(
            m(0, 3 << 47, 48).try_guest_from_host(HostTicks(3)),
            Some(GuestTicks(4))
        );
        // The scaled value overflows u64 for a ratio of 2 at the top of the host range.
        assert_eq!(
            m(0, 2 << 48, 48).try_guest_from_host(HostTicks(u64::MAX)),
            None
        );
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
        assert_eq!(
            half.try_host_from_guest_ceil(GuestTicks(10)),
            Some(HostTicks(20))
        );
        assert_eq!(
            half.try_host_from_guest_floor(GuestTicks(10)),
            Some(HostTicks(21))
        );
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
        assert_ne!(
            tc, host.0,
            "trace-cmd's 64-bit forward formula cannot invert"
        );
    }

    #[test]
    fn postcard_round_trip_and_checked_decode() {
        use postcard::experimental::max_size::MaxSize;
        let mut buf = [0u8; KvmTscMapping::POSTCARD_MAX_SIZE];
        assert_eq!(KvmTscMapping::POSTCARD_MAX_SIZE, 10 + 10 + 5);
        let extreme = m(i64::MIN, u64::MAX, 63);
        let used = postcard::to_slice(&extreme, &mut buf)
            .expect("fits max size")
            .len();
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
}
