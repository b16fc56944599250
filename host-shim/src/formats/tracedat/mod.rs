//! trace.dat (trace-cmd's file format, versions 6 and 7) for guest events: a streaming writer,
//! a strict reader, the TIME_SHIFT that puts guest events on the host timeline, and the GUEST
//! option added to a copy of a host trace.
//!
//! No Rust crate reads or writes trace.dat, so this is std plus `tempfile`. Every file is checked
//! against trace-cmd 3.1.6 itself in the tier-2 tests (`tests/tests/tier2/tracedat.rs`); the
//! format, the reader's traps and the choices made here are in `docs/trace-dat.md`.
//!
//! Layers:
//! - [`consts`], [`format`](mod@format): option ids, ring-buffer constants, the format texts
//!   (`header_page`, `header_event`, the `vmtsync:event` / `vmtsync:event_data` formats).
//! - `page`: one ring-buffer page being filled (deltas, time extends).
//! - [`writer`]: [`TraceDatWriter`], constant memory in the number of events.
//! - [`timeshift`]: our [`SyncSegment`]s → TIME_SHIFT samples in trace-cmd's sign convention,
//!   a model of trace-cmd's reader ([`timeshift::trace_cmd_host_time`]) and the worst-case
//!   error of its 64-bit arithmetic.
//! - [`reader`]: layout and events with the byte offset of the first damage or truncation.
//! - [`hostcopy`]: [`copy_host_trace`], a host trace.dat copied with GUEST (and TRACEID).
//! - [`attach`]: [`attach_time_shift`], someone else's guest trace.dat copied with a TIME_SHIFT;
//!   [`plan`](mod@plan): which samples, from a fixed mapping, each vCPU's or a sync file's.
//!
//! # Writing a guest trace
//!
//! ```no_run
//! use vmtsync::formats::tracedat::{ShiftMode, SyncSegment, TimeShift, TraceDatWriter, WriterOptions};
//! use vmtsync_core::HostTicks;
//!
//! # fn main() -> Result<(), vmtsync::formats::tracedat::TraceDatError> {
//! let mut w = TraceDatWriter::create("guest.dat".as_ref(), WriterOptions::new(2, 0x1234))?;
//! // (vCPU, raw guest TSC, event id, payload ≤ 16 bytes), non-decreasing TSC per vCPU.
//! w.push(0, 1_000_500, 7, &[])?;
//! w.push(1, 1_000_900, 8, &[0xde, 0xad])?;
//! // Our segments: from host tick `start` on, guest = host + offset (guest - host).
//! let shift = TimeShift {
//!     peer_trace_id: 0xabcd, // the host trace's TRACEID
//!     mode: ShiftMode::Step,
//!     cpus: vec![
//!         vec![SyncSegment::offset_only(HostTicks(1_000_000), 500)],
//!         vec![SyncSegment::offset_only(HostTicks(1_000_000), 500)],
//!     ],
//! };
//! // Check first if a segment has a non-identity rate: above 1 tick, pre-convert instead.
//! assert!(w.shift_error(&shift)?.iter().all(|&e| e <= 1));
//! let summary = w.finish(Some(&shift))?;
//! println!("{} events", summary.events.iter().sum::<u64>());
//! # Ok(()) }
//! ```
//!
//! Guarantees: memory does not grow with the number of events; an event the writer cannot
//! store correctly (backwards timestamp, oversized payload, unknown CPU) is refused with an
//! error, never written wrong; a TIME_SHIFT whose worst-case error exceeds
//! [`WriterOptions::max_shift_error`] is refused; the target path only ever holds a complete,
//! verified file; no file content makes the reader panic.

/// An event's `format` file as the kernel prints it: its name and ID, the common fields every
/// event this crate writes starts with and a blank line, the event's own fields (one `field:`
/// line per `(declaration, offset, size, signed)`), a blank line and its print format.
macro_rules! event_format {
    ($name:literal, $id:literal, [$($field:tt),* $(,)?], $print:literal) => {
        concat!(
            "name: ", $name, "\nID: ", $id, "\nformat:\n",
            event_format!(@fields
                ("unsigned short common_type", 0, 2, 0),
                ("unsigned char common_flags", 2, 1, 0),
                ("unsigned char common_preempt_count", 3, 1, 0),
                ("int common_pid", 4, 4, 1)
            ),
            "\n",
            event_format!(@fields $($field),*),
            "\nprint fmt: ", $print, "\n"
        )
    };
    (@fields $(($decl:literal, $offset:literal, $size:literal, $signed:literal)),*) => {
        concat!($("\tfield:", $decl, ";\toffset:", $offset, ";\tsize:", $size, ";\tsigned:", $signed, ";\n",)*)
    };
}

pub mod attach;
pub mod consts;
mod error;
pub mod format;
pub mod funcgraph;
pub mod hostcopy;
pub(crate) mod page;
pub mod plan;
pub mod reader;
#[cfg(test)]
mod testutil;
pub mod timeshift;
pub mod writer;

pub use attach::{AttachSummary, attach_time_shift, trace_cpus};
pub use consts::Tsc2Nsec;
pub use error::TraceDatError;
pub use funcgraph::SpanGraph;
pub use hostcopy::{GuestInfo, HostCopySummary, copy_host_trace, copy_host_trace_with};
pub use page::Padded;
pub use reader::{
    Event, EventFormat, Layout, cpu_time_ranges, for_each_record, read_event_formats, read_layout,
    verify_file,
};
pub use timeshift::{ShiftMode, SyncSegment, TimeShift, TimeShiftError};
pub use writer::{FileVersion, Summary, TraceDatWriter, WriterOptions};
