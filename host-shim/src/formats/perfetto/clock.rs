//! The host's TSC on CLOCK_BOOTTIME, Perfetto's default trace clock (docs/perfetto.md).
//!
//! A [`ClockSnapshot`] reads the TSC, CLOCK_BOOTTIME, and the TSC again, several times, and
//! keeps the try with the smallest TSC gap: the BOOTTIME reading happened at some TSC inside
//! that gap, so the snapshot pairs it with the gap's midpoint and its resolution is the gap.
//! A [`BootClock`] maps a host TSC to BOOTTIME through such snapshots: with the nearest snapshot
//! at or before it (the first one before that) and the rate between that snapshot and the next
//! one (the previous pair after the last). That is exact at every snapshot within its
//! resolution; between snapshots it assumes BOOTTIME ran at a constant rate against the TSC
//! (NTP slews it, within the kernel's 500 ppm, so dense snapshots keep that small); beyond the
//! last one it extrapolates the last rate.

use std::fmt;

use crate::kvm::hosttsc::read_host_tsc;

/// Tries per snapshot; the smallest gap wins. Each try is two `lfence; rdtsc` and one vDSO
/// `clock_gettime`, well under a microsecond.
const TRIES: u32 = 16;

/// One reading of the host TSC and CLOCK_BOOTTIME together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockSnapshot {
    /// The host TSC, the midpoint of the gap in which BOOTTIME was read.
    pub tsc: u64,
    /// CLOCK_BOOTTIME, ns.
    pub boottime_ns: u64,
    /// The gap (ticks) between the TSC reads around the BOOTTIME read: the reading happened at
    /// a TSC within `tsc ± resolution / 2`.
    pub resolution: u64,
}

impl ClockSnapshot {
    /// Takes a snapshot now (the best of several tries).
    ///
    /// # Errors
    /// `clock_gettime(CLOCK_BOOTTIME)` failed (not on Linux), or the TSC went backwards in
    /// every try.
    pub fn take() -> Result<Self, ClockError> {
        let mut best: Option<Self> = None;
        for _ in 0..TRIES {
            let before = read_host_tsc().0;
            let ts = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
            let after = read_host_tsc().0;
            let Some(gap) = after.checked_sub(before) else {
                continue;
            };
            let ns = u64::try_from(ts.tv_sec)
                .ok()
                .and_then(|s| s.checked_mul(1_000_000_000))
                .and_then(|s| s.checked_add(u64::try_from(ts.tv_nsec).ok()?))
                .ok_or(ClockError::BadReading)?;
            if best.is_none_or(|b| gap < b.resolution) {
                best = Some(Self {
                    tsc: before + gap / 2,
                    boottime_ns: ns,
                    resolution: gap,
                });
            }
        }
        best.ok_or(ClockError::BadReading)
    }
}

/// Why no BOOTTIME mapping is available.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClockError {
    /// The clock reading made no sense (a TSC that went backwards in every try, a negative
    /// BOOTTIME).
    #[error("the host clocks gave no usable TSC/BOOTTIME reading")]
    BadReading,
    /// Fewer than two snapshots with distinct TSCs: no rate.
    #[error("at least two clock snapshots at different TSCs are needed to map TSC to BOOTTIME")]
    TooFew,
    /// Snapshots whose BOOTTIME goes backwards while the TSC goes forwards (or the reverse):
    /// they come from different boots or a broken clock.
    #[error(
        "clock snapshots are not monotonic (TSC {tsc_a} -> {tsc_b}, BOOTTIME {ns_a} -> {ns_b} ns): they do not come from one boot"
    )]
    NotMonotonic {
        /// The earlier snapshot's TSC.
        tsc_a: u64,
        /// The later snapshot's TSC.
        tsc_b: u64,
        /// The earlier snapshot's BOOTTIME.
        ns_a: u64,
        /// The later snapshot's BOOTTIME.
        ns_b: u64,
    },
}

/// Host TSC → CLOCK_BOOTTIME through snapshots (see the module docs).
#[derive(Clone, PartialEq, Eq)]
pub struct BootClock {
    /// Sorted by TSC, strictly increasing TSC, non-decreasing BOOTTIME, at least two.
    snaps: Vec<ClockSnapshot>,
    /// `pairs[i]` converts through `snaps[i]` and `snaps[i + 1]`.
    pairs: Vec<Pair>,
}

