//! The streaming trace.dat writer (v6 and v7) for guest events.
//!
//! Memory is constant in the number of events: one 4 KiB page per CPU plus fixed write
//! buffers. Pages go to disk as they fill. v7 streams CPU 0 straight into the output's
//! flyrecord section and every other CPU into an anonymous spill file beside the output; at
//! [`TraceDatWriter::finish`] the spills are appended (`copy_file_range`, no user-space copy),
//! because trace-cmd needs each CPU's pages contiguous and the flyrecord section contiguous
//! with the sections around it. v6 puts its options (with the TIME_SHIFT, known only at the
//! end) before the data, so all CPUs spill and the file is assembled at the end.
//!
//! The output is written to a temporary file in the target's directory, synced and only then
//! renamed over the target: a failed or abandoned write never leaves a partial file under the
//! target name. Reading it back is not part of writing it: [`Summary::verify`] does that for tests and
//! for callers that want it (layout, every page, every event count).

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::atomic_file::{AtomicFile, BackgroundFile};

use super::consts::{PAGE_SIZE, PAGE_SIZE_U32, SECTION_HEADER_SIZE, Tsc2Nsec, option};
use super::error::TraceDatError;
use super::format::{
    EVENT_DATA_FORMAT, EVENT_FORMAT, FUNCGRAPH_ENTRY_FORMAT, FUNCGRAPH_EXIT_FORMAT, HEADER_EVENT,
    HEADER_PAGE, MAX_PAYLOAD, SPAN_ORPHAN_FORMAT, SYSTEM,
};
use super::page::{Padded, PageBuf, Stop};
use super::reader;
use super::timeshift::{self, TimeShift};

/// The clock our timestamps are in: raw TSC ticks, which trace-cmd displays unconverted.
pub const CLOCK: &str = "x86-tsc";

/// Write buffer of the output.
const WRITE_BUF: usize = 256 * 1024;
/// Write buffer of each spill file (16 pages per write; one per vCPU, so kept smaller).
const SPILL_BUF: usize = 64 * 1024;

/// trace.dat file version.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FileVersion {
    /// Version 6: one metadata run, options, then the CPU data.
    V6,
    /// Version 7 (trace-cmd 3.x default): sections, options sections at the end.
    #[default]
    V7,
}

/// What the writer is created with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriterOptions {
    /// File version.
    pub version: FileVersion,
    /// Trace CPUs (one per vCPU).
    pub cpus: u32,
    /// This trace's TRACEID; a host file's GUEST option names it.
    pub trace_id: u64,
    /// Free text written as the UNAME option (`trace-cmd report --uname` shows it), e.g. the
    /// guest's name, or a note that timestamps were pre-converted.
    pub uname: Option<String>,
    /// The largest TIME_SHIFT error, in ticks, [`TraceDatWriter::finish`] accepts.
    pub max_shift_error: u64,
    /// A TSC2NSEC option to write. A host trace recorded with `--tsc2nsec` shows nanoseconds;
    /// giving the guest file the host's values ([`reader::Layout::tsc2nsec`]) makes trace-cmd
    /// convert the guest's shifted ticks the same way, so a merge stays aligned.
    pub tsc2nsec: Option<Tsc2Nsec>,
    /// Write v7's first CPU's pages on the caller's thread, not on a writing thread of their
    /// own (the data is still synced in the background): for a caller that already runs
    /// beside what produces its records, such as a memory recording's writer thread.
    pub write_here: bool,
}

impl WriterOptions {
    /// v7, `cpus` CPUs, the given TRACEID, no UNAME, at most 1 tick of TIME_SHIFT error.
    #[must_use]
    pub const fn new(cpus: u32, trace_id: u64) -> Self {
        Self {
            version: FileVersion::V7,
            cpus,
            trace_id,
            uname: None,
            max_shift_error: 1,
            tsc2nsec: None,
            write_here: false,
        }
    }
}

/// What [`TraceDatWriter::finish`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// The output file.
    pub path: PathBuf,
    /// Its length in bytes.
    pub bytes: u64,
    /// Events per CPU.
    pub events: Vec<u64>,
    /// Ring-buffer pages per CPU.
    pub pages: Vec<u64>,
    /// `(first, last)` timestamp per CPU, `None` for a CPU without events.
    pub ranges: Vec<Option<(u64, u64)>>,
    /// Per CPU, the worst-case TIME_SHIFT error in ticks (`None` without TIME_SHIFT).
    pub shift_error: Option<Vec<u64>>,
    /// Per CPU, the offset and size of its data in the file.
    pub table: Vec<(u64, u64)>,
    /// The TRACEID written.
    pub trace_id: u64,
}

