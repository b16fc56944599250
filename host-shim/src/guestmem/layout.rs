//! The recorder header's byte layout (layout version 1) and its checked parse.
//!
//! Every field is little-endian at a fixed offset, as `docs/memory-layout.md` ("Header") and
//! core's `HeaderLayout::FIELDS` give them. The parse takes 128 untrusted bytes and either
//! returns a [`Header`] whose numbers are all in range and whose whole storage span fits in a
//! `u64`, or says which rule the bytes broke. It cannot panic: every read is a fixed-offset
//! copy out of a fixed-size array.

use thiserror::Error;
use vmtsync_core::recorder::{
    BUSY, HeaderLayout, MAX_CAPACITY, MAX_PAYLOAD, MAX_VCPUS, MIN_CAPACITY, RING_HEADER_SIZE,
    SLOT_SIZE, holds,
};

pub use vmtsync_core::recorder::{
    BEACON_ID, ClockKind, HEADER_SIZE, LAYOUT_VERSION, MAGIC, Mode, checksum,
};

/// The header's alignment: the scan looks for it only at multiples of this.
pub const HEADER_ALIGN: u64 = 64;
/// Bytes of a ring before its first slot (the producer's and the consumer's cache lines), as
/// the `u64` offsets the reader computes with.
pub const RING_PREFIX: u64 = RING_HEADER_SIZE as u64;
/// Bytes of one record slot, as a `u64` offset.
pub const RECORD_SIZE: u64 = SLOT_SIZE as u64;
/// [`HEADER_SIZE`] as the header's `u32` field holds it.
#[allow(clippy::cast_possible_truncation)] // 128: the assertion below checks the round trip.
const HEADER_SIZE_U32: u32 = HEADER_SIZE as u32;
/// [`RECORD_SIZE`] as the header's `u32` field holds it.
#[allow(clippy::cast_possible_truncation)] // 32: the assertion below checks the round trip.
const RECORD_SIZE_U32: u32 = SLOT_SIZE as u32;
// The casts above and in the parse keep every value (core's limits are 128, 32, 1024, 2^31).
const _: () = assert!(
    HEADER_SIZE_U32 as usize == HEADER_SIZE
        && RECORD_SIZE_U32 as usize == SLOT_SIZE
        && MAX_VCPUS <= u32::MAX as usize
        && MAX_PAYLOAD <= u8::MAX as usize
);

/// A header that passed every check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The boot nonce (non-zero); another value later means the guest restarted.
    pub nonce: u64,
    /// Number of rings, one per vCPU (1..=[`MAX_VCPUS`]).
    pub vcpus: u32,
    /// Records per ring: a power of two, at most [`MAX_CAPACITY`].
    pub capacity: u64,
    /// The guest's TSC frequency in kHz, 0 if it does not know it.
    pub tsc_khz: u64,
    /// What a full ring does.
    pub mode: Mode,
    /// What the records' `tsc` words hold.
    pub clock: ClockKind,
    /// Bytes from the header's first byte to ring 0.
    pub rings_offset: u64,
    /// Bytes from ring `i` to ring `i + 1`.
    pub ring_stride: u64,
    /// The sync port of the guest's beacons, 0 if it sends none.
    pub beacon_port: u16,
}

/// Why 128 bytes are not a valid header.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderError {
    /// The magic word is not `VMTSRING` (or not published yet).
    #[error("no magic word (found {0:#018x})")]
    Magic(u64),
    /// The checksum over bytes 0..120 does not match.
    #[error("checksum {stored:#010x} does not match the bytes' CRC-32/ISCSI {computed:#010x}")]
    Checksum {
        /// The checksum word in the header.
        stored: u32,
        /// What the bytes hash to.
        computed: u32,
    },
    /// A layout version this reader does not know.
    #[error("layout version {0} (this reader knows version 1)")]
    Version(u32),
    /// The header size is not 128.
    #[error("header size {0} (version 1 says 128)")]
    HeaderSize(u32),
    /// The nonce is zero.
    #[error("boot nonce is zero")]
    ZeroNonce,
    /// The vCPU count is outside 1..=1024.
    #[error("vCPU count {0} outside 1..=1024")]
    Vcpus(u32),
    /// The record size is not 32.
    #[error("record size {0} (version 1 says 32)")]
    RecordSize(u32),
    /// The capacity is not a power of two of at most 2^31.
    #[error("capacity {0} is not a power of two of at most 2^31")]
    Capacity(u64),
    /// The mode word is neither 0 nor 1.
    #[error("mode {0} is neither 0 (stop-when-full) nor 1 (overwrite)")]
    Mode(u32),
    /// The clock word is neither 0 nor 1.
    #[error("clock {0} is neither 0 (raw TSC) nor 1 (other)")]
    Clock(u32),
    /// Ring 0 would overlap the header or sit off a 64-byte boundary.
    #[error("rings offset {0} is below 128 or not a multiple of 64")]
    RingsOffset(u64),
    /// Rings would overlap or sit off a 64-byte boundary.
    #[error("ring stride {stride} is below one ring's {ring} bytes or not a multiple of 64")]
    RingStride {
        /// The stride the header gives.
        stride: u64,
        /// One ring's bytes: 128 + 32 × capacity.
        ring: u64,
    },
    /// The storage would not fit in the address space.
    #[error("storage of {vcpus} rings of stride {stride} does not fit in 64 bits")]
    TooLarge {
        /// vCPU count.
        vcpus: u32,
        /// Ring stride.
        stride: u64,
    },
    /// A reserved byte is not zero.
    #[error("reserved byte at offset {0} is not zero")]
    Reserved(usize),
}

