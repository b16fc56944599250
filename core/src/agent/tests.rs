//! Agent tests through the fakes: the test plays the host on the other end of a [`FakeLink`].

use std::println;
use std::vec::Vec;

use super::fake::{FakeClock, FakeLink};
use super::*;
use crate::arch::FakeTsc;
use crate::proto::{
    Hello, MappingPush, ProbeReply, ProbeReplyFull, decode_frame, try_unwrap_tsc_low32,
};
use crate::recorder::{EventSources, Recorder, Ring};

const VCPU: u32 = 3;
const T0: u64 = (1 << 45) + 12_345;

type TestAgent = Agent<FakeLink, FakeClock, &'static Ring<256>>;

fn agent(step: u64) -> TestAgent {
    // Each test gets its own ring; leaking it is how a test gets the `static` a unikernel has.
    let ring: &'static Ring<256> = std::boxed::Box::leak(std::boxed::Box::new(Ring::new()));
    Agent::with_events(FakeLink::new(), FakeClock::new(T0, step, VCPU), ring)
}

/// Records event `id` stamped exactly `tsc` into the agent's ring.
fn record_at(a: &TestAgent, id: u16, tsc: u64) -> bool {
    a.events()
        .view()
        .record(&FakeTsc::new(tsc, 0), id, &[])
        .is_ok()
}

/// The batch's records as (timestamp, id).
fn stamped(b: &EventBatch) -> Vec<(u64, u16)> {
    b.timestamped()
        .map(|r| r.map(|(t, r)| (t, r.id)).expect("timestamp in range"))
        .collect()
}

/// Host side: sends `msg`, polls the agent once, returns everything it answered.
fn exchange<E: EventSources>(a: &mut Agent<FakeLink, FakeClock, E>, msg: &Message) -> Vec<Message> {
    assert!(a.link_mut().push_message(msg));
    a.poll().expect("poll");
    drain(a)
}

fn drain<E: EventSources>(a: &mut Agent<FakeLink, FakeClock, E>) -> Vec<Message> {
    let mut out = Vec::new();
    while let Some(m) = a.link_mut().next_sent() {
        out.push(m.expect("agent sent a frame that does not decode"));
    }
    assert_eq!(a.link().outbound_len(), 0, "a partial frame was left");
    out
}

fn hello() -> Message {
    Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        features: Features::EVENTS.union(Features::MAPPING),
    })
}

/// Says hello and returns the TSC in the capabilities.
fn open(a: &mut TestAgent) -> GuestTicks {
    match exchange(a, &hello()).as_slice() {
        [Message::Capabilities(c)] => {
            assert_eq!(c.version, PROTOCOL_VERSION);
            assert_eq!(c.vcpu, VCPU);
            assert_eq!(c.transport, Transport::Memory);
            assert!(
                c.features
                    .contains(Features::EVENTS.union(Features::MAPPING))
            );
            c.tsc
        }
        other => panic!("expected capabilities, got {other:?}"),
    }
}

#[test]
fn hello_then_probes_unwrap_to_the_exact_tsc() {
    // 1.5e9 ticks per read: the low 32 bits wrap every ~3 probes, yet each step stays inside
    // the ±2^31 unwrap window, so chaining the reference recovers every reading exactly.
    let step = 1_500_000_000;
    let mut a = agent(step);
    a.clock_mut().tsc_khz = Some(3_000_000);
    let hello_tsc = open(&mut a);
    assert_eq!(hello_tsc, GuestTicks(T0));
    let mut reference = hello_tsc;
    let mut wraps = 0;
    for k in 1..=20u8 {
        let mut req = [0u8; MAX_FRAME_SIZE];
        let req_len = encode_frame(&Message::Probe { seq: k }, &mut req)
            .unwrap()
            .len();
        assert!(a.link_mut().push_inbound(&req[..req_len]));
        a.poll().unwrap();
        let mut reply = [0u8; MAX_FRAME_SIZE];
        let reply_len = a.link_mut().next_sent_frame(&mut reply).unwrap();
        if k == 1 {
            println!(
                "agent probe round trip: {req_len} B + {reply_len} B = {} B",
                req_len + reply_len
            );
        }
        assert!(req_len + reply_len <= 16);
        let Ok(Message::ProbeReply(ProbeReply {
            seq,
            vcpu,
            tsc_low32,
        })) = decode_frame(&mut reply[..reply_len])
        else {
            panic!("not a probe reply")
        };
        assert_eq!((seq, vcpu), (k, VCPU));
        let full = try_unwrap_tsc_low32(reference, tsc_low32).unwrap();
        // Exactly one TSC read per probe, taken for this reply.
        assert_eq!(full, GuestTicks(T0 + u64::from(k) * step));
        if full.0 >> 32 != reference.0 >> 32 {
            wraps += 1;
        }
        reference = full;
    }
    assert!(
        wraps >= 6,
        "the test must cross the low-word wrap ({wraps})"
    );
    assert_eq!(a.stats().probes, 20);
    assert_eq!(a.clock_mut().reads, 21);
}