/// Where a CPU's pages go while streaming.
#[derive(Debug)]
enum Sink {
    /// Straight into the output (v7 CPU 0).
    Main,
    /// An anonymous temporary file, appended at the end.
    Spill(BufWriter<File>),
}

#[derive(Debug)]
struct Cpu {
    page: PageBuf,
    sink: Sink,
    pages: u64,
    events: u64,
    first: u64,
    last: u64,
}

/// v7 positions to patch at the end.
#[derive(Debug)]
struct V7 {
    /// File offset of the header's "first options section" field.
    options_ptr: u64,
    /// (option id, section offset) of the metadata sections.
    meta: Vec<(u16, u64)>,
    /// Offset of the flyrecord section header.
    flyrecord: u64,
    /// Offset of CPU 0's data (page aligned).
    data_start: u64,
}

/// A streaming writer of one guest trace.dat; see the [module docs](super).
#[derive(Debug)]
pub struct TraceDatWriter {
    path: PathBuf,
    tmp: AtomicFile,
    out: BufWriter<File>,
    pos: u64,
    opts: WriterOptions,
    cpus: Vec<Cpu>,
    strings: Strings,
    v7: Option<V7>,
    /// The kallsyms text ([`Self::set_kallsyms`]), written at the end.
    kallsyms: String,
    /// The saved command lines text ([`Self::set_cmdlines`]), written at the end.
    cmdlines: String,
    /// v7's CPU 0 pages, on their way into the output.
    main: MainPages,
}

/// Pages of v7's first CPU, which go straight into the output a [`MAIN_BUF`] at a time
/// through a [`BackgroundFile`]: that CPU's [`PageBuf`] fills them in a store of that size,
/// handed over whole (no copy) once every page of it is sealed; by default a second thread
/// writes it, so the kernel's copy into the page cache runs beside the encoding of the next
/// pages; with [`WriterOptions::write_here`], the caller's thread
/// ([`BackgroundFile::on_this_thread`]). Started at the first store, once the header before it
/// is flushed; both write through one open file, so they share its position.
#[derive(Debug, Default)]
struct MainPages {
    bg: Option<BackgroundFile<File>>,
    write_here: bool,
}

/// Bytes of [`MainPages`]' stores (two exist).
const MAIN_BUF: usize = 1 << 20;

impl MainPages {
    fn new(write_here: bool) -> Self {
        Self {
            bg: None,
            write_here,
        }
    }

    /// Writes the sealed pages of `page`'s store and gives it a free one.
    fn submit(&mut self, out: &mut BufWriter<File>, page: &mut PageBuf) -> std::io::Result<()> {
        let sealed = match page.sealed() {
            0 => page.pages(),
            n => n,
        };
        let bg = match &mut self.bg {
            Some(bg) => bg,
            None => {
                out.flush()?;
                let file = out.get_ref().try_clone()?;
                // The buffer it makes first is not needed: the page's store is the first.
                let (bg, _) = if self.write_here {
                    BackgroundFile::on_this_thread(file, 0)?
                } else {
                    BackgroundFile::new(file, MAIN_BUF)?
                };
                self.bg.insert(bg)
            }
        };
        let full = page.take_store(Vec::new());
        let free = bg.submit(full, sealed * PAGE_SIZE)?;
        page.take_store(free);
        Ok(())
    }

    /// Writes the sealed pages of `page` (the first CPU's, after its last page was sealed)
    /// and waits until every page is in the file.
    fn finish(
        &mut self,
        out: &mut BufWriter<File>,
        page: Option<&mut PageBuf>,
    ) -> std::io::Result<()> {
        if let Some(p) = page.filter(|p| p.sealed() > 0) {
            self.submit(out, p)?;
        }
        if let Some(bg) = self.bg.take() {
            bg.finish()?;
        }
        Ok(())
    }
}

