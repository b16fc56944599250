//! The one message enum of the probe protocol, its payloads, and the TSC unwrap helper.
//!
//! Every message is a variant of [`Message`]. postcard encodes the variant index as a varint,
//! so all tags here are one byte. **Tags are part of the wire format**: a variant is never
//! renumbered within a [`PROTOCOL_VERSION`], and [`Message::Hello`] / [`Message::Capabilities`]
//! keep tags 0 and 1 in every version, so two peers of different versions can always decode
//! each other's hello and see the mismatch instead of misreading later messages.
//!
//! Integers are postcard varints (7 bits per byte) unless a field says "fixed": the probe
//! replies carry the TSC as fixed little-endian bytes, placed last, so the agent can encode
//! everything else before it reads the TSC (see [`super::ProbeReplyFrame`]). Sequence numbers
//! are `u8`, which postcard writes as one raw byte.

use postcard::experimental::max_size::MaxSize;
use serde::{Deserialize, Serialize};

use crate::mapping::KvmTscMapping;
use crate::units::GuestTicks;

/// The protocol version this crate speaks, sent in [`Hello`] and [`Capabilities`].
///
/// Bump it whenever any encoding below (or the framing) changes; peers with different versions
/// stop after the hello exchange. Version 2 added the frame checksum and one-byte sequence
/// numbers; version 3 the compact [`EventRecord`] (no payload length byte for an event
/// without a payload); version 4 [`EventBatch::overwrite`] (flight-recorder rings, whose
/// `first` indices skip the records they overwrote).
pub const PROTOCOL_VERSION: u16 = 4;

/// The most event records one [`EventBatch`] carries.
///
/// 64 records of at most 30 bytes each keep the largest message (and so every frame buffer)
/// under 2 KiB, while a batch of small events costs a few bytes per event: the per-frame
/// overhead (tag, counters, base timestamp, COBS, delimiter) is shared by 64 records.
pub const EVENT_BATCH_MAX: usize = 64;

/// The largest payload of one event record, in bytes (the recorder's
/// [`crate::recorder::MAX_PAYLOAD`]).
pub const EVENT_PAYLOAD_MAX: usize = crate::recorder::MAX_PAYLOAD;

