//! The recorder's storage as bytes: the self-describing header, the ring header words, and
//! publication. `docs/memory-layout.md` is the language-neutral description; the `const`
//! asserts at the bottom pin every offset it names.
//!
//! Storage is one contiguous, 64-byte aligned block of 32-byte [`Slot`]s: the header (four
//! slots' worth, 128 bytes), then per vCPU one ring: its header (128 bytes) and `capacity`
//! record slots. Every word is a little-endian `u64` accessed atomically, so the same bytes
//! serve the Rust types ([`super::Recorder`]), caller-provided memory
//! ([`super::MemRecorder`]) and a reader outside the guest.

use core::sync::atomic::{AtomicU64, Ordering, fence};

use super::Mode;
use super::slot::{SLOT_SIZE, Slot};

/// The header's magic, `b"VMTSRING"` as a little-endian `u64`; zero until published.
pub const MAGIC: u64 = u64::from_le_bytes(*b"VMTSRING");
/// The layout version this code writes.
pub const LAYOUT_VERSION: u32 = 1;
/// The header's size in bytes.
pub const HEADER_SIZE: usize = 128;
/// A ring header's size in bytes (the ring's slots follow it).
pub const RING_HEADER_SIZE: usize = 128;
/// The most rings (vCPUs) a header may describe.
pub const MAX_VCPUS: usize = 1024;
/// The largest ring capacity in records.
pub const MAX_CAPACITY: usize = 1 << 31;
/// The smallest ring capacity in records a recorder with a header has (two slots make a
/// 64-byte line, so every ring starts on a cache line and the stride is `128 + 32 * cap`).
pub const MIN_CAPACITY: usize = 2;
/// The event id of a sync beacon record ([`super::RingRef::beacon`]).
pub const BEACON_ID: u16 = 0xFFFF;
/// A named phase began: payload = its name, 1..=16 bytes ([`super::span`]).
pub const SPAN_BEGIN_ID: u16 = 0xFF01;
/// A named phase ended: payload = the name its begin gave.
pub const SPAN_END_ID: u16 = 0xFF02;
/// A function was entered: payload = its address then the call site, 4 bytes each (32-bit
/// code) or 8 bytes each (64-bit code), little-endian.
pub const FUNC_ENTRY_ID: u16 = 0xFF03;
/// A function returned: payload as [`FUNC_ENTRY_ID`]'s.
pub const FUNC_EXIT_ID: u16 = 0xFF04;
/// Code moved: payload = link start (6 bytes), runtime start (6 bytes), length (4 bytes).
pub const RELOC_ID: u16 = 0xFF05;
/// The lowest event id reserved for vmtsync itself (`RESERVED_ID_MIN..=0xFFFF`).
pub const RESERVED_ID_MIN: u16 = 0xFF00;

/// The header's u32 fields' values of the sizes above (asserted equal below).
const HEADER_SIZE32: u32 = 128;
const SLOT_SIZE32: u32 = 32;
const MAX_VCPUS32: u32 = 1024;

/// Which clock the records' `tsc` field holds (header offset 52).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[repr(u32)]
pub enum ClockKind {
    /// The vCPU's raw TSC: KVM's per-vCPU host↔guest mapping applies exactly.
    RawTsc = 0,
    /// Some other guest clock (for example a software-skewed TSC): the host needs beacons to
    /// place it.
    Other = 1,
}

/// What the guest knows only at run time, for [`super::Recorder::publish`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct HeaderInfo {
    /// This boot's nonce (non-zero; [`crate::arch::nonce_from`] makes one). A reader that
    /// sees it change knows the guest restarted its recording.
    pub nonce: u64,
    /// The guest TSC frequency in kHz, 0 if unknown.
    pub tsc_khz: u64,
    /// Which clock the records hold.
    pub clock: ClockKind,
    /// The sync port the guest's beacons use, 0 for no beacons.
    pub beacon_port: u16,
}