/// Which snapshot pair a [`BootClock`] used last, for the next conversion to try first
/// (`BootClock::boottime_ns_near`). Any value is safe: a wrong one costs a search.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairHint(usize);

/// One pair of neighbouring snapshots, with what every conversion through it needs computed
/// once (a conversion is then two multiplications, no division).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pair {
    /// The first snapshot's TSC and BOOTTIME.
    t0: u64,
    n0: u64,
    /// The second snapshot's TSC.
    t1: u64,
    /// The rate, ns per tick, as a 64.64 fixed-point number rounded down,
    /// `floor(span_ns · 2^64 / span_tsc)`, in its integer and fraction halves.
    rate_hi: u64,
    rate_lo: u64,
    /// [`BootClock::error_ns`] between the snapshots: the larger half-resolution of the two
    /// ends in ns at the pair's rate, rounded up, plus 1 ns of rounding.
    e_inside: u64,
    /// How fast the error grows beyond the snapshots, ns per tick, as a 64.64 fixed-point
    /// number rounded up: `ceil((ea + eb) · 2^64 / span_tsc)` (the sum of the two
    /// half-resolutions over the span), so the growth is a multiplication, not a 128-bit
    /// division per conversion (`export perfetto` maps every event beyond its snapshots).
    growth: u128,
}

impl Pair {
    fn new(a: &ClockSnapshot, b: &ClockSnapshot) -> Self {
        let span_tsc = u128::from(b.tsc - a.tsc);
        let span_ns = u128::from(b.boottime_ns - a.boottime_ns);
        // span_ns < 2^64, so span_ns · 2^64 < 2^128; and span_tsc ≥ 1.
        let rate = (span_ns << 64) / span_tsc;
        let half = |r: u64| (u128::from(r) * span_ns).div_ceil(2 * span_tsc);
        let (ea, eb) = (half(a.resolution), half(b.resolution));
        Self {
            t0: a.tsc,
            n0: a.boottime_ns,
            t1: b.tsc,
            rate_hi: u64::try_from(rate >> 64).unwrap_or(u64::MAX),
            rate_lo: u64::try_from(rate & u128::from(u64::MAX)).unwrap_or(0),
            e_inside: u64::try_from(ea.max(eb))
                .unwrap_or(u64::MAX)
                .saturating_add(1),
            // Past 2^64 ns of error the bound is meaningless anyway: it saturates.
            growth: u64::try_from(ea + eb)
                .ok()
                .map_or(u128::MAX, |e| (u128::from(e) << 64).div_ceil(span_tsc)),
        }
    }
}

impl fmt::Debug for BootClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BootClock")
            .field("snapshots", &self.snaps.len())
            .field("first", &self.snaps.first())
            .field("last", &self.snaps.last())
            .finish()
    }
}

impl BootClock {
    /// A mapping through `snaps` (any order; snapshots at an equal TSC keep the finer one).
    ///
    /// # Errors
    /// [`ClockError::TooFew`], [`ClockError::NotMonotonic`].
    pub fn new(mut snaps: Vec<ClockSnapshot>) -> Result<Self, ClockError> {
        snaps.sort_by_key(|s| (s.tsc, s.resolution));
        snaps.dedup_by_key(|s| s.tsc);
        if snaps.len() < 2 {
            return Err(ClockError::TooFew);
        }
        for w in snaps.windows(2) {
            if w[1].boottime_ns < w[0].boottime_ns {
                return Err(ClockError::NotMonotonic {
                    tsc_a: w[0].tsc,
                    tsc_b: w[1].tsc,
                    ns_a: w[0].boottime_ns,
                    ns_b: w[1].boottime_ns,
                });
            }
        }
        let pairs = snaps.windows(2).map(|w| Pair::new(&w[0], &w[1])).collect();
        Ok(Self { snaps, pairs })
    }

    /// Adds a snapshot taken after every one the clock holds (a writer streaming for a long
    /// time takes one now and then): the TSCs after it convert through it and the one before,
    /// as [`Self::new`] with all of them would. A snapshot not after the last one is refused.
    ///
    /// # Errors
    /// [`ClockError::NotMonotonic`] when its TSC or BOOTTIME is behind the last snapshot's.
    pub fn extend(&mut self, s: ClockSnapshot) -> Result<(), ClockError> {
        let last = *self.snaps.last().ok_or(ClockError::TooFew)?;
        if s.tsc <= last.tsc || s.boottime_ns < last.boottime_ns {
            return Err(ClockError::NotMonotonic {
                tsc_a: last.tsc,
                tsc_b: s.tsc,
                ns_a: last.boottime_ns,
                ns_b: s.boottime_ns,
            });
        }
        self.pairs.push(Pair::new(&last, &s));
        self.snaps.push(s);
        Ok(())
    }

