//! Golden-byte tests: every message's exact encoding, as an unframed body (postcard bytes and
//! checksum) and framed, the measured probe round-trip size, and the error-detection strength
//! of the two checksums. A change here is a wire-format change: bump `PROTOCOL_VERSION`.
//!
//! The checksums in the table were computed outside this crate (a bitwise CRC written from the
//! catalog parameters) and are re-checked here by [`reference_crc`], which shares no code with
//! the `crc` crate.

use super::*;
use crate::mapping::KvmTscMapping;
use crate::units::GuestTicks;
use postcard::experimental::max_size::MaxSize;
use std::println;
use std::vec::Vec;

/// (message, body = postcard bytes + checksum, COBS frame with delimiter).
fn golden() -> Vec<(Message, &'static [u8], &'static [u8])> {
    // Two records 2600 ticks apart (a million events per second at 2.6 GHz), the first with
    // no payload, the second with two bytes, then one 100 ticks back (a clock that stepped).
    let base = 0x2000_0000_0000;
    let mut events = EventBatch::new(2, EventClock::Guest, base);
    events.remaining = 3;
    events.dropped = 300;
    events.overwrite = true;
    events.first = 1000;
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
            &[0x00, 0x04, 0x0f, 0x1b, 0xb3],
            &[0x01, 0x05, 0x04, 0x0f, 0x1b, 0xb3, 0x00],
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
                0xe8, 0xb6, 0x01, 0x2b, 0x27
            ],
            &[
                0x03, 0x01, 0x01, 0x11, 0x03, 0x02, 0xf8, 0xac, 0xd1, 0x91, 0x81, 0x80, 0x08, 0x01,
                0x80, 0xe8, 0xb6, 0x01, 0x2b, 0x27, 0x00
            ],
        ),
        (
            Message::Probe { seq: 0xa5 },
            &[0x02, 0xa5, 0xb9],
            &[0x04, 0x02, 0xa5, 0xb9, 0x00],
        ),
        (
            Message::ProbeReply(ProbeReply {
                seq: 0xa5,
                vcpu: 5,
                tsc_low32: 0x1234_5678,
            }),
            &[0x03, 0xa5, 0x05, 0x78, 0x56, 0x34, 0x12, 0x56, 0xb9],
            &[
                0x0a, 0x03, 0xa5, 0x05, 0x78, 0x56, 0x34, 0x12, 0x56, 0xb9, 0x00
            ],
        ),
        (
            Message::ProbeFull { seq: 1 },
            &[0x04, 0x01, 0x10, 0xea],
            &[0x05, 0x04, 0x01, 0x10, 0xea, 0x00],
        ),
        (
            Message::ProbeReplyFull(ProbeReplyFull {
                seq: 1,
                vcpu: 0,
                tsc: 0x2000_1234_5678,
            }),
            &[
                0x05, 0x01, 0x00, 0x78, 0x56, 0x34, 0x12, 0x00, 0x20, 0x00, 0x00, 0xd6, 0xd7
            ],
            &[
                0x03, 0x05, 0x01, 0x05, 0x78, 0x56, 0x34, 0x12, 0x02, 0x20, 0x01, 0x03, 0xd6, 0xd7,
                0x00
            ],
        ),
        (
            Message::SetMapping(MappingPush {
                vcpu: 1,
                mapping: KvmTscMapping::try_new(-1000, 1 << 48, 48).unwrap(),
            }),
            &[
                0x06, 0x01, 0xcf, 0x0f, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x40, 0x30, 0x05, 0xf0
            ],
            &[
                0x0f, 0x06, 0x01, 0xcf, 0x0f, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x40, 0x30, 0x05,
                0xf0, 0x00
            ],
        ),
        (
            Message::MappingApplied { vcpu: 1 },
            &[0x07, 0x01, 0x92, 0xf9],
            &[0x05, 0x07, 0x01, 0x92, 0xf9, 0x00],
        ),
        (
            Message::PvclockRequest,
            &[0x08, 0x68, 0xeb],
            &[0x04, 0x08, 0x68, 0xeb, 0x00]
        ),
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
                0xd0, 0x0f, 0xe7, 0x7c
            ],
            &[
                0x02, 0x09, 0x11, 0x02, 0xe8, 0x07, 0xf4, 0x03, 0x80, 0x80, 0x80, 0x80, 0x08, 0xff,
                0x01, 0xd0, 0x0f, 0xe7, 0x7c, 0x00
            ],
        ),
        (
            Message::EventsRequest { max: 8 },
            &[0x0a, 0x08, 0xd8, 0x28],
            &[0x05, 0x0a, 0x08, 0xd8, 0x28, 0x00],
        ),
        (
            Message::Events(events),
            // tag, vcpu 2, dropped 300, overwrite, first 1000, remaining 3, last, guest clock,
            // base 2^45, 3 records: (delta 0, header 2 = id 1 without payload), (delta +2600 =
            // zigzag 5200, header 15 = id 7 with payload, [aa 00]), (delta -100 = zigzag 199,
            // header 600 = id 300 without payload); CRC-32 0xf2b6f071. Computed by an
            // independent Python varint, CRC-32/BZIP2 and COBS, which also reproduce version
            // 3's bytes (the same without the overwrite byte, CRC-32 0xbcaf5294).
            &[
                0x0b, 0x02, 0xac, 0x02, 0x01, 0xe8, 0x07, 0x03, 0x01, 0x00, 0x80, 0x80, 0x80, 0x80,
                0x80, 0x80, 0x08, 0x03, 0x00, 0x02, 0xd0, 0x28, 0x0f, 0x02, 0xaa, 0x00, 0xc7, 0x01,
                0xd8, 0x04, 0xf2, 0xb6, 0xf0, 0x71,
            ],
            &[
                0x0a, 0x0b, 0x02, 0xac, 0x02, 0x01, 0xe8, 0x07, 0x03, 0x01, 0x09, 0x80, 0x80, 0x80,
                0x80, 0x80, 0x80, 0x08, 0x03, 0x07, 0x02, 0xd0, 0x28, 0x0f, 0x02, 0xaa, 0x09, 0xc7,
                0x01, 0xd8, 0x04, 0xf2, 0xb6, 0xf0, 0x71, 0x00,
            ],
        ),
        (
            Message::Shutdown,
            &[0x0c, 0x1f, 0xd7],
            &[0x04, 0x0c, 0x1f, 0xd7, 0x00]
        ),
        (
            Message::Exiting,
            &[0x0d, 0x02, 0x18],
            &[0x04, 0x0d, 0x02, 0x18, 0x00]
        ),
        (
            Message::Error(ErrorCode::NotReady),
            &[0x0e, 0x02, 0x1c, 0x80],
            &[0x05, 0x0e, 0x02, 0x1c, 0x80, 0x00],
        ),
        (
            Message::ProbeOn {
                seq: 200,
                vcpu: 2,
                full: false,
            },
            &[0x0f, 0xc8, 0x02, 0x00, 0x7a, 0xb0],
            &[0x04, 0x0f, 0xc8, 0x02, 0x03, 0x7a, 0xb0, 0x00],
        ),
        (
            Message::VcpusRequest,
            &[0x10, 0x47, 0xac],
            &[0x04, 0x10, 0x47, 0xac, 0x00],
        ),
        (
            Message::Vcpus { online: 0xf },
            &[0x11, 0x0f, 0x6c, 0xf2],
            &[0x05, 0x11, 0x0f, 0x6c, 0xf2, 0x00],
        ),
    ]
}

