//! Probe protocol costs: encode + decode time per probe message, the agent's late-TSC reply
//! path (including the CRC-16 it finishes after the TSC read) against the generic encoder, the
//! CRC continuation alone, and bytes on the wire per probe round trip (printed, for every seq).
//!
//! Run with `cargo bench -p vmtsync-core --bench proto`. Compare the numbers of one run with
//! each other (the machine is shared); absolute times are only indicative.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use vmtsync_core::GuestTicks;
use vmtsync_core::proto::{
    CRC16, Feed, FrameReceiver, MAX_FRAME_SIZE, Message, ProbeReply, ProbeReplyFrame, decode_frame,
    encode_frame, try_unwrap_tsc_low32,
};

/// Realistic values: guest TSC ~2^45, vCPU < 128.
const TSC: GuestTicks = GuestTicks((1 << 45) + 0x0123_4567);
const SEQ: u8 = 200;
const VCPU: u32 = 3;

/// (request, reply) bytes on the wire of one probe round trip, compact or full-width.
fn round_trip_bytes(seq: u8, full: bool) -> (usize, usize) {
    let mut buf = [0u8; MAX_FRAME_SIZE];
    let msg = if full {
        Message::ProbeFull { seq }
    } else {
        Message::Probe { seq }
    };
    let request = encode_frame(&msg, &mut buf).map(|f| f.len()).unwrap_or(0);
    let mut reply = if full {
        ProbeReplyFrame::full(seq, VCPU)
    } else {
        ProbeReplyFrame::compact(seq, VCPU)
    };
    (request, reply.finish(TSC).len())
}

/// Prints the wire sizes over every sequence number as one `key=value` line each, for
/// BENCHMARKS.md.
fn print_sizes() {
    for (name, full) in [("probe_round_trip", false), ("full_probe_round_trip", true)] {
        let sizes: Vec<(usize, usize)> = (0..=u8::MAX).map(|s| round_trip_bytes(s, full)).collect();
        let total = |&(a, b): &(usize, usize)| a + b;
        let min = sizes.iter().map(total).min().unwrap_or(0);
        let max = sizes.iter().map(total).max().unwrap_or(0);
        let (req, reply) = sizes.first().copied().unwrap_or_default();
        println!(
            "{name}: bytes_min={min} bytes_max={max} request={req} reply={reply} \
             (every seq 0..=255, vCPU {VCPU}, TSC ~2^45; COBS + CRC + delimiter included; \
             trace-cmd ptp: ~96.7 B per probe)"
        );
    }
}

fn encode_decode(msg: &Message) -> Message {
    let mut buf = [0u8; MAX_FRAME_SIZE];
    let frame = encode_frame(msg, &mut buf).expect("fits");
    decode_frame(frame).expect("decodes")
}

fn bench_proto(c: &mut Criterion) {
    print_sizes();
    let request = Message::Probe { seq: SEQ };
    let reply = Message::ProbeReply(ProbeReply {
        seq: SEQ,
        vcpu: VCPU,
        tsc_low32: 0x0123_4567,
    });

    let mut g = c.benchmark_group("probe");
    g.bench_function("request encode+decode", |b| {
        b.iter(|| encode_decode(black_box(&request)));
    });
    g.bench_function("reply encode+decode", |b| {
        b.iter(|| encode_decode(black_box(&reply)));
    });
    // What the agent does after reading the TSC, vs the generic encoder on the same reply.
    // `finish` restarts from the prepared prefix on every call, as the agent's would.
    let mut prepared = ProbeReplyFrame::compact(SEQ, VCPU);
    g.bench_function("reply finish (agent late-TSC path)", |b| {
        b.iter(|| black_box(&mut prepared).finish(black_box(TSC)).len());
    });
    // The part of `finish` that the checksum adds: continue the prefix's CRC-16 over the TSC.
    let mut prefix_crc = CRC16.digest();
    prefix_crc.update(&[3, SEQ, 3]);
    let low = TSC.0.to_le_bytes();
    g.bench_function("reply CRC-16 continuation over the TSC bytes", |b| {
        b.iter(|| {
            let mut d = black_box(&prefix_crc).clone();
            d.update(black_box(&low[..4]));
            d.finalize()
        });
    });
    g.bench_function("reply encode_frame (generic)", |b| {
        let mut buf = [0u8; MAX_FRAME_SIZE];
        b.iter(|| encode_frame(black_box(&reply), &mut buf).map(|f| f.len()));
    });
    // What the host does per reply: reassemble from the stream, decode, unwrap.
    let mut frame_buf = [0u8; MAX_FRAME_SIZE];
    let frame = encode_frame(&reply, &mut frame_buf).expect("fits").to_vec();
    g.bench_function("host receive+unwrap reply", |b| {
        let mut rx = FrameReceiver::new();
        b.iter(|| match rx.feed(black_box(&frame)) {
            Feed::Message {
                msg: Message::ProbeReply(r),
                ..
            } => try_unwrap_tsc_low32(TSC, r.tsc_low32),
            _ => None,
        });
    });
    g.finish();
}

criterion_group!(benches, bench_proto);
criterion_main!(benches);