/// The protocol messages. The doc line of each variant says who sends it and what the peer does.
///
/// [`Message::Events`] makes the enum about 2 KiB; there is no heap to box it in, and a message
/// only ever lives on the stack for one decode or encode, so the size is accepted.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, MaxSize)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Message {
    /// Host → guest, tag 0: opens a session. The agent answers with [`Message::Capabilities`].
    Hello(Hello),
    /// Guest → host, tag 1: the agent's version, transport, features and a full-width TSC
    /// reading that seeds the host's [`try_unwrap_tsc_low32`] reference.
    Capabilities(Capabilities),
    /// Host → guest, tag 2: the common probe. The agent answers with [`Message::ProbeReply`]
    /// carrying the low 32 bits of its TSC, read as late as possible before the send.
    Probe {
        /// Sequence number echoed in the reply, so late replies can be matched or dropped.
        /// One fixed byte: the session wraps it (why 8 bits suffice: `docs/wire-integrity.md`).
        seq: u8,
    },
    /// Guest → host, tag 3: the compact answer to [`Message::Probe`].
    ProbeReply(ProbeReply),
    /// Host → guest, tag 4: a probe asking for the full 64-bit TSC, used when the host has no
    /// unwrap reference within 2^31 ticks. Answered with [`Message::ProbeReplyFull`].
    ProbeFull {
        /// Sequence number echoed in the reply (one fixed byte, like [`Message::Probe`]'s).
        seq: u8,
    },
    /// Guest → host, tag 5: the full-width answer to [`Message::ProbeFull`].
    ProbeReplyFull(ProbeReplyFull),
    /// Host → guest, tag 6: the KVM mapping host→guest of one vCPU, so the agent can stamp its
    /// events in the host's clock. Answered with [`Message::MappingApplied`] or an error.
    SetMapping(MappingPush),
    /// Guest → host, tag 7: the mapping pushed for this vCPU is now in use.
    MappingApplied {
        /// The vCPU whose mapping was applied.
        vcpu: u32,
    },
    /// Host → guest, tag 8: asks for a pvclock snapshot. Answered with
    /// [`Message::PvclockReport`], or [`ErrorCode::Unsupported`] without a pvclock page.
    PvclockRequest,
    /// Guest → host, tag 9: the vCPU's pvclock page and the TSC read inside the same seqlock
    /// section.
    PvclockReport(PvclockReport),
    /// Host → guest, tag 10: asks for queued event records. Answered with one or more
    /// [`Message::Events`] batches (of at most [`EVENT_BATCH_MAX`] records each), the last one
    /// flagged [`EventBatch::last`]; one empty batch when nothing is queued.
    EventsRequest {
        /// The most records the host wants in this answer, over all its batches.
        max: u32,
    },
    /// Guest → host, tag 11: a batch of event records for the trace pipeline.
    Events(EventBatch),
    /// Host → guest, tag 12: end of session. The agent answers [`Message::Exiting`] and stops.
    Shutdown,
    /// Guest → host, tag 13: the agent acknowledges [`Message::Shutdown`]; nothing follows.
    Exiting,
    /// Either direction, tag 14: the last request (or the bytes received) could not be served.
    Error(ErrorCode),
    /// Host → guest, tag 15: a probe answered on vCPU `vcpu`, which reads its own TSC after
    /// the request arrived and before the reply leaves ([`Features::SMP`]; `docs/smp.md`).
    /// Answered with [`Message::ProbeReply`] (or [`Message::ProbeReplyFull`] when `full`)
    /// naming that vCPU, or [`ErrorCode::UnknownVcpu`] when it cannot answer.
    ProbeOn {
        /// Sequence number echoed in the reply (one fixed byte, like [`Message::Probe`]'s).
        seq: u8,
        /// The vCPU whose TSC is wanted.
        vcpu: u32,
        /// Whether the reply carries the full 64-bit TSC.
        full: bool,
    },
    /// Host → guest, tag 16: which vCPUs answer [`Message::ProbeOn`]. Answered with
    /// [`Message::Vcpus`].
    VcpusRequest,
    /// Guest → host, tag 17: the vCPUs that answer [`Message::ProbeOn`].
    Vcpus {
        /// Bit `i` set: vCPU `i` (the APIC id KVM names `vcpuN` after) answers. vCPUs from 64 up
        /// cannot be named here.
        online: u64,
    },
}

/// Payload of [`Message::Hello`]: what the host speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, MaxSize)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Hello {
    /// The host's [`PROTOCOL_VERSION`]. The agent serves only an equal version.
    pub version: u16,
    /// Features the host can use; the session uses the intersection with the agent's.
    pub features: Features,
}

/// Payload of [`Message::Capabilities`]: what the agent is and can do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, MaxSize)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Capabilities {
    /// The agent's [`PROTOCOL_VERSION`]. If it differs from the hello's, the agent serves no
    /// further requests until a hello with its version arrives.
    pub version: u16,
    /// The transport the agent talks over.
    pub transport: Transport,
    /// Features the agent supports.
    pub features: Features,
    /// The vCPU the agent runs on (the one whose TSC it reads).
    pub vcpu: u32,
    /// The full 64-bit guest TSC read while answering the hello: the first unwrap reference.
    pub tsc: GuestTicks,
    /// The guest TSC frequency in kHz if the agent knows it (CPUID leaf 0x15/0x40000010 or
    /// pvclock), else `None`.
    pub tsc_khz: Option<u32>,
}

/// Payload of [`Message::ProbeReply`]: the compact probe answer.
///
/// Field order is the wire order; the TSC bytes come last so the agent can encode the rest
/// before reading the TSC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, MaxSize)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct ProbeReply {
    /// The request's sequence number.
    pub seq: u8,
    /// The vCPU whose TSC was read.
    pub vcpu: u32,
    /// Low 32 bits of the guest TSC, fixed 4 bytes little-endian. The host recovers the full
    /// value with [`try_unwrap_tsc_low32`].
    #[serde(with = "postcard::fixint::le")]
    pub tsc_low32: u32,
}

/// Payload of [`Message::ProbeReplyFull`]: the full-width probe answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, MaxSize)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct ProbeReplyFull {
    /// The request's sequence number.
    pub seq: u8,
    /// The vCPU whose TSC was read.
    pub vcpu: u32,
    /// The guest TSC, fixed 8 bytes little-endian (fixed so the agent's late-read path is the
    /// same as for [`ProbeReply`]).
    #[serde(with = "postcard::fixint::le")]
    pub tsc: u64,
}

