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
//! That line, computed exactly in `i128` (`corner`), is the crate's one rule for a segment's
//! line, and [`place`] its one rule for a point: `record` (both front ends), `validate` and
//! `convert --sync` place through them (docs/record.md, "Placing an event"). The core
//! timeline's slopes (`syncfile::SyncTimeline`) serve only trace.dat's TIME_SHIFT.
//!
//! Segments written by this crate always carry drift bounds: the hull's, or, while the samples
//! do not bound the rate yet, the session's rate limits (1/2 to 2), so an event far from a
//! young segment's anchor gets a wide but true interval. A segment without drift bounds (an
//! old sync file) is a constant-offset model: the rate is taken as exactly `drift_ppb`, and the
//! interval is as good as that assumption.
//!
//! # Two-sided placement
//!
//! One segment alone extrapolates: an event between two rounds gets the earlier round's box,
//! widened by its distance times that round's rate uncertainty, and an event before the first
//! round gets the session's rate limits. [`place`] intersects what every round since the last
//! break says instead: the epoch's newest drift bounds (the convex hull over all its rounds
//! proves them, and they only narrow as rounds are added, so they hold for the older rounds'
//! boxes too) applied to the box of the round before the event and to the box of the round
//! after it. Each of those boxes holds the true relation when the rate was constant since the
//! break, which is what the hull already rests on, so each interval holds the truth and so
//! does their intersection. A break ends the epoch: rounds after it say nothing about events
//! before it.

use crate::syncfile::SyncSegment;

/// How `vmtsync record` places an event (`--placement`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// The segment covering the event, with its own drift bounds (the placement before
    /// two-sided placement existed; kept so the two can be measured side by side).
    OneSided,
    /// The intersection of the round before and the round after, under the epoch's newest
    /// drift bounds ([`place`]).
    #[default]
    TwoSided,
}

/// An event on the host timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    /// The point estimate.
    pub host: u64,
    /// The guaranteed interval's lower end.
    pub lo: u64,
    /// Its upper end.
    pub hi: u64,
    /// The round of the segment that covers the event.
    pub round: u64,
}

/// Guest tick `g` through `segments` (one vCPU's, in guest order): one-sided through the
/// covering segment, or two-sided (see the module docs). Two-sided never gives a wider
/// interval than one-sided: it is intersected with it. The point estimate of an
/// identity-rate segment is its line at one offset for all its events (what a trace.dat
/// TIME_SHIFT applies: [`steady_offset`]) when that lies inside the interval; else the line through the anchors of the rounds around the
/// event, or, outside the epoch's rounds, the line from the nearest round's anchor at the
/// epoch's newest rate, when that lies inside; else the interval's midpoint (rounded down).
/// It always lies inside the interval. `None` without a segment or outside `u64`.
#[must_use]
pub fn place(segments: &[SyncSegment], g: u64, how: Placement) -> Option<Place> {
    let i = segments
        .partition_point(|s| s.guest_start <= g)
        .saturating_sub(1);
    let seg = segments.get(i)?;
    let (centre, lo, hi) = host_bounds(seg, g)?;
    let one = Place {
        host: centre,
        lo,
        hi,
        round: seg.round,
    };
    if how == Placement::OneSided {
        return Some(one);
    }
    // The epoch runs up to (not including) the next break.
    let end = segments[i + 1..]
        .iter()
        .position(|s| s.is_break)
        .map_or(segments.len(), |k| i + 1 + k);
    let newest = &segments[end - 1];
    let drift = match (
        seg.drift_ppb_lo,
        seg.drift_ppb_hi,
        newest.drift_ppb_lo,
        newest.drift_ppb_hi,
    ) {
        (Some(a), Some(b), Some(c), Some(d)) if a.max(c) <= b.min(d) => (a.max(c), b.min(d)),
        // An old file without drift bounds, or bounds that do not meet (they cannot when the
        // samples are sound): nothing better than one-sided is proven.
        _ => return Some(one),
    };
    let (mut lo, mut hi) = (one.lo, one.hi);
    for s in &segments[i..(i + 2).min(end)] {
        let narrowed = SyncSegment {
            drift_ppb_lo: Some(drift.0),
            drift_ppb_hi: Some(drift.1),
            ..*s
        };
        let Some((_, l, h)) = host_bounds(&narrowed, g) else {
            continue;
        };
        lo = lo.max(l);
        hi = hi.min(h);
    }
    if lo > hi {
        // Sound rounds always overlap at the truth; rounds that do not say something is
        // wrong with a bracket, and the wider one-sided answer is the honest one.
        return Some(one);
    }
    // Between two rounds of the epoch: the line through their anchors, which follows the rate
    // the rounds show rather than the worst case the interval allows. Outside them (before the
    // epoch's first round, after its last): the nearest round's anchor at the epoch's newest
    // rate, which every round since the break refines (two anchors alone would extrapolate
    // their own noise: two rounds 30 ms apart, each bracketed within ~100 µs, give a rate
    // thousands of ppm off).
    let inside = |p: &u64| (lo..=hi).contains(p);
    let between = i + 1 < end && g >= seg.guest_start;
    let line = if between {
        through_anchors(seg, &segments[i + 1], g)
    } else {
        corner(seg.host_anchor, g, seg.offset, newest.drift_ppb)
            .and_then(|(f, _)| u64::try_from(f).ok())
    };
    // At identity rate, one offset for the whole segment (what a trace.dat TIME_SHIFT
    // applies, one sample per segment): the segment's own, moved into the next round's box
    // when it lies outside it. Both boxes hold the true offset when the rate is 1, so their
    // overlap does, and the point lies inside the interval of every event the segment covers
    // whenever the epoch's drift bounds allow rate 1.
    let steady = (seg.drift_ppb == 0)
        .then(|| steady_offset(seg, segments[i + 1..end].first()))
        .and_then(|o| corner(seg.host_anchor, g, o, 0))
        .and_then(|(p, _)| u64::try_from(p).ok());
    let host = if let Some(p) = steady.filter(inside) {
        p
    } else if let Some(p) = line.filter(inside) {
        p
    } else {
        lo + (hi - lo) / 2
    };
    Some(Place {
        host,
        lo,
        hi,
        round: seg.round,
    })
}

