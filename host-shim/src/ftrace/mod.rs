//! Reading ftrace events: private tracefs instances, binary ring-buffer pages, and record
//! layouts from the kernel's own format descriptions (docs/ftrace.md).
//!
//! - [`instance`]: [`Instance`], the one private tracefs instance type (`x86-tsc` clock, event
//!   enables and filters of its own, removed on drop), and [`find_tracefs`].
//! - [`raw`]: [`RawPipes`], every CPU's `trace_pipe_raw`, read non-blocking and bounded, pages
//!   walked by the trace.dat page code.
//! - [`format`]: an event's `format` text (tracefs or a trace.dat's event-format section) and
//!   the typed `kvm:kvm_pio` record that exit anchoring and validation read.
//! - [`tsc_offset`]: `kvm:kvm_write_tsc_offset` for watch mode (text `trace_pipe`).

pub mod format;
pub mod instance;
pub mod raw;
pub mod tsc_offset;

pub use instance::{Instance, TRACEFS_CANDIDATES, TraceError, find_tracefs};
pub use raw::{DrainStats, RawPipes};
