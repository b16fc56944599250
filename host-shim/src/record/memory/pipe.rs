//! Exact mode writes beside the reading: the drain rounds are read, checked and placed on the
//! recording's thread, and written into the output's format on a thread of its own.
//!
//! Exact mode places every record for good when it reads it (`mapping.rs`), so placing needs
//! nothing the writer knows, and writing needs nothing a later round changes. Each round goes
//! to the writer as a [`Batch`]: the records the drainer read and, in ring order, what to
//! write of them ([`Item`]). At most [`IN_FLIGHT`] batches wait for the writer, so memory
//! stays bounded whatever the number of events; their record buffers come back to be filled
//! again. The writer stops at its first error and the recording sees it at its next round
//! (or at the end): the same failure a write on the recording's thread would have been.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender, SyncSender, TrySendError, channel, sync_channel};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::formats::perfetto::clock::ClockSnapshot;
#[cfg(doc)]
use crate::guestmem::Drainer;
use crate::guestmem::GuestRecord;
use crate::record::RecordError;
use crate::record::place::Placed;
use crate::record::stream::ExactRun;
use crate::record::write::Out;

/// Rounds that may wait for the writer: one being written, seven queued (4 MiB of records at
/// the default round bound). The slack is for the writer's stalls: a write into the page cache
/// now and then waits in the kernel for far longer than a round takes to read, and with one
/// round queued the reading waited with it.
pub(super) const IN_FLIGHT: usize = 8;

/// What to write of a round's records, in ring order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Item {
    /// `records[from..to]`: each one a plain event that `run` places.
    Run {
        run: ExactRun,
        from: usize,
        to: usize,
    },
    /// `records[at]` of vCPU key `key`, placed at host tick `host` by segment round `round`.
    One {
        at: usize,
        key: u32,
        host: u64,
        round: u64,
    },
}

/// One drain round on its way to the writer.
struct Batch {
    records: Vec<GuestRecord>,
    items: Vec<Item>,
    /// The clock snapshot taken at the round's end, if one was.
    snap: Option<ClockSnapshot>,
}

/// What the writer hands back when it ends: the output (to be finished on the recording's
/// thread), its first error, and when it finished writing the last round that had records.
struct Ended {
    out: Out,
    failed: Option<RecordError>,
    last_written: Option<Instant>,
}

/// The writer thread and the round being assembled for it.
pub(super) struct Pipe {
    /// The output, named in errors.
    path: PathBuf,
    tx: Option<SyncSender<Batch>>,
    back: Receiver<(Vec<GuestRecord>, Vec<Item>)>,
    worker: Option<JoinHandle<Ended>>,
    /// The round being placed.
    pub(super) items: Vec<Item>,
}

impl Pipe {
    /// Starts the writer thread on `out`; `path` names the output in errors.
    pub(super) fn start(out: Out, path: PathBuf) -> Result<Self, RecordError> {
        let (tx, rx) = sync_channel::<Batch>(IN_FLIGHT - 1);
        let (back_tx, back) = channel();
        // The pool of record buffers, whole from the start and taken oldest first, so every
        // buffer is in use within the first rounds: memory reaches its bound at once, not
        // when (and whether) the writer once fell that far behind. One more than the writer
        // can hold, so the reading always finds one here besides the drainer's own. Cannot
        // fail: the receiver is here.
        for _ in 0..=IN_FLIGHT {
            let _ = back_tx.send((Vec::new(), Vec::new()));
        }
        let worker = std::thread::Builder::new()
            .name("vmtsync-format".into())
            .spawn({
                let path = path.clone();
                move || write_batches(out, &path, &rx, &back_tx)
            })
            .map_err(RecordError::io(&path))?;
        Ok(Self {
            path,
            tx: Some(tx),
            back,
            worker: Some(worker),
            items: Vec::new(),
        })
    }

    /// Sends the round just placed: its records, taken by `swap` in exchange for an emptied
    /// buffer to fill next (the drainer's [`Drainer::swap_round`]), the items placed of them,
    /// and the snapshot taken at its end. `Err`: the writer failed (its error).
    pub(super) fn send_round(
        &mut self,
        swap: impl FnOnce(Vec<GuestRecord>) -> Vec<GuestRecord>,
        snap: Option<ClockSnapshot>,
    ) -> Result<(), RecordError> {
        let (spare, items) = self
            .back
            .try_recv()
            .unwrap_or_else(|_| (Vec::new(), Vec::new()));
        let records = swap(spare);
        let batch = Batch {
            records,
            items: std::mem::replace(&mut self.items, items),
            snap,
        };
        let Some(tx) = &self.tx else {
            // Only after the writer ended: nothing sent now would be written.
            return Err(self.writer_error("already ended"));
        };
        let sent = match tx.try_send(batch) {
            Ok(()) => Ok(()),
            // The writer is behind: wait for it (this is the bound on memory).
            Err(TrySendError::Full(b)) => tx.send(b).map_err(|_| ()),
            Err(TrySendError::Disconnected(_)) => Err(()),
        };
        match sent {
            Ok(()) => Ok(()),
            // The writer stopped: its error.
            Err(()) => match self.join()?.failed {
                Some(e) => Err(e),
                None => Ok(()),
            },
        }
    }

    /// Waits for the writer to write everything sent, and takes its output back, with when
    /// it wrote its last records. `Err`: the writer's error.
    pub(super) fn finish(&mut self) -> Result<(Out, Option<Instant>), RecordError> {
        let ended = self.join()?;
        match ended.failed {
            Some(e) => Err(e),
            None => Ok((ended.out, ended.last_written)),
        }
    }

