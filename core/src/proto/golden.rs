//! Golden-byte tests: every message's exact encoding, bare and framed, plus the measured probe
//! round-trip size. A change here is a wire-format change: bump `PROTOCOL_VERSION`.

use super::*;
use crate::mapping::KvmTscMapping;
use crate::units::GuestTicks;
use std::println;
use std::vec::Vec;

/// (message, bare postcard bytes, COBS frame with delimiter).
fn golden() -> Vec<(Message, &'static [u8], &'static [u8])> {
    // Two records 2600 ticks apart (a million events per second at 2.6 GHz), the first with
    // no payload, the second with two bytes, then one 100 ticks back (a clock that stepped).
    let base = 0x2000_0000_0000;
    let mut events = EventBatch::new(2, EventClock::Guest, base);
    events.remaining = 3;
    events.dropped = 300;
    events.last = true;
    assert!(events.push(base, base, 1, &[]));
    assert!(events.push(base, base + 2600, 7, &[0xaa, 0x00]));
    assert!(events.push(base + 2600, base + 2500, 300, &[]));
    std::vec![
        (
            Message::Hello(Hello {
                version: PROTOCOL_VERSION,
                features: Features(0b1111),
            }),
            &[0x00, 0x01, 0x0f],
            &[0x01, 0x03, 0x01, 0x0f, 0x00],
        ),
        (
            Message::Capabilities(Capabilities {
                version: 1,
                transport: Transport::Uart16550,
                features: Features::PVCLOCK.union(Features::EVENTS),
                vcpu: 2,
                tsc: GuestTicks(0x2000_1234_5678),
                tsc_khz: Some(2_995_200),
            }),
            &[
                0x01, 0x01, 0x00, 0x03, 0x02, 0xf8, 0xac, 0xd1, 0x91, 0x81, 0x80, 0x08, 0x01, 0x80,
                0xe8, 0xb6, 0x01,
            ],
            &[
                0x03, 0x01, 0x01, 0x0f, 0x03, 0x02, 0xf8, 0xac, 0xd1, 0x91, 0x81, 0x80, 0x08, 0x01,
                0x80, 0xe8, 0xb6, 0x01, 0x00,
            ],
        ),
        (
            Message::Probe { seq: 0x1234 },
            &[0x02, 0xb4, 0x24],
            &[0x04, 0x02, 0xb4, 0x24, 0x00],
        ),
        (
            Message::ProbeReply(ProbeReply {
                seq: 0x1234,
                vcpu: 5,
                tsc_low32: 0x1234_5678,
            }),
            &[0x03, 0xb4, 0x24, 0x05, 0x78, 0x56, 0x34, 0x12],
            &[0x09, 0x03, 0xb4, 0x24, 0x05, 0x78, 0x56, 0x34, 0x12, 0x00],
        ),
        (
            Message::ProbeFull { seq: 1 },
            &[0x04, 0x01],
            &[0x03, 0x04, 0x01, 0x00],
        ),
        (
            Message::ProbeReplyFull(ProbeReplyFull {
                seq: 1,
                vcpu: 0,
                tsc: 0x2000_1234_5678,
            }),
            &[
                0x05, 0x01, 0x00, 0x78, 0x56, 0x34, 0x12, 0x00, 0x20, 0x00, 0x00
            ],
            &[
                0x03, 0x05, 0x01, 0x05, 0x78, 0x56, 0x34, 0x12, 0x02, 0x20, 0x01, 0x01, 0x00
            ],
        ),
        (
            Message::SetMapping(MappingPush {
                vcpu: 1,
                mapping: KvmTscMapping::try_new(-1000, 1 << 48, 48).unwrap(),
            }),
            &[
                0x06, 0x01, 0xcf, 0x0f, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x40, 0x30
            ],
            &[
                0x0d, 0x06, 0x01, 0xcf, 0x0f, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x40, 0x30, 0x00
            ],
        ),
        (
            Message::MappingApplied { vcpu: 1 },
            &[0x07, 0x01],
            &[0x03, 0x07, 0x01, 0x00],
        ),
        (Message::PvclockRequest, &[0x08], &[0x02, 0x08, 0x00]),
        (
            Message::PvclockReport(PvclockReport {
                vcpu: 0,
                version: 2,
                tsc_timestamp: 1000,
                system_time: 500,
                mul: 0x8000_0000,
                shift: -1,
                flags: 1,
                tsc: GuestTicks(2000),
            }),
            &[
                0x09, 0x00, 0x02, 0xe8, 0x07, 0xf4, 0x03, 0x80, 0x80, 0x80, 0x80, 0x08, 0xff, 0x01,
                0xd0, 0x0f,
            ],
            &[
                0x02, 0x09, 0x0f, 0x02, 0xe8, 0x07, 0xf4, 0x03, 0x80, 0x80, 0x80, 0x80, 0x08, 0xff,
                0x01, 0xd0, 0x0f, 0x00,
            ],
        ),
        (
            Message::EventsRequest { max: 8 },
            &[0x0a, 0x08],
            &[0x03, 0x0a, 0x08, 0x00],
        ),
        (
            Message::Events(events),
            // tag, vcpu 2, dropped 300, remaining 3, last, guest clock, base 2^45, 3 records:
            // (delta 0, id 1, no payload), (delta +2600 = zigzag 5200, id 7, [aa 00]),
            // (delta -100 = zigzag 199, id 300, no payload).
            &[
                0x0b, 0x02, 0xac, 0x02, 0x03, 0x01, 0x00, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x08,
                0x03, 0x00, 0x01, 0x00, 0xd0, 0x28, 0x07, 0x02, 0xaa, 0x00, 0xc7, 0x01, 0xac, 0x02,
                0x00,
            ],
            &[
                0x07, 0x0b, 0x02, 0xac, 0x02, 0x03, 0x01, 0x09, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80,
                0x08, 0x03, 0x02, 0x01, 0x06, 0xd0, 0x28, 0x07, 0x02, 0xaa, 0x05, 0xc7, 0x01, 0xac,
                0x02, 0x01, 0x00,
            ],
        ),
        (Message::Shutdown, &[0x0c], &[0x02, 0x0c, 0x00]),
        (Message::Exiting, &[0x0d], &[0x02, 0x0d, 0x00]),
        (
            Message::Error(ErrorCode::NotReady),
            &[0x0e, 0x02],
            &[0x03, 0x0e, 0x02, 0x00],
        ),
    ]
}

