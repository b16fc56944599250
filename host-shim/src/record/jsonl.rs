//! The JSON Lines output of `vmtsync record`: one object per event (schema in
//! `docs/record.md`), streamed to `OUT.partial` and renamed to `OUT` when the recording ends.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::{Placed, RecordError, create_beside};

/// The event object schema this crate writes.
pub const EVENT_SCHEMA: u32 = 1;

/// One line.
#[derive(Serialize)]
struct Line<'a> {
    schema: u32,
    vcpu: u32,
    id: u16,
    guest_tsc: u64,
    host_tsc: u64,
    host_lo: u64,
    host_hi: u64,
    /// Lowercase hex, two digits per byte.
    payload: &'a str,
    /// The sync round whose segment placed the event.
    round: u64,
}

/// A streaming writer.
pub(super) struct Writer {
    partial: PathBuf,
    out: BufWriter<File>,
    hex: String,
}

impl Writer {
    pub(super) fn create(path: &Path) -> Result<Self, RecordError> {
        let (partial, out) = create_beside(path)?;
        Ok(Self {
            partial,
            out,
            hex: String::with_capacity(32),
        })
    }

    pub(super) fn event(&mut self, e: &Placed<'_>) -> Result<(), RecordError> {
        use std::fmt::Write as _;
        self.hex.clear();
        for b in e.payload {
            let _ = write!(self.hex, "{b:02x}");
        }
        let line = Line {
            schema: EVENT_SCHEMA,
            vcpu: e.vcpu,
            id: e.id,
            guest_tsc: e.guest,
            host_tsc: e.host,
            host_lo: e.lo,
            host_hi: e.hi,
            payload: &self.hex,
            round: e.round,
        };
        serde_json::to_writer(&mut self.out, &line)
            .map_err(std::io::Error::from)
            .and_then(|()| self.out.write_all(b"\n"))
            .map_err(RecordError::io(&self.partial))
    }

    /// Everything so far reaches the file (a killed run keeps it).
    pub(super) fn flush(&mut self) -> Result<(), RecordError> {
        self.out.flush().map_err(RecordError::io(&self.partial))
    }

    /// Flushes, syncs and renames `OUT.partial` to `path`.
    pub(super) fn finish(mut self, path: &Path) -> Result<(), RecordError> {
        self.flush()?;
        let f = self
            .out
            .into_inner()
            .map_err(|e| RecordError::io(&self.partial)(e.into_error()))?;
        f.sync_all().map_err(RecordError::io(&self.partial))?;
        std::fs::rename(&self.partial, path).map_err(RecordError::io(path))
    }
}
