//! Tier 2: guest events (`events=N`) from the agent under the built-in VMM.
//!
//! With `events=N` the agent records, after each poll of its loop that handled messages, one
//! event whose id is the number of messages handled so far. The host sends one request at a
//! time, so event `k` is recorded after the reply to message `k` went out and before the guest
//! read message `k + 1`: its TSC lies between the exit carrying that reply's first byte and the
//! exit where the guest read the next request, both taken to guest time through the truth
//! (KVM's debugfs mapping of the vCPU, `vmtsync_tests::truth`). Once that true mapping is
//! pushed, the host-stamped events lie inside the same exits' host TSC bracket.

use std::time::Duration;

use vmtsync_core::HostTicks;
use vmtsync_core::proto::{
    EventRecord, EventStamp, Features, Hello, MappingPush, Message, PROTOCOL_VERSION,
};
use vmtsync_tests::truth::{GuestTruth, truth_mapping_of, truth_ready};
use vmtsync_tests::vmm::client::{Exchange, ProtoClient};
use vmtsync_tests::vmm::{Vm, VmConfig, VmExit, agent_elf};
use vmtsync_tests::{have_kvm, require};

const STEP: Duration = Duration::from_secs(20);

fn boot(test: &str, cmdline: &str) -> Option<Vm> {
    if !require(test, have_kvm(), "/dev/kvm is not accessible read-write") || !truth_ready(test) {
        return None;
    }
    let elf = agent_elf().expect("agent builds");
    let cfg = VmConfig {
        cmdline: cmdline.into(),
        timeout: Duration::from_secs(60),
        ..VmConfig::default()
    };
    Some(Vm::boot(&elf, &cfg).expect("VM boots"))
}

/// A client that keeps every exchange, so message `k` (1-based) is `log[k - 1]`.
struct Session<'a> {
    c: ProtoClient<'a>,
    log: Vec<Exchange>,
}

impl Session<'_> {
    fn ask(&mut self, msg: &Message) -> Message {
        let ex = self.c.exchange(msg, STEP).expect("reply");
        let reply = ex.reply.clone();
        self.log.push(ex);
        reply
    }

    /// Sends `EventsRequest { max }` until the agent says none remain; returns the events and
    /// the batches' `dropped` counters.
    fn drain(&mut self, max: u16) -> (Vec<EventRecord>, Vec<u32>) {
        let (mut events, mut dropped) = (Vec::new(), Vec::new());
        loop {
            let Message::Events(b) = self.ask(&Message::EventsRequest { max }) else {
                panic!("expected an event batch, got {:?}", self.log.last())
            };
            assert_eq!(b.vcpu, 0);
            assert!(b.events.len() <= usize::from(max));
            events.extend(b.events.iter().copied());
            dropped.push(b.dropped);
            if b.remaining == 0 {
                return (events, dropped);
            }
        }
    }

    /// Checks event `id`'s TSC against the bracket of the poll that recorded it: host TSCs
    /// of VM exits, taken to guest time through `truth` for a guest-stamped event (`Some`),
    /// as they are for a host-stamped one (`None`).
    fn check_bracket(&self, id: u32, tsc: u64, truth: Option<&GuestTruth>) {
        let k = usize::try_from(id).expect("small id");
        let map = |h: u64| truth.map_or(h, |t| t.guest_at(HostTicks(h)).expect("maps").0);
        let after_reply = map(self.log[k - 1].reply_first_byte_tsc);
        let before_next = map(self.log[k].request_read_tsc);
        assert!(
            after_reply <= tsc && tsc <= before_next,
            "event {id} at {tsc} outside [{after_reply}, {before_next}]"
        );
    }
}

fn hello() -> Message {
    Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        features: Features::NONE,
    })
}

