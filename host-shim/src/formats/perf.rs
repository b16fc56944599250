//! perf's guest-to-host time mapping: a VM's KVM TSC mapping as `perf inject --guest-data`'s
//! offset and scale (`vmtsync export perf`), or why perf cannot take it.
//!
//! perf 6.1 (tools/perf/builtin-inject.c, `parse_guest_data` and
//! `guest_session__convert_time`) parses the offset with `strtoull` (a negative offset wraps
//! and still subtracts correctly) and the scale with `strtod`, and turns a guest TSC into a
//! host TSC with `tsc -= time_offset; tsc /= time_scale`: a wrapping u64 subtraction, then a
//! division in double precision truncated to u64. One offset and scale serve the whole guest.
//! KVM's relation per vCPU is `guest = offset + ((host * ratio) >> frac_bits)`. So perf is
//! exact when every vCPU (or the one chosen) has the same offset and `ratio` is an integer
//! multiple `k` of `2^frac_bits`, while `guest - offset` stays below 2^53 (a double holds
//! every integer up to there): then `host = (guest - offset) / k`. A fractional ratio has no
//! exact double-precision inverse of KVM's fixed-point product; the explanation gives the
//! error of the closest arguments at the current guest TSC. Details in `docs/perf.md`.

use vmtsync_core::mapping::KvmTscMapping;

/// What perf can do with a set of vCPU mappings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PerfMapping {
    /// Exact: `host = (guest - offset) / scale` for every vCPU, in perf's arithmetic, at
    /// every guest TSC whose `guest - offset` is below [`PERF_EXACT_LIMIT`].
    Exact {
        /// perf's `time_offset` (our sign: guest - host at the origin).
        offset: i64,
        /// perf's `time_scale` (1 for no TSC scaling).
        scale: u64,
        /// Set when a vCPU's `guest - offset` has already passed [`PERF_EXACT_LIMIT`]: what
        /// perf's double-precision division costs now.
        caveat: Option<String>,
    },
    /// perf cannot express it; why, and the error the closest perf arguments would make.
    Inexpressible(String),
}

/// perf divides `guest - offset` in double precision, which holds every integer below 2^53
/// exactly: below this, an integer scale gives the exact quotient.
pub const PERF_EXACT_LIMIT: u64 = 1 << 53;

/// perf's host TSC for `guest` with `offset` and `scale`, computed as perf 6.1 does
/// (`guest_session__convert_time`): wrapping u64 subtraction, then a double division
/// truncated to u64.
#[allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "this is perf's own double-precision arithmetic, reproduced to judge its error"
)]
fn perf_host(guest: u64, offset: i64, scale: f64) -> u64 {
    (guest.wrapping_sub(offset.cast_unsigned()) as f64 / scale) as u64
}

/// The closest double to `ratio / 2^frac_bits`, perf's scale for it.
#[allow(
    clippy::cast_precision_loss,
    reason = "perf's scale is a double; a ratio needing more than 53 bits is rounded as strtod would"
)]
fn perf_scale(ratio: u64, frac_bits: u32) -> f64 {
    ratio as f64 / (1u128 << frac_bits) as f64
}

/// The exact host TSC of `guest` under `m`: the first host tick at which the guest TSC has
/// reached it (`KvmTscMapping::try_host_from_guest_ceil`).
fn exact_host(m: &KvmTscMapping, guest: u64) -> Option<u64> {
    m.try_host_from_guest_ceil(vmtsync_core::GuestTicks(guest))
        .map(|h| h.0)
}

/// The largest error of perf's arithmetic with `offset` and `scale` against the exact
/// inverse over `maps`, at the guest TSC each vCPU reads at host tick `host_now`, with the
/// vCPU it occurs on; `None` when no vCPU's current guest TSC maps back to the host.
fn worst_error(
    maps: &[(u32, KvmTscMapping)],
    host_now: u64,
    offset: i64,
    scale: f64,
) -> Option<(u32, u64)> {
    let mut worst: Option<(u32, u64)> = None;
    for &(v, m) in maps {
        let Some(g) = m.try_guest_from_host(vmtsync_core::HostTicks(host_now)) else {
            continue;
        };
        if let Some(exact) = exact_host(&m, g.0) {
            let err = perf_host(g.0, offset, scale).abs_diff(exact);
            if worst.is_none_or(|(_, w)| err > w) {
                worst = Some((v, err));
            }
        }
    }
    worst
}

