//! Sync files: the append-only record of `vmtsync probe --continuous`, and the guest→host
//! conversion `vmtsync convert --sync FILE --vcpu N` does with it.
//!
//! # Format (schema 1)
//!
//! JSON Lines, UTF-8, one object per `\n`-terminated line; every object has a `"type"`.
//! The first line is the header, every later line a segment; lines of other types are
//! skipped (room for additions within schema 1), a different `schema` is refused.
//!
//! ```text
//! {"type":"header","schema":1,"tool":"vmtsync 0.1.0","host_clock":"x86-tsc","created_unix_s":1796000000,"source":"tcp:127.0.0.1:4444"}
//! {"type":"segment","vcpu":0,"round":0,"guest_start":…,"host_anchor":…,"guest_anchor":…,"offset":…,"offset_lo":…,"offset_hi":…,"drift_ppb":0,"drift_ppb_lo":null,"drift_ppb_hi":null,"model":"offset","probes":64,"rtt_min_ticks":…,"host_first":…,"host_last":…,"break":false}
//! ```
//!
//! A segment is one re-sync round of one vCPU. All ticks are TSC ticks, `offset = guest - host`:
//!
//! | key | meaning |
//! |---|---|
//! | `vcpu` | the vCPU the agent read |
//! | `round` | round number within the run that wrote it |
//! | `guest_start` | first guest tick this segment applies to (its first probe's reading); it applies up to the next segment of the same vCPU |
//! | `host_anchor`, `guest_anchor` | the point the segment's line passes through: `guest_anchor = host_anchor + offset` |
//! | `offset`, `offset_lo`, `offset_hi` | offset at `host_anchor`: centre and guaranteed bounds |
//! | `drift_ppb` | the rate used for conversion: the value in `[drift_ppb_lo, drift_ppb_hi]` closest to 0 (0 when unbounded), since KVM's default is identity rate and any value in the bounds fits every sample |
//! | `drift_ppb_lo`, `drift_ppb_hi` | guaranteed drift bounds over all rounds since the last break, or null |
//! | `model` | `"offset"` (constant offset fits) or `"drift"` (constant rate) |
//! | `probes`, `rtt_min_ticks` | samples of the round and its fastest round trip |
//! | `host_first`, `host_last` | host TSC span of the round |
//! | `break` | the offset or rate changed since the previous round (migration, reset): a new estimate starts here |
//!
//! Conversion inside a segment: `host = host_anchor + floor((guest - guest_anchor) · 1e9 /
//! (1e9 + drift_ppb))`: exact for a zero drift, at most one tick low otherwise (the core
//! timeline's slope rounding). Before the first segment the first one is extrapolated
//! backwards. The error is the segment's offset half-width plus the drift
//! uncertainty times the distance from the anchor.
//!
//! # Append-only, readable while written, and what a crash leaves
//!
//! Other output files are written whole to a temporary file beside the target and renamed
//! over it, so a reader sees the old file or the new one. A sync file cannot be: it is read
//! (by `convert --sync`, by a trace pipeline) while `probe --continuous` is still adding to it,
//! for as long as the VM runs, and rewriting it per round would copy the whole history every
//! few milliseconds. So it is append-only, with the reader doing its share:
//!
//! - A new file appears (a temporary file beside it, synced, then renamed into place without
//!   replacing anything) already holding its whole header line: no reader ever sees a file
//!   without a header.
//! - Each segment is one `write(2)` of a whole `\n`-terminated line. A line counts only once its
//!   `\n` is in the file: the reader accepts the complete lines and **cuts** whatever follows
//!   the last `\n` (a write in progress, or one torn by `kill -9`, a full disk or a file-size
//!   limit), reporting how many bytes it cut ([`SyncFile::cut`], [`CutTail`]). A cut line is
//!   never parsed, so a torn line that happens to be valid JSON is not misread either.
//! - A failed append is rolled back (the file is truncated to its length before the write), so
//!   a torn line is never followed by a complete one.
//! - A writer reopening a file keeps its header and first truncates a torn last line left by a
//!   crash ([`SyncWriter::cut_on_open`] says how much); readers never modify the file.
//!
//! Conversion runs on `vmtsync_core::timeline` ([`SyncTimeline`] builds its segments with
//! [`SyncSegment::to_timeline_segment`]).

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;
use vmtsync_core::timeline::Segment;
use vmtsync_core::{GuestTicks, HostTicks};

