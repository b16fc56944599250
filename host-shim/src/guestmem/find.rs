//! Finding the recorder in the VMM's address space: a scan of its writable mappings, a host
//! virtual address the user names, or a guest-physical address (from `--elf`).

use thiserror::Error;

use super::layout::{HEADER_ALIGN, HEADER_SIZE, Header, HeaderError, MAGIC};
use super::memory::{GuestMemory, MemError, PAGE_SIZE, Region};

/// [`PAGE_SIZE`] as a buffer length.
const PAGE_BYTES: usize = 4096;
/// [`HEADER_ALIGN`] as a chunk length.
const ALIGN_BYTES: usize = 64;
const _: () = assert!(PAGE_BYTES as u64 == PAGE_SIZE && ALIGN_BYTES as u64 == HEADER_ALIGN);
/// Pages the scan looks at per step: 1 MiB, the most it buffers.
const SCAN_PAGES: usize = 256;
/// Valid headers the scan keeps (it counts all of them).
const MAX_KEPT: usize = 8;
/// Rejected magic words the scan remembers for its error message.
const MAX_REJECTED: usize = 4;

/// Where to look for the recorder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// Scan every writable mapping.
    Scan,
    /// The header is at this host virtual address.
    HostAddress(u64),
    /// The header is at this guest-physical address (an ELF symbol's load address): see
    /// [`find`] for the rule that maps it to the host.
    GuestPhysical(u64),
    /// A pointer variable at guest-physical `gpa`, `width` (4 or 8) bytes little-endian,
    /// holds the header's guest-physical address (a recorder the guest allocates at run time;
    /// the value is taken as physical, as in firmware that runs flat or identity-mapped).
    Pointer {
        /// The variable's guest-physical address (its ELF symbol's load address).
        gpa: u64,
        /// Its size: 4 in a 32-bit image, 8 in a 64-bit one.
        width: u8,
    },
}

/// A header found in memory, with its mapping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// The header's host virtual address.
    pub addr: u64,
    /// The header.
    pub header: Header,
    /// The mapping that holds the header and every ring.
    pub region: Region,
}

/// Why the scan passed over a magic word.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
pub enum Rejected {
    /// The header failed a check.
    #[error("{0}")]
    Header(HeaderError),
    /// The header is valid but its rings run past its mapping.
    #[error("declares {span} bytes, past its mapping's end {region_end:#x}")]
    PastMapping {
        /// Bytes the header declares.
        span: u64,
        /// The mapping's end.
        region_end: u64,
    },
}

/// What a scan looked at.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScanStats {
    /// Writable mappings scanned.
    pub regions: u64,
    /// Bytes those mappings span.
    pub bytes_mapped: u64,
    /// Bytes actually read (present pages only, when the page map reads).
    pub bytes_read: u64,
    /// Pages skipped because the page map said they hold nothing.
    pub pages_skipped: u64,
    /// Bytes in runs that would not read (device mappings and the like), skipped.
    pub bytes_unreadable: u64,
    /// Whether the page map answered for every mapping.
    pub pagemap: bool,
    /// Magic words whose header failed a check: the first few, with the reason.
    pub rejected: Vec<(u64, Rejected)>,
    /// Valid headers found (all of them, even beyond those kept).
    pub valid: u64,
    /// Pages of valid recorders (their headers' spans) passed over unread. A recorder's rings
    /// hold its records, whose bytes are not headers: nothing inside a valid header's span is
    /// searched (read or not).
    pub pages_in_recorders: u64,
}

