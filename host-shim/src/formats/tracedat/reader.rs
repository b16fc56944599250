//! A strict reader: the layout of any v6/v7 trace.dat (header, sections, the options chain,
//! buffers and their per-CPU data), and the events of uncompressed files such as ours.
//!
//! Every size and offset is checked against the file's length before it is used, so a damaged
//! or truncated file yields [`TraceDatError::Parse`] with the byte offset where parsing failed,
//! never a panic and never an allocation the file's claims alone would size (claims are bounded
//! by the file length first). trace-cmd's own `report` exits 0 on a truncated file; this is the
//! check to rely on.
//!
//! Compressed sections (what `trace-cmd extract` writes here: zstd) are decompressed with
//! `ruzstd` where their content is needed (event formats, CPU data), one section or one chunk
//! at a time, each bounded before anything is allocated; the options chain is read in place.
//! The layouts of a compressed section and of compressed CPU data are in `docs/trace-dat.md`.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::consts::{MAGIC, SEC_FL_COMPRESS, SECTION_HEADER_SIZE, TRACING, option};
use super::error::TraceDatError;
use super::format::{
    EVENT_DATA_FIXED_ID, EVENT_DATA_ID, MAX_PAYLOAD, PAYLOAD_AT, is_vmtsync_event,
};

/// Longest NUL-terminated string we accept in headers and options (names, clocks, versions).
const MAX_CSTR: u64 = 4096;

/// One option as found in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptionRec {
    /// Option id.
    pub id: u16,
    /// File offset of the option's data (after its 6-byte id and size).
    pub offset: u64,
    /// The data.
    pub data: Vec<u8>,
}

/// One v7 section header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SectionRec {
    /// Section id (an option id: 0 options, 3 flyrecord, 15 strings, 16..21 metadata).
    pub id: u16,
    /// Flags ([`SEC_FL_COMPRESS`]).
    pub flags: u16,
    /// File offset of the section header.
    pub offset: u64,
    /// Body size in the file.
    pub size: u64,
}

/// One CPU's data in a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuData {
    /// The CPU number.
    pub cpu: u32,
    /// File offset of the data.
    pub offset: u64,
    /// Size in the file.
    pub size: u64,
}

/// One trace buffer (the top one has the empty name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferRec {
    /// Instance name, `""` for the top buffer.
    pub name: String,
    /// Its clock (v7 BUFFER option; v6 has it only in TRACECLOCK and after the CPU table).
    pub clock: Option<String>,
    /// Whether the data is compressed (v7 section flag).
    pub compressed: bool,
    /// Per-CPU data.
    pub cpus: Vec<CpuData>,
}

/// The structure of a trace.dat.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// File version, 6 or 7.
    pub version: u32,
    /// Page size from the header.
    pub page_size: u32,
    /// v7 compression name (`None` for "none" and for v6).
    pub compression: Option<String>,
    /// File length.
    pub file_len: u64,
    /// All options, in chain order.
    pub options: Vec<OptionRec>,
    /// v7 sections in file order (empty for v6).
    pub sections: Vec<SectionRec>,
    /// Trace buffers: the top one first.
    pub buffers: Vec<BufferRec>,
    /// v7: file offset of the last DONE option's 8-byte "next options section" field.
    /// v6: file offset of the `u16 0` that ends the options block.
    pub options_end: u64,
    /// v7: total uncompressed size of the STRINGS sections (the next string's id).
    pub strings_size: u64,
    /// v7: whether the file has a strings section (`trace-cmd restore` writes none; any other
    /// file without one was cut at a section boundary).
    pub has_strings: bool,
    /// v6: offset of the top buffer's `"flyrecord\0"`.
    pub flyrecord: Option<u64>,
    /// v6: offset just past the top buffer's CPU table and clock (where padding begins).
    pub flyrecord_end: Option<u64>,
    /// v6: the file range of the ftrace and event formats blocks (from the ftrace format count
    /// to the end of the last event format).
    pub v6_formats: Option<(u64, u64)>,
}

impl Layout {
    /// The last TRACEID option's value (trace-cmd keeps the last one it reads).
    #[must_use]
    pub fn trace_id(&self) -> Option<u64> {
        self.options
            .iter()
            .rev()
            .find(|o| o.id == option::TRACEID && o.data.len() >= 8)
            .map(|o| u64::from_le_bytes(o.data[..8].try_into().unwrap_or([0; 8])))
    }

    /// The last TSC2NSEC option (trace-cmd keeps the last one it reads).
    #[must_use]
    pub fn tsc2nsec(&self) -> Option<super::consts::Tsc2Nsec> {
        let d = &self.options_with(option::TSC2NSEC).last()?.data;
        let u32_at = |i: usize| u32::from_le_bytes(d[i..i + 4].try_into().unwrap_or([0; 4]));
        (d.len() >= 16).then(|| super::consts::Tsc2Nsec {
            mult: u32_at(0),
            shift: u32_at(4),
            offset: u64::from_le_bytes(d[8..16].try_into().unwrap_or([0; 8])),
        })
    }

    /// Options with `id`, in chain order.
    pub fn options_with(&self, id: u16) -> impl Iterator<Item = &OptionRec> {
        self.options.iter().filter(move |o| o.id == id)
    }
}

/// Random-access, bounds-checked reads of one file.
pub(super) struct Src {
    file: File,
    len: u64,
    path: PathBuf,
}

