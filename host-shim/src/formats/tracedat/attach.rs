//! A guest trace.dat made by someone else (a Linux guest traced by trace-cmd with the `x86-tsc`
//! clock) copied with a TIME_SHIFT that puts its events on the host's timeline: the library
//! side of `vmtsync trace-cmd attach`.
//!
//! The rewrite is the one the host copy uses (`hostcopy::copy_with_options`): for v7 the file
//! is copied byte for byte and a new, uncompressed options section (TIME_SHIFT, and TRACEID if
//! the file has none) is appended and linked from the last DONE option, so compressed sections
//! are never decompressed or recompressed; for v6 the options are inserted before the options'
//! end marker and the data moves by whole pages. The samples and their worst-case error come
//! from [`timeshift::encode`] over each CPU's raw time range, read from the first and last
//! pages only ([`super::reader::cpu_time_ranges`]), so the cost is a file copy plus a few pages,
//! whatever the number of events. Details: `docs/attach.md`.

use std::path::{Path, PathBuf};

use super::consts::option;
use super::error::TraceDatError;
use super::hostcopy::{copy_with_options, put, random_id};
use super::reader::{Layout, MAX_CPUS};
use super::timeshift::{self, TimeShift};

/// What [`attach_time_shift`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachSummary {
    /// The output file.
    pub path: PathBuf,
    /// The input's file version.
    pub version: u32,
    /// The input's compression (`None`: uncompressed); compressed sections were copied as they
    /// are.
    pub compression: Option<String>,
    /// The guest file's TRACEID in the copy.
    pub guest_trace_id: u64,
    /// Whether a TRACEID option was added (the input had none).
    pub added_trace_id: bool,
    /// Per CPU: the worst-case error of trace-cmd's host time over the CPU's events, in ticks.
    pub max_error: Vec<u64>,
    /// Per CPU: the number of TIME_SHIFT samples written.
    pub samples: Vec<usize>,
    /// Length of the copy.
    pub bytes: u64,
}

/// The CPUs a trace's TIME_SHIFT must cover: one more than the highest CPU number any buffer
/// has a table entry for (trace-cmd leaves CPUs at or above the TIME_SHIFT's count uncorrected),
/// and at least as many as `ranges` (from [`super::reader::cpu_time_ranges`]).
#[must_use]
pub fn trace_cpus(layout: &Layout, ranges: &[Option<(u64, u64)>]) -> usize {
    layout
        .buffers
        .iter()
        .flat_map(|b| b.cpus.iter().map(|c| c.cpu as usize + 1))
        .filter(|&n| n <= MAX_CPUS)
        .max()
        .unwrap_or(1)
        .max(ranges.len())
        .max(1)
}

/// Copies the guest trace `input` to `output` with a TIME_SHIFT for `shift` (one segment list
/// per CPU of [`trace_cpus`]), refusing if trace-cmd's result could be off by more than `limit`
/// ticks for any event. `ranges` are the input's per-CPU raw time ranges.
///
/// # Errors
/// `TimeShift` (e.g. [`timeshift::TimeShiftError::AboveLimit`] with the figure) if the shift
/// cannot be written within `limit`; `Unsupported` if the input already has a TIME_SHIFT (two
/// would leave the result to trace-cmd's parsing order) or the output is the input; `Parse`
/// for a damaged input; `Verify`/`Io` if writing fails. The input is only read.
pub fn attach_time_shift(
    input: &Path,
    output: &Path,
    layout: &Layout,
    ranges: &[Option<(u64, u64)>],
    shift: &TimeShift,
    limit: u64,
) -> Result<AttachSummary, TraceDatError> {
    if layout.options_with(option::TIME_SHIFT).next().is_some() {
        return Err(TraceDatError::Unsupported {
            path: input.to_path_buf(),
            reason: "the trace already has a TIME_SHIFT option (from trace-cmd's own guest sync?): attach to the trace without it".into(),
        });
    }
    let cpus = trace_cpus(layout, ranges);
    let mut ranges = ranges.to_vec();
    ranges.resize(cpus, None);
    let (body, max_error) = timeshift::encode(shift, &ranges, limit)?;
    let existing = layout.trace_id();
    let guest_trace_id = existing.unwrap_or_else(random_id);
    let mut opts = Vec::new();
    if existing.is_none() {
        put(&mut opts, option::TRACEID, &guest_trace_id.to_le_bytes());
    }
    put(&mut opts, option::TIME_SHIFT, &body);
    let bytes = copy_with_options(input, output, layout, &opts, |path, l| {
        let bad = |reason: &str| TraceDatError::Verify {
            path: path.to_path_buf(),
            reason: reason.into(),
        };
        if l.trace_id() != Some(guest_trace_id) {
            return Err(bad("TRACEID does not read back"));
        }
        if l.options_with(option::TIME_SHIFT).last().map(|o| &o.data) != Some(&body) {
            return Err(bad("TIME_SHIFT does not read back"));
        }
        Ok(())
    })?;
    // What `timeshift::encode` writes per CPU: one sample per segment, and in step mode the
    // sentinel after the last.
    let sentinel = usize::from(shift.mode == timeshift::ShiftMode::Step);
    let samples = shift.cpus.iter().map(|c| c.len() + sentinel).collect();
    Ok(AttachSummary {
        path: output.to_path_buf(),
        version: layout.version,
        compression: layout.compression.clone(),
        guest_trace_id,
        added_trace_id: existing.is_none(),
        max_error,
        samples,
        bytes,
    })
}

#[cfg(test)]
mod tests;