pub use crate::probe::report::OffsetModel;
pub use convert::{SyncConvertStats, SyncTimeline, convert_sync_file, convert_with_sync};

mod convert;

/// The sync file schema this crate writes and reads.
pub const SYNC_SCHEMA: u32 = 1;

/// The longest line accepted (sync file or conversion input).
const MAX_LINE: usize = 4096;

/// The first line of a sync file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncHeader {
    /// Always [`SYNC_SCHEMA`] for files this crate writes.
    pub schema: u32,
    /// The writer, e.g. `vmtsync 0.1.0`.
    pub tool: String,
    /// The host clock the `host_*` values are in (`x86-tsc`).
    pub host_clock: String,
    /// When the file was created (seconds since the Unix epoch).
    pub created_unix_s: u64,
    /// Where the samples came from (the `--connect` address).
    #[serde(default)]
    pub source: String,
}

/// One re-sync round of one vCPU (see the module docs for every field).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncSegment {
    /// The vCPU.
    pub vcpu: u32,
    /// Round number within the run.
    pub round: u64,
    /// First guest tick this segment applies to.
    pub guest_start: u64,
    /// Host tick of the anchor.
    pub host_anchor: u64,
    /// Guest tick of the anchor (`host_anchor + offset`).
    pub guest_anchor: u64,
    /// Offset at the anchor, centre of the bounds.
    pub offset: i64,
    /// Guaranteed lower bound of the offset at the anchor.
    pub offset_lo: i64,
    /// Guaranteed upper bound of the offset at the anchor.
    pub offset_hi: i64,
    /// The drift used for conversion, ppb.
    pub drift_ppb: i64,
    /// Guaranteed lower drift bound, ppb, if bounded.
    pub drift_ppb_lo: Option<i64>,
    /// Guaranteed upper drift bound, ppb, if bounded.
    pub drift_ppb_hi: Option<i64>,
    /// Which model the bounds come from.
    pub model: OffsetModel,
    /// Samples in the round.
    pub probes: u32,
    /// Fastest round trip of the round, host ticks.
    pub rtt_min_ticks: u64,
    /// Host TSC of the round's first send.
    pub host_first: u64,
    /// Host TSC of the round's last receive.
    pub host_last: u64,
    /// A new estimate starts here (the previous rounds' relation no longer fits).
    #[serde(rename = "break")]
    pub is_break: bool,
}

impl SyncSegment {
    /// This segment as a `vmtsync_core::timeline` segment: the line through
    /// `(guest_anchor, host_anchor)` with `1e9 / (1e9 + drift_ppb)` host ticks per guest tick,
    /// used from `guest_start` on. A zero drift is an exact offset; otherwise the slope is
    /// rounded down by less than 2^-62 relative ([`vmtsync_core::timeline::Slope::try_from_ratio_floor`]), so a
    /// result is at most one tick below the exact floor for host values below 2^62.
    ///
    /// `None` if the rate is not positive or `guest_start` maps outside the host range.
    #[must_use]
    pub fn to_timeline_segment(&self) -> Option<Segment> {
        let start = GuestTicks(self.guest_start);
        if self.drift_ppb == 0 {
            return Segment::try_offset(start, self.offset.checked_neg()?);
        }
        let den = u64::try_from(1_000_000_000_i64.checked_add(self.drift_ppb)?).ok()?;
        Segment::try_from_anchor_ratio(
            start,
            GuestTicks(self.guest_anchor),
            HostTicks(self.host_anchor),
            1_000_000_000,
            den,
        )
    }
}

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

