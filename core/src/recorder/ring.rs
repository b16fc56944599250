//! One vCPU's ring: the producer's side ([`Ring::record`], [`Producer`]) and the consumer's
//! (indexed reads, [`Ring::skip`], [`Ring::release`]).

use core::cell::Cell;
use core::marker::PhantomData;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::slot::{ReadError, Slot};
use super::{MAX_PAYLOAD, Mode, Record, RecordError};
use crate::arch::Tsc;

/// A single-producer single-consumer ring of `CAP` records (`CAP` a power of two, at most
/// 2^31), stop-when-full ([`Ring::new`]) or overwriting its oldest records
/// ([`Ring::new_flight`]).
///
/// `repr(C)`: the producer's words on the first 64-byte line, the consumer's on the second,
/// then the slots (`super::slot` has their layout).
#[derive(Debug)]
#[repr(C)]
pub struct Ring<const CAP: usize> {
    prod: CacheLine<ProducerSide>,
    cons: CacheLine<ConsumerSide>,
    slots: [Slot; CAP],
}

/// The words the producer writes (and the mode it reads on every record).
#[derive(Debug)]
#[repr(C)]
struct ProducerSide {
    /// Records stored (free-running): the next record's index.
    head: AtomicU64,
    /// Events refused because the ring was full (stop-when-full only).
    refused: AtomicU64,
    /// What a full ring does.
    mode: Mode,
    /// Whether a [`Producer`] handle is out.
    claimed: AtomicBool,
}

/// The words the consumer writes.
#[derive(Debug)]
#[repr(C)]
struct ConsumerSide {
    /// Records released by the consumer (free-running): every record below it is consumed.
    tail: AtomicU64,
    /// Records the producer overwrote before the consumer sent them (overwrite mode).
    overwritten: AtomicU64,
}

/// A value alone on its 64-byte cache line, so a producer on one CPU and the consumer on
/// another do not bounce one line between them on every record.
#[derive(Debug)]
#[repr(C, align(64))]
struct CacheLine<T>(T);

