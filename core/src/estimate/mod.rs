//! Offset and drift estimators over probe samples, with guaranteed bounds.
//!
//! A [`ProbeSample`] brackets one guest TSC reading between two host TSC readings. Three
//! estimators consume the same samples so they can be compared honestly:
//!
//! - [`trace_cmd_fastest`]: trace-cmd's default PTP estimator, the midpoint offset of the
//!   fastest round trip. No error bound; biased by that probe's path asymmetry.
//! - [`trace_cmd_histogram`]: trace-cmd's histogram variant (modal bin of `|offset|`), without
//!   its division by zero.
//! - Ours: [`OffsetInterval`] (constant offset) intersects the interval each probe proves,
//!   `[guest - host_recv, guest - host_send]`; [`DriftEstimator`] (constant rate) keeps the
//!   two convex hulls that bound every feasible line and derives exact rate and offset
//!   bounds. Both report the centre of what the samples prove, the bounds always contain the
//!   truth, and a contradiction is reported as [`EstimateError::SegmentBreak`].
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
pub use sample::{EstimateError, ProbeSample, Ratio};
pub use tracecmd::{
    TRACE_CMD_PTP_SYNC_LOOP, TraceCmdEstimate, trace_cmd_fastest, trace_cmd_histogram,
};