/// The incomplete last line a reader cut off a sync file: everything after the last `\n`.
///
/// A writer appends each segment as one `\n`-terminated line, so this is a write in progress
/// (the file is being written) or one interrupted by a crash, `kill -9` or a full disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CutTail {
    /// Bytes after the last `\n` (more than zero).
    pub bytes: u64,
    /// The complete lines before them, header included; the cut line would have been line
    /// `complete_lines + 1`.
    pub complete_lines: u64,
}

impl std::fmt::Display for CutTail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cut an incomplete last line ({} bytes, 1 line) after line {}: a write in progress, or one interrupted by a crash",
            self.bytes, self.complete_lines
        )
    }
}

impl SyncFileError {
    /// True for a write to a closed pipe (`vmtsync convert --sync F | head`), which the CLI
    /// treats as success.
    #[must_use]
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, Self::Output(e) if e.kind() == io::ErrorKind::BrokenPipe)
    }
}

/// Appends segments to a sync file, one whole line per `write(2)`.
#[derive(Debug)]
pub struct SyncWriter {
    file: File,
    path: PathBuf,
    /// The file's length after the last complete line, where a failed append rolls back to.
    len: u64,
    /// What [`SyncWriter::open`] cut off an existing file.
    cut_on_open: Option<CutTail>,
}

impl SyncWriter {
    /// Opens `path` for appending: a new file is created holding `header` as its first line
    /// (through a rename, so readers never see it without the header), an empty one gets it
    /// written; an
    /// existing file must have a schema-1 header (its own is kept) and a partial last line
    /// left by a crash is truncated.
    ///
    /// # Errors
    /// [`SyncFileError::Io`], or the header errors of [`SyncFile::parse`].
    pub fn open(path: &Path, header: &SyncHeader) -> Result<Self, SyncFileError> {
        let io_err = |source| SyncFileError::Io {
            path: path.to_owned(),
            source,
        };
        let mut header_line = serde_json::to_string(&Tagged::Header(header.clone()))
            .map_err(|e| io_err(io::Error::other(e)))?;
        header_line.push('\n');
        if !path.exists() {
            create_with_header(path, header_line.as_bytes()).map_err(io_err)?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io_err)?;
        let mut len = file.metadata().map_err(io_err)?.len();
        let mut cut_on_open = None;
        if len == 0 {
            // An existing empty file (e.g. made by `touch`): adopt it.
            file.write_all(header_line.as_bytes()).map_err(io_err)?;
            len = u64::try_from(header_line.len()).unwrap_or(u64::MAX);
        } else {
            // Validate the existing header, and cut a torn last line left by a crash, so the
            // next segment starts a line of its own.
            let existing = SyncFile::parse(BufReader::new(&mut file))?;
            if let Some(cut) = existing.cut {
                len = len.saturating_sub(cut.bytes);
                file.set_len(len).map_err(io_err)?;
                cut_on_open = Some(cut);
            }
        }
        file.seek(SeekFrom::Start(len)).map_err(io_err)?;
        Ok(Self {
            file,
            path: path.to_owned(),
            len,
            cut_on_open,
        })
    }

    /// What opening cut off the end of an existing file (a torn last line left by a crash),
    /// for a warning; `None` if nothing was cut.
    #[must_use]
    pub fn cut_on_open(&self) -> Option<CutTail> {
        self.cut_on_open
    }

    /// Appends one segment as one line with a single write, so concurrent readers see it
    /// whole or not at all (short of a partial write, which they skip).
    ///
    /// # Errors
    /// [`SyncFileError::Io`].
    pub fn append(&mut self, seg: &SyncSegment) -> Result<(), SyncFileError> {
        let io_err = |source| SyncFileError::Io {
            path: self.path.clone(),
            source,
        };
        let mut line = serde_json::to_string(&Tagged::Segment(*seg))
            .map_err(|e| io_err(io::Error::other(e)))?;
        line.push('\n');
        if let Err(e) = self.file.write_all(line.as_bytes()) {
            // A short write (a full disk, a file-size limit) left a torn line: take it back so
            // the next append cannot glue a complete line onto it. Readers cut it meanwhile.
            if self.file.set_len(self.len).is_ok() {
                let _ = self.file.seek(SeekFrom::Start(self.len));
            }
            return Err(io_err(e));
        }
        self.len += u64::try_from(line.len()).unwrap_or(u64::MAX);
        Ok(())
    }