/// The offset an identity-rate segment's points follow: its central offset, clamped into
/// the overlap of its box and the next round's (`next`, of the same epoch) when they overlap.
fn steady_offset(seg: &SyncSegment, next: Option<&SyncSegment>) -> i64 {
    let (mut lo, mut hi) = (seg.offset_lo, seg.offset_hi);
    if let Some(n) = next {
        lo = lo.max(n.offset_lo);
        hi = hi.min(n.offset_hi);
    }
    if lo <= hi {
        seg.offset.clamp(lo, hi)
    } else {
        seg.offset
    }
}

/// [`place`] through `segments`, its point the host tick of KVM's exact mappings `exact`
/// (width 0, a raw-TSC guest's, docs/record.md) whenever that lies inside the interval. With
/// no segment (no round ever covered the vCPU: a late attach read its beacons before the
/// trace could bracket them) the event is placed by `exact` alone, width 0 on the header's
/// word (`exact` is empty unless that is known).
#[must_use]
pub fn place_with_exact(
    segments: &[SyncSegment],
    exact: &[SyncSegment],
    g: u64,
    how: Placement,
) -> Option<Place> {
    if segments.is_empty() {
        return place(exact, g, Placement::OneSided);
    }
    let mut p = place(segments, g, how)?;
    if let Some(e) = place(exact, g, Placement::OneSided)
        && (p.lo..=p.hi).contains(&e.host)
    {
        p.host = e.host;
    }
    Some(p)
}

/// Guest tick `g` on the line through the anchors (host, guest) of rounds `a` and `b`, `None`
/// when they do not go forward in both clocks or the result leaves `u64`.
fn through_anchors(a: &SyncSegment, b: &SyncSegment, g: u64) -> Option<u64> {
    let (ha, ga) = (i128::from(a.host_anchor), i128::from(a.guest_anchor));
    let (hb, gb) = (i128::from(b.host_anchor), i128::from(b.guest_anchor));
    if hb <= ha || gb <= ga {
        return None;
    }
    let h = ha + (i128::from(g) - ga) * (hb - ha) / (gb - ga);
    u64::try_from(h).ok()
}

const PPB: i128 = 1_000_000_000;

/// The segment of `segments` (one vCPU's, in guest order) that covers guest tick `g`: the
/// last one whose `guest_start` is at or before it, else the first (extrapolated backwards),
/// the rule a sync file's conversion follows.
#[must_use]
#[inline]
pub fn covering(segments: &[SyncSegment], g: u64) -> Option<&SyncSegment> {
    // Events come in time order: most fall in the latest segment.
    if let Some(last) = segments.last()
        && last.guest_start <= g
    {
        return Some(last);
    }
    let i = segments.partition_point(|s| s.guest_start <= g);
    segments.get(i.saturating_sub(1))
}

/// Guest tick `guest` on the host timeline through `seg`: the converted value (with the
/// segment's central offset and the rate it uses) and the guaranteed interval `[lo, hi]`,
/// clipped to the host's `u64` range (a host tick is one: the clipped interval still holds
/// the truth). `None` if the converted value leaves `u64` or a rate bound is not above
/// −1e9 ppb.
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
    let to_u64 = |v: i128| u64::try_from(v.clamp(0, i128::from(u64::MAX))).ok();
    Some((u64::try_from(center).ok()?, to_u64(lo)?, to_u64(hi)?))
}

