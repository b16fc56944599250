//! What the agent's protocol loop drains: [`EventSource`] (one queue) and [`EventSources`]
//! (one queue per vCPU). Consumer-side operations only, by record index: a record's index is
//! its position in its ring's sequence, so a record the producer overwrote leaves a gap that
//! the consumer can name exactly.

use super::slot::ReadError;
use super::{Mode, Record, Recorder, Ring, RingRef};

/// One queue of records: a [`Ring`] (or a reference to one), or [`NoEvents`].
pub trait EventSource {
    /// The index of the oldest record not yet released.
    fn start(&self) -> u64;
    /// Records stored so far: the index the next one will get.
    fn end(&self) -> u64;
    /// Record `index`, left in place; never a half-overwritten one.
    ///
    /// # Errors
    /// [`ReadError`]: not stored yet, or gone.
    fn read(&self, index: u64) -> Result<Record, ReadError>;
    /// After `read(from)` found it overwritten: the index to read next; records skipped at or
    /// above `sent` (the end of what was ever handed on) count in [`EventSource::dropped`].
    fn skip(&self, from: u64, sent: u64) -> u64;
    /// Releases every record below `end`.
    fn release(&self, end: u64);
    /// Records waiting.
    fn waiting(&self) -> usize;
    /// Events lost in the guest so far (cumulative): refused by a full queue, or (for a queue
    /// that [overwrites](EventSource::overwrites)) overwritten before they were handed on.
    fn dropped(&self) -> u64;
    /// Whether the queue overwrites its oldest records when full (a flight recorder): its
    /// [`EventSource::dropped`] then counts only records it skipped, all below the index
    /// read next, so a gap in indices is that many overwritten records plus any lost later.
    fn overwrites(&self) -> bool;
    /// Whether this source records events at all (the agent advertises `Features::EVENTS`
    /// only then).
    fn present(&self) -> bool {
        true
    }
}

impl EventSource for RingRef<'_> {
    fn start(&self) -> u64 {
        RingRef::start(self)
    }
    fn end(&self) -> u64 {
        RingRef::end(self)
    }
    fn read(&self, index: u64) -> Result<Record, ReadError> {
        RingRef::read(self, index)
    }
    fn skip(&self, from: u64, sent: u64) -> u64 {
        RingRef::skip(self, from, sent)
    }
    fn release(&self, end: u64) {
        RingRef::release(self, end);
    }
    fn waiting(&self) -> usize {
        self.len()
    }
    fn dropped(&self) -> u64 {
        RingRef::dropped(self)
    }
    fn overwrites(&self) -> bool {
        self.mode() == Mode::Overwrite
    }
}

/// A [`Ring`] is the queue its view is.
impl<const CAP: usize> EventSource for Ring<CAP> {
    fn start(&self) -> u64 {
        self.view().start()
    }
    fn end(&self) -> u64 {
        self.view().end()
    }
    fn read(&self, index: u64) -> Result<Record, ReadError> {
        self.view().read(index)
    }
    fn skip(&self, from: u64, sent: u64) -> u64 {
        self.view().skip(from, sent)
    }
    fn release(&self, end: u64) {
        self.view().release(end);
    }
    fn waiting(&self) -> usize {
        self.view().len()
    }
    fn dropped(&self) -> u64 {
        self.view().dropped()
    }
    fn overwrites(&self) -> bool {
        self.view().mode() == Mode::Overwrite
    }
}

impl<S: EventSource + ?Sized> EventSource for &S {
    fn start(&self) -> u64 {
        (**self).start()
    }
    fn end(&self) -> u64 {
        (**self).end()
    }
    fn read(&self, index: u64) -> Result<Record, ReadError> {
        (**self).read(index)
    }
    fn skip(&self, from: u64, sent: u64) -> u64 {
        (**self).skip(from, sent)
    }
    fn release(&self, end: u64) {
        (**self).release(end);
    }
    fn waiting(&self) -> usize {
        (**self).waiting()
    }
    fn dropped(&self) -> u64 {
        (**self).dropped()
    }
    fn overwrites(&self) -> bool {
        (**self).overwrites()
    }
    fn present(&self) -> bool {
        (**self).present()
    }
}

/// An agent without events: nothing is ever waiting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoEvents;

impl EventSource for NoEvents {
    fn start(&self) -> u64 {
        0
    }
    fn end(&self) -> u64 {
        0
    }
    fn read(&self, _: u64) -> Result<Record, ReadError> {
        Err(ReadError::NotYet)
    }
    fn skip(&self, from: u64, _: u64) -> u64 {
        from
    }
    fn release(&self, _: u64) {}
    fn waiting(&self) -> usize {
        0
    }
    fn dropped(&self) -> u64 {
        0
    }
    fn overwrites(&self) -> bool {
        false
    }
    fn present(&self) -> bool {
        false
    }
}