impl Src {
    pub(super) fn open(path: &Path) -> Result<Self, TraceDatError> {
        let file = File::open(path).map_err(TraceDatError::io("open", path))?;
        let len = file
            .metadata()
            .map_err(TraceDatError::io("stat", path))?
            .len();
        Ok(Self {
            file,
            len,
            path: path.to_path_buf(),
        })
    }

    pub(super) fn err(&self, offset: u64, reason: impl Into<String>) -> TraceDatError {
        TraceDatError::Parse {
            path: self.path.clone(),
            offset,
            reason: reason.into(),
        }
    }

    /// Fails unless `[at, at + n)` lies inside the file.
    fn need(&self, at: u64, n: u64, what: &str) -> Result<(), TraceDatError> {
        match at.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(self.err(
                at,
                format!(
                    "{what}: needs {n} bytes here but the file ends at {} (truncated?)",
                    self.len
                ),
            )),
        }
    }

    pub(super) fn read_into(
        &self,
        at: u64,
        buf: &mut [u8],
        what: &str,
    ) -> Result<(), TraceDatError> {
        self.need(at, buf.len() as u64, what)?;
        self.file
            .read_exact_at(buf, at)
            .map_err(TraceDatError::io("read", &self.path))
    }

    fn bytes(&self, at: u64, n: u64, what: &str) -> Result<Vec<u8>, TraceDatError> {
        self.need(at, n, what)?;
        let mut v = vec![0; usize::try_from(n).map_err(|_| self.err(at, "size too large"))?];
        self.read_into(at, &mut v, what)?;
        Ok(v)
    }
}

/// A sequential cursor over a [`Src`].
struct Cur<'a> {
    src: &'a Src,
    pos: u64,
}

impl Cur<'_> {
    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], TraceDatError> {
        let mut b = [0; N];
        self.src.read_into(self.pos, &mut b, what)?;
        self.pos += N as u64;
        Ok(b)
    }
    fn u16(&mut self, what: &str) -> Result<u16, TraceDatError> {
        self.array(what).map(u16::from_le_bytes)
    }
    fn u32(&mut self, what: &str) -> Result<u32, TraceDatError> {
        self.array(what).map(u32::from_le_bytes)
    }
    fn u64(&mut self, what: &str) -> Result<u64, TraceDatError> {
        self.array(what).map(u64::from_le_bytes)
    }
    fn skip(&mut self, n: u64, what: &str) -> Result<(), TraceDatError> {
        self.src.need(self.pos, n, what)?;
        self.pos += n;
        Ok(())
    }
    fn cstr(&mut self, what: &str) -> Result<String, TraceDatError> {
        let start = self.pos;
        let avail = self.src.len.saturating_sub(start).min(MAX_CSTR);
        let buf = self.src.bytes(start, avail, what)?;
        let nul = buf.iter().position(|&b| b == 0).ok_or_else(|| {
            self.src.err(
                start,
                format!("{what}: no NUL-terminated string (truncated?)"),
            )
        })?;
        self.pos = start + nul as u64 + 1;
        Ok(String::from_utf8_lossy(&buf[..nul]).into_owned())
    }
    fn expect(&mut self, want: &[u8], what: &str) -> Result<(), TraceDatError> {
        let at = self.pos;
        let got = self.src.bytes(at, want.len() as u64, what)?;
        if got != want {
            return Err(self.src.err(at, format!("expected {what}")));
        }
        self.pos += want.len() as u64;
        Ok(())
    }
}

/// Reads and checks the layout of the trace.dat at `path`.
///
/// # Errors
/// [`TraceDatError::Parse`] with the failing offset for a damaged or truncated file,
/// [`TraceDatError::Unsupported`] for big-endian or 32-bit files, `Io` if it cannot be read.
pub fn read_layout(path: &Path) -> Result<Layout, TraceDatError> {
    let src = Src::open(path)?;
    read_layout_src(&src)
}

pub(super) fn read_layout_src(src: &Src) -> Result<Layout, TraceDatError> {
    let mut c = Cur { src, pos: 0 };
    c.expect(&MAGIC, "trace.dat magic 17 08 44")?;
    c.expect(TRACING, "\"tracing\"")?;
    let version = c.cstr("file version")?;
    let version: u32 = match version.as_str() {
        "6" => 6,
        "7" => 7,
        v => return Err(src.err(10, format!("file version {v:?}, expected 6 or 7"))),
    };
    let [endian, long] = c.array::<2>("endianness and long size")?;
    if endian != 0 || long != 8 {
        return Err(TraceDatError::Unsupported {
            path: src.path.clone(),
            reason: "only little-endian files with 8-byte longs are supported".into(),
        });
    }
    let page_size = c.u32("page size")?;
    if !page_size.is_power_of_two() || page_size < 1024 {
        return Err(src.err(
            c.pos - 4,
            format!("page size {page_size} is not a power of two"),
        ));
    }
    if version == 6 {
        read_v6(src, c, page_size)
    } else {
        read_v7(src, c, page_size)
    }
}