    /// The snapshots, sorted by TSC.
    #[must_use]
    pub fn snapshots(&self) -> &[ClockSnapshot] {
        &self.snaps
    }

    /// The pair whose rate converts `tsc`: the nearest snapshot at or before it and the next
    /// one (the first pair before the first snapshot, the last pair after the last).
    #[inline]
    fn pair(&self, tsc: u64) -> &Pair {
        self.pair_near(tsc, &mut PairHint::default())
    }

    /// [`Self::pair`], trying the pair `hint` names first and leaving it naming the pair used:
    /// events come roughly in time order, so a writer converting many of them through many
    /// snapshots (`record --format perfetto` takes one per sync round) finds each pair without
    /// a search.
    #[inline]
    fn pair_near(&self, tsc: u64, hint: &mut PairHint) -> &Pair {
        let last = self.pairs.len() - 1;
        if let Some(p) = self.pairs.get(hint.0) {
            // Pair k serves [t0, t1), the first one also everything before it and the last
            // one everything after it.
            if (tsc >= p.t0 || hint.0 == 0) && (tsc < p.t1 || hint.0 == last) {
                return p;
            }
        }
        let i = if tsc >= self.pairs[last].t0 {
            last
        } else {
            self.pairs
                .partition_point(|p| p.t0 <= tsc)
                .saturating_sub(1)
        };
        hint.0 = i;
        &self.pairs[i]
    }

    /// `tsc` on CLOCK_BOOTTIME, ns, rounded to the nearest ns; `None` outside the 64-bit
    /// range. The rate is a 64.64 fixed-point number rounded down, so the result is within
    /// 1 ns of the exactly rounded line (exact at the snapshots themselves).
    #[must_use]
    #[inline]
    pub fn boottime_ns(&self, tsc: u64) -> Option<u64> {
        self.pair(tsc).ns(tsc)
    }

    /// [`Self::boottime_ns`] starting from the pair `hint` remembers (the same result; only
    /// faster for TSCs near the previous one).
    #[must_use]
    #[inline]
    pub fn boottime_ns_near(&self, tsc: u64, hint: &mut PairHint) -> Option<u64> {
        self.pair_near(tsc, hint).ns(tsc)
    }

    /// [`Self::boottime_ns_near`] and [`Self::error_ns`] of `tsc` together, through one pair
    /// lookup: the per-event path of an exact recording, whose width-0 interval is the
    /// timestamp widened by the error on both sides, what [`Self::widened_ns`] gives it
    /// (tested), with one conversion instead of two.
    #[must_use]
    #[inline(always)]
    pub fn boottime_and_error_near(&self, tsc: u64, hint: &mut PairHint) -> Option<(u64, u64)> {
        let p = self.pair_near(tsc, hint);
        Some((p.ns(tsc)?, p.error_ns(tsc)))
    }

    /// How far (ns) a BOOTTIME from [`Self::boottime_ns`] can be from the reading a snapshot
    /// taken at `tsc` would have given, from the snapshots' resolutions alone: each end of the
    /// pair used is off by up to half its resolution, which moves the line by at most that at
    /// the ends and proportionally beyond them; plus 1 ns of rounding. It does not cover
    /// BOOTTIME's own rate changes between snapshots (see the module docs).
    #[must_use]
    pub fn error_ns(&self, tsc: u64) -> u64 {
        self.pair(tsc).error_ns(tsc)
    }

    /// The interval `[lo, hi]` of host TSCs on BOOTTIME, each end mapped and moved out by its
    /// [`Self::error_ns`], so it holds what BOOTTIME read over that interval; `None` when an
    /// end maps outside the 64-bit range.
    /// `hint` as for [`Self::boottime_ns_near`].
    #[must_use]
    #[inline]
    pub fn widened_ns(&self, lo: u64, hi: u64, hint: &mut PairHint) -> Option<(u64, u64)> {
        let a = self.pair_near(lo, hint);
        let b = self.pair_near(hi, hint);
        Some((
            a.ns(lo)?.saturating_sub(a.error_ns(lo)),
            b.ns(hi)?.saturating_add(b.error_ns(hi)),
        ))
    }
}