    fn join(&mut self) -> Result<Ended, RecordError> {
        drop(self.tx.take());
        let worker = self
            .worker
            .take()
            .ok_or_else(|| self.writer_error("already ended"))?;
        worker.join().map_err(|_| self.writer_error("panicked"))
    }

    /// The output's error when its writer thread is gone (`why`).
    fn writer_error(&self, why: &str) -> RecordError {
        RecordError::Io {
            path: self.path.clone(),
            source: std::io::Error::other(format!("its writer thread {why}")),
        }
    }
}

/// The writer thread: every batch in order, until the recording ends or a write fails.
fn write_batches(
    mut out: Out,
    path: &std::path::Path,
    rx: &Receiver<Batch>,
    back: &Sender<(Vec<GuestRecord>, Vec<Item>)>,
) -> Ended {
    let mut last_written = None;
    for mut b in rx {
        if let Err(e) = write_batch(&mut out, path, &b) {
            return Ended {
                out,
                failed: Some(e),
                last_written,
            };
        }
        if !b.records.is_empty() {
            last_written = Some(Instant::now());
        }
        b.records.clear();
        b.items.clear();
        // The recording may have ended meanwhile: then nobody takes the buffers back.
        let _ = back.send((b.records, b.items));
    }
    Ended {
        out,
        failed: None,
        last_written,
    }
}

/// One round into the output, then its end.
fn write_batch(out: &mut Out, path: &std::path::Path, b: &Batch) -> Result<(), RecordError> {
    for item in &b.items {
        match *item {
            Item::Run { run, from, to } => write_run(out, path, &run, &b.records[from..to])?,
            Item::One {
                at,
                key,
                host,
                round,
            } => out.push(&Placed::exact(&b.records[at], key, host, round), path)?,
        }
    }
    out.round_end(b.snap)
}

/// A run's records: as many at once as the output takes ([`Out::push_run`]), each other
/// one on its own.
fn write_run(
    out: &mut Out,
    path: &std::path::Path,
    run: &ExactRun,
    records: &[GuestRecord],
) -> Result<(), RecordError> {
    let mut rest = records;
    while !rest.is_empty() {
        let n = out.push_run(run, rest)?;
        rest = &rest[n..];
        if let Some(r) = rest.first() {
            // Every record of a run is one its segment places.
            if let Some(host) = run.places(r) {
                out.push(&Placed::exact(r, run.key, host, run.round), path)?;
            }
            rest = &rest[1..];
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::jsonl::Line;
    use crate::record::place::State;
    use crate::record::target::Target;
    use crate::record::write::finish;
    use crate::record::{RecordFormat, place::boot_key};
    use crate::sync::Placement;

    /// A written line's guest tick, host tick, round, boot and payload.
    type Seen = (u64, u64, u64, Option<u32>, Vec<u8>);

    fn rec(vcpu: u32, index: u64, id: u16, tsc: u64) -> GuestRecord {
        GuestRecord {
            vcpu,
            id,
            tsc,
            len: 1,
            payload: [u8::try_from(index).unwrap(); 16],
        }
    }

    /// Rounds sent through the writer thread come out in order, each run's records at their
    /// guest tick minus the run's offset and each single record at its own host tick, with
    /// the record buffers handed back to be filled again.
    #[test]
    fn rounds_are_written_in_order_with_their_placements() {
        let d = tempfile::tempdir().unwrap();
        let target = Target::test(&d.path().join("out.jsonl"), RecordFormat::Jsonl);
        let out = Out::create(&target, Placement::OneSided).unwrap();
        let mut pipe = Pipe::start(out, target.out.clone()).unwrap();
        let key = boot_key(1, 0);
        let run = ExactRun {
            key,
            offset: 1000,
            start: 5000,
            round: 4,
        };
        for round in 0..3u64 {
            let base = round * 10;
            let records: Vec<GuestRecord> = (0..4)
                .map(|k| rec(0, base + k, 7, 10_000 + (base + k) * 100))
                .collect();
            pipe.items = vec![
                Item::Run {
                    run,
                    from: 0,
                    to: 3,
                },
                Item::One {
                    at: 3,
                    key,
                    host: 42 + round,
                    round: 2,
                },
            ];
            pipe.send_round(
                |spare| {
                    assert!(spare.is_empty(), "a buffer comes back emptied");
                    records
                },
                None,
            )
            .unwrap();
        }
        let (out, last) = pipe.finish().unwrap();
        assert!(last.is_some());
        let st = State::new(&[], None, Placement::OneSided);
        finish(out, &target, &st).unwrap();
        let lines: Vec<Line> = std::fs::read_to_string(&target.out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let got: Vec<Seen> = lines
            .iter()
            .map(|l| {
                (
                    l.guest_tsc,
                    l.host_tsc,
                    l.round,
                    l.boot,
                    l.payload.as_slice().to_vec(),
                )
            })
            .collect();
        let mut want = Vec::new();
        for round in 0..3u64 {
            let base = round * 10;
            for k in 0..3 {
                let g = 10_000 + (base + k) * 100;
                want.push((
                    g,
                    g - 1000,
                    4,
                    Some(1),
                    vec![u8::try_from(base + k).unwrap()],
                ));
            }
            let i = base + 3;
            want.push((
                10_000 + i * 100,
                42 + round,
                2,
                Some(1),
                vec![u8::try_from(i).unwrap()],
            ));
        }
        assert_eq!(got, want);
        assert!(
            lines
                .iter()
                .all(|l| l.host_lo == l.host_tsc && l.host_hi == l.host_tsc)
        );
    }
}