impl ProbeReplyFull {
    /// The TSC as a unit-carrying value.
    #[must_use]
    pub const fn guest_tsc(&self) -> GuestTicks {
        GuestTicks(self.tsc)
    }
}

/// Payload of [`Message::SetMapping`]: KVM's per-vCPU relation
/// `guest = offset + ((host * ratio) >> frac_bits)` (128-bit product), as the host read it
/// from debugfs or computed it.
///
/// On the wire: `vcpu`, then the mapping's `offset` (zigzag varint), `ratio` and `frac_bits`
/// (varints). [`KvmTscMapping`]'s own decoder rejects `ratio == 0` and `frac_bits > 63`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, MaxSize)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct MappingPush {
    /// The vCPU the mapping belongs to.
    pub vcpu: u32,
    /// The host→guest TSC mapping of that vCPU.
    pub mapping: KvmTscMapping,
}

/// Payload of [`Message::PvclockReport`]: the fields of `struct pvclock_vcpu_time_info`
/// (arch/x86/include/asm/pvclock-abi.h) from one consistent seqlock read, plus the TSC read
/// inside that read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, MaxSize)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PvclockReport {
    /// The vCPU whose pvclock page this is.
    pub vcpu: u32,
    /// Seqlock version (even: a consistent read).
    pub version: u32,
    /// `tsc_timestamp`: guest TSC at the last kvmclock update.
    pub tsc_timestamp: u64,
    /// `system_time`: kvmclock ns at `tsc_timestamp`.
    pub system_time: u64,
    /// `tsc_to_system_mul` (32.32 fixed point).
    pub mul: u32,
    /// `tsc_shift`.
    pub shift: i8,
    /// `flags` (bit 0 TSC_STABLE, bit 1 GUEST_STOPPED).
    pub flags: u8,
    /// The guest TSC read between the two version reads.
    pub tsc: GuestTicks,
}

/// One guest event for the trace pipeline, as it travels in an [`EventBatch`].
///
/// Its wire form (since protocol version 3) is not postcard's derived struct encoding but
/// three parts, so that an event without a payload spends no byte on a payload length:
///
/// 1. `delta`, a zigzag varint (1 byte below 64 ticks, 2 below 8192, 3 below 2^20);
/// 2. a header varint `id << 1 | has_payload` (1 byte for ids below 64, 2 below 8192, 3 above);
/// 3. only when `has_payload` is 1: the payload as postcard writes a byte sequence, its length
///    (1 to [`EVENT_PAYLOAD_MAX`], one byte) then the bytes.
///
/// So a payload-less event with a small id costs 3 bytes at a million events per second on a
/// 2.6 GHz TSC (2600 ticks apart). The decoder accepts exactly this, canonically: a header
/// whose id does not fit a `u16`, or that announces a payload of length 0 or above
/// [`EVENT_PAYLOAD_MAX`], is [`crate::proto::DecodeError::InvalidValue`]. The layout is
/// described with the batch in `docs/wire-integrity.md`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct EventRecord {
    /// This record's timestamp minus the previous record's in the batch (the first record's:
    /// minus [`EventBatch::base`]), a zigzag varint, so a clock that steps back is carried
    /// as it is and the host decides what to do with it.
    pub delta: i64,
    /// Application-defined event id.
    pub id: u16,
    /// The payload (up to [`EVENT_PAYLOAD_MAX`] bytes).
    pub payload: heapless::Vec<u8, EVENT_PAYLOAD_MAX>,
}

/// The payload of one [`EventRecord`] as it is held and sent.
type EventPayload = heapless::Vec<u8, EVENT_PAYLOAD_MAX>;

impl Serialize for EventRecord {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let has_payload = !self.payload.is_empty();
        // postcard writes a tuple as its elements back to back; the element count only
        // matters to self-describing formats, which never see this type.
        let mut t = s.serialize_tuple(2 + usize::from(has_payload))?;
        t.serialize_element(&self.delta)?;
        t.serialize_element(&(u32::from(self.id) << 1 | u32::from(has_payload)))?;
        if has_payload {
            t.serialize_element(&self.payload)?;
        }
        t.end()
    }
}

