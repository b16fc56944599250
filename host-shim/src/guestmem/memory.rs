//! Reading another process's memory: the [`GuestMemory`] trait, a live process
//! ([`ProcMemory`]: `process_vm_readv(2)`, falling back to `/proc/PID/mem`) and an in-memory
//! fake that can change between reads ([`FakeMemory`]).

use std::fs::File;
use std::io::{self, ErrorKind, IoSliceMut};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use nix::errno::Errno;
use nix::sys::uio::{self, RemoteIoVec};
use nix::unistd::Pid;
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

    /// Fills each `(addr, buf)` of `parts`, all of them or an error, in slice order: part
    /// `i` is read completely before part `i + 1` begins, and each part's bytes as
    /// [`GuestMemory::read`] reads them. A reader may do this in fewer system calls than one
    /// per part ([`ProcMemory`]: one `process_vm_readv` per batch of parts, which the kernel
    /// documents to process in array order); the default reads them one by one.
    ///
    /// # Errors
    /// The first part that is not (or no longer) readable; the parts before it were read.
    fn read_many(&mut self, parts: &mut [(u64, &mut [u8])]) -> Result<(), MemError> {
        for (addr, buf) in parts.iter_mut() {
            self.read(*addr, buf)?;
        }
        Ok(())
    }

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

/// How [`ProcMemory`] copies the other process's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReadMethod {
    /// `process_vm_readv(2)`: the kernel copies straight from the other process's pages into
    /// ours. What [`ProcMemory::open`] starts with: per byte, it is the faster of the two
    /// (`cargo xtask bench`, section 8b, measures both on the same guest).
    VmReadv,
    /// `pread(2)` on `/proc/PID/mem`: the kernel copies each page into a bounce page, then
    /// into ours. The fallback when `process_vm_readv` is refused (`EPERM`: a ptrace policy
    /// that allows the open but not the call; `ENOSYS`: a kernel without cross-memory attach,
    /// or a seccomp filter), and the path every failed read is finished on, so errors read as
    /// they always did.
    Pread,
}

impl ReadMethod {
    /// The name the bench and the examples print: `process_vm_readv` or `pread`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::VmReadv => "process_vm_readv",
            Self::Pread => "pread",
        }
    }
}

/// Parts per `process_vm_readv` call in [`ProcMemory`]'s [`GuestMemory::read_many`] (the
/// kernel takes up to `IOV_MAX` = 1024).
const IOV_BATCH: usize = 64;

/// A live process's memory: `process_vm_readv(2)` at the host virtual address, with
/// `/proc/PID/mem` (`pread`) as the fallback and for the errors.
///
/// `/proc/PID/mem` is opened either way: it is the permission check every caller already
/// handles ([`MemError::Open`], [`MemError::Exited`]), and a read that `process_vm_readv`
/// cannot complete (a page not mapped, the process gone, any error) is finished through it,
/// so a failed read returns exactly the error a `pread` read returned before (`EIO` for an
/// unmapped page: [`MemError::Read`]; [`MemError::Unmapped`] once the process has exited).
#[derive(Debug)]
pub struct ProcMemory {
    pid: libc::pid_t,
    method: ReadMethod,
    mem: File,
    maps: PathBuf,
    /// `None` when the page map cannot be opened (then no page is skipped).
    pagemap: Option<File>,
    /// Reused page-map read buffer (8 bytes a page).
    pm_buf: Vec<u8>,
}

impl ProcMemory {
    /// Opens process `pid`'s memory under `proc` (normally `/proc`), reading with
    /// [`ReadMethod::VmReadv`] (falling back to [`ReadMethod::Pread`] if the kernel refuses
    /// it).
    ///
    /// # Errors
    /// [`MemError::Open`] if `mem` cannot be opened (no such process, or not root).
    pub fn open(proc: &ProcFs, pid: u32) -> Result<Self, MemError> {
        Self::open_with(proc, pid, ReadMethod::VmReadv)
    }

