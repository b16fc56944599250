//! Reading another process's memory: the [`GuestMemory`] trait, `/proc/PID/mem`
//! ([`ProcMemory`]) and an in-memory fake that can change between reads ([`FakeMemory`]).

use std::fs::File;
use std::io::{self, ErrorKind};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use thiserror::Error;

use crate::kvm::procinfo::ProcFs;

/// The page size `/proc/PID/pagemap` counts in (x86-64 base pages).
pub const PAGE_SIZE: u64 = 4096;

/// One mapping of the VMM's address space (a `/proc/PID/maps` line).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
    /// Whether the mapping is writable (guest RAM always is).
    pub writable: bool,
    /// The path or `[name]` column, empty for an anonymous mapping.
    pub name: String,
}

impl Region {
    /// Whether `[addr, addr + len)` lies wholly inside this mapping.
    #[must_use]
    pub fn holds(&self, addr: u64, len: u64) -> bool {
        addr >= self.start && addr.checked_add(len).is_some_and(|e| e <= self.end)
    }
}

/// Why memory could not be read.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MemError {
    /// The process is gone: its proc files no longer exist.
    #[error("{path} is gone: the VMM process exited")]
    Exited {
        /// The file.
        path: PathBuf,
    },
    /// A proc file could not be opened.
    #[error("open {path}: {source} (reading a VMM's memory needs root or CAP_SYS_PTRACE)")]
    Open {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// A read failed.
    #[error("read {len} bytes at {addr:#x}: {source}")]
    Read {
        /// Host virtual address.
        addr: u64,
        /// Bytes asked for.
        len: usize,
        /// The OS error (EIO: nothing mapped there; ESRCH: the process exited).
        source: io::Error,
    },
    /// The address range is not mapped (the fake's answer; the kernel gives EIO).
    #[error("{len} bytes at {addr:#x} are not mapped")]
    Unmapped {
        /// Host virtual address.
        addr: u64,
        /// Bytes asked for.
        len: usize,
    },
    /// A `maps` line did not parse.
    #[error("unexpected line in {path}: {line:?}")]
    Maps {
        /// The maps file.
        path: PathBuf,
        /// The line.
        line: String,
    },
}

impl MemError {
    /// The error of opening `path`: [`MemError::Exited`] when the process is gone (the file
    /// no longer exists, or ESRCH), else [`MemError::Open`].
    fn open(path: PathBuf, source: io::Error) -> Self {
        if source.kind() == io::ErrorKind::NotFound || source.raw_os_error() == Some(libc::ESRCH) {
            Self::Exited { path }
        } else {
            Self::Open { path, source }
        }
    }
}

/// A process's memory, read only.
pub trait GuestMemory {
    /// Fills `buf` from host virtual address `addr`, all of it or an error.
    ///
    /// # Errors
    /// The range is not (or no longer) readable.
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), MemError>;

    /// The process's mappings, in address order.
    ///
    /// # Errors
    /// The mapping list could not be read.
    fn regions(&mut self) -> Result<Vec<Region>, MemError>;

    /// Marks in `present[i]` whether page `first_page + i` (page numbers: address / 4096)
    /// holds data (resident or swapped). Returns `false`, leaving `present` alone, when the
    /// process's page state is unknown: then every page must be read.
    ///
    /// # Errors
    /// Only for failures that should stop the caller; an unreadable page map is `Ok(false)`.
    fn resident(&mut self, first_page: u64, present: &mut [bool]) -> Result<bool, MemError> {
        let _ = (first_page, present);
        Ok(false)
    }
}

/// `/proc/PID/pagemap` entry bit: the page is in RAM.
const PM_PRESENT: u64 = 1 << 63;
/// `/proc/PID/pagemap` entry bit: the page is in swap.
const PM_SWAPPED: u64 = 1 << 62;

/// A live process's memory through `/proc/PID/mem` (`pread` at the host virtual address).
#[derive(Debug)]
pub struct ProcMemory {
    mem: File,
    maps: PathBuf,
    /// `None` when the page map cannot be opened (then no page is skipped).
    pagemap: Option<File>,
    /// Reused page-map read buffer (8 bytes a page).
    pm_buf: Vec<u8>,
}

impl ProcMemory {
    /// Opens process `pid`'s memory under `proc` (normally `/proc`).
    ///
    /// # Errors
    /// [`MemError::Open`] if `mem` cannot be opened (no such process, or not root).
    pub fn open(proc: &ProcFs, pid: u32) -> Result<Self, MemError> {
        let dir = proc.root().join(pid.to_string());
        let path = dir.join("mem");
        let mem = File::open(&path).map_err(|source| MemError::open(path, source))?;
        let pagemap = File::open(dir.join("pagemap")).ok();
        Ok(Self {
            mem,
            maps: dir.join("maps"),
            pagemap,
            pm_buf: Vec::new(),
        })
    }
}

