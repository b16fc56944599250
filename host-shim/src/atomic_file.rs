//! Output files written atomically: the bytes go to a temporary file beside the target, which
//! is synced and then renamed into place, so a reader (or whatever a crash leaves) sees the
//! old file or the whole new one, never a part. A temporary file that is dropped uncommitted
//! is removed; a crash leaves at most a `.vmtsync-*.tmp` file beside the target. The one
//! exception is a live file ([`AtomicFile::live`], `vmtsync record`'s JSON Lines): it is
//! written at `OUT.partial`, to be followed while it grows, and kept by a run that ends early.
//!
//! Every output file goes through here (a CTF trace is a directory, which its writer renames
//! into place the same way), except the appended part of a sync file, which is read while it
//! is written (see [`crate::syncfile`] for why that is appended and how readers stay safe);
//! its creation (the header) goes through here too.

use std::fs::File;
use std::io::{self, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tempfile::NamedTempFile;

/// The mode of every file vmtsync writes (traces, sync files, plots: all for people and their
/// tools to read): 0644 like any file a program creates (the process's umask applies), where
/// tempfile's default for the temporary file would be 0600 and leave a trace recorded with
/// `sudo` unreadable to the user who asked for it.
pub const OUTPUT_MODE: u32 = 0o644;

/// A file being written to a temporary name beside `target`; [`AtomicFile::commit`] puts it in
/// place.
#[derive(Debug)]
pub struct AtomicFile {
    tmp: Temp,
    target: PathBuf,
}

/// Where the bytes wait until the commit.
#[derive(Debug)]
enum Temp {
    /// A randomly named file, removed when dropped uncommitted.
    Hidden(NamedTempFile),
    /// `<target>.partial`, kept when dropped uncommitted so a killed run leaves what it wrote.
    Live { file: File, path: PathBuf },
}

impl AtomicFile {
    /// Starts a file that will become `target`, in `target`'s directory (a rename is atomic
    /// only within one file system), in [`OUTPUT_MODE`].
    ///
    /// # Errors
    /// Creating the temporary file failed (the directory does not exist or is not writable).
    pub fn new(target: &Path) -> io::Result<Self> {
        let dir = match target.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let tmp = tempfile::Builder::new()
            .prefix(".vmtsync-")
            .suffix(".tmp")
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(OUTPUT_MODE))
            .tempfile_in(dir)?;
        Ok(Self {
            tmp: Temp::Hidden(tmp),
            target: target.to_owned(),
        })
    }

    /// A file written at the visible name `<target>.partial` (an existing one is truncated), so
    /// that it can be followed while it grows; unlike the other temporary files it is kept
    /// when dropped uncommitted, so a killed or failed run leaves every byte written so far.
    ///
    /// # Errors
    /// Creating `<target>.partial` failed.
    pub fn live(target: &Path) -> io::Result<Self> {
        let mut path = target.as_os_str().to_owned();
        path.push(".partial");
        let path = PathBuf::from(path);
        let file = File::create(&path)?;
        Ok(Self {
            tmp: Temp::Live { file, path },
            target: target.to_owned(),
        })
    }

    /// Syncs the bytes and renames the file over `target`, replacing any file there.
    ///
    /// # Errors
    /// Syncing or renaming failed; the target is then unchanged (and a hidden temporary file
    /// gone).
    pub fn commit(mut self) -> io::Result<()> {
        self.flush()?;
        self.as_file().sync_all()?;
        match self.tmp {
            Temp::Hidden(t) => t.persist(&self.target).map(drop).map_err(|e| e.error),
            Temp::Live { path, .. } => std::fs::rename(path, &self.target),
        }
    }

    /// Like [`AtomicFile::commit`], but only if `target` does not exist: `Ok(false)` (and the
    /// existing file untouched) if it does, e.g. because another writer created it meanwhile.
    ///
    /// # Errors
    /// Syncing or linking failed for another reason, or the file is a [`AtomicFile::live`]
    /// one (which has no no-replace commit).
    pub fn commit_new(mut self) -> io::Result<bool> {
        self.flush()?;
        self.as_file().sync_all()?;
        match self.tmp {
            Temp::Hidden(t) => match t.persist_noclobber(&self.target) {
                Ok(_) => Ok(true),
                Err(e) if e.error.kind() == io::ErrorKind::AlreadyExists => Ok(false),
                Err(e) => Err(e.error),
            },
            Temp::Live { .. } => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "a live file is committed with commit",
            )),
        }
    }
}