impl<'de> Deserialize<'de> for EventRecord {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Record;
        impl<'de> serde::de::Visitor<'de> for Record {
            type Value = EventRecord;

            fn expecting(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                f.write_str("an event record (delta, header, optional payload)")
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<EventRecord, A::Error> {
                use serde::de::Error;
                let missing = || A::Error::invalid_length(0, &Record);
                let delta: i64 = seq.next_element()?.ok_or_else(missing)?;
                let header: u32 = seq.next_element()?.ok_or_else(missing)?;
                let invalid = || A::Error::custom("event record header");
                let id = u16::try_from(header >> 1).map_err(|_| invalid())?;
                let payload = if header & 1 == 1 {
                    // heapless refuses more than EVENT_PAYLOAD_MAX bytes; an announced but
                    // empty payload is refused here, so every record has one encoding.
                    let p: EventPayload = seq.next_element()?.ok_or_else(missing)?;
                    if p.is_empty() {
                        return Err(invalid());
                    }
                    p
                } else {
                    EventPayload::new()
                };
                Ok(EventRecord { delta, id, payload })
            }
        }
        d.deserialize_tuple(3, Record)
    }
}

impl MaxSize for EventRecord {
    /// The delta's varint, the header's (at most 3 bytes: `id << 1 | 1 < 2^17`), and the
    /// payload with its length.
    const POSTCARD_MAX_SIZE: usize = i64::POSTCARD_MAX_SIZE + 3 + EventPayload::POSTCARD_MAX_SIZE;
}

/// The clock a batch's timestamps are in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, MaxSize)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum EventClock {
    /// Raw guest TSC: the agent had no mapping, or a conversion did not fit.
    Guest,
    /// Host TSC, converted by the agent with the pushed mapping, rounded up (ceil).
    Host,
}

/// Payload of [`Message::Events`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, MaxSize)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct EventBatch {
    /// The vCPU whose ring these events come from.
    pub vcpu: u32,
    /// Events that vCPU's ring lost in the guest so far (cumulative): with `overwrite`
    /// clear, events it refused because it was full (they have no index); with `overwrite`
    /// set, records it overwrote before the agent sent them, every one with an index below
    /// `first`.
    pub dropped: u64,
    /// The ring overwrites its oldest records (a flight recorder), so a gap in `first` is
    /// records it overwrote (the growth of `dropped`) plus records lost in transit. Clear: a
    /// stop-when-full ring, whose every stored record is sent, so a gap is only transit loss.
    pub overwrite: bool,
    /// The index of the first record in this vCPU's ring (how many records the ring stored
    /// before it): the host sees a gap, a batch it never got, or a replay, exactly, per vCPU.
    pub first: u64,
    /// Records still queued after this batch (every vCPU's).
    pub remaining: u32,
    /// The last batch of the answer to one [`Message::EventsRequest`].
    pub last: bool,
    /// The clock of `base` and of every record's timestamp.
    pub clock: EventClock,
    /// The timestamp the first record's delta is taken against.
    pub base: u64,
    /// The records, oldest first.
    pub records: heapless::Vec<EventRecord, EVENT_BATCH_MAX>,
}

impl EventBatch {
    /// An empty batch whose deltas start at `base`.
    #[must_use]
    pub const fn new(vcpu: u32, clock: EventClock, base: u64) -> Self {
        Self {
            vcpu,
            dropped: 0,
            overwrite: false,
            first: 0,
            remaining: 0,
            last: false,
            clock,
            base,
            records: heapless::Vec::new(),
        }
    }

    /// Appends a record stamped `timestamp`; `false` if the batch is full or the delta from
    /// the previous timestamp (`prev`, or `base` for the first) does not fit an `i64`.
    pub fn push(&mut self, prev: u64, timestamp: u64, id: u16, payload: &[u8]) -> bool {
        let Ok(delta) = i64::try_from(i128::from(timestamp) - i128::from(prev)) else {
            return false;
        };
        let Ok(payload) = heapless::Vec::from_slice(payload) else {
            return false;
        };
        self.records
            .push(EventRecord { delta, id, payload })
            .is_ok()
    }

    /// The records with their absolute timestamps, oldest first. A record whose timestamp
    /// would leave `u64` yields `None` (and so does every record after it).
    pub fn timestamped(&self) -> impl Iterator<Item = Option<(u64, &EventRecord)>> + '_ {
        let mut at = Some(self.base);
        self.records.iter().map(move |r| {
            at = at.and_then(|t| t.checked_add_signed(r.delta));
            at.map(|t| (t, r))
        })
    }
}

