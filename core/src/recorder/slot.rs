//! One ring slot: its `repr(C)` layout, its commit stamp, and the checked read.
//!
//! The layout is meant to be read by code that only reads (the consumer on another vCPU, and
//! later a host reading guest memory), so every field is a little-endian 64-bit word at a
//! fixed offset, and each slot says by itself which record it holds and whether it is whole:
//!
//! | offset | word | contents |
//! |---|---|---|
//! | 0 | `meta` | bits 0–15 event id, 16–23 payload length (0–16), bit 24 `BUSY`, bits 25–63 the commit stamp: (record index + 1) mod 2^39 |
//! | 8 | `tsc` | the guest TSC read while recording |
//! | 16 | `lo` | payload bytes 0–7 (little-endian; unused bytes zero) |
//! | 24 | `hi` | payload bytes 8–15 |
//!
//! A record's index is its position in its ring's sequence (0 for the first record the ring
//! stored), so record `n` lives in slot `n mod CAP`. The producer writes a slot as a seqlock
//! writer does: `meta` = stamp of `n` with `BUSY` set, a release fence, the three data words,
//! then `meta` = stamp of `n` with `BUSY` clear plus id and length (a release store). A
//! reader of record `n` loads `meta` (acquire), the data words, an acquire fence and `meta`
//! again: only when both loads show `n`'s stamp with `BUSY` clear did no write of another
//! record touch the data it read (Boehm, "Can seqlocks get along with programming language
//! memory models?", 2012). Stamps of one slot only grow (`n`, `n + CAP`, …), so an
//! overwritten record can never pass for the one the reader wants, except after 2^39 records
//! in one slot read; [`Slot::read`] rules that out too by re-reading the producer's count.

use core::sync::atomic::{AtomicU64, Ordering, fence};

use super::{MAX_PAYLOAD, Record};
use crate::units::GuestTicks;

/// `meta` bit set while the producer writes the slot.
pub const BUSY: u64 = 1 << 24;
/// Where the commit stamp starts in `meta`.
pub const STAMP_SHIFT: u32 = 25;
/// The commit stamp's width in bits.
pub const STAMP_BITS: u32 = 64 - STAMP_SHIFT;
/// The bytes of one slot.
pub const SLOT_SIZE: usize = 32;

/// One record's storage: four words, written by the producer, read by the consumer. It is
/// also the recorder's unit of storage: a header or a ring header is four slots' worth of
/// words, so caller-provided memory is a `[Slot]` ([`super::MemRecorder`]).
#[derive(Debug)]
#[repr(C, align(32))]
pub struct Slot {
    meta: AtomicU64,
    tsc: AtomicU64,
    lo: AtomicU64,
    hi: AtomicU64,
}

// The layout a reader in another language relies on (the table above).
const _: () = {
    assert!(size_of::<Slot>() == SLOT_SIZE);
    assert!(core::mem::offset_of!(Slot, meta) == 0);
    assert!(core::mem::offset_of!(Slot, tsc) == 8);
    assert!(core::mem::offset_of!(Slot, lo) == 16);
    assert!(core::mem::offset_of!(Slot, hi) == 24);
};

/// The commit stamp of record `index`, in place in `meta`.
#[inline]
const fn stamp(index: u64) -> u64 {
    index.wrapping_add(1) << STAMP_SHIFT
}

/// `meta` of record `index` once it is complete.
#[inline]
pub const fn committed(index: u64, id: u16, len: u8) -> u64 {
    stamp(index) | (len as u64) << 16 | id as u64
}

/// Whether `meta` says the slot holds record `index`, complete.
#[inline]
pub const fn holds(meta: u64, index: u64) -> bool {
    meta & !(BUSY - 1) == stamp(index)
}

/// Why a record could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum ReadError {
    /// The record has not been stored yet.
    NotYet,
    /// The record is gone: the producer overwrote it, or was overwriting it during the read
    /// (its slot is never returned half-written).
    Overwritten,
}

impl Slot {
    /// An empty slot (its stamp matches no record).
    pub const fn new() -> Self {
        Self {
            meta: AtomicU64::new(0),
            tsc: AtomicU64::new(0),
            lo: AtomicU64::new(0),
            hi: AtomicU64::new(0),
        }
    }

    /// A slot holding these four words (a ring header's words are slots too).
    pub(super) const fn from_words(w: [u64; 4]) -> Self {
        Self {
            meta: AtomicU64::new(w[0]),
            tsc: AtomicU64::new(w[1]),
            lo: AtomicU64::new(w[2]),
            hi: AtomicU64::new(w[3]),
        }
    }

    /// Word `i` (0..4; larger values give the last word) as storage: how headers, which
    /// are made of slots, reach their fields.
    pub(super) fn word(&self, i: usize) -> &AtomicU64 {
        match i {
            0 => &self.meta,
            1 => &self.tsc,
            2 => &self.lo,
            _ => &self.hi,
        }
    }