impl TraceDatWriter {
    /// Starts a trace.dat that will replace `path` at [`Self::finish`].
    ///
    /// # Errors
    /// `NoCpus`, or `Io` if the temporary files cannot be created beside `path`.
    pub fn create(path: &Path, opts: WriterOptions) -> Result<Self, TraceDatError> {
        let write_here = opts.write_here;
        if opts.cpus == 0 {
            return Err(TraceDatError::NoCpus);
        }
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let tmp =
            AtomicFile::new(path).map_err(TraceDatError::io("create a temporary file in", &dir))?;
        let file = tmp
            .as_file()
            .try_clone()
            .map_err(TraceDatError::io("open", tmp.path()))?;
        let mut cpus = Vec::with_capacity(opts.cpus as usize);
        for i in 0..opts.cpus {
            let (sink, page) = if i == 0 && opts.version == FileVersion::V7 {
                (Sink::Main, PageBuf::with_pages(MAIN_BUF / PAGE_SIZE))
            } else {
                let f = tempfile::tempfile_in(&dir)
                    .map_err(TraceDatError::io("create a spill file in", &dir))?;
                (
                    Sink::Spill(BufWriter::with_capacity(SPILL_BUF, f)),
                    PageBuf::new(),
                )
            };
            cpus.push(Cpu {
                page,
                sink,
                pages: 0,
                events: 0,
                first: 0,
                last: 0,
            });
        }
        let mut w = Self {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(WRITE_BUF, file),
            tmp,
            pos: 0,
            opts,
            cpus,
            strings: Strings::default(),
            v7: None,
            kallsyms: String::new(),
            cmdlines: String::new(),
            main: MainPages::new(write_here),
        };
        if w.opts.version == FileVersion::V7 {
            w.start_v7()?;
        }
        Ok(w)
    }

    /// Appends an event: `cpu`'s raw guest TSC `ts`, the event `id` and up to 16 payload bytes.
    ///
    /// Timestamps must not decrease on a CPU: a ring-buffer page stores forward deltas only,
    /// so a backwards timestamp is refused (`NotMonotonic`, nothing written) rather than
    /// clamped or reordered. The caller decides: sort, drop, or start a new file.
    ///
    /// # Errors
    /// `CpuOutOfRange`, `PayloadTooLong`, `NotMonotonic`, or `Io` when a full page cannot be
    /// written.
    #[inline]
    pub fn push(
        &mut self,
        cpu: u32,
        ts: u64,
        id: u32,
        payload: &[u8],
    ) -> Result<(), TraceDatError> {
        if payload.len() > MAX_PAYLOAD {
            return Err(TraceDatError::PayloadTooLong {
                len: payload.len(),
                max: MAX_PAYLOAD,
            });
        }
        self.append(
            cpu,
            [ts],
            |&ts| Ok(ts),
            |page, &ts| page.try_push(ts, id, payload),
        )
    }

    /// Appends `event(r)` to `cpu` for each `r` of `recs` in turn, as [`Self::push`] of each
    /// would, while it is `Some` and not before the CPU's last event: a run of the memory
    /// path's plain records, checked and written in one pass. Returns how many it wrote, and
    /// the error that stopped it if one did (the events before it are written).
    ///
    /// # Errors
    /// `CpuOutOfRange`, `PayloadTooLong`, `Io`.
    pub fn push_padded_while<R>(
        &mut self,
        cpu: u32,
        recs: &[R],
        event: impl Fn(&R) -> Option<Padded>,
    ) -> (usize, Result<(), TraceDatError>) {
        let mut n = 0;
        while let Some(r) = recs.get(n) {
            let Some(c) = self.cpus.get_mut(cpu as usize) else {
                let cpus = self.opts.cpus;
                return (n, Err(TraceDatError::CpuOutOfRange { cpu, cpus }));
            };
            // Onto a page that has events, as many as fit it plainly, in one loop.
            let e = if c.page.is_empty() {
                match event(r) {
                    Some(e) => e,
                    None => break,
                }
            } else {
                let (k, stop) = c.page.fill_padded(&recs[n..], &event);
                c.events += k as u64;
                c.last = c.page.last_ts();
                n += k;
                match stop {
                    Stop::End | Stop::Refused => break,
                    Stop::General(e) => e,
                }
            };
            // The event that starts a page or needs a time extend, as `push` takes it (one
            // before the CPU's last ends the run instead).
            if c.events > 0 && e.ts < c.last {
                break;
            }
            let pushed = self.append(
                cpu,
                [e],
                |e| {
                    if e.len > MAX_PAYLOAD {
                        return Err(TraceDatError::PayloadTooLong {
                            len: e.len,
                            max: MAX_PAYLOAD,
                        });
                    }
                    Ok(e.ts)
                },
                |page, e| page.try_push_padded(e.ts, e.id, e.len, &e.payload),
            );
            if let Err(err) = pushed {
                return (n, Err(err));
            }
            n += 1;
        }
        (n, Ok(()))
    }