/// The transport an agent talks over (informational, for logs and sync files).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, MaxSize)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Transport {
    /// A 16550 UART (port I/O).
    Uart16550,
    /// virtio-vsock.
    VirtioVsock,
    /// An in-memory link (tests, simulation, shared-memory rings).
    Memory,
    /// Anything else.
    Other,
}

/// Feature bits exchanged in [`Hello`] and [`Capabilities`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, MaxSize)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[serde(transparent)]
pub struct Features(pub u32);

impl Features {
    /// No features.
    pub const NONE: Self = Self(0);
    /// The agent can answer [`Message::PvclockRequest`].
    pub const PVCLOCK: Self = Self(1 << 0);
    /// The agent records events and answers [`Message::EventsRequest`].
    pub const EVENTS: Self = Self(1 << 1);
    /// The agent applies [`Message::SetMapping`] and stamps events in the host clock.
    pub const MAPPING: Self = Self(1 << 2);
    /// The guest's TSC is invariant (CPUID 0x8000_0007 EDX bit 8).
    pub const INVARIANT_TSC: Self = Self(1 << 3);
    /// The agent brackets the TSC read of every probe reply with port I/O on its sync port: an
    /// `in` right before the read and an `out` of the probe's sequence number right after, so
    /// the host's `kvm:kvm_pio` stamps bracket the read on any transport (the host's docs:
    /// `docs/anchor.md`).
    pub const SYNC_PORT: Self = Self(1 << 4);
    /// The agent answers [`Message::VcpusRequest`] and [`Message::ProbeOn`] for more than
    /// the vCPU it runs on.
    pub const SMP: Self = Self(1 << 5);

    /// Whether every bit of `other` is set in `self`.
    #[must_use]
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// The bits set in either.
    #[must_use]
    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// The bits set in both (what a session can use).
    #[must_use]
    pub const fn intersection(self, other: Self) -> Self {
        Self(self.0 & other.0)
    }
}

/// Why a request was refused; carried by [`Message::Error`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, MaxSize)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum ErrorCode {
    /// A frame failed COBS or postcard decoding, or held invalid values.
    Malformed,
    /// A frame was longer than the largest message; it was dropped up to the next delimiter.
    FrameTooLong,
    /// A request arrived before a hello with a matching version.
    NotReady,
    /// The hello's protocol version differs from the agent's.
    VersionMismatch,
    /// The request needs a feature the agent lacks (e.g. no pvclock page).
    Unsupported,
    /// The message is one the receiver never accepts (e.g. a guest→host message sent to the
    /// guest).
    Unexpected,
    /// The message names a vCPU the receiver does not serve.
    UnknownVcpu,
    /// The pushed mapping cannot be used (e.g. it maps no guest time back to host time).
    InvalidMapping,
}

/// Recovers a full guest TSC from its low 32 bits and a reference reading.
///
/// Returns the unique value `v` with `v mod 2^32 == low32` and
/// `reference - 2^31 <= v < reference + 2^31`, or `None` if that `v` is outside `u64`.
/// The result is correct whenever the true TSC lies in that window, i.e. while the reference
/// is within 2^31 ticks (about 0.7 s at 3 GHz) of it. The host's reference is its best
/// estimate of the guest TSC at the probe: the last full reading it knows (the hello's
/// [`Capabilities::tsc`], a [`ProbeReplyFull`], or a previously unwrapped reply) plus the host
/// ticks elapsed since, scaled by the mapping. If no such estimate is that close, ask with
/// [`Message::ProbeFull`] instead.
#[must_use]
pub fn try_unwrap_tsc_low32(reference: GuestTicks, low32: u32) -> Option<GuestTicks> {
    // The low 32 bits of the reference: truncation is the point.
    #[allow(clippy::cast_possible_truncation)]
    let ref_low = reference.0 as u32;
    // Signed distance from the reference modulo 2^32, in [-2^31, 2^31).
    let delta = low32.wrapping_sub(ref_low).cast_signed();
    reference
        .0
        .checked_add_signed(i64::from(delta))
        .map(GuestTicks)
}