/// The header's fields as plain integers, in byte order (`repr(C)`, no padding): what
/// [`HeaderLayout::to_bytes`] writes and [`HeaderLayout::from_bytes`] reads. The guest never
/// keeps one in its storage; it is the value publication turns into bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct HeaderLayout {
    /// [`MAGIC`] once published.
    pub magic: u64,
    /// [`LAYOUT_VERSION`].
    pub version: u32,
    /// [`HEADER_SIZE`].
    pub header_size: u32,
    /// The boot nonce, non-zero.
    pub nonce: u64,
    /// Number of rings, 1..=[`MAX_VCPUS`].
    pub vcpus: u32,
    /// [`SLOT_SIZE`].
    pub slot_size: u32,
    /// Records per ring, a power of two in [`MIN_CAPACITY`]..=[`MAX_CAPACITY`].
    pub capacity: u64,
    /// Guest TSC kHz, 0 = unknown.
    pub tsc_khz: u64,
    /// [`Mode`] as 0 or 1.
    pub mode: u32,
    /// [`ClockKind`] as 0 or 1.
    pub clock: u32,
    /// Bytes from the header's first byte to ring 0.
    pub rings_offset: u64,
    /// Bytes from ring `i` to ring `i + 1`.
    pub ring_stride: u64,
    /// The beacon port, 0 = no beacons.
    pub beacon_port: u16,
    /// Zero.
    pub reserved0: [u8; 46],
    /// CRC-32/ISCSI of bytes 0..120, with the magic as published.
    pub checksum: u32,
    /// Zero.
    pub reserved1: u32,
}

/// One field of a header: its name in [`HeaderLayout`] (or [`RingLayout`]), its byte offset
/// and its size. [`HeaderLayout::FIELDS`] and [`RingLayout::FIELDS`] list them all; they are
/// the tables the C header (`capi/include/vmtsync.h`) and `docs/memory-layout.md` are checked
/// against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeaderField {
    /// The field's name in its struct (and in C's `struct vmtsync_header`).
    pub name: &'static str,
    /// Bytes from the header's first byte.
    pub offset: usize,
    /// The field's size in bytes.
    pub size: usize,
}

/// The size of the field `_f` picks out of an `S`.
const fn field_size<S, F>(_f: fn(&S) -> &F) -> usize {
    core::mem::size_of::<F>()
}

/// [`HeaderField`]s of the named fields of struct `$s`, from the struct itself.
macro_rules! header_fields {
    ($s:ident: $($f:ident),* $(,)?) => {
        [$(HeaderField {
            name: stringify!($f),
            offset: core::mem::offset_of!($s, $f),
            size: field_size(|h: &$s| &h.$f),
        }),*]
    };
}

/// Whether `fields` tile `size` bytes in order, with no gap and no overlap.
const fn tiles(fields: &[HeaderField], size: usize) -> bool {
    let mut end = 0;
    let mut i = 0;
    while i < fields.len() {
        if fields[i].offset != end {
            return false;
        }
        end += fields[i].size;
        i += 1;
    }
    end == size
}

impl HeaderLayout {
    /// Every field in byte order (a `const` assertion below checks that they tile the 128
    /// bytes with no gap).
    pub const FIELDS: [HeaderField; 16] = header_fields!(
        HeaderLayout: magic,
        version,
        header_size,
        nonce,
        vcpus,
        slot_size,
        capacity,
        tsc_khz,
        mode,
        clock,
        rings_offset,
        ring_stride,
        beacon_port,
        reserved0,
        checksum,
        reserved1,
    );

    /// The header a recorder with `vcpus` rings of `capacity` records publishes, with its
    /// checksum, but with the magic left zero: publication stores [`MAGIC`] itself, last. So
    /// no value the guest handles (this one, on its stack) is ever a whole valid header: a
    /// reader scanning guest memory would otherwise find a second copy and refuse both.
    #[must_use]
    pub fn new(info: &HeaderInfo, vcpus: usize, capacity: usize, mode: Mode) -> Self {
        let mut h = Self {
            magic: 0,
            version: LAYOUT_VERSION,
            header_size: HEADER_SIZE32,
            nonce: info.nonce,
            // Both are checked against their limits (1024, 2^31) where storage is built.
            #[allow(clippy::cast_possible_truncation)]
            vcpus: vcpus as u32,
            slot_size: SLOT_SIZE32,
            capacity: capacity as u64,
            tsc_khz: info.tsc_khz,
            mode: mode as u32,
            clock: info.clock as u32,
            rings_offset: HEADER_SIZE as u64,
            ring_stride: ring_stride(capacity) as u64,
            beacon_port: info.beacon_port,
            reserved0: [0; 46],
            checksum: 0,
            reserved1: 0,
        };
        h.checksum = published_checksum(&h.to_bytes());
        h
    }

