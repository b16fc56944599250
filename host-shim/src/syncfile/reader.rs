//! [`SyncFile`]: reading a sync file that may still be written, or was left by a killed
//! writer, up to its last complete line.

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};

use vmtsync_core::timeline::Segment;

use super::format::Tagged;
use super::{SYNC_SCHEMA, SyncFileError, SyncHeader, SyncSegment, SyncTimeline};

/// The longest line accepted (sync file or conversion input).
pub(super) const MAX_LINE: usize = 4096;

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

/// A sync file read into memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncFile {
    /// The header line.
    pub header: SyncHeader,
    /// Every segment, in file order.
    pub segments: Vec<SyncSegment>,
    /// The line number of each segment, for error messages.
    pub(super) lines: Vec<u64>,
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
mod tests {
    use super::super::format::samples::{header, seg};
    use super::*;

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
    fn segments_say_their_anchor_and_files_from_before_the_field_read_as_in_process() {
        use crate::syncfile::AnchorKind;
        let h = serde_json::to_string(&Tagged::Header(header())).unwrap();
        let mut anchored = seg(0, 0, 100_000, 5, 0);
        anchored.anchor = AnchorKind::KvmPioSyncPort;
        let line = serde_json::to_string(&Tagged::Segment(anchored)).unwrap();
        assert!(line.contains("\"anchor\":\"kvm-pio-sync-port\""), "{line}");
        // A segment line as written before the field existed.
        let mut old: serde_json::Value = serde_json::from_str(&line).unwrap();
        old.as_object_mut().unwrap().remove("anchor");
        // And one from a newer writer with a kind this version does not know.
        let newer = line.replace("kvm-pio-sync-port", "kvm-something-new");
        let f = SyncFile::parse(format!("{h}\n{line}\n{old}\n{newer}\n").as_bytes()).unwrap();
        let kinds: Vec<AnchorKind> = f.segments.iter().map(|s| s.anchor).collect();
        assert_eq!(
            kinds,
            [
                AnchorKind::KvmPioSyncPort,
                AnchorKind::InProcess,
                AnchorKind::Unknown
            ]
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
