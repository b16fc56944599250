//! The probe protocol: one versioned message enum, postcard + COBS framing.
//!
//! Layers:
//! - [`message`]: [`Message`] and its payloads; who sends what, and the TSC unwrap helper.
//! - [`frame`]: encoding, the one checked decode path for untrusted bytes, the stream
//!   receiver, and [`ProbeReplyFrame`], which lets the agent encode a reply before it reads the
//!   TSC.
//!
//! # Size of a probe
//!
//! A probe round trip is the host's [`Message::Probe`] and the guest's [`Message::ProbeReply`],
//! each COBS-framed with a `0x00` delimiter. For realistic values (sequence number below 2^14,
//! vCPU below 128, any TSC) that is:
//!
//! | message | body | COBS | delimiter | wire |
//! |---|---|---|---|---|
//! | `Probe { seq }` | tag 1 + seq 2 | +1 | +1 | 5 B |
//! | `ProbeReply` | tag 1 + seq 2 + vcpu 1 + TSC low word 4 | +1 | +1 | 10 B |
//!
//! **15 bytes per probe round trip** (pinned by a test), against ≈ 96.7 B per probe for
//! trace-cmd's PTP plugin (36 B each way plus its share of the 8 KiB result message;
//! reference/trace-cmd-tsync.md §3.6). The reply carries only the low 32 bits of the guest
//! TSC: a full varint TSC near 2^45 would take 7 bytes and push the round trip to ~18 B. The
//! host recovers the full value with [`try_unwrap_tsc_low32`] against its estimate of the
//! guest TSC, which is exact while that estimate is within 2^31 ticks (≈ 0.7 s at 3 GHz). The
//! hello's [`Capabilities::tsc`] seeds the estimate; [`Message::ProbeFull`] asks for a
//! full-width reply when the host has lost track.
//!
//! # Versioning
//!
//! [`PROTOCOL_VERSION`] is exchanged in [`Hello`] / [`Capabilities`], which keep tags 0 and 1
//! in every version. Golden-byte tests pin every message's encoding, framed and bare.

pub mod frame;
pub mod message;

#[cfg(test)]
mod golden;
#[cfg(test)]
pub(crate) mod testutil;

pub use frame::{
    DecodeError, EncodeError, Feed, FrameReceiver, MAX_FRAME_SIZE, MAX_MESSAGE_SIZE,
    ProbeReplyFrame, decode, decode_frame, encode, encode_frame,
};
pub use message::{
    Capabilities, EVENT_BATCH_MAX, EVENT_PAYLOAD_MAX, ErrorCode, EventBatch, EventClock,
    EventRecord, Features, Hello, MappingPush, Message, PROTOCOL_VERSION, ProbeReply,
    ProbeReplyFull, PvclockReport, Transport, try_unwrap_tsc_low32,
};