impl Pair {
    /// [`BootClock::boottime_ns`] through this pair.
    #[inline]
    fn ns(&self, tsc: u64) -> Option<u64> {
        // dt · rate >> 64, rounded: with rate = hi·2^64 + lo that is dt·hi + (dt·lo + 2^63)
        // >> 64, two 64×64-bit products (a 128×128-bit multiply with an overflow check is a
        // slow library call). dt·lo + 2^63 < 2^128 since dt, lo < 2^64.
        let (hi, lo) = (self.rate_hi, self.rate_lo);
        let scaled = |dt: u64| {
            let low = (u128::from(dt) * u128::from(lo) + (1 << 63)) >> 64;
            // A TSC faster than 1 GHz (every host's) has no integer part: one product, whose
            // rounded high half always fits (a branch that never changes).
            if hi == 0 {
                return u64::try_from(low).ok();
            }
            u64::try_from((u128::from(dt) * u128::from(hi)).checked_add(low)?).ok()
        };
        if tsc >= self.t0 {
            self.n0.checked_add(scaled(tsc - self.t0)?)
        } else {
            self.n0.checked_sub(scaled(self.t0 - tsc)?)
        }
    }

    /// [`BootClock::error_ns`] through this pair: a constant between its snapshots.
    #[inline]
    fn error_ns(&self, tsc: u64) -> u64 {
        // The line through two points each off by ≤ e: off by ≤ max(ea, eb) between them and
        // by ≤ max(ea, eb) + (ea + eb)·d/span at distance d beyond them (rounded up, and by
        // the rate rounded up at most 1 ns more).
        let beyond = self.t0.saturating_sub(tsc).max(tsc.saturating_sub(self.t1));
        if beyond == 0 {
            return self.e_inside;
        }
        self.e_inside.saturating_add(grow(self.growth, beyond))
    }
}