/// Why no single recorder was found.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum FindError {
    /// Reading the process failed.
    #[error(transparent)]
    Mem(#[from] MemError),
    /// The scan found no valid header.
    #[error(
        "no valid recorder header in {regions} writable mappings ({bytes_read} bytes read){}; \
         has the guest published its recorder yet? (or name it with an address or --elf)",
        rejected_note(.rejected)
    )]
    NotFound {
        /// Mappings scanned.
        regions: u64,
        /// Bytes read.
        bytes_read: u64,
        /// The first headers that looked right but failed a check.
        rejected: Vec<(u64, Rejected)>,
    },
    /// More than one valid header.
    #[error(
        "{count} valid recorder headers, at {first:#x} and {second:#x}{}: name one by address",
        if *.count > 2 { " and more" } else { "" }
    )]
    Ambiguous {
        /// The lowest address.
        first: u64,
        /// The next one.
        second: u64,
        /// How many there are.
        count: u64,
    },
    /// The named address is in no mapping (or not 64-byte aligned).
    #[error("{0:#x} is not a 64-byte aligned address inside a mapping of the process")]
    NotMapped(u64),
    /// The bytes at the named address are not a header.
    #[error("no valid recorder header at {addr:#x}: {source}")]
    Invalid {
        /// The address.
        addr: u64,
        /// What failed.
        source: HeaderError,
    },
    /// The header's rings run past the end of its mapping.
    #[error(
        "the recorder at {addr:#x} declares {span} bytes, past its mapping's end {region_end:#x}"
    )]
    RingsOutside {
        /// The header's address.
        addr: u64,
        /// The bytes the header declares.
        span: u64,
        /// The mapping's end.
        region_end: u64,
    },
    /// No mapping holds a valid header at the guest-physical address's host counterpart.
    #[error(
        "no writable mapping holds a valid recorder header at guest-physical {gpa:#x} \
         ({tried} mappings tried); is the guest running and has it published its recorder?"
    )]
    NoRamMapping {
        /// The guest-physical address.
        gpa: u64,
        /// Mappings large enough to hold it.
        tried: u64,
    },
    /// The pointer variable is null, or points at no valid header, in every mapping that
    /// could hold it.
    #[error(
        "the pointer at guest-physical {gpa:#x} names no valid recorder header ({tried} \
         mappings tried; the last value read: {last:#x}); has the guest set it and published?"
    )]
    NoPointerTarget {
        /// The variable's guest-physical address.
        gpa: u64,
        /// Mappings large enough to hold it.
        tried: u64,
        /// The last value read from it.
        last: u64,
    },
}

impl FindError {
    /// Whether the recorder may simply not be published yet (nothing valid where it should
    /// be), so that waiting can help; read errors and a location outside every mapping
    /// cannot get better.
    #[must_use]
    pub fn not_yet(&self) -> bool {
        match self {
            Self::NotFound { .. } | Self::Invalid { .. } => true,
            Self::NoRamMapping { tried, .. } | Self::NoPointerTarget { tried, .. } => *tried > 0,
            _ => false,
        }
    }
}

fn rejected_note(rejected: &[(u64, Rejected)]) -> String {
    rejected
        .first()
        .map(|(a, e)| format!("; rejected {a:#x}: {e}"))
        .unwrap_or_default()
}

/// Reads and checks the header at `addr`, which must sit in `region` with all its rings.
///
/// # Errors
/// [`FindError::Invalid`], [`FindError::RingsOutside`] or a read error.
pub fn check_at(
    mem: &mut impl GuestMemory,
    addr: u64,
    region: &Region,
) -> Result<Found, FindError> {
    if !addr.is_multiple_of(HEADER_ALIGN) || !region.holds(addr, HEADER_SIZE as u64) {
        return Err(FindError::NotMapped(addr));
    }
    let mut bytes = [0u8; HEADER_SIZE];
    mem.read(addr, &mut bytes)?;
    let header = Header::parse(&bytes).map_err(|source| FindError::Invalid { addr, source })?;
    let span = header.span();
    if !region.holds(addr, span) {
        return Err(FindError::RingsOutside {
            addr,
            span,
            region_end: region.end,
        });
    }
    Ok(Found {
        addr,
        header,
        region: region.clone(),
    })
}

