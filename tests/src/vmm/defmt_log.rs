//! Decodes the guest agent's COM2 log: defmt frames (rzCOBS, `0x00`-delimited) whose format
//! strings live in the agent ELF's `.defmt` section.
//!
//! The decoder is stateless over a byte stream: [`DefmtLog::decode`] takes everything COM2
//! produced so far and returns the complete frames as [`LogLine`]s, so callers that poll a
//! growing buffer (the built-in VMM, a file QEMU appends to) simply decode it again. A frame the
//! guest cut short (a panic inside a log call ends it with a bare `0x00`) is counted in
//! [`Decoded::malformed`] and shown in place as a [`MALFORMED`] line; the next frame decodes
//! normally. Decoding a longer prefix of the same stream only appends lines, so a caller can
//! print the new lines (or the new tail of [`Decoded::text`]) as the stream grows.

use std::fmt;
use std::path::Path;

use defmt_decoder::{DecodeError, Table};

/// Why an ELF gives no decoder.
#[derive(Debug, thiserror::Error)]
pub enum DefmtLogError {
    /// The ELF could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The ELF's path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The ELF does not parse, or its defmt table does not (a defmt version the decoder does
    /// not know: rebuild the agent with the workspace's defmt 1.x).
    #[error("parsing the defmt table: {0:#}")]
    Table(anyhow::Error),
    /// The ELF has no `.defmt` section (not built with defmt, or `defmt.x` not linked).
    #[error("the ELF has no .defmt section (is it a defmt build of the agent?)")]
    NoTable,
}

/// The text of the line that stands in for a frame that did not decode.
pub const MALFORMED: &str = "(malformed defmt frame skipped)";

/// One decoded log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    /// Guest TSC when the line was logged (the agent's defmt timestamp), if the ELF has one.
    pub tsc: Option<u64>,
    /// `trace`, `debug`, `info`, `warn` or `error`; `None` for `defmt::println!`.
    pub level: Option<&'static str>,
    /// The formatted message.
    pub text: String,
}

impl fmt::Display for LogLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(t) = self.tsc {
            write!(f, "{t} ")?;
        }
        if let Some(level) = self.level {
            write!(f, "{level:<5} ")?;
        }
        f.write_str(&self.text)
    }
}

/// The result of decoding a COM2 byte stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decoded {
    /// Complete frames, in order.
    pub lines: Vec<LogLine>,
    /// Frames that did not decode (cut short, or bytes from something other than this ELF);
    /// each also appears in `lines` as a [`MALFORMED`] line without level or TSC.
    pub malformed: usize,
    /// Bytes after the last delimiter: a frame still being written.
    pub pending_bytes: usize,
}

impl Decoded {
    /// The lines as text, one per line (each ending in `\n`), for assertions and logs.
    #[must_use]
    pub fn text(&self) -> String {
        let mut s = String::new();
        for l in &self.lines {
            s.push_str(&l.to_string());
            s.push('\n');
        }
        s
    }

    /// The first line whose message contains `needle`.
    #[must_use]
    pub fn find(&self, needle: &str) -> Option<&LogLine> {
        self.lines.iter().find(|l| l.text.contains(needle))
    }
}

/// A decoder for the log of one agent ELF.
pub struct DefmtLog {
    table: Table,
}

impl fmt::Debug for DefmtLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DefmtLog")
            .field("encoding", &self.table.encoding())
            .field("has_timestamp", &self.table.has_timestamp())
            .finish_non_exhaustive()
    }
}

impl DefmtLog {
    /// A decoder for the ELF image `elf`.
    ///
    /// # Errors
    /// [`DefmtLogError::Table`] for an ELF or defmt table that does not parse,
    /// [`DefmtLogError::NoTable`] for an ELF without defmt data.
    pub fn from_elf(elf: &[u8]) -> Result<Self, DefmtLogError> {
        match Table::parse(elf) {
            Ok(Some(table)) => Ok(Self { table }),
            Ok(None) => Err(DefmtLogError::NoTable),
            Err(e) => Err(DefmtLogError::Table(e)),
        }
    }