    /// Stores record `index`. Producer side only.
    #[inline]
    pub fn write(
        &self,
        index: u64,
        id: u16,
        data: &[u8; MAX_PAYLOAD],
        len: u8,
        tsc: impl FnOnce() -> u64,
    ) {
        let (lo, hi) = words(data);
        self.meta.store(stamp(index) | BUSY, Ordering::Relaxed);
        // Orders the BUSY store before the data stores: a reader that sees any of them sees
        // BUSY (or a later stamp) on its second load of `meta`.
        fence(Ordering::Release);
        // The stamp is the last thing read before the record is published, so it is as close
        // to the caller's event as the ring allows.
        let stamp = tsc();
        self.lo.store(lo, Ordering::Relaxed);
        self.hi.store(hi, Ordering::Relaxed);
        self.tsc.store(stamp, Ordering::Relaxed);
        self.meta
            .store(committed(index, id, len), Ordering::Release);
    }

    /// Reads record `index`, whole or not at all. `count` loads the producer's count of
    /// stored records: a record `CAP` or more below it is gone.
    #[inline]
    pub fn read(&self, index: u64, cap: u64, count: impl Fn() -> u64) -> Result<Record, ReadError> {
        let m1 = self.meta.load(Ordering::Acquire);
        if !holds(m1, index) {
            return Err(ReadError::Overwritten);
        }
        let tsc = self.tsc.load(Ordering::Relaxed);
        let lo = self.lo.load(Ordering::Relaxed);
        let hi = self.hi.load(Ordering::Relaxed);
        // Orders the data loads before the second `meta` load (the seqlock reader's fence).
        fence(Ordering::Acquire);
        let m2 = self.meta.load(Ordering::Acquire);
        // A stamp that matched although the slot was rewritten 2^39 times in between would
        // come with a count at least 2^39 above `index`: the acquire load of `m2` makes the
        // count the producer published before that write visible here.
        if m2 != m1 || count().wrapping_sub(index) > cap {
            return Err(ReadError::Overwritten);
        }
        let mut data = [0u8; MAX_PAYLOAD];
        let (a, b) = data.split_at_mut(8);
        a.copy_from_slice(&lo.to_le_bytes());
        b.copy_from_slice(&hi.to_le_bytes());
        // The low 16 bits are the id, the next 8 the length (clamped: a slot garbled by a
        // broken single-producer contract must not claim more than the payload holds).
        #[allow(clippy::cast_possible_truncation)]
        let (id, len) = (m1 as u16, ((m1 >> 16) as u8).min(MAX_PAYLOAD as u8));
        Ok(Record {
            tsc: GuestTicks(tsc),
            id,
            len,
            data,
        })
    }
}

impl Default for Slot {
    fn default() -> Self {
        Self::new()
    }
}

/// The payload as its two little-endian words.
#[inline]
fn words(data: &[u8; MAX_PAYLOAD]) -> (u64, u64) {
    let mut lo = [0u8; 8];
    let mut hi = [0u8; 8];
    lo.copy_from_slice(&data[..8]);
    hi.copy_from_slice(&data[8..]);
    (u64::from_le_bytes(lo), u64::from_le_bytes(hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_holds_only_the_record_it_was_committed_with() {
        let s = Slot::new();
        let data = [7u8; MAX_PAYLOAD];
        assert_eq!(
            s.read(0, 4, || 1),
            Err(ReadError::Overwritten),
            "never written"
        );
        s.write(5, 9, &data, 3, || 42);
        let r = s.read(5, 4, || 6).unwrap();
        assert_eq!((r.tsc.0, r.id, r.payload()), (42, 9, &data[..3]));
        // Another lap's record, an older one, and a count that says it was overwritten.
        assert_eq!(s.read(1, 4, || 6), Err(ReadError::Overwritten));
        assert_eq!(s.read(9, 4, || 10), Err(ReadError::Overwritten));
        assert_eq!(s.read(5, 4, || 10), Err(ReadError::Overwritten));
        // The stamp wraps at 2^39 records; the count check still tells them apart.
        let far = 5 + (1 << STAMP_BITS);
        assert!(holds(s.meta.load(Ordering::Relaxed), far));
        assert_eq!(s.read(far, 4, || 6), Err(ReadError::Overwritten));
    }

    #[test]
    fn a_read_during_the_write_is_refused() {
        let s = Slot::new();
        let data = [1u8; MAX_PAYLOAD];
        s.write(2, 1, &data, 16, || 10);
        // The producer starts record 6 (same slot, next lap); the reader runs in the middle,
        // between the BUSY store and the data stores, deterministically.
        let mut seen = None;
        s.write(6, 2, &[2u8; MAX_PAYLOAD], 16, || {
            seen = Some((s.read(2, 4, || 6), s.read(6, 4, || 6)));
            20
        });
        assert_eq!(
            seen,
            Some((Err(ReadError::Overwritten), Err(ReadError::Overwritten)))
        );
        assert_eq!(s.read(6, 4, || 7).map(|r| r.tsc.0), Ok(20));
    }
}