    /// This header as published: the same fields with the magic set (for readers and tests;
    /// guest code has no need to hold one).
    #[must_use]
    pub const fn published(mut self) -> Self {
        self.magic = MAGIC;
        self
    }

    /// The header's 128 bytes, little-endian.
    #[must_use]
    pub fn to_bytes(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        put(&mut b, 0, &self.magic.to_le_bytes());
        put(&mut b, 8, &self.version.to_le_bytes());
        put(&mut b, 12, &self.header_size.to_le_bytes());
        put(&mut b, 16, &self.nonce.to_le_bytes());
        put(&mut b, 24, &self.vcpus.to_le_bytes());
        put(&mut b, 28, &self.slot_size.to_le_bytes());
        put(&mut b, 32, &self.capacity.to_le_bytes());
        put(&mut b, 40, &self.tsc_khz.to_le_bytes());
        put(&mut b, 48, &self.mode.to_le_bytes());
        put(&mut b, 52, &self.clock.to_le_bytes());
        put(&mut b, 56, &self.rings_offset.to_le_bytes());
        put(&mut b, 64, &self.ring_stride.to_le_bytes());
        put(&mut b, 72, &self.beacon_port.to_le_bytes());
        put(&mut b, 74, &self.reserved0);
        put(&mut b, 120, &self.checksum.to_le_bytes());
        put(&mut b, 124, &self.reserved1.to_le_bytes());
        b
    }

    /// The fields of 128 header bytes, unchecked (see [`HeaderLayout::is_valid`]).
    #[must_use]
    pub fn from_bytes(b: &[u8; HEADER_SIZE]) -> Self {
        let mut reserved0 = [0u8; 46];
        reserved0.copy_from_slice(&b[74..120]);
        Self {
            magic: u64::from_le_bytes(take(b, 0)),
            version: u32::from_le_bytes(take(b, 8)),
            header_size: u32::from_le_bytes(take(b, 12)),
            nonce: u64::from_le_bytes(take(b, 16)),
            vcpus: u32::from_le_bytes(take(b, 24)),
            slot_size: u32::from_le_bytes(take(b, 28)),
            capacity: u64::from_le_bytes(take(b, 32)),
            tsc_khz: u64::from_le_bytes(take(b, 40)),
            mode: u32::from_le_bytes(take(b, 48)),
            clock: u32::from_le_bytes(take(b, 52)),
            rings_offset: u64::from_le_bytes(take(b, 56)),
            ring_stride: u64::from_le_bytes(take(b, 64)),
            beacon_port: u16::from_le_bytes(take(b, 72)),
            reserved0,
            checksum: u32::from_le_bytes(take(b, 120)),
            reserved1: u32::from_le_bytes(take(b, 124)),
        }
    }

    /// Whether this is a version-1 header this code would have written: magic, version,
    /// sizes, limits, the v1 offsets and the checksum all agree.
    #[must_use]
    pub fn is_valid(&self) -> bool {
        let cap_ok = self.capacity.is_power_of_two()
            && (MIN_CAPACITY as u64..=MAX_CAPACITY as u64).contains(&self.capacity);
        self.magic == MAGIC
            && self.version == LAYOUT_VERSION
            && self.header_size == HEADER_SIZE32
            && self.nonce != 0
            && (1..=MAX_VCPUS32).contains(&self.vcpus)
            && self.slot_size == SLOT_SIZE32
            && cap_ok
            && self.mode <= 1
            && self.clock <= 1
            && self.rings_offset == HEADER_SIZE as u64
            && self.ring_stride == RING_HEADER_SIZE as u64 + SLOT_SIZE as u64 * self.capacity
            && self.checksum == checksum(&self.to_bytes())
    }
}

/// CRC-32/ISCSI of the first 120 header bytes (everything before the checksum).
#[must_use]
pub fn checksum(header: &[u8; HEADER_SIZE]) -> u32 {
    const CRC: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
    CRC.checksum(&header[..120])
}

/// The checksum of a published header whose other fields are `body`'s (its magic bytes are
/// ignored): [`MAGIC`] is fed to the CRC on its own, so that the whole valid header never sits
/// in one buffer in guest memory.
fn published_checksum(body: &[u8; HEADER_SIZE]) -> u32 {
    const CRC: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
    let mut d = CRC.digest();
    d.update(&MAGIC.to_le_bytes());
    d.update(&body[8..120]);
    d.finalize()
}