    /// [`ProcMemory::open`] with the read method chosen (the bench compares them).
    ///
    /// `process_vm_readv` addresses the process by PID, not by the open file, so it is used
    /// only when `proc` is the system's `/proc` (a test's fake proc tree names no live
    /// process).
    ///
    /// # Errors
    /// As [`ProcMemory::open`].
    pub fn open_with(proc: &ProcFs, pid: u32, method: ReadMethod) -> Result<Self, MemError> {
        let dir = proc.root().join(pid.to_string());
        let path = dir.join("mem");
        let mem = File::open(&path).map_err(|source| MemError::open(path, source))?;
        let pagemap = File::open(dir.join("pagemap")).ok();
        let pid_t = libc::pid_t::try_from(pid).ok();
        let method = match pid_t {
            Some(_) if proc.root() == std::path::Path::new("/proc") => method,
            _ => ReadMethod::Pread,
        };
        Ok(Self {
            pid: pid_t.unwrap_or(0),
            method,
            mem,
            maps: dir.join("maps"),
            pagemap,
            pm_buf: Vec::new(),
        })
    }

    /// How reads are done now ([`ReadMethod::Pread`] after `process_vm_readv` was refused).
    #[must_use]
    pub fn method(&self) -> ReadMethod {
        self.method
    }

    /// `pread` on `/proc/PID/mem` until `buf` is full; errors for the read the caller asked
    /// for (`addr`, `len`), as before `process_vm_readv` was used.
    fn pread(&self, at: u64, buf: &mut [u8], addr: u64, len: usize) -> Result<(), MemError> {
        self.mem.read_exact_at(buf, at).map_err(|source| {
            if source.kind() == ErrorKind::UnexpectedEof {
                MemError::Unmapped { addr, len }
            } else {
                MemError::Read { addr, len, source }
            }
        })
    }

    /// One `process_vm_readv` of `parts` (at most [`IOV_BATCH`]): the bytes copied, in order
    /// (all of them, or fewer when a page is not mapped or the call fails). Switches to
    /// [`ReadMethod::Pread`] for good when the kernel refuses the call itself.
    fn vm_readv(&mut self, parts: &mut [(u64, &mut [u8])]) -> usize {
        let n = parts.len().min(IOV_BATCH);
        let mut remote = [RemoteIoVec { base: 0, len: 0 }; IOV_BATCH];
        for (r, (addr, buf)) in remote.iter_mut().zip(parts.iter()) {
            let Ok(base) = usize::try_from(*addr) else {
                // An address no pointer holds: nothing is read, `pread` answers.
                return 0;
            };
            *r = RemoteIoVec {
                base,
                len: buf.len(),
            };
        }
        let mut local: Vec<IoSliceMut<'_>> = parts[..n]
            .iter_mut()
            .map(|(_, buf)| IoSliceMut::new(buf))
            .collect();
        self.readv(&mut local, &remote[..n])
    }