/// A bitwise MSB-first CRC straight from the catalog parameters (polynomial, init, xorout;
/// neither input nor output reflected), independent of the `crc` crate's tables.
fn reference_crc(width: u32, poly: u32, init: u32, xorout: u32, data: &[u8]) -> u32 {
    let top = 1u64 << (width - 1);
    let mask = (1u64 << width) - 1;
    let (poly, mut r) = (u64::from(poly), u64::from(init));
    for &b in data {
        r ^= u64::from(b) << (width - 8);
        for _ in 0..8 {
            r = if r & top != 0 {
                ((r << 1) ^ poly) & mask
            } else {
                (r << 1) & mask
            };
        }
    }
    u32::try_from(r).expect("width <= 32") ^ xorout
}

#[test]
fn reference_crc_matches_the_catalog_check_values() {
    // The catalog's check value: the CRC of the ASCII bytes "123456789".
    assert_eq!(
        reference_crc(16, 0x1dcf, 0xffff, 0xffff, b"123456789"),
        0xa819
    );
    assert_eq!(reference_crc(8, 0x2f, 0xff, 0xff, b"123456789"), 0xdf);
    assert_eq!(u32::from(CRC16.checksum(b"123456789")), 0xa819);
    assert_eq!(u32::from(CRC8.checksum(b"123456789")), 0xdf);
    assert_eq!(
        reference_crc(32, 0x04c1_1db7, u32::MAX, u32::MAX, b"123456789"),
        0xfc89_1918
    );
    assert_eq!(CRC32.checksum(b"123456789"), 0xfc89_1918);
}