#[test]
fn builtin_vmm_agent_records_events_in_the_session_bracket_guest_then_host_stamped() {
    let Some(vm) = boot(
        "builtin_vmm_agent_records_events_in_the_session_bracket_guest_then_host_stamped",
        "events=100 exit=0",
    ) else {
        return;
    };
    let mut s = Session {
        c: ProtoClient::new(vm.com1()),
        log: Vec::new(),
    };
    assert!(s.c.wait_ready(STEP), "log:\n{}", vm.log_text());
    let kvm = truth_mapping_of(vm.debugfs_id(), 0).expect("truth from debugfs");
    let truth = GuestTruth::new(kvm, None);
    let Message::Capabilities(k) = s.ask(&hello()) else {
        panic!("no capabilities")
    };
    assert!(
        k.features
            .contains(Features::EVENTS.union(Features::MAPPING))
    );
    for seq in 0..10 {
        assert!(matches!(
            s.ask(&Message::ProbeFull { seq }),
            Message::ProbeReplyFull(_)
        ));
    }
    // Messages 1..=11 handled; the first drain (messages 12, 13) returns events 1..=12: a
    // full batch of 8, then the rest, including the event of the first drain request itself.
    let (guest_events, dropped) = s.drain(8);
    let ids: Vec<u32> = guest_events.iter().map(|e| e.id).collect();
    assert_eq!(ids, (1..=12).collect::<Vec<_>>(), "log:\n{}", vm.log_text());
    assert_eq!(dropped, vec![0, 0]);
    let mut prev = 0;
    for e in &guest_events {
        let EventStamp::Guest(t) = e.stamp else {
            panic!("no mapping yet, but {e:?} is host-stamped")
        };
        assert!(t.0 > prev, "event TSCs not increasing at {e:?}");
        prev = t.0;
        s.check_bracket(e.id, t.0, Some(&truth));
    }

    // KVM's mapping from debugfs is the truth: push it.
    let push = MappingPush {
        vcpu: 0,
        mapping: kvm,
    };
    assert_eq!(
        s.ask(&Message::SetMapping(push)),
        Message::MappingApplied { vcpu: 0 }
    );
    for seq in 10..15 {
        assert!(matches!(
            s.ask(&Message::ProbeFull { seq }),
            Message::ProbeReplyFull(_)
        ));
    }
    // Messages 13..=19 were handled since the last batch (13 is the first drain's last
    // request, 14 the mapping, 15..=19 probes); all leave stamped in the host clock.
    let (host_events, dropped) = s.drain(8);
    let ids: Vec<u32> = host_events.iter().map(|e| e.id).collect();
    assert_eq!(ids, (13..=19).collect::<Vec<_>>());
    assert_eq!(dropped, vec![0]);
    for e in &host_events {
        let EventStamp::Host(h) = e.stamp else {
            panic!("mapping pushed, but {e:?} is guest-stamped")
        };
        assert!(h.0 > prev, "event TSCs not increasing at {e:?}");
        prev = h.0;
        s.check_bracket(e.id, h.0, None);
    }
    let first = s.log[0].request_read_tsc;
    let last = s.log.last().expect("exchanges").reply_first_byte_tsc;
    let reply_at = |id: u32, guest_stamped: bool| {
        let h = s.log[usize::try_from(id).expect("id") - 1].reply_first_byte_tsc;
        if guest_stamped {
            truth.guest_at(HostTicks(h)).expect("maps").0
        } else {
            h
        }
    };
    eprintln!(
        "19 events ({} guest-, {} host-stamped) within a session of {} cycles; median gap \
         reply -> event {} cycles",
        guest_events.len(),
        host_events.len(),
        last - first,
        {
            let mut gaps: Vec<u64> = guest_events
                .iter()
                .chain(&host_events)
                .map(|e| match e.stamp {
                    EventStamp::Guest(t) => t.0 - reply_at(e.id, true),
                    EventStamp::Host(h) => h.0 - reply_at(e.id, false),
                })
                .collect();
            gaps.sort_unstable();
            gaps[gaps.len() / 2]
        }
    );

    assert_eq!(s.ask(&Message::Shutdown), Message::Exiting);
    let out = vm.wait().expect("run ends");
    assert_eq!(out.exit, VmExit::DebugExit(0), "log:\n{}", out.log);
    assert_eq!(
        out.log_lines.last().map(|l| l.text.as_str()),
        Some("shutdown after 15 probes, 21 messages, 0 bad frames, 21 events: isa-debug-exit 0"),
        "log:\n{}",
        out.log
    );
}

#[test]
fn builtin_vmm_agent_stops_after_n_events_and_counts_drops_past_its_queue() {
    // The agent's queue holds 32 events: 36 recorded before the first drain lose 4.
    let Some(vm) = boot(
        "builtin_vmm_agent_stops_after_n_events_and_counts_drops_past_its_queue",
        "events=36 exit=0",
    ) else {
        return;
    };
    let mut s = Session {
        c: ProtoClient::new(vm.com1()),
        log: Vec::new(),
    };
    assert!(s.c.wait_ready(STEP), "log:\n{}", vm.log_text());
    assert!(matches!(s.ask(&hello()), Message::Capabilities(_)));
    for seq in 0..35 {
        assert!(matches!(
            s.ask(&Message::Probe { seq }),
            Message::ProbeReply(_)
        ));
    }
    let (events, dropped) = s.drain(8);
    let ids: Vec<u32> = events.iter().map(|e| e.id).collect();
    assert_eq!(ids, (1..=32).collect::<Vec<_>>());
    assert_eq!(dropped, vec![4; 4]);
    // N reached: more traffic records nothing.
    assert!(matches!(
        s.ask(&Message::Probe { seq: 99 }),
        Message::ProbeReply(_)
    ));
    let (events, dropped) = s.drain(8);
    assert!(events.is_empty(), "{events:?}");
    assert_eq!(dropped, vec![4]);
    assert_eq!(s.ask(&Message::Shutdown), Message::Exiting);
    assert_eq!(vm.wait().expect("run ends").exit, VmExit::DebugExit(0));
}