/// Parses one `/proc/PID/maps` line: `start-end perms offset dev inode [name]`.
fn parse_maps_line(line: &str) -> Option<Region> {
    let mut cols = line.splitn(6, ' ');
    let range = cols.next()?;
    let perms = cols.next()?;
    let (start, end) = range.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    if end < start {
        return None;
    }
    let _offset = cols.next()?;
    let _dev = cols.next()?;
    let _inode = cols.next()?;
    let name = cols.next().unwrap_or("").trim_start().to_owned();
    Some(Region {
        start,
        end,
        writable: perms.as_bytes().get(1) == Some(&b'w'),
        name,
    })
}

impl GuestMemory for ProcMemory {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), MemError> {
        let len = buf.len();
        self.mem.read_exact_at(buf, addr).map_err(|source| {
            if source.kind() == ErrorKind::UnexpectedEof {
                MemError::Unmapped { addr, len }
            } else {
                MemError::Read { addr, len, source }
            }
        })
    }

    fn regions(&mut self) -> Result<Vec<Region>, MemError> {
        let text = std::fs::read_to_string(&self.maps)
            .map_err(|source| MemError::open(self.maps.clone(), source))?;
        text.lines()
            .filter(|l| !l.is_empty())
            .map(|l| {
                parse_maps_line(l).ok_or_else(|| MemError::Maps {
                    path: self.maps.clone(),
                    line: l.to_owned(),
                })
            })
            .collect()
    }

    fn resident(&mut self, first_page: u64, present: &mut [bool]) -> Result<bool, MemError> {
        let Some(pm) = &self.pagemap else {
            return Ok(false);
        };
        self.pm_buf.resize(present.len() * 8, 0);
        let Some(off) = first_page.checked_mul(8) else {
            return Ok(false);
        };
        // A page map that does not read (an old kernel, a restricted one) costs speed, not
        // correctness: the caller reads every page instead.
        if pm.read_exact_at(&mut self.pm_buf, off).is_err() {
            return Ok(false);
        }
        for (p, e) in present.iter_mut().zip(self.pm_buf.chunks_exact(8)) {
            let mut w = [0u8; 8];
            w.copy_from_slice(e);
            let entry = u64::from_le_bytes(w);
            *p = entry & (PM_PRESENT | PM_SWAPPED) != 0;
        }
        Ok(true)
    }
}

/// A hook the fake runs before each piece of a read: it may rewrite memory as a guest would.
pub type FakeHook = Box<dyn FnMut(&mut FakeMemory) + Send>;

/// One mapping of the fake.
#[derive(Debug, Clone)]
struct FakeRegion {
    start: u64,
    bytes: Vec<u8>,
    writable: bool,
    /// Pages the page map calls absent (numbers relative to `start`).
    absent_pages: Vec<u64>,
}

/// Process memory held in vectors, for tests and the fuzzer.
///
/// Reads can be split into pieces of [`FakeMemory::set_granule`] bytes, taken in an order
/// scrambled by a seed, with [`FakeMemory::set_hook`]'s hook run before every piece: that is
/// how a test lets a "guest" write between (and inside) the reader's copies, in an order the
/// reader cannot rely on.
pub struct FakeMemory {
    regions: Vec<FakeRegion>,
    hook: Option<FakeHook>,
    granule: usize,
    scramble: u64,
    /// Reads served so far (each piece counts).
    pub pieces_read: u64,
    /// Whether [`GuestMemory::resident`] answers (like a readable page map).
    pub pagemap: bool,
}

impl std::fmt::Debug for FakeMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeMemory")
            .field("regions", &self.regions.len())
            .field("granule", &self.granule)
            .field("pieces_read", &self.pieces_read)
            .finish_non_exhaustive()
    }
}

impl Default for FakeMemory {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeMemory {
    /// No mappings; whole reads; a readable page map.
    #[must_use]
    pub fn new() -> Self {
        Self {
            regions: Vec::new(),
            hook: None,
            granule: 0,
            scramble: 0,
            pieces_read: 0,
            pagemap: true,
        }
    }

    /// Adds a zero-filled mapping of `len` bytes at `start` (kept in address order).
    pub fn map(&mut self, start: u64, len: usize, writable: bool) {
        self.regions.push(FakeRegion {
            start,
            bytes: vec![0; len],
            writable,
            absent_pages: Vec::new(),
        });
        self.regions.sort_by_key(|r| r.start);
    }

    /// Marks the page holding `addr` absent in the page map.
    pub fn mark_absent(&mut self, addr: u64) {
        if let Some(r) = self.region_mut(addr, 1) {
            r.absent_pages.push((addr - r.start) / PAGE_SIZE);
        }
    }

    /// Splits every read into pieces of `granule` bytes (0: whole reads), served in an
    /// order scrambled by `scramble` (0: in address order).
    pub fn set_granule(&mut self, granule: usize, scramble: u64) {
        self.granule = granule;
        self.scramble = scramble;
    }

    /// Runs `hook` before every piece of every read.
    pub fn set_hook(&mut self, hook: FakeHook) {
        self.hook = Some(hook);
    }

