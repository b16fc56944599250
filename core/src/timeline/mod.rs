//! Per-vCPU piecewise-linear guest→host conversion of trace timestamps.
//!
//! Sync results (an exact KVM relation, or an estimator's offset and drift re-measured every
//! few milliseconds) become [`Segment`]s; a [`Timeline`] is a caller-owned slice of them, sorted
//! by guest start. Segment `i` applies from its start (inclusive) up to segment `i + 1`'s start;
//! the last one applies to the end of time. Segments split at *breaks* (a migration, a re-sync
//! that moved the offset), so the mapping may jump there: a monotone guest stream stays monotone
//! inside a segment, not necessarily across a break.
//!
//! Two ways to convert, with identical results (a property test pins this):
//!
//! - random access, [`Timeline::try_convert_floor`]: a binary search per timestamp, which is
//!   what trace-cmd's reader does for every event (docs/trace-cmd.md);
//! - streaming, [`Cursor`]: remembers the current segment, so a non-decreasing stream costs
//!   amortized O(1) per timestamp (a jump over many segments gallops: O(log gap));
//!   [`Cursor::try_convert_slice_floor`] is the batch fast path (a range compare checked eight
//!   at a time, one 64×64→128 multiply and a few adds per timestamp, no shift for every slope
//!   of at least 1/4). A timestamp that goes backwards falls back to a binary search: slower,
//!   never wrong.
//!
//! `cargo bench -p vmtsync-core --bench timeline` (4096 segments, 1 Mi monotone events)
//! measures the batch path against the per-event binary search in the same run.
//!
//! Segments live in a caller-owned slice (a `Vec` on the host) or in a [`TimelineBuf`], a
//! fixed-capacity owner for heap-less callers.
//!
//! **Before the first segment** the first segment is extrapolated backwards (trace-cmd does the
//! same), so an event recorded just before the first sync still lands on the host timeline.
//!
//! **Rounding**: a linear segment's result is the floor of its exact rational line; see
//! [`Segment`] for the error against the true rate. A KVM segment's result is exactly
//! [`crate::mapping::KvmTscMapping::try_host_from_guest_ceil`], no error at all. **Overflow**: a result below 0 or above
//! `u64::MAX` is `None` (or a [`ConvertError`] naming the element, in the batch API); nothing
//! here panics or allocates, and there are no floats.

mod cursor;
mod error;
mod exact_inverse;
mod fast;
mod lookup;
mod owned;
mod segment;
mod slope;

pub use cursor::Cursor;
pub use error::{ConvertError, TimelineError};
pub use lookup::Timeline;
pub use owned::TimelineBuf;
pub use segment::Segment;
pub use slope::Slope;
