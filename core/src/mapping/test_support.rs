//! Shared pieces of the mapping tests: naive u128/i128 references and proptest strategies.

// The naive references work in i128/u128 and narrow only after range checks.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use proptest::prelude::*;

use super::{FRAC_BITS_SVM, FRAC_BITS_VMX, KvmTscMapping};

pub(super) const TWO_64: u128 = 1 << 64;
pub(super) const TWO_64_I: i128 = 1 << 64;

pub(super) fn m(offset: i64, ratio: u64, frac: u32) -> KvmTscMapping {
    KvmTscMapping::try_new(offset, ratio, frac).expect("valid test mapping")
}

/// `F(h) = floor(h * ratio / 2^frac)` over unbounded integers (h may be 2^64).
pub(super) fn ref_scaled(map: KvmTscMapping, h: u128) -> u128 {
    (h * u128::from(map.ratio())) >> map.frac_bits()
}

/// The forward relation, computed in i128 with an explicit Euclidean modulo.
pub(super) fn ref_forward(map: KvmTscMapping, h: u64) -> Option<u64> {
    let f = ref_scaled(map, u128::from(h));
    let f = i128::from(u64::try_from(f).ok()?);
    Some((i128::from(map.offset()) + f).rem_euclid(TWO_64_I) as u64)
}

/// `s = (guest - offset) mod 2^64`.
pub(super) fn ref_s(map: KvmTscMapping, g: u64) -> u128 {
    (i128::from(g) - i128::from(map.offset())).rem_euclid(TWO_64_I) as u128
}

/// The largest host tick whose scaled value still fits a `u64`.
pub(super) fn max_host(map: KvmTscMapping) -> u64 {
    let lim = ((TWO_64 << map.frac_bits()) - 1) / u128::from(map.ratio());
    u64::try_from(lim).unwrap_or(u64::MAX)
}

pub(super) fn frac() -> impl Strategy<Value = u32> {
    prop_oneof![Just(FRAC_BITS_SVM), Just(FRAC_BITS_VMX)]
}

/// Default, default ±10 %, tiny, huge, anything.
pub(super) fn ratio_for(frac: u32) -> impl Strategy<Value = u64> {
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
pub(super) fn ratio_at_least_identity(frac: u32) -> impl Strategy<Value = u64> {
    let d = 1u64 << frac;
    prop_oneof![
        2 => Just(d),
        5 => d..=(d + d / 10),
        1 => (u64::MAX - 1000)..=u64::MAX,
        1 => d..=u64::MAX,
    ]
}

pub(super) fn offset() -> impl Strategy<Value = i64> {
    prop_oneof![
        any::<i64>(),
        -(1i64 << 40)..(1i64 << 40),
        Just(i64::MIN),
        Just(i64::MAX),
        Just(0)
    ]
}

pub(super) fn mapping() -> impl Strategy<Value = KvmTscMapping> {
    frac()
        .prop_flat_map(|f| (offset(), ratio_for(f), Just(f)))
        .prop_map(|(o, r, f)| m(o, r, f))
}

pub(super) fn mapping_injective() -> impl Strategy<Value = KvmTscMapping> {
    frac()
        .prop_flat_map(|f| (offset(), ratio_at_least_identity(f), Just(f)))
        .prop_map(|(o, r, f)| m(o, r, f))
}

/// A host tick inside the forward map's domain, biased towards its two ends.
pub(super) fn host_in_domain(map: KvmTscMapping, pick: u64, which: u8) -> u64 {
    let top = max_host(map);
    match which % 8 {
        0 => 0,
        1 => top,
        2 => top.saturating_sub(pick % 1024),
        _ => (u128::from(pick) % (u128::from(top) + 1)) as u64,
    }
}