impl AtomicFile {
    /// The temporary file's path, for writers that re-read what they wrote before committing.
    #[must_use]
    pub fn path(&self) -> &Path {
        match &self.tmp {
            Temp::Hidden(t) => t.path(),
            Temp::Live { path, .. } => path,
        }
    }

    /// The temporary file, for writers that need more than [`Write`] and [`Seek`] (metadata,
    /// `set_len`).
    #[must_use]
    pub fn as_file(&self) -> &File {
        match &self.tmp {
            Temp::Hidden(t) => t.as_file(),
            Temp::Live { file, .. } => file,
        }
    }

    fn file_mut(&mut self) -> &mut File {
        match &mut self.tmp {
            Temp::Hidden(t) => t.as_file_mut(),
            Temp::Live { file, .. } => file,
        }
    }
}

impl Seek for AtomicFile {
    fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
        self.file_mut().seek(pos)
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file_mut().write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file_mut().flush()
    }
}

/// Writes `target` atomically with what `write` produces: all of it, or (on any error) none,
/// the previous file, if any, left as it was.
///
/// # Errors
/// The error of `write`, or of creating, syncing or renaming the temporary file.
pub fn write_atomically(
    target: &Path,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> io::Result<()> {
    let mut file = AtomicFile::new(target)?;
    let mut buffered = io::BufWriter::new(&mut file);
    write(&mut buffered)?;
    // Flushed here, not on drop, where an error would be lost and a short file committed.
    buffered.flush()?;
    drop(buffered);
    file.commit()
}

/// Checks that `path` has [`OUTPUT_MODE`] under this process's umask (from
/// `/proc/self/status`: reading it with `umask(2)` would change it for every thread a moment).
#[cfg(test)]
pub(crate) fn assert_output_mode(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let umask = status
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .map(|m| u32::from_str_radix(m.trim(), 8).unwrap())
        .expect("the kernel reports the umask");
    let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, OUTPUT_MODE & !umask, "{}: {mode:o}", path.display());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file written on the caller's thread asks for no sync until `SYNC_START` after its
    /// first write, however much is written; the first then takes everything written until
    /// then, and the next waits for `SYNC_EVERY` more bytes. One with a writing thread asks at
    /// its first `SYNC_EVERY` bytes.
    #[test]
    fn the_first_sync_waits_for_sync_start_and_takes_everything_before() {
        let d = tempfile::tempdir().unwrap();
        let f = File::create(d.path().join("f")).unwrap();
        let mut w = io::sink();
        let t0 = Instant::now();
        let mut threaded = Syncer::start(&f, Duration::ZERO).unwrap();
        threaded.wrote_at(&mut w, SYNC_EVERY, t0).unwrap();
        assert_eq!(threaded.unsynced, 0, "no sync asked for at SYNC_EVERY");
        threaded.finish().unwrap();
        let (mut here, _) = BackgroundFile::on_this_thread(f.try_clone().unwrap(), 0).unwrap();
        let How::Here(Some((_, s))) = &mut here.how else {
            panic!("not written on this thread");
        };
        s.wrote_at(&mut w, SYNC_EVERY, t0).unwrap();
        s.wrote_at(&mut w, 2 * SYNC_EVERY, t0 + SYNC_START / 2)
            .unwrap();
        assert_eq!(
            s.unsynced,
            3 * SYNC_EVERY,
            "asked for a sync before SYNC_START"
        );
        s.wrote_at(&mut w, 1, t0 + SYNC_START).unwrap();
        assert_eq!(s.unsynced, 0, "no sync asked for at SYNC_START");
        s.wrote_at(&mut w, SYNC_EVERY - 1, t0 + 2 * SYNC_START)
            .unwrap();
        assert_eq!(
            s.unsynced,
            SYNC_EVERY - 1,
            "asked for a sync before SYNC_EVERY more"
        );
        s.finish().unwrap();
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// On a writing thread or on the caller's: every buffer in order, and a file dropped
    /// unfinished leaves nothing.
    #[test]
    fn a_background_file_writes_every_buffer_in_order_and_a_dropped_one_leaves_nothing() {
        type Start = fn(AtomicFile, usize) -> io::Result<(BackgroundFile, Vec<u8>)>;
        let ways: [(&str, Start); 2] = [
            ("a writing thread", BackgroundFile::new),
            ("this thread", BackgroundFile::on_this_thread),
        ];
        for (way, start) in ways {
            let dir = tempfile::tempdir().unwrap();
            let target = dir.path().join("out");
            let (mut w, mut buf) = start(AtomicFile::new(&target).unwrap(), 64).unwrap();
            let mut want = Vec::new();
            for i in 0..1000u32 {
                // Buffers come back stale: every byte written is set here first.
                let len = usize::try_from(i % 65).unwrap();
                for (k, b) in buf.iter_mut().enumerate().take(len) {
                    *b = u8::try_from((i as usize + k) % 251).unwrap();
                }
                want.extend_from_slice(&buf[..len]);
                buf = w.submit(buf, len).unwrap();
                assert_eq!(buf.len(), 64, "{way}");
            }
            w.finish().unwrap().commit().unwrap();
            assert_eq!(std::fs::read(&target).unwrap(), want, "{way}");
            // Dropped without finishing: the threads end and its temporary file goes.
            let other = dir.path().join("other");
            let (mut w, buf) = start(AtomicFile::new(&other).unwrap(), 8).unwrap();
            let _ = w.submit(buf, 8).unwrap();
            drop(w);
            assert_eq!(names(dir.path()), ["out"], "{way}");
        }
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out.dat");
        write_atomically(&target, |w| w.write_all(b"first")).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"first");
        let err = write_atomically(&target, |w| {
            w.write_all(b"half of the second")?;
            Err(io::Error::other("the exporter failed"))
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "the exporter failed");
        assert_eq!(std::fs::read(&target).unwrap(), b"first", "old file intact");
        assert_eq!(names(dir.path()), ["out.dat"], "no temporary file left");
        write_atomically(&target, |w| w.write_all(b"second")).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"second");
        assert_output_mode(&target);
    }

    #[test]
    fn commit_new_never_replaces_an_existing_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("sync.jsonl");
        let mut a = AtomicFile::new(&target).unwrap();
        a.write_all(b"mine").unwrap();
        let mut b = AtomicFile::new(&target).unwrap();
        b.write_all(b"theirs").unwrap();
        assert!(b.commit_new().unwrap());
        assert!(!a.commit_new().unwrap());
        assert_eq!(std::fs::read(&target).unwrap(), b"theirs");
        assert_eq!(names(dir.path()), ["sync.jsonl"]);
    }
}