    /// The file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Creates `path` holding `header_line`, atomically: the bytes go to a temporary file in the
/// same directory, which is synced and then linked into place only if `path` still does not
/// exist, so a concurrent reader never sees a file without its whole header line and an
/// existing file (made meanwhile by another writer) is never replaced. A crash leaves at most
/// the temporary file, never a headerless sync file.
fn create_with_header(path: &Path, header_line: &[u8]) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::Builder::new()
        .prefix(".vmtsync-sync-")
        .suffix(".tmp")
        .tempfile_in(dir)?;
    tmp.write_all(header_line)?;
    tmp.as_file().sync_all()?;
    match tmp.persist_noclobber(path) {
        Ok(_) => Ok(()),
        // Someone created it first: append to theirs (its header is validated on open).
        Err(e) if e.error.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e.error),
    }
}

/// The on-disk line shapes, tagged by `"type"`.
#[derive(Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
enum Tagged {
    Header(SyncHeader),
    Segment(SyncSegment),
}

/// A sync file read into memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncFile {
    /// The header line.
    pub header: SyncHeader,
    /// Every segment, in file order.
    pub segments: Vec<SyncSegment>,
    /// The line number of each segment, for error messages.
    lines: Vec<u64>,
    /// The incomplete last line that was cut (a write in progress or torn by a crash), if any.
    pub cut: Option<CutTail>,
}

