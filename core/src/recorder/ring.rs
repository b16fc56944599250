//! One vCPU's ring: the producer's side ([`RingRef::record`], [`Producer`], beacons) and the
//! consumer's (indexed reads, [`RingRef::skip`], [`RingRef::release`]).
//!
//! All ring logic lives in [`RingRef`], a view of a ring header and its slots. [`Ring`] (a
//! `const`-sized ring in a `static`) and [`super::MemRecorder`] (rings in caller-provided
//! memory) are storage that hands out that view, so both have the same code and bytes.

use core::cell::Cell;
use core::marker::PhantomData;
use core::ops::Deref;
use core::sync::atomic::{AtomicU64, Ordering, compiler_fence};

use super::layout::{
    BEACON_ID, CLAIMED_BIT, W_BEACONS, W_HEAD, W_MODE, W_OVERWRITTEN, W_REFUSED, W_TAIL, word,
};
use super::slot::{ReadError, Slot};
use super::{MAX_PAYLOAD, Mode, Record, RecordError};
use crate::arch::{PortIo, Tsc};

/// A ring header's storage: 128 bytes (the producer's 64-byte line, then the consumer's) as
/// four slots' worth of words (`super::layout::RingLayout` names them).
pub(super) type RingHeader = [Slot; 4];

/// A ring header for a ring in `mode`, for a `static`.
pub(super) const fn ring_header(mode: Mode) -> RingHeader {
    [
        // Word 2 holds the mode byte (byte 16 of the ring header).
        Slot::from_words([0, 0, mode as u64, 0]),
        Slot::new(),
        Slot::new(),
        Slot::new(),
    ]
}

/// A single-producer single-consumer ring of `CAP` records (`CAP` a power of two, at most
/// 2^31), stop-when-full ([`Ring::new`]) or overwriting its oldest records
/// ([`Ring::new_flight`]). It is storage only: [`Ring::view`] hands out its one set of
/// methods, [`RingRef`]'s.
///
/// `repr(C)`: the ring header (the producer's words on the first 64-byte line, the
/// consumer's on the second), then the slots (`super::slot` has their layout).
#[derive(Debug)]
#[repr(C, align(64))]
pub struct Ring<const CAP: usize> {
    header: RingHeader,
    slots: [Slot; CAP],
}

impl<const CAP: usize> Default for Ring<CAP> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const CAP: usize> Ring<CAP> {
    /// Checked when a ring is built: indices are masked, and `CAP` fits the slot stamp's
    /// distance checks.
    const VALID: () = assert!(
        CAP.is_power_of_two() && CAP <= 1 << 31,
        "ring capacity must be a power of two, at most 2^31"
    );

    /// An empty stop-when-full ring, usable in a `static`.
    #[must_use]
    pub const fn new() -> Self {
        Self::with_mode(Mode::StopWhenFull)
    }

    /// An empty flight-recorder ring (it overwrites its oldest records), usable in a `static`.
    #[must_use]
    pub const fn new_flight() -> Self {
        Self::with_mode(Mode::Overwrite)
    }

    /// An empty ring in `mode`, usable in a `static`.
    #[must_use]
    pub const fn with_mode(mode: Mode) -> Self {
        let () = Self::VALID;
        Self {
            header: ring_header(mode),
            slots: [const { Slot::new() }; CAP],
        }
    }

    /// The ring as a view: where all of its logic lives.
    #[inline]
    #[must_use]
    pub fn view(&self) -> RingRef<'_> {
        RingRef {
            header: &self.header,
            slots: &self.slots,
        }
    }

    /// The ring's capacity in records.
    #[must_use]
    pub const fn capacity(&self) -> usize {
        CAP
    }
}

impl<'a, const CAP: usize> From<&'a Ring<CAP>> for RingRef<'a> {
    #[inline]
    fn from(ring: &'a Ring<CAP>) -> Self {
        ring.view()
    }
}

/// A view of one ring: its header words and its slots, wherever they are stored (a [`Ring`]
/// or caller-provided memory). The slot count is a power of two (every constructor checks
/// it). Copying the view does not copy the ring.
#[derive(Clone, Copy, Debug)]
pub struct RingRef<'a> {
    header: &'a RingHeader,
    slots: &'a [Slot],
}

impl<'a> RingRef<'a> {
    /// A view of a ring header and its slots. `slots.len()` must be a power of two (checked
    /// by the callers, which own the storage).
    pub(super) const fn new(header: &'a RingHeader, slots: &'a [Slot]) -> Self {
        Self { header, slots }
    }

