//! JSON Lines, `vmtsync record --format jsonl`: one object per event (schema in
//! `docs/record.md`). One [`Line`] type is both what the recorder writes ([`JsonlWriter`],
//! streamed to `OUT.partial` and renamed to `OUT` when the recording ends) and what the
//! exporters read back ([`JsonlSource`], through [`super::source::open`]).

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::event::{Bound, ExportError, ExportEvent, MAX_PAYLOAD, Payload};
use crate::atomic_file::AtomicFile;

/// The event object schema this crate writes and reads.
pub const EVENT_SCHEMA: u32 = 1;

/// The longest line accepted (ours are under 300 bytes); a longer one is an error, so a
/// file without newlines cannot make the reader buffer it whole.
const MAX_LINE: u64 = 4096;

/// One line: one event, its host time and guaranteed interval, and the round that placed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Line {
    /// Always [`EVENT_SCHEMA`] for lines this crate writes.
    pub schema: u32,
    /// The vCPU whose ring the event came from.
    pub vcpu: u32,
    /// The application's event id.
    pub id: u16,
    /// The raw guest TSC.
    pub guest_tsc: u64,
    /// The event on the host's TSC.
    pub host_tsc: u64,
    /// Lowest host tick of the guaranteed interval.
    pub host_lo: u64,
    /// Highest host tick of the guaranteed interval.
    pub host_hi: u64,
    /// Lowercase hex, two digits per byte.
    #[serde(with = "hex")]
    pub payload: Payload,
    /// The sync round whose segment placed the event (absent from lines that predate it).
    #[serde(default)]
    pub round: u64,
    /// Memory recordings: the guest boot the event belongs to (0, 1, … one per header the
    /// reader followed across guest resets); absent from other recordings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<u32>,
}

impl Line {
    /// The event as every exporter takes it; `Err` (what is wrong) for a line that breaks the
    /// schema: another schema number, or a host time outside its own interval.
    ///
    /// # Errors
    /// The reason, in words.
    pub fn to_event(&self) -> Result<ExportEvent, String> {
        if self.schema != EVENT_SCHEMA {
            return Err(format!(
                "schema {} (this vmtsync reads schema {EVENT_SCHEMA})",
                self.schema
            ));
        }
        if !(self.host_lo <= self.host_tsc && self.host_tsc <= self.host_hi) {
            return Err(format!(
                "host_tsc {} outside its interval [{}, {}]",
                self.host_tsc, self.host_lo, self.host_hi
            ));
        }
        Ok(ExportEvent {
            vcpu: self.vcpu,
            id: self.id,
            guest_tsc: Some(self.guest_tsc),
            host_tsc: self.host_tsc,
            bound: Some(Bound {
                lo: self.host_lo,
                hi: self.host_hi,
            }),
            payload: self.payload,
        })
    }
}

/// The payload as lowercase hex, two digits per byte, at most [`MAX_PAYLOAD`] bytes.
mod hex {
    use serde::de::{Error, Visitor};
    use serde::{Deserializer, Serializer};

    use super::{MAX_PAYLOAD, Payload, parse_hex};

    pub(super) fn serialize<S: Serializer>(p: &Payload, s: S) -> Result<S::Ok, S::Error> {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut buf = [0u8; 2 * MAX_PAYLOAD];
        let bytes = p.as_slice();
        for (pair, b) in buf.chunks_exact_mut(2).zip(bytes) {
            pair[0] = DIGITS[usize::from(b >> 4)];
            pair[1] = DIGITS[usize::from(b & 0xf)];
        }
        // Hex digits are ASCII, so this cannot fail; an empty string stands in if it did.
        s.serialize_str(std::str::from_utf8(&buf[..2 * bytes.len()]).unwrap_or_default())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Payload, D::Error> {
        struct HexVisitor;
        impl Visitor<'_> for HexVisitor {
            type Value = Payload;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "lowercase hex of at most {MAX_PAYLOAD} bytes")
            }
            fn visit_str<E: Error>(self, v: &str) -> Result<Payload, E> {
                parse_hex(v).ok_or_else(|| {
                    E::custom(format!(
                        "payload {v:?} is not lowercase hex of at most {MAX_PAYLOAD} bytes"
                    ))
                })
            }
        }
        d.deserialize_str(HexVisitor)
    }
}