fn read_v7(src: &Src, mut c: Cur<'_>, page_size: u32) -> Result<Layout, TraceDatError> {
    let zname = c.cstr("compression name")?;
    let _zver = c.cstr("compression version")?;
    let options_start = c.u64("offset of the first options section")?;
    // Sections follow each other to the end of the file; trace-cmd walks them that way to
    // find the strings, so a gap or an overrun is damage.
    let mut sections = Vec::new();
    let mut strings_size = 0;
    let mut strings_found = false;
    while c.pos < src.len {
        let offset = c.pos;
        let id = c.u16("section id")?;
        let flags = c.u16("section flags")?;
        let _desc = c.u32("section description")?;
        let size = c.u64("section size")?;
        let body = c.pos;
        src.need(body, size, "section body").map_err(|_| {
            src.err(
                offset + 8,
                format!(
                    "section {id} of {size} bytes runs past the end of the file at {} (truncated?)",
                    src.len
                ),
            )
        })?;
        if id == option::STRINGS {
            strings_found = true;
            strings_size += if flags & SEC_FL_COMPRESS != 0 {
                let mut b = [0; 8];
                src.read_into(body, &mut b, "compressed strings header")?;
                u64::from(u32::from_le_bytes(b[4..8].try_into().unwrap_or([0; 4])))
            } else {
                size
            };
        }
        sections.push(SectionRec {
            id,
            flags,
            offset,
            size,
        });
        c.pos = body + size;
    }
    // trace-cmd writes the strings section last, so a file cut at a section boundary loses it;
    // but `trace-cmd restore` writes files without one, which trace-cmd reads. The layout says
    // so and `verify_file` (the check for files that must be complete) refuses it.
    let find = |off: u64, id: u16, what: &str| {
        sections
            .iter()
            .find(|s| s.offset == off && s.id == id)
            .copied()
            .ok_or_else(|| {
                if off >= src.len {
                    src.err(
                        src.len,
                        format!("{what} at {off}: past the end of the file (truncated?)"),
                    )
                } else {
                    src.err(off, format!("{what}: no section {id} starts here"))
                }
            })
    };
    let mut options = Vec::new();
    let mut seen = BTreeSet::new();
    let mut next = options_start;
    let mut options_end;
    loop {
        if !seen.insert(next) {
            return Err(src.err(next, "options sections form a loop"));
        }
        let sec = find(next, option::DONE, "options section")?;
        if sec.flags & SEC_FL_COMPRESS != 0 {
            return Err(TraceDatError::Unsupported {
                path: src.path.clone(),
                reason: format!(
                    "options section at {} is compressed: run `trace-cmd convert --compression none` first",
                    sec.offset
                ),
            });
        }
        let end = sec.offset + SECTION_HEADER_SIZE + sec.size;
        let mut oc = Cur {
            src,
            pos: sec.offset + SECTION_HEADER_SIZE,
        };
        let mut done = None;
        while oc.pos < end {
            let id = oc.u16("option id")?;
            let size = u64::from(oc.u32("option size")?);
            let offset = oc.pos;
            if offset + size > end {
                return Err(src.err(offset - 4, "option runs past its options section"));
            }
            if id == option::DONE {
                if size < 8 {
                    return Err(src.err(offset - 4, "DONE option shorter than 8 bytes"));
                }
                done = Some((offset, oc.u64("next options offset")?));
                break;
            }
            let data = src.bytes(offset, size, "option data")?;
            oc.pos = offset + size;
            options.push(OptionRec { id, offset, data });
        }
        let (at, n) = done.ok_or_else(|| src.err(end, "options section without DONE option"))?;
        options_end = at;
        if n == 0 {
            break;
        }
        next = n;
    }
    let mut buffers = Vec::new();
    for o in options.iter().filter(|o| o.id == option::BUFFER) {
        let b = parse_buffer_option(src, o)?;
        let sec = find(b.0, option::BUFFER, "BUFFER option's flyrecord")?;
        let mut rec = b.1;
        rec.compressed = sec.flags & SEC_FL_COMPRESS != 0;
        let body = sec.offset + SECTION_HEADER_SIZE;
        for cd in &rec.cpus {
            if cd.size != 0
                && (cd.offset < body || cd.offset.saturating_add(cd.size) > body + sec.size)
            {
                return Err(src.err(
                    o.offset,
                    format!(
                        "buffer {:?} CPU {} data [{}, +{}) is outside its section (truncated?)",
                        rec.name, cd.cpu, cd.offset, cd.size
                    ),
                ));
            }
        }
        buffers.push(rec);
    }
    buffers.sort_by_key(|b| !b.name.is_empty());
    Ok(Layout {
        version: 7,
        page_size,
        compression: (zname != "none").then_some(zname),
        file_len: src.len,
        options,
        sections,
        buffers,
        options_end,
        strings_size,
        has_strings: strings_found,
        flyrecord: None,
        flyrecord_end: None,
        v6_formats: None,
    })
}