/// `host_anchor + (guest − host_anchor − offset) · 1e9 / (1e9 + rate)`, floored and ceiled.
fn corner(host_anchor: u64, guest: u64, offset: i64, rate: i64) -> Option<(i128, i128)> {
    if rate == 0 {
        // Identity rate: the quotient is exact (`· 1e9 / 1e9`), no division needed.
        let v = i128::from(guest) - i128::from(offset);
        return Some((v, v));
    }
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
    use crate::syncfile::OffsetModel;
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
            anchor: crate::syncfile::AnchorKind::InProcess,
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

    #[test]
    fn an_interval_past_host_tick_0_is_clipped_there() {
        // 900 guest ticks before the anchor at the rate limits: host ticks -820 to 555, the
        // point at identity rate 100. No host tick is below 0, so [0, 555] holds the truth.
        let s = seg(1_000, (-10, 0, 10), Some((-500_000_000, 1_000_000_000)));
        assert_eq!(host_bounds(&s, 100), Some((100, 0, 555)));
        assert_eq!(
            place(&[s], 100, Placement::TwoSided).map(|p| (p.host, p.lo, p.hi)),
            Some((100, 0, 555))
        );
    }

    /// Segments as `vmtsync record` makes them: `rounds` rounds of simulated probes through
    /// the real cumulative estimator and segment builder, the true clock stepping forward by
    /// `step` at the start of round `break_at` (a break). Returns the segments and, per
    /// round, the host tick its first probe left (a step happens exactly there).
    fn simulate(
        sim: &mut vmtsync_core::sim::Sim,
        probes: &[usize],
        gaps: &[u64],
        brk: Option<(usize, i64)>,
    ) -> (Vec<SyncSegment>, Vec<u64>) {
        use crate::sync::{Cumulative, Round};
        use vmtsync_core::estimate::ProbeSample;
        use vmtsync_core::sim::Delay;
        let mut c = Cumulative::new();
        let (mut segs, mut starts) = (Vec::new(), Vec::new());
        let within = sim.link.gap;
        for (round, (&n, &gap)) in probes.iter().zip(gaps).enumerate() {
            // The gap before the round's first probe is the time between rounds.
            sim.link.gap = Delay::Constant(gap);
            let mut samples: Vec<ProbeSample> = Vec::with_capacity(n);
            for k in 0..n {
                if k == 0 {
                    let start = sim.now().0 + gap;
                    starts.push(start);
                    if let Some((at, step)) = brk
                        && at == round
                    {
                        sim.clock.offset += step;
                    }
                }
                samples.push(sim.probe().unwrap());
                sim.link.gap = within;
            }
            let r = Round::from_samples(&samples).unwrap();
            let anchor = crate::syncfile::AnchorKind::InProcess;
            segs.push(c.add_round(&r, &samples, round as u64, anchor).unwrap());
        }
        (segs, starts)
    }

    #[derive(Clone, Copy, Debug)]
    enum Shape {
        TightAsymmetric,
        WideVarying,
        Exponential,
    }

    fn link(shape: Shape) -> vmtsync_core::sim::Link {
        use vmtsync_core::sim::{Delay, Link};
        match shape {
            Shape::TightAsymmetric => Link::tight_asymmetric(),
            // The in-process shape: long, varying legs of different lengths each way.
            Shape::WideVarying => Link {
                forward: Delay::Uniform {
                    min: 20_000,
                    max: 900_000,
                },
                backward: Delay::Uniform {
                    min: 1_000,
                    max: 3_000_000,
                },
                outlier_ppm: 0,
                outlier: Delay::Constant(0),
                gap: Delay::Uniform {
                    min: 10_000,
                    max: 2_000_000,
                },
            },
            Shape::Exponential => Link {
                forward: Delay::Exponential {
                    min: 50_000,
                    mean: 40_000,
                },
                backward: Delay::Exponential {
                    min: 2_000,
                    mean: 100_000,
                },
                outlier_ppm: 20_000,
                outlier: Delay::Uniform {
                    min: 1_000_000,
                    max: 20_000_000,
                },
                gap: Delay::Uniform {
                    min: 50_000,
                    max: 250_000,
                },
            },
        }
    }

    /// The true host tick of guest tick `g` lies within one tick of `h` (the guest counter's
    /// own rounding); `[lo, hi]` must hold it.
    fn holds(p: &Place, h: u64) -> bool {
        p.lo <= h + 1 && h <= p.hi + 1 && p.lo <= p.host && p.host <= p.hi
    }

    /// Events long before the first round, and between rounds, get the hull's drift bounds
    /// over every round instead of the session's rate limits or one round's.
    #[test]
    fn two_sided_placement_narrows_early_and_between_rounds_events() {
        use vmtsync_core::HostTicks;
        use vmtsync_core::sim::{GuestClock, Sim};
        let clock = GuestClock::with_drift_ppb(7_000_000_000, 100_000).unwrap();
        let mut sim = Sim::new(
            3,
            HostTicks(1 << 41),
            clock,
            link(Shape::TightAsymmetric),
            0,
        );
        let (segs, starts) = simulate(&mut sim, &[64, 64, 64, 64], &[1_000_000_000; 4], None);
        // One event 2e9 ticks before the first round, one halfway between rounds 1 and 2.
        for h in [starts[0] - 2_000_000_000, starts[1] + 500_000_000] {
            let g = clock.guest_at(HostTicks(h)).unwrap().0;
            let one = place(&segs, g, Placement::OneSided).unwrap();
            let two = place(&segs, g, Placement::TwoSided).unwrap();
            assert!(holds(&one, h) && holds(&two, h), "{one:?} {two:?} {h}");
            let widest_round = segs
                .iter()
                .map(|s| s.offset_hi.abs_diff(s.offset_lo))
                .max()
                .unwrap();
            assert!(
                two.hi - two.lo <= 3 * widest_round,
                "two-sided {} against rounds of {widest_round}",
                two.hi - two.lo
            );
            assert!(two.hi - two.lo < one.hi - one.lo, "{one:?} {two:?}");
        }
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

        /// Against a known truth (an offset, a rate up to ±200 ppm, delays asymmetric and
        /// varying, outliers, a forward step making a break): every event's two-sided and
        /// one-sided intervals hold the truth, and the two-sided one is never wider, for
        /// events before the first round, between rounds, after the last, and around breaks.
        #[test]
        fn two_sided_placement_holds_the_truth_and_is_never_wider(
            seed: u64,
            offset in -1_000_000_000_000i64..1_000_000_000_000,
            ppb in prop_oneof![Just(100_000i64), Just(0), Just(-100_000), -200_000i64..200_000],
            shape in prop_oneof![
                Just(Shape::TightAsymmetric), Just(Shape::WideVarying), Just(Shape::Exponential)
            ],
            probes in proptest::collection::vec(1usize..24, 1..6),
            gap in 1_000_000u64..3_000_000_000,
            brk in proptest::option::of((1usize..5, 1_000_000i64..10_000_000_000)),
            events in proptest::collection::vec((0u64..1_000_000, 0u64..1 << 20), 1..40),
        ) {
            use vmtsync_core::HostTicks;
            use vmtsync_core::sim::{GuestClock, Sim};
            let clock = GuestClock::with_drift_ppb(offset, ppb).unwrap();
            let start = 1u64 << 42;
            let mut sim = Sim::new(seed, HostTicks(start), clock, link(shape), 0);
            let gaps: Vec<u64> = (0..probes.len()).map(|i| gap / (1 + i as u64 % 3)).collect();
            let brk = brk.filter(|b| b.0 < probes.len());
            let (segs, starts) = simulate(&mut sim, &probes, &gaps, brk);
            // The bounds rest on a constant rate since the last break. A step the rounds do not
            // see as a break (small against the time between rounds, within the rate limits)
            // is, to the samples, a rate change the hull takes for drift: no placement from
            // samples alone can tell the two apart, so such cases are outside the claim.
            prop_assume!(brk.is_none_or(|(at, _)| segs[at].is_break));
            let end = sim.now().0;
            // The truth at host tick h: the clock before the step, or after it.
            let truth = |h: u64| {
                let mut c = clock;
                if let Some((at, step)) = brk && h >= starts[at] {
                    c.offset += step;
                }
                c.guest_at(HostTicks(h)).unwrap().0
            };
            let from = starts[0] - 3_000_000_000;
            let span = end + 1_000_000_000 - from;
            for (pick, jitter) in events {
                let h = from + span / 1_000_000 * pick + jitter % (span / 1_000_000 + 1);
                let g = truth(h);
                // No event between a step and the guest's reading in the first probe of the
                // round that sees it (its tick is past the step but below that round's first
                // reading): no round can say on which side of the step such an event lies.
                if let Some((at, _)) = brk && h >= starts[at]
                    && segs.get(at).is_none_or(|s| g < s.guest_start) {
                    continue;
                }
                let one = place(&segs, g, Placement::OneSided).unwrap();
                let two = place(&segs, g, Placement::TwoSided).unwrap();
                prop_assert!(holds(&one, h), "one-sided {one:?} truth {h}");
                prop_assert!(holds(&two, h), "two-sided {two:?} truth {h}");
                prop_assert!(one.lo <= two.lo && two.hi <= one.hi, "{one:?} {two:?}");
            }
        }
    }
}