    /// Appends a record of one of the other event types the file describes (the function
    /// graph's, [`super::funcgraph`]): `data` from `common_type` on, a multiple of 4 bytes
    /// from 8 to 112. The same ordering rule as [`Self::push`].
    ///
    /// # Errors
    /// `CpuOutOfRange`, `PayloadTooLong` (a record of the wrong size), `NotMonotonic`, `Io`.
    pub fn push_raw(&mut self, cpu: u32, ts: u64, data: &[u8]) -> Result<(), TraceDatError> {
        let max = 4 * super::consts::TYPE_DATA_MAX as usize;
        if !data.len().is_multiple_of(4) || !(8..=max).contains(&data.len()) {
            return Err(TraceDatError::PayloadTooLong {
                len: data.len(),
                max,
            });
        }
        self.append(
            cpu,
            [ts],
            |&ts| Ok(ts),
            |page, &ts| page.try_push_raw(ts, data),
        )
    }

    /// What [`Self::push`], [`Self::push_raw`] and the events [`Self::push_padded_while`]
    /// cannot put on a page plainly share: CPU `cpu`'s buffer takes each item in turn, at the
    /// timestamp `check` returns (in order), through `try_push`, on a fresh page when the
    /// current one is full. Stops at the first error.
    #[inline]
    fn append<T>(
        &mut self,
        cpu: u32,
        items: impl IntoIterator<Item = T>,
        check: impl Fn(&T) -> Result<u64, TraceDatError>,
        try_push: impl Fn(&mut super::page::PageBuf, &T) -> bool,
    ) -> Result<(), TraceDatError> {
        let ncpus = self.opts.cpus;
        let Self {
            cpus,
            out,
            pos,
            tmp,
            main,
            ..
        } = self;
        // Not `ok_or`: the error would be built (and dropped) for every record.
        let Some(c) = cpus.get_mut(cpu as usize) else {
            return Err(TraceDatError::CpuOutOfRange { cpu, cpus: ncpus });
        };
        for item in items {
            let ts = check(&item)?;
            if c.events > 0 && ts < c.last {
                return Err(TraceDatError::NotMonotonic {
                    cpu,
                    ts,
                    last: c.last,
                });
            }
            if !try_push(&mut c.page, &item) {
                flush_page(c, out, main, pos).map_err(TraceDatError::io("write", tmp.path()))?;
                let pushed = try_push(&mut c.page, &item);
                debug_assert!(pushed, "a record always fits an empty page");
            }
            if c.events == 0 {
                c.first = ts;
            }
            c.events += 1;
            c.last = ts;
        }
        Ok(())
    }

    /// The file's kallsyms text (`/proc/kallsyms` lines, `ADDR TYPE NAME`): what trace-cmd
    /// names function addresses with. Written by [`Self::finish`].
    pub fn set_kallsyms(&mut self, text: String) {
        self.kallsyms = text;
    }

    /// The file's saved command lines (`PID COMM` lines): the names trace-cmd shows for the
    /// records' `common_pid`. Written by [`Self::finish`].
    pub fn set_cmdlines(&mut self, text: String) {
        self.cmdlines = text;
    }

    /// Replaces the UNAME option's text (written by [`Self::finish`]): a streaming caller
    /// names its CPUs once it knows them all.
    pub fn set_uname(&mut self, text: String) {
        self.opts.uname = Some(text);
    }

    /// Adds a trace CPU after the ones the writer was created with (spilled like every CPU
    /// but v7's first) and returns its number.
    ///
    /// # Errors
    /// `Io` if its spill file cannot be created.
    pub fn add_cpu(&mut self) -> Result<u32, TraceDatError> {
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let f = tempfile::tempfile_in(&dir)
            .map_err(TraceDatError::io("create a spill file in", &dir))?;
        self.cpus.push(Cpu {
            page: PageBuf::new(),
            sink: Sink::Spill(BufWriter::with_capacity(SPILL_BUF, f)),
            pages: 0,
            events: 0,
            first: 0,
            last: 0,
        });
        self.opts.cpus += 1;
        Ok(self.opts.cpus - 1)
    }

    /// Events pushed so far per CPU.
    #[must_use]
    pub fn events(&self) -> Vec<u64> {
        self.cpus.iter().map(|c| c.events).collect()
    }

    /// Each CPU's `(first, last)` timestamp so far.
    #[must_use]
    pub fn ranges(&self) -> Vec<Option<(u64, u64)>> {
        self.cpus
            .iter()
            .map(|c| (c.events > 0).then_some((c.first, c.last)))
            .collect()
    }