    fn region_mut(&mut self, addr: u64, len: usize) -> Option<&mut FakeRegion> {
        self.regions.iter_mut().find(|r| {
            addr >= r.start
                && (addr - r.start)
                    .checked_add(len as u64)
                    .is_some_and(|e| e <= r.bytes.len() as u64)
        })
    }

    fn slice_mut(&mut self, addr: u64, len: usize) -> Option<&mut [u8]> {
        let r = self.region_mut(addr, len)?;
        let off = usize::try_from(addr - r.start).ok()?;
        r.bytes.get_mut(off..off + len)
    }

    /// Writes `bytes` at `addr` (a guest's store). Panics if the range is not mapped: this
    /// is test set-up, where that is a bug in the test.
    pub fn write(&mut self, addr: u64, bytes: &[u8]) {
        self.slice_mut(addr, bytes.len())
            .expect("fake write inside a mapping")
            .copy_from_slice(bytes);
    }

    /// Writes a little-endian `u64` at `addr`.
    pub fn write_u64(&mut self, addr: u64, v: u64) {
        self.write(addr, &v.to_le_bytes());
    }

    /// Reads a little-endian `u64` at `addr`, if mapped (for test checks).
    #[must_use]
    pub fn peek_u64(&mut self, addr: u64) -> Option<u64> {
        let s = self.slice_mut(addr, 8)?;
        let mut w = [0u8; 8];
        w.copy_from_slice(s);
        Some(u64::from_le_bytes(w))
    }

    fn read_piece(&mut self, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        if let Some(mut hook) = self.hook.take() {
            hook(self);
            self.hook = Some(hook);
        }
        self.pieces_read += 1;
        let len = out.len();
        let src = self
            .slice_mut(addr, len)
            .ok_or(MemError::Unmapped { addr, len })?;
        out.copy_from_slice(src);
        Ok(())
    }
}

impl GuestMemory for FakeMemory {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), MemError> {
        let len = buf.len();
        if addr.checked_add(len as u64).is_none() {
            return Err(MemError::Unmapped { addr, len });
        }
        if self.granule == 0 || len <= self.granule {
            return self.read_piece(addr, buf);
        }
        let pieces = len.div_ceil(self.granule);
        // A fixed odd multiplier walks every piece exactly once when the count is a power of
        // two; otherwise the order falls back to a rotation. Either way each piece is read
        // once, in an order the reader does not choose.
        let rot = usize::try_from(self.scramble % pieces as u64).unwrap_or(0);
        let odd = pieces.is_power_of_two() && self.scramble != 0;
        for k in 0..pieces {
            let i = if odd {
                (k.wrapping_mul(2 * (rot | 1) + 1).wrapping_add(rot)) % pieces
            } else {
                (k + rot) % pieces
            };
            let lo = i * self.granule;
            let hi = (lo + self.granule).min(len);
            self.read_piece(addr + lo as u64, &mut buf[lo..hi])?;
        }
        Ok(())
    }

    fn regions(&mut self) -> Result<Vec<Region>, MemError> {
        Ok(self
            .regions
            .iter()
            .map(|r| Region {
                start: r.start,
                end: r.start + r.bytes.len() as u64,
                writable: r.writable,
                name: String::new(),
            })
            .collect())
    }

    fn resident(&mut self, first_page: u64, present: &mut [bool]) -> Result<bool, MemError> {
        if !self.pagemap {
            return Ok(false);
        }
        for (i, p) in present.iter_mut().enumerate() {
            let page = first_page + i as u64;
            let addr = page * PAGE_SIZE;
            *p = self.regions.iter().any(|r| {
                addr >= r.start
                    && addr < r.start + r.bytes.len() as u64
                    && !r.absent_pages.contains(&((addr - r.start) / PAGE_SIZE))
            });
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_parse() {
        let r = parse_maps_line(
            "7f0000000000-7f0100000000 rw-p 00000000 00:00 0                          ",
        )
        .expect("anonymous line");
        assert_eq!(
            (r.start, r.end, r.writable),
            (0x7f00_0000_0000, 0x7f01_0000_0000, true)
        );
        assert_eq!(r.name, "");
        let r =
            parse_maps_line("55d0c0000000-55d0c0021000 r--p 00000000 fd:01 1234   /usr/bin/qemu")
                .expect("file line");
        assert!(!r.writable);
        assert_eq!(r.name, "/usr/bin/qemu");
        assert_eq!(parse_maps_line("garbage"), None);
        assert_eq!(parse_maps_line("2000-1000 rw-p 0 0:0 0"), None);
    }

    #[test]
    fn fake_pieces_cover_every_byte_once() {
        for scramble in [0, 1, 7, 12345] {
            let mut m = FakeMemory::new();
            m.map(0x1000, 256, true);
            let data: Vec<u8> = (0..=255).collect();
            m.write(0x1000, &data);
            m.set_granule(8, scramble);
            let mut buf = [0u8; 200];
            m.read(0x1010, &mut buf).expect("mapped");
            assert_eq!(&buf[..], &data[16..216]);
            assert_eq!(m.pieces_read, 25);
        }
    }
}