    /// The ring header and the slots.
    pub(super) const fn parts(&self) -> (&'a RingHeader, &'a [Slot]) {
        (self.header, self.slots)
    }

    #[inline]
    fn w(&self, i: usize) -> &'a AtomicU64 {
        word(self.header, i)
    }

    /// The capacity as a record count.
    #[inline]
    fn cap64(&self) -> u64 {
        self.slots.len() as u64
    }

    /// The ring's capacity in records.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// What the ring does when it is full.
    #[inline]
    #[must_use]
    pub fn mode(&self) -> Mode {
        if self.w(W_MODE).load(Ordering::Relaxed) & 0xff == Mode::Overwrite as u64 {
            Mode::Overwrite
        } else {
            Mode::StopWhenFull
        }
    }

    /// The ring's one producer handle; `None` while another is out. Dropping it gives the
    /// ring back, so a later producer (on the same vCPU, or after a hand-over) can claim it.
    #[must_use]
    pub fn producer(self) -> Option<Producer<'a>> {
        // Acquire: a second producer sees everything the first one stored.
        let before = self.w(W_MODE).fetch_or(CLAIMED_BIT, Ordering::Acquire);
        (before & CLAIMED_BIT == 0).then_some(Producer {
            ring: self,
            not_sync: PhantomData,
        })
    }

    /// Records event `id` with `payload`, stamped with an ordered read of `tsc` now.
    ///
    /// This is the unchecked path: the caller keeps the one-producer rule itself (prefer a
    /// [`Producer`], which cannot be duplicated).
    ///
    /// # Errors
    /// [`RecordError::Full`] (stop-when-full; counted in [`RingRef::refused`]),
    /// [`RecordError::PayloadTooLong`], or [`RecordError::ReservedId`] for an id of
    /// vmtsync's own (from [`super::RESERVED_ID_MIN`]: a beacon's record is the beacon's
    /// alone). An overwriting ring is never full.
    #[inline]
    pub fn record<T: Tsc + ?Sized>(
        &self,
        tsc: &T,
        id: u16,
        payload: &[u8],
    ) -> Result<(), RecordError> {
        if id >= super::RESERVED_ID_MIN {
            return Err(RecordError::ReservedId);
        }
        self.store(tsc, id, payload)
    }

    /// [`RingRef::record`] for any id (beacons and [`super::span`] records use it).
    #[inline]
    pub(super) fn store<T: Tsc + ?Sized>(
        &self,
        tsc: &T,
        id: u16,
        payload: &[u8],
    ) -> Result<(), RecordError> {
        let mut data = [0u8; MAX_PAYLOAD];
        let Some(dst) = data.get_mut(..payload.len()) else {
            return Err(RecordError::PayloadTooLong);
        };
        dst.copy_from_slice(payload);
        let head_w = self.w(W_HEAD);
        let head = head_w.load(Ordering::Relaxed);
        if self.mode() == Mode::StopWhenFull {
            // Acquire: the consumer's reads of the slot it released are done.
            let tail = self.w(W_TAIL).load(Ordering::Acquire);
            if head.wrapping_sub(tail) >= self.cap64() {
                self.w(W_REFUSED).fetch_add(1, Ordering::Relaxed);
                return Err(RecordError::Full);
            }
        }
        // `data.get_mut` checked the length against MAX_PAYLOAD (16).
        #[allow(clippy::cast_possible_truncation)]
        let len = payload.len() as u8;
        self.slot(head)
            .write(head, id, &data, len, || tsc.read_ordered());
        // Release: a consumer that sees the count sees the record complete.
        head_w.store(head.wrapping_add(1), Ordering::Release);
        Ok(())
    }

    /// Emits sync beacon number [`RingRef::beacons`]: `in` from `port`, a record with id
    /// [`BEACON_ID`] whose payload is the sequence number (`u64`, little-endian) and whose
    /// `tsc` is read (ordered) after the `in`, then `out` of the sequence number's low byte
    /// to `port`. The host's timestamps of the two port exits bracket the record's TSC read.
    ///
    /// The sequence number advances and the `out` happens even when the record is refused,
    /// so the exits of every beacon carry a distinct number and the host never pairs one
    /// beacon's `in` with another's `out`. Producer side only (through a [`Producer`], or
    /// by a caller that keeps the one-producer rule).
    ///
    /// # Errors
    /// As [`RingRef::record`]: the beacon's exits happened but its record was not stored.
    pub fn beacon<T: Tsc + ?Sized, P: PortIo + ?Sized>(
        &self,
        tsc: &T,
        ports: &P,
        port: u16,
    ) -> Result<u64, RecordError> {
        let seq_w = self.w(W_BEACONS);
        let seq = seq_w.load(Ordering::Relaxed);
        let _ = ports.inb(port);
        // The host's bracket rests on this program order (docs/memory-reader.md, "Beacon
        // brackets"): no memory access moves across a port access, whatever `PortIo` the
        // caller gives (one whose asm says `nomem` would otherwise let the compiler move the
        // count's store above the `out`).
        compiler_fence(Ordering::SeqCst);
        let stored = self.store(tsc, BEACON_ID, &seq.to_le_bytes());
        compiler_fence(Ordering::SeqCst);
        // The low byte is what the host matches the `out` by (the probe protocol's rule).
        #[allow(clippy::cast_possible_truncation)]
        ports.outb(port, seq as u8);
        compiler_fence(Ordering::SeqCst);
        seq_w.store(seq.wrapping_add(1), Ordering::Relaxed);
        stored.map(|()| seq)
    }

    /// Beacons emitted so far: the next beacon's sequence number.
    #[must_use]
    pub fn beacons(&self) -> u64 {
        self.w(W_BEACONS).load(Ordering::Relaxed)
    }

    /// Records stored so far (free-running): the next record's index.
    #[must_use]
    pub fn end(&self) -> u64 {
        self.w(W_HEAD).load(Ordering::Acquire)
    }

    /// The index of the oldest record the consumer has not released.
    #[must_use]
    pub fn start(&self) -> u64 {
        self.w(W_TAIL).load(Ordering::Relaxed)
    }

    /// Reads record `index` without removing it: whole, or an error; never a record half
    /// overwritten. Consumer side (any reader may call it: it writes nothing).
    ///
    /// # Errors
    /// [`ReadError::NotYet`] when it is not stored yet, [`ReadError::Overwritten`] when the
    /// producer overwrote it (or was overwriting it during the read).
    pub fn read(&self, index: u64) -> Result<Record, ReadError> {
        let head_w = self.w(W_HEAD);
        let head = head_w.load(Ordering::Acquire);
        if index >= head {
            return Err(ReadError::NotYet);
        }
        if head - index > self.cap64() {
            return Err(ReadError::Overwritten);
        }
        self.slot(index)
            .read(index, self.cap64(), || head_w.load(Ordering::Relaxed))
    }

    /// After a read of `from` found it [`ReadError::Overwritten`]: moves the consumer past
    /// every record lost with it and returns the index to read next. Records at or above
    /// `sent` (the end of what the consumer ever handed on) that it skips count in
    /// [`RingRef::overwritten`]: they were lost before anyone saw them. Consumer side only.
    pub fn skip(&self, from: u64, sent: u64) -> u64 {
        let head = self.end();
        // Every record CAP or more below the count is overwritten; `from` itself was caught
        // being overwritten.
        let next = from
            .saturating_add(1)
            .max(head.saturating_sub(self.cap64()))
            .min(head);
        let lost = next.saturating_sub(from.max(sent));
        if lost > 0 {
            let o = self.w(W_OVERWRITTEN);
            let n = o.load(Ordering::Relaxed);
            o.store(n.wrapping_add(lost), Ordering::Relaxed);
        }
        self.release(next);
        next.max(from)
    }

    /// Releases every record below `end` (their slots become the producer's again).
    /// Consumer side only.
    pub fn release(&self, end: u64) {
        let tail_w = self.w(W_TAIL);
        let tail = tail_w.load(Ordering::Relaxed);
        let end = end.min(self.end());
        if end > tail {
            // Release: the reads of the freed slots happen before the producer reuses them.
            tail_w.store(end, Ordering::Release);
        }
    }

    /// The oldest record, removed from the ring; `None` when empty. Overwritten records it
    /// meets on the way are skipped and counted. Consumer side only.
    #[must_use]
    pub fn pop(&self) -> Option<Record> {
        let mut at = self.start();
        // Each skip moves forward; a producer that laps the reader this often is given up on
        // for this call (the next one goes on from here).
        for _ in 0..4 {
            match self.read(at) {
                Ok(r) => {
                    self.release(at.wrapping_add(1));
                    return Some(r);
                }
                Err(ReadError::NotYet) => return None,
                Err(ReadError::Overwritten) => at = self.skip(at, at),
            }
        }
        None
    }

    /// Records waiting to be consumed (at most the capacity; an overwriting ring that lapped
    /// its consumer holds the newest `CAP`).
    #[must_use]
    pub fn len(&self) -> usize {
        let tail = self.w(W_TAIL).load(Ordering::Acquire);
        let head = self.end();
        // At most CAP <= 2^31: fits.
        #[allow(clippy::cast_possible_truncation)]
        let n = head.wrapping_sub(tail).min(self.cap64()) as usize;
        n
    }

    /// Whether no record is waiting.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Events refused so far because the ring was full (stop-when-full, cumulative).
    #[must_use]
    pub fn refused(&self) -> u64 {
        self.w(W_REFUSED).load(Ordering::Relaxed)
    }

    /// Records overwritten before the consumer handed them on (cumulative).
    #[must_use]
    pub fn overwritten(&self) -> u64 {
        self.w(W_OVERWRITTEN).load(Ordering::Relaxed)
    }

    /// Every event the ring lost: refused plus overwritten (one of them is 0 for a ring
    /// used by the rules).
    #[must_use]
    pub fn dropped(&self) -> u64 {
        self.refused().wrapping_add(self.overwritten())
    }

    /// Puts the ring back to empty in `mode`, releasing any producer claim. Only for storage
    /// no one else uses yet ([`super::MemRecorder::init`]).
    pub(super) fn reset(&self, mode: Mode) {
        for i in 0..16 {
            self.w(i).store(0, Ordering::Relaxed);
        }
        self.w(W_MODE).store(mode as u64, Ordering::Relaxed);
        for s in self.slots {
            for i in 0..4 {
                s.word(i).store(0, Ordering::Relaxed);
            }
        }
    }

    #[inline]
    fn slot(&self, index: u64) -> &'a Slot {
        // The slot count is a power of two (checked by every constructor), so masking is
        // the modulo and `get` always finds the slot. Its `None` arm, which cannot happen,
        // names a spare slot rather than indexing: an index that could panic would pull the
        // panic machinery (and its formatting code) into every producer's path.
        static SPARE: Slot = Slot::new();
        #[allow(clippy::cast_possible_truncation)]
        let i = index as usize & self.slots.len().wrapping_sub(1);
        self.slots.get(i).unwrap_or(&SPARE)
    }
}