/// Finds the one recorder at `loc`.
///
/// - [`Location::Scan`]: every writable mapping, at every 64-byte boundary of every page the
///   page map calls present; exactly one valid header must turn up.
/// - [`Location::HostAddress`]: the header at that address, in whatever mapping holds it.
/// - [`Location::GuestPhysical`]: the rule is that guest RAM from guest-physical 0 is one
///   host mapping, so guest-physical `g` is host `start + g` for that mapping (true of the
///   low RAM block in QEMU, Firecracker, cloud-hypervisor and the built-in VMM, up to the
///   32-bit PCI hole). Which mapping that is the reader does not assume: it tries `start + g`
///   in every writable mapping large enough and takes the one where a valid header sits.
///
/// # Errors
/// [`FindError`]: nothing found, several found, or a bad named location.
pub fn find(mem: &mut impl GuestMemory, loc: Location) -> Result<Found, FindError> {
    let regions = coalesce(mem.regions()?);
    match loc {
        Location::Scan => {
            let (found, stats) = scan(mem, &regions)?;
            match found.as_slice() {
                [] => Err(FindError::NotFound {
                    regions: stats.regions,
                    bytes_read: stats.bytes_read,
                    rejected: stats.rejected,
                }),
                [one] => Ok(one.clone()),
                [a, b, ..] => Err(FindError::Ambiguous {
                    first: a.addr,
                    second: b.addr,
                    count: stats.valid,
                }),
            }
        }
        Location::HostAddress(addr) => {
            let region = regions
                .iter()
                .find(|r| r.holds(addr, 1))
                .ok_or(FindError::NotMapped(addr))?;
            check_at(mem, addr, region)
        }
        Location::GuestPhysical(gpa) => {
            let mut tried = 0;
            let mut hits = Vec::new();
            for (r, addr) in ram_holding(&regions, gpa, HEADER_SIZE as u64) {
                tried += 1;
                if let Ok(f) = check_at(mem, addr, r) {
                    hits.push(f);
                }
            }
            the_one(hits, FindError::NoRamMapping { gpa, tried })
        }
        Location::Pointer { gpa, width } => {
            // The variable and what it points at in the same mapping: guest RAM from 0 is one
            // mapping (the rule above). Its value is untrusted: only a header that validates
            // where it points counts.
            let width = usize::from(width.clamp(1, 8));
            let (mut tried, mut last) = (0, 0);
            let mut hits = Vec::new();
            for (r, at) in ram_holding(&regions, gpa, width as u64) {
                tried += 1;
                let mut b = [0u8; 8];
                mem.read(at, &mut b[..width])?;
                last = u64::from_le_bytes(b);
                let Some(addr) = r.start.checked_add(last).filter(|_| last != 0) else {
                    continue;
                };
                if r.holds(addr, HEADER_SIZE as u64)
                    && let Ok(f) = check_at(mem, addr, r)
                {
                    hits.push(f);
                }
            }
            the_one(hits, FindError::NoPointerTarget { gpa, tried, last })
        }
    }
}

/// Each writable mapping that may be guest RAM from guest-physical 0 (the rule of
/// [`Location::GuestPhysical`]) with `len` bytes at guest-physical `gpa` inside it, and the host
/// address of `gpa` there.
fn ram_holding(regions: &[Region], gpa: u64, len: u64) -> impl Iterator<Item = (&Region, u64)> {
    regions.iter().filter(|r| r.writable).filter_map(move |r| {
        let addr = r.start.checked_add(gpa)?;
        r.holds(addr, len).then_some((r, addr))
    })
}

/// The one header among `hits`: `none` when there is none, [`FindError::Ambiguous`] when
/// there are several.
fn the_one(mut hits: Vec<Found>, none: FindError) -> Result<Found, FindError> {
    match hits.len() {
        0 => Err(none),
        1 => Ok(hits.swap_remove(0)),
        n => Err(FindError::Ambiguous {
            first: hits[0].addr,
            second: hits[1].addr,
            count: n as u64,
        }),
    }
}

