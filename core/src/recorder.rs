//! The event recorder a unikernel links: one lock-free single-producer ring per vCPU in
//! `const`-constructible static storage.
//!
//! ```
//! use vmtsync_core::arch::FakeTsc;
//! use vmtsync_core::recorder::Recorder;
//!
//! // Two vCPUs, 1024 records each: 2 × 1024 × 32 bytes of static storage, no heap.
//! static RECORDER: Recorder<2, 1024> = Recorder::new();
//!
//! let tsc = FakeTsc::new(1_000, 10);
//! // On vCPU 1: event 7 with a 4-byte payload, stamped with the TSC now.
//! assert!(RECORDER.record(1, &tsc, 7, &42u32.to_le_bytes()).is_ok());
//! // The consumer (the agent's protocol loop) drains it.
//! let ring = RECORDER.ring(1).unwrap();
//! let r = ring.pop().unwrap();
//! assert_eq!((r.id, r.payload()), (7, &42u32.to_le_bytes()[..]));
//! ```
//!
//! # Contract
//! - **One producer per ring.** Each vCPU records only into its own ring (the caller names
//!   it). Code that can interrupt a producer on the same vCPU (an interrupt handler) must use
//!   a ring of its own or mask the interrupt around [`Ring::record`]. Breaking this contract
//!   can garble records but never causes undefined behaviour or a panic: every slot is made
//!   of atomics, and this module has no `unsafe`.
//! - **One consumer per ring**: the agent's protocol loop, which drains every ring of a
//!   [`Recorder`] through [`EventSources`] (each batch names its vCPU).
//! - [`Ring::record`] never blocks, never allocates and never panics. When the ring is full it
//!   counts the event in [`Ring::dropped`] (exactly: one per refused event) and returns
//!   [`RecordError::Full`].
//! - Records come out of a ring in the order they went in; each carries the TSC read inside
//!   [`Ring::record`] (ordered: `lfence; rdtsc`, see [`crate::arch::Tsc`]), so a ring's
//!   timestamps are non-decreasing as long as the TSC is.
//!
//! # How it works
//! A ring is a bounded single-producer single-consumer queue (Lamport's). The producer owns
//! `head`, the consumer owns `tail`, both free-running `u32` counters (indices are taken
//! modulo `CAP`, which must be a power of two). The producer writes a slot with relaxed stores
//! and publishes it by storing `head` with `Release`; the consumer loads `head` with `Acquire`,
//! reads the slot and frees it by storing `tail` with `Release`, which the producer loads with
//! `Acquire` before reusing the slot. A slot is four `AtomicU64` words (32 bytes):
//! the TSC; `id | len << 16`; the payload's 16 bytes as two little-endian words.

use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::arch::Tsc;
use crate::units::GuestTicks;

/// The largest payload one record carries, in bytes.
pub const MAX_PAYLOAD: usize = 16;

/// One recorded event, as the consumer gets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Record {
    /// The guest TSC read when the event was recorded.
    pub tsc: GuestTicks,
    /// The application's event id.
    pub id: u16,
    /// How many bytes of `data` are payload (at most [`MAX_PAYLOAD`]).
    pub len: u8,
    /// The payload in `data[..len]`; the rest is zero.
    pub data: [u8; MAX_PAYLOAD],
}

impl Record {
    /// The payload bytes.
    #[must_use]
    pub fn payload(&self) -> &[u8] {
        self.data
            .get(..usize::from(self.len))
            .unwrap_or(&self.data[..])
    }
}

/// Why [`Ring::record`] did not store an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum RecordError {
    /// The ring is full; the event was counted in [`Ring::dropped`].
    Full,
    /// The payload is longer than [`MAX_PAYLOAD`]; nothing was stored or counted.
    PayloadTooLong,
    /// [`Recorder::record`] named a vCPU the recorder has no ring for; nothing was counted.
    NoSuchVcpu,
}