/// Decides what perf can do with `maps` (`(vCPU, mapping)`), judging errors at the guest TSC
/// each vCPU reads at host tick `host_now`.
#[must_use]
pub fn perf_mapping(maps: &[(u32, KvmTscMapping)], host_now: u64) -> PerfMapping {
    let Some(&(v0, m0)) = maps.first() else {
        return PerfMapping::Inexpressible("the VM has no vCPU".into());
    };
    let one = 1u128 << m0.frac_bits();
    let r = u128::from(m0.ratio());
    let integer = r % one == 0;
    let mut why = Vec::new();
    for &(v, m) in &maps[1..] {
        if m.offset() != m0.offset() || m.ratio() != m0.ratio() || m.frac_bits() != m0.frac_bits() {
            why.push(format!(
                "vcpu{v} (offset {}, ratio {}/2^{}) differs from vcpu{v0} (offset {}, ratio {}/2^{}): perf takes one offset and scale per guest",
                m.offset(),
                m.ratio(),
                m.frac_bits(),
                m0.offset(),
                m0.ratio(),
                m0.frac_bits()
            ));
        }
    }
    if !integer {
        why.push(format!(
            "the TSC scaling ratio {}/2^{} is not an integer: perf's double-precision division \
             cannot invert KVM's fixed-point product exactly",
            m0.ratio(),
            m0.frac_bits()
        ));
    }
    let scale = perf_scale(m0.ratio(), m0.frac_bits());
    if why.is_empty() {
        // An integer ratio: the scale is that integer (at least 1, below 2^64 / 2^frac_bits).
        let k = u64::try_from((r / one).max(1)).unwrap_or(u64::MAX);
        let caveat = maps
            .iter()
            .filter_map(|&(v, m)| {
                let g = m.try_guest_from_host(vmtsync_core::HostTicks(host_now))?;
                (g.0.wrapping_sub(m0.offset().cast_unsigned()) >= PERF_EXACT_LIMIT).then_some(v)
            })
            .next()
            .map(|v| {
                let err = worst_error(maps, host_now, m0.offset(), scale).map_or(0, |w| w.1);
                format!(
                    "vcpu{v}'s guest TSC minus the offset has passed 2^53, where perf's \
                     double-precision division stops being exact: it is off by {err} ticks now"
                )
            });
        return PerfMapping::Exact {
            offset: m0.offset(),
            scale: k,
            caveat,
        };
    }
    // The error of the closest arguments (vcpu0's offset, the ratio as a double) at each
    // vCPU's current guest TSC, against the exact inverse.
    let err = worst_error(maps, host_now, m0.offset(), scale).map_or_else(
        || "no vCPU's current guest TSC maps back to the host".to_owned(),
        |(v, e)| {
            format!(
                "with --guest-data=…,{},{scale} perf would be off by {e} ticks for vcpu{v} at its \
                 current guest TSC, and perf says nothing of the error at other times",
                m0.offset()
            )
        },
    );
    PerfMapping::Inexpressible(format!("{}; {err}", why.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(offset: i64, ratio: u64, frac: u32) -> KvmTscMapping {
        KvmTscMapping::try_new(offset, ratio, frac).unwrap()
    }

    #[test]
    fn identity_and_integer_scales_are_exact_in_perfs_arithmetic() {
        let id = m(-123_456_789, 1 << 48, 48);
        assert_eq!(
            perf_mapping(&[(0, id), (1, id)], 5_000_000_000),
            PerfMapping::Exact {
                offset: -123_456_789,
                scale: 1,
                caveat: None,
            }
        );
        // Twice the host rate: guest = offset + 2 host, so host = (guest - offset) / 2.
        let twice = m(1000, 2 << 32, 32);
        let PerfMapping::Exact {
            offset,
            scale,
            caveat: None,
        } = perf_mapping(&[(0, twice)], 1 << 40)
        else {
            panic!()
        };
        // Up to 2^52 host ticks the doubled guest TSC stays below 2^53: exact in doubles.
        for host in [0u64, 1, 12_345, 1 << 40, (1 << 52) - 1] {
            let g = twice
                .try_guest_from_host(vmtsync_core::HostTicks(host))
                .unwrap()
                .0;
            assert_eq!(perf_host(g, offset, perf_scale(2 << 32, 32)), host);
            assert_eq!(scale, 2);
        }
    }

    #[test]
    fn past_2_to_the_53_an_exact_mapping_carries_perfs_rounding_caveat() {
        let id = m(-123_456_789, 1 << 48, 48);
        let PerfMapping::Exact {
            caveat: Some(c), ..
        } = perf_mapping(&[(0, id)], (1 << 54) + 1)
        else {
            panic!()
        };
        // guest - offset = 2^54 + 1 is not a double (their spacing is 4 there): perf rounds it
        // to 2^54, one tick early.
        assert!(c.contains("2^53") && c.contains("off by 1 ticks"), "{c}");
    }

    #[test]
    fn a_fractional_ratio_or_differing_vcpus_are_explained_with_the_error() {
        // 1.25x (the intel fixture's ratio): perf's closest scale is the double 1.25. At host
        // 4e9 + 1 the guest reads off + 5e9 + 1; perf's (5e9 + 1) / 1.25 truncates to 4e9, one
        // tick before the host tick at which the guest TSC reached that value.
        let frac = m(-123_456_789, 351_843_720_888_320, 48);
        let PerfMapping::Inexpressible(why) = perf_mapping(&[(0, frac)], 4_000_000_001) else {
            panic!()
        };
        assert!(why.contains("not an integer"), "{why}");
        assert!(
            why.contains(",-123456789,1.25 perf would be off by 1 ticks"),
            "{why}"
        );
        let a = m(-5, 1 << 48, 48);
        let b = m(-7, 1 << 48, 48);
        let PerfMapping::Inexpressible(why) = perf_mapping(&[(0, a), (1, b)], 1 << 30) else {
            panic!()
        };
        assert!(
            why.contains("vcpu1") && why.contains(",-5,1 perf would be off by 2 ticks"),
            "{why}"
        );
    }
}
