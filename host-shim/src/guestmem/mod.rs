//! Reading a guest's recorder straight out of the VMM's memory (issue 16's host side).
//!
//! The guest's recorder storage is one block: a 128-byte header, then one ring per vCPU
//! (layout version 1, documented in `docs/memory-layout.md`). The host finds the header in the VMM
//! process's address space ([`find()`]), then drains the rings while the guest keeps
//! recording ([`Drainer`]). It never writes guest memory, and it treats every byte it reads
//! as hostile: every number is range-checked before it sizes a read, a round reads a
//! bounded number of records, and a header that changes under the reader ends draining with
//! a typed error that carries the exact counts so far.
//!
//! Layers:
//! - [`memory`]: the [`GuestMemory`] trait, a live process ([`ProcMemory`]: `process_vm_readv`,
//!   falling back to `/proc/PID/mem`) and a fake that can rewrite itself between (and inside)
//!   reads ([`FakeMemory`]).
//! - [`layout`]: the header's bytes and their checked parse ([`Header::parse`]).
//! - [`find`](mod@find): the scan of writable mappings (skipping pages the page map calls
//!   absent), a named host address, or a guest-physical address.
//! - [`elf`]: an ELF symbol's guest-physical address.
//! - [`drain`]: the reading rule and the counts ([`RingCounts`]).
//!
//! The header's fields, their offsets and the rules a valid header keeps are in
//! `docs/memory-layout.md` ("Header"); core's `HeaderLayout::FIELDS` is the one table, and
//! tests check that page and the C header against it.

pub mod drain;
pub mod elf;
pub mod find;
pub mod layout;
pub mod memory;

pub use drain::{
    DEFAULT_MAX_PER_ROUND, DrainError, Drainer, GuestRecord, PollSummary, RingCounts, RoundRing,
};
pub use elf::{
    ElfError, pointer_guest_physical_in, symbol_guest_physical, symbol_guest_physical_in,
};
pub use find::{FindError, Found, Location, Rejected, ScanStats, find, scan};
pub use layout::{BEACON_ID, ClockKind, Header, HeaderError, Mode};
pub use memory::{FakeMemory, GuestMemory, MemError, ProcMemory, ReadMethod, Region};

#[cfg(test)]
mod proc_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod torn_tests;
