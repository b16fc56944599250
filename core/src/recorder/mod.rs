//! The event recorder a unikernel links: one lock-free single-producer ring per vCPU in
//! `const`-constructible static storage, stop-when-full or a flight recorder.
//!
//! ```
//! use vmtsync_core::arch::FakeTsc;
//! use vmtsync_core::recorder::Recorder;
//!
//! // Two vCPUs, 1024 records each: 2 × 1024 × 32 bytes of static storage, no heap.
//! static RECORDER: Recorder<2, 1024> = Recorder::new();
//! // A flight recorder instead keeps the newest 1024 records of each vCPU.
//! static FLIGHT: Recorder<2, 1024> = Recorder::new_flight();
//!
//! let tsc = FakeTsc::new(1_000, 10);
//! // vCPU 1 claims its ring's one producer handle once, and records through it.
//! let p = RECORDER.producer(1).unwrap();
//! assert!(RECORDER.producer(1).is_none(), "a second producer of ring 1 is refused");
//! assert!(p.record(&tsc, 7, &42u32.to_le_bytes()).is_ok());
//! // The consumer (the agent's protocol loop) drains it.
//! let r = RECORDER.ring(1).unwrap().pop().unwrap();
//! assert_eq!((r.id, r.payload()), (7, &42u32.to_le_bytes()[..]));
//!
//! let f = FLIGHT.producer(0).unwrap();
//! for i in 0..3000u32 {
//!     f.record(&tsc, 1, &i.to_le_bytes()).unwrap(); // never full
//! }
//! let ring = FLIGHT.ring(0).unwrap();
//! let r = ring.pop().unwrap();
//! assert_eq!(r.payload(), &(3000u32 - 1024).to_le_bytes()[..]);
//! assert_eq!(ring.overwritten(), 3000 - 1024);
//! ```
//!
//! # Contract
//! - **One producer per ring.** Each vCPU records only into its own ring. A [`Producer`]
//!   (from [`Recorder::producer`] or [`RingRef::producer`]) enforces it: a ring hands out one
//!   handle at a time, the handle cannot be cloned and is not `Sync`, and a vCPU index
//!   without a ring gives `None`. [`RingRef::record`] (on [`Ring::view`] or
//!   [`Recorder::ring`]) is the unchecked path for code that keeps the rule itself.
//! - **Interrupt handlers.** A handler that interrupts a producer on the same vCPU must not
//!   record through that producer's ring: give handlers a ring of their own (for example a
//!   second `Recorder` with one ring per vCPU, whose handles the handlers claim), or mask
//!   interrupts around the interrupted code's `record` (about 20 ns). Breaking the rule can
//!   garble or lose records but never causes undefined behaviour or a panic: every slot is
//!   made of atomics, and this module has no `unsafe`.
//! - **One consumer per ring**: the agent's protocol loop, which drains every ring of a
//!   [`Recorder`] through [`EventSources`] (each batch names its vCPU).
//! - Recording never blocks, never allocates and never panics.
//!   - **Stop when full** ([`Recorder::new`], [`Ring::new`], the default): a full ring
//!     refuses the event, counts it in [`RingRef::refused`] (exactly: one per refused event) and
//!     returns [`RecordError::Full`]. The host sees the oldest records.
//!   - **Flight recorder** ([`Recorder::new_flight`], [`Ring::new_flight`]; ftrace's and
//!     LTTng's default): a full ring overwrites its oldest record, so a host that attaches
//!     late sees the recent past. The consumer counts, exactly, every record overwritten
//!     before it handed it on ([`RingRef::overwritten`]), and never returns a record the
//!     producer overwrote while it was being read.
//! - Every stored record has an index: its position in its ring's sequence (0, 1, …). Records
//!   come out of a ring in index order; each carries the TSC read inside `record` (ordered:
//!   `lfence; rdtsc`, see [`crate::arch::Tsc`]), so a ring's timestamps are non-decreasing as
//!   long as the TSC is. An overwritten record leaves a gap in the indices the consumer sees.
//!
//! # How it works
//! A ring is a bounded single-producer single-consumer queue (Lamport's) whose slots are
//! seqlocks. The producer owns `head`, the consumer owns `tail`, both free-running `u64`
//! record counts (slot = index mod `CAP`, a power of two). The producer writes a slot under
//! its commit stamp (`slot.rs` has the byte layout and the protocol) and publishes it by
//! storing `head` with `Release`. A stop-when-full producer first loads `tail` (`Acquire`)
//! and refuses when `head - tail` is `CAP`; an overwriting producer never looks at `tail`.
//! The consumer reads a record by index, checking the slot's stamp before and after the read
//! and `head` after it, so a record overwritten meanwhile is reported as such
//! ([`ReadError::Overwritten`]); [`RingRef::skip`] then moves past every record lost with it and
//! counts them. Releasing (`tail`, `Release`) hands slots back to a stop-when-full producer.
//!
//! The ring is `repr(C)`: the producer's words (`head`, `refused`, the mode byte, the
//! beacon count) on the first 64-byte line, the consumer's (`tail`, `overwritten`) on the
//! second, then `CAP` 32-byte slots. A reader that only reads (a host reading guest memory)
//! can find each record's index and completeness in its slot alone.
//!
//! # In guest memory
//! A [`Recorder`] is a self-describing block: a 128-byte header, zero in the image and
//! written at run time by [`Recorder::publish`] (magic last, with a release store), then
//! the rings. The byte layout, publication, the reading rule for a host that only reads, and
//! beacons ([`RingRef::beacon`], records with id [`BEACON_ID`]) and span records ([`span`]:
//! phases, function entries and exits, relocations) are described in
//! `docs/memory-layout.md`, so that other languages can produce and read it.
//! [`MemRecorder`] is the same layout in memory the caller provides, with its vCPU count and
//! capacity chosen at run time (the API under the C ABI). Both hand out [`RingRef`], the one
//! implementation of the ring.

