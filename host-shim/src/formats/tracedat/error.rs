//! The module's errors.

use std::path::PathBuf;

use super::timeshift::TimeShiftError;

/// Why writing, reading or copying a trace.dat failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceDatError {
    /// A file operation failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done ("create", "write", "read", "rename"…).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// An event names a CPU the writer was not created with.
    #[error(
        "event for CPU {cpu} but the trace has {cpus} CPUs: create the writer with one CPU per vCPU"
    )]
    CpuOutOfRange {
        /// The event's CPU.
        cpu: u32,
        /// The writer's CPU count.
        cpus: u32,
    },
    /// A payload longer than an event holds.
    #[error("event payload of {len} bytes, at most {max} fit: split it")]
    PayloadTooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Timestamps went backwards on a CPU. The writer refuses rather than reorder or clamp:
    /// a ring buffer page only stores forward deltas.
    #[error(
        "CPU {cpu}: timestamp {ts} is before the previous event's {last}: events must be pushed in non-decreasing time order per CPU (sort them first)"
    )]
    NotMonotonic {
        /// The CPU.
        cpu: u32,
        /// The offending timestamp.
        ts: u64,
        /// The previous event's timestamp on that CPU.
        last: u64,
    },
    /// The writer was created with no CPU.
    #[error("a trace needs at least one CPU")]
    NoCpus,
    /// The TIME_SHIFT cannot be written correctly.
    #[error(transparent)]
    TimeShift(#[from] TimeShiftError),
    /// The file is not a trace.dat we can read, or is damaged or truncated.
    #[error("{}: byte {offset}: {reason}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// Where parsing failed (for a truncated file: the first byte that is missing or the
        /// field that points past the end).
        offset: u64,
        /// What was expected there.
        reason: String,
    },
    /// The file is valid but uses something this module does not handle.
    #[error("{}: {reason}", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What, and what to do instead.
        reason: String,
    },
    /// A file we wrote did not read back as written.
    #[error("{}: written file does not verify: {reason}", path.display())]
    Verify {
        /// The file.
        path: PathBuf,
        /// The mismatch.
        reason: String,
    },
}

impl TraceDatError {
    /// A `map_err` adapter; the path is copied only when an error happens.
    pub(super) fn io<'a>(
        what: &'static str,
        path: &'a std::path::Path,
    ) -> impl FnOnce(std::io::Error) -> Self + 'a {
        move |source| Self::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }
}
