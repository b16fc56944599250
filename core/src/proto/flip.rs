//! Frame integrity against single bit flips: a realistic session is recorded in both
//! directions with the real agent state machine and its fakes, then every bit of every frame
//! is flipped in turn and the flipped stream is fed to the other side's receiver. No flipped
//! frame may decode as any message; only the untouched frames around it may.

use std::vec::Vec;

use crate::agent::fake::{FakeClock, FakeLink};
use crate::agent::{Agent, AgentState};
use crate::arch::FakeTsc;
use crate::mapping::KvmTscMapping;
use crate::proto::{
    ErrorCode, Features, Feed, FrameReceiver, Hello, MAX_FRAME_SIZE, MappingPush, Message,
    PROTOCOL_VERSION, PvclockReport, decode_frame, encode_frame,
};
use crate::recorder::Ring;
use crate::units::GuestTicks;

const VCPU: u32 = 2;

/// The frames of one direction, each with its delimiter, in the order sent.
type Frames = Vec<Vec<u8>>;

/// Plays the host against a real agent: every request kind, the compact and full probes at
/// sequence numbers 0, 1, 127, 128 and 255, a rejected mapping, events, pvclock, errors and
/// the shutdown. Returns (host → guest frames, guest → host frames).
fn record_session(tsc: u64, step: u64) -> (Frames, Frames) {
    let mut clock = FakeClock::new(tsc, step, VCPU);
    clock.tsc_khz = Some(2_995_200);
    clock.invariant = true;
    clock.pvclock = Some(PvclockReport {
        vcpu: VCPU,
        version: 4,
        tsc_timestamp: tsc - 1_000_000,
        system_time: 123_456_789_000,
        mul: 0xa6f3_b2c1,
        shift: -1,
        flags: 1,
        tsc: GuestTicks(0),
    });
    let ring: &'static Ring<64> = std::boxed::Box::leak(std::boxed::Box::new(Ring::new()));
    let mut agent = Agent::with_events(FakeLink::new(), clock, ring);
    let mut to_guest = Vec::new();
    let mut to_host = Vec::new();
    let mut send = |agent: &mut Agent<FakeLink, FakeClock, &'static Ring<64>>, msg: &Message| {
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let frame = encode_frame(msg, &mut buf).unwrap();
        to_guest.push(frame.to_vec());
        assert!(agent.link_mut().push_inbound(frame));
        agent.poll().unwrap();
        let mut answers = 0;
        let mut out = [0u8; MAX_FRAME_SIZE];
        while let Some(n) = agent.link_mut().next_sent_frame(&mut out) {
            to_host.push(out[..n].to_vec());
            answers += 1;
        }
        answers
    };
    // Before the hello: answered NotReady.
    assert_eq!(send(&mut agent, &Message::Probe { seq: 9 }), 1);
    let hello = Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        features: Features::EVENTS.union(Features::MAPPING),
    });
    assert_eq!(send(&mut agent, &hello), 1);
    for seq in [0, 1, 127, 128, 255] {
        assert_eq!(send(&mut agent, &Message::Probe { seq }), 1);
    }
    for seq in [0, 128, 255] {
        assert_eq!(send(&mut agent, &Message::ProbeFull { seq }), 1);
    }
    let mapping = KvmTscMapping::try_new(-123_456_789, (1 << 48) + 777, 48).unwrap();
    // A mapping for another vCPU is refused with an error, the right one applied.
    for vcpu in [VCPU + 1, VCPU] {
        let push = Message::SetMapping(MappingPush { vcpu, mapping });
        assert_eq!(send(&mut agent, &push), 1);
    }
    let events_tsc = FakeTsc::new(tsc + 5_000, 2_600);
    for (id, payload) in [
        (1, &[][..]),
        (2, &[0, 0, 7][..]),
        (300, &[0xff; 16][..]),
        (0xfeff, &[1][..]),
    ] {
        assert!(ring.view().record(&events_tsc, id, payload).is_ok());
    }
    assert_eq!(send(&mut agent, &Message::EventsRequest { max: 3 }), 1);
    assert_eq!(send(&mut agent, &Message::EventsRequest { max: 8 }), 1);
    assert_eq!(send(&mut agent, &Message::PvclockRequest), 1);
    // The host may report an error too; the agent never answers one.
    assert_eq!(send(&mut agent, &Message::Error(ErrorCode::Unexpected)), 0);
    assert_eq!(send(&mut agent, &Message::Shutdown), 1);
    assert_eq!(agent.state(), AgentState::Exited);
    (to_guest, to_host)
}