/// Recovers a full guest TSC from its low 32 bits and a window `[lo, hi]` (inclusive) known to
/// contain the true value.
///
/// Returns the value `v` in `[lo, hi]` with `v mod 2^32 == low32` when exactly one exists
/// (always so for a window of at most 2^32 values, `hi - lo < 2^32`, that holds the truth);
/// `None` when two or more exist (the low bits cannot say which), when `lo > hi`, or when none
/// does (the window's premise was wrong). Unlike [`try_unwrap_tsc_low32`], which trusts a point
/// estimate to be within 2^31 of the truth, this never picks between candidates: a host that
/// knows only that the guest TSC lies in its window cannot be handed a value off by 2^32.
#[must_use]
pub fn try_unwrap_tsc_low32_in(lo: GuestTicks, hi: GuestTicks, low32: u32) -> Option<GuestTicks> {
    if lo > hi {
        return None;
    }
    // The low 32 bits of `lo`: truncation is the point.
    #[allow(clippy::cast_possible_truncation)]
    let lo_low = lo.0 as u32;
    // The first value at or after `lo` with the wanted low bits, and the next one.
    let v = lo.0.checked_add(u64::from(low32.wrapping_sub(lo_low)))?;
    let unique = v.checked_add(1 << 32).is_none_or(|next| next > hi.0);
    (v <= hi.0 && unique).then_some(GuestTicks(v))
}

#[cfg(test)]
mod unwrap_in_tests {
    use super::*;
    use proptest::prelude::*;

    /// The naive answer: every `k * 2^32 + low32` near the window, kept if inside; unique or
    /// nothing.
    fn naive(lo: u64, hi: u64, low32: u32) -> Option<GuestTicks> {
        if lo > hi {
            return None;
        }
        // More high words than the loop below looks at means more than one candidate.
        if (hi >> 32) - (lo >> 32) >= 4 {
            return None;
        }
        let mut found = None;
        for k in (lo >> 32)..=(hi >> 32) {
            let v = (u128::from(k) << 32) + u128::from(low32);
            if (u128::from(lo)..=u128::from(hi)).contains(&v) {
                if found.is_some() {
                    return None;
                }
                found = Some(GuestTicks(u64::try_from(v).unwrap()));
            }
        }
        found
    }

    #[test]
    fn edges() {
        let m = u64::from(u32::MAX);
        // Exactly 2^32 values: every residue once.
        assert_eq!(
            try_unwrap_tsc_low32_in(GuestTicks(10), GuestTicks(10 + m), 9),
            Some(GuestTicks((1 << 32) + 9))
        );
        // One more value: residue 10 appears twice, every other residue still once.
        assert_eq!(
            try_unwrap_tsc_low32_in(GuestTicks(10), GuestTicks(11 + m), 10),
            None
        );
        assert_eq!(
            try_unwrap_tsc_low32_in(GuestTicks(10), GuestTicks(11 + m), 12),
            Some(GuestTicks(12))
        );
        // Empty and inverted windows.
        assert_eq!(
            try_unwrap_tsc_low32_in(GuestTicks(5), GuestTicks(4), 5),
            None
        );
        // No candidate inside a narrow window.
        assert_eq!(
            try_unwrap_tsc_low32_in(GuestTicks(100), GuestTicks(200), 300),
            None
        );
        // Near u64::MAX: the candidate would overflow.
        assert_eq!(
            try_unwrap_tsc_low32_in(GuestTicks(u64::MAX - 5), GuestTicks(u64::MAX), 0),
            None
        );
        assert_eq!(
            try_unwrap_tsc_low32_in(GuestTicks(u64::MAX - 5), GuestTicks(u64::MAX), u32::MAX),
            Some(GuestTicks(u64::MAX))
        );
    }