/// One slot: four words, written by the producer, read by the consumer.
#[derive(Debug)]
struct Slot {
    tsc: AtomicU64,
    meta: AtomicU64,
    lo: AtomicU64,
    hi: AtomicU64,
}

impl Slot {
    const fn new() -> Self {
        Self {
            tsc: AtomicU64::new(0),
            meta: AtomicU64::new(0),
            lo: AtomicU64::new(0),
            hi: AtomicU64::new(0),
        }
    }
}

/// A single-producer single-consumer ring of `CAP` records (`CAP` a power of two, at most
/// 2^31).
#[derive(Debug)]
pub struct Ring<const CAP: usize> {
    /// Records published by the producer (free-running). Producer-written fields and the
    /// consumer's `tail` sit on different cache lines, so a producer on one CPU and the
    /// consumer on another do not bounce one line between them on every record.
    head: CacheLine<AtomicU32>,
    /// Events refused because the ring was full (free-running, wraps at 2^64).
    dropped: AtomicU64,
    /// Records consumed (free-running).
    tail: CacheLine<AtomicU32>,
    slots: [Slot; CAP],
}

/// A value alone on its 64-byte cache line.
#[derive(Debug)]
#[repr(align(64))]
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
    /// Checked when a ring is built: indices are masked, and `head - tail` must fit a `u32`.
    const VALID: () = assert!(
        CAP.is_power_of_two() && CAP <= 1 << 31,
        "ring capacity must be a power of two, at most 2^31"
    );

    /// An empty ring, usable in a `static`.
    #[must_use]
    pub const fn new() -> Self {
        let () = Self::VALID;
        Self {
            head: CacheLine(AtomicU32::new(0)),
            dropped: AtomicU64::new(0),
            tail: CacheLine(AtomicU32::new(0)),
            slots: [const { Slot::new() }; CAP],
        }
    }

    /// The ring's capacity in records.
    #[must_use]
    pub const fn capacity(&self) -> usize {
        CAP
    }

    /// Records event `id` with `payload`, stamped with an ordered read of `tsc` now.
    ///
    /// # Errors
    /// [`RecordError::Full`] (counted in [`Ring::dropped`]) or [`RecordError::PayloadTooLong`].
    #[inline]
    pub fn record<T: Tsc + ?Sized>(
        &self,
        tsc: &T,
        id: u16,
        payload: &[u8],
    ) -> Result<(), RecordError> {
        if payload.len() > MAX_PAYLOAD {
            return Err(RecordError::PayloadTooLong);
        }
        let head = self.head.load(Ordering::Relaxed);
        let tail = self.tail.load(Ordering::Acquire);
        if head.wrapping_sub(tail) as usize >= CAP {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return Err(RecordError::Full);
        }
        let mut data = [0u8; MAX_PAYLOAD];
        if let Some(dst) = data.get_mut(..payload.len()) {
            dst.copy_from_slice(payload);
        }
        let (lo, hi) = data.split_at(8);
        let word = |b: &[u8]| {
            let mut w = [0u8; 8];
            w.copy_from_slice(b);
            u64::from_le_bytes(w)
        };
        // The stamp is the last thing read before publishing, so it is as close to the
        // caller's event as the ring allows.
        let stamp = tsc.read_ordered();
        let slot = self.slot(head);
        slot.meta.store(
            u64::from(id) | (payload.len() as u64) << 16,
            Ordering::Relaxed,
        );
        slot.lo.store(word(lo), Ordering::Relaxed);
        slot.hi.store(word(hi), Ordering::Relaxed);
        slot.tsc.store(stamp, Ordering::Relaxed);
        self.head.store(head.wrapping_add(1), Ordering::Release);
        Ok(())
    }

    /// The oldest record, removed from the ring; `None` when empty. Consumer side only.
    #[must_use]
    pub fn pop(&self) -> Option<Record> {
        let r = self.peek()?;
        self.advance();
        Some(r)
    }

    /// The oldest record, left in the ring (take it with [`Ring::advance`] once it is safely
    /// sent). Consumer side only.
    #[must_use]
    pub fn peek(&self) -> Option<Record> {
        self.get(0)
    }

    /// Removes the oldest record (after [`Ring::peek`]); does nothing when empty. Consumer
    /// side only.
    pub fn advance(&self) {
        self.consume(1);
    }

    /// The `i`-th oldest record (0: the oldest), left in the ring; `None` if fewer than
    /// `i + 1` are waiting. Consumer side only.
    #[must_use]
    pub fn get(&self, i: usize) -> Option<Record> {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        if i >= head.wrapping_sub(tail) as usize {
            return None;
        }
        // i < head - tail <= CAP <= 2^31, so it fits.
        let index = tail.wrapping_add(u32::try_from(i).ok()?);
        let slot = self.slot(index);
        let meta = slot.meta.load(Ordering::Relaxed);
        let mut data = [0u8; MAX_PAYLOAD];
        let (lo, hi) = data.split_at_mut(8);
        lo.copy_from_slice(&slot.lo.load(Ordering::Relaxed).to_le_bytes());
        hi.copy_from_slice(&slot.hi.load(Ordering::Relaxed).to_le_bytes());
        // The low 16 bits are the id, the next 8 the length (clamped: a garbled slot, from a
        // broken single-producer contract, must not claim more than the payload holds).
        #[allow(clippy::cast_possible_truncation)]
        let (id, len) = (meta as u16, ((meta >> 16) as u8).min(MAX_PAYLOAD as u8));
        Some(Record {
            tsc: GuestTicks(slot.tsc.load(Ordering::Relaxed)),
            id,
            len,
            data,
        })
    }

    /// Removes the `n` oldest records (fewer if fewer are waiting). Consumer side only.
    pub fn consume(&self, n: usize) {
        let tail = self.tail.load(Ordering::Relaxed);
        let waiting = self.head.load(Ordering::Acquire).wrapping_sub(tail);
        let n = u32::try_from(n).unwrap_or(u32::MAX).min(waiting);
        self.tail.store(tail.wrapping_add(n), Ordering::Release);
    }

    /// Records waiting to be consumed.
    #[must_use]
    pub fn len(&self) -> usize {
        let tail = self.tail.load(Ordering::Acquire);
        let head = self.head.load(Ordering::Acquire);
        (head.wrapping_sub(tail) as usize).min(CAP)
    }

    /// Whether no record is waiting.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Events refused so far because the ring was full (cumulative).
    #[must_use]
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    fn slot(&self, index: u32) -> &Slot {
        // CAP is a power of two (checked in `new`), so masking is the modulo; `get` keeps the
        // indexing panic-free even so.
        let i = index as usize & (CAP - 1);
        self.slots.get(i).unwrap_or(&self.slots[0])
    }
}