    /// The worst-case error trace-cmd would make with `shift` over the events pushed so far,
    /// per CPU, without writing anything (the same computation `finish` checks against
    /// [`WriterOptions::max_shift_error`]).
    ///
    /// # Errors
    /// The [`timeshift::TimeShiftError`] `finish` would return (except `AboveLimit`).
    pub fn shift_error(&self, shift: &TimeShift) -> Result<Vec<u64>, TraceDatError> {
        Ok(timeshift::encode(shift, &self.ranges(), u64::MAX)?.1)
    }

    /// Writes the remaining pages, the TIME_SHIFT (if any) and the metadata, and renames the
    /// file over the target (synced first). [`Summary::verify`] reads it back.
    ///
    /// # Errors
    /// `TimeShift` (the file is not written: the caller may pre-convert and write again), or
    /// `Io`.
    pub fn finish(mut self, shift: Option<&TimeShift>) -> Result<Summary, TraceDatError> {
        let ranges = self.ranges();
        let (shift_bytes, shift_error) = match shift {
            Some(s) => {
                let (b, e) = timeshift::encode(s, &ranges, self.opts.max_shift_error)?;
                (Some(b), Some(e))
            }
            None => (None, None),
        };
        let tmp_path = self.tmp.path().to_path_buf();
        let io = |what| TraceDatError::io(what, &tmp_path);
        for c in &mut self.cpus {
            if !c.page.is_empty() {
                flush_page(c, &mut self.out, &mut self.main, &mut self.pos).map_err(io("write"))?;
            }
        }
        let main_page = match self.cpus.first_mut() {
            Some(c) if matches!(c.sink, Sink::Main) => Some(&mut c.page),
            _ => None,
        };
        self.main
            .finish(&mut self.out, main_page)
            .map_err(io("write"))?;
        let table = match self.opts.version {
            FileVersion::V7 => self.finish_v7(shift_bytes.as_deref())?,
            FileVersion::V6 => self.finish_v6(shift_bytes.as_deref())?,
        };
        self.out.flush().map_err(io("write"))?;
        let bytes = self.pos;
        let trace_id = self.opts.trace_id;
        let Self {
            tmp, path, cpus, ..
        } = self;
        tmp.commit().map_err(|source| TraceDatError::Io {
            what: "rename the finished trace onto",
            path: path.clone(),
            source,
        })?;
        Ok(Summary {
            path,
            bytes,
            events: cpus.iter().map(|c| c.events).collect(),
            pages: cpus.iter().map(|c| c.pages).collect(),
            ranges,
            shift_error,
            table,
            trace_id,
        })
    }

    fn write(&mut self, b: &[u8]) -> Result<(), TraceDatError> {
        self.out
            .write_all(b)
            .map_err(TraceDatError::io("write", self.tmp.path()))?;
        self.pos += b.len() as u64;
        Ok(())
    }

    /// Overwrites bytes already written (positions the header or a table left open).
    fn patch(&mut self, at: u64, b: &[u8]) -> Result<(), TraceDatError> {
        self.out
            .flush()
            .map_err(TraceDatError::io("write", self.tmp.path()))?;
        self.out
            .get_ref()
            .write_all_at(b, at)
            .map_err(TraceDatError::io("write", self.tmp.path()))
    }

    fn pad_to_page(&mut self) -> Result<(), TraceDatError> {
        let pad = self.pos.next_multiple_of(PAGE_SIZE as u64) - self.pos;
        self.write(&vec![0; usize::try_from(pad).unwrap_or(0)])
    }

    /// Appends every spilled CPU's pages, returning each CPU's (offset, size).
    fn append_spills(
        &mut self,
        first_offset: Option<u64>,
    ) -> Result<Vec<(u64, u64)>, TraceDatError> {
        let io = |what| TraceDatError::io(what, self.tmp.path());
        let mut table = Vec::with_capacity(self.cpus.len());
        self.out.flush().map_err(io("write"))?;
        for i in 0..self.cpus.len() {
            let size = self.cpus[i].pages * PAGE_SIZE as u64;
            match std::mem::replace(&mut self.cpus[i].sink, Sink::Main) {
                Sink::Main => table.push((first_offset.unwrap_or(self.pos), size)),
                Sink::Spill(w) => {
                    let mut f = w.into_inner().map_err(|e| TraceDatError::Io {
                        what: "write a spill file for",
                        path: self.path.clone(),
                        source: e.into_error(),
                    })?;
                    f.seek(SeekFrom::Start(0))
                        .map_err(io("read a spill file for"))?;
                    let copied = std::io::copy(&mut f, self.out.get_mut())
                        .map_err(io("copy CPU data into"))?;
                    if copied != size {
                        return Err(TraceDatError::Verify {
                            path: self.path.clone(),
                            reason: format!(
                                "CPU {i}: spill file holds {copied} bytes, expected {size}"
                            ),
                        });
                    }
                    table.push((self.pos, size));
                    self.pos += size;
                }
            }
        }
        Ok(table)
    }

