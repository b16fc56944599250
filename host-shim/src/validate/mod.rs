//! `vmtsync validate`: checks a sync file against the host's own record of the guest's I/O.
//!
//! Any guest's events recorded next to its own port I/O, as the user's rules say: `--before
//! ID:PORT` (event ID is recorded before the guest's next I/O on PORT, an `out` of its step
//! number's low byte) and `--after ID:PORT` (recorded after its previous I/O on PORT); the
//! agent's workload (`workload=RATE,COUNT,PORT`: `0x100` before its `out`, `0x101` after the
//! `in` that follows) is one instance ([`workload_rules`], `--port`). The host kernel stamps
//! the exits (`kvm:kvm_pio`, `x86-tsc`) before the VMM sees them, so the true host time of a
//! before-event lies before its `out`'s stamp, and that of an after-event after its exit's
//! stamp: a bracket from outside the sync code. `validate` converts each event's guest tick
//! with the sync file (the segment covering it, as `record` does), or takes the conversion
//! `record --format jsonl` wrote beside it when there is no sync file, and checks it lies in
//! its bracket; it also checks that the guaranteed interval meets the bracket (otherwise the
//! bound itself is false).
//! Details, and why the offset a sync file holds decides the merged order trace-cmd shows:
//! `docs/validate.md`.
//!
//! - [`check`]: pairing events with exits and the check, on decoded inputs.
//! - [`probes`]: the same for the probes of a probe log (`--probe-log`): each paired with its
//!   own exits by the live anchor's matcher, its guest TSC converted and checked.
//! - [`report`]: what the files share: the error, the report's parts, the lag arithmetic.
//! - [`input`]: the guest trace (our trace.dat), the probe log and the host trace
//!   (`trace-cmd extract`'s).

pub mod check;
pub mod input;
pub mod probes;
pub mod report;
#[cfg(test)]
pub(crate) mod testutil;

pub use check::{
    Conversion, EventRule, IoEvent, Numbering, PlacementName, REPORT_SCHEMA, Side, ValidateReport,
    Violation, Widths, check, check_placed,
};
pub use input::{ValidateOptions, validate, workload_rules};
pub use probes::ProbeChecker;
pub use report::{ExitCheck, LagStats, ProbeReport, ProbeViolation, SegmentWorst, ValidateError};