#[test]
fn a_sync_port_clock_is_announced_and_tagged_with_each_probes_seq() {
    let mut a = agent(10);
    a.clock_mut().sync_port = true;
    let caps = exchange(&mut a, &hello());
    assert!(
        matches!(&caps[..], [Message::Capabilities(c)] if c.features.contains(Features::SYNC_PORT)),
        "{caps:?}"
    );
    for seq in [7u8, 200] {
        let r = exchange(&mut a, &Message::ProbeFull { seq });
        assert!(
            matches!(&r[..], [Message::ProbeReplyFull(p)] if p.seq == seq),
            "{r:?}"
        );
        assert_eq!(a.clock_mut().last_probe_seq, Some(seq));
    }
    // Without a sync port nothing is announced.
    let mut b = agent(10);
    let caps = exchange(&mut b, &hello());
    assert!(
        matches!(&caps[..], [Message::Capabilities(c)] if !c.features.contains(Features::SYNC_PORT)),
        "{caps:?}"
    );
}

#[test]
fn probe_full_carries_the_whole_tsc() {
    let mut a = agent(7);
    open(&mut a);
    let got = exchange(&mut a, &Message::ProbeFull { seq: 9 });
    assert_eq!(
        got,
        [Message::ProbeReplyFull(ProbeReplyFull {
            seq: 9,
            vcpu: VCPU,
            tsc: T0 + 7,
        })]
    );
}

#[test]
fn probes_on_other_vcpus_are_answered_by_them_or_refused() {
    let mut a = agent(7);
    // A single-vCPU clock: no SMP feature, only its own vCPU listed and probed.
    open(&mut a);
    let one = 1u64 << VCPU;
    assert_eq!(
        exchange(&mut a, &Message::VcpusRequest),
        [Message::Vcpus { online: one }]
    );
    assert_eq!(
        exchange(
            &mut a,
            &Message::ProbeOn {
                seq: 1,
                vcpu: 0,
                full: false
            }
        ),
        [Message::Error(ErrorCode::UnknownVcpu)]
    );

    let peers = 0b101;
    let clock = a.clock_mut();
    clock.peers = peers;
    clock.peer_offset = 1 << 40;
    let got = exchange(&mut a, &hello());
    let [Message::Capabilities(c)] = got.as_slice() else {
        panic!("expected capabilities, got {got:?}");
    };
    assert!(c.features.contains(Features::SMP));
    assert_eq!(
        exchange(&mut a, &Message::VcpusRequest),
        [Message::Vcpus {
            online: peers | one
        }]
    );
    let t = a.clock_mut().tsc;
    // vCPU 2 reads its own clock (the fake's plus 2 · 2^40), in full or compact form.
    assert_eq!(
        exchange(
            &mut a,
            &Message::ProbeOn {
                seq: 2,
                vcpu: 2,
                full: true
            }
        ),
        [Message::ProbeReplyFull(ProbeReplyFull {
            seq: 2,
            vcpu: 2,
            tsc: t + (2 << 40),
        })]
    );
    #[allow(clippy::cast_possible_truncation)]
    let low = (t + 7) as u32;
    assert_eq!(
        exchange(
            &mut a,
            &Message::ProbeOn {
                seq: 3,
                vcpu: 0,
                full: false
            }
        ),
        [Message::ProbeReply(ProbeReply {
            seq: 3,
            vcpu: 0,
            tsc_low32: low,
        })]
    );
    // Its own vCPU through ProbeOn is a plain probe; vCPU 1 and ids past 63 are unknown.
    assert_eq!(
        exchange(
            &mut a,
            &Message::ProbeOn {
                seq: 4,
                vcpu: VCPU,
                full: true
            }
        ),
        [Message::ProbeReplyFull(ProbeReplyFull {
            seq: 4,
            vcpu: VCPU,
            tsc: t + 14,
        })]
    );
    for vcpu in [1, 64, u32::MAX] {
        assert_eq!(
            exchange(
                &mut a,
                &Message::ProbeOn {
                    seq: 5,
                    vcpu,
                    full: false
                }
            ),
            [Message::Error(ErrorCode::UnknownVcpu)]
        );
    }
    assert_eq!(a.stats().probes, 3);
}