/// A v7 BUFFER option: the flyrecord section offset and the buffer.
fn parse_buffer_option(src: &Src, o: &OptionRec) -> Result<(u64, BufferRec), TraceDatError> {
    let d = &o.data;
    let bad = |at: usize| src.err(o.offset + at as u64, "BUFFER option is too short");
    let rd = |at: usize, n: usize| d.get(at..at + n).ok_or_else(|| bad(at));
    let u64_at = |at| rd(at, 8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
    let u32_at = |at| rd(at, 4).map(|b| u32::from_le_bytes(b.try_into().unwrap_or([0; 4])));
    let cstr_at = |at: usize| {
        let rest = d.get(at..).ok_or_else(|| bad(at))?;
        let n = rest.iter().position(|&b| b == 0).ok_or_else(|| bad(at))?;
        Ok::<_, TraceDatError>((String::from_utf8_lossy(&rest[..n]).into_owned(), at + n + 1))
    };
    let off = u64_at(0)?;
    let (name, at) = cstr_at(8)?;
    let (clock, at) = cstr_at(at)?;
    let _page = u32_at(at)?;
    let n = u32_at(at + 4)?;
    let mut at = at + 8;
    if (n as usize).saturating_mul(20) > d.len() {
        return Err(bad(at));
    }
    let mut cpus = Vec::with_capacity(n as usize);
    for _ in 0..n {
        cpus.push(CpuData {
            cpu: u32_at(at)?,
            offset: u64_at(at + 4)?,
            size: u64_at(at + 12)?,
        });
        at += 20;
    }
    Ok((
        off,
        BufferRec {
            name,
            clock: Some(clock),
            compressed: false,
            cpus,
        },
    ))
}

fn read_v6(src: &Src, mut c: Cur<'_>, page_size: u32) -> Result<Layout, TraceDatError> {
    c.expect(b"header_page\0", "\"header_page\"")?;
    let n = c.u64("header_page size")?;
    c.skip(n, "header_page")?;
    c.expect(b"header_event\0", "\"header_event\"")?;
    let n = c.u64("header_event size")?;
    c.skip(n, "header_event")?;
    let v6_formats = c.pos;
    let count = c.u32("ftrace format count")?;
    for _ in 0..count {
        let n = c.u64("ftrace format size")?;
        c.skip(n, "ftrace format")?;
    }
    let systems = c.u32("event system count")?;
    for _ in 0..systems {
        c.cstr("event system name")?;
        let count = c.u32("event count")?;
        for _ in 0..count {
            let n = c.u64("event format size")?;
            c.skip(n, "event format")?;
        }
    }
    let v6_formats_end = c.pos;
    let n = c.u32("kallsyms size")?;
    c.skip(u64::from(n), "kallsyms")?;
    let n = c.u32("printk formats size")?;
    c.skip(u64::from(n), "printk formats")?;
    let n = c.u64("saved cmdlines size")?;
    c.skip(n, "saved cmdlines")?;
    let cpus = c.u32("CPU count")?;
    let mut options = Vec::new();
    let mut options_end = 0;
    let mut flyrecord = None;
    let mut flyrecord_end = None;
    let mut buffers = Vec::new();
    loop {
        let at = c.pos;
        let kind = c.array::<10>("\"options\", \"flyrecord\" or \"latency\"")?;
        match &kind {
            b"options  \0" => loop {
                let oat = c.pos;
                let id = c.u16("option id")?;
                if id == option::DONE {
                    options_end = oat;
                    break;
                }
                let size = u64::from(c.u32("option size")?);
                let offset = c.pos;
                let data = src.bytes(offset, size, "option data")?;
                c.pos = offset + size;
                options.push(OptionRec { id, offset, data });
            },
            b"flyrecord\0" => {
                flyrecord = Some(at);
                let table = read_cpu_table(src, &mut c, cpus)?;
                if options.iter().any(|o| o.id == option::TRACECLOCK) {
                    // trace-cmd's reader expects the clock here whenever TRACECLOCK is set.
                    let n = c.u64("trace clock size")?;
                    c.skip(n, "trace clock")?;
                }
                flyrecord_end = Some(c.pos);
                buffers.push(BufferRec {
                    name: String::new(),
                    clock: None,
                    compressed: false,
                    cpus: table,
                });
                break;
            }
            b"latency  \0" => break,
            _ => return Err(src.err(at, "expected \"options  \", \"flyrecord\" or \"latency  \"")),
        }
    }
    // Instance buffers: a BUFFER option holds the offset of the instance's own flyrecord.
    for o in options.iter().filter(|o| o.id == option::BUFFER) {
        let off = o
            .data
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
            .ok_or_else(|| src.err(o.offset, "BUFFER option is too short"))?;
        let name = String::from_utf8_lossy(o.data[8..].split(|&b| b == 0).next().unwrap_or(&[]))
            .into_owned();
        let mut bc = Cur { src, pos: off };
        bc.expect(b"flyrecord\0", "instance \"flyrecord\"")?;
        let table = read_cpu_table(src, &mut bc, cpus)?;
        buffers.push(BufferRec {
            name,
            clock: None,
            compressed: false,
            cpus: table,
        });
    }
    Ok(Layout {
        version: 6,
        page_size,
        compression: None,
        file_len: src.len,
        options,
        sections: Vec::new(),
        buffers,
        options_end,
        strings_size: 0,
        has_strings: false,
        flyrecord,
        flyrecord_end,
        v6_formats: Some((v6_formats, v6_formats_end)),
    })
}

fn read_cpu_table(src: &Src, c: &mut Cur<'_>, cpus: u32) -> Result<Vec<CpuData>, TraceDatError> {
    let mut table = Vec::new();
    for cpu in 0..cpus {
        let at = c.pos;
        let offset = c.u64("CPU data offset")?;
        let size = c.u64("CPU data size")?;
        if size != 0 {
            src.need(offset, size, "CPU data").map_err(|_| {
                src.err(
                    at,
                    format!("CPU {cpu} data [{offset}, +{size}) runs past the end of the file at {} (truncated?)", src.len),
                )
            })?;
        }
        table.push(CpuData { cpu, offset, size });
    }
    Ok(table)
}

/// One event read back from a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// Trace CPU.
    pub cpu: u32,
    /// Raw timestamp (the guest TSC in our files).
    pub ts: u64,
    /// The record's `common_type` (event format id).
    pub common_type: u16,
    /// `id` field of a `vmtsync` event (0 for other events).
    pub id: u32,
    /// Payload length of a `vmtsync:event_data` (0 otherwise).
    pub len: u8,
    /// Payload bytes (the first `len` are valid).
    pub payload: [u8; MAX_PAYLOAD],
}