    fn header(version: &str) -> Vec<u8> {
        let mut b = Vec::with_capacity(64);
        b.extend_from_slice(&super::consts::MAGIC);
        b.extend_from_slice(super::consts::TRACING);
        b.extend_from_slice(version.as_bytes());
        b.push(0);
        // Little endian, 8-byte longs, the page size.
        b.extend_from_slice(&[0, 8]);
        b.extend_from_slice(&PAGE_SIZE_U32.to_le_bytes());
        b
    }

    fn start_v7(&mut self) -> Result<(), TraceDatError> {
        let mut b = Self::header("7");
        // Compression "none", version "".
        b.extend_from_slice(b"none\0\0");
        let options_ptr = b.len() as u64;
        b.extend_from_slice(&0u64.to_le_bytes());
        let mut meta = Vec::new();
        for (id, desc, body) in [
            (option::HEADER_INFO, "headers", header_info()),
            (option::FTRACE_EVENTS, "ftrace events", ftrace_formats()),
            (option::EVENT_FORMATS, "events format", event_formats()),
            (option::PRINTK, "printk", 0u32.to_le_bytes().to_vec()),
        ] {
            meta.push((id, b.len() as u64));
            self.strings
                .section_header(&mut b, id, desc, body.len() as u64);
            b.extend_from_slice(&body);
        }
        let flyrecord = b.len() as u64;
        // The size is patched at the end; the data starts at the next page boundary.
        self.strings
            .section_header(&mut b, option::BUFFER, "buffer flyrecord ", 0);
        self.write(&b)?;
        self.pad_to_page()?;
        self.v7 = Some(V7 {
            options_ptr,
            meta,
            flyrecord,
            data_start: self.pos,
        });
        Ok(())
    }

    fn finish_v7(&mut self, shift: Option<&[u8]>) -> Result<Vec<(u64, u64)>, TraceDatError> {
        let v7 = self.v7.take().ok_or_else(|| TraceDatError::Verify {
            path: self.path.clone(),
            reason: "v7 state missing".into(),
        })?;
        self.pos = v7.data_start + self.cpus[0].pages * PAGE_SIZE as u64;
        let table = self.append_spills(Some(v7.data_start))?;
        let fly_size = self.pos - v7.flyrecord - SECTION_HEADER_SIZE;
        self.patch(v7.flyrecord + 8, &fly_size.to_le_bytes())?;

        // kallsyms and the command lines are known only now (the names the events used): as
        // sections after the data, which trace-cmd finds by the options' offsets.
        let mut meta = v7.meta.clone();
        for (id, desc, body) in [
            (option::KALLSYMS, "kallsyms", kallsyms_body(&self.kallsyms)),
            (
                option::CMDLINES,
                "command lines",
                cmdlines_body(&self.cmdlines),
            ),
        ] {
            meta.push((id, self.pos));
            let mut b = Vec::with_capacity(body.len() + 16);
            self.strings
                .section_header(&mut b, id, desc, body.len() as u64);
            b.extend_from_slice(&body);
            self.write(&b)?;
        }
        let mut opts = Vec::new();
        for &(id, off) in &meta {
            put_option(&mut opts, id, &off.to_le_bytes());
        }
        put_option(&mut opts, 8, &self.opts.cpus.to_le_bytes()); // CPUCOUNT
        self.common_options(&mut opts, shift);
        let mut buffer = Vec::new();
        buffer.extend_from_slice(&v7.flyrecord.to_le_bytes());
        buffer.push(0); // The top buffer's name is "".
        buffer.extend_from_slice(CLOCK.as_bytes());
        buffer.push(0);
        buffer.extend_from_slice(&PAGE_SIZE_U32.to_le_bytes());
        buffer.extend_from_slice(&self.opts.cpus.to_le_bytes());
        for (cpu, &(off, size)) in (0u32..).zip(&table) {
            buffer.extend_from_slice(&cpu.to_le_bytes());
            buffer.extend_from_slice(&off.to_le_bytes());
            buffer.extend_from_slice(&size.to_le_bytes());
        }
        put_option(&mut opts, option::BUFFER, &buffer);
        put_option(&mut opts, option::DONE, &0u64.to_le_bytes());

        let options_at = self.pos;
        let mut b = Vec::new();
        self.strings
            .section_header(&mut b, option::DONE, "options", opts.len() as u64);
        b.extend_from_slice(&opts);
        // The strings section names itself, so its id is taken before its body is written.
        let strings_id = self.strings.id("strings");
        let body = self.strings.bytes.clone();
        b.extend_from_slice(&option::STRINGS.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        b.extend_from_slice(&strings_id.to_le_bytes());
        b.extend_from_slice(&(body.len() as u64).to_le_bytes());
        b.extend_from_slice(&body);
        self.write(&b)?;
        self.patch(v7.options_ptr, &options_at.to_le_bytes())?;
        Ok(table)
    }

    /// TRACECLOCK, TRACEID, TIME_SHIFT, TSC2NSEC, UNAME, VERSION: the options both versions carry.
    fn common_options(&self, opts: &mut Vec<u8>, shift: Option<&[u8]>) {
        put_option(opts, option::TRACECLOCK, format!("[{CLOCK}]\0").as_bytes());
        put_option(opts, option::TRACEID, &self.opts.trace_id.to_le_bytes());
        if let Some(s) = shift {
            put_option(opts, option::TIME_SHIFT, s);
        }
        if let Some(t) = self.opts.tsc2nsec {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&t.mult.to_le_bytes());
            b[4..8].copy_from_slice(&t.shift.to_le_bytes());
            b[8..].copy_from_slice(&t.offset.to_le_bytes());
            put_option(opts, option::TSC2NSEC, &b);
        }
        if let Some(u) = &self.opts.uname {
            put_option(opts, option::UNAME, format!("{u}\0").as_bytes());
        }
        let version = concat!("vmtsync ", env!("CARGO_PKG_VERSION"), "\0");
        put_option(opts, option::VERSION, version.as_bytes());
    }