impl Header {
    /// Checks 128 untrusted bytes and returns the header they hold.
    ///
    /// # Errors
    /// The first rule the bytes break, in the order magic, checksum, then the fields.
    pub fn parse(bytes: &[u8; HEADER_SIZE]) -> Result<Self, HeaderError> {
        let h = HeaderLayout::from_bytes(bytes);
        if h.magic != MAGIC {
            return Err(HeaderError::Magic(h.magic));
        }
        let computed = checksum(bytes);
        if h.checksum != computed {
            return Err(HeaderError::Checksum {
                stored: h.checksum,
                computed,
            });
        }
        if h.version != LAYOUT_VERSION {
            return Err(HeaderError::Version(h.version));
        }
        if h.header_size != HEADER_SIZE_U32 {
            return Err(HeaderError::HeaderSize(h.header_size));
        }
        if h.nonce == 0 {
            return Err(HeaderError::ZeroNonce);
        }
        if !(1..=MAX_VCPUS).contains(&(h.vcpus as usize)) {
            return Err(HeaderError::Vcpus(h.vcpus));
        }
        if h.slot_size != RECORD_SIZE_U32 {
            return Err(HeaderError::RecordSize(h.slot_size));
        }
        if !h.capacity.is_power_of_two()
            || !(MIN_CAPACITY as u64..=MAX_CAPACITY as u64).contains(&h.capacity)
        {
            return Err(HeaderError::Capacity(h.capacity));
        }
        let mode = match h.mode {
            0 => Mode::StopWhenFull,
            1 => Mode::Overwrite,
            m => return Err(HeaderError::Mode(m)),
        };
        let clock = match h.clock {
            0 => ClockKind::RawTsc,
            1 => ClockKind::Other,
            c => return Err(HeaderError::Clock(c)),
        };
        // Version 1 fixes both: ring 0 right after the header, rings back to back.
        if h.rings_offset != HEADER_SIZE as u64 {
            return Err(HeaderError::RingsOffset(h.rings_offset));
        }
        // Capacity <= 2^31 keeps this product far below 2^64.
        let ring = RING_PREFIX + RECORD_SIZE * h.capacity;
        if h.ring_stride != ring {
            return Err(HeaderError::RingStride {
                stride: h.ring_stride,
                ring,
            });
        }
        if let Some(i) = h.reserved0.iter().position(|&b| b != 0) {
            return Err(HeaderError::Reserved(74 + i));
        }
        if h.reserved1 != 0 {
            return Err(HeaderError::Reserved(124));
        }
        let header = Self {
            nonce: h.nonce,
            vcpus: h.vcpus,
            capacity: h.capacity,
            tsc_khz: h.tsc_khz,
            mode,
            clock,
            rings_offset: h.rings_offset,
            ring_stride: h.ring_stride,
            beacon_port: h.beacon_port,
        };
        if header.try_span().is_none() {
            return Err(HeaderError::TooLarge {
                vcpus: h.vcpus,
                stride: h.ring_stride,
            });
        }
        Ok(header)
    }

    /// Bytes from the header's first byte to the end of the last ring, if that fits in 64 bits.
    fn try_span(&self) -> Option<u64> {
        let last = self
            .ring_stride
            .checked_mul(u64::from(self.vcpus) - 1)?
            .checked_add(self.rings_offset)?;
        last.checked_add(RING_PREFIX + RECORD_SIZE * self.capacity)
    }

    /// Bytes from the header's first byte to the end of the last ring (checked by the parse).
    #[must_use]
    pub fn span(&self) -> u64 {
        self.try_span().unwrap_or(u64::MAX)
    }

    /// Offset of ring `vcpu` from the header's first byte (`vcpu < vcpus`, so it fits).
    #[must_use]
    pub fn ring_offset(&self, vcpu: u32) -> u64 {
        self.rings_offset
            .saturating_add(self.ring_stride.saturating_mul(u64::from(vcpu)))
    }