/// Largest uncompressed metadata section decompressed into memory. The event formats of a
/// kernel with every tracepoint are about 2 MB (2,012,704 bytes for the 101 systems of the
/// kernel here); kallsyms (MBs) is never decompressed.
const MAX_SECTION: u64 = 32 << 20;
/// Highest CPU number + 1 a trace may use (bounds per-CPU tables built from file contents).
pub const MAX_CPUS: usize = 1 << 16;
/// Largest uncompressed chunk of CPU data (trace-cmd writes chunks of a few pages: 16 KiB
/// here).
const MAX_CHUNK: u64 = 16 << 20;
/// Largest zstd window a frame may ask the decoder to allocate (the decoder's own default is
/// 128 MiB): as large as the largest block we decompress, so a hostile frame header cannot
/// claim more.
const MAX_ZSTD_WINDOW: u64 = 32 << 20;

/// Decompresses `input` (one or more zstd frames) into exactly `out.len()` bytes.
fn unzstd(input: &[u8], out: &mut [u8]) -> Result<(), String> {
    let mut d = ruzstd::decoding::FrameDecoder::new();
    d.set_max_window_size(MAX_ZSTD_WINDOW);
    match d.decode_all(input, out) {
        Ok(n) if n == out.len() => Ok(()),
        Ok(n) => Err(format!(
            "zstd data holds {n} bytes, the header says {}",
            out.len()
        )),
        Err(e) => Err(format!("zstd: {e}")),
    }
}

impl Src {
    /// The body of the v7 section whose header is at `offset`, decompressed if it is
    /// compressed (`u32 compressed size, u32 uncompressed size, data`), at most `cap` bytes.
    fn section_body(&self, sec: &SectionRec, cap: u64) -> Result<Vec<u8>, TraceDatError> {
        let body = sec.offset + SECTION_HEADER_SIZE;
        if sec.flags & SEC_FL_COMPRESS == 0 {
            if sec.size > cap {
                return Err(self.err(
                    sec.offset + 8,
                    format!(
                        "section of {} bytes is larger than the {cap} we read",
                        sec.size
                    ),
                ));
            }
            return self.bytes(body, sec.size, "section body");
        }
        let mut c = Cur {
            src: self,
            pos: body,
        };
        let zsize = u64::from(c.u32("compressed section: compressed size")?);
        let usize_ = u64::from(c.u32("compressed section: uncompressed size")?);
        if 8 + zsize > sec.size {
            return Err(self.err(
                body,
                format!(
                    "compressed size {zsize} runs past its section of {} bytes",
                    sec.size
                ),
            ));
        }
        if usize_ > cap {
            return Err(self.err(
                body + 4,
                format!("uncompressed size {usize_} is larger than the {cap} we accept"),
            ));
        }
        let z = self.bytes(body + 8, zsize, "compressed section data")?;
        let mut out = vec![0; usize::try_from(usize_).unwrap_or(0)];
        unzstd(&z, &mut out).map_err(|e| self.err(body + 8, e))?;
        Ok(out)
    }
}

/// One event format stored in a trace.dat: an ftrace-internal one (system `"ftrace"`) or an
/// event's `format` file as tracefs printed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventFormat {
    /// Event system (`"ftrace"` for the ftrace formats block, else the directory name).
    pub system: String,
    /// The `name:` line of the format text (empty if it has none).
    pub name: String,
    /// The `ID:` line (the records' `common_type`), `None` if missing or not a `u16`.
    pub id: Option<u16>,
    /// The whole format text, as tracefs printed it.
    pub format: String,
}

/// Parses the `count, {u64 size, text}…` list of one system out of `b` from `*at`.
fn format_list(
    b: &[u8],
    at: &mut usize,
    system: &str,
    out: &mut Vec<EventFormat>,
) -> Result<(), String> {
    let take = |at: &mut usize, n: usize, what: &str| -> Result<std::ops::Range<usize>, String> {
        let end = at.checked_add(n).filter(|&e| e <= b.len()).ok_or_else(|| {
            format!(
                "{what} of {n} bytes at {at} runs past the {} bytes of the block",
                b.len()
            )
        })?;
        let r = *at..end;
        *at = end;
        Ok(r)
    };
    let r = take(at, 4, "format count")?;
    let count = u32::from_le_bytes(b[r].try_into().unwrap_or([0; 4]));
    for _ in 0..count {
        let r = take(at, 8, "format size")?;
        let n = u64::from_le_bytes(b[r].try_into().unwrap_or([0; 8]));
        let r = take(at, usize::try_from(n).unwrap_or(usize::MAX), "format text")?;
        let format = String::from_utf8_lossy(&b[r]).into_owned();
        let line = |key: &str| {
            format
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .map(|v| v.trim().to_string())
        };
        out.push(EventFormat {
            system: system.to_string(),
            name: line("name:").unwrap_or_default(),
            id: line("ID:").and_then(|v| v.parse().ok()),
            format,
        });
    }
    Ok(())
}