/// Bytes from one ring to the next: its header and its slots.
#[must_use]
pub const fn ring_stride(capacity: usize) -> usize {
    RING_HEADER_SIZE + SLOT_SIZE * capacity
}

/// Whether `vcpus` rings of `capacity` records are a layout a header can describe.
#[must_use]
pub const fn valid_shape(vcpus: usize, capacity: usize) -> bool {
    vcpus >= 1
        && vcpus <= MAX_VCPUS
        && capacity.is_power_of_two()
        && capacity >= MIN_CAPACITY
        && capacity <= MAX_CAPACITY
}

fn put(b: &mut [u8; HEADER_SIZE], at: usize, v: &[u8]) {
    if let Some(dst) = b.get_mut(at..at + v.len()) {
        dst.copy_from_slice(v);
    }
}

fn take<const N: usize>(b: &[u8; HEADER_SIZE], at: usize) -> [u8; N] {
    let mut v = [0u8; N];
    if let Some(src) = b.get(at..at + N) {
        v.copy_from_slice(src);
    }
    v
}

/// The storage of a header: 128 bytes as sixteen atomic words, all zero until published.
pub(super) type HeaderWords = [Slot; HEADER_SIZE / SLOT_SIZE];

/// An all-zero header, for a `static`.
pub(super) const fn empty_header() -> HeaderWords {
    [const { Slot::new() }; HEADER_SIZE / SLOT_SIZE]
}

/// Word `i` (0..16) of a 128-byte block of four slots.
pub(super) fn word(block: &[Slot; 4], i: usize) -> &AtomicU64 {
    let slot = block.get(i / 4).unwrap_or(&block[0]);
    slot.word(i % 4)
}

/// Writes `h` into `words`: magic zero first (a reader that catches the rest half-written
/// sees no header), then every other word, then the magic with a release store, so a reader
/// that loads the magic with acquire (or, outside the guest, checks the checksum) sees a
/// whole header.
pub(super) fn publish(words: &HeaderWords, h: &HeaderLayout) {
    let bytes = h.to_bytes();
    word(words, 0).store(0, Ordering::Relaxed);
    // Orders the magic's clearing before the new field values.
    fence(Ordering::Release);
    for i in 1..HEADER_SIZE / 8 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
        word(words, i).store(u64::from_le_bytes(w), Ordering::Relaxed);
    }
    word(words, 0).store(MAGIC, Ordering::Release);
}

/// Copies `slots`' words little-endian into `out` from `*at` on, as far as `out` goes, and
/// advances `*at` by the bytes copied.
pub(super) fn copy_slots(slots: &[Slot], out: &mut [u8], at: &mut usize) {
    for s in slots {
        for i in 0..4 {
            let Some(dst) = out.get_mut(*at..*at + 8) else {
                return;
            };
            dst.copy_from_slice(&s.word(i).load(Ordering::Acquire).to_le_bytes());
            *at += 8;
        }
    }
}

/// Clears the magic, so a reader sees no header until the next [`publish`].
pub(super) fn unpublish(words: &HeaderWords) {
    word(words, 0).store(0, Ordering::Release);
}

/// The published beacon port: `None` before publication or when the header names none.
pub(super) fn beacon_port(words: &HeaderWords) -> Option<u16> {
    // Acquire: the magic is stored last, so the port read after it is the published one.
    if word(words, 0).load(Ordering::Acquire) != MAGIC {
        return None;
    }
    let port = word(words, W_BEACON_PORT).load(Ordering::Relaxed) & 0xffff;
    // Masked to 16 bits just above.
    #[allow(clippy::cast_possible_truncation)]
    let port = port as u16;
    (port != 0).then_some(port)
}

/// Reads a header back from its words (for the guest's own checks and tests).
pub(super) fn read(words: &HeaderWords) -> HeaderLayout {
    let mut b = [0u8; HEADER_SIZE];
    for (i, chunk) in b.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(words, i).load(Ordering::Acquire).to_le_bytes());
    }
    HeaderLayout::from_bytes(&b)
}