#[test]
fn golden_bytes_encode_and_decode() {
    let table = golden();
    // One entry per variant, tags 0..=14 in order.
    assert_eq!(table.len(), 15);
    for (tag, (msg, bare, frame)) in table.into_iter().enumerate() {
        assert_eq!(usize::from(bare[0]), tag, "{msg:?}");
        let mut buf = [0u8; MAX_FRAME_SIZE];
        assert_eq!(encode(&msg, &mut buf).unwrap(), bare, "bare {msg:?}");
        assert_eq!(
            encode_frame(&msg, &mut buf).unwrap(),
            frame,
            "frame {msg:?}"
        );
        assert_eq!(decode(bare), Ok(msg.clone()));
        let mut f = frame.to_vec();
        assert_eq!(decode_frame(&mut f), Ok(msg.clone()));
        // Without the delimiter too.
        let mut f = frame[..frame.len() - 1].to_vec();
        assert_eq!(decode_frame(&mut f), Ok(msg));
    }
}

#[test]
fn probe_round_trip_is_at_most_16_bytes() {
    // Realistic values: guest TSC ~2^45 (a few hours of uptime at 3 GHz), seq just below
    // 2^14, vCPU 127.
    let tsc = GuestTicks((1 << 45) + 0x0123_4567);
    let seq = (1 << 14) - 1;
    let vcpu = 127;
    let mut buf = [0u8; MAX_FRAME_SIZE];
    let request = encode_frame(&Message::Probe { seq }, &mut buf)
        .unwrap()
        .len();
    let mut reply_frame = ProbeReplyFrame::compact(seq, vcpu);
    let reply = reply_frame.finish(tsc).len();
    let round_trip = request + reply;
    println!(
        "probe round trip: request {request} B + reply {reply} B = {round_trip} B on the wire \
         (trace-cmd ptp: ~96.7 B per probe)"
    );
    assert_eq!(request, 5);
    assert_eq!(reply, 10);
    assert!(round_trip <= 16);

    // The full-width variant, for when the host has no unwrap reference.
    let full_req = encode_frame(&Message::ProbeFull { seq }, &mut buf)
        .unwrap()
        .len();
    let full_reply = ProbeReplyFrame::full(seq, vcpu).finish(tsc).len();
    println!(
        "full-width probe round trip: {full_req} B + {full_reply} B = {} B",
        full_req + full_reply
    );
    assert_eq!(full_req + full_reply, 19);

    // And the host recovers the TSC from the compact reply against the hello reading.
    let mut f = ProbeReplyFrame::compact(seq, vcpu).finish(tsc).to_vec();
    let Ok(Message::ProbeReply(r)) = decode_frame(&mut f) else {
        panic!("reply did not decode")
    };
    let hello_tsc = GuestTicks(tsc.0 - 1_500_000_000);
    assert_eq!(try_unwrap_tsc_low32(hello_tsc, r.tsc_low32), Some(tsc));
}

#[test]
fn hello_and_capabilities_tags_are_stable() {
    // Peers of any version must decode each other's hello: tags 0 and 1 forever.
    let mut buf = [0u8; MAX_MESSAGE_SIZE];
    let h = Message::Hello(Hello {
        version: 0xffff,
        features: Features::NONE,
    });
    assert_eq!(encode(&h, &mut buf).unwrap()[0], 0);
    let c = Message::Capabilities(Capabilities {
        version: 0xffff,
        transport: Transport::Other,
        features: Features::NONE,
        vcpu: 0,
        tsc: GuestTicks(0),
        tsc_khz: None,
    });
    assert_eq!(encode(&c, &mut buf).unwrap()[0], 1);
}