#[test]
fn nothing_but_hello_before_hello_and_version_mismatch_is_not_served() {
    let mut a = agent(1);
    assert_eq!(
        exchange(&mut a, &Message::Probe { seq: 1 }),
        [Message::Error(ErrorCode::NotReady)]
    );
    let old = Message::Hello(Hello {
        version: PROTOCOL_VERSION + 1,
        features: Features::NONE,
    });
    match exchange(&mut a, &old).as_slice() {
        [Message::Capabilities(c)] => assert_eq!(c.version, PROTOCOL_VERSION),
        other => panic!("{other:?}"),
    }
    assert_eq!(a.state(), AgentState::AwaitHello);
    assert_eq!(
        exchange(&mut a, &Message::PvclockRequest),
        [Message::Error(ErrorCode::NotReady)]
    );
    open(&mut a);
    assert_eq!(a.state(), AgentState::Ready);
}

#[test]
fn pushed_mapping_is_applied_and_events_are_stamped_in_host_time() {
    let mut a = agent(10);
    open(&mut a);
    // Events recorded before any mapping go out in guest time.
    assert!(record_at(&a, 1, T0 - 500));
    let mut want = EventBatch::new(VCPU, EventClock::Guest, T0 - 500);
    want.last = true;
    assert!(want.push(T0 - 500, T0 - 500, 1, &[]));
    assert_eq!(
        exchange(&mut a, &Message::EventsRequest { max: 8 }),
        [Message::Events(want)]
    );

    // Guest clock runs 1.5x the host's and 1_000_000 ticks ahead (VMX: 48 fraction bits).
    let offset = 1_000_000;
    let mapping = KvmTscMapping::try_new(offset, 3 << 47, 48).unwrap();
    let wrong_vcpu = Message::SetMapping(MappingPush {
        vcpu: VCPU + 1,
        mapping,
    });
    assert_eq!(
        exchange(&mut a, &wrong_vcpu),
        [Message::Error(ErrorCode::UnknownVcpu)]
    );
    assert_eq!(a.mapping(), None);
    let push = Message::SetMapping(MappingPush {
        vcpu: VCPU,
        mapping,
    });
    assert_eq!(
        exchange(&mut a, &push),
        [Message::MappingApplied { vcpu: VCPU }]
    );
    assert_eq!(a.mapping(), Some(mapping));

    let guest_times = [T0, T0 + 1, T0 + 2, T0 + 3_000_000_001];
    for (id, &g) in (10u16..).zip(&guest_times) {
        assert!(record_at(&a, id, g));
    }
    let Ok([Message::Events(batch)]) =
        <[Message; 1]>::try_from(exchange(&mut a, &Message::EventsRequest { max: 100 }))
    else {
        panic!("expected one batch")
    };
    assert_eq!((batch.clock, batch.last), (EventClock::Host, true));
    let got = stamped(&batch);
    assert_eq!(got.len(), guest_times.len());
    for (&(host, _), &g) in got.iter().zip(&guest_times) {
        // host = ceil((g - offset) * 2 / 3), the u128 reference.
        let want = (u128::from(g) - 1_000_000) * 2;
        let want = u64::try_from(want.div_ceil(3)).unwrap();
        assert_eq!(host, want, "guest {g}");
        // And it is the first host tick whose guest image reaches the event (the guest runs
        // faster, so some guest ticks have no exact host preimage).
        assert!(mapping.try_guest_from_host(HostTicks(want)).unwrap() >= GuestTicks(g));
        assert!(mapping.try_guest_from_host(HostTicks(want - 1)).unwrap() < GuestTicks(g));
    }
    assert_eq!(
        a.host_now_ceil(),
        mapping.try_host_from_guest_ceil(GuestTicks(a.clock_mut().tsc - 10))
    );

    // A mapping that cannot place the present on the host timeline is refused, and the
    // previous one stays in force: ratio 1 with 48 fraction bits sends host time past u64.
    let useless = KvmTscMapping::try_new(0, 1, 48).unwrap();
    assert_eq!(
        exchange(
            &mut a,
            &Message::SetMapping(MappingPush {
                vcpu: VCPU,
                mapping: useless
            })
        ),
        [Message::Error(ErrorCode::InvalidMapping)]
    );
    assert_eq!(a.mapping(), Some(mapping));
}