/// A ring header's fields in byte order (`repr(C)`): the offsets the ring code's word
/// indices come from. Words 0–3 are the producer's cache line, 8–9 the consumer's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct RingLayout {
    /// Records stored (free-running): the next record's index. Producer.
    pub head: u64,
    /// Events refused because the ring was full. Producer.
    pub refused: u64,
    /// [`Mode`] as 0 or 1.
    pub mode: u8,
    /// 1 while a producer handle is out.
    pub claimed: u8,
    /// Zero.
    pub reserved0: [u8; 6],
    /// Beacons emitted (free-running): the next beacon's sequence number. Producer.
    pub beacons: u64,
    /// Zero (the rest of the producer's line).
    pub reserved1: [u8; 32],
    /// Records the in-guest consumer released (0 forever without one).
    pub tail: u64,
    /// Records the in-guest consumer found overwritten.
    pub overwritten: u64,
    /// Zero (the rest of the consumer's line).
    pub reserved2: [u8; 48],
}

impl RingLayout {
    /// Every field in byte order (a `const` assertion below checks that they tile the 128
    /// bytes with no gap).
    pub const FIELDS: [HeaderField; 10] = header_fields!(
        RingLayout: head,
        refused,
        mode,
        claimed,
        reserved0,
        beacons,
        reserved1,
        tail,
        overwritten,
        reserved2,
    );
}

/// The header word holding the beacon port (in its low 16 bits).
const W_BEACON_PORT: usize = core::mem::offset_of!(HeaderLayout, beacon_port) / 8;

/// Word indices of a ring header.
pub(super) const W_HEAD: usize = core::mem::offset_of!(RingLayout, head) / 8;
pub(super) const W_REFUSED: usize = core::mem::offset_of!(RingLayout, refused) / 8;
pub(super) const W_MODE: usize = core::mem::offset_of!(RingLayout, mode) / 8;
pub(super) const W_BEACONS: usize = core::mem::offset_of!(RingLayout, beacons) / 8;
pub(super) const W_TAIL: usize = core::mem::offset_of!(RingLayout, tail) / 8;
pub(super) const W_OVERWRITTEN: usize = core::mem::offset_of!(RingLayout, overwritten) / 8;
/// The claimed flag's bit in the mode word (byte 17 of the ring header).
pub(super) const CLAIMED_BIT: u64 = 1 << (8 * (core::mem::offset_of!(RingLayout, claimed) % 8));

// The byte layout docs/memory-layout.md describes; a change here is a new layout version.
const _: () = {
    use core::mem::{offset_of, size_of};
    assert!(size_of::<HeaderLayout>() == HEADER_SIZE);
    assert!(offset_of!(HeaderLayout, magic) == 0);
    assert!(offset_of!(HeaderLayout, version) == 8);
    assert!(offset_of!(HeaderLayout, header_size) == 12);
    assert!(offset_of!(HeaderLayout, nonce) == 16);
    assert!(offset_of!(HeaderLayout, vcpus) == 24);
    assert!(offset_of!(HeaderLayout, slot_size) == 28);
    assert!(offset_of!(HeaderLayout, capacity) == 32);
    assert!(offset_of!(HeaderLayout, tsc_khz) == 40);
    assert!(offset_of!(HeaderLayout, mode) == 48);
    assert!(offset_of!(HeaderLayout, clock) == 52);
    assert!(offset_of!(HeaderLayout, rings_offset) == 56);
    assert!(offset_of!(HeaderLayout, ring_stride) == 64);
    assert!(offset_of!(HeaderLayout, beacon_port) == 72);
    assert!(offset_of!(HeaderLayout, reserved0) == 74);
    assert!(offset_of!(HeaderLayout, checksum) == 120);
    assert!(offset_of!(HeaderLayout, reserved1) == 124);
    assert!(size_of::<HeaderWords>() == HEADER_SIZE);
    // FIELDS names every byte once, in order: no field is left out of either table.
    assert!(tiles(&HeaderLayout::FIELDS, HEADER_SIZE));
    assert!(tiles(&RingLayout::FIELDS, RING_HEADER_SIZE));
    assert!(HEADER_SIZE32 as usize == HEADER_SIZE);
    assert!(SLOT_SIZE32 as usize == SLOT_SIZE);
    assert!(MAX_VCPUS32 as usize == MAX_VCPUS);
    assert!(offset_of!(HeaderLayout, beacon_port) % 8 == 0);

    assert!(size_of::<RingLayout>() == RING_HEADER_SIZE);
    assert!(offset_of!(RingLayout, head) == 0);
    assert!(offset_of!(RingLayout, refused) == 8);
    assert!(offset_of!(RingLayout, mode) == 16);
    assert!(offset_of!(RingLayout, claimed) == 17);
    assert!(offset_of!(RingLayout, beacons) == 24);
    assert!(offset_of!(RingLayout, tail) == 64);
    assert!(offset_of!(RingLayout, overwritten) == 72);
    assert!(W_MODE == 2 && CLAIMED_BIT == 1 << 8);
};