/// Parses an event formats block: `u32 systems, {name\0, format list}…`.
fn system_lists(b: &[u8], out: &mut Vec<EventFormat>) -> Result<(), String> {
    let systems = b
        .get(..4)
        .map(|v| u32::from_le_bytes(v.try_into().unwrap_or([0; 4])))
        .ok_or("event formats block shorter than its system count")?;
    let mut at = 4;
    for _ in 0..systems {
        let rest = b.get(at..).unwrap_or(&[]);
        let nul = rest
            .iter()
            .position(|&c| c == 0)
            .ok_or_else(|| format!("system name at {at} is not NUL-terminated"))?;
        let system = String::from_utf8_lossy(&rest[..nul]).into_owned();
        at += nul + 1;
        format_list(b, &mut at, &system, out)?;
    }
    Ok(())
}

/// The event formats stored in the file at `path`: the ftrace formats (system `"ftrace"`)
/// first, then every system's events in file order. Compressed v7 sections are decompressed.
///
/// # Errors
/// `Parse` with the offset of the damaged block (for a compressed section: of its data; the
/// reason names the byte inside the uncompressed block).
pub fn read_event_formats(path: &Path, layout: &Layout) -> Result<Vec<EventFormat>, TraceDatError> {
    let src = Src::open(path)?;
    let mut out = Vec::new();
    if layout.version == 6 {
        let (at, end) = layout
            .v6_formats
            .ok_or_else(|| src.err(0, "v6 layout without the formats range"))?;
        // The blocks are inline and were bounds-checked by `read_layout`; read them as one.
        if end.saturating_sub(at) > MAX_SECTION {
            return Err(src.err(at, "event formats larger than 32 MiB"));
        }
        let n = end.saturating_sub(at);
        let b = src.bytes(at, n, "event formats")?;
        let mut pos = 0;
        format_list(&b, &mut pos, "ftrace", &mut out).map_err(|e| src.err(at, e))?;
        let events_at = at + pos as u64;
        system_lists(&b[pos..], &mut out).map_err(|e| src.err(events_at, e))?;
        return Ok(out);
    }
    for (id, system) in [
        (option::FTRACE_EVENTS, Some("ftrace")),
        (option::EVENT_FORMATS, None),
    ] {
        let Some(o) = layout.options_with(id).last() else {
            continue;
        };
        let off = o
            .data
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
            .ok_or_else(|| src.err(o.offset, "formats option shorter than 8 bytes"))?;
        let sec = layout
            .sections
            .iter()
            .find(|s| s.offset == off && s.id == id)
            .ok_or_else(|| {
                src.err(
                    o.offset,
                    format!("formats option points at {off}, where no section {id} starts"),
                )
            })?;
        let b = src.section_body(sec, MAX_SECTION)?;
        let at = sec.offset + SECTION_HEADER_SIZE;
        let r = match system {
            Some(s) => format_list(&b, &mut 0, s, &mut out),
            None => system_lists(&b, &mut out),
        };
        r.map_err(|e| src.err(at, format!("section {id} (uncompressed): {e}")))?;
    }
    Ok(out)
}

/// Where a page's bytes came from, to name the failing byte in an error.
#[derive(Clone, Copy)]
enum PageAt {
    /// The page starts at this file offset.
    File(u64),
    /// The page starts at byte `1` of the uncompressed chunk whose header is at file offset `0`.
    Chunk(u64, u64),
}

impl Src {
    fn page_err(&self, at: PageAt, byte: usize, what: &str) -> TraceDatError {
        match at {
            PageAt::File(p) => self.err(p + byte as u64, what),
            PageAt::Chunk(c, p) => self.err(
                c,
                format!(
                    "compressed chunk here, uncompressed byte {}: {what}",
                    p + byte as u64
                ),
            ),
        }
    }
}

/// A record callback that may reject a record: `Err((byte in the record, reason))`.
type RecordFn<'a> = dyn FnMut(u32, u64, &[u8]) -> Result<(), (usize, &'static str)> + 'a;

/// Calls `f(cpu, ts, data)` for every data record of `buffer`'s CPU data in `path`, CPU by CPU
/// in file order, page by page: `ts` is the record's raw timestamp (deltas, time extends and
/// absolute stamps applied), `data` the record's bytes (`common_type` first; with the ring
/// buffer's 4-byte alignment padding). Compressed CPU data is decompressed one chunk at a
/// time, so memory stays constant (one chunk, at most 16 MiB) whatever the file's size.
/// Returns the number of records.
///
/// # Errors
/// `Parse` with the failing offset for a malformed page, record or compressed chunk.
pub fn for_each_record(
    path: &Path,
    layout: &Layout,
    buffer: usize,
    mut f: impl FnMut(u32, u64, &[u8]),
) -> Result<u64, TraceDatError> {
    records(path, layout, buffer, &mut |cpu, ts, data| {
        f(cpu, ts, data);
        Ok(())
    })
}

fn records(
    path: &Path,
    layout: &Layout,
    buffer: usize,
    f: &mut RecordFn<'_>,
) -> Result<u64, TraceDatError> {
    let src = Src::open(path)?;
    let Some(b) = layout.buffers.get(buffer) else {
        return Ok(0);
    };
    let ps = u64::from(layout.page_size);
    let mut page = vec![0; layout.page_size as usize];
    let mut bufs = (Vec::new(), Vec::new());
    let mut n = 0;
    for cd in b.cpus.iter().filter(|c| c.size > 0) {
        if !b.compressed {
            let mut at = cd.offset;
            let end = cd.offset + cd.size;
            while at < end {
                let len = ps.min(end - at);
                let page = &mut page[..usize::try_from(len).unwrap_or(0)];
                src.read_into(at, page, "ring buffer page")?;
                n += walk_page(&src, PageAt::File(at), page, cd.cpu, f)?;
                at += len;
            }
            continue;
        }
        let mut chunks = Chunks::open(&src, layout, cd)?;
        while let Some(h) = chunks.next(&src, ps)? {
            n += walk_chunk(&src, layout, h, cd.cpu, &mut bufs, f)?;
        }
    }
    Ok(n)
}

