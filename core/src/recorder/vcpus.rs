//! [`Recorder`]: one ring per vCPU in static storage.

use super::ring::{Producer, Ring};
use super::{Mode, RecordError};
use crate::arch::Tsc;

/// One ring per vCPU: `VCPUS` rings of `CAP` records each, in static storage.
#[derive(Debug)]
#[repr(C)]
pub struct Recorder<const VCPUS: usize, const CAP: usize> {
    rings: [Ring<CAP>; VCPUS],
}

impl<const VCPUS: usize, const CAP: usize> Default for Recorder<VCPUS, CAP> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const VCPUS: usize, const CAP: usize> Recorder<VCPUS, CAP> {
    /// Empty stop-when-full rings, usable in a `static`.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            rings: [const { Ring::new() }; VCPUS],
        }
    }

    /// Empty flight-recorder rings (each overwrites its oldest records), usable in a `static`.
    #[must_use]
    pub const fn new_flight() -> Self {
        Self {
            rings: [const { Ring::new_flight() }; VCPUS],
        }
    }

    /// Empty rings in `mode`, usable in a `static`.
    #[must_use]
    pub const fn with_mode(mode: Mode) -> Self {
        match mode {
            Mode::StopWhenFull => Self::new(),
            Mode::Overwrite => Self::new_flight(),
        }
    }

    /// The producer handle of `vcpu`'s ring: `None` if the recorder has no ring for it or its
    /// handle is already out (so a wrong vCPU index cannot make two producers of one ring).
    #[must_use]
    pub fn producer(&self, vcpu: usize) -> Option<Producer<'_, CAP>> {
        self.ring(vcpu)?.producer()
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

    /// Records event `id` on `vcpu`'s ring (see [`Ring::record`]): the unchecked path, where
    /// the caller guarantees that it runs on `vcpu` (prefer [`Recorder::producer`]).
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