/// An [`AtomicFile`] (or any file) written a buffer at a time, by default on a second thread,
/// so that the kernel's copy of each buffer into the page cache runs beside the caller's
/// encoding of the next (on another core) rather than after it. Two buffers exist, the
/// caller's and the one being written: memory stays constant, and a caller faster than the
/// disk waits for the free buffer. A trace.dat's data section goes to a clone of its file's
/// handle. [`BackgroundFile::on_this_thread`] writes each buffer on the caller's thread
/// instead, for a caller that already runs beside what produces its data: there a third busy
/// thread on few cores would only wait for the other two.
/// Either way a [`Syncer`] syncs the file's data every [`SYNC_EVERY`] bytes on a thread of
/// its own (written on the caller's thread, from [`SYNC_START`] after the first write on), so
/// the sync before the rename finds little left to write and neither the caller nor a writing
/// thread waits for the disk.
#[derive(Debug)]
pub struct BackgroundFile<W: Write + SyncData + Send + 'static = AtomicFile> {
    how: How<W>,
}

/// Where a [`BackgroundFile`]'s buffers are written.
#[derive(Debug)]
enum How<W: Write + SyncData + Send + 'static> {
    Thread {
        /// Full buffers and how many of their bytes to write (`None` once finished).
        full: Option<SyncSender<(Vec<u8>, usize)>>,
        /// Buffers the thread has written, back for reuse.
        free: Receiver<Vec<u8>>,
        /// The writing thread: the file back, or the first write error.
        thread: Option<JoinHandle<io::Result<W>>>,
    },
    /// On the caller's thread (`None` once finished).
    Here(Option<(W, Syncer)>),
}