impl SyncFile {
    /// Reads and validates a sync file.
    ///
    /// # Errors
    /// [`SyncFileError::Io`] and the errors of [`SyncFile::parse`].
    pub fn read(path: &Path) -> Result<Self, SyncFileError> {
        let file = File::open(path).map_err(|source| SyncFileError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(BufReader::new(file))
    }

    /// Parses a sync file: a schema-1 header line, then segment lines; unknown line types are
    /// skipped, a final line without `\n` is cut and reported in [`SyncFile::cut`].
    ///
    /// # Errors
    /// [`SyncFileError::NoHeader`], [`SyncFileError::Schema`], [`SyncFileError::BadLine`].
    pub fn parse(mut input: impl BufRead) -> Result<Self, SyncFileError> {
        let mut header = None;
        let mut segments = Vec::new();
        let mut lines = Vec::new();
        let mut cut = None;
        let mut line_no = 0_u64;
        let mut line = Vec::new();
        loop {
            line.clear();
            let complete =
                read_line_bounded(&mut input, &mut line).map_err(|source| SyncFileError::Io {
                    path: PathBuf::from("<sync file>"),
                    source,
                })?;
            match complete {
                LineRead::Eof => break,
                LineRead::Partial { bytes } => {
                    cut = Some(CutTail {
                        bytes,
                        complete_lines: line_no,
                    });
                    break;
                }
                LineRead::TooLong | LineRead::Line => {}
            }
            line_no += 1;
            let bad = |why: String| SyncFileError::BadLine { line: line_no, why };
            if complete == LineRead::TooLong {
                return Err(bad(format!("longer than {MAX_LINE} bytes")));
            }
            let value: serde_json::Value =
                serde_json::from_slice(&line).map_err(|e| bad(e.to_string()))?;
            if header.is_none() {
                if value.get("type").and_then(|t| t.as_str()) != Some("header") {
                    return Err(SyncFileError::NoHeader);
                }
                let schema = value.get("schema").and_then(serde_json::Value::as_u64);
                if schema != Some(u64::from(SYNC_SCHEMA)) {
                    return Err(SyncFileError::Schema {
                        found: schema.unwrap_or(0),
                    });
                }
            }
            match value.get("type").and_then(|t| t.as_str()) {
                Some("header" | "segment") => {}
                // Other line types may be added within schema 1: skip them.
                _ => continue,
            }
            match serde_json::from_value::<Tagged>(value).map_err(|e| bad(e.to_string()))? {
                Tagged::Header(h) if header.is_none() => header = Some(h),
                Tagged::Header(_) => return Err(bad("a second header".to_owned())),
                Tagged::Segment(s) => {
                    if s.offset_lo > s.offset || s.offset > s.offset_hi {
                        return Err(bad("offset outside [offset_lo, offset_hi]".to_owned()));
                    }
                    if i128::from(s.guest_anchor)
                        != i128::from(s.host_anchor) + i128::from(s.offset)
                    {
                        return Err(bad("guest_anchor != host_anchor + offset".to_owned()));
                    }
                    segments.push(s);
                    lines.push(line_no);
                }
            }
        }
        Ok(Self {
            header: header.ok_or(SyncFileError::NoHeader)?,
            segments,
            lines,
            cut,
        })
    }

    /// The vCPUs that have segments, sorted.
    #[must_use]
    pub fn vcpus(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.segments.iter().map(|s| s.vcpu).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The piecewise guest→host mapping of one vCPU, on `vmtsync_core::timeline`.
    ///
    /// # Errors
    /// [`SyncFileError::NoSegments`], [`SyncFileError::NotIncreasing`], and
    /// [`SyncFileError::BadLine`] for a segment with no valid line (a rate at or below -100 %,
    /// or a start before host tick 0).
    pub fn timeline(&self, vcpu: u32) -> Result<SyncTimeline, SyncFileError> {
        let mut records: Vec<SyncSegment> = Vec::new();
        let mut segments: Vec<Segment> = Vec::new();
        for (s, &line) in self.segments.iter().zip(&self.lines) {
            if s.vcpu != vcpu {
                continue;
            }
            if records
                .last()
                .is_some_and(|p| p.guest_start >= s.guest_start)
            {
                return Err(SyncFileError::NotIncreasing { line, vcpu });
            }
            let seg = s.to_timeline_segment().ok_or_else(|| SyncFileError::BadLine {
                line,
                why: "the segment maps its guest_start outside the host TSC range, or its rate is not positive".to_owned(),
            })?;
            records.push(*s);
            segments.push(seg);
        }
        if segments.is_empty() {
            return Err(SyncFileError::NoSegments {
                vcpu,
                present: self.vcpus(),
            });
        }
        Ok(SyncTimeline::new(records, segments))
    }
}

/// How [`read_line_bounded`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LineRead {
    /// No bytes were left.
    Eof,
    /// A complete line.
    Line,
    /// The input ended inside a line, `bytes` after the last `\n` (all of them counted, also
    /// beyond [`MAX_LINE`]).
    Partial { bytes: u64 },
    /// A complete line longer than [`MAX_LINE`].
    TooLong,
}

/// Reads one `\n`-terminated line into `line` (without it), keeping at most [`MAX_LINE`]
/// bytes; the rest of an overlong line is consumed and dropped.
pub(crate) fn read_line_bounded(
    input: &mut impl BufRead,
    line: &mut Vec<u8>,
) -> io::Result<LineRead> {
    let mut too_long = false;
    let mut consumed = 0_u64;
    loop {
        let buf = match input.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(if consumed == 0 {
                LineRead::Eof
            } else {
                LineRead::Partial { bytes: consumed }
            });
        }
        let (chunk, found) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], Some(i + 1)),
            None => (buf, None),
        };
        let room = MAX_LINE.saturating_sub(line.len());
        if chunk.len() > room {
            too_long = true;
        }
        line.extend_from_slice(&chunk[..chunk.len().min(room)]);
        let used = found.unwrap_or(buf.len());
        input.consume(used);
        consumed += u64::try_from(used).unwrap_or(u64::MAX);
        if found.is_some() {
            return Ok(if too_long {
                LineRead::TooLong
            } else {
                LineRead::Line
            });
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(super) fn header() -> SyncHeader {
        SyncHeader {
            schema: SYNC_SCHEMA,
            tool: "vmtsync test".into(),
            host_clock: "x86-tsc".into(),
            created_unix_s: 1_796_000_000,
            source: "tcp:127.0.0.1:1".into(),
        }
    }

    pub(super) fn seg(
        vcpu: u32,
        round: u64,
        host_anchor: u64,
        offset: i64,
        drift_ppb: i64,
    ) -> SyncSegment {
        let guest_anchor = host_anchor.checked_add_signed(offset).unwrap();
        SyncSegment {
            vcpu,
            round,
            guest_start: guest_anchor - 1000,
            host_anchor,
            guest_anchor,
            offset,
            offset_lo: offset - 10,
            offset_hi: offset + 10,
            drift_ppb,
            drift_ppb_lo: Some(drift_ppb - 5),
            drift_ppb_hi: None,
            model: OffsetModel::Drift,
            probes: 64,
            rtt_min_ticks: 3000,
            host_first: host_anchor - 1000,
            host_last: host_anchor + 1000,
            is_break: round == 0,
        }
    }

    /// `name` in a fresh temp dir, removed (with its contents) when the guard drops.
    fn tmp(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix("vmtsync-syncfile-")
            .tempdir()
            .unwrap();
        let p = dir.path().join(name);
        (dir, p)
    }

    #[test]
    fn schema_round_trip_through_writer_and_reader() {
        let (_tmp_dir, path) = tmp("rt.jsonl");
        let segs = [
            seg(0, 0, 1_000_000, 5_000_000, 0),
            seg(0, 1, 9_000_000, 5_000_100, 3),
        ];
        let mut w = SyncWriter::open(&path, &header()).unwrap();
        w.append(&segs[0]).unwrap();
        drop(w);
        // Reopening appends after the existing header (its own header is kept).
        let mut other = header();
        other.source = "ignored".into();
        let mut w = SyncWriter::open(&path, &other).unwrap();
        w.append(&segs[1]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 3, "{text}");
        assert!(
            text.starts_with("{\"type\":\"header\",\"schema\":1,"),
            "{text}"
        );
        assert!(text.contains("\"break\":true"), "{text}");
        let f = SyncFile::read(&path).unwrap();
        assert_eq!(f.header, header());
        assert_eq!(f.segments, segs);
        assert_eq!(f.cut, None);
        assert_eq!(f.vcpus(), [0]);
        // The header went in through a temporary file that is gone now.
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            [path.file_name().unwrap()],
            "no temporary file is left"
        );
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn partial_last_line_is_ignored_and_truncated_on_reopen() {
        let (_tmp_dir, path) = tmp("partial.jsonl");
        let mut w = SyncWriter::open(&path, &header()).unwrap();
        w.append(&seg(1, 0, 1_000_000, -50, 0)).unwrap();
        drop(w);
        let torn_line = b"{\"type\":\"segment\",\"vcpu\":1,\"rou";
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(torn_line).unwrap();
        drop(f);
        let torn = CutTail {
            bytes: u64::try_from(torn_line.len()).unwrap(),
            complete_lines: 2,
        };
        let before = std::fs::read(&path).unwrap();
        let r = SyncFile::read(&path).unwrap();
        assert_eq!(r.cut, Some(torn));
        assert_eq!(r.segments.len(), 1);
        assert_eq!(
            std::fs::read(&path).unwrap(),
            before,
            "reading modifies nothing"
        );
        let mut w = SyncWriter::open(&path, &header()).unwrap();
        assert_eq!(w.cut_on_open(), Some(torn));
        w.append(&seg(1, 1, 2_000_000, -50, 0)).unwrap();
        let r = SyncFile::read(&path).unwrap();
        assert_eq!(r.cut, None);
        assert_eq!(r.segments.len(), 2);
        let mut out = Vec::new();
        let guest = r.segments[1].guest_start + 3;
        let stats = convert_sync_file(
            &path,
            1,
            &mut format!("{guest}\n").as_bytes(),
            &mut out,
            false,
        )
        .unwrap();
        assert_eq!(stats.converted, 1);
        assert_eq!(String::from_utf8(out).unwrap(), format!("{}\n", guest + 50));
        std::fs::remove_file(path).unwrap();
    }

    /// A file cut at any byte (as `kill -9` in the middle of a write can leave it) reads as
    /// exactly the segments whose whole line, `\n` included, is before the cut, and reports
    /// every byte after the last `\n` as cut; before the header is complete it is no sync file.
    #[test]
    fn a_file_cut_at_any_byte_keeps_exactly_its_complete_segments() {
        let segs: Vec<SyncSegment> = (0..4)
            .map(|i| seg(i % 2, u64::from(i), 1_000_000 * u64::from(i + 1), 5_000, 0))
            .collect();
        let mut text = serde_json::to_string(&Tagged::Header(header())).unwrap() + "\n";
        // Where each line ends (the byte after its `\n`).
        let mut ends = vec![text.len()];
        for s in &segs {
            text += &(serde_json::to_string(&Tagged::Segment(*s)).unwrap() + "\n");
            ends.push(text.len());
        }
        let bytes = text.as_bytes();
        for cut_at in 0..=bytes.len() {
            let r = SyncFile::parse(&bytes[..cut_at]);
            if cut_at < ends[0] {
                assert!(matches!(r, Err(SyncFileError::NoHeader)), "{cut_at}: {r:?}");
                continue;
            }
            let f = r.unwrap_or_else(|e| panic!("cut at {cut_at}: {e}"));
            let complete = ends.iter().filter(|&&e| e <= cut_at).count();
            assert_eq!(f.segments, segs[..complete - 1], "cut at {cut_at}");
            let last_end = ends[complete - 1];
            let want = (cut_at > last_end).then(|| CutTail {
                bytes: u64::try_from(cut_at - last_end).unwrap(),
                complete_lines: u64::try_from(complete).unwrap(),
            });
            assert_eq!(f.cut, want, "cut at {cut_at}");
        }
    }

    /// A torn line that is complete JSON (only its `\n` missing) is still cut, not read.
    #[test]
    fn a_torn_line_that_parses_as_json_is_still_cut() {
        let h = serde_json::to_string(&Tagged::Header(header())).unwrap();
        let s = serde_json::to_string(&Tagged::Segment(seg(0, 0, 100_000, 5, 0))).unwrap();
        let f = SyncFile::parse(format!("{h}\n{s}").as_bytes()).unwrap();
        assert!(f.segments.is_empty());
        assert_eq!(
            f.cut.map(|c| c.bytes),
            Some(u64::try_from(s.len()).unwrap())
        );
    }

    #[test]
    fn refuses_foreign_or_inconsistent_files_and_skips_unknown_lines() {
        let parse = |s: &str| SyncFile::parse(s.as_bytes());
        assert!(matches!(parse(""), Err(SyncFileError::NoHeader)));
        assert!(matches!(
            parse("{\"type\":\"segment\"}\n"),
            Err(SyncFileError::NoHeader)
        ));
        assert!(matches!(
            parse("{\"type\":\"header\",\"schema\":2}\n"),
            Err(SyncFileError::Schema { found: 2 })
        ));
        assert!(matches!(
            parse("not json\n"),
            Err(SyncFileError::BadLine { line: 1, .. })
        ));
        let h = serde_json::to_string(&Tagged::Header(header())).unwrap();
        let mut bad = seg(0, 0, 100_000, 5, 0);
        bad.guest_anchor += 1;
        let bad = serde_json::to_string(&Tagged::Segment(bad)).unwrap();
        let err = parse(&format!("{h}\n{bad}\n")).unwrap_err();
        assert!(
            matches!(err, SyncFileError::BadLine { line: 2, .. }),
            "{err}"
        );
        let good = serde_json::to_string(&Tagged::Segment(seg(0, 0, 100_000, 5, 0))).unwrap();
        let f = parse(&format!(
            "{h}\n{{\"type\":\"note\",\"text\":\"hi\"}}\n{good}\n"
        ))
        .unwrap();
        assert_eq!(f.segments.len(), 1);
        let err = parse(&format!("{h}\n{h}\n")).unwrap_err();
        assert!(err.to_string().contains("second header"), "{err}");
        let long = "x".repeat(MAX_LINE + 10);
        assert!(matches!(
            parse(&format!("{h}\n{long}\n")),
            Err(SyncFileError::BadLine { line: 2, .. })
        ));
    }
}
