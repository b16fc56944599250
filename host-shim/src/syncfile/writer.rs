//! [`SyncWriter`]: appending segments, one whole line per `write(2)`, to a file that is read
//! while written (see the module docs of [`super`] for why append and not rename).

use std::fs::File;
use std::fs::OpenOptions;
use std::io::{self, BufReader, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::format::Tagged;
use super::reader::{CutTail, SyncFile};
use super::{SyncFileError, SyncHeader, SyncSegment};
use crate::atomic_file::AtomicFile;

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

/// Creates `path` holding `header_line`, atomically ([`AtomicFile::commit_new`]): a
/// concurrent reader never sees a file without its whole header line, an existing file (made
/// meanwhile by another writer) is never replaced, and a crash leaves at most a temporary file,
/// never a headerless sync file.
fn create_with_header(path: &Path, header_line: &[u8]) -> io::Result<()> {
    let mut file = AtomicFile::new(path)?;
    file.write_all(header_line)?;
    // Someone created it first: append to theirs (its header is validated on open).
    file.commit_new().map(drop)
}

#[cfg(test)]
mod tests {
    use super::super::CutTail;
    use super::super::format::samples::{header, seg};
    use super::*;
    use vmtsync_core::{GuestTicks, HostTicks};

    /// `name` in a fresh temp dir, removed (with its contents) when the guard drops.
    fn tmp(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        crate::testutil::temp_path("vmtsync-syncfile-", name)
    }

    #[test]
    fn schema_round_trip_through_writer_and_reader() {
        let (_tmp_dir, path) = tmp("rt.jsonl");
        let segs = [
            seg(0, 0, 1_000_000, 5_000_000, 0),
            seg(0, 1, 9_000_000, 5_000_100, 3),
        ];
        let mut w = SyncWriter::open(&path, &header()).unwrap();
        crate::atomic_file::assert_output_mode(&path);
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
        // The segment appended after the cut is the one read back.
        let guest = r.segments[1].guest_start + 3;
        let host = r
            .timeline(1)
            .unwrap()
            .try_host_from_guest_floor(GuestTicks(guest));
        assert_eq!(host, Some(HostTicks(guest + 50)));
        std::fs::remove_file(path).unwrap();
    }
}
