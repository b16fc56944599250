//! The formats wing: every trace format vmtsync writes or reads, and the one event vocabulary
//! they share.
//!
//! - [`event`]: [`ExportEvent`] (one guest event on the host timeline), [`Payload`],
//!   [`Bound`], [`InputKind`], [`ExportError`].
//! - [`jsonl`]: JSON Lines, `vmtsync record --format jsonl`: one [`jsonl::Line`] type that the
//!   recorder writes and the exporters read.
//! - [`tracedat`]: trace-cmd's trace.dat (v6/v7): streaming guest-event writer, TIME_SHIFT,
//!   strict reader, GUEST option on a host trace copy, and attach planning.
//! - [`source`]: [`open`], a recording (JSON Lines or our trace.dat) streamed as
//!   [`ExportEvent`]s in constant memory.
//! - [`ctf`]: Common Trace Format 1.8 (Trace Compass, babeltrace2).
//! - [`perfetto`]: a Perfetto protobuf trace on the host's CLOCK_BOOTTIME.
//! - [`perf`]: the guest-to-host mapping for `perf inject` of a guest `perf.data`.

pub mod ctf;
pub mod event;
pub mod jsonl;
pub mod perf;
pub mod perfetto;
pub mod source;
pub mod tracedat;

pub use event::{Bound, ExportError, ExportEvent, InputKind, MAX_PAYLOAD, Payload};
pub use source::{EventSource, open};
