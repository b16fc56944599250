//! The one event source every exporter reads: a recording, whatever its format.
//!
//! [`open`] takes a file written by `vmtsync record` — JSON Lines (`--format jsonl`) or our
//! guest trace.dat (`--format trace-cmd`) — recognised by its first bytes, and streams its
//! events as [`ExportEvent`]s in constant memory. What each input knows (`docs/ctf.md`,
//! "Inputs"):
//!
//! - **JSON Lines**: everything: vCPU, id, payload, the guest TSC, the host TSC and its
//!   guaranteed interval, exactly as recorded.
//! - **trace.dat with a TIME_SHIFT** (every segment at identity rate): the raw guest TSC; the
//!   host TSC is trace-cmd's reading of the TIME_SHIFT ([`timeshift::trace_cmd_host_time`]),
//!   which for these step-mode identity samples is exact and equals the JSON Lines' host time.
//!   The guaranteed interval is not in the file.
//! - **trace.dat without a TIME_SHIFT** (pre-converted): the host TSC only (a timestamp the
//!   recorder raised to keep the file in order is that raised value); no guest TSC, no interval.
//!
//! In both trace.dat cases the vCPU is the file's trace CPU (`vmtsync record` writes its
//! session's vCPU as trace CPU 0).
//!
//! Order: JSON Lines in file order (the order events were received); trace.dat CPU by CPU,
//! each in time order. Every exporter writes one stream per vCPU, so per-vCPU order is what
//! matters.

use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use super::event::{ExportError, ExportEvent, InputKind, Payload};
use super::jsonl::JsonlSource;
use super::tracedat::consts::{MAGIC, option};
use super::tracedat::format::is_vmtsync_event;
use super::tracedat::format::{FUNCGRAPH_ENTRY_ID, FUNCGRAPH_EXIT_ID, SPAN_ORPHAN_ID};
use super::tracedat::reader::{self, Layout};
use super::tracedat::timeshift::{self, TraceCmdSample};
use super::tracedat::{TraceDatError, read_layout};