mod layout;
mod mem;
mod ring;
mod slot;
mod source;
pub mod span;
mod vcpus;

pub use layout::{
    BEACON_ID, ClockKind, FUNC_ENTRY_ID, FUNC_EXIT_ID, HEADER_SIZE, HeaderField, HeaderInfo,
    HeaderLayout, LAYOUT_VERSION, MAGIC, MAX_CAPACITY, MAX_VCPUS, MIN_CAPACITY, RELOC_ID,
    RESERVED_ID_MIN, RING_HEADER_SIZE, RingLayout, SPAN_BEGIN_ID, SPAN_END_ID, checksum,
    ring_stride,
};
pub use mem::{LayoutError, MemRecorder};
pub use ring::{Producer, Ring, RingRef};
pub use slot::{BUSY, ReadError, SLOT_SIZE, STAMP_BITS, STAMP_SHIFT, Slot, committed, holds};
pub use source::{EventSource, EventSources, MAX_EVENT_SOURCES, NoEvents};
pub use vcpus::Recorder;

use crate::units::GuestTicks;

/// The largest payload one record carries, in bytes.
pub const MAX_PAYLOAD: usize = 16;

/// What a ring does when an event finds it full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[repr(u8)]
pub enum Mode {
    /// Refuse the new event and count it (the default; byte 0 in the ring).
    StopWhenFull = 0,
    /// Overwrite the oldest record: a flight recorder (byte 1 in the ring).
    Overwrite = 1,
}

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

/// Why an event was not stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum RecordError {
    /// The stop-when-full ring is full; the event was counted in [`RingRef::refused`].
    Full,
    /// The payload is longer than [`MAX_PAYLOAD`]; nothing was stored or counted.
    PayloadTooLong,
    /// A vCPU the recorder has no ring for ([`Recorder::ring`] gives `None`; the C ABI's
    /// per-vCPU calls return this); nothing was counted.
    NoSuchVcpu,
    /// A beacon was asked for but the published header names no beacon port (or the
    /// header is not published: [`Recorder::beacon_port`] gives `None`); nothing was done.
    NoBeaconPort,
    /// The event id is vmtsync's own ([`RESERVED_ID_MIN`] and above; a beacon's record
    /// carries [`BEACON_ID`]); nothing was stored or counted.
    ReservedId,
    /// A span record that cannot be said: an empty span name, or a relocation address that
    /// is not a sign-extended 48-bit value ([`span`]); nothing was stored or counted.
    BadSpan,
}

#[cfg(test)]
mod tests;