#[test]
fn a_record_the_mapping_cannot_convert_starts_a_guest_clock_batch() {
    let mut a = agent(1);
    open(&mut a);
    // The guest runs at half the host's rate: guest ticks above 2^63 map past the host's u64.
    let mapping = KvmTscMapping::try_new(0, 1 << 47, 48).unwrap();
    let push = Message::SetMapping(MappingPush {
        vcpu: VCPU,
        mapping,
    });
    assert_eq!(
        exchange(&mut a, &push),
        [Message::MappingApplied { vcpu: VCPU }]
    );
    assert!(record_at(&a, 1, 5000));
    assert!(record_at(&a, 2, u64::MAX - 10));
    assert!(record_at(&a, 3, 6000));
    let got = exchange(&mut a, &Message::EventsRequest { max: 10 });
    let batches: Vec<&EventBatch> = got
        .iter()
        .map(|m| match m {
            Message::Events(b) => b,
            other => panic!("{other:?}"),
        })
        .collect();
    let clocks: Vec<_> = batches.iter().map(|b| (b.clock, b.last)).collect();
    assert_eq!(
        clocks,
        [
            (EventClock::Host, false),
            (EventClock::Guest, false),
            (EventClock::Host, true)
        ]
    );
    assert_eq!(stamped(batches[0]), [(10_000, 1)]);
    assert_eq!(stamped(batches[1]), [(u64::MAX - 10, 2)]);
    assert_eq!(stamped(batches[2]), [(12_000, 3)]);
}

#[test]
fn events_come_in_bounded_batches_and_overflow_is_counted() {
    let mut a = agent(1);
    open(&mut a);
    let tsc = FakeTsc::new(T0, 7);
    for id in 0..300u16 {
        let queued = a
            .events()
            .view()
            .record(&tsc, id, &id.to_le_bytes())
            .is_ok();
        assert_eq!(queued, id < 256, "event {id}");
    }
    assert_eq!(a.waiting_events(), 256);
    let mut ids = Vec::new();
    let mut requests = 0;
    loop {
        let got = exchange(&mut a, &Message::EventsRequest { max: 100 });
        requests += 1;
        let mut sent = 0;
        for (i, m) in got.iter().enumerate() {
            let Message::Events(b) = m else {
                panic!("{got:?}")
            };
            assert_eq!(b.dropped, 44);
            assert!(b.records.len() <= EVENT_BATCH_MAX);
            // Only the answer's final batch is flagged.
            assert_eq!(b.last, i + 1 == got.len());
            for (t, r) in b.timestamped().map(Option::unwrap) {
                // Stamps are the recorder's TSC reads, 7 ticks apart; payloads intact.
                assert_eq!(t, T0 + 7 * u64::from(r.id));
                assert_eq!(r.payload.as_slice(), r.id.to_le_bytes());
                ids.push(r.id);
            }
            sent += b.records.len();
            assert_eq!(usize::try_from(b.remaining).unwrap(), 256 - ids.len());
        }
        // An answer holds at most `max` records.
        assert!(sent <= 100);
        if a.waiting_events() == 0 {
            break;
        }
    }
    assert_eq!(requests, 3);
    assert_eq!(ids, (0..256).collect::<Vec<_>>());
    // Nothing waiting: one empty, final batch.
    let got = exchange(&mut a, &Message::EventsRequest { max: 100 });
    assert!(
        matches!(got.as_slice(), [Message::Events(b)] if b.records.is_empty() && b.last),
        "{got:?}"
    );
}

