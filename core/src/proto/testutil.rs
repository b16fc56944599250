//! proptest strategies for every message, and body/frame builders for hand-made payloads
//! (test-only).

use proptest::collection::vec as pvec;
use proptest::prelude::*;
use std::vec;
use std::vec::Vec;

use super::frame::{CRC8, CRC16, CRC32};

use super::message::*;
use crate::mapping::KvmTscMapping;
use crate::units::GuestTicks;

fn arb_features() -> impl Strategy<Value = Features> {
    any::<u32>().prop_map(Features)
}

fn arb_transport() -> impl Strategy<Value = Transport> {
    prop_oneof![
        Just(Transport::Uart16550),
        Just(Transport::VirtioVsock),
        Just(Transport::Memory),
        Just(Transport::Other),
    ]
}

fn arb_error_code() -> impl Strategy<Value = ErrorCode> {
    prop_oneof![
        Just(ErrorCode::Malformed),
        Just(ErrorCode::FrameTooLong),
        Just(ErrorCode::NotReady),
        Just(ErrorCode::VersionMismatch),
        Just(ErrorCode::Unsupported),
        Just(ErrorCode::Unexpected),
        Just(ErrorCode::UnknownVcpu),
        Just(ErrorCode::InvalidMapping),
    ]
}

fn arb_event() -> impl Strategy<Value = EventRecord> {
    (
        any::<i64>(),
        any::<u16>(),
        pvec(any::<u8>(), 0..=EVENT_PAYLOAD_MAX),
    )
        .prop_map(|(delta, id, p)| EventRecord {
            delta,
            id,
            payload: heapless::Vec::from_slice(&p).unwrap(),
        })
}

/// Any message that passes the decoder's semantic checks (so it must round-trip).
pub(crate) fn arb_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (any::<u16>(), arb_features())
            .prop_map(|(version, features)| Message::Hello(Hello { version, features })),
        (
            any::<u16>(),
            arb_transport(),
            arb_features(),
            any::<u32>(),
            any::<u64>(),
            any::<Option<u32>>()
        )
            .prop_map(|(version, transport, features, vcpu, tsc, tsc_khz)| {
                Message::Capabilities(Capabilities {
                    version,
                    transport,
                    features,
                    vcpu,
                    tsc: GuestTicks(tsc),
                    tsc_khz,
                })
            }),
        any::<u8>().prop_map(|seq| Message::Probe { seq }),
        (any::<u8>(), any::<u32>(), any::<u32>()).prop_map(|(seq, vcpu, tsc_low32)| {
            Message::ProbeReply(ProbeReply {
                seq,
                vcpu,
                tsc_low32,
            })
        }),
        any::<u8>().prop_map(|seq| Message::ProbeFull { seq }),
        (any::<u8>(), any::<u32>(), any::<u64>()).prop_map(|(seq, vcpu, tsc)| {
            Message::ProbeReplyFull(ProbeReplyFull { seq, vcpu, tsc })
        }),
        (any::<u32>(), any::<i64>(), 1..=u64::MAX, 0..=63u32).prop_map(
            |(vcpu, offset, ratio, frac_bits)| Message::SetMapping(MappingPush {
                vcpu,
                mapping: KvmTscMapping::try_new(offset, ratio, frac_bits).unwrap(),
            })
        ),
        any::<u32>().prop_map(|vcpu| Message::MappingApplied { vcpu }),
        Just(Message::PvclockRequest),
        (any::<u8>(), any::<u32>(), any::<bool>()).prop_map(|(seq, vcpu, full)| Message::ProbeOn {
            seq,
            vcpu,
            full
        }),
        Just(Message::VcpusRequest),
        any::<u64>().prop_map(|online| Message::Vcpus { online }),
        (
            any::<u32>(),
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            any::<i8>(),
            any::<u8>(),
            any::<u64>()
        )
            .prop_map(
                |(vcpu, version, tsc_timestamp, system_time, mul, shift, flags, tsc)| {
                    Message::PvclockReport(PvclockReport {
                        vcpu,
                        version,
                        tsc_timestamp,
                        system_time,
                        mul,
                        shift,
                        flags,
                        tsc: GuestTicks(tsc),
                    })
                }
            ),
        any::<u32>().prop_map(|max| Message::EventsRequest { max }),
        (
            (any::<u32>(), any::<u64>(), any::<u32>(), any::<bool>()),
            (any::<bool>(), any::<u64>()),
            pvec(arb_event(), 0..=EVENT_BATCH_MAX)
        )
            .prop_map(|((vcpu, dropped, remaining, last), (host, base), evs)| {
                let clock = if host {
                    EventClock::Host
                } else {
                    EventClock::Guest
                };
                let mut b = EventBatch::new(vcpu, clock, base);
                b.dropped = dropped;
                b.first = dropped.rotate_left(17);
                b.remaining = remaining;
                b.last = last;
                for e in evs {
                    b.records.push(e).unwrap();
                }
                Message::Events(b)
            }),
        Just(Message::Shutdown),
        Just(Message::Exiting),
        arb_error_code().prop_map(Message::Error),
    ]
}

/// A hand-made postcard payload with the checksum its tag calls for appended (CRC-8 after the
/// compact probe's tag 2, CRC-16 big-endian after every other), as `encode` would.
pub(crate) fn body_of(payload: &[u8]) -> Vec<u8> {
    let mut body = payload.to_vec();
    match payload.first() {
        Some(&2) => body.push(CRC8.checksum(payload)),
        Some(&11) => body.extend_from_slice(&CRC32.checksum(payload).to_be_bytes()),
        _ => body.extend_from_slice(&CRC16.checksum(payload).to_be_bytes()),
    }
    body
}

/// COBS-frames a body (with its delimiter) through the cobs crate, as `encode_frame` does.
pub(crate) fn cobs_frame(body: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; body.len() + body.len() / 254 + 2];
    let n = cobs::encode(body, &mut out);
    out.truncate(n);
    out.push(0);
    out
}
