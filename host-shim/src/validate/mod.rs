//! `vmtsync validate`: checks a sync file against the host's own record of the guest's I/O.
//!
//! The agent's workload (`workload=RATE,COUNT,PORT`) records event `0x100` right before an
//! `out` of its sequence number's low byte to PORT, and event `0x101` right after the `in`
//! from PORT that follows. The host kernel stamps both exits (`kvm:kvm_pio`, `x86-tsc`) before
//! the VMM sees them, so the true host time of a before-event lies before its `out`'s stamp,
//! and that of an after-event after its `in`'s stamp: an exit bracket from outside the sync
//! code. `validate` converts each event's guest tick with the sync file (the segment covering
//! it, as `record` does) and checks it lies in its bracket; it also checks that the segment's
//! guaranteed interval meets the bracket (otherwise the sync file's bound itself is false).
//! Details, and why the offset a sync file holds decides the merged order trace-cmd shows:
//! `docs/validate.md`.
//!
//! - [`check`]: pairing events with exits and the check, on decoded inputs.
//! - [`probes`]: the same for the probes of a probe log (`--probe-log`): each paired with its
//!   own exits by the live anchor's matcher, its guest TSC converted and checked.
//! - [`input`]: the guest trace (our trace.dat), the probe log and the host trace
//!   (`trace-cmd extract`'s).

pub mod check;
pub mod input;
pub mod probes;

pub use check::{
    Conversion, EventRule, IoEvent, LagStats, Numbering, Recorded, SegmentWorst, Side,
    ValidateReport, Violation, check,
};
pub use input::{ValidateError, ValidateOptions, validate, workload_rules};
pub use probes::{ProbeChecker, ProbeReport, ProbeViolation};
