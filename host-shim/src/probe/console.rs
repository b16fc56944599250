//! `--console FILE`: the guest's console text from a link it shares with the protocol.
//!
//! A guest whose only serial port carries the protocol keeps its console on the same UART
//! under one wire rule: it writes a `0x00` before each frame as well as the frame's own
//! trailing `0x00`, so the bytes it prints between frames form runs of their own. The session
//! receives through [`vmtsync_core::proto::FrameReceiver::feed_text`]: a `0x00`-delimited run
//! that decodes (COBS, checksum, strict postcard) is a message, every other non-empty run is
//! console text. The text goes to this file byte for byte, as it arrives (a run longer than
//! any frame is streamed, never held), so the host's memory stays the session's fixed
//! buffers whatever the guest prints; the delimiters are not text, so console text must not
//! contain NUL bytes (one would only split a run). Without `--console` the session still
//! counts the text ([`super::SessionStats::console_bytes`]) and the report says so.
//!
//! A damaged frame is indistinguishable from a run of text and lands in the file too: the
//! checksum is what keeps text from passing for a frame, and a frame from passing for text
//! is impossible to tell on the wire (docs/probe.md, "Console text on the protocol's UART").

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use super::ProbeError;

/// The append-only file console text is written to.
#[derive(Debug)]
pub struct ConsoleLog {
    file: File,
    path: PathBuf,
    /// The first write error, kept until the session can return it.
    failed: Option<io::Error>,
}

impl ConsoleLog {
    /// Opens `path` for appending (created if missing), so a session that reconnects keeps
    /// the text of the one before.
    ///
    /// # Errors
    /// [`ProbeError::Console`].
    pub fn create(path: &Path) -> Result<Self, ProbeError> {
        let (file, path) = open_append(path, |path, source| ProbeError::Console { path, source })?;
        Ok(Self {
            file,
            path,
            failed: None,
        })
    }

    /// Writes `text` unbuffered, so the file holds every byte received even if the run is
    /// killed; after a failure the rest is dropped and [`ConsoleLog::check`] reports it.
    pub(super) fn write(&mut self, text: &[u8]) {
        if self.failed.is_none()
            && let Err(e) = self.file.write_all(text)
        {
            self.failed = Some(e);
        }
    }

    /// The first write error, once.
    ///
    /// # Errors
    /// [`ProbeError::Console`].
    pub(super) fn check(&mut self) -> Result<(), ProbeError> {
        match self.failed.take() {
            Some(source) => Err(ProbeError::Console {
                path: self.path.clone(),
                source,
            }),
            None => Ok(()),
        }
    }

    /// The file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }
}
/// `path` opened for appending, created if missing, and its name: the `--console` and
/// `--probe-log` files (a later run adds to an earlier one's); `error` names a failure.
pub(super) fn open_append(
    path: &Path,
    error: fn(PathBuf, io::Error) -> ProbeError,
) -> Result<(File, PathBuf), ProbeError> {
    match OpenOptions::new().create(true).append(true).open(path) {
        Ok(file) => Ok((file, path.to_owned())),
        Err(source) => Err(error(path.to_owned(), source)),
    }
}