#[test]
fn events_stay_queued_when_the_send_fails() {
    let mut a = agent(1);
    open(&mut a);
    assert!(record_at(&a, 5, T0));
    a.link_mut().refuse_sends = true;
    assert!(
        a.link_mut()
            .push_message(&Message::EventsRequest { max: 8 })
    );
    assert_eq!(a.poll(), Err(AgentError::Link(LinkError::WouldBlock)));
    assert_eq!(a.waiting_events(), 1);
    a.link_mut().refuse_sends = false;
    let got = exchange(&mut a, &Message::EventsRequest { max: 8 });
    assert!(matches!(got.as_slice(), [Message::Events(b)] if b.records.len() == 1));
    assert_eq!(a.waiting_events(), 0);
}

/// A drain of several batches goes to the link back to back and is flushed once, after the
/// last; records leave the ring only after that flush, so a failed flush keeps them all and
/// the next drain sends them again under the same `first` indices.
#[test]
fn a_drain_is_flushed_once_and_consumed_only_after_the_flush() {
    let mut a = agent(1);
    open(&mut a);
    for i in 0..200 {
        assert!(record_at(&a, 9, T0 + i));
    }
    let flushes = a.link().flushes;
    a.link_mut().refuse_flushes = true;
    assert!(
        a.link_mut()
            .push_message(&Message::EventsRequest { max: 200 })
    );
    assert_eq!(a.poll(), Err(AgentError::Link(LinkError::WouldBlock)));
    let firsts = |got: &[Message]| -> Vec<u64> {
        got.iter()
            .map(|m| match m {
                Message::Events(b) => b.first,
                other => panic!("{other:?}"),
            })
            .collect()
    };
    let lost = drain(&mut a);
    assert_eq!(firsts(&lost), [0, 64, 128, 192]);
    assert_eq!(a.waiting_events(), 200, "nothing consumed without a flush");
    assert_eq!(a.stats().events_out, 0);
    a.link_mut().refuse_flushes = false;
    let got = exchange(&mut a, &Message::EventsRequest { max: 200 });
    assert_eq!(
        firsts(&got),
        [0, 64, 128, 192],
        "resent under the same indices"
    );
    assert_eq!(
        a.link().flushes,
        flushes + 1,
        "one flush for the whole answer"
    );
    assert_eq!(a.waiting_events(), 0);
    assert_eq!(a.stats().events_out, 200);
}

fn flight_agent() -> Agent<FakeLink, FakeClock, &'static Ring<256>> {
    let ring: &'static Ring<256> = std::boxed::Box::leak(std::boxed::Box::new(Ring::new_flight()));
    Agent::with_events(FakeLink::new(), FakeClock::new(T0, 1, VCPU), ring)
}

/// A batch's (first, len, dropped, overwrite).
type BatchHead = (u64, usize, u64, bool);

/// The batches' heads and every record's payload index.
fn flight_batches(got: &[Message]) -> (Vec<BatchHead>, Vec<u64>) {
    let mut heads = Vec::new();
    let mut seqs = Vec::new();
    for m in got {
        let Message::Events(b) = m else {
            panic!("{m:?}")
        };
        heads.push((b.first, b.records.len(), b.dropped, b.overwrite));
        for (i, r) in b.records.iter().enumerate() {
            let seq = u64::from_le_bytes(r.payload.as_slice().try_into().unwrap());
            // A record's index is its position in the ring's sequence: the payload says so.
            assert_eq!(seq, b.first + i as u64);
            seqs.push(seq);
        }
    }
    (heads, seqs)
}

