//! Probe protocol costs: encode + decode time per probe message, the agent's late-TSC reply
//! path against the generic encoder, and bytes on the wire per probe round trip (printed).
//!
//! Run with `cargo bench -p vmtsync-core --bench proto`. Compare the numbers of one run with
//! each other (the machine is shared); absolute times are only indicative.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use vmtsync_core::GuestTicks;
use vmtsync_core::proto::{
    Feed, FrameReceiver, MAX_FRAME_SIZE, Message, ProbeReply, ProbeReplyFrame, decode_frame,
    encode_frame, try_unwrap_tsc_low32,
};

/// Realistic values: guest TSC ~2^45, seq < 2^14, vCPU < 128.
const TSC: GuestTicks = GuestTicks((1 << 45) + 0x0123_4567);
const SEQ: u16 = 9_000;
const VCPU: u32 = 3;

fn round_trip_bytes() -> usize {
    let mut buf = [0u8; MAX_FRAME_SIZE];
    let request = encode_frame(&Message::Probe { seq: SEQ }, &mut buf)
        .map(|f| f.len())
        .unwrap_or(0);
    let reply = ProbeReplyFrame::compact(SEQ, VCPU).finish(TSC).len();
    request + reply
}

fn encode_decode(msg: &Message) -> Message {
    let mut buf = [0u8; MAX_FRAME_SIZE];
    let frame = encode_frame(msg, &mut buf).expect("fits");
    decode_frame(frame).expect("decodes")
}

fn bench_proto(c: &mut Criterion) {
    println!(
        "probe round trip: {} B on the wire (request + compact reply, COBS + delimiter each); \
         trace-cmd ptp: ~96.7 B per probe",
        round_trip_bytes()
    );
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
    let prepared = ProbeReplyFrame::compact(SEQ, VCPU);
    g.bench_function("reply finish (agent late-TSC path)", |b| {
        b.iter(|| {
            let mut f = black_box(prepared);
            f.finish(black_box(TSC)).len()
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