/// Where the agent's protocol loop takes events from: a [`Ring`] (or a reference to one), or
/// [`NoEvents`]. Consumer-side operations only.
pub trait EventSource {
    /// The `i`-th oldest waiting record.
    fn get(&self, i: usize) -> Option<Record>;
    /// Removes the `n` oldest records.
    fn consume(&self, n: usize);
    /// Records waiting.
    fn waiting(&self) -> usize;
    /// Events refused so far because the storage was full (cumulative).
    fn dropped(&self) -> u64;
    /// Whether this source records events at all (the agent advertises `Features::EVENTS`
    /// only then).
    fn present(&self) -> bool {
        true
    }
}

impl<const CAP: usize> EventSource for Ring<CAP> {
    fn get(&self, i: usize) -> Option<Record> {
        Ring::get(self, i)
    }
    fn consume(&self, n: usize) {
        Ring::consume(self, n);
    }
    fn waiting(&self) -> usize {
        self.len()
    }
    fn dropped(&self) -> u64 {
        Ring::dropped(self)
    }
}

impl<S: EventSource + ?Sized> EventSource for &S {
    fn get(&self, i: usize) -> Option<Record> {
        (**self).get(i)
    }
    fn consume(&self, n: usize) {
        (**self).consume(n);
    }
    fn waiting(&self) -> usize {
        (**self).waiting()
    }
    fn dropped(&self) -> u64 {
        (**self).dropped()
    }
    fn present(&self) -> bool {
        (**self).present()
    }
}