#[test]
fn golden_bytes_encode_and_decode() {
    let table = golden();
    // One entry per variant, tags 0..=17 in order.
    assert_eq!(table.len(), 18);
    for (tag, (msg, body, frame)) in table.into_iter().enumerate() {
        assert_eq!(usize::from(body[0]), tag, "{msg:?}");
        // The checksum: CRC-8 after the compact probe, CRC-32 big-endian after an event
        // batch, CRC-16 big-endian after the others.
        let (payload, crc) = body.split_at(body.len() - checksum_len(body.first()));
        let want = match tag {
            2 => reference_crc(8, 0x2f, 0xff, 0xff, payload),
            11 => reference_crc(32, 0x04c1_1db7, u32::MAX, u32::MAX, payload),
            _ => reference_crc(16, 0x1dcf, 0xffff, 0xffff, payload),
        };
        let got = crc.iter().fold(0u32, |acc, &b| (acc << 8) | u32::from(b));
        assert_eq!(got, want, "checksum of {msg:?}");
        let mut buf = [0u8; MAX_FRAME_SIZE];
        assert_eq!(encode(&msg, &mut buf).unwrap(), body, "body {msg:?}");
        assert_eq!(
            encode_frame(&msg, &mut buf).unwrap(),
            frame,
            "frame {msg:?}"
        );
        assert_eq!(decode(body), Ok(msg.clone()));
        let mut f = frame.to_vec();
        assert_eq!(decode_frame(&mut f), Ok(msg.clone()));
        // Without the delimiter too.
        let mut f = frame[..frame.len() - 1].to_vec();
        assert_eq!(decode_frame(&mut f), Ok(msg));
    }
}

/// The wire size of a compact probe round trip: the host's request frame plus the agent's
/// reply frame (built on the agent's late-TSC path).
fn compact_round_trip(seq: u8, vcpu: u32, tsc: GuestTicks) -> (usize, usize) {
    let mut buf = [0u8; MAX_FRAME_SIZE];
    let request = encode_frame(&Message::Probe { seq }, &mut buf)
        .unwrap()
        .len();
    let reply = ProbeReplyFrame::compact(seq, vcpu).finish(tsc).len();
    (request, reply)
}

#[test]
fn probe_round_trip_is_at_most_16_bytes() {
    // Guest TSCs near 2^45 (hours of uptime at 3 GHz) and near 2^63, with low words that
    // contain zero bytes and ones that do not (COBS overhead must not depend on them).
    let tscs = [
        GuestTicks((1 << 45) + 0x0123_4567),
        GuestTicks(1 << 45),
        GuestTicks((1 << 63) - 1),
        GuestTicks((1 << 63) + 0x00ff_00ff),
    ];
    for seq in [0, 1, 127, 128, 255] {
        for vcpu in [0, 5, 127] {
            for tsc in tscs {
                let (request, reply) = compact_round_trip(seq, vcpu, tsc);
                assert_eq!(
                    (request, reply),
                    (5, 11),
                    "seq {seq} vcpu {vcpu} tsc {tsc:?}"
                );
                assert!(request + reply <= 16);
            }
        }
    }
    let (request, reply) = compact_round_trip(255, 127, tscs[0]);
    println!(
        "probe round trip: request {request} B + reply {reply} B = {} B on the wire, any seq, \
         vCPU < 128, any TSC (trace-cmd ptp: ~96.7 B per probe)",
        request + reply
    );

    // The full-width variant, for when the host has no unwrap reference.
    let mut buf = [0u8; MAX_FRAME_SIZE];
    let full_req = encode_frame(&Message::ProbeFull { seq: 255 }, &mut buf)
        .unwrap()
        .len();
    let full_reply = ProbeReplyFrame::full(255, 127).finish(tscs[2]).len();
    println!(
        "full-width probe round trip: {full_req} B + {full_reply} B = {} B",
        full_req + full_reply
    );
    assert_eq!((full_req, full_reply), (6, 15));

    // And the host recovers the TSC from the compact reply against the hello reading.
    let tsc = tscs[0];
    let mut f = ProbeReplyFrame::compact(200, 3).finish(tsc).to_vec();
    let Ok(Message::ProbeReply(r)) = decode_frame(&mut f) else {
        panic!("reply did not decode")
    };
    assert_eq!((r.seq, r.vcpu), (200, 3));
    let hello_tsc = GuestTicks(tsc.0 - 1_500_000_000);
    assert_eq!(try_unwrap_tsc_low32(hello_tsc, r.tsc_low32), Some(tsc));
}