/// One compressed chunk's header: where it is and its two sizes.
#[derive(Clone, Copy)]
struct ChunkHdr {
    /// File offset of the chunk's 8-byte header.
    at: u64,
    zsize: u64,
    usize_: u64,
}

/// The chunk headers of one CPU's compressed data, read one at a time: `u32 chunk count`,
/// then `{u32 compressed size, u32 uncompressed size, data}` per chunk. trace-cmd's CPU size
/// counts the bytes after the count word; the chunks must also stay inside their flyrecord
/// section.
struct Chunks {
    pos: u64,
    end: u64,
    left: u32,
    cpu: u32,
}

impl Chunks {
    fn open(src: &Src, layout: &Layout, cd: &CpuData) -> Result<Self, TraceDatError> {
        let sec_end = layout
            .sections
            .iter()
            .find(|s| {
                s.id == option::BUFFER
                    && s.offset < cd.offset
                    && cd.offset < s.offset + SECTION_HEADER_SIZE + s.size
            })
            .map_or(0, |s| s.offset + SECTION_HEADER_SIZE + s.size);
        let end = sec_end.min(cd.offset.saturating_add(4).saturating_add(cd.size));
        let mut c = Cur {
            src,
            pos: cd.offset,
        };
        let left = c.u32("compressed CPU data: chunk count")?;
        Ok(Self {
            pos: c.pos,
            end,
            left,
            cpu: cd.cpu,
        })
    }

    fn next(&mut self, src: &Src, ps: u64) -> Result<Option<ChunkHdr>, TraceDatError> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        let at = self.pos;
        let mut c = Cur { src, pos: at };
        let zsize = u64::from(c.u32("compressed chunk size")?);
        let usize_ = u64::from(c.u32("uncompressed chunk size")?);
        if c.pos + zsize > self.end {
            return Err(src.err(
                at,
                format!(
                    "CPU {} chunk of {zsize} compressed bytes runs past the CPU's data at {} (truncated?)",
                    self.cpu, self.end
                ),
            ));
        }
        if usize_ > MAX_CHUNK || usize_ % ps != 0 {
            return Err(src.err(
                at + 4,
                format!(
                    "uncompressed chunk size {usize_} is not a multiple of the page size up to {MAX_CHUNK}"
                ),
            ));
        }
        self.pos = c.pos + zsize;
        Ok(Some(ChunkHdr { at, zsize, usize_ }))
    }
}

/// Decompresses one chunk into `bufs.1` (reusing both buffers) and walks its pages.
fn walk_chunk(
    src: &Src,
    layout: &Layout,
    h: ChunkHdr,
    cpu: u32,
    bufs: &mut (Vec<u8>, Vec<u8>),
    f: &mut RecordFn<'_>,
) -> Result<u64, TraceDatError> {
    let (zbuf, chunk) = bufs;
    zbuf.resize(usize::try_from(h.zsize).unwrap_or(0), 0);
    src.read_into(h.at + 8, zbuf, "compressed chunk")?;
    chunk.resize(usize::try_from(h.usize_).unwrap_or(0), 0);
    unzstd(zbuf, chunk).map_err(|e| src.err(h.at + 8, e))?;
    let mut n = 0;
    for (i, page) in chunk.chunks(layout.page_size as usize).enumerate() {
        let where_ = PageAt::Chunk(h.at, i as u64 * u64::from(layout.page_size));
        n += walk_page(src, where_, page, cpu, f)?;
    }
    Ok(n)
}

/// Each CPU's raw timestamp range `(first, last)` over every buffer of the file, indexed by
/// CPU number (`None` for a CPU without records); the vector is as long as the highest CPU
/// number with data plus one. Reads only the first and last non-empty pages (or compressed
/// chunks) of each CPU, since a CPU's ring buffer timestamps never decrease: the cost does not
/// grow with the number of events.
///
/// # Errors
/// As [`for_each_record`].
pub fn cpu_time_ranges(
    path: &Path,
    layout: &Layout,
) -> Result<Vec<Option<(u64, u64)>>, TraceDatError> {
    let src = Src::open(path)?;
    let ps = u64::from(layout.page_size);
    let mut ranges: Vec<Option<(u64, u64)>> = Vec::new();
    let mut page = vec![0; layout.page_size as usize];
    let mut bufs = (Vec::new(), Vec::new());
    for b in &layout.buffers {
        for cd in b.cpus.iter().filter(|c| c.size > 0) {
            // `unit(i)`: the (min, max) timestamps of page or chunk `i`.
            let mut unit =
                |i: u64, chunks: &[ChunkHdr]| -> Result<Option<(u64, u64)>, TraceDatError> {
                    let mut r: Option<(u64, u64)> = None;
                    let mut f = |_: u32, ts: u64, _: &[u8]| {
                        r = Some(r.map_or((ts, ts), |(lo, hi)| (lo.min(ts), hi.max(ts))));
                        Ok(())
                    };
                    if b.compressed {
                        let h = chunks[usize::try_from(i).unwrap_or(0)];
                        walk_chunk(&src, layout, h, cd.cpu, &mut bufs, &mut f)?;
                    } else {
                        let at = cd.offset + i * ps;
                        let len = ps.min(cd.offset + cd.size - at);
                        let page = &mut page[..usize::try_from(len).unwrap_or(0)];
                        src.read_into(at, page, "ring buffer page")?;
                        walk_page(&src, PageAt::File(at), page, cd.cpu, &mut f)?;
                    }
                    Ok(r)
                };
            let mut chunks = Vec::new();
            let count = if b.compressed {
                let mut it = Chunks::open(&src, layout, cd)?;
                while let Some(h) = it.next(&src, ps)? {
                    chunks.push(h);
                }
                chunks.len() as u64
            } else {
                cd.size.div_ceil(ps)
            };
            let mut first = None;
            let mut lo_unit = 0;
            while lo_unit < count {
                first = unit(lo_unit, &chunks)?;
                if first.is_some() {
                    break;
                }
                lo_unit += 1;
            }
            let Some((lo, mut hi)) = first else {
                continue;
            };
            for i in (lo_unit + 1..count).rev() {
                if let Some((_, h)) = unit(i, &chunks)? {
                    hi = hi.max(h);
                    break;
                }
            }
            let cpu = cd.cpu as usize;
            if cpu >= MAX_CPUS {
                return Err(src.err(
                    0,
                    format!(
                        "buffer {:?} has data for CPU {cpu}: more than {MAX_CPUS} CPUs",
                        b.name
                    ),
                ));
            }
            if ranges.len() <= cpu {
                ranges.resize(cpu + 1, None);
            }
            ranges[cpu] = Some(ranges[cpu].map_or((lo, hi), |(a, b)| (a.min(lo), b.max(hi))));
        }
    }
    Ok(ranges)
}

