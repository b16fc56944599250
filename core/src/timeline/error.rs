//! The timeline's errors: an invalid slice of segments, and a batch element out of range.

/// Why a slice of segments is not a timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum TimelineError {
    /// There are no segments, so no guest tick has a host tick.
    Empty,
    /// Segment `index` does not start strictly after segment `index - 1` (unsorted or overlapping).
    NotIncreasing {
        /// The first offending segment.
        index: usize,
    },
    /// A [`super::TimelineBuf`] already holds its `capacity` segments.
    Full {
        /// The buffer's fixed capacity.
        capacity: usize,
    },
}

impl core::fmt::Display for TimelineError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Empty => f.write_str("timeline has no segments"),
            Self::NotIncreasing { index } => write!(
                f,
                "segment {index} does not start after segment {}: sort the segments by guest start and drop duplicates",
                index.wrapping_sub(1)
            ),
            Self::Full { capacity } => write!(
                f,
                "timeline buffer holds its {capacity} segments: use a larger capacity"
            ),
        }
    }
}

impl core::error::Error for TimelineError {}

/// A timestamp in a batch had no host tick (the mapped value is below 0 or above `u64::MAX`).
///
/// Elements before `index` are converted, the element at `index` and those after it are left
/// as they were, so the caller can report or skip it and resume on the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub struct ConvertError {
    /// Position of the first timestamp that could not be converted.
    pub index: usize,
}

impl core::fmt::Display for ConvertError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "timestamp {} maps outside the host tick range",
            self.index
        )
    }
}

impl core::error::Error for ConvertError {}