/// The most vCPU queues one [`EventSources`] may have: the protocol names vCPUs 0–63 in its
/// vCPU list (docs/smp.md), and the agent keeps a fixed array per queue.
pub const MAX_EVENT_SOURCES: usize = 64;

/// What the agent drains: one queue per vCPU (a [`Recorder`]), or a single queue of its own
/// vCPU (any [`EventSource`]: a [`Ring`], a reference to one, [`NoEvents`]). Queue `q` holds
/// the events of vCPU [`EventSources::queue_vcpu`]`(q)`; each queue is consumed on its own.
pub trait EventSources {
    /// How many queues (at most [`MAX_EVENT_SOURCES`] are served).
    fn queues(&self) -> usize;
    /// The vCPU (APIC id) whose events queue `q` holds; `None`: the agent's own vCPU.
    fn queue_vcpu(&self, q: usize) -> Option<u32>;
    /// The `i`-th oldest waiting record of queue `q`.
    fn get_in(&self, q: usize, i: usize) -> Option<Record>;
    /// Removes the `n` oldest records of queue `q`.
    fn consume_in(&self, q: usize, n: usize);
    /// Records waiting in queue `q`.
    fn waiting_in(&self, q: usize) -> usize;
    /// Events queue `q` refused so far because it was full (cumulative).
    fn dropped_in(&self, q: usize) -> u64;
    /// Whether this source records events at all.
    fn records_events(&self) -> bool;
}

impl<E: EventSource> EventSources for E {
    fn queues(&self) -> usize {
        1
    }
    fn queue_vcpu(&self, _: usize) -> Option<u32> {
        None
    }
    fn get_in(&self, q: usize, i: usize) -> Option<Record> {
        if q == 0 { self.get(i) } else { None }
    }
    fn consume_in(&self, q: usize, n: usize) {
        if q == 0 {
            self.consume(n);
        }
    }
    fn waiting_in(&self, q: usize) -> usize {
        if q == 0 { self.waiting() } else { 0 }
    }
    fn dropped_in(&self, q: usize) -> u64 {
        if q == 0 { self.dropped() } else { 0 }
    }
    fn records_events(&self) -> bool {
        self.present()
    }
}

/// A [`Recorder`]'s ring `i` is vCPU `i`'s (the index is the APIC id).
impl<const VCPUS: usize, const CAP: usize> EventSources for Recorder<VCPUS, CAP> {
    fn queues(&self) -> usize {
        VCPUS.min(MAX_EVENT_SOURCES)
    }
    fn queue_vcpu(&self, q: usize) -> Option<u32> {
        u32::try_from(q).ok()
    }
    fn get_in(&self, q: usize, i: usize) -> Option<Record> {
        self.ring(q)?.get(i)
    }
    fn consume_in(&self, q: usize, n: usize) {
        if let Some(r) = self.ring(q) {
            r.consume(n);
        }
    }
    fn waiting_in(&self, q: usize) -> usize {
        self.ring(q).map_or(0, Ring::len)
    }
    fn dropped_in(&self, q: usize) -> u64 {
        self.ring(q).map_or(0, Ring::dropped)
    }
    fn records_events(&self) -> bool {
        true
    }
}

/// A reference to a [`Recorder`] (the agent holds the `static` one by reference).
impl<const VCPUS: usize, const CAP: usize> EventSources for &Recorder<VCPUS, CAP> {
    fn queues(&self) -> usize {
        (**self).queues()
    }
    fn queue_vcpu(&self, q: usize) -> Option<u32> {
        (**self).queue_vcpu(q)
    }
    fn get_in(&self, q: usize, i: usize) -> Option<Record> {
        (**self).get_in(q, i)
    }
    fn consume_in(&self, q: usize, n: usize) {
        (**self).consume_in(q, n);
    }
    fn waiting_in(&self, q: usize) -> usize {
        (**self).waiting_in(q)
    }
    fn dropped_in(&self, q: usize) -> u64 {
        (**self).dropped_in(q)
    }
    fn records_events(&self) -> bool {
        true
    }
}