/// A flight ring recorded 10x its capacity before the host asked: the agent sends the newest
/// 256 under their own indices, each batch counting the overwritten records below it.
#[test]
fn a_lapped_flight_ring_sends_the_newest_records_and_counts_the_rest() {
    let mut a = flight_agent();
    open(&mut a);
    let tsc = FakeTsc::new(T0, 1);
    for seq in 0..2560u64 {
        a.events()
            .view()
            .record(&tsc, 1, &seq.to_le_bytes())
            .unwrap();
    }
    let got = exchange(&mut a, &Message::EventsRequest { max: 4096 });
    let (heads, seqs) = flight_batches(&got);
    assert_eq!(seqs, (2304..2560).collect::<Vec<_>>());
    assert_eq!(
        heads,
        [
            (2304, 64, 2304, true),
            (2368, 64, 2304, true),
            (2432, 64, 2304, true),
            (2496, 64, 2304, true)
        ]
    );
    assert_eq!(
        (a.waiting_events(), a.events().view().overwritten()),
        (0, 2304)
    );
}

/// An answer whose flush failed is sent again under the same indices, minus what the ring
/// overwrote meanwhile: those records were handed to the link once, so the ring does not
/// count them as overwritten (the host counts them lost in transit, from the gap); the
/// records it overwrote before ever sending them it counts.
#[test]
fn a_failed_flight_answer_is_resent_and_what_was_overwritten_meanwhile_counted_once() {
    let mut a = flight_agent();
    open(&mut a);
    let tsc = FakeTsc::new(T0, 1);
    let mut seq = 0u64;
    let mut record = |a: &TestAgent, n: u64| {
        for _ in 0..n {
            a.events()
                .view()
                .record(&tsc, 1, &seq.to_le_bytes())
                .unwrap();
            seq += 1;
        }
    };
    record(&a, 200);
    a.link_mut().refuse_flushes = true;
    assert!(
        a.link_mut()
            .push_message(&Message::EventsRequest { max: 128 })
    );
    assert_eq!(a.poll(), Err(AgentError::Link(LinkError::WouldBlock)));
    let (heads, _) = flight_batches(&drain(&mut a));
    assert_eq!(heads, [(0, 64, 0, true), (64, 64, 0, true)]);
    a.link_mut().refuse_flushes = false;
    // 300 more: records 0..244 are overwritten, of which 0..128 had been handed on.
    record(&a, 300);
    let got = exchange(&mut a, &Message::EventsRequest { max: 4096 });
    let (heads, seqs) = flight_batches(&got);
    assert_eq!(seqs, (244..500).collect::<Vec<_>>());
    assert_eq!(heads[0], (244, 64, 244 - 128, true));
    assert_eq!(a.events().view().overwritten(), 244 - 128);
}