/// A file whose written data can be synced from another thread (`fdatasync` on a second
/// handle of it).
pub trait SyncData {
    /// A second handle of the same open file.
    ///
    /// # Errors
    /// The handle could not be duplicated.
    fn sync_handle(&self) -> io::Result<File>;
}

impl SyncData for File {
    fn sync_handle(&self) -> io::Result<File> {
        self.try_clone()
    }
}

impl SyncData for AtomicFile {
    fn sync_handle(&self) -> io::Result<File> {
        self.as_file().try_clone()
    }
}

/// Syncs a file's data on a thread of its own every [`SYNC_EVERY`] bytes written (skipped
/// while that thread is still at the last one: the next sync takes both), so the disk writes
/// while the writer works and the sync before the rename finds little left, without the writer
/// waiting for the disk ([`BackgroundFile`]'s, in either of its ways). The first sync may be
/// told to wait a while after the first write; it then takes everything written until then.
#[derive(Debug)]
struct Syncer {
    tx: Option<SyncSender<()>>,
    thread: Option<JoinHandle<io::Result<()>>>,
    unsynced: usize,
    /// When the first bytes were written.
    first_write: Option<Instant>,
    /// How long after the first write the first sync waits.
    wait: Duration,
}

impl Syncer {
    /// Starts the syncing thread on a second handle of `file`; no sync is asked for until
    /// `wait` after the first write.
    ///
    /// # Errors
    /// The handle could not be duplicated or the thread not started.
    fn start(file: &impl SyncData, wait: Duration) -> io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel::<()>(1);
        let handle = file.sync_handle()?;
        let thread = std::thread::Builder::new()
            .name("vmtsync-sync".into())
            .spawn(move || -> io::Result<()> {
                for () in rx {
                    handle.sync_data()?;
                }
                Ok(())
            })?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            unsynced: 0,
            first_write: None,
            wait,
        })
    }

    /// `len` more bytes were written to the file through `writer`: every [`SYNC_EVERY`] bytes,
    /// from the wait after the first write on, `writer` is flushed and a sync asked for.
    ///
    /// # Errors
    /// The flush's error, or the syncing thread's once it has ended.
    fn wrote(&mut self, writer: &mut impl Write, len: usize) -> io::Result<()> {
        self.wrote_at(writer, len, Instant::now())
    }

    /// [`Self::wrote`] at `now`.
    fn wrote_at(&mut self, writer: &mut impl Write, len: usize, now: Instant) -> io::Result<()> {
        self.unsynced += len;
        let first = *self.first_write.get_or_insert(now);
        if self.unsynced < SYNC_EVERY || now.saturating_duration_since(first) < self.wait {
            return Ok(());
        }
        writer.flush()?;
        match self.tx.as_ref().map(|t| t.try_send(())) {
            Some(Ok(())) => self.unsynced = 0,
            // Still syncing the last: the next one takes both.
            Some(Err(TrySendError::Full(()))) => {}
            // The thread ended: its error.
            Some(Err(TrySendError::Disconnected(()))) | None => return self.finish(),
        }
        Ok(())
    }

    /// Waits for the last sync asked for; the thread's first error.
    ///
    /// # Errors
    /// A failed sync.
    fn finish(&mut self) -> io::Result<()> {
        self.tx = None;
        match self.thread.take() {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the syncing thread panicked"))),
            None => Ok(()),
        }
    }
}

/// How many bytes a [`BackgroundFile`] writes between two syncs of its data. Smaller syncs
/// cost a drain that writes at the same time less than larger ones do (lab, on two cores: a
/// Perfetto recording of 4 M events drained about a tenth faster with 16 MiB than with 32).
pub const SYNC_EVERY: usize = 16 << 20;

/// How long after its first write a [`BackgroundFile`] written on the caller's thread
/// ([`BackgroundFile::on_this_thread`]) asks for its first sync (which takes everything written
/// until then). Such a file's writer runs beside what produces its data, on the other core (a
/// memory recording's format thread beside its reading), and a recording's heaviest moment is
/// usually its start, the backlog found in the guest's rings, drained back to back: on two
/// cores, the disk's writeback during the drain of a full 4 Mi-record ring into trace.dat made
/// it about a third slower, and the whole run no shorter. A file with a writing thread of its
/// own syncs from the start: there the overlap with the disk is worth more (a Perfetto export
/// of 1 Mi events took a fifth longer when its first sync waited 50 ms).
pub const SYNC_START: Duration = Duration::from_millis(50);

