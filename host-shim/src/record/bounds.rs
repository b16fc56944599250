//! Where a guest tick lies on the host timeline, with a guaranteed interval, from one sync
//! segment.
//!
//! A segment says: at host tick `host_anchor` the offset (guest − host) was in
//! `[offset_lo, offset_hi]`, and — once more than one round has been seen — the guest's rate
//! relative to the host's is `1 + r / 1e9` with `r` in `[drift_ppb_lo, drift_ppb_hi]`. For an
//! offset `o` at the anchor and a rate `r`, guest tick `g` is host tick
//! `h = host_anchor + (g − host_anchor − o) · 1e9 / (1e9 + r)`. That is monotone in `o` and in
//! `r` (for a fixed sign of `g − host_anchor − o`), so over the box of feasible `(o, r)` its
//! extremes are at the box's corners: the interval is the floor of the smallest corner and the
//! ceiling of the largest. The true relation lies in the box, so the interval holds the truth.
//!
//! Segments written by this crate always carry drift bounds: the hull's, or, while the samples
//! do not bound the rate yet, the session's rate limits (1/2 to 2), so an event far from a
//! young segment's anchor gets a wide but true interval. A segment without drift bounds (an
//! old sync file) is a constant-offset model: the rate is taken as exactly `drift_ppb`, and the
//! interval is as good as that assumption.

use crate::syncfile::SyncSegment;

const PPB: i128 = 1_000_000_000;

/// The segment of `segments` (one vCPU's, in guest order) that covers guest tick `g`: the
/// last one whose `guest_start` is at or before it, else the first (extrapolated backwards),
/// the rule a sync file's conversion follows.
#[must_use]
pub fn covering(segments: &[SyncSegment], g: u64) -> Option<&SyncSegment> {
    let i = segments.partition_point(|s| s.guest_start <= g);
    segments.get(i.saturating_sub(1))
}

/// Guest tick `guest` on the host timeline through `seg`: the converted value (with the
/// segment's central offset and the rate it uses) and the guaranteed interval `[lo, hi]`.
/// `None` if a value leaves `u64` or a rate bound is not above −1e9 ppb.
#[must_use]
pub fn host_bounds(seg: &SyncSegment, guest: u64) -> Option<(u64, u64, u64)> {
    let rates: &[i64] = match (seg.drift_ppb_lo, seg.drift_ppb_hi) {
        (Some(lo), Some(hi)) if lo <= hi => &[lo, hi],
        _ => std::slice::from_ref(&seg.drift_ppb),
    };
    let mut lo = i128::MAX;
    let mut hi = i128::MIN;
    for &o in &[seg.offset_lo, seg.offset_hi] {
        for &r in rates {
            let (f, c) = corner(seg.host_anchor, guest, o, r)?;
            lo = lo.min(f);
            hi = hi.max(c);
        }
    }
    let (center, _) = corner(seg.host_anchor, guest, seg.offset, seg.drift_ppb)?;
    let to_u64 = |v: i128| u64::try_from(v).ok();
    Some((to_u64(center)?, to_u64(lo)?, to_u64(hi)?))
}

/// `host_anchor + (guest − host_anchor − offset) · 1e9 / (1e9 + rate)`, floored and ceiled.
fn corner(host_anchor: u64, guest: u64, offset: i64, rate: i64) -> Option<(i128, i128)> {
    let den = PPB + i128::from(rate);
    if den <= 0 {
        return None;
    }
    let num =
        (i128::from(guest) - i128::from(host_anchor) - i128::from(offset)).checked_mul(PPB)?;
    let floor = num.div_euclid(den);
    let ceil = floor + i128::from(num.rem_euclid(den) != 0);
    let base = i128::from(host_anchor);
    Some((base + floor, base + ceil))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::report::OffsetModel;
    use proptest::prelude::*;

    fn seg(anchor: u64, o: (i64, i64, i64), drift: Option<(i64, i64)>) -> SyncSegment {
        SyncSegment {
            vcpu: 0,
            round: 0,
            guest_start: 0,
            host_anchor: anchor,
            guest_anchor: anchor.checked_add_signed(o.1).unwrap(),
            offset: o.1,
            offset_lo: o.0,
            offset_hi: o.2,
            drift_ppb: drift.map_or(0, |(lo, hi)| 0_i64.clamp(lo, hi)),
            drift_ppb_lo: drift.map(|d| d.0),
            drift_ppb_hi: drift.map(|d| d.1),
            model: if drift.is_some() {
                OffsetModel::Drift
            } else {
                OffsetModel::Offset
            },
            probes: 1,
            rtt_min_ticks: 1,
            host_first: anchor,
            host_last: anchor,
            is_break: false,
            anchor: crate::probe::anchor::AnchorKind::InProcess,
        }
    }

    #[test]
    fn an_exact_offset_converts_exactly() {
        let s = seg(1_000_000, (-500, -500, -500), None);
        assert_eq!(
            host_bounds(&s, 2_000_000),
            Some((2_000_500, 2_000_500, 2_000_500))
        );
    }

    #[test]
    fn offset_bounds_become_host_bounds_with_the_sign_flipped() {
        // offset in [-10, 30]: host = guest - offset in [guest - 30, guest + 10].
        let s = seg(1_000_000, (-10, 10, 30), None);
        assert_eq!(
            host_bounds(&s, 5_000_000),
            Some((4_999_990, 4_999_970, 5_000_010))
        );
    }

    #[test]
    fn out_of_range_is_none() {
        let s = seg(10, (100, 100, 100), None);
        assert_eq!(host_bounds(&s, 5), None);
        let s = seg(10, (0, 0, 0), Some((-2_000_000_000, 0)));
        assert_eq!(host_bounds(&s, 5), None);
    }

    proptest! {
        /// A true relation (offset at the anchor, rate) anywhere inside the segment's box: the
        /// interval holds the true host tick, and the centre lies inside the interval.
        #[test]
        fn the_interval_holds_the_truth(
            anchor in 1u64 << 40..1u64 << 50,
            o_lo in -1_000_000i64..1_000_000, o_w in 0i64..100_000, o_pick: u64,
            r_lo in -100_000i64..100_000, r_w in 0i64..10_000, r_pick: u64,
            k in -300i64..300, j in 0i64..1_000_000_000,
        ) {
            let (o_hi, r_hi) = (o_lo + o_w, r_lo + r_w);
            let o = o_lo + i64::try_from(o_pick % u64::try_from(o_w + 1).unwrap()).unwrap();
            let r = r_lo + i64::try_from(r_pick % u64::try_from(r_w + 1).unwrap()).unwrap();
            let s = seg(anchor, (o_lo, o_lo + o_w / 2, o_hi), Some((r_lo, r_hi)));
            // The truth: host tick anchor + x has guest tick anchor + o + x·(1e9 + r)/1e9;
            // x = k·1e9 + j keeps the guest tick an integer (rounded down, as a TSC counts).
            let x = i128::from(k) * PPB + i128::from(j);
            let guest = i128::from(anchor) + i128::from(o) + (x * (PPB + i128::from(r))).div_euclid(PPB);
            let truth = i128::from(anchor) + x;
            let (c, lo, hi) = host_bounds(&s, u64::try_from(guest).unwrap()).unwrap();
            // The guest tick's host preimage is an interval of width < 1 tick around the truth:
            // allow the one tick of the guest counter's own rounding.
            prop_assert!(i128::from(lo) <= truth + 1 && truth - 1 <= i128::from(hi), "{lo} {truth} {hi}");
            prop_assert!(lo <= c && c <= hi);
        }
    }
}