/// The one producer of a ring (from [`RingRef::producer`], [`super::Recorder::producer`] or
/// [`super::MemRecorder::producer`]). It cannot be cloned and is not `Sync`, so one handle
/// records from one place at a time; it is `Send`, so it may move to the vCPU that owns it.
/// It dereferences to its ring's view, so it records through [`RingRef`]'s methods
/// ([`RingRef::record`], [`RingRef::beacon`], the span records).
#[derive(Debug)]
pub struct Producer<'a> {
    ring: RingRef<'a>,
    not_sync: PhantomData<Cell<()>>,
}

impl<'a> Producer<'a> {
    /// The ring this handle produces into.
    #[must_use]
    pub const fn ring(&self) -> RingRef<'a> {
        self.ring
    }
}

impl<'a> Deref for Producer<'a> {
    type Target = RingRef<'a>;

    #[inline]
    fn deref(&self) -> &RingRef<'a> {
        &self.ring
    }
}

impl Drop for Producer<'_> {
    fn drop(&mut self) {
        // Release: the next producer sees this one's records.
        self.ring
            .w(W_MODE)
            .fetch_and(!CLAIMED_BIT, Ordering::Release);
    }
}

// The ring's layout (a reader of guest memory finds the slots at 128, and ring `i + 1`
// right after ring `i`'s last slot).
const _: () = {
    assert!(core::mem::offset_of!(Ring<2>, header) == 0);
    assert!(core::mem::offset_of!(Ring<2>, slots) == 128);
    assert!(core::mem::size_of::<Ring<2>>() == super::layout::ring_stride(2));
    assert!(core::mem::size_of::<Ring<64>>() == super::layout::ring_stride(64));
    assert!(core::mem::size_of::<RingHeader>() == super::layout::RING_HEADER_SIZE);
    // `ring_header` puts the mode in slot 0's third word.
    assert!(W_MODE == 2);
};