/// Joins adjacent writable mappings into one: the kernel splits one allocation into several
/// `maps` lines when their flags differ (a program's `.data` and `.bss`, or a part of guest
/// RAM given another `madvise`), and the recorder may straddle such a split. Read-only
/// mappings are kept as they are (they never hold a live recorder, and are not joined).
#[must_use]
pub fn coalesce(regions: Vec<Region>) -> Vec<Region> {
    let mut out: Vec<Region> = Vec::with_capacity(regions.len());
    for r in regions {
        match out.last_mut() {
            Some(last) if last.writable && r.writable && last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

/// Scans `regions`' writable mappings for valid headers: returns the first few (address
/// order) and what it looked at. A valid recorder's rings are passed over, not read (they hold
/// its records: a magic word there is a record's bytes). Memory use is one 1 MiB buffer and a
/// page map slice.
///
/// # Errors
/// Only errors that are not about one range (a range that will not read is skipped and
/// counted in [`ScanStats::bytes_unreadable`]).
pub fn scan(
    mem: &mut impl GuestMemory,
    regions: &[Region],
) -> Result<(Vec<Found>, ScanStats), FindError> {
    let mut stats = ScanStats {
        pagemap: true,
        ..ScanStats::default()
    };
    let mut found = Vec::new();
    // The end of the last valid recorder's span: nothing before it is searched.
    let mut past = 0;
    let mut buf = vec![0u8; SCAN_PAGES * PAGE_BYTES];
    let mut present = vec![false; SCAN_PAGES];
    for region in regions.iter().filter(|r| r.writable && r.end > r.start) {
        stats.regions += 1;
        stats.bytes_mapped += region.end - region.start;
        // Mappings are page-aligned; a fake's need not be, so round inwards.
        let mut page = region.start.div_ceil(PAGE_SIZE);
        let end_page = region.end / PAGE_SIZE;
        'pages: while page < end_page {
            let n = usize::try_from((end_page - page).min(SCAN_PAGES as u64)).unwrap_or(1);
            let known = mem.resident(page, &mut present[..n])?;
            if !known {
                stats.pagemap = false;
                present[..n].fill(true);
            }
            let mut i = 0;
            while i < n {
                if !present[i] {
                    stats.pages_skipped += 1;
                    i += 1;
                    continue;
                }
                let run_start = i;
                while i < n && present[i] {
                    i += 1;
                }
                let addr = (page + run_start as u64) * PAGE_SIZE;
                let len = (i - run_start) * PAGE_BYTES;
                let chunk = &mut buf[..len];
                if mem.read(addr, chunk).is_err() {
                    stats.bytes_unreadable += len as u64;
                    continue;
                }
                stats.bytes_read += len as u64;
                look_for_headers(
                    mem,
                    region,
                    addr,
                    &buf[..len],
                    &mut found,
                    &mut stats,
                    &mut past,
                )?;
                // Past the rings of a recorder just found (they lie inside the mapping).
                let (next, resume) = (page + i as u64, past.div_ceil(PAGE_SIZE));
                if resume > next {
                    stats.pages_in_recorders += resume.min(end_page) - next;
                    page = resume;
                    continue 'pages;
                }
            }
            page += n as u64;
        }
    }
    Ok((found, stats))
}

/// Checks every 64-byte boundary of `chunk` (read from `addr`) at or after `past` for the
/// magic word, and re-reads and checks the header at each one found; a valid one moves `past`
/// to the end of its span.
fn look_for_headers(
    mem: &mut impl GuestMemory,
    region: &Region,
    addr: u64,
    chunk: &[u8],
    found: &mut Vec<Found>,
    stats: &mut ScanStats,
    past: &mut u64,
) -> Result<(), FindError> {
    let magic = MAGIC.to_le_bytes();
    for (k, line) in chunk.chunks_exact(ALIGN_BYTES).enumerate() {
        let at = addr + k as u64 * HEADER_ALIGN;
        if line[..8] != magic || at < *past {
            continue;
        }
        // The header is read again on its own: it may cross into the next page, and the
        // guest may have changed it since the chunk was read.
        match check_at(mem, at, region) {
            Ok(f) => {
                stats.valid += 1;
                *past = f.addr.saturating_add(f.header.span());
                if found.len() < MAX_KEPT {
                    found.push(f);
                }
            }
            Err(FindError::Invalid { source, .. }) => {
                if stats.rejected.len() < MAX_REJECTED {
                    stats.rejected.push((at, Rejected::Header(source)));
                }
            }
            Err(FindError::RingsOutside {
                span, region_end, ..
            }) => {
                if stats.rejected.len() < MAX_REJECTED {
                    stats
                        .rejected
                        .push((at, Rejected::PastMapping { span, region_end }));
                }
            }
            Err(FindError::Mem(_)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