/// An agent without events: nothing is ever waiting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoEvents;

impl EventSource for NoEvents {
    fn get(&self, _: usize) -> Option<Record> {
        None
    }
    fn consume(&self, _: usize) {}
    fn waiting(&self) -> usize {
        0
    }
    fn dropped(&self) -> u64 {
        0
    }
    fn present(&self) -> bool {
        false
    }
}

/// One ring per vCPU: `VCPUS` rings of `CAP` records each, in static storage.
#[derive(Debug)]
pub struct Recorder<const VCPUS: usize, const CAP: usize> {
    rings: [Ring<CAP>; VCPUS],
}

impl<const VCPUS: usize, const CAP: usize> Default for Recorder<VCPUS, CAP> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const VCPUS: usize, const CAP: usize> Recorder<VCPUS, CAP> {
    /// Empty rings, usable in a `static`.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            rings: [const { Ring::new() }; VCPUS],
        }
    }

    /// The ring of `vcpu`, if the recorder has one.
    #[must_use]
    pub fn ring(&self, vcpu: usize) -> Option<&Ring<CAP>> {
        self.rings.get(vcpu)
    }

    /// All rings, by vCPU index.
    #[must_use]
    pub const fn rings(&self) -> &[Ring<CAP>; VCPUS] {
        &self.rings
    }

    /// Records event `id` on `vcpu`'s ring (see [`Ring::record`]).
    ///
    /// # Errors
    /// [`RecordError::NoSuchVcpu`], or what [`Ring::record`] returns.
    #[inline]
    pub fn record<T: Tsc + ?Sized>(
        &self,
        vcpu: usize,
        tsc: &T,
        id: u16,
        payload: &[u8],
    ) -> Result<(), RecordError> {
        self.ring(vcpu)
            .ok_or(RecordError::NoSuchVcpu)?
            .record(tsc, id, payload)
    }
}

