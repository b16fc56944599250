//! Span records: named phases, function entries and exits, and relocations, stored under
//! vmtsync's reserved event ids, and [`decode`], their one decoder (the host's).
//!
//! Payloads (`docs/memory-layout.md`, "Reserved event ids"; the C recorder writes the same
//! bytes):
//! - [`SPAN_BEGIN_ID`], [`SPAN_END_ID`]: the span's name, 1..=16 bytes, no terminator. A longer
//!   name is cut at byte 16, as the C recorder cuts it, which may split a UTF-8 character:
//!   [`SpanName::as_str`] gives the valid prefix.
//! - [`FUNC_ENTRY_ID`], [`FUNC_EXIT_ID`]: the function's address, then the call site, each 4
//!   bytes (32-bit code, [`u32`]) or 8 bytes (64-bit code, [`u64`]), little-endian.
//! - [`RELOC_ID`]: link start (6 bytes), runtime start (6 bytes), length (4 bytes), all
//!   little-endian; the two addresses are sign-extended from bit 47 (canonical x86-64
//!   addresses; 32-bit ones are positive).
//!
//! These records bypass the refusal of reserved ids that [`RingRef::record`] applies, and are
//! otherwise ordinary records: a full stop-when-full ring refuses (and counts) them, a flight
//! ring overwrites its oldest.

use super::layout::{FUNC_ENTRY_ID, FUNC_EXIT_ID, RELOC_ID, SPAN_BEGIN_ID, SPAN_END_ID};
use super::ring::RingRef;
use super::{MAX_PAYLOAD, RecordError};
use crate::arch::Tsc;

/// The longest span name in bytes: one record's payload.
pub const MAX_NAME: usize = MAX_PAYLOAD;

/// An address width a function record carries: [`u32`] for 32-bit code (8-byte payload),
/// [`u64`] for 64-bit code (16-byte payload). Sealed: there are exactly these two.
pub trait FuncAddr: Copy + sealed::Sealed {
    /// Bytes of one address in the payload.
    const BYTES: usize;
    /// The address, zero-extended.
    fn to_u64(self) -> u64;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for u32 {}
    impl Sealed for u64 {}
}

impl FuncAddr for u32 {
    const BYTES: usize = 4;
    fn to_u64(self) -> u64 {
        u64::from(self)
    }
}

impl FuncAddr for u64 {
    const BYTES: usize = 8;
    fn to_u64(self) -> u64 {
        self
    }
}

/// A span's name as recorded: 1..=16 bytes (unused bytes zero, so equal names compare and
/// hash equal).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpanName {
    bytes: [u8; MAX_NAME],
    len: u8,
}

impl SpanName {
    /// The name of `bytes`, 1..=16 of them; `None` otherwise.
    #[must_use]
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.is_empty() {
            return None;
        }
        let mut b = [0u8; MAX_NAME];
        b.get_mut(..bytes.len())?.copy_from_slice(bytes);
        // At most 16: `get_mut` checked it.
        #[allow(clippy::cast_possible_truncation)]
        let len = bytes.len() as u8;
        Some(Self { bytes: b, len })
    }

    /// The name a recorder stores for `name`: its first 16 bytes; `None` when it is empty.
    #[must_use]
    pub fn truncated(name: &str) -> Option<Self> {
        let b = name.as_bytes();
        Self::from_bytes(b.get(..MAX_NAME).unwrap_or(b))
    }

    /// The recorded bytes.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        self.bytes
            .get(..usize::from(self.len))
            .unwrap_or(&self.bytes[..])
    }

    /// The longest valid UTF-8 prefix of the bytes (all of them for a name the recorder did
    /// not have to cut inside a character, or that a guest did not garble).
    #[must_use]
    pub fn as_str(&self) -> &str {
        let b = self.as_bytes();
        match core::str::from_utf8(b) {
            Ok(s) => s,
            Err(e) => b
                .get(..e.valid_up_to())
                .and_then(|p| core::str::from_utf8(p).ok())
                .unwrap_or(""),
        }
    }
}