/// The most vCPU queues one [`EventSources`] may have: the protocol names vCPUs 0–63 in its
/// vCPU list (docs/smp.md), and the agent keeps a fixed array per queue.
pub const MAX_EVENT_SOURCES: usize = 64;

/// What the agent drains: one queue per vCPU (a [`Recorder`]), or a single queue of its own
/// vCPU (any [`EventSource`]). Queue `q` holds the events of vCPU
/// [`EventSources::queue_vcpu`]`(q)`; each queue is consumed on its own, with the
/// [`EventSource`] operations of the same names.
pub trait EventSources {
    /// How many queues (at most [`MAX_EVENT_SOURCES`] are served).
    fn queues(&self) -> usize;
    /// The vCPU (APIC id) whose events queue `q` holds; `None`: the agent's own vCPU.
    fn queue_vcpu(&self, q: usize) -> Option<u32>;
    /// [`EventSource::start`] of queue `q`.
    fn start_in(&self, q: usize) -> u64;
    /// [`EventSource::end`] of queue `q`.
    fn end_in(&self, q: usize) -> u64;
    /// [`EventSource::read`] of queue `q`.
    ///
    /// # Errors
    /// [`ReadError`]; [`ReadError::NotYet`] for a queue that does not exist.
    fn read_in(&self, q: usize, index: u64) -> Result<Record, ReadError>;
    /// [`EventSource::skip`] of queue `q`.
    fn skip_in(&self, q: usize, from: u64, sent: u64) -> u64;
    /// [`EventSource::release`] of queue `q`.
    fn release_in(&self, q: usize, end: u64);
    /// [`EventSource::waiting`] of queue `q`.
    fn waiting_in(&self, q: usize) -> usize;
    /// [`EventSource::dropped`] of queue `q`.
    fn dropped_in(&self, q: usize) -> u64;
    /// [`EventSource::overwrites`] of queue `q`.
    fn overwrites_in(&self, q: usize) -> bool;
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
    fn start_in(&self, q: usize) -> u64 {
        if q == 0 { self.start() } else { 0 }
    }
    fn end_in(&self, q: usize) -> u64 {
        if q == 0 { self.end() } else { 0 }
    }
    fn read_in(&self, q: usize, index: u64) -> Result<Record, ReadError> {
        if q == 0 {
            self.read(index)
        } else {
            Err(ReadError::NotYet)
        }
    }
    fn skip_in(&self, q: usize, from: u64, sent: u64) -> u64 {
        if q == 0 { self.skip(from, sent) } else { from }
    }
    fn release_in(&self, q: usize, end: u64) {
        if q == 0 {
            self.release(end);
        }
    }
    fn waiting_in(&self, q: usize) -> usize {
        if q == 0 { self.waiting() } else { 0 }
    }
    fn dropped_in(&self, q: usize) -> u64 {
        if q == 0 { self.dropped() } else { 0 }
    }
    fn overwrites_in(&self, q: usize) -> bool {
        q == 0 && self.overwrites()
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
    fn start_in(&self, q: usize) -> u64 {
        self.ring(q).map_or(0, |r| r.start())
    }
    fn end_in(&self, q: usize) -> u64 {
        self.ring(q).map_or(0, |r| r.end())
    }
    fn read_in(&self, q: usize, index: u64) -> Result<Record, ReadError> {
        self.ring(q)
            .map_or(Err(ReadError::NotYet), |r| r.read(index))
    }
    fn skip_in(&self, q: usize, from: u64, sent: u64) -> u64 {
        self.ring(q).map_or(from, |r| r.skip(from, sent))
    }
    fn release_in(&self, q: usize, end: u64) {
        if let Some(r) = self.ring(q) {
            r.release(end);
        }
    }
    fn waiting_in(&self, q: usize) -> usize {
        self.ring(q).map_or(0, |r| r.len())
    }
    fn dropped_in(&self, q: usize) -> u64 {
        self.ring(q).map_or(0, |r| r.dropped())
    }
    fn overwrites_in(&self, q: usize) -> bool {
        self.ring(q).is_some_and(|r| r.mode() == Mode::Overwrite)
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
    fn start_in(&self, q: usize) -> u64 {
        (**self).start_in(q)
    }
    fn end_in(&self, q: usize) -> u64 {
        (**self).end_in(q)
    }
    fn read_in(&self, q: usize, index: u64) -> Result<Record, ReadError> {
        (**self).read_in(q, index)
    }
    fn skip_in(&self, q: usize, from: u64, sent: u64) -> u64 {
        (**self).skip_in(q, from, sent)
    }
    fn release_in(&self, q: usize, end: u64) {
        (**self).release_in(q, end);
    }
    fn waiting_in(&self, q: usize) -> usize {
        (**self).waiting_in(q)
    }
    fn dropped_in(&self, q: usize) -> u64 {
        (**self).dropped_in(q)
    }
    fn overwrites_in(&self, q: usize) -> bool {
        (**self).overwrites_in(q)
    }
    fn records_events(&self) -> bool {
        true
    }
}