impl<W: Write + SyncData + Send + 'static> BackgroundFile<W> {
    /// Starts the thread writing to `file`; returns it and the caller's first buffer (of
    /// `buf_len` zero bytes; a second one waits in the pool).
    ///
    /// # Errors
    /// The thread could not be started.
    pub fn new(mut file: W, buf_len: usize) -> io::Result<(Self, Vec<u8>)> {
        let (full_tx, full_rx) = mpsc::sync_channel::<(Vec<u8>, usize)>(1);
        let (free_tx, free_rx) = mpsc::sync_channel::<Vec<u8>>(2);
        // Cannot fail: the channel has room for both buffers and its receiver is here.
        let _ = free_tx.send(vec![0; buf_len]);
        let mut syncer = Syncer::start(&file, Duration::ZERO)?;
        let thread = std::thread::Builder::new()
            .name("vmtsync-write".into())
            .spawn(move || {
                for (buf, len) in full_rx {
                    file.write_all(buf.get(..len).unwrap_or(&buf))?;
                    if free_tx.send(buf).is_err() {
                        break;
                    }
                    syncer.wrote(&mut file, len)?;
                }
                syncer.finish()?;
                Ok(file)
            })?;
        let how = How::Thread {
            full: Some(full_tx),
            free: free_rx,
            thread: Some(thread),
        };
        Ok((Self { how }, vec![0; buf_len]))
    }

    /// Like [`Self::new`], but each buffer is written on the caller's thread when submitted
    /// (only the syncs run on a thread of their own, the first [`SYNC_START`] after the first
    /// write); the caller's buffer comes back from [`Self::submit`] to be filled again.
    ///
    /// # Errors
    /// The syncing thread could not be started.
    pub fn on_this_thread(file: W, buf_len: usize) -> io::Result<(Self, Vec<u8>)> {
        let syncer = Syncer::start(&file, SYNC_START)?;
        let how = How::Here(Some((file, syncer)));
        Ok((Self { how }, vec![0; buf_len]))
    }

    /// Writes the first `len` bytes of `buf` (or hands them to the thread) and returns a free
    /// buffer (its contents stale); with a writing thread, waits until it has written the
    /// buffer before.
    ///
    /// # Errors
    /// The write error (the file is then incomplete; nothing more is written).
    pub fn submit(&mut self, buf: Vec<u8>, len: usize) -> io::Result<Vec<u8>> {
        match &mut self.how {
            How::Thread { full, free, .. } => {
                let sent = full.as_ref().is_some_and(|t| t.send((buf, len)).is_ok());
                match free.recv() {
                    Ok(b) if sent => Ok(b),
                    _ => Err(self
                        .stop()
                        .err()
                        .unwrap_or_else(|| io::Error::other("the writing thread ended"))),
                }
            }
            How::Here(Some((file, syncer))) => {
                file.write_all(buf.get(..len).unwrap_or(&buf))?;
                syncer.wrote(file, len)?;
                Ok(buf)
            }
            How::Here(None) => Err(io::Error::other("the file was finished")),
        }
    }

    /// Waits until every submitted buffer is written (and the last sync has ended) and
    /// returns the file (to commit).
    ///
    /// # Errors
    /// The first write or sync error.
    pub fn finish(mut self) -> io::Result<W> {
        self.stop()
    }

    /// Ends the writing (and the syncing) thread and joins it.
    fn stop(&mut self) -> io::Result<W> {
        match &mut self.how {
            How::Thread { full, thread, .. } => {
                *full = None;
                match thread.take() {
                    Some(t) => t
                        .join()
                        .unwrap_or_else(|_| Err(io::Error::other("the writing thread panicked"))),
                    None => Err(io::Error::other("the writing thread has ended")),
                }
            }
            How::Here(here) => {
                let (file, mut syncer) = here
                    .take()
                    .ok_or_else(|| io::Error::other("the file was finished"))?;
                syncer.finish()?;
                Ok(file)
            }
        }
    }
}

impl<W: Write + SyncData + Send + 'static> Drop for BackgroundFile<W> {
    /// Without [`BackgroundFile::finish`]: the thread ends (and an [`AtomicFile`]'s temporary
    /// file is removed).
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