impl core::fmt::Debug for SpanName {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

/// One span record, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanRecord {
    /// A named phase began ([`SPAN_BEGIN_ID`]).
    Begin {
        /// The phase's name.
        name: SpanName,
    },
    /// A named phase ended ([`SPAN_END_ID`]).
    End {
        /// The phase's name, as its begin gave it.
        name: SpanName,
    },
    /// A function was entered ([`FUNC_ENTRY_ID`]).
    Entry {
        /// The function's address (as the code runs: undo a [`SpanRecord::Reloc`] before
        /// looking it up in the image's symbols).
        func: u64,
        /// The call site's address.
        site: u64,
    },
    /// A function returned ([`FUNC_EXIT_ID`]).
    Exit {
        /// The function's address.
        func: u64,
        /// The call site's address.
        site: u64,
    },
    /// Code linked at `[link, link + len)` runs at `[runtime, runtime + len)` from this
    /// record on ([`RELOC_ID`]). Both addresses are sign-extended from bit 47.
    Reloc {
        /// Where the image's symbols put the code.
        link: u64,
        /// Where it runs.
        runtime: u64,
        /// The moved range's length in bytes.
        len: u32,
    },
}

/// Decodes a record's id and payload as a span record: `None` for any other id, and for a
/// payload whose length that id does not allow (a name of 0 or more than 16 bytes, a function
/// record of other than 8 or 16 bytes, a relocation of other than 16).
#[must_use]
pub fn decode(id: u16, payload: &[u8]) -> Option<SpanRecord> {
    match id {
        SPAN_BEGIN_ID => Some(SpanRecord::Begin {
            name: SpanName::from_bytes(payload)?,
        }),
        SPAN_END_ID => Some(SpanRecord::End {
            name: SpanName::from_bytes(payload)?,
        }),
        FUNC_ENTRY_ID | FUNC_EXIT_ID => {
            let half = match payload.len() {
                8 => 4,
                16 => 8,
                _ => return None,
            };
            let func = le(payload.get(..half)?);
            let site = le(payload.get(half..)?);
            Some(if id == FUNC_ENTRY_ID {
                SpanRecord::Entry { func, site }
            } else {
                SpanRecord::Exit { func, site }
            })
        }
        RELOC_ID => {
            if payload.len() != 16 {
                return None;
            }
            let len = le(payload.get(12..16)?);
            Some(SpanRecord::Reloc {
                link: sign_extend_48(le(payload.get(..6)?)),
                runtime: sign_extend_48(le(payload.get(6..12)?)),
                // Four bytes: fits.
                #[allow(clippy::cast_possible_truncation)]
                len: len as u32,
            })
        }
        _ => None,
    }
}

/// Up to 8 little-endian bytes, zero-extended.
fn le(b: &[u8]) -> u64 {
    b.iter().rev().fold(0u64, |v, &x| (v << 8) | u64::from(x))
}

/// The low 48 bits of `v`, sign-extended from bit 47.
fn sign_extend_48(v: u64) -> u64 {
    // Reinterpreting as signed is the point: the arithmetic shift copies bit 47 upwards.
    #[allow(clippy::cast_possible_wrap, clippy::cast_sign_loss)]
    let r = (((v << 16) as i64) >> 16) as u64;
    r
}

/// A function record's payload: `func` then `site`, each `A::BYTES` wide.
fn func_payload<A: FuncAddr>(func: A, site: A) -> ([u8; MAX_PAYLOAD], usize) {
    let mut b = [0u8; MAX_PAYLOAD];
    let (f, s) = (func.to_u64().to_le_bytes(), site.to_u64().to_le_bytes());
    let n = A::BYTES;
    if let (Some(d), Some(src)) = (b.get_mut(..n), f.get(..n)) {
        d.copy_from_slice(src);
    }
    if let (Some(d), Some(src)) = (b.get_mut(n..2 * n), s.get(..n)) {
        d.copy_from_slice(src);
    }
    (b, 2 * n)
}

/// A relocation's payload; `None` when an address is not a sign-extended 48-bit value (the
/// record could not say it).
fn reloc_payload(link: u64, runtime: u64, len: u32) -> Option<[u8; MAX_PAYLOAD]> {
    if sign_extend_48(link) != link || sign_extend_48(runtime) != runtime {
        return None;
    }
    let mut b = [0u8; MAX_PAYLOAD];
    b.get_mut(..6)?
        .copy_from_slice(link.to_le_bytes().get(..6)?);
    b.get_mut(6..12)?
        .copy_from_slice(runtime.to_le_bytes().get(..6)?);
    b.get_mut(12..16)?.copy_from_slice(&len.to_le_bytes());
    Some(b)
}