#[cfg(test)]
// Test data is built from small loop indices: truncation is intended.
#[allow(clippy::cast_possible_truncation)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;
    use crate::arch::FakeTsc;
    use proptest::prelude::*;

    #[test]
    fn a_full_ring_counts_every_refused_event_exactly() {
        let ring = Ring::<4>::new();
        let tsc = FakeTsc::new(100, 1);
        for i in 0..4 {
            ring.record(&tsc, i, &[]).unwrap();
        }
        for _ in 0..10 {
            assert_eq!(ring.record(&tsc, 9, &[1]), Err(RecordError::Full));
        }
        assert_eq!((ring.len(), ring.dropped()), (4, 10));
        let ids: Vec<u16> = core::iter::from_fn(|| ring.pop()).map(|r| r.id).collect();
        assert_eq!(ids, [0, 1, 2, 3]);
        // Freed slots are reused.
        ring.record(&tsc, 5, &[]).unwrap();
        assert_eq!(ring.pop().map(|r| r.id), Some(5));
    }

    #[test]
    fn payloads_round_trip_and_overlong_ones_are_refused_uncounted() {
        let ring = Ring::<2>::new();
        let tsc = FakeTsc::new(7, 3);
        let p: [u8; 16] = core::array::from_fn(|i| i as u8 + 1);
        ring.record(&tsc, 0xbeef, &p).unwrap();
        assert_eq!(
            ring.record(&tsc, 1, &[0; 17]),
            Err(RecordError::PayloadTooLong)
        );
        assert_eq!(ring.dropped(), 0);
        let r = ring.pop().unwrap();
        assert_eq!((r.id, r.payload(), r.tsc.0 > 0), (0xbeef, &p[..], true));
        assert_eq!(ring.pop(), None);
    }

    #[test]
    fn the_recorder_names_its_vcpus() {
        static R: Recorder<2, 8> = Recorder::new();
        let tsc = FakeTsc::new(1, 1);
        assert_eq!(R.record(2, &tsc, 1, &[]), Err(RecordError::NoSuchVcpu));
        R.record(1, &tsc, 1, &[]).unwrap();
        assert_eq!((R.rings()[0].len(), R.rings()[1].len()), (0, 1));
    }

    #[test]
    fn peek_then_advance_keeps_a_record_until_it_is_taken() {
        let ring = Ring::<2>::new();
        let tsc = FakeTsc::new(1, 1);
        ring.record(&tsc, 3, &[]).unwrap();
        assert_eq!(ring.peek().map(|r| r.id), Some(3));
        assert_eq!(ring.len(), 1);
        ring.advance();
        assert!(ring.is_empty());
        ring.advance();
        assert!(ring.is_empty());
    }

    proptest! {
        /// Against a model queue: any interleaving of records and pops keeps order, loses
        /// nothing that was not counted as dropped, and never exceeds the capacity.
        #[test]
        fn matches_a_model_queue(ops in proptest::collection::vec(any::<(bool, u16, u8)>(), 0..400)) {
            let ring = Ring::<8>::new();
            let tsc = FakeTsc::new(10, 5);
            let mut model = std::collections::VecDeque::new();
            let mut dropped = 0u64;
            for (push, id, len) in ops {
                if push {
                    let len = usize::from(len % 17);
                    let payload: Vec<u8> = (0..len).map(|i| id as u8 ^ i as u8).collect();
                    match ring.record(&tsc, id, &payload) {
                        Ok(()) => model.push_back((id, payload)),
                        Err(RecordError::Full) => {
                            prop_assert_eq!(model.len(), 8);
                            dropped += 1;
                        }
                        Err(e) => prop_assert!(false, "{:?}", e),
                    }
                } else {
                    let got = ring.pop().map(|r| (r.id, r.payload().to_vec()));
                    prop_assert_eq!(got, model.pop_front());
                }
                prop_assert_eq!(ring.len(), model.len());
                prop_assert_eq!(ring.dropped(), dropped);
            }
        }
    }

    /// A producer thread against a consumer thread: every event arrives once, in order, or
    /// is counted as dropped; timestamps never go backwards.
    #[test]
    fn a_concurrent_producer_and_consumer_lose_nothing_uncounted() {
        struct Counter(AtomicU64);
        impl Tsc for Counter {
            fn read_ordered(&self) -> u64 {
                self.0.fetch_add(1, Ordering::Relaxed)
            }
        }
        static RING: Ring<64> = Ring::new();
        const N: u32 = 200_000;
        let tsc = Counter(AtomicU64::new(0));
        let consumer = std::thread::spawn(|| {
            let mut got = Vec::new();
            let mut last_tsc = 0;
            loop {
                match RING.pop() {
                    Some(r) => {
                        let seq = u32::from_le_bytes(r.payload().try_into().unwrap());
                        assert!(r.tsc.0 >= last_tsc);
                        last_tsc = r.tsc.0;
                        if seq == u32::MAX {
                            return got;
                        }
                        got.push(seq);
                    }
                    None => std::thread::yield_now(),
                }
            }
        });
        for seq in 0..N {
            let _ = RING.record(&tsc, 1, &seq.to_le_bytes());
        }
        let mut marker_refusals = 0u64;
        while RING.record(&tsc, 1, &u32::MAX.to_le_bytes()).is_err() {
            marker_refusals += 1;
            std::thread::yield_now();
        }
        let got = consumer.join().unwrap();
        // Strictly increasing sequence numbers: order kept, nothing duplicated.
        assert!(got.windows(2).all(|w| w[0] < w[1]));
        // Every missing event, and every refused try of the end marker, was counted as dropped.
        let missing = u64::from(N) - got.len() as u64;
        assert_eq!(missing + marker_refusals, RING.dropped());
    }
}
