//! Feeds arbitrary bytes to a ready agent through the fake link, in a chunk size chosen by the
//! input. A panic, or an answer that does not decode, is a crash; afterwards a probe (after a
//! delimiter that closes whatever the input left open) must be answered as the state says.
//!
//! Input: the first byte picks the chunk size (low 6 bits) and, with its top bit set, has every
//! frame's checksum rewritten to match (`reseal_stream`), so mutations reach the state
//! machine; the rest is the host → guest stream.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmtsync_core::agent::fake::{FakeClock, FakeLink};
use vmtsync_core::agent::{Agent, AgentState};
use vmtsync_core::proto::{ErrorCode, Features, Hello, Message, PROTOCOL_VERSION, reseal_stream};

fn drain(agent: &mut Agent<FakeLink, FakeClock>) -> Option<Message> {
    let mut last = None;
    while let Some(m) = agent.link_mut().next_sent() {
        last = Some(m.expect("the agent only sends frames that decode"));
    }
    last
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, raw)) = data.split_first() else {
        return;
    };
    let mut stream = Vec::with_capacity(raw.len() + raw.len() / 8 + 2);
    if first & 0x80 != 0 {
        reseal_stream(raw, |piece| stream.extend_from_slice(piece));
    } else {
        stream.extend_from_slice(raw);
    }
    // Two more vCPUs (2 and 5), so probes for other vCPUs reach their reads too.
    let mut clock = FakeClock::new(1 << 45, 1_000, 0);
    clock.peers = 0b10_0100;
    clock.peer_offset = 1 << 40;
    let mut agent: Agent<FakeLink, FakeClock> = Agent::new(FakeLink::new(), clock);
    assert!(agent.link_mut().push_message(&Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        features: Features::NONE,
    })));
    let _ = agent.poll();
    drain(&mut agent);
    agent.link_mut().max_recv = usize::from(first % 64) + 1;
    for piece in stream.chunks(1024) {
        if !agent.link_mut().push_inbound(piece) {
            break;
        }
        while agent.link().inbound_len() > 0 && agent.state() != AgentState::Exited {
            let _ = agent.poll();
        }
        drain(&mut agent);
    }
    assert!(agent.link_mut().push_inbound(&[0]));
    let _ = agent.poll();
    drain(&mut agent);
    let state = agent.state();
    assert!(agent.link_mut().push_message(&Message::Probe { seq: 77 }));
    let _ = agent.poll();
    let answer = drain(&mut agent);
    match state {
        AgentState::Ready => {
            assert!(matches!(answer, Some(Message::ProbeReply(r)) if r.seq == 77));
        }
        AgentState::AwaitHello => assert_eq!(answer, Some(Message::Error(ErrorCode::NotReady))),
        AgentState::Exited => assert_eq!(answer, None),
    }
});
