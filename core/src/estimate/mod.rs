//! Offset and drift estimators over probe samples, with guaranteed bounds.
//!
//! A [`ProbeSample`] brackets one guest TSC reading between two host TSC readings. Three
//! estimators consume the same samples so they can be compared honestly:
//!
//! - [`trace_cmd_fastest`]: trace-cmd's default PTP estimator, the midpoint offset of the
//!   fastest round trip. No error bound; biased by that probe's path asymmetry.
//! - [`trace_cmd_histogram`]: trace-cmd's histogram variant (modal bin of `|offset|`), without
//!   its division by zero.
//! - Ours: [`DriftEstimator`] (constant rate) keeps the two convex hulls that bound every
//!   feasible line and derives exact rate and offset bounds; with [`RateLimits`] (the rates
//!   assumed possible) its offset bounds exist from the first sample and hold for every
//!   constant rate within them: that is the guaranteed bound the host reports.
//!   [`OffsetInterval`] (constant offset) intersects the interval each probe proves,
//!   `[guest - host_recv, guest - host_send]`: tighter, but it contains the truth only if the
//!   guest's rate is exactly the host's; under drift it can miss before it becomes empty.
//!   Both report the centre of what the samples prove, round bounds outward, and report a
//!   contradiction as [`EstimateError::SegmentBreak`].
//!   [`DriftEstimator::central_offset_at_within`] is a point estimate inside the guaranteed
//!   bounds (the centre of the offsets that fit at the central feasible rate), not a bound.
//!
//! Sign convention everywhere: `offset = guest - host` (KVM's `tsc-offset`), an `i64`.
//! Everything is `no_std`, heap-free, float-free; products use `i128`.

mod hull;
mod interval;
mod sample;
mod tracecmd;

#[cfg(test)]
mod sim_tests;

pub use hull::{DriftEstimate, DriftEstimator, estimate_drift};
pub use interval::{OffsetEstimate, OffsetInterval, estimate_offset};
pub use sample::{EstimateError, ProbeSample, RateLimits, Ratio};
pub use tracecmd::{
    TRACE_CMD_PTP_SYNC_LOOP, TraceCmdEstimate, trace_cmd_fastest, trace_cmd_histogram,
};