/// Lowercase hex, two digits per byte, at most [`MAX_PAYLOAD`] bytes.
pub(crate) fn parse_hex(s: &str) -> Option<Payload> {
    let s = s.as_bytes();
    if !s.len().is_multiple_of(2) || s.len() / 2 > MAX_PAYLOAD {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut bytes = [0u8; MAX_PAYLOAD];
    for (i, pair) in s.chunks_exact(2).enumerate() {
        bytes[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Payload::new(&bytes[..s.len() / 2])
}

/// A streaming writer of [`Line`]s: to `OUT.partial` (kept, with every line flushed so far, by
/// a run that ends early), renamed to `OUT` by [`JsonlWriter::finish`].
#[derive(Debug)]
pub struct JsonlWriter {
    out: BufWriter<AtomicFile>,
}

impl JsonlWriter {
    /// Starts `OUT.partial` beside `path` (an existing one is truncated).
    ///
    /// # Errors
    /// Creating the file failed.
    pub fn create(path: &Path) -> io::Result<Self> {
        Ok(Self {
            out: BufWriter::with_capacity(256 * 1024, AtomicFile::live(path)?),
        })
    }

    /// The file being written (`OUT.partial`), for messages.
    #[must_use]
    pub fn path(&self) -> &Path {
        self.out.get_ref().path()
    }

    /// Appends one line.
    ///
    /// # Errors
    /// Writing failed.
    pub fn write(&mut self, line: &Line) -> io::Result<()> {
        serde_json::to_writer(&mut self.out, line)?;
        self.out.write_all(b"\n")
    }

    /// Everything so far reaches the file (a killed run keeps it).
    ///
    /// # Errors
    /// Writing failed.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// Flushes, syncs and renames `OUT.partial` to `OUT`.
    ///
    /// # Errors
    /// Writing, syncing or renaming failed.
    pub fn finish(self) -> io::Result<()> {
        self.out.into_inner().map_err(|e| e.into_error())?.commit()
    }
}

/// A streaming reader of [`Line`]s as [`ExportEvent`]s, one bounded line at a time.
#[derive(Debug)]
pub struct JsonlSource {
    path: PathBuf,
    r: BufReader<File>,
    buf: Vec<u8>,
    line: u64,
    boot: Option<u32>,
}

impl JsonlSource {
    /// Reads `f`, the file at `path` (named in errors).
    #[must_use]
    pub fn new(path: &Path, f: File) -> Self {
        Self {
            path: path.to_owned(),
            r: BufReader::with_capacity(256 * 1024, f),
            buf: Vec::with_capacity(512),
            line: 0,
            boot: None,
        }
    }

    /// The guest boot of the last event read (memory recordings followed across resets;
    /// `None` for lines without one).
    #[must_use]
    pub fn boot(&self) -> Option<u32> {
        self.boot
    }

    /// The next event, `None` at the end of the file.
    pub fn next_event(&mut self) -> Option<Result<ExportEvent, ExportError>> {
        loop {
            self.buf.clear();
            self.line += 1;
            let n = match (&mut self.r)
                .take(MAX_LINE + 1)
                .read_until(b'\n', &mut self.buf)
            {
                Ok(n) => n,
                Err(source) => {
                    return Some(Err(ExportError::Io {
                        path: self.path.clone(),
                        source,
                    }));
                }
            };
            if n == 0 {
                return None;
            }
            if n as u64 > MAX_LINE {
                return Some(Err(self.bad(format!("longer than {MAX_LINE} bytes"))));
            }
            if self.buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return Some(
                serde_json::from_slice::<Line>(&self.buf)
                    .map_err(|e| e.to_string())
                    .and_then(|l| {
                        self.boot = l.boot;
                        l.to_event()
                    })
                    .map_err(|reason| self.bad(reason)),
            );
        }
    }

    fn bad(&self, reason: String) -> ExportError {
        ExportError::Line {
            path: self.path.clone(),
            line: self.line,
            reason,
        }
    }
}