impl<T> core::ops::Deref for CacheLine<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
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
    /// `CAP` as a record count.
    const CAP64: u64 = CAP as u64;

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
            prod: CacheLine(ProducerSide {
                head: AtomicU64::new(0),
                refused: AtomicU64::new(0),
                mode,
                claimed: AtomicBool::new(false),
            }),
            cons: CacheLine(ConsumerSide {
                tail: AtomicU64::new(0),
                overwritten: AtomicU64::new(0),
            }),
            slots: [const { Slot::new() }; CAP],
        }
    }

    /// The ring's capacity in records.
    #[must_use]
    pub const fn capacity(&self) -> usize {
        CAP
    }

    /// What the ring does when it is full.
    #[must_use]
    pub const fn mode(&self) -> Mode {
        self.prod.0.mode
    }

    /// The ring's one producer handle; `None` while another is out. Dropping it gives the
    /// ring back, so a later producer (on the same vCPU, or after a hand-over) can claim it.
    #[must_use]
    pub fn producer(&self) -> Option<Producer<'_, CAP>> {
        // Acquire: a second producer sees everything the first one stored.
        (!self.prod.claimed.swap(true, Ordering::Acquire)).then_some(Producer {
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
    /// [`RecordError::Full`] (stop-when-full; counted in [`Ring::refused`]) or
    /// [`RecordError::PayloadTooLong`]. An overwriting ring is never full.
    #[inline]
    pub fn record<T: Tsc + ?Sized>(
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
        let head = self.prod.head.load(Ordering::Relaxed);
        if self.prod.mode == Mode::StopWhenFull {
            // Acquire: the consumer's reads of the slot it released are done.
            let tail = self.cons.tail.load(Ordering::Acquire);
            if head.wrapping_sub(tail) >= Self::CAP64 {
                self.prod.refused.fetch_add(1, Ordering::Relaxed);
                return Err(RecordError::Full);
            }
        }
        // `data.get_mut` checked the length against MAX_PAYLOAD (16).
        #[allow(clippy::cast_possible_truncation)]
        let len = payload.len() as u8;
        self.slot(head)
            .write(head, id, &data, len, || tsc.read_ordered());
        // Release: a consumer that sees the count sees the record complete.
        self.prod
            .head
            .store(head.wrapping_add(1), Ordering::Release);
        Ok(())
    }

    /// Records stored so far (free-running): the next record's index.
    #[must_use]
    pub fn end(&self) -> u64 {
        self.prod.head.load(Ordering::Acquire)
    }

    /// The index of the oldest record the consumer has not released.
    #[must_use]
    pub fn start(&self) -> u64 {
        self.cons.tail.load(Ordering::Relaxed)
    }

    /// Reads record `index` without removing it: whole, or an error; never a record half
    /// overwritten. Consumer side (any reader may call it: it writes nothing).
    ///
    /// # Errors
    /// [`ReadError::NotYet`] when it is not stored yet, [`ReadError::Overwritten`] when the
    /// producer overwrote it (or was overwriting it during the read).
    pub fn read(&self, index: u64) -> Result<Record, ReadError> {
        let head = self.prod.head.load(Ordering::Acquire);
        if index >= head {
            return Err(ReadError::NotYet);
        }
        if head - index > Self::CAP64 {
            return Err(ReadError::Overwritten);
        }
        self.slot(index).read(index, Self::CAP64, || {
            self.prod.head.load(Ordering::Relaxed)
        })
    }

    /// After a read of `from` found it [`ReadError::Overwritten`]: moves the consumer past
    /// every record lost with it and returns the index to read next. Records at or above
    /// `sent` (the end of what the consumer ever handed on) that it skips count in
    /// [`Ring::overwritten`]: they were lost before anyone saw them. Consumer side only.
    pub fn skip(&self, from: u64, sent: u64) -> u64 {
        let head = self.prod.head.load(Ordering::Acquire);
        // Every record CAP or more below the count is overwritten; `from` itself was caught
        // being overwritten.
        let next = from
            .saturating_add(1)
            .max(head.saturating_sub(Self::CAP64))
            .min(head);
        let lost = next.saturating_sub(from.max(sent));
        if lost > 0 {
            let n = self.cons.overwritten.load(Ordering::Relaxed);
            self.cons
                .overwritten
                .store(n.wrapping_add(lost), Ordering::Relaxed);
        }
        self.release(next);
        next.max(from)
    }

    /// Releases every record below `end` (their slots become the producer's again).
    /// Consumer side only.
    pub fn release(&self, end: u64) {
        let tail = self.cons.tail.load(Ordering::Relaxed);
        let end = end.min(self.prod.head.load(Ordering::Acquire));
        if end > tail {
            // Release: the reads of the freed slots happen before the producer reuses them.
            self.cons.tail.store(end, Ordering::Release);
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
        let tail = self.cons.tail.load(Ordering::Acquire);
        let head = self.prod.head.load(Ordering::Acquire);
        // At most CAP <= 2^31: fits.
        #[allow(clippy::cast_possible_truncation)]
        let n = head.wrapping_sub(tail).min(Self::CAP64) as usize;
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
        self.prod.refused.load(Ordering::Relaxed)
    }

    /// Records overwritten before the consumer handed them on (cumulative).
    #[must_use]
    pub fn overwritten(&self) -> u64 {
        self.cons.overwritten.load(Ordering::Relaxed)
    }

    /// Every event the ring lost: refused plus overwritten (one of them is 0 for a ring
    /// used by the rules).
    #[must_use]
    pub fn dropped(&self) -> u64 {
        self.refused().wrapping_add(self.overwritten())
    }

    fn slot(&self, index: u64) -> &Slot {
        // CAP is a power of two (checked in `with_mode`), so masking is the modulo; `get`
        // keeps the indexing panic-free even so.
        #[allow(clippy::cast_possible_truncation)]
        let i = index as usize & (CAP - 1);
        self.slots.get(i).unwrap_or(&self.slots[0])
    }
}

/// The one producer of a [`Ring`] (from [`Ring::producer`] or
/// [`super::Recorder::producer`]). It cannot be cloned and is not `Sync`, so one handle
/// records from one place at a time; it is `Send`, so it may move to the vCPU that owns it.
#[derive(Debug)]
pub struct Producer<'a, const CAP: usize> {
    ring: &'a Ring<CAP>,
    not_sync: PhantomData<Cell<()>>,
}

impl<const CAP: usize> Producer<'_, CAP> {
    /// Records event `id` with `payload`, stamped with an ordered read of `tsc` now; never
    /// blocks, allocates or panics.
    ///
    /// # Errors
    /// As [`Ring::record`].
    #[inline]
    pub fn record<T: Tsc + ?Sized>(
        &self,
        tsc: &T,
        id: u16,
        payload: &[u8],
    ) -> Result<(), RecordError> {
        self.ring.record(tsc, id, payload)
    }

    /// The ring this handle produces into.
    #[must_use]
    pub const fn ring(&self) -> &Ring<CAP> {
        self.ring
    }
}

impl<const CAP: usize> Drop for Producer<'_, CAP> {
    fn drop(&mut self) {
        // Release: the next producer sees this one's records.
        self.ring.prod.claimed.store(false, Ordering::Release);
    }
}

// The ring's header layout (a reader of guest memory finds the slots at 128).
const _: () = {
    assert!(core::mem::offset_of!(Ring<1>, prod) == 0);
    assert!(core::mem::offset_of!(Ring<1>, cons) == 64);
    assert!(core::mem::offset_of!(Ring<1>, slots) == 128);
    assert!(core::mem::offset_of!(ProducerSide, head) == 0);
    assert!(core::mem::offset_of!(ProducerSide, refused) == 8);
    assert!(core::mem::offset_of!(ProducerSide, mode) == 16);
    assert!(core::mem::offset_of!(ConsumerSide, tail) == 0);
    assert!(core::mem::offset_of!(ConsumerSide, overwritten) == 8);
};
