//! Why a sync file could not be written, read or used.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

use super::SYNC_SCHEMA;

/// Why a sync file could not be written, read or used.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SyncFileError {
    /// Opening, reading or writing the file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A line is not a JSON object of the expected shape.
    #[error("sync file line {line}: {why}")]
    BadLine {
        /// Line number (from 1).
        line: u64,
        /// What is wrong.
        why: String,
    },
    /// The first line is not a header.
    #[error(
        "not a vmtsync sync file (the first line is not a {{\"type\":\"header\"}} object); write one with vmtsync probe --continuous --out FILE"
    )]
    NoHeader,
    /// The header has another schema version.
    #[error(
        "sync file schema {found} is not supported (this vmtsync reads schema {SYNC_SCHEMA}); use a matching vmtsync"
    )]
    Schema {
        /// The version found.
        found: u64,
    },
    /// A vCPU's segments do not start at increasing guest ticks.
    #[error(
        "sync file line {line}: vCPU {vcpu}'s segment does not start after the previous one (the guest TSC went backwards: a reboot?); split the file at that line"
    )]
    NotIncreasing {
        /// Line number.
        line: u64,
        /// The vCPU.
        vcpu: u32,
    },
    /// No segment for the requested vCPU.
    #[error("the sync file has no segment for vCPU {vcpu} (vCPUs present: {present:?})")]
    NoSegments {
        /// The vCPU asked for.
        vcpu: u32,
        /// The vCPUs that have segments.
        present: Vec<u32>,
    },
    /// A conversion input line is not a decimal u64.
    #[error(
        "input line {line}: expected one decimal guest TSC value, found \"{shown}\" (use --skip-bad to skip such lines)"
    )]
    BadInput {
        /// Line number.
        line: u64,
        /// The line's start, escaped.
        shown: String,
    },
    /// A converted value is outside the host tick range.
    #[error("input line {line}: {value} maps outside the host TSC range")]
    OutOfRange {
        /// Line number.
        line: u64,
        /// The input value.
        value: u64,
    },
    /// Writing the conversion output failed.
    #[error("writing output: {0}")]
    Output(io::Error),
}

impl SyncFileError {
    /// True for a write to a closed pipe (`vmtsync convert --sync F | head`), which the CLI
    /// treats as success.
    #[must_use]
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, Self::Output(e) if e.kind() == io::ErrorKind::BrokenPipe)
    }
}
