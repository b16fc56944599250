//! One vCPU's sync segments on `vmtsync_core::timeline`: the slopes a trace.dat TIME_SHIFT
//! carries (`formats::tracedat::plan`, `vmtsync trace-cmd attach`). Placing a guest tick with
//! its guaranteed interval, `convert --sync` included, is the sync wing's
//! (`crate::sync::place`).

use vmtsync_core::timeline::{Segment, Timeline, TimelineError};
use vmtsync_core::{GuestTicks, HostTicks};

use super::SyncSegment;

/// One vCPU's segments, sorted by guest start: the piecewise guest→host mapping, converted
/// by `vmtsync_core::timeline` (floor; before the first segment, the first is extrapolated
/// backwards).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncTimeline {
    records: Vec<SyncSegment>,
    segments: Vec<Segment>,
}

impl SyncTimeline {
    /// Pairs the records with their core segments (built by [`super::SyncFile::timeline`], which
    /// validated them).
    pub(super) fn new(records: Vec<SyncSegment>, segments: Vec<Segment>) -> Self {
        Self { records, segments }
    }

    /// The sync file records, by increasing `guest_start`.
    #[must_use]
    pub fn records(&self) -> &[SyncSegment] {
        &self.records
    }

    /// The core timeline over these segments.
    ///
    /// # Errors
    /// Never for a `SyncTimeline` from [`super::SyncFile::timeline`], which already checked what
    /// `Timeline::new` checks (non-empty, strictly increasing starts).
    pub fn timeline(&self) -> Result<Timeline<'_>, TimelineError> {
        Timeline::new(&self.segments)
    }

    /// Converts one guest tick through the core timeline, rounding down; `None` outside the
    /// host range. For streams use the core timeline's cursor.
    #[must_use]
    pub fn try_host_from_guest_floor(&self, guest: GuestTicks) -> Option<HostTicks> {
        self.timeline().ok()?.try_convert_floor(guest)
    }
}

#[cfg(test)]
mod tests {
    use super::super::SyncFileError;
    use super::super::format::samples::{file, seg};
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn timeline_is_piecewise_and_validated() {
        let a = seg(0, 0, 1_000_000, 5_000_000, 0);
        let b = seg(0, 1, 2_000_000, 5_000_500, 0);
        let other = seg(4, 0, 1_500_000, 7, 0);
        let f = file(&[a, other, b]);
        let t = f.timeline(0).unwrap();
        assert_eq!(t.records(), [a, b]);
        // Exact inverse of a pure offset inside each segment, and before the first.
        for g in [a.guest_start - 77, a.guest_start, b.guest_start - 1] {
            assert_eq!(
                t.try_host_from_guest_floor(GuestTicks(g)),
                Some(HostTicks(g - 5_000_000))
            );
        }
        for g in [b.guest_start, b.guest_start + 10_000_000] {
            assert_eq!(
                t.try_host_from_guest_floor(GuestTicks(g)),
                Some(HostTicks(g - 5_000_500))
            );
        }
        // Below host tick 0 is None, not a wrapped value.
        assert_eq!(t.try_host_from_guest_floor(GuestTicks(5)), None);
        let err = f.timeline(9).unwrap_err();
        assert!(
            matches!(&err, SyncFileError::NoSegments { vcpu: 9, present } if present == &[0, 4]),
            "{err}"
        );
        let err = file(&[b, a]).timeline(0).unwrap_err();
        assert!(
            matches!(err, SyncFileError::NotIncreasing { line: 3, vcpu: 0 }),
            "{err}"
        );
    }

    proptest! {
        /// The core cursor equals random access for any order of queries, and every
        /// conversion equals a naive rational floor of the record's line (one tick low at most
        /// for a non-zero drift).
        #[test]
        fn cursor_matches_random_access_and_naive_floor(
            anchors in proptest::collection::vec((1u64 << 20..1u64 << 40, -1_000_000i64..1_000_000, -100_000i64..100_000), 1..8),
            queries in proptest::collection::vec(0u64..1u64 << 42, 1..64),
            sorted in any::<bool>(),
        ) {
            let mut hosts: Vec<_> = anchors.clone();
            hosts.sort_by_key(|a| a.0);
            hosts.dedup_by_key(|a| a.0);
            let segs: Vec<SyncSegment> = hosts
                .iter()
                .enumerate()
                .map(|(i, &(h, off, ppb))| {
                    let mut s = seg(0, i as u64, h << 1, off, ppb);
                    s.guest_start = (h << 1) + 5_000;
                    s
                })
                .collect();
            let f = file(&segs);
            let t = f.timeline(0).unwrap();
            let mut q = queries.clone();
            if sorted { q.sort_unstable(); }
            let core = t.timeline().unwrap();
            let mut c = core.cursor();
            for g in q {
                let want = t.try_host_from_guest_floor(GuestTicks(g));
                prop_assert_eq!(c.try_convert_floor(GuestTicks(g)), want);
                let idx = segs.iter().rposition(|s| s.guest_start <= g).unwrap_or(0);
                let s = &segs[idx];
                let num = (i128::from(g) - i128::from(s.guest_anchor)) * 1_000_000_000;
                let den = 1_000_000_000 + i128::from(s.drift_ppb);
                let naive = i128::from(s.host_anchor) + num.div_euclid(den);
                // Exact for a pure offset; the core slope may round one tick low otherwise.
                let tol = i128::from(s.drift_ppb != 0);
                match want {
                    Some(h) => prop_assert!(naive - tol <= i128::from(h.0) && i128::from(h.0) <= naive,
                        "got {} naive {} ppb {}", h.0, naive, s.drift_ppb),
                    None => prop_assert!(naive - tol < 0, "None but naive {}", naive),
                }
            }
        }
    }
}