/// Opens a recording and streams its events (see the module docs).
///
/// # Errors
/// [`ExportError`] for an unreadable file, an unknown format, or a trace.dat whose layout or
/// TIME_SHIFT is damaged (events are checked as they are read).
pub fn open(path: &Path) -> Result<EventSource, ExportError> {
    let io_err = |source| ExportError::Io {
        path: path.to_owned(),
        source,
    };
    let mut head = [0u8; 3];
    let mut f = File::open(path).map_err(io_err)?;
    let n = read_up_to(&mut f, &mut head).map_err(io_err)?;
    drop(f);
    if head[..n] == MAGIC[..n] && n == MAGIC.len() {
        return open_dat(path);
    }
    // JSON Lines: the first non-blank byte opens an object (an empty file has no events).
    if head[..n]
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_none_or(|&b| b == b'{')
    {
        let f = File::open(path).map_err(io_err)?;
        return Ok(EventSource {
            kind: InputKind::Jsonl,
            inner: Inner::Jsonl(JsonlSource::new(path, f)),
            done: false,
        });
    }
    Err(ExportError::UnknownFormat {
        path: path.to_owned(),
    })
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_up_to(f: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// The events of one recording, in constant memory: an iterator that ends after the first
/// error.
#[derive(Debug)]
pub struct EventSource {
    kind: InputKind,
    inner: Inner,
    done: bool,
}

impl EventSource {
    /// What the input is, and so what its events know.
    #[must_use]
    pub fn kind(&self) -> InputKind {
        self.kind
    }

    /// The guest boot of the last event read: a JSON Lines memory recording followed across
    /// guest resets numbers them 0, 1, …; 0 for every other input.
    #[must_use]
    pub fn boot(&self) -> u32 {
        match &self.inner {
            Inner::Jsonl(s) => s.boot().unwrap_or(0),
            Inner::Dat(_) => 0,
        }
    }
}

#[derive(Debug)]
enum Inner {
    Jsonl(JsonlSource),
    Dat(DatSource),
}

impl Iterator for EventSource {
    type Item = Result<ExportEvent, ExportError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let r = match &mut self.inner {
            Inner::Jsonl(s) => s.next_event(),
            Inner::Dat(s) => s.next(),
        };
        if !matches!(r, Some(Ok(_))) {
            self.done = true;
        }
        r
    }
}

/// Events handed from the reading thread in batches of this many (two batches in flight:
/// constant memory).
const BATCH: usize = 4096;

/// A trace.dat read by a thread running [`reader::for_each_event`] (a callback reader) and
/// handed over in bounded batches.
#[derive(Debug)]
struct DatSource {
    rx: Receiver<Result<Vec<ExportEvent>, ExportError>>,
    batch: std::vec::IntoIter<ExportEvent>,
    /// Set when the consumer is gone, so the thread stops converting and sending.
    cancel: Arc<AtomicBool>,
}

impl Drop for DatSource {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl DatSource {
    fn next(&mut self) -> Option<Result<ExportEvent, ExportError>> {
        loop {
            if let Some(e) = self.batch.next() {
                return Some(Ok(e));
            }
            match self.rx.recv() {
                Ok(Ok(b)) => self.batch = b.into_iter(),
                Ok(Err(e)) => return Some(Err(e)),
                // The thread finished and every batch is consumed.
                Err(_) => return None,
            }
        }
    }
}

/// How a trace.dat's timestamps reach the host TSC.
#[derive(Debug)]
enum DatClock {
    /// Raw guest TSC; per trace CPU, the TIME_SHIFT samples and flags.
    Shifted {
        flags: u32,
        cpus: Vec<Vec<TraceCmdSample>>,
    },
    /// Already host TSC.
    Host,
}

fn open_dat(path: &Path) -> Result<EventSource, ExportError> {
    let layout = read_layout(path)?;
    let unsupported = |reason: String| TraceDatError::Unsupported {
        path: path.to_owned(),
        reason,
    };
    let Some(top) = layout.buffers.first() else {
        return Err(unsupported("no trace buffer".into()).into());
    };
    if let Some(c) = top.clock.as_deref().filter(|&c| c != "x86-tsc") {
        return Err(unsupported(format!(
            "trace clock {c:?}: a vmtsync recording uses x86-tsc"
        ))
        .into());
    }
    let clock = match layout.options_with(option::TIME_SHIFT).last() {
        None => DatClock::Host,
        Some(o) => {
            let d = timeshift::decode(&o.data).map_err(|(at, reason)| TraceDatError::Parse {
                path: path.to_owned(),
                offset: o.offset + at as u64,
                reason: reason.into(),
            })?;
            DatClock::Shifted {
                flags: d.flags,
                cpus: d.cpus,
            }
        }
    };
    let kind = match clock {
        DatClock::Host => InputKind::TraceDatHost,
        DatClock::Shifted { .. } => InputKind::TraceDatShifted,
    };
    let (tx, rx) = sync_channel(1);
    let cancel = Arc::new(AtomicBool::new(false));
    let thread_cancel = Arc::clone(&cancel);
    let path = path.to_owned();
    std::thread::Builder::new()
        .name("vmtsync-export-dat".into())
        .spawn(move || read_dat(&path, &layout, &clock, &tx, &thread_cancel))
        .map_err(|source| ExportError::Io {
            path: PathBuf::from("(reader thread)"),
            source,
        })?;
    Ok(EventSource {
        kind,
        inner: Inner::Dat(DatSource {
            rx,
            batch: Vec::new().into_iter(),
            cancel,
        }),
        done: false,
    })
}

/// The reading thread: converts every event and sends batches; the first error (a damaged
/// page, an event that is not ours, a CPU without TIME_SHIFT samples) ends it.
fn read_dat(
    path: &Path,
    layout: &Layout,
    clock: &DatClock,
    tx: &SyncSender<Result<Vec<ExportEvent>, ExportError>>,
    cancel: &AtomicBool,
) {
    let mut batch = Vec::with_capacity(BATCH);
    let mut failed: Option<ExportError> = None;
    let bad = |reason: String| -> ExportError {
        TraceDatError::Unsupported {
            path: path.to_owned(),
            reason,
        }
        .into()
    };
    let r = reader::for_each_event(path, layout, 0, |ev| {
        if failed.is_some() || cancel.load(Ordering::Relaxed) {
            return;
        }
        // The function graph's records restate span records the file also holds as events.
        if matches!(
            ev.common_type,
            FUNCGRAPH_ENTRY_ID | FUNCGRAPH_EXIT_ID | SPAN_ORPHAN_ID
        ) {
            return;
        }
        let e = (|| {
            if !is_vmtsync_event(ev.common_type) {
                return Err(bad(format!(
                    "CPU {}: event type {} is not a vmtsync event (is this a guest trace written by `vmtsync record`?)",
                    ev.cpu, ev.common_type
                )));
            }
            let id = u16::try_from(ev.id).map_err(|_| {
                bad(format!(
                    "CPU {}: event id {} does not fit 16 bits",
                    ev.cpu, ev.id
                ))
            })?;
            let (guest_tsc, host_tsc) = match clock {
                DatClock::Host => (None, ev.ts),
                DatClock::Shifted { flags, cpus } => {
                    let samples = cpus.get(ev.cpu as usize).map_or(&[][..], Vec::as_slice);
                    let host = timeshift::trace_cmd_host_time(samples, *flags, ev.ts).ok_or_else(
                        || {
                            bad(format!(
                                "CPU {} has no TIME_SHIFT samples: its host time is unknown",
                                ev.cpu
                            ))
                        },
                    )?;
                    (Some(ev.ts), host)
                }
            };
            Ok(ExportEvent {
                vcpu: ev.cpu,
                id,
                guest_tsc,
                host_tsc,
                bound: None,
                payload: Payload::new(&ev.payload[..usize::from(ev.len)]).unwrap_or_default(),
            })
        })();
        match e {
            Ok(e) => {
                batch.push(e);
                if batch.len() == BATCH {
                    let full = std::mem::replace(&mut batch, Vec::with_capacity(BATCH));
                    if tx.send(Ok(full)).is_err() {
                        cancel.store(true, Ordering::Relaxed);
                    }
                }
            }
            Err(e) => failed = Some(e),
        }
    });
    if cancel.load(Ordering::Relaxed) {
        return;
    }
    if !batch.is_empty() {
        let _ = tx.send(Ok(batch));
    }
    let end = match r {
        Err(e) => Some(e.into()),
        Ok(_) => failed,
    };
    if let Some(e) = end {
        let _ = tx.send(Err(e));
    }
}

#[cfg(test)]
mod tests;