/// `x^i mod poly` for every bit position `i < n` of a `width`-bit CRC's codeword: an error
/// pattern goes undetected exactly when the syndromes of its bits XOR to zero.
fn syndromes(width: u32, poly: u32, n: usize) -> Vec<u32> {
    let top = 1u32 << width;
    let mut s = Vec::with_capacity(n);
    let mut r = 1u32;
    for _ in 0..n {
        s.push(r);
        r <<= 1;
        if r & top != 0 {
            r ^= top | poly;
        }
    }
    s
}

/// The smallest weight of an undetected error pattern among codewords of `n` bits, if it is
/// below 5 (else 5): the Hamming distance, capped.
fn hamming_distance_capped(width: u32, poly: u32, n: usize) -> u32 {
    let s = syndromes(width, poly, n);
    // Which position has each syndrome (u32::MAX: none).
    let mut at = std::vec![u32::MAX; 1 << width];
    for (i, &v) in s.iter().enumerate() {
        if v == 0 || at[v as usize] != u32::MAX {
            return if v == 0 { 1 } else { 2 };
        }
        at[v as usize] = u32::try_from(i).unwrap();
    }
    // Weight 3: two syndromes XOR to a third. Weight 4: two disjoint pairs XOR alike (pairs
    // sharing a position cannot, the syndromes being distinct).
    let mut pair_seen = std::vec![false; 1 << width];
    for i in 0..n {
        for j in i + 1..n {
            let v = (s[i] ^ s[j]) as usize;
            if at[v] != u32::MAX {
                return 3;
            }
            if pair_seen[v] {
                return 4;
            }
            pair_seen[v] = true;
        }
    }
    5
}

/// The largest body payload of any message other than an event batch: every message kind with
/// every field at its widest.
fn largest_non_event_message() -> usize {
    Message::POSTCARD_MAX_SIZE.min(
        [
            Hello::POSTCARD_MAX_SIZE,
            Capabilities::POSTCARD_MAX_SIZE,
            ProbeReply::POSTCARD_MAX_SIZE,
            ProbeReplyFull::POSTCARD_MAX_SIZE,
            MappingPush::POSTCARD_MAX_SIZE,
            PvclockReport::POSTCARD_MAX_SIZE,
            ErrorCode::POSTCARD_MAX_SIZE,
            5, // `EventsRequest { max: u32 }`, the widest of the field-only variants
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
            + 1, // the tag
    )
}

#[test]
fn checksums_have_the_documented_hamming_distance() {
    let bits = |payload_bytes: usize, crc_bits: usize| payload_bytes * 8 + crc_bits;
    // CRC-16/PROFIBUS: HD 5 (every 1- to 4-bit error detected) for payloads up to 13 bytes,
    // which covers every probe request and reply with a vCPU below 2^14; HD 4 for every
    // message up to the largest one.
    assert_eq!(
        CRC16.algorithm.poly, 0x1dcf,
        "the analysis below is for this polynomial"
    );
    assert_eq!(hamming_distance_capped(16, 0x1dcf, bits(13, 16)), 5);
    assert_eq!(hamming_distance_capped(16, 0x1dcf, bits(14, 16)), 4);
    // Every message but an event batch (which has its own CRC-32) stays within HD 4.
    assert_eq!(hamming_distance_capped(16, 0x1dcf, bits(342, 16)), 4);
    assert!(largest_non_event_message() <= 342);
    // The classic CRC-16/IBM-3740 (0x1021) stays at HD 4 even for the probe: weaker here.
    assert_eq!(hamming_distance_capped(16, 0x1021, bits(7, 16)), 4);
    // CRC-8/AUTOSAR over the compact probe's two payload bytes: HD 4.
    assert_eq!(CRC8.algorithm.poly, 0x2f);
    assert_eq!(hamming_distance_capped(8, 0x2f, bits(2, 8)), 4);
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
