//! [`MemRecorder`]: the recorder over caller-provided memory, with its vCPU count and
//! capacity chosen at run time. This is the API the C ABI is built on.

use super::Mode;
use super::layout::{self, HEADER_SIZE, HeaderInfo, HeaderLayout, HeaderWords};
use super::ring::{Producer, RingHeader, RingRef};
use super::slot::{SLOT_SIZE, Slot};

/// Slots (32-byte units) of a header or a ring header.
const HEADER_SLOTS: usize = HEADER_SIZE / SLOT_SIZE;

/// Why caller-provided memory cannot hold a recorder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum LayoutError {
    /// The vCPU count is outside 1..=1024 or the capacity is not a power of two in
    /// 2..=2^31.
    BadShape,
    /// The memory is smaller than [`MemRecorder::storage_slots`] says it must be.
    TooSmall,
    /// The memory does not start on a 64-byte boundary.
    Misaligned,
}

/// A recorder in memory the caller provides: the same bytes as a
/// [`super::Recorder<VCPUS, CAP>`] with `VCPUS = vcpus` and `CAP = capacity`, and the same
/// ring code (both hand out [`RingRef`] views), with the shape chosen at run time.
///
/// The storage is a slice of [`Slot`]s (32-byte units of four atomic words). A C program
/// passes a 64-byte aligned buffer of [`MemRecorder::storage_bytes`] bytes, which the C ABI
/// views as `[Slot]` (an `unsafe` cast that lives there, not here).
#[derive(Clone, Copy, Debug)]
pub struct MemRecorder<'a> {
    header: &'a HeaderWords,
    rings: &'a [Slot],
    vcpus: usize,
    capacity: usize,
}

impl<'a> MemRecorder<'a> {
    /// How many slots `vcpus` rings of `capacity` records need, header included; `None` for
    /// a shape no header can describe.
    #[must_use]
    pub const fn storage_slots(vcpus: usize, capacity: usize) -> Option<usize> {
        if !layout::valid_shape(vcpus, capacity) {
            return None;
        }
        // At most 1024 * (4 + 2^31) + 4 slots: no overflow on a 64-bit target; checked
        // anyway for 32-bit ones.
        match (HEADER_SLOTS + capacity).checked_mul(vcpus) {
            Some(r) => r.checked_add(HEADER_SLOTS),
            None => None,
        }
    }

    /// [`MemRecorder::storage_slots`] in bytes.
    #[must_use]
    pub const fn storage_bytes(vcpus: usize, capacity: usize) -> Option<usize> {
        match Self::storage_slots(vcpus, capacity) {
            Some(s) => s.checked_mul(SLOT_SIZE),
            None => None,
        }
    }

    /// Lays out an empty recorder in `storage`: clears the header (so a reader sees no
    /// recorder until [`MemRecorder::publish`]), then every ring, empty, in `mode`, with no
    /// producer claimed. Slots past the recorder's size are left alone.
    ///
    /// Call it before any producer or consumer uses the storage (it resets them). The
    /// header is cleared first, so a host reading memory never sees a published header
    /// over half-reset rings.
    ///
    /// # Errors
    /// [`LayoutError`] when the shape is invalid or `storage` too small or misaligned.
    pub fn init(
        storage: &'a [Slot],
        vcpus: usize,
        capacity: usize,
        mode: Mode,
    ) -> Result<Self, LayoutError> {
        let r = Self::view(storage, vcpus, capacity)?;
        layout::unpublish(r.header);
        for v in 0..vcpus {
            if let Some(ring) = r.ring(v) {
                ring.reset(mode);
            }
        }
        Ok(r)
    }

    /// A view of a recorder that [`MemRecorder::init`] already laid out in `storage`
    /// (another handle to the same memory).
    ///
    /// # Errors
    /// As [`MemRecorder::init`].
    pub fn view(storage: &'a [Slot], vcpus: usize, capacity: usize) -> Result<Self, LayoutError> {
        let need = Self::storage_slots(vcpus, capacity).ok_or(LayoutError::BadShape)?;
        // The address is only inspected, never turned back into a pointer.
        if !(storage.as_ptr() as usize).is_multiple_of(64) {
            return Err(LayoutError::Misaligned);
        }
        let (Some(header), Some(rings)) =
            (storage.get(..HEADER_SLOTS), storage.get(HEADER_SLOTS..need))
        else {
            return Err(LayoutError::TooSmall);
        };
        let header = header.try_into().map_err(|_| LayoutError::TooSmall)?;
        Ok(Self {
            header,
            rings,
            vcpus,
            capacity,
        })
    }

    /// The number of rings.
    #[must_use]
    pub const fn vcpus(&self) -> usize {
        self.vcpus
    }

    /// Records per ring.
    #[must_use]
    pub const fn capacity(&self) -> usize {
        self.capacity
    }

    /// Copies the recorder's bytes (header, then every ring), word by word with atomic loads,
    /// into `out` as far as it goes, and returns how many it copied. A snapshot is what a
    /// reader outside the guest sees; words stored during the copy may or may not be in it.
    pub fn copy_bytes(&self, out: &mut [u8]) -> usize {
        let mut at = 0;
        layout::copy_slots(self.header, out, &mut at);
        for v in 0..self.vcpus {
            if let Some(r) = self.ring(v) {
                let (h, s) = r.parts();
                layout::copy_slots(h, out, &mut at);
                layout::copy_slots(s, out, &mut at);
            }
        }
        at
    }

    /// What the rings do when full.
    #[must_use]
    pub fn mode(&self) -> Mode {
        self.ring(0).map_or(Mode::StopWhenFull, |r| r.mode())
    }

    /// Writes the self-describing header, magic last (see [`super::Recorder::publish`]).
    pub fn publish(&self, info: &HeaderInfo) -> HeaderLayout {
        let h = HeaderLayout::new(info, self.vcpus, self.capacity, self.mode());
        layout::publish(self.header, &h);
        h
    }

    /// The header as it is now (all zero before [`MemRecorder::publish`]).
    #[must_use]
    pub fn header(&self) -> HeaderLayout {
        layout::read(self.header)
    }

    /// The ring of `vcpu`, if the recorder has one.
    #[inline]
    #[must_use]
    pub fn ring(&self, vcpu: usize) -> Option<RingRef<'a>> {
        if vcpu >= self.vcpus {
            return None;
        }
        let at = vcpu.checked_mul(HEADER_SLOTS + self.capacity)?;
        let header: &'a RingHeader = self.rings.get(at..at + HEADER_SLOTS)?.try_into().ok()?;
        let start = at + HEADER_SLOTS;
        let slots = self.rings.get(start..start + self.capacity)?;
        Some(RingRef::new(header, slots))
    }

    /// The producer handle of `vcpu`'s ring (see [`super::Recorder::producer`]).
    #[must_use]
    pub fn producer(&self, vcpu: usize) -> Option<Producer<'a>> {
        self.ring(vcpu)?.producer()
    }

    /// The beacon port the published header names (see [`super::Recorder::beacon_port`]).
    #[must_use]
    pub fn beacon_port(&self) -> Option<u16> {
        layout::beacon_port(self.header)
    }
}
