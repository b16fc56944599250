//! [`Timeline`]: a validated, borrowed slice of segments, and random access by binary search.

use super::error::TimelineError;
use super::segment::Segment;
use crate::units::{GuestTicks, HostTicks};

/// A validated, borrowed sequence of segments: strictly increasing guest starts, at least one.
///
/// It borrows rather than owns so that `core` needs no heap: the host keeps its segments in a
/// `Vec`, a guest in a fixed array or a [`super::TimelineBuf`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeline<'a> {
    pub(super) segments: &'a [Segment],
}

impl<'a> Timeline<'a> {
    /// Validates `segments` once (non-empty, starts strictly increasing), so that conversions
    /// need no further checks.
    ///
    /// # Errors
    ///
    /// [`TimelineError::Empty`] for an empty slice, [`TimelineError::NotIncreasing`] naming the
    /// first segment whose start is not above its predecessor's.
    pub fn new(segments: &'a [Segment]) -> Result<Self, TimelineError> {
        if segments.is_empty() {
            return Err(TimelineError::Empty);
        }
        if let Some(pos) = segments.windows(2).position(|w| w[0].start >= w[1].start) {
            return Err(TimelineError::NotIncreasing { index: pos + 1 });
        }
        Ok(Self { segments })
    }

    /// The segments, as validated.
    #[must_use]
    pub const fn segments(&self) -> &'a [Segment] {
        self.segments
    }

    /// Index of the segment that applies to `guest`: the last one starting at or before it, or
    /// 0 before the first start (which is extrapolated backwards).
    #[must_use]
    pub fn segment_index(&self, guest: GuestTicks) -> usize {
        self.segments
            .partition_point(|s| s.start <= guest.0)
            .saturating_sub(1)
    }

    /// Converts one guest tick by binary search over the segments, rounding down; `None` if the
    /// host value is below 0 or above `u64::MAX`.
    ///
    /// O(log n) per call. For a stream of timestamps use [`Timeline::cursor`].
    #[must_use]
    pub fn try_convert_floor(&self, guest: GuestTicks) -> Option<HostTicks> {
        self.segments
            .get(self.segment_index(guest))?
            .try_convert_floor(guest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offset(start: u64, host_minus_guest: i64) -> Segment {
        Segment::try_offset(GuestTicks(start), host_minus_guest).unwrap()
    }

    #[test]
    fn validation_errors() {
        assert_eq!(Timeline::new(&[]), Err(TimelineError::Empty));
        let dup = [offset(10, 0), offset(20, 0), offset(20, 5)];
        assert_eq!(
            Timeline::new(&dup),
            Err(TimelineError::NotIncreasing { index: 2 })
        );
        let unsorted = [offset(10, 0), offset(5, 0), offset(20, 0)];
        assert_eq!(
            Timeline::new(&unsorted),
            Err(TimelineError::NotIncreasing { index: 1 })
        );
        let ok = [offset(10, 0), offset(11, 0), offset(u64::MAX, 0)];
        assert_eq!(Timeline::new(&ok).map(|t| t.segments().len()), Ok(3));
        assert_eq!(Timeline::new(&ok[..1]).map(|t| t.segments().len()), Ok(1));
    }

    #[test]
    fn segment_starts_are_inclusive() {
        // Offsets +100 from 1000, +200 from 2000, +300 from 3000: a step at each start.
        let segs = [offset(1_000, 100), offset(2_000, 200), offset(3_000, 300)];
        let timeline = Timeline::new(&segs).unwrap();
        let cases = [
            (999, 0, 1_099),
            (1_000, 0, 1_100),
            (1_999, 0, 2_099),
            (2_000, 1, 2_200),
            (2_001, 1, 2_201),
            (2_999, 1, 3_199),
            (3_000, 2, 3_300),
            (u64::MAX - 300, 2, u64::MAX),
        ];
        let mut cursor = timeline.cursor();
        let mut batch: [u64; 8] = cases.map(|c| c.0);
        timeline.try_convert_slice_floor(&mut batch).unwrap();
        for (i, &(guest, index, host)) in cases.iter().enumerate() {
            let g = GuestTicks(guest);
            assert_eq!(timeline.segment_index(g), index, "guest {guest}");
            assert_eq!(
                timeline.try_convert_floor(g),
                Some(HostTicks(host)),
                "guest {guest}"
            );
            assert_eq!(
                cursor.try_convert_floor(g),
                Some(HostTicks(host)),
                "guest {guest}"
            );
            assert_eq!(batch[i], host, "guest {guest}");
        }
        assert_eq!(timeline.try_convert_floor(GuestTicks(u64::MAX - 299)), None);
    }

    #[test]
    fn before_first_segment_extrapolates_backwards() {
        // 1 + 1/2 host ticks per guest tick, anchored at guest 1000 → host 10_000.
        let segs = [
            Segment::try_from_anchor_ratio(
                GuestTicks(1_000),
                GuestTicks(1_000),
                HostTicks(10_000),
                3,
                2,
            )
            .unwrap(),
            offset(2_000, 0),
        ];
        let timeline = Timeline::new(&segs).unwrap();
        let at = |g| {
            timeline
                .try_convert_floor(GuestTicks(g))
                .map(HostTicks::get)
        };
        assert_eq!(at(1_000), Some(10_000));
        assert_eq!(at(999), Some(9_998)); // 9998.5
        assert_eq!(at(998), Some(9_997));
        assert_eq!(at(0), Some(8_500));
        assert_eq!(at(1_001), Some(10_001)); // 10001.5
        assert_eq!(at(1_999), Some(11_498)); // 11498.5
        assert_eq!(at(2_000), Some(2_000));
        // Extrapolating below host 0 is out of range.
        let late = [offset(1_000, -500)];
        let timeline = Timeline::new(&late).unwrap();
        assert_eq!(
            timeline.try_convert_floor(GuestTicks(500)),
            Some(HostTicks(0))
        );
        assert_eq!(timeline.try_convert_floor(GuestTicks(499)), None);
    }
}
