//! What every format's reader hands on and every exporter takes: one guest event on the host
//! timeline ([`ExportEvent`], its [`Payload`] and guaranteed [`Bound`]), what an input knows
//! ([`InputKind`]), and why reading or exporting failed ([`ExportError`]).

use std::io;
use std::path::PathBuf;

use thiserror::Error;

use super::tracedat::TraceDatError;

/// The most payload bytes an event carries.
pub const MAX_PAYLOAD: usize = 16;

/// An event's payload: at most [`MAX_PAYLOAD`] bytes, stored inline so events are `Copy`.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Payload {
    pub(super) len: u8,
    pub(super) bytes: [u8; MAX_PAYLOAD],
}

impl Payload {
    /// `None` if `b` is longer than [`MAX_PAYLOAD`].
    #[must_use]
    #[inline]
    pub fn new(b: &[u8]) -> Option<Self> {
        if b.len() > MAX_PAYLOAD {
            return None;
        }
        Some(Self {
            len: u8::try_from(b.len()).ok()?,
            bytes: padded(b),
        })
    }

    /// The first `len` of `bytes`, whose bytes past `len` are zero (as a
    /// [`crate::guestmem::GuestRecord`]'s are): no copy to pad them. `None` past
    /// [`MAX_PAYLOAD`].
    #[must_use]
    #[inline]
    pub fn from_padded(len: u8, bytes: [u8; MAX_PAYLOAD]) -> Option<Self> {
        debug_assert!(
            bytes[usize::from(len).min(MAX_PAYLOAD)..]
                .iter()
                .all(|&b| b == 0)
        );
        (usize::from(len) <= MAX_PAYLOAD).then_some(Self { len, bytes })
    }

    /// The bytes.
    #[must_use]
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

/// `b` (at most [`MAX_PAYLOAD`] bytes) followed by zeros, made in a register: two
/// overlapping loads of its first and last 8 (4, 1) bytes, one 16-byte value. Copying the
/// bytes into a zeroed array took a `memcpy` call per event, and the wide load that then
/// moved the array on waited for its narrow stores (a store-forwarding stall: measured with
/// `perf`, the most expensive instruction of `record --format perfetto|ctf`'s format thread).
#[inline]
fn padded(b: &[u8]) -> [u8; MAX_PAYLOAD] {
    let n = b.len();
    let v: u128 = if let (Some(lo), Some(hi)) = (b.first_chunk::<8>(), b.last_chunk::<8>()) {
        // 8 to 16 bytes: the last 8 start at byte n - 8 (the bytes both cover are the same).
        u128::from(u64::from_le_bytes(*lo)) | u128::from(u64::from_le_bytes(*hi)) << (8 * (n - 8))
    } else if let (Some(lo), Some(hi)) = (b.first_chunk::<4>(), b.last_chunk::<4>()) {
        u128::from(u32::from_le_bytes(*lo)) | u128::from(u32::from_le_bytes(*hi)) << (8 * (n - 4))
    } else if let (Some(&a), Some(&z)) = (b.first(), b.last()) {
        // 1 to 3 bytes: the first, the middle and the last cover them.
        u128::from(a) | u128::from(b[n / 2]) << (8 * (n / 2)) | u128::from(z) << (8 * (n - 1))
    } else {
        0
    };
    v.to_le_bytes()
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.as_slice() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// A guaranteed interval on the host's TSC: the event happened at a host tick in `[lo, hi]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bound {
    /// Lowest host tick.
    pub lo: u64,
    /// Highest host tick.
    pub hi: u64,
}

/// One guest event on the host timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportEvent {
    /// The vCPU whose ring it came from.
    pub vcpu: u32,
    /// The application's event id.
    pub id: u16,
    /// The guest TSC, when the input has it (not in a pre-converted trace.dat).
    pub guest_tsc: Option<u64>,
    /// The event on the host's TSC (what `vmtsync record` computed).
    pub host_tsc: u64,
    /// Its guaranteed interval, when the input has it (JSON Lines only).
    pub bound: Option<Bound>,
    /// The payload.
    pub payload: Payload,
}

impl ExportEvent {
    /// Whether its id is one of the span records' (`SPAN_BEGIN` to `RELOC`, which
    /// [`crate::spans::SpanTracker`] pairs): a cheap test before the per-event path.
    #[must_use]
    #[inline]
    pub fn is_span_record(&self) -> bool {
        is_span_id(self.id)
    }
}

/// What kind of file a source reads, and so what its events know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    /// `vmtsync record --format jsonl`: everything.
    Jsonl,
    /// Our guest trace.dat with a TIME_SHIFT: guest TSC and host TSC, no interval.
    TraceDatShifted,
    /// Our guest trace.dat without one (pre-converted): host TSC only.
    TraceDatHost,
}

/// Why reading an input failed.
#[derive(Debug, Error)]
pub enum ExportError {
    /// A file operation failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The input is neither JSON Lines nor a trace.dat.
    #[error(
        "{}: not a vmtsync recording (expected JSON Lines from `vmtsync record --format jsonl` or a trace.dat from `vmtsync record`)",
        path.display()
    )]
    UnknownFormat {
        /// The file.
        path: PathBuf,
    },
    /// A JSON Lines line is malformed.
    #[error("{}: line {line}: {reason}", path.display())]
    Line {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What is wrong.
        reason: String,
    },
    /// The trace.dat is damaged, truncated, or not one of ours.
    #[error(transparent)]
    TraceDat(#[from] TraceDatError),
    /// Writing an export failed.
    #[error("writing {}: {source}", path.display())]
    Write {
        /// The output.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The output cannot hold the input (e.g. too many vCPUs).
    #[error("{0}")]
    Unsupported(String),
}

/// Whether event id `id` is one of the reserved span records (`SPAN_BEGIN` to `RELOC`).
#[must_use]
pub fn is_span_id(id: u16) -> bool {
    use vmtsync_core::recorder::{RELOC_ID, SPAN_BEGIN_ID};
    (SPAN_BEGIN_ID..=RELOC_ID).contains(&id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_holds_its_bytes_then_zeros_at_every_length() {
        let src: Vec<u8> = (1..=17).map(|i| i * 13).collect();
        for n in 0..=MAX_PAYLOAD {
            let p = Payload::new(&src[..n]).unwrap();
            assert_eq!(p.as_slice(), &src[..n], "{n}");
            assert!(p.bytes[n..].iter().all(|&b| b == 0), "{n}");
            assert_eq!(usize::from(p.len), n);
        }
        assert!(Payload::new(&src).is_none());
    }
}