    /// A decoder for the ELF file at `path`.
    ///
    /// # Errors
    /// As [`DefmtLog::from_elf`], plus [`DefmtLogError::Read`].
    pub fn from_elf_path(path: &Path) -> Result<Self, DefmtLogError> {
        let elf = std::fs::read(path).map_err(|source| DefmtLogError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_elf(&elf)
    }

    /// Decodes every complete frame in `stream` (all bytes COM2 produced so far).
    #[must_use]
    pub fn decode(&self, stream: &[u8]) -> Decoded {
        let mut out = Decoded::default();
        // Only complete frames: the bytes after the last delimiter are still being written.
        let complete = stream.iter().rposition(|&b| b == 0).map_or(0, |i| i + 1);
        out.pending_bytes = stream.len() - complete;
        let mut dec = self.table.new_stream_decoder();
        dec.received(&stream[..complete]);
        loop {
            match dec.decode() {
                Ok(frame) => out.lines.push(LogLine {
                    tsc: frame
                        .display_timestamp()
                        .and_then(|t| t.to_string().parse().ok()),
                    level: frame.level().map(|l| l.as_str()),
                    text: frame.display_message().to_string(),
                }),
                Err(DecodeError::Malformed) => {
                    out.malformed += 1;
                    out.lines.push(LogLine {
                        tsc: None,
                        level: None,
                        text: MALFORMED.into(),
                    });
                }
                Err(DecodeError::UnexpectedEof) => break,
            }
        }
        out
    }
}

/// The decoded text of a COM2 capture file (QEMU's `file` chardev) of the agent `elf`, for
/// diagnostics: on any failure, a line saying why instead.
#[must_use]
pub fn decode_file_text(elf: &Path, com2: &Path) -> String {
    let decoder = match DefmtLog::from_elf_path(elf) {
        Ok(d) => d,
        Err(e) => return format!("(COM2 not decoded: {e})\n"),
    };
    match std::fs::read(com2) {
        Ok(bytes) => decoder.decode(&bytes).text(),
        Err(e) => format!("(COM2 capture {} unreadable: {e})\n", com2.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_elf_without_defmt_data_is_refused() {
        // A system binary is an ELF, but not a defmt one. (Not this test binary: with
        // `--all-features` it links vmtsync-core's defmt logging and has a `.defmt` table.)
        let me = Path::new("/bin/true");
        assert!(
            me.exists(),
            "/bin/true (coreutils) is needed as a non-defmt ELF"
        );
        let err = DefmtLog::from_elf_path(me).expect_err("no .defmt section");
        assert!(matches!(err, DefmtLogError::NoTable), "{err}");
        assert!(matches!(
            DefmtLog::from_elf(b"not an elf"),
            Err(DefmtLogError::Table(_))
        ));
        assert!(matches!(
            DefmtLog::from_elf_path(Path::new("/nonexistent/agent.elf")),
            Err(DefmtLogError::Read { .. })
        ));
        assert!(decode_file_text(me, Path::new("/nonexistent")).starts_with("(COM2 not decoded: "));
    }

    #[test]
    fn line_display_has_tsc_level_and_text() {
        let l = LogLine {
            tsc: Some(42),
            level: Some("info"),
            text: "ready".into(),
        };
        assert_eq!(l.to_string(), "42 info  ready");
        let bad = LogLine {
            tsc: None,
            level: None,
            text: MALFORMED.into(),
        };
        let d = Decoded {
            lines: vec![l, bad],
            malformed: 1,
            pending_bytes: 0,
        };
        assert_eq!(d.text(), format!("42 info  ready\n{MALFORMED}\n"));
        assert!(d.find("read").is_some());
        assert!(d.find("steady").is_none());
    }
}