#[cfg(test)]
mod tests {
    use std::string::String;
    use std::vec::Vec;

    use super::{HEADER_SIZE, HeaderField, HeaderLayout, RingLayout};

    fn page() -> String {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/memory-layout.md");
        std::fs::read_to_string(path).expect("docs/memory-layout.md")
    }

    /// `(offset, size, text)` of each row of the table under `heading` of a memory-layout
    /// page: the rows between that heading and the next, whose first cell is a number.
    fn doc_rows(page: &str, heading: &str) -> Vec<(usize, usize, String)> {
        let section = page
            .split(heading)
            .nth(1)
            .and_then(|s| s.split("\n## ").next())
            .unwrap_or_else(|| panic!("docs/memory-layout.md has no {heading:?} section"));
        section
            .lines()
            .filter_map(|line| {
                let cells: Vec<&str> = line.trim().trim_matches('|').split('|').collect();
                let [offset, ty, field, ..] = cells.as_slice() else {
                    return None;
                };
                let offset = offset.trim().parse().ok()?;
                let ty = ty.trim();
                let size = match ty {
                    "u8" => 1,
                    "u16" => 2,
                    "u32" => 4,
                    "u64" => 8,
                    _ => ty
                        .strip_suffix(" bytes")
                        .and_then(|n| n.parse().ok())
                        .unwrap_or_else(|| panic!("unknown type {ty:?} in {line:?}")),
                };
                Some((offset, size, String::from(field.trim())))
            })
            .collect()
    }

    /// docs/memory-layout.md's header table says what [`HeaderLayout::FIELDS`] says: the same
    /// fields at the same offsets with the same sizes, in order.
    #[test]
    fn the_docs_header_table_is_the_code_s() {
        let rows = doc_rows(&page(), "\n## Header");
        let want: Vec<(usize, usize)> = HeaderLayout::FIELDS
            .iter()
            .map(|f: &HeaderField| (f.offset, f.size))
            .collect();
        let got: Vec<(usize, usize)> = rows.iter().map(|&(o, s, _)| (o, s)).collect();
        assert_eq!(
            got, want,
            "docs/memory-layout.md's header table (offset, size) rows"
        );
        // Each row names its field: the reserved rows say so, the others start with the
        // field's words (`ring_stride` is "ring stride: …").
        for ((_, _, text), f) in rows.iter().zip(HeaderLayout::FIELDS) {
            let text = text.to_lowercase();
            let words = f
                .name
                .trim_end_matches(|c: char| c.is_ascii_digit())
                .replace('_', " ");
            let named = match words.as_str() {
                "header size" | "rings offset" | "ring stride" | "beacon port" | "checksum"
                | "magic" | "capacity" | "mode" | "clock" | "reserved" => text.starts_with(&words),
                "version" => text.starts_with("layout version"),
                "nonce" => text.starts_with("boot nonce"),
                "vcpus" => text.starts_with("vcpu count"),
                "slot size" => text.starts_with("slot size"),
                "tsc khz" => text.starts_with("guest tsc frequency in khz"),
                other => panic!("no wording known for header field {other:?}"),
            };
            assert!(
                named,
                "row at offset {} ({text:?}) is not field {}",
                f.offset, f.name
            );
        }
        assert_eq!(rows.iter().map(|r| r.1).sum::<usize>(), HEADER_SIZE);
    }

    /// The same for the ring header's table and [`RingLayout::FIELDS`] (offsets and sizes).
    #[test]
    fn the_docs_ring_header_table_is_the_code_s() {
        let got: Vec<(usize, usize)> = doc_rows(&page(), "\n## Ring header")
            .iter()
            .map(|&(o, s, _)| (o, s))
            .collect();
        let want: Vec<(usize, usize)> = RingLayout::FIELDS
            .iter()
            .map(|f| (f.offset, f.size))
            .collect();
        assert_eq!(
            got, want,
            "docs/memory-layout.md's ring header (offset, size) rows"
        );
    }
}