    /// One `process_vm_readv` (again after EINTR): the bytes copied, 0 when it failed. A
    /// refusal (EPERM, ENOSYS) switches this reader to `pread` for good; any other failure
    /// (EFAULT: not mapped, ESRCH: gone, ENOMEM, ...) is left to `pread` to answer.
    fn readv(&mut self, local: &mut [IoSliceMut<'_>], remote: &[RemoteIoVec]) -> usize {
        loop {
            match uio::process_vm_readv(Pid::from_raw(self.pid), local, remote) {
                Ok(copied) => return copied,
                Err(Errno::EINTR) => {}
                Err(Errno::EPERM | Errno::ENOSYS) => {
                    self.method = ReadMethod::Pread;
                    return 0;
                }
                Err(_) => return 0,
            }
        }
    }

    /// [`ProcMemory::vm_readv`] of one buffer (no allocation).
    fn vm_readv_one(&mut self, addr: u64, buf: &mut [u8]) -> usize {
        let Ok(base) = usize::try_from(addr) else {
            return 0;
        };
        let remote = [RemoteIoVec {
            base,
            len: buf.len(),
        }];
        let mut local = [IoSliceMut::new(buf)];
        self.readv(&mut local, &remote)
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
        let mut done = 0;
        // A partial transfer stops at the first page that cannot be read; asking again for
        // the rest from there either makes progress or fails at once, and then `pread`
        // finishes (or fails) exactly as it always did.
        while self.method == ReadMethod::VmReadv && done < len {
            let Some(at) = addr.checked_add(done as u64) else {
                break;
            };
            let copied = self.vm_readv_one(at, &mut buf[done..]);
            if copied == 0 {
                break;
            }
            done += copied;
        }
        if done == len {
            return Ok(());
        }
        self.pread(addr.wrapping_add(done as u64), &mut buf[done..], addr, len)
    }

    fn read_many(&mut self, parts: &mut [(u64, &mut [u8])]) -> Result<(), MemError> {
        let mut i = 0;
        while i < parts.len() {
            if self.method != ReadMethod::VmReadv {
                let (addr, buf) = &mut parts[i];
                self.read(*addr, buf)?;
                i += 1;
                continue;
            }
            let batch = (parts.len() - i).min(IOV_BATCH);
            let want: usize = parts[i..i + batch].iter().map(|(_, b)| b.len()).sum();
            let mut copied = self.vm_readv(&mut parts[i..i + batch]);
            if copied == want {
                i += batch;
                continue;
            }
            // Short: the parts wholly copied are done; the one it stopped in is finished by
            // `read` from where it stopped (keeping the order), the rest of the batch by the
            // loop.
            while copied > 0 && copied >= parts[i].1.len() {
                copied -= parts[i].1.len();
                i += 1;
            }
            let (addr, buf) = &mut parts[i];
            let len = buf.len();
            let rest = &mut buf[copied..];
            if let Err(e) = self.read(addr.wrapping_add(copied as u64), rest) {
                // The error names the whole part, as a `read` of it would.
                return Err(match e {
                    MemError::Read { source, .. } => MemError::Read {
                        addr: *addr,
                        len,
                        source,
                    },
                    MemError::Unmapped { .. } => MemError::Unmapped { addr: *addr, len },
                    other => other,
                });
            }
            i += 1;
        }
        Ok(())
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

    /// The end of our main thread's stack: the mapped page below it holds bytes that do not
    /// change while the tests run (the program's arguments and environment), and nothing is
    /// mapped above it (mmap places mappings below the stack; only `[vsyscall]` lies above).
    fn stack_end() -> u64 {
        let mut m = own(ReadMethod::Pread);
        m.regions()
            .expect("our maps")
            .into_iter()
            .find(|r| r.name == "[stack]")
            .expect("a [stack] mapping")
            .end
    }

    fn own(method: ReadMethod) -> ProcMemory {
        ProcMemory::open_with(&ProcFs::default(), std::process::id(), method).expect("own mem")
    }

    /// What an error says, for comparing the two methods: the variant, the address and length
    /// it names, and the OS error.
    fn shape(e: &MemError) -> (String, u64, usize, Option<i32>) {
        match e {
            MemError::Read { addr, len, source } => {
                ("read".into(), *addr, *len, source.raw_os_error())
            }
            MemError::Unmapped { addr, len } => ("unmapped".into(), *addr, *len, None),
            other => (other.to_string(), 0, 0, None),
        }
    }

    #[test]
    fn guestmem_both_methods_read_our_own_buffer() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
        let addr = data.as_ptr() as u64;
        let mut vm = own(ReadMethod::VmReadv);
        assert_eq!(
            vm.method(),
            ReadMethod::VmReadv,
            "root may read its own memory with process_vm_readv"
        );
        assert_eq!(
            ProcMemory::open(&ProcFs::default(), std::process::id())
                .expect("open")
                .method(),
            ReadMethod::VmReadv
        );
        let mut pr = own(ReadMethod::Pread);
        assert_eq!(pr.method(), ReadMethod::Pread);
        for (off, len) in [
            (0, 100_000),
            (1, 1),
            (4095, 2),
            (12_345, 54_321),
            (99_999, 1),
            (7, 0),
        ] {
            let want = &data[off..off + len];
            for m in [&mut vm, &mut pr] {
                let mut buf = vec![0xAA; len];
                m.read(addr + off as u64, &mut buf).expect("our own buffer");
                assert_eq!(buf, want, "{:?} at +{off}, {len} bytes", m.method());
            }
        }
        assert_eq!(vm.method(), ReadMethod::VmReadv, "no fallback needed");
    }

    #[test]
    fn guestmem_an_unmapped_page_fails_alike_with_both_methods() {
        let end = stack_end();
        let mut vm = own(ReadMethod::VmReadv);
        let mut pr = own(ReadMethod::Pread);
        // Wholly unmapped, and straddling the mapped page and what lies past it.
        for (addr, len) in [
            (end + PAGE_SIZE, 64),
            (end, 1),
            (end - 16, 64),
            (end - PAGE_SIZE, 2 * 4096),
        ] {
            let mut a = vec![0; len];
            let mut b = vec![0; len];
            let ea = vm.read(addr, &mut a).expect_err("not mapped");
            let eb = pr.read(addr, &mut b).expect_err("not mapped");
            assert_eq!(shape(&ea), shape(&eb), "{addr:#x}+{len}: {ea} / {eb}");
            assert_eq!(
                shape(&eb),
                ("read".into(), addr, len, Some(libc::EIO)),
                "pread on /proc/PID/mem says EIO"
            );
            assert_eq!(a[..len.min(16)], b[..len.min(16)], "the mapped bytes alike");
        }
        // The mapped page still reads, alike, and the reader still uses process_vm_readv.
        let (mut a, mut b) = (vec![0; 16], vec![0; 16]);
        vm.read(end - 16, &mut a).expect("mapped");
        pr.read(end - 16, &mut b).expect("mapped");
        assert_eq!(a, b);
        assert_eq!(vm.method(), ReadMethod::VmReadv);
    }

    #[test]
    fn guestmem_read_many_reads_every_part_in_order_or_names_the_bad_one() {
        let data: Vec<u8> = (0..=255).cycle().take(10_000).collect();
        let addr = data.as_ptr() as u64;
        for method in [ReadMethod::VmReadv, ReadMethod::Pread] {
            let mut m = own(method);
            // More parts than one process_vm_readv batch, of mixed sizes (some empty).
            let spans: Vec<(usize, usize)> = (0..200).map(|i| ((i * 37) % 9000, i % 9)).collect();
            let mut bufs: Vec<Vec<u8>> = spans.iter().map(|&(_, l)| vec![0; l]).collect();
            let mut parts: Vec<(u64, &mut [u8])> = spans
                .iter()
                .zip(bufs.iter_mut())
                .map(|(&(o, _), b)| (addr + o as u64, b.as_mut_slice()))
                .collect();
            m.read_many(&mut parts).expect("all mapped");
            for (&(o, l), b) in spans.iter().zip(&bufs) {
                assert_eq!(b.as_slice(), &data[o..o + l], "{method:?} +{o}");
            }
            // A part in the middle crosses past the stack's end: the parts before it are read,
            // and the error names that part as `read` would.
            let end = stack_end();
            let (mut a, mut b, mut c) = (vec![0; 8], vec![0; 32], vec![0; 8]);
            let (mut a2, mut b2) = (vec![0; 8], vec![0; 8]);
            own(ReadMethod::Pread)
                .read_many(&mut [(end - 64, &mut a2), (end - 8, &mut b2)])
                .expect("mapped");
            let bad = end - 8;
            let mut parts: Vec<(u64, &mut [u8])> =
                vec![(end - 64, &mut a), (bad, &mut b), (end - 32, &mut c)];
            let e = m
                .read_many(&mut parts)
                .expect_err("the second part is not mapped");
            assert_eq!(
                shape(&e),
                ("read".into(), bad, 32, Some(libc::EIO)),
                "{method:?}: {e}"
            );
            assert_eq!(
                (&a, &b[..8]),
                (&a2, &b2[..]),
                "{method:?}: the bytes before the hole"
            );
        }
    }

    #[test]
    fn guestmem_a_fake_proc_tree_reads_with_pread() {
        let dir = tempfile::tempdir().expect("tmp");
        let pid = dir.path().join("42");
        std::fs::create_dir(&pid).expect("dir");
        std::fs::write(pid.join("mem"), b"0123456789").expect("mem");
        let mut m = ProcMemory::open(&ProcFs::new(dir.path()), 42).expect("open");
        assert_eq!(m.method(), ReadMethod::Pread);
        let mut buf = [0; 4];
        m.read(3, &mut buf).expect("in the file");
        assert_eq!(&buf, b"3456");
        let e = m.read(8, &mut buf).expect_err("past the end");
        assert!(matches!(e, MemError::Unmapped { addr: 8, len: 4 }), "{e}");
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
