//! [`Recorder`]: the header and one ring per vCPU in static storage.

use super::Mode;
use super::layout::{self, HeaderInfo, HeaderLayout, HeaderWords};
use super::ring::{Producer, Ring, RingRef};

/// The recorder header's storage, on its own 64-byte aligned block.
#[derive(Debug)]
#[repr(C, align(64))]
pub(super) struct Header(pub(super) HeaderWords);

/// The header followed by one ring per vCPU: `VCPUS` rings of `CAP` records each, in static
/// storage (`docs/memory-layout.md` has the bytes). The header is zero until
/// [`Recorder::publish`] writes it.
#[derive(Debug)]
#[repr(C)]
pub struct Recorder<const VCPUS: usize, const CAP: usize> {
    header: Header,
    rings: [Ring<CAP>; VCPUS],
}

impl<const VCPUS: usize, const CAP: usize> Default for Recorder<VCPUS, CAP> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const VCPUS: usize, const CAP: usize> Recorder<VCPUS, CAP> {
    /// Checked when a recorder is built: a header can describe it.
    const VALID: () = assert!(
        layout::valid_shape(VCPUS, CAP),
        "a recorder has 1..=1024 vCPUs and a power-of-two capacity in 2..=2^31"
    );

    /// Empty stop-when-full rings, usable in a `static`.
    #[must_use]
    pub const fn new() -> Self {
        Self::with_mode(Mode::StopWhenFull)
    }

    /// Empty flight-recorder rings (each overwrites its oldest records), usable in a `static`.
    #[must_use]
    pub const fn new_flight() -> Self {
        Self::with_mode(Mode::Overwrite)
    }

    /// Empty rings in `mode` and an unpublished (all zero) header, usable in a `static`.
    #[must_use]
    pub const fn with_mode(mode: Mode) -> Self {
        let () = Self::VALID;
        Self {
            header: Header(layout::empty_header()),
            rings: match mode {
                Mode::StopWhenFull => [const { Ring::new() }; VCPUS],
                Mode::Overwrite => [const { Ring::new_flight() }; VCPUS],
            },
        }
    }

    /// Writes the self-describing header (magic last, with a release store), so that a
    /// reader of guest memory can find and trust the rings. Call it once at run time,
    /// before recording; calling it again with another nonce tells a reader that the guest
    /// restarted. Returns what it wrote, with the magic left zero ([`HeaderLayout::new`]).
    pub fn publish(&self, info: &HeaderInfo) -> HeaderLayout {
        let h = HeaderLayout::new(info, VCPUS, CAP, self.mode());
        layout::publish(&self.header.0, &h);
        h
    }

    /// The header as it is now (all zero before [`Recorder::publish`]).
    #[must_use]
    pub fn header(&self) -> HeaderLayout {
        layout::read(&self.header.0)
    }

    /// Copies the recorder's bytes (header, then every ring), word by word with atomic loads,
    /// into `out` as far as it goes, and returns how many it copied. A snapshot is what a
    /// reader outside the guest sees; words stored during the copy may or may not be in it.
    pub fn copy_bytes(&self, out: &mut [u8]) -> usize {
        let mut at = 0;
        layout::copy_slots(&self.header.0, out, &mut at);
        for v in 0..VCPUS {
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

    /// The producer handle of `vcpu`'s ring: `None` if the recorder has no ring for it or its
    /// handle is already out (so a wrong vCPU index cannot make two producers of one ring).
    #[must_use]
    pub fn producer(&self, vcpu: usize) -> Option<Producer<'_>> {
        self.ring(vcpu)?.producer()
    }

    /// The ring of `vcpu`, if the recorder has one: its [`RingRef`] methods record
    /// ([`RingRef::record`] is the unchecked path, where the caller guarantees that it runs on
    /// `vcpu`; prefer [`Recorder::producer`]) and consume.
    #[inline]
    #[must_use]
    pub fn ring(&self, vcpu: usize) -> Option<RingRef<'_>> {
        self.rings.get(vcpu).map(Ring::view)
    }

    /// All rings, by vCPU index.
    #[must_use]
    pub const fn rings(&self) -> &[Ring<CAP>; VCPUS] {
        &self.rings
    }

    /// The beacon port the published header names: `None` before [`Recorder::publish`] or
    /// when it names none. A vCPU's beacon is `ring(vcpu)?.beacon(tsc, ports, port)`.
    #[must_use]
    pub fn beacon_port(&self) -> Option<u16> {
        layout::beacon_port(&self.header.0)
    }
}

// The recorder's rings start right after the 128-byte header.
const _: () = {
    assert!(core::mem::offset_of!(Recorder<1, 2>, header) == 0);
    assert!(core::mem::offset_of!(Recorder<1, 2>, rings) == layout::HEADER_SIZE);
    assert!(
        core::mem::size_of::<Recorder<3, 8>>() == layout::HEADER_SIZE + 3 * layout::ring_stride(8)
    );
};