/// Calls `f` for every event of `buffer`'s CPU data in `path` ([`for_each_record`] with the
/// `vmtsync` event fields decoded).
///
/// # Errors
/// As [`for_each_record`], and `Parse` for a `vmtsync:event_data` payload length above 16.
pub fn for_each_event(
    path: &Path,
    layout: &Layout,
    buffer: usize,
    mut f: impl FnMut(&Event),
) -> Result<u64, TraceDatError> {
    records(path, layout, buffer, &mut |cpu, ts, rec| {
        let len = rec.len();
        let mut ev = Event {
            cpu,
            ts,
            common_type: if len >= 2 {
                u16::from_le_bytes([rec[0], rec[1]])
            } else {
                0
            },
            id: 0,
            len: 0,
            payload: [0; MAX_PAYLOAD],
        };
        if is_vmtsync_event(ev.common_type) && len >= 12 {
            ev.id = u32::from_le_bytes(rec[8..12].try_into().unwrap_or([0; 4]));
        }
        if ev.common_type == EVENT_DATA_ID {
            // `__data_loc`: the payload's offset (ours is always PAYLOAD_AT) and length.
            let loc = rec
                .get(12..16)
                .ok_or((0, "vmtsync event_data shorter than its fields"))?;
            let (at, l) = (
                usize::from(u16::from_le_bytes([loc[0], loc[1]])),
                usize::from(u16::from_le_bytes([loc[2], loc[3]])),
            );
            if at != PAYLOAD_AT || l > MAX_PAYLOAD {
                return Err((12, "vmtsync payload location not 16 or length above 16"));
            }
            let p = rec
                .get(at..at + l)
                .ok_or((12, "vmtsync payload runs past its record"))?;
            ev.len = u8::try_from(l).unwrap_or(0);
            ev.payload[..l].copy_from_slice(p);
        }
        if ev.common_type == EVENT_DATA_FIXED_ID && len >= 32 {
            let l = u16::from_le_bytes([rec[12], rec[13]]);
            if usize::from(l) > MAX_PAYLOAD {
                return Err((12, "vmtsync payload length above 16"));
            }
            ev.len = u8::try_from(l).unwrap_or(0);
            ev.payload.copy_from_slice(&rec[16..32]);
        }
        f(&ev);
        Ok(())
    })
}

/// Walks one page with [`super::page::walk_records`] (kbuffer-parse.c semantics: every record
/// inside `commit`), naming the failing byte by where the page came from.
fn walk_page(
    src: &Src,
    page_at: PageAt,
    page: &[u8],
    cpu: u32,
    f: &mut RecordFn<'_>,
) -> Result<u64, TraceDatError> {
    let mut rejected = None;
    let n = super::page::walk_records(page, |ts, data, rec| match f(cpu, ts, rec) {
        Ok(()) => true,
        Err((i, what)) => {
            rejected = Some((data + i, what));
            false
        }
    })
    .map_err(|e| src.page_err(page_at, e.at, e.reason))?;
    match rejected {
        Some((at, what)) => Err(src.page_err(page_at, at, what)),
        None => Ok(n),
    }
}

/// Reads the layout and every event of one of our files (or any uncompressed one): the check
/// that catches truncation and damage `trace-cmd report` would pass over.
///
/// # Errors
/// As [`read_layout`] and [`for_each_event`].
pub fn verify_file(path: &Path) -> Result<(Layout, u64), TraceDatError> {
    let layout = read_layout(path)?;
    if layout.version == 7 && !layout.has_strings {
        return Err(TraceDatError::Parse {
            path: path.to_path_buf(),
            offset: layout.file_len,
            reason: "no strings section (truncated?)".into(),
        });
    }
    let mut n = 0;
    for b in 0..layout.buffers.len() {
        n += for_each_event(path, &layout, b, |_| {})?;
    }
    Ok((layout, n))
}

#[cfg(test)]
mod tests;
