//! The probe protocol: one versioned message enum, postcard + checksum + COBS framing.
//!
//! Layers:
//! - [`message`]: [`Message`] and its payloads; who sends what, and the TSC unwrap helper.
//! - [`frame`]: encoding, the checksums, the one checked decode path for untrusted bytes, the
//!   stream receiver, and [`ProbeReplyFrame`], which lets the agent encode a reply before it
//!   reads the TSC.
//!
//! # Size of a probe
//!
//! A probe round trip is the host's [`Message::Probe`] and the guest's [`Message::ProbeReply`],
//! each ending in a checksum and COBS-framed with a `0x00` delimiter. For any sequence number
//! and any TSC (vCPU below 128) that is:
//!
//! | message | body | COBS | delimiter | wire |
//! |---|---|---|---|---|
//! | `Probe { seq }` | tag 1 + seq 1 + CRC-8 1 | +1 | +1 | 5 B |
//! | `ProbeReply` | tag 1 + seq 1 + vcpu 1 + TSC low word 4 + CRC-16 2 | +1 | +1 | 11 B |
//!
//! **16 bytes per probe round trip** (pinned by a test), against ≈ 96.7 B per probe for
//! trace-cmd's PTP plugin (36 B each way plus its share of the 8 KiB result message;
//! docs/trace-cmd.md). The reply carries only the low 32 bits of the guest
//! TSC: a full TSC takes 8 bytes and pushes the round trip to 21 B ([`Message::ProbeFull`]).
//! The host recovers the full value with [`try_unwrap_tsc_low32`] against its estimate of the
//! guest TSC, which is exact while that estimate is within 2^31 ticks (≈ 0.7 s at 3 GHz). The
//! hello's [`Capabilities::tsc`] seeds the estimate; [`Message::ProbeFull`] asks for a
//! full-width reply when the host has lost track.
//!
//! The sequence number is one byte, the checksums are CRC-16/PROFIBUS and (on the compact
//! request only) CRC-8/AUTOSAR; `docs/wire-integrity.md` says why, and why an 8-bit sequence
//! number cannot make a stale reply pass for the awaited one.
//!
//! # Versioning
//!
//! [`PROTOCOL_VERSION`] is exchanged in [`Hello`] / [`Capabilities`], which keep tags 0 and 1
//! in every version; from version 2 on every frame carries its checksum. Golden-byte tests pin
//! every message's encoding, framed and unframed.

pub mod frame;
pub mod message;

#[cfg(test)]
mod flip;
#[cfg(test)]
mod golden;
#[cfg(test)]
pub(crate) mod testutil;

pub use frame::{
    CRC8, CRC16, CRC32, DecodeError, EncodeError, Feed, FrameReceiver, MAX_BODY_SIZE,
    MAX_FRAME_SIZE, MAX_MESSAGE_SIZE, ProbeReplyFrame, checksum_len, decode, decode_frame, encode,
    encode_frame,
};
#[cfg(feature = "sim")]
pub use frame::{reseal_frame, reseal_stream};
pub use message::{
    Capabilities, EVENT_BATCH_MAX, EVENT_PAYLOAD_MAX, ErrorCode, EventBatch, EventClock,
    EventRecord, Features, Hello, MappingPush, Message, PROTOCOL_VERSION, ProbeReply,
    ProbeReplyFull, PvclockReport, Transport, try_unwrap_tsc_low32, try_unwrap_tsc_low32_in,
};