    fn finish_v6(&mut self, shift: Option<&[u8]>) -> Result<Vec<(u64, u64)>, TraceDatError> {
        let mut b = Self::header("6");
        b.extend_from_slice(&header_info());
        b.extend_from_slice(&ftrace_formats());
        b.extend_from_slice(&event_formats());
        b.extend_from_slice(&kallsyms_body(&self.kallsyms));
        b.extend_from_slice(&0u32.to_le_bytes()); // printk formats
        b.extend_from_slice(&cmdlines_body(&self.cmdlines));
        b.extend_from_slice(&self.opts.cpus.to_le_bytes());
        b.extend_from_slice(b"options  \0");
        self.common_options(&mut b, shift);
        b.extend_from_slice(&option::DONE.to_le_bytes());
        b.extend_from_slice(b"flyrecord\0");
        let table_at = b.len();
        b.resize(table_at + 16 * self.cpus.len(), 0);
        // With a TRACECLOCK option the 3.1.6 reader expects the clock right after the table.
        let clock = format!("[{CLOCK}]");
        b.extend_from_slice(&(clock.len() as u64).to_le_bytes());
        b.extend_from_slice(clock.as_bytes());
        self.write(&b)?;
        self.pad_to_page()?;
        let table = self.append_spills(None)?;
        let mut t = Vec::with_capacity(16 * table.len());
        for &(off, size) in &table {
            t.extend_from_slice(&off.to_le_bytes());
            t.extend_from_slice(&size.to_le_bytes());
        }
        self.patch(table_at as u64, &t)?;
        Ok(table)
    }
}

impl Summary {
    /// Reads the finished trace.dat back: the layout must show this CPU table and TRACEID,
    /// and each CPU the event count and last timestamp written, every page parsing. For
    /// tests and careful callers; not part of writing.
    ///
    /// # Errors
    /// `Verify` naming the first difference, or the reader's error.
    pub fn verify(&self) -> Result<(), TraceDatError> {
        verify_summary(self)
    }
}

fn verify_summary(s: &Summary) -> Result<(), TraceDatError> {
    let bad = |reason: String| TraceDatError::Verify {
        path: s.path.clone(),
        reason,
    };
    let layout = reader::read_layout(&s.path)?;
    let top = layout
        .buffers
        .first()
        .ok_or_else(|| bad("no trace buffer".into()))?;
    let got: Vec<(u64, u64)> = top.cpus.iter().map(|c| (c.offset, c.size)).collect();
    if got != s.table {
        return Err(bad(format!("CPU table {got:?}, wrote {:?}", s.table)));
    }
    if layout.trace_id() != Some(s.trace_id) {
        return Err(bad("TRACEID does not read back".into()));
    }
    let mut counts = vec![0u64; s.events.len()];
    let mut last = vec![0u64; s.events.len()];
    reader::for_each_event(&s.path, &layout, 0, |e| {
        let i = e.cpu as usize;
        if let Some(n) = counts.get_mut(i) {
            *n += 1;
            last[i] = e.ts;
        }
    })?;
    for (i, (&n, r)) in s.events.iter().zip(&s.ranges).enumerate() {
        let want_last = r.map_or(0, |(_, l)| l);
        if counts[i] != n || (n > 0 && last[i] != want_last) {
            return Err(bad(format!(
                "CPU {i}: read {} events ending at {}, wrote {n} ending at {want_last}",
                counts[i], last[i]
            )));
        }
    }
    Ok(())
}