/// Every message the receiver decodes from `stream`, fed in chunks of `chunk` bytes.
fn receive(stream: &[u8], chunk: usize) -> Vec<Message> {
    let mut rx = FrameReceiver::new();
    let mut got = Vec::new();
    for piece in stream.chunks(chunk) {
        let mut input = piece;
        loop {
            match rx.feed(input) {
                Feed::Consumed => break,
                Feed::Message { msg, rest } => {
                    got.push(msg);
                    input = rest;
                }
                Feed::Error { rest, .. } => input = rest,
            }
        }
    }
    got
}

/// How many messages a fresh agent accepts from the host stream `stream`.
fn agent_accepts(stream: &[u8]) -> u32 {
    let mut agent: Agent<FakeLink, FakeClock> =
        Agent::new(FakeLink::new(), FakeClock::new(1 << 45, 1000, VCPU));
    assert!(agent.link_mut().push_inbound(stream));
    while agent.link().inbound_len() > 0 && agent.state() != AgentState::Exited {
        agent.poll().unwrap();
    }
    agent.stats().messages_in
}

/// Flips every bit of `frames` in turn; returns the number of flips checked. `guest_bound`
/// also runs each flipped stream through a real agent.
fn check_every_flip(frames: &Frames, guest_bound: bool) -> usize {
    let msgs: Vec<Message> = frames
        .iter()
        .map(|f| decode_frame(&mut f.clone()).unwrap())
        .collect();
    let stream: Vec<u8> = frames.concat();
    // The untouched stream decodes to every message, in any chunking.
    for chunk in [1, 7, stream.len()] {
        assert_eq!(receive(&stream, chunk), msgs);
    }
    let mut flips = 0;
    let mut start = 0;
    for (f, frame) in frames.iter().enumerate() {
        for byte in start..start + frame.len() {
            // A flipped delimiter merges this frame with the next: both are lost.
            let lost_next = byte == start + frame.len() - 1;
            let want: Vec<Message> = msgs
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != f && !(lost_next && i == f + 1))
                .map(|(_, m)| m.clone())
                .collect();
            for bit in 0..8 {
                let mut flipped = stream.clone();
                flipped[byte] ^= 1 << bit;
                for chunk in [flipped.len(), 5] {
                    let got = receive(&flipped, chunk);
                    assert_eq!(
                        got,
                        want,
                        "frame {f} ({:?}) byte {} bit {bit} accepted, chunk {chunk}",
                        msgs[f],
                        byte - start
                    );
                }
                if guest_bound {
                    let n = u32::try_from(want.len()).unwrap();
                    assert_eq!(
                        agent_accepts(&flipped),
                        n,
                        "frame {f} byte {byte} bit {bit}"
                    );
                }
                flips += 1;
            }
        }
        start += frame.len();
    }
    flips
}

#[test]
fn no_single_bit_flip_is_accepted_in_either_direction() {
    // TSCs near 2^45 and 2^63, steps that put zero bytes into some readings and not others.
    for (tsc, step) in [
        ((1 << 45) + 0x0123_4567, 0x00ff_0100),
        ((1 << 63) - 3, 1_000_003),
    ] {
        let (to_guest, to_host) = record_session(tsc, step);
        let bytes = |f: &Frames| f.iter().map(Vec::len).sum::<usize>();
        let down = check_every_flip(&to_guest, true);
        let up = check_every_flip(&to_host, false);
        std::println!(
            "tsc {tsc:#x}: {} host->guest frames ({} B), {} guest->host frames ({} B): \
             {down} + {up} single-bit flips, none accepted",
            to_guest.len(),
            bytes(&to_guest),
            to_host.len(),
            bytes(&to_host)
        );
        assert_eq!(down, bytes(&to_guest) * 8);
        assert_eq!(up, bytes(&to_host) * 8);
    }
}