#[test]
fn pvclock_report_or_unsupported() {
    let mut a = agent(3);
    open(&mut a);
    assert_eq!(
        exchange(&mut a, &Message::PvclockRequest),
        [Message::Error(ErrorCode::Unsupported)]
    );
    let page = PvclockReport {
        vcpu: VCPU,
        version: 4,
        tsc_timestamp: T0 - 100,
        system_time: 77,
        mul: 0x5555_5555,
        shift: 1,
        flags: 1,
        tsc: GuestTicks(0),
    };
    a.clock_mut().pvclock = Some(page);
    let now = a.clock_mut().tsc;
    assert_eq!(
        exchange(&mut a, &Message::PvclockRequest),
        [Message::PvclockReport(PvclockReport {
            tsc: GuestTicks(now),
            ..page
        })]
    );
    // With a pvclock page the next hello advertises it.
    match exchange(&mut a, &hello()).as_slice() {
        [Message::Capabilities(c)] => assert!(c.features.contains(Features::PVCLOCK)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn garbage_gets_an_error_and_the_next_frame_is_served() {
    let mut a = agent(1);
    open(&mut a);
    // Noise ending in a delimiter, then a probe.
    assert!(a.link_mut().push_inbound(&[0x42, 0xff, 0x13, 0x00]));
    assert!(a.link_mut().push_message(&Message::Probe { seq: 1 }));
    // An overlong run (no delimiter for more than a frame), then a probe.
    assert!(a.link_mut().push_inbound(&[0x07; MAX_FRAME_SIZE + 10]));
    assert!(a.link_mut().push_inbound(&[0x00]));
    assert!(a.link_mut().push_message(&Message::Probe { seq: 2 }));
    // Arrives three bytes at a time, so every frame spans several recv calls.
    a.link_mut().max_recv = 3;
    while a.link().inbound_len() > 0 {
        a.poll().unwrap();
    }
    let got = drain(&mut a);
    let kinds: Vec<_> = got
        .iter()
        .map(|m| match m {
            Message::Error(c) => Ok(*c),
            Message::ProbeReply(r) => Err(r.seq),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        kinds,
        [
            Ok(ErrorCode::Malformed),
            Err(1),
            Ok(ErrorCode::FrameTooLong),
            Err(2)
        ]
    );
    assert_eq!(a.stats().bad_frames, 2);
}

#[test]
fn guest_bound_messages_only_and_errors_are_not_answered() {
    let mut a = agent(1);
    open(&mut a);
    assert_eq!(
        exchange(&mut a, &Message::Exiting),
        [Message::Error(ErrorCode::Unexpected)]
    );
    assert_eq!(exchange(&mut a, &Message::Error(ErrorCode::Malformed)), []);
}

#[test]
fn shutdown_answers_exiting_and_stops() {
    let mut a = agent(1);
    open(&mut a);
    assert!(a.link_mut().push_message(&Message::Shutdown));
    assert!(a.link_mut().push_message(&Message::Probe { seq: 1 }));
    let exited = Ok(Poll {
        state: AgentState::Exited,
        next: PollAt::Never,
    });
    assert_eq!(a.poll(), exited);
    assert_eq!(drain(&mut a), [Message::Exiting]);
    assert_eq!(a.poll(), exited);
    assert_eq!(drain(&mut a), []);
}

/// `poll` says `Now` only while it stopped with input possibly waiting (its budget of
/// 16 × 64 bytes read), `Input` once the link ran dry.
#[test]
fn poll_says_when_it_needs_to_run_again() {
    let mut a = agent(1);
    let idle = |state| {
        Ok(Poll {
            state,
            next: PollAt::Input,
        })
    };
    assert_eq!(a.poll(), idle(AgentState::AwaitHello));
    open(&mut a);
    let mut probes = 0u32;
    while a.link().inbound_len() < RX_CHUNK * MAX_CHUNKS_PER_POLL + 1 {
        assert!(a.link_mut().push_message(&Message::Probe { seq: 1 }));
        probes += 1;
    }
    let first = a.poll().map(|p| p.next);
    assert_eq!(
        first,
        Ok(PollAt::Now),
        "the budget ran out with input waiting"
    );
    let mut answered = drain(&mut a).len();
    assert_eq!(a.poll(), idle(AgentState::Ready), "the rest fits one poll");
    answered += drain(&mut a).len();
    assert_eq!(answered, usize::try_from(probes).expect("small"));
}

proptest::proptest! {
    /// Arbitrary bytes, in arbitrary chunk sizes, never panic the agent, and once a delimiter
    /// has closed whatever they left open, the next probe is answered according to the state
    /// the garbage left (it may itself hold valid frames, such as a shutdown).
    #[test]
    fn arbitrary_input_then_probe(
        garbage in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
        chunk in 1usize..80,
        seq: u8,
    ) {
        let mut a = agent(5);
        open(&mut a);
        a.link_mut().max_recv = chunk;
        for piece in garbage.chunks(1000) {
            proptest::prop_assert!(a.link_mut().push_inbound(piece));
        }
        proptest::prop_assert!(a.link_mut().push_inbound(&[0]));
        while a.link().inbound_len() > 0 && a.state() != AgentState::Exited {
            let _ = a.poll();
        }
        drain(&mut a);
        let state = a.state();
        let answer = exchange(&mut a, &Message::Probe { seq });
        match state {
            AgentState::Ready => {
                let ok = matches!(
                    answer.as_slice(),
                    [Message::ProbeReply(r)] if r.seq == seq && r.vcpu == VCPU
                );
                proptest::prop_assert!(ok, "{:?}", answer);
            }
            AgentState::AwaitHello => {
                proptest::prop_assert_eq!(answer, [Message::Error(ErrorCode::NotReady)]);
            }
            AgentState::Exited => proptest::prop_assert_eq!(answer, []),
        }
    }
}

/// A unikernel's per-vCPU recorder: each vCPU's events come in batches naming that vCPU,
/// each queue counted on its own, the answer's `max` shared, the last batch flagged once, and
/// only the agent's own vCPU converted with the mapping pushed for it.
#[test]
fn a_recorder_s_vcpus_are_sent_queue_by_queue_each_counted_on_its_own() {
    let rec: &'static Recorder<4, 64> =
        std::boxed::Box::leak(std::boxed::Box::new(Recorder::new()));
    let mut a = Agent::with_events(FakeLink::new(), FakeClock::new(T0, 1, VCPU), rec);
    assert!(matches!(
        exchange(&mut a, &hello()).as_slice(),
        [Message::Capabilities(c)] if c.features.contains(Features::EVENTS)
    ));
    let at = |v: usize, id: u16, tsc: u64| {
        assert!(
            rec.ring(v)
                .unwrap()
                .record(&FakeTsc::new(tsc, 0), id, &[])
                .is_ok()
        );
    };
    for i in 0..3 {
        at(0, 10, T0 + 100 + i);
    }
    for i in 0..4 {
        at(2, 20, T0 + 200 + i);
    }
    at(3, 30, T0 + 300);
    assert_eq!(a.waiting_events(), 8);
    // vCPU 3 (the agent's own) gets a mapping: only its records may use it.
    let mapping = KvmTscMapping::offset_only(1_000);
    assert_eq!(
        exchange(
            &mut a,
            &Message::SetMapping(MappingPush {
                vcpu: VCPU,
                mapping
            })
        ),
        [Message::MappingApplied { vcpu: VCPU }]
    );
    let batches = |got: Vec<Message>| -> Vec<EventBatch> {
        got.into_iter()
            .map(|m| match m {
                Message::Events(b) => b,
                other => panic!("{other:?}"),
            })
            .collect()
    };
    // max 5: vCPU 0's three, then two of vCPU 2's four.
    let got = batches(exchange(&mut a, &Message::EventsRequest { max: 5 }));
    let shape: Vec<(u32, u64, usize, bool)> = got
        .iter()
        .map(|b| (b.vcpu, b.first, b.records.len(), b.last))
        .collect();
    assert_eq!(shape, [(0, 0, 3, false), (2, 0, 2, true)]);
    assert_eq!(got[0].clock, EventClock::Guest);
    assert_eq!(
        stamped(&got[0]),
        [(T0 + 100, 10), (T0 + 101, 10), (T0 + 102, 10)]
    );
    assert_eq!(got[1].remaining, 3, "two of vCPU 2 and one of vCPU 3 left");
    assert_eq!(a.waiting_events(), 3);
    // The rest: vCPU 2 from its third record on, then vCPU 3's, in the host clock.
    let got = batches(exchange(&mut a, &Message::EventsRequest { max: 100 }));
    let shape: Vec<(u32, u64, usize, bool)> = got
        .iter()
        .map(|b| (b.vcpu, b.first, b.records.len(), b.last))
        .collect();
    assert_eq!(shape, [(2, 2, 2, false), (3, 0, 1, true)]);
    assert_eq!(
        got[0].clock,
        EventClock::Guest,
        "vCPU 2's TSC is not vCPU 3's"
    );
    assert_eq!(stamped(&got[0]), [(T0 + 202, 20), (T0 + 203, 20)]);
    assert_eq!(got[1].clock, EventClock::Host);
    let host = mapping
        .try_host_from_guest_ceil(GuestTicks(T0 + 300))
        .unwrap();
    assert_eq!(stamped(&got[1]), [(host.0, 30)]);
    assert_eq!(a.stats().events_out, 8);
    // Nothing waiting: one empty last batch; a new record of vCPU 0 continues its own count.
    let got = batches(exchange(&mut a, &Message::EventsRequest { max: 100 }));
    assert!(got.len() == 1 && got[0].records.is_empty() && got[0].last);
    assert_eq!(
        (got[0].vcpu, got[0].first),
        (VCPU, 1),
        "an empty answer names the agent's own vCPU (its queue's count)"
    );
    at(0, 11, T0 + 400);
    let got = batches(exchange(&mut a, &Message::EventsRequest { max: 100 }));
    let shape: Vec<(u32, u64, usize, bool)> = got
        .iter()
        .map(|b| (b.vcpu, b.first, b.records.len(), b.last))
        .collect();
    assert_eq!(shape, [(0, 3, 1, true)]);
}
