//! A fixed-capacity owner of segments, for callers without a heap (a guest agent or firmware
//! keeping the sync results of one trace session).
//!
//! [`super::Timeline`] only borrows, so `core` never allocates; this owner is the heap-less way
//! to build the slice incrementally, one sync result at a time, keeping the timeline invariant
//! (strictly increasing starts) on every push so that viewing it needs no re-validation.

use super::error::TimelineError;
use super::lookup::Timeline;
use super::segment::Segment;

/// Up to `N` segments in a `heapless::Vec`, always sorted by strictly increasing guest start.
#[derive(Clone, Debug, Default)]
pub struct TimelineBuf<const N: usize> {
    segments: heapless::Vec<Segment, N>,
}

impl<const N: usize> TimelineBuf<N> {
    /// An empty buffer.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            segments: heapless::Vec::new(),
        }
    }

    /// Appends `segment`, which must start after the last one (sync results arrive in guest
    /// time order; a break simply starts a new segment).
    ///
    /// # Errors
    ///
    /// [`TimelineError::NotIncreasing`] if `segment` does not start after the last segment,
    /// [`TimelineError::Full`] if `N` segments are held already; the buffer is unchanged.
    pub fn try_push(&mut self, segment: Segment) -> Result<(), TimelineError> {
        if let Some(last) = self.segments.last()
            && last.start >= segment.start
        {
            return Err(TimelineError::NotIncreasing {
                index: self.segments.len(),
            });
        }
        self.segments
            .push(segment)
            .map_err(|_| TimelineError::Full { capacity: N })
    }

    /// The segments held, in order.
    #[must_use]
    pub fn as_slice(&self) -> &[Segment] {
        &self.segments
    }

    /// Forgets every segment (for a new trace session).
    pub fn clear(&mut self) {
        self.segments.clear();
    }

    /// A timeline over the segments held; `None` while the buffer is empty.
    #[must_use]
    pub fn timeline(&self) -> Option<Timeline<'_>> {
        if self.segments.is_empty() {
            None
        } else {
            // try_push kept the starts strictly increasing: no re-validation needed.
            Some(Timeline {
                segments: &self.segments,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::{GuestTicks, HostTicks};

    #[test]
    fn push_keeps_the_timeline_invariant() {
        let mut buf = TimelineBuf::<2>::new();
        assert!(buf.timeline().is_none());
        buf.try_push(Segment::identity(GuestTicks(10))).unwrap();
        assert_eq!(
            buf.try_push(Segment::identity(GuestTicks(10))),
            Err(TimelineError::NotIncreasing { index: 1 })
        );
        buf.try_push(Segment::try_offset(GuestTicks(20), 5).unwrap())
            .unwrap();
        assert_eq!(
            buf.try_push(Segment::identity(GuestTicks(30))),
            Err(TimelineError::Full { capacity: 2 })
        );
        let timeline = buf.timeline().unwrap();
        assert_eq!(Timeline::new(buf.as_slice()), Ok(timeline));
        assert_eq!(
            timeline.try_convert_floor(GuestTicks(19)),
            Some(HostTicks(19))
        );
        assert_eq!(
            timeline.try_convert_floor(GuestTicks(20)),
            Some(HostTicks(25))
        );
        buf.clear();
        assert!(buf.as_slice().is_empty() && buf.timeline().is_none());
    }
}