impl RingRef<'_> {
    /// Records that the phase `name` began ([`SPAN_BEGIN_ID`]; the name's first 16 bytes).
    ///
    /// # Errors
    /// [`RecordError::BadSpan`] for an empty name (nothing stored or counted), or
    /// [`RecordError::Full`] as for any record.
    pub fn span_begin<T: Tsc + ?Sized>(&self, tsc: &T, name: &str) -> Result<(), RecordError> {
        let name = SpanName::truncated(name).ok_or(RecordError::BadSpan)?;
        self.store(tsc, SPAN_BEGIN_ID, name.as_bytes())
    }

    /// Records that the phase `name` ended ([`SPAN_END_ID`]).
    ///
    /// # Errors
    /// As [`RingRef::span_begin`].
    pub fn span_end<T: Tsc + ?Sized>(&self, tsc: &T, name: &str) -> Result<(), RecordError> {
        let name = SpanName::truncated(name).ok_or(RecordError::BadSpan)?;
        self.store(tsc, SPAN_END_ID, name.as_bytes())
    }

    /// Records the entry into the function at `func`, called from `site` ([`FUNC_ENTRY_ID`]):
    /// pass [`u32`]s from 32-bit code, [`u64`]s from 64-bit code.
    ///
    /// # Errors
    /// [`RecordError::Full`] as for any record.
    #[inline]
    pub fn func_entry<T: Tsc + ?Sized, A: FuncAddr>(
        &self,
        tsc: &T,
        func: A,
        site: A,
    ) -> Result<(), RecordError> {
        let (b, n) = func_payload(func, site);
        self.store(tsc, FUNC_ENTRY_ID, b.get(..n).unwrap_or(&b))
    }

    /// Records the return from the function at `func` to `site` ([`FUNC_EXIT_ID`]).
    ///
    /// # Errors
    /// As [`RingRef::func_entry`].
    #[inline]
    pub fn func_exit<T: Tsc + ?Sized, A: FuncAddr>(
        &self,
        tsc: &T,
        func: A,
        site: A,
    ) -> Result<(), RecordError> {
        let (b, n) = func_payload(func, site);
        self.store(tsc, FUNC_EXIT_ID, b.get(..n).unwrap_or(&b))
    }

    /// Records that code linked at `[link_start, link_start + len)` runs at
    /// `[runtime_start, runtime_start + len)` from now on ([`RELOC_ID`]).
    ///
    /// # Errors
    /// [`RecordError::BadSpan`] when an address is not a sign-extended 48-bit value (nothing
    /// stored or counted), or [`RecordError::Full`] as for any record.
    pub fn reloc<T: Tsc + ?Sized>(
        &self,
        tsc: &T,
        link_start: u64,
        runtime_start: u64,
        len: u32,
    ) -> Result<(), RecordError> {
        let b = reloc_payload(link_start, runtime_start, len).ok_or(RecordError::BadSpan)?;
        self.store(tsc, RELOC_ID, &b)
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::format;
    use std::vec::Vec;

    use super::*;
    use crate::arch::FakeTsc;
    use crate::recorder::{BEACON_ID, MemRecorder, Mode, Record, Recorder, Ring};

    fn drain(ring: &RingRef<'_>) -> Vec<Record> {
        core::iter::from_fn(|| ring.pop()).collect()
    }

    fn name(s: &str) -> SpanName {
        SpanName::truncated(s).unwrap()
    }

    /// Each method stores its reserved id with the wire format's payload, and the decoder
    /// gives back what was recorded.
    #[test]
    fn every_span_record_round_trips_through_the_ring_and_the_decoder() {
        let ring = Ring::<16>::new();
        let ring = ring.view();
        let tsc = FakeTsc::new(1, 1);
        ring.span_begin(&tsc, "post").unwrap();
        ring.func_entry(&tsc, 0x000f_1234u32, 0x000f_0010u32)
            .unwrap();
        ring.func_exit(&tsc, 0x000f_1234u32, 0x000f_0010u32)
            .unwrap();
        ring.func_entry(&tsc, 0xffff_ffff_8100_0000u64, 0x1234u64)
            .unwrap();
        ring.reloc(&tsc, 0x000f_0000, 0x07fb_0000, 0x1_2345)
            .unwrap();
        ring.span_end(&tsc, "post").unwrap();
        let recs = drain(&ring);
        let raw: Vec<(u16, Vec<u8>)> = recs.iter().map(|r| (r.id, r.payload().to_vec())).collect();
        let mut func32 = 0x000f_1234u32.to_le_bytes().to_vec();
        func32.extend_from_slice(&0x000f_0010u32.to_le_bytes());
        let mut func64 = 0xffff_ffff_8100_0000u64.to_le_bytes().to_vec();
        func64.extend_from_slice(&0x1234u64.to_le_bytes());
        let reloc = [
            0x00, 0x00, 0x0f, 0, 0, 0, 0x00, 0x00, 0xfb, 0x07, 0, 0, 0x45, 0x23, 0x01, 0,
        ];
        assert_eq!(
            raw,
            [
                (SPAN_BEGIN_ID, b"post".to_vec()),
                (FUNC_ENTRY_ID, func32.clone()),
                (FUNC_EXIT_ID, func32),
                (FUNC_ENTRY_ID, func64),
                (RELOC_ID, reloc.to_vec()),
                (SPAN_END_ID, b"post".to_vec()),
            ]
        );
        let decoded: Vec<SpanRecord> = recs
            .iter()
            .map(|r| decode(r.id, r.payload()).unwrap())
            .collect();
        assert_eq!(
            decoded,
            [
                SpanRecord::Begin { name: name("post") },
                SpanRecord::Entry {
                    func: 0xf_1234,
                    site: 0xf_0010
                },
                SpanRecord::Exit {
                    func: 0xf_1234,
                    site: 0xf_0010
                },
                SpanRecord::Entry {
                    func: 0xffff_ffff_8100_0000,
                    site: 0x1234
                },
                SpanRecord::Reloc {
                    link: 0xf_0000,
                    runtime: 0x7fb_0000,
                    len: 0x1_2345
                },
                SpanRecord::End { name: name("post") },
            ]
        );
    }

    /// Bit 47 of a relocation's addresses is copied upwards: a kernel address comes back
    /// canonical, a low one positive. An address that is not canonical cannot be recorded.
    #[test]
    fn relocation_addresses_are_sign_extended_from_bit_47() {
        let mut p = [0u8; 16];
        p[..6].copy_from_slice(&[0x00, 0x00, 0x00, 0x81, 0xff, 0xff]);
        p[6..12].copy_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]);
        p[12..].copy_from_slice(&7u32.to_le_bytes());
        assert_eq!(
            decode(RELOC_ID, &p),
            Some(SpanRecord::Reloc {
                link: 0xffff_ffff_8100_0000,
                runtime: 0x0000_7fff_ffff_ffff,
                len: 7
            })
        );
        let ring = Ring::<4>::new();
        let ring = ring.view();
        let tsc = FakeTsc::new(1, 1);
        for bad in [
            0x0000_8000_0000_0000u64,
            0x8000_0000_0000_0000,
            0xfff0_0000_0000_0000,
        ] {
            assert_eq!(ring.reloc(&tsc, bad, 0, 1), Err(RecordError::BadSpan));
            assert_eq!(ring.reloc(&tsc, 0, bad, 1), Err(RecordError::BadSpan));
        }
        assert_eq!(
            (ring.end(), ring.refused()),
            (0, 0),
            "nothing stored or counted"
        );
        ring.reloc(&tsc, 0xffff_8000_0000_0000, 0x7fff_ffff_ffff, u32::MAX)
            .unwrap();
        let r = ring.pop().unwrap();
        assert_eq!(
            decode(r.id, r.payload()),
            Some(SpanRecord::Reloc {
                link: 0xffff_8000_0000_0000,
                runtime: 0x7fff_ffff_ffff,
                len: u32::MAX
            })
        );
    }

    /// A length the id does not allow, or an id that is not a span record's, decodes to
    /// nothing.
    #[test]
    fn bad_lengths_and_other_ids_decode_to_none() {
        let p = [0x41u8; 17];
        for id in [SPAN_BEGIN_ID, SPAN_END_ID] {
            assert_eq!(decode(id, &[]), None);
            assert_eq!(decode(id, &p), None);
            assert!(decode(id, &p[..16]).is_some());
            assert!(decode(id, &p[..1]).is_some());
        }
        for id in [FUNC_ENTRY_ID, FUNC_EXIT_ID] {
            for n in (0..=17).filter(|n| *n != 8 && *n != 16) {
                assert_eq!(decode(id, &p[..n]), None, "function record of {n} bytes");
            }
        }
        for n in (0..=17).filter(|n| *n != 16) {
            assert_eq!(decode(RELOC_ID, &p[..n]), None, "relocation of {n} bytes");
        }
        for id in [0, 1, 0xFF00, 0xFF06, BEACON_ID] {
            assert_eq!(decode(id, &p[..8]), None);
        }
    }

    /// Names: cut at byte 16 like the C recorder; an empty one is refused; a cut inside a
    /// character shows its valid prefix.
    #[test]
    fn names_are_cut_at_16_bytes_and_empty_ones_refused() {
        let ring = Ring::<4>::new();
        let ring = ring.view();
        let tsc = FakeTsc::new(1, 1);
        assert_eq!(ring.span_begin(&tsc, ""), Err(RecordError::BadSpan));
        assert_eq!(ring.span_end(&tsc, ""), Err(RecordError::BadSpan));
        ring.span_begin(&tsc, "a_phase_name_longer_than_16")
            .unwrap();
        // 15 ASCII bytes, then a 2-byte character split by the cut.
        ring.span_end(&tsc, "abcdefghijklmnoé").unwrap();
        let r = drain(&ring);
        assert_eq!(r[0].payload(), b"a_phase_name_lon");
        assert_eq!(r[1].payload().len(), 16);
        let Some(SpanRecord::End { name }) = decode(r[1].id, r[1].payload()) else {
            panic!("not an end: {:?}", r[1]);
        };
        assert_eq!(name.as_str(), "abcdefghijklmno");
        assert_eq!(format!("{name:?}"), "\"abcdefghijklmno\"");
    }

    /// Span records are ordinary records in every other respect: a full stop-when-full ring
    /// refuses and counts them, a flight ring overwrites its oldest, and `record` still refuses
    /// their ids.
    #[test]
    fn span_records_are_refused_or_overwritten_like_any_record() {
        let tsc = FakeTsc::new(1, 1);
        let ring = Ring::<2>::new();
        let ring = ring.view();
        for _ in 0..2 {
            ring.func_entry(&tsc, 1u32, 2u32).unwrap();
        }
        assert_eq!(ring.func_exit(&tsc, 1u32, 2u32), Err(RecordError::Full));
        assert_eq!(ring.span_begin(&tsc, "x"), Err(RecordError::Full));
        assert_eq!(ring.reloc(&tsc, 1, 2, 3), Err(RecordError::Full));
        assert_eq!((ring.end(), ring.refused()), (2, 3));
        for id in [SPAN_BEGIN_ID, FUNC_ENTRY_ID, RELOC_ID] {
            assert_eq!(ring.record(&tsc, id, &[1]), Err(RecordError::ReservedId));
        }

        let flight = Ring::<2>::new_flight();
        let flight = flight.view();
        assert_eq!(flight.mode(), Mode::Overwrite);
        for i in 0..5u64 {
            flight.func_entry(&tsc, i, i).unwrap();
        }
        let kept: Vec<Option<SpanRecord>> = drain(&flight)
            .iter()
            .map(|r| decode(r.id, r.payload()))
            .collect();
        assert_eq!(
            kept,
            [
                Some(SpanRecord::Entry { func: 3, site: 3 }),
                Some(SpanRecord::Entry { func: 4, site: 4 })
            ]
        );
        assert_eq!(flight.overwritten(), 3);
    }

    /// The recorders' rings record spans on the named vCPU's ring, and name no ring for a
    /// missing vCPU; a producer records on its ring.
    #[test]
    fn recorders_and_producers_record_spans_on_the_named_ring() {
        static R: Recorder<2, 8> = Recorder::new();
        let tsc = FakeTsc::new(1, 1);
        assert!(R.ring(2).is_none(), "no ring 2");
        R.ring(1).unwrap().span_begin(&tsc, "x").unwrap();
        R.ring(1).unwrap().func_entry(&tsc, 1u32, 2u32).unwrap();
        R.ring(1).unwrap().func_exit(&tsc, 1u32, 2u32).unwrap();
        R.ring(1).unwrap().reloc(&tsc, 1, 2, 3).unwrap();
        R.ring(1).unwrap().span_end(&tsc, "x").unwrap();
        assert_eq!((R.ring(0).unwrap().len(), R.ring(1).unwrap().len()), (0, 5));
        let p = R.producer(0).unwrap();
        p.span_begin(&tsc, "y").unwrap();
        p.func_entry(&tsc, 5u64, 6u64).unwrap();
        drop(p);
        let ids: Vec<u16> = drain(&R.ring(0).unwrap()).iter().map(|r| r.id).collect();
        assert_eq!(ids, [SPAN_BEGIN_ID, FUNC_ENTRY_ID]);

        let (storage, skip) = crate::recorder::tests::aligned_storage(1, 4);
        let m = MemRecorder::init(&storage[skip..], 1, 4, Mode::StopWhenFull).unwrap();
        assert!(m.ring(1).is_none(), "no ring 1");
        m.ring(0).unwrap().span_begin(&tsc, "m").unwrap();
        m.ring(0).unwrap().func_entry(&tsc, 1u32, 2u32).unwrap();
        m.ring(0).unwrap().func_exit(&tsc, 1u32, 2u32).unwrap();
        m.ring(0).unwrap().reloc(&tsc, 1, 2, 3).unwrap();
        assert_eq!(
            m.ring(0).unwrap().span_end(&tsc, "m"),
            Err(RecordError::Full)
        );
        assert_eq!(m.ring(0).map(|r| (r.end(), r.refused())), Some((4, 1)));
    }
}
