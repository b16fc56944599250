//! proptest strategies for every message (test-only).

use proptest::collection::vec as pvec;
use proptest::prelude::*;
use std::vec;

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
        any::<u16>().prop_map(|seq| Message::Probe { seq }),
        (any::<u16>(), any::<u32>(), any::<u32>()).prop_map(|(seq, vcpu, tsc_low32)| {
            Message::ProbeReply(ProbeReply {
                seq,
                vcpu,
                tsc_low32,
            })
        }),
        any::<u16>().prop_map(|seq| Message::ProbeFull { seq }),
        (any::<u16>(), any::<u32>(), any::<u64>()).prop_map(|(seq, vcpu, tsc)| {
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
