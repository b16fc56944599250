//! A strict reader: the layout of any v6/v7 trace.dat (header, sections, the options chain,
//! buffers and their per-CPU data), and the events of uncompressed files such as ours.
//!
//! Every size and offset is checked against the file's length before it is used, so a damaged
//! or truncated file yields [`TraceDatError::Parse`] with the byte offset where parsing failed,
//! never a panic and never an allocation the file's claims alone would size (claims are bounded
//! by the file length first). trace-cmd's own `report` exits 0 on a truncated file; this is the
//! check to rely on.
//!
//! Compressed sections (what `trace-cmd extract` writes here) are walked, not decompressed:
//! enough to find and extend the options chain of a host file. Events are read only from
//! uncompressed flyrecord data.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::consts::{MAGIC, SEC_FL_COMPRESS, SECTION_HEADER_SIZE, TRACING, option};
use super::error::TraceDatError;
use super::format::{EVENT_DATA_ID, EVENT_ID, MAX_PAYLOAD};
use super::page::walk_records;

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
    /// v6: offset of the top buffer's `"flyrecord\0"`.
    pub flyrecord: Option<u64>,
    /// v6: offset just past the top buffer's CPU table and clock (where padding begins).
    pub flyrecord_end: Option<u64>,
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
    pub fn tsc2nsec(&self) -> Option<super::writer::Tsc2Nsec> {
        let d = &self.options_with(option::TSC2NSEC).last()?.data;
        let u32_at = |i: usize| u32::from_le_bytes(d[i..i + 4].try_into().unwrap_or([0; 4]));
        (d.len() >= 16).then(|| super::writer::Tsc2Nsec {
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
    // trace-cmd writes the strings section last; a file cut at a section boundary loses it.
    if !strings_found {
        return Err(src.err(src.len, "no strings section (truncated?)"));
    }
    let find = |off: u64, id: u16, what: &str| {
        sections
            .iter()
            .find(|s| s.offset == off && s.id == id)
            .copied()
            .ok_or_else(|| src.err(off, format!("{what}: no section {id} starts here")))
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
        flyrecord: None,
        flyrecord_end: None,
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
        flyrecord,
        flyrecord_end,
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

/// Calls `f` for every event of `buffer`'s CPU data in `path`, CPU by CPU in file order, page
/// by page (constant memory). Returns the number of events.
///
/// # Errors
/// `Parse` with the failing offset for a malformed page or event, `Unsupported` for compressed
/// data.
pub fn for_each_event(
    path: &Path,
    layout: &Layout,
    buffer: usize,
    mut f: impl FnMut(&Event),
) -> Result<u64, TraceDatError> {
    let src = Src::open(path)?;
    let Some(b) = layout.buffers.get(buffer) else {
        return Ok(0);
    };
    if b.compressed {
        return Err(TraceDatError::Unsupported {
            path: src.path.clone(),
            reason: "compressed CPU data: run `trace-cmd convert --compression none` first".into(),
        });
    }
    let ps = u64::from(layout.page_size);
    let mut page = vec![0; layout.page_size as usize];
    let mut n = 0;
    for cd in &b.cpus {
        let mut at = cd.offset;
        let end = cd.offset + cd.size;
        while at < end {
            let len = ps.min(end - at);
            let page = &mut page[..usize::try_from(len).unwrap_or(0)];
            src.read_into(at, page, "ring buffer page")?;
            n += walk_page(&src, at, page, cd.cpu, &mut f)?;
            at += len;
        }
    }
    Ok(n)
}

/// Walks one page (kbuffer-parse.c semantics, [`super::page::walk_records`]) and decodes
/// our own events' fields.
fn walk_page(
    src: &Src,
    page_at: u64,
    page: &[u8],
    cpu: u32,
    f: &mut impl FnMut(&Event),
) -> Result<u64, TraceDatError> {
    let mut bad_payload = None;
    let n = walk_records(page, |ts, data, rec| {
        let mut ev = Event {
            cpu,
            ts,
            common_type: if rec.len() >= 2 {
                u16::from_le_bytes([rec[0], rec[1]])
            } else {
                0
            },
            id: 0,
            len: 0,
            payload: [0; MAX_PAYLOAD],
        };
        if (ev.common_type == EVENT_ID || ev.common_type == EVENT_DATA_ID) && rec.len() >= 12 {
            ev.id = u32::from_le_bytes(rec[8..12].try_into().unwrap_or([0; 4]));
        }
        if ev.common_type == EVENT_DATA_ID && rec.len() >= 32 {
            let l = u16::from_le_bytes([rec[12], rec[13]]);
            if usize::from(l) > MAX_PAYLOAD {
                bad_payload.get_or_insert(data + 12);
                return false;
            }
            ev.len = u8::try_from(l).unwrap_or(0);
            ev.payload.copy_from_slice(&rec[16..32]);
        }
        f(&ev);
        true
    })
    .map_err(|e| src.err(page_at + e.at as u64, e.reason))?;
    match bad_payload {
        Some(at) => Err(src.err(page_at + at as u64, "vmtsync payload length above 16")),
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
    let mut n = 0;
    for b in 0..layout.buffers.len() {
        n += for_each_event(path, &layout, b, |_| {})?;
    }
    Ok((layout, n))
}

#[cfg(test)]
mod tests;