    proptest! {
        /// Any window and low word: equal to the naive enumeration.
        #[test]
        fn matches_naive(lo in any::<u64>(), width in 0u64..(3 << 32), low32 in any::<u32>()) {
            let hi = lo.saturating_add(width);
            prop_assert_eq!(
                try_unwrap_tsc_low32_in(GuestTicks(lo), GuestTicks(hi), low32),
                naive(lo, hi, low32)
            );
        }

        /// Whenever the window holds the truth and at most 2^32 values, the truth comes back.
        #[test]
        fn recovers_the_truth(truth in any::<u64>(), below in 0u64..(1 << 32), above in 0u64..(1 << 32)) {
            let lo = truth.saturating_sub(below);
            let hi = truth.saturating_add(above);
            #[allow(clippy::cast_possible_truncation)]
            let got = try_unwrap_tsc_low32_in(GuestTicks(lo), GuestTicks(hi), truth as u32);
            if hi - lo <= u64::from(u32::MAX) {
                prop_assert_eq!(got, Some(GuestTicks(truth)));
            } else {
                // Wider: unresolved, or resolved to the truth, never to another value.
                prop_assert!(got.is_none_or(|g| g.0 == truth));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn low(v: u64) -> u32 {
        u32::try_from(v & 0xffff_ffff).unwrap()
    }

    #[test]
    fn unwrap_same_and_small_steps() {
        let r = GuestTicks(0x2000_1234_5678);
        assert_eq!(try_unwrap_tsc_low32(r, low(r.0)), Some(r));
        assert_eq!(
            try_unwrap_tsc_low32(r, low(r.0 + 1000)),
            Some(GuestTicks(r.0 + 1000))
        );
        assert_eq!(
            try_unwrap_tsc_low32(r, low(r.0 - 1000)),
            Some(GuestTicks(r.0 - 1000))
        );
    }

    #[test]
    fn unwrap_across_low_word_wrap() {
        // Forward across a 2^32 boundary: the low word wraps to a small number.
        let r = GuestTicks(0x1f_ffff_fff0);
        assert_eq!(
            try_unwrap_tsc_low32(r, 0x20),
            Some(GuestTicks(0x20_0000_0020))
        );
        // Backward across it: the reference is just past the boundary.
        let r = GuestTicks(0x20_0000_0010);
        assert_eq!(
            try_unwrap_tsc_low32(r, 0xffff_fff0),
            Some(GuestTicks(0x1f_ffff_fff0))
        );
    }

    #[test]
    fn unwrap_window_edges() {
        let r = GuestTicks(1 << 45);
        let fwd = r.0 + (1 << 31) - 1;
        assert_eq!(try_unwrap_tsc_low32(r, low(fwd)), Some(GuestTicks(fwd)));
        let back = r.0 - (1 << 31);
        assert_eq!(try_unwrap_tsc_low32(r, low(back)), Some(GuestTicks(back)));
        // Exactly 2^31 ahead is outside the window: it aliases to 2^31 behind.
        let too_far = r.0 + (1 << 31);
        assert_eq!(
            try_unwrap_tsc_low32(r, low(too_far)),
            Some(GuestTicks(too_far - (1 << 32)))
        );
    }

    #[test]
    fn unwrap_out_of_u64_is_none() {
        // Near zero, a "backward" low word would need a negative TSC.
        assert_eq!(try_unwrap_tsc_low32(GuestTicks(5), 0xffff_ff00), None);
        // Near u64::MAX, a "forward" one would overflow.
        assert_eq!(try_unwrap_tsc_low32(GuestTicks(u64::MAX - 5), 0x10), None);
        assert_eq!(
            try_unwrap_tsc_low32(GuestTicks(u64::MAX), u32::MAX),
            Some(GuestTicks(u64::MAX))
        );
    }

    #[test]
    fn features_set_ops() {
        let f = Features::PVCLOCK.union(Features::EVENTS);
        assert!(f.contains(Features::PVCLOCK));
        assert!(!f.contains(Features::MAPPING));
        assert_eq!(
            f.intersection(Features::EVENTS.union(Features::MAPPING)),
            Features::EVENTS
        );
    }

    proptest! {
        /// Against a u128/i128 reference: any true value within [-2^31, 2^31) of the reference
        /// is recovered exactly; outside u64 gives None.
        #[test]
        fn unwrap_matches_reference(r in any::<u64>(), d in -(1i64 << 31)..(1i64 << 31)) {
            let truth = i128::from(r) + i128::from(d);
            let lo = u32::try_from(truth.rem_euclid(1 << 32)).unwrap();
            let got = try_unwrap_tsc_low32(GuestTicks(r), lo);
            if (0..=i128::from(u64::MAX)).contains(&truth) {
                prop_assert_eq!(got, Some(GuestTicks(u64::try_from(truth).unwrap())));
            } else {
                prop_assert_eq!(got, None);
            }
        }
    }
}