/// Seals `c`'s page and writes it to its sink.
fn flush_page(
    c: &mut Cpu,
    out: &mut BufWriter<File>,
    main: &mut MainPages,
    pos: &mut u64,
) -> std::io::Result<()> {
    let page = c.page.seal();
    match &mut c.sink {
        Sink::Main => {
            *pos += PAGE_SIZE as u64;
            // Back at the store's first page: every page of it is sealed.
            if c.page.sealed() == 0 {
                main.submit(out, &mut c.page)?;
            }
        }
        Sink::Spill(w) => w.write_all(page)?,
    }
    c.pages += 1;
    Ok(())
}

fn put_option(b: &mut Vec<u8>, id: u16, data: &[u8]) {
    b.extend_from_slice(&id.to_le_bytes());
    b.extend_from_slice(&u32::try_from(data.len()).unwrap_or(u32::MAX).to_le_bytes());
    b.extend_from_slice(data);
}

/// `"header_page\0"`, size, text, `"header_event\0"`, size, text (both versions).
fn header_info() -> Vec<u8> {
    let mut b = Vec::new();
    for (name, text) in [("header_page", HEADER_PAGE), ("header_event", HEADER_EVENT)] {
        b.extend_from_slice(name.as_bytes());
        b.push(0);
        b.extend_from_slice(&(text.len() as u64).to_le_bytes());
        b.extend_from_slice(text.as_bytes());
    }
    b
}

/// One system (`vmtsync`) with its event formats.
fn event_formats() -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(SYSTEM.as_bytes());
    b.push(0);
    format_list(
        &mut b,
        &[EVENT_FORMAT, EVENT_DATA_FORMAT, SPAN_ORPHAN_FORMAT],
    );
    b
}

/// The ftrace formats block: the function graph's entry and exit (trace-cmd prints records of
/// these two as a call graph).
fn ftrace_formats() -> Vec<u8> {
    let mut b = Vec::new();
    format_list(&mut b, &[FUNCGRAPH_ENTRY_FORMAT, FUNCGRAPH_EXIT_FORMAT]);
    b
}

/// `u32 count`, then `u64 size, text` per format.
fn format_list(b: &mut Vec<u8>, formats: &[&str]) {
    b.extend_from_slice(&u32::try_from(formats.len()).unwrap_or(0).to_le_bytes());
    for f in formats {
        b.extend_from_slice(&(f.len() as u64).to_le_bytes());
        b.extend_from_slice(f.as_bytes());
    }
}

/// The kallsyms block: `u32 size`, then the text.
fn kallsyms_body(text: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + text.len());
    b.extend_from_slice(&u32::try_from(text.len()).unwrap_or(0).to_le_bytes());
    b.extend_from_slice(text.as_bytes());
    b
}

/// The saved command lines block: `u64 size`, then the text.
fn cmdlines_body(text: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(8 + text.len());
    b.extend_from_slice(&(text.len() as u64).to_le_bytes());
    b.extend_from_slice(text.as_bytes());
    b
}

/// The v7 strings table being built: a section's description is an offset into it.
#[derive(Debug, Default)]
pub(super) struct Strings {
    pub(super) bytes: Vec<u8>,
    /// Id of the first string (non-zero when appending to a file that has strings).
    pub(super) base: u64,
}

impl Strings {
    pub(super) fn id(&mut self, s: &str) -> u32 {
        let id = self.base + self.bytes.len() as u64;
        self.bytes.extend_from_slice(s.as_bytes());
        self.bytes.push(0);
        u32::try_from(id).unwrap_or(u32::MAX)
    }

    /// A v7 section header: `u16 id, u16 flags (0: uncompressed), u32 description, u64 size`.
    pub(super) fn section_header(&mut self, b: &mut Vec<u8>, id: u16, desc: &str, size: u64) {
        let desc = self.id(desc);
        b.extend_from_slice(&id.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        b.extend_from_slice(&desc.to_le_bytes());
        b.extend_from_slice(&size.to_le_bytes());
    }
}

#[cfg(test)]
mod tests;