/// `ceil(d · growth / 2^64)`, saturating: at least `ceil(d · x)` for any `x ≤ growth / 2^64`,
/// and less than 1 more when `growth` is `x · 2^64` rounded up.
#[inline]
fn grow(growth: u128, d: u64) -> u64 {
    let (gh, gl) = (
        u64::try_from(growth >> 64).unwrap_or(u64::MAX),
        u64::try_from(growth & u128::from(u64::MAX)).unwrap_or(0),
    );
    let low = u128::from(d) * u128::from(gl);
    let up = u128::from(u64::try_from(low & u128::from(u64::MAX)).unwrap_or(0) != 0);
    // Under 1 ns of growth per tick (snapshots finer than their span: every real pair), one
    // product, whose rounded-up high half always fits (a branch that never changes).
    if gh == 0 {
        return u64::try_from((low >> 64) + up).unwrap_or(u64::MAX);
    }
    let total = (u128::from(d) * u128::from(gh))
        .saturating_add(low >> 64)
        .saturating_add(up);
    u64::try_from(total).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(tsc: u64, ns: u64) -> ClockSnapshot {
        ClockSnapshot {
            tsc,
            boottime_ns: ns,
            resolution: 0,
        }
    }

    #[test]
    fn a_clock_extended_snapshot_by_snapshot_converts_as_one_made_with_all_of_them() {
        let all = [
            ClockSnapshot {
                tsc: 1_000_000,
                boottime_ns: 5_000_000,
                resolution: 40,
            },
            ClockSnapshot {
                tsc: 3_100_000,
                boottime_ns: 6_000_000,
                resolution: 20,
            },
            ClockSnapshot {
                tsc: 5_200_007,
                boottime_ns: 7_000_001,
                resolution: 60,
            },
            ClockSnapshot {
                tsc: 9_400_000,
                boottime_ns: 9_000_100,
                resolution: 10,
            },
        ];
        let whole = BootClock::new(all.to_vec()).unwrap();
        let mut grown = BootClock::new(all[..2].to_vec()).unwrap();
        for s in &all[2..] {
            grown.extend(*s).unwrap();
        }
        assert_eq!(grown.snapshots(), whole.snapshots());
        for tsc in [
            0, 999_999, 1_000_000, 3_099_999, 3_100_000, 5_200_007, 9_399_999, 20_000_000,
        ] {
            assert_eq!(grown.boottime_ns(tsc), whole.boottime_ns(tsc), "{tsc}");
            assert_eq!(grown.error_ns(tsc), whole.error_ns(tsc), "{tsc}");
        }
        // Only forward: an earlier TSC, or BOOTTIME going back, is refused.
        assert!(grown.extend(snap(9_000_000, 9_500_000)).is_err());
        assert!(grown.extend(snap(9_500_000, 8_000_000)).is_err());
        assert_eq!(grown.snapshots().len(), 4);
    }

    #[test]
    fn snapshots_are_fresh_and_fine() {
        let a = ClockSnapshot::take().unwrap();
        let b = ClockSnapshot::take().unwrap();
        assert!(
            b.tsc >= a.tsc && b.boottime_ns >= a.boottime_ns,
            "{a:?} {b:?}"
        );
        #[cfg(target_arch = "x86_64")]
        assert!(a.tsc > 0);
    }

    #[test]
    fn maps_exactly_at_snapshots_and_linearly_between() {
        // 3 ticks per ns before 3000, then 2 per ns.
        let c = BootClock::new(vec![snap(3000, 2000), snap(0, 1000), snap(5000, 3000)]).unwrap();
        assert_eq!(c.boottime_ns(0), Some(1000));
        assert_eq!(c.boottime_ns(3000), Some(2000));
        assert_eq!(c.boottime_ns(5000), Some(3000));
        assert_eq!(c.boottime_ns(1500), Some(1500));
        // 1 tick = 1/3 ns: rounds to nearest.
        assert_eq!(c.boottime_ns(1), Some(1000));
        assert_eq!(c.boottime_ns(2), Some(1001));
        assert_eq!(c.boottime_ns(4000), Some(2500));
        // Beyond the ends: the nearest pair's rate.
        assert_eq!(c.boottime_ns(7000), Some(4000));
        let c = BootClock::new(vec![snap(3000, 2000), snap(6000, 3000)]).unwrap();
        assert_eq!(c.boottime_ns(0), Some(1000));
        assert_eq!(c.boottime_ns(u64::MAX).map(|_| ()), Some(()));
    }

    #[test]
    fn rejects_what_no_boot_gives() {
        assert_eq!(BootClock::new(vec![snap(1, 1)]), Err(ClockError::TooFew));
        assert_eq!(
            BootClock::new(vec![snap(1, 1), snap(1, 1)]),
            Err(ClockError::TooFew)
        );
        assert!(matches!(
            BootClock::new(vec![snap(1, 5), snap(2, 4)]),
            Err(ClockError::NotMonotonic { .. })
        ));
    }

    /// The width-0 shortcut gives what the general widening gives, inside, between, before
    /// and beyond the snapshots, whatever pair the hint held before.
    #[test]
    fn a_width_zero_interval_widens_as_the_general_rule_does() {
        let mut snaps = vec![snap(1_000_000, 5_000_000), snap(3_100_000, 6_000_000)];
        snaps.push(snap(5_200_007, 7_000_003));
        for (s, r) in snaps.iter_mut().zip([40, 20, 75]) {
            s.resolution = r;
        }
        let c = BootClock::new(snaps).unwrap();
        for tsc in [
            0,
            999_999,
            1_000_000,
            2_000_000,
            3_100_000,
            4_000_000,
            5_200_007,
            u64::MAX / 4,
        ] {
            for start in [0, 1] {
                let (mut h1, mut h2) = (PairHint(start), PairHint(start));
                let Some(ns) = c.boottime_ns_near(tsc, &mut h1) else {
                    continue;
                };
                let general = c.widened_ns(tsc, tsc, &mut h2).unwrap();
                let (ns2, e) = c
                    .boottime_and_error_near(tsc, &mut PairHint(start))
                    .unwrap();
                assert_eq!((ns2, e), (ns, c.error_ns(tsc)), "tsc {tsc}");
                assert_eq!(
                    (ns.saturating_sub(e), ns.saturating_add(e)),
                    general,
                    "tsc {tsc}"
                );
            }
        }
    }

    #[test]
    fn the_error_grows_with_distance_from_the_snapshots() {
        let mut a = snap(1_000_000, 1_000_000);
        let mut b = snap(2_000_000, 2_000_000);
        a.resolution = 100;
        b.resolution = 100;
        let c = BootClock::new(vec![a, b]).unwrap();
        assert_eq!(c.error_ns(1_500_000), 51);
        // 1 M ticks beyond the pair: 50 + (100 · 1 M / 1 M) + 1, plus the 1 ns that the growth
        // rate rounded up (100 / 1 M ns per tick is not a finite binary fraction) adds.
        assert_eq!(c.error_ns(3_000_000), 152);
        assert_eq!(c.error_ns(0), 152);
    }

    #[test]
    fn a_real_mapping_predicts_a_later_reading() {
        // Truth from outside the mapping: a snapshot taken after the two that built it, which
        // the extrapolation must meet within its error plus that snapshot's own resolution.
        let a = ClockSnapshot::take().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let b = ClockSnapshot::take().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let t = ClockSnapshot::take().unwrap();
        let c = BootClock::new(vec![a, b]).unwrap();
        let got = c.boottime_ns(t.tsc).unwrap();
        let err = c.error_ns(t.tsc) + t.resolution;
        assert!(
            got.abs_diff(t.boottime_ns) <= err,
            "mapped {got}, read {}, allowed {err}",
            t.boottime_ns
        );
    }

    proptest::proptest! {
        /// Whatever the hint, the pair found is the one the search finds.
        #[test]
        fn hints_find_the_searched_pair(
            gaps in proptest::collection::vec(1u64..1000, 1..12),
            tscs in proptest::collection::vec(0u64..15_000, 1..40),
            start in 0usize..20,
        ) {
            let mut t = 1000;
            let snaps: Vec<ClockSnapshot> = gaps
                .iter()
                .map(|g| {
                    t += g;
                    snap(t, t * 2)
                })
                .chain([snap(500, 1000)])
                .collect();
            let c = BootClock::new(snaps).unwrap();
            let mut hint = PairHint(start);
            for tsc in tscs {
                let searched = c.pairs.partition_point(|p| p.t0 <= tsc).saturating_sub(1);
                proptest::prop_assert_eq!(*c.pair_near(tsc, &mut hint), c.pairs[searched]);
                proptest::prop_assert_eq!(*c.pair(tsc), c.pairs[searched]);
            }
        }

        /// The growth beyond the snapshots by multiplication is the exact rounded-up quotient
        /// or 1 ns more: never less (the bound must hold), never much wider.
        #[test]
        fn growth_is_the_quotient_rounded_up_or_one_more(
            e in 0u64..1 << 40,
            span in 1u64..u64::MAX,
            d in 0u64..u64::MAX,
        ) {
            let growth = (u128::from(e) << 64).div_ceil(u128::from(span));
            let exact = (u128::from(e) * u128::from(d)).div_ceil(u128::from(span));
            let got = u128::from(grow(growth, d));
            if let Ok(x) = u64::try_from(exact) {
                proptest::prop_assert!(got == u128::from(x) || got == u128::from(x) + 1,
                    "{got} vs {exact}");
            } else {
                proptest::prop_assert_eq!(got, u128::from(u64::MAX));
            }
        }

        /// Against the exact rational line rounded to nearest (u128/i128 reference): within
        /// 1 ns, exact at the snapshots, for rates from 1/4 to 4 ns per tick.
        #[test]
        fn maps_within_a_ns_of_the_exact_line(
            t0 in 0u64..1 << 50,
            span in 1u64..1 << 40,
            rate_num in 1u64..16,
            ns0 in 0u64..1 << 50,
            back in 0u64..1 << 40,
            fwd in 0u64..1 << 44,
        ) {
            let span_ns = span * rate_num / 4;
            let c = BootClock::new(vec![snap(t0, ns0), snap(t0 + span, ns0 + span_ns)]).unwrap();
            for tsc in [t0.saturating_sub(back), t0, t0 + span, t0 + fwd] {
                let dt = i128::from(tsc) - i128::from(t0);
                let num = 2 * dt * i128::from(span_ns) + i128::from(span);
                let exact = i128::from(ns0) + num.div_euclid(2 * i128::from(span));
                let got = c.boottime_ns(tsc);
                if let Ok(e) = u64::try_from(exact) {
                    let g = i128::from(got.expect("in range"));
                    proptest::prop_assert!((g - i128::from(e)).abs() <= 1, "{tsc}: {g} vs {exact}");
                    if tsc == t0 || tsc == t0 + span {
                        proptest::prop_assert_eq!(g, exact);
                    }
                }
            }
        }
    }
}