    /// The 128 bytes of this header, checksum included, as the core lays them out (for
    /// tests and the fuzzer, which also build headers a guest never would).
    #[must_use]
    pub fn to_bytes(&self) -> [u8; HEADER_SIZE] {
        let mut h = HeaderLayout {
            magic: MAGIC,
            version: LAYOUT_VERSION,
            header_size: HEADER_SIZE_U32,
            nonce: self.nonce,
            vcpus: self.vcpus,
            slot_size: RECORD_SIZE_U32,
            capacity: self.capacity,
            tsc_khz: self.tsc_khz,
            mode: self.mode as u32,
            clock: self.clock as u32,
            rings_offset: self.rings_offset,
            ring_stride: self.ring_stride,
            beacon_port: self.beacon_port,
            reserved0: [0; 46],
            checksum: 0,
            reserved1: 0,
        };
        h.checksum = checksum(&h.to_bytes());
        h.to_bytes()
    }
}

/// A slot's `meta` word, decoded if it says "record `index`, complete" (core's
/// [`vmtsync_core::recorder::committed`] is the encoder of the same word).
///
/// Complete means: the stamp is `(index + 1) mod 2^39`, `BUSY` is clear and the length is at
/// most 16. Returns `(id, len)`.
#[must_use]
pub fn decode_committed(meta: u64, index: u64) -> Option<(u16, u8)> {
    if !holds(meta, index) {
        return None;
    }
    let len = u8::try_from((meta >> 16) & 0xFF).unwrap_or(u8::MAX);
    if usize::from(len) > MAX_PAYLOAD {
        return None;
    }
    Some((u16::try_from(meta & 0xFFFF).unwrap_or(u16::MAX), len))
}

/// The `meta` word of record `index` while its producer writes it (for tests that tear
/// records).
#[must_use]
pub fn meta_busy(index: u64) -> u64 {
    vmtsync_core::recorder::committed(index, 0, 0) | BUSY
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes at the contract's offsets, read back by hand, and the checksum computed by
    /// the crc crate directly over the published bytes.
    #[test]
    fn header_bytes_sit_at_the_contracts_offsets() {
        let h = Header {
            nonce: 0x0102_0304_0506_0708,
            vcpus: 3,
            capacity: 1 << 12,
            tsc_khz: 2_000_000,
            mode: Mode::Overwrite,
            clock: ClockKind::Other,
            rings_offset: 128,
            ring_stride: 128 + 32 * 4096,
            beacon_port: 0x510,
        };
        let b = h.to_bytes();
        assert_eq!(&b[0..8], b"VMTSRING");
        assert_eq!(b[8..16], [1, 0, 0, 0, 128, 0, 0, 0]);
        assert_eq!(b[16..24], [8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(b[24..32], [3, 0, 0, 0, 32, 0, 0, 0]);
        assert_eq!(b[32..40], [0, 0x10, 0, 0, 0, 0, 0, 0]);
        assert_eq!(b[40..48], 2_000_000u64.to_le_bytes());
        assert_eq!(b[48..56], [1, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(b[56..64], 128u64.to_le_bytes());
        assert_eq!(b[64..72], (128u64 + 32 * 4096).to_le_bytes());
        assert_eq!(b[72..74], [0x10, 0x05]);
        assert!(b[74..120].iter().chain(&b[124..]).all(|&x| x == 0));
        let crc = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI).checksum(&b[..120]);
        assert_eq!(b[120..124], crc.to_le_bytes());
        assert_eq!(Header::parse(&b), Ok(h));
        // The guest's own writer (the core) produces the same bytes.
        let info = vmtsync_core::recorder::HeaderInfo {
            nonce: h.nonce,
            tsc_khz: h.tsc_khz,
            clock: vmtsync_core::recorder::ClockKind::Other,
            beacon_port: 0x510,
        };
        let core =
            HeaderLayout::new(&info, 3, 4096, vmtsync_core::recorder::Mode::Overwrite).published();
        assert_eq!(core.to_bytes(), b);
        assert!(core.is_valid());
    }

    #[test]
    fn committed_meta_decodes_only_for_its_own_index() {
        use vmtsync_core::recorder::committed;
        let m = committed(41, 7, 16);
        assert_eq!(decode_committed(m, 41), Some((7, 16)));
        assert_eq!(decode_committed(m, 40), None);
        assert_eq!(decode_committed(m, 41 + (1 << 39)), Some((7, 16)));
        assert_eq!(decode_committed(meta_busy(41), 41), None);
        assert_eq!(decode_committed(committed(41, 7, 17), 41), None);
    }
}
