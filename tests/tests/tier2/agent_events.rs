//! Tier 2: guest events (`events=N`) from the agent under the built-in VMM.
//!
//! With `events=N` the agent records, after each poll of its loop that handled messages, one
//! event whose payload is the number of messages handled so far. The host sends one request at a
//! time, so event `k` is recorded after the reply to message `k` went out and before the guest
//! read message `k + 1`: its TSC lies between the exit carrying that reply's first byte and the
//! exit where the guest read the next request, both taken to guest time through the truth
//! (KVM's debugfs mapping of the vCPU, `vmtsync_tests::truth`; nothing assumes this host's
//! guest TSC == host TSC, docs/host-quirks.md). Once that true mapping is pushed, the
//! host-stamped events lie inside the same exits' host TSC bracket. The host side is
//! vmtsync's `ProbeSession` over the VMM's COM1 transport.

use std::time::{Duration, Instant};

use vmtsync::probe::ProbeSession;
use vmtsync_core::HostTicks;
use vmtsync_core::proto::{EventBatch, EventClock, Features, MappingPush, Message};
use vmtsync_core::sim::median;
use vmtsync_tests::truth::{GuestTruth, truth_mapping_of};
use vmtsync_tests::vmm::client::{Com1Exchange, Com1Transport, wait_ready};
use vmtsync_tests::vmm::{Vm, VmConfig, VmExit, agent_elf};

use crate::util::{kvm_ready, kvm_truth_ready};

crate::trials!(
    kvm_truth_ready;
    builtin_vmm_agent_records_events_in_the_session_bracket_guest_then_host_stamped;
    kvm_ready;
    builtin_vmm_agent_stops_after_n_events,
    builtin_vmm_workload_overflows_the_ring_and_counts_every_drop,
    builtin_vmm_flight_recorder_keeps_the_newest_and_counts_every_overwrite,
);

const STEP: Duration = Duration::from_secs(20);

fn boot(cmdline: &str) -> Vm {
    let elf = agent_elf().expect("agent builds");
    let cfg = VmConfig {
        cmdline: cmdline.into(),
        timeout: Duration::from_secs(60),
        ..VmConfig::default()
    };
    Vm::boot(&elf, &cfg).expect("VM boots")
}

/// A session that keeps every exchange's stamps, so message `k` (1-based) is `log[k - 1]`.
struct Session<'a> {
    c: ProbeSession<Com1Transport<'a>>,
    log: Vec<Com1Exchange>,
}

impl<'a> Session<'a> {
    /// Waits for the beacon and greets the agent: message 1.
    fn start(vm: &'a Vm) -> Self {
        let mut t = Com1Transport::new(vm.com1());
        assert!(
            wait_ready(&mut t, Instant::now() + STEP).is_ok(),
            "log:\n{}",
            vm.log_text()
        );
        let c = ProbeSession::hello(t, STEP).expect("capabilities");
        let log = vec![c.transport().last_exchange()];
        Self { c, log }
    }

    fn ask(&mut self, msg: &Message) -> Message {
        let (reply, _) = self.c.request(msg).expect("reply");
        self.log.push(self.c.transport().last_exchange());
        reply
    }

    /// One probe through the session: full-width (`full`, no unwrap reference), or compact.
    fn probe(&mut self, full: bool) {
        if full {
            self.c.forget_reference();
        }
        let compact_before = self.c.stats().compact_samples;
        let sample = self.c.probe().expect("probe reply");
        assert!(sample.is_some(), "probe lost: {:?}", self.c.stats());
        // The reply had the width asked for: compact unless `full`.
        assert_eq!(
            self.c.stats().compact_samples - compact_before,
            u64::from(!full),
            "{:?}",
            self.c.stats()
        );
        self.log.push(self.c.transport().last_exchange());
    }

    /// Sends `EventsRequest { max }` (at most one batch's worth, so one batch answers it)
    /// until the agent says none remain; returns the events and the batches' `dropped`
    /// counters.
    fn drain(&mut self, max: u32) -> (Vec<Event>, Vec<u64>) {
        let (mut events, mut dropped) = (Vec::new(), Vec::new());
        loop {
            let b = self.batch(max);
            assert!(b.last, "one batch answers a request of {max}");
            assert!(b.records.len() <= usize::try_from(max).unwrap());
            events.extend(Event::all(&b));
            dropped.push(b.dropped);
            if b.remaining == 0 {
                return (events, dropped);
            }
        }
    }

    /// One `EventsRequest { max }` answered by one batch.
    fn batch(&mut self, max: u32) -> EventBatch {
        let Message::Events(b) = self.ask(&Message::EventsRequest { max }) else {
            panic!("expected an event batch, got {:?}", self.log.last())
        };
        assert_eq!(b.vcpu, 0);
        b
    }

    /// Checks event `e`'s TSC against the bracket of the poll that recorded it: host TSCs of
    /// VM exits, taken to guest time through `truth` for a guest-stamped event, as they are
    /// for a host-stamped one.
    fn check_bracket(&self, e: &Event, truth: &GuestTruth) {
        let k = usize::try_from(e.id).expect("small id");
        let after_reply = e.clock_at(self.log[k - 1].first_byte, truth);
        let before_next = e.clock_at(self.log[k].request_read, truth);
        assert!(
            after_reply <= e.tsc && e.tsc <= before_next,
            "event {e:?} outside [{after_reply}, {before_next}] ({truth:?})"
        );
    }
}

/// One `events=N` event: the message count in its payload, its timestamp and clock.
#[derive(Clone, Copy, Debug)]
struct Event {
    id: u32,
    tsc: u64,
    clock: EventClock,
}

impl Event {
    /// Host TSC `host` in this event's clock: through the truth for a guest-stamped event,
    /// as it is for a host-stamped one.
    fn clock_at(&self, host: u64, truth: &GuestTruth) -> u64 {
        match self.clock {
            EventClock::Guest => truth.guest_at(HostTicks(host)).expect("maps").0,
            EventClock::Host => host,
        }
    }

    /// This event's time in the guest clock: its TSC, or for a host-stamped event the truth's
    /// guest TSC at its host TSC.
    fn guest_time(&self, truth: &GuestTruth) -> u64 {
        match self.clock {
            EventClock::Guest => self.tsc,
            EventClock::Host => truth.guest_at(HostTicks(self.tsc)).expect("maps").0,
        }
    }

    fn all(b: &EventBatch) -> Vec<Self> {
        b.timestamped()
            .map(|r| {
                let (tsc, r) = r.expect("timestamps in range");
                assert_eq!(r.id, 1, "events=N records the message event");
                let id = u32::from_le_bytes(r.payload.as_slice().try_into().expect("u32 payload"));
                Self {
                    id,
                    tsc,
                    clock: b.clock,
                }
            })
            .collect()
    }
}

fn builtin_vmm_agent_records_events_in_the_session_bracket_guest_then_host_stamped() {
    let vm = boot("events=100 exit=0");
    let mut s = Session::start(&vm);
    let kvm = truth_mapping_of(vm.debugfs_id(), 0).expect("truth from debugfs");
    let truth = GuestTruth::new(kvm, None);
    assert!(
        s.c.info()
            .features
            .contains(Features::EVENTS.union(Features::MAPPING))
    );
    for _ in 0..10 {
        s.probe(true);
    }
    // Messages 1..=11 handled; the first drain (messages 12, 13) returns events 1..=12: a
    // batch of 8 (all the request asked for), then the rest, including the event of the first
    // drain request itself.
    let (guest_events, dropped) = s.drain(8);
    let ids: Vec<u32> = guest_events.iter().map(|e| e.id).collect();
    assert_eq!(ids, (1..=12).collect::<Vec<_>>(), "log:\n{}", vm.log_text());
    assert_eq!(dropped, vec![0, 0]);
    // Compared in guest time: across the push, host-stamped TSCs may be below guest-stamped
    // ones (a host whose guests' TSCs run ahead of its own).
    let mut prev = 0;
    for e in &guest_events {
        assert_eq!(
            e.clock,
            EventClock::Guest,
            "no mapping yet, but {e:?} is host-stamped"
        );
        let t = e.guest_time(&truth);
        assert!(t > prev, "event TSCs not increasing at {e:?}");
        prev = t;
        s.check_bracket(e, &truth);
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
    for _ in 10..15 {
        s.probe(true);
    }
    // Messages 13..=19 were handled since the last batch (13 is the first drain's last
    // request, 14 the mapping, 15..=19 probes); all leave stamped in the host clock.
    let (host_events, dropped) = s.drain(8);
    let ids: Vec<u32> = host_events.iter().map(|e| e.id).collect();
    assert_eq!(ids, (13..=19).collect::<Vec<_>>());
    assert_eq!(dropped, vec![0]);
    for e in &host_events {
        assert_eq!(
            e.clock,
            EventClock::Host,
            "mapping pushed, but {e:?} is guest-stamped"
        );
        let t = e.guest_time(&truth);
        assert!(t > prev, "event TSCs not increasing at {e:?}");
        prev = t;
        s.check_bracket(e, &truth);
    }
    let first = s.log[0].request_read;
    let last = s.log.last().expect("exchanges").first_byte;
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
                .map(|e| {
                    e.tsc
                        - e.clock_at(
                            s.log[usize::try_from(e.id).expect("id") - 1].first_byte,
                            &truth,
                        )
                })
                .collect();
            median(&mut gaps).unwrap_or_default()
        }
    );

    assert_eq!(s.ask(&Message::Shutdown), Message::Exiting);
    let out = vm.wait().expect("run ends");
    assert_eq!(out.exit, VmExit::DebugExit(0), "log:\n{}", out.log);
    assert_eq!(
        out.log_lines.last().map(|l| l.text.as_str()),
        Some(
            "shutdown after 15 probes, 21 messages, 0 bad frames, 21 events (0 workload, 19 \
             sent, 0 dropped): isa-debug-exit 0"
        ),
        "log:\n{}",
        out.log
    );
}

fn builtin_vmm_agent_stops_after_n_events() {
    let vm = boot("events=36 exit=0");
    // The capabilities came (or the hello would have failed): message 1.
    let mut s = Session::start(&vm);
    for _ in 0..40 {
        s.probe(false);
    }
    let (events, dropped) = s.drain(64);
    let ids: Vec<u32> = events.iter().map(|e| e.id).collect();
    assert_eq!(ids, (1..=36).collect::<Vec<_>>());
    assert_eq!(dropped, vec![0]);
    // N reached: more traffic records nothing.
    s.probe(false);
    let (events, dropped) = s.drain(8);
    assert!(events.is_empty(), "{events:?}");
    assert_eq!(dropped, vec![0]);
    assert_eq!(s.ask(&Message::Shutdown), Message::Exiting);
    assert_eq!(vm.wait().expect("run ends").exit, VmExit::DebugExit(0));
}

fn builtin_vmm_workload_overflows_the_ring_and_counts_every_drop() {
    // 5000 workload events with nobody draining: the ring (4096 records) keeps the first
    // 4096 and counts the other 904 as dropped, exactly.
    // Ring 3: bulk work, native there (the default ring 0 is emulated on these hosts).
    let vm = boot("ring=3 workload=1000000,5000 exit=0");
    let mut s = Session::start(&vm);
    // Wait (without draining: max 0) until the workload has emitted all 5000.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let b = s.batch(0);
        assert!(b.records.is_empty() && b.last);
        if u64::from(b.remaining) + b.dropped == 5000 {
            assert_eq!((b.remaining, b.dropped), (4096, 904));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "workload stuck: {b:?}\n{}",
            vm.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut seqs = Vec::new();
    let mut prev = 0;
    loop {
        let b = s.batch(64);
        assert_eq!(b.dropped, 904);
        for r in b.timestamped() {
            let (tsc, r) = r.expect("timestamps in range");
            assert_eq!(r.id, 0x100);
            assert!(tsc >= prev, "workload timestamps go back at {tsc}");
            prev = tsc;
            seqs.push(u64::from_le_bytes(
                r.payload.as_slice().try_into().expect("u64 payload"),
            ));
        }
        if b.remaining == 0 {
            break;
        }
    }
    // The first 4096 events, in order, each once.
    assert_eq!(seqs, (0..4096).collect::<Vec<_>>());
    assert_eq!(s.ask(&Message::Shutdown), Message::Exiting);
    let out = vm.wait().expect("run ends");
    assert_eq!(out.exit, VmExit::DebugExit(0), "log:\n{}", out.log);
    assert!(
        out.log.contains("(5000 workload, 4096 sent, 904 dropped)"),
        "log:\n{}",
        out.log
    );
}

fn builtin_vmm_flight_recorder_keeps_the_newest_and_counts_every_overwrite() {
    // 10x the ring's capacity (4096 records) with nobody attached: a flight ring keeps the
    // newest 4096 and the host learns exactly how many were overwritten. The truth is in the
    // payloads: each workload event carries its own sequence number.
    const RING: u64 = 4096;
    const PRODUCED: u64 = 10 * RING;
    // Ring 3: bulk work, native there (the default ring 0 is emulated on these hosts).
    let vm = boot(&format!(
        "ring=3 workload=10000000,{PRODUCED} flight=1 exit=0"
    ));
    // The agent is up (its beacon came), but the host says nothing until the workload is
    // over: at 10 M events/s it needs 4 ms of guest time (bursts of 64 between polls); two
    // seconds leave it a wide margin, and a workload still running would show below as
    // sequence numbers short of the last one.
    let mut t = Com1Transport::new(vm.com1());
    assert!(
        wait_ready(&mut t, Instant::now() + STEP).is_ok(),
        "log:\n{}",
        vm.log_text()
    );
    std::thread::sleep(Duration::from_secs(2));
    let c = ProbeSession::hello(t, STEP).expect("capabilities");
    let log = vec![c.transport().last_exchange()];
    let mut s = Session { c, log };
    let (mut seqs, mut batches) = (Vec::new(), Vec::new());
    loop {
        let b = s.batch(64);
        assert!(b.overwrite, "a flight ring's batch says so: {b:?}");
        let mut first_seq = None;
        for r in b.timestamped() {
            let (_, r) = r.expect("timestamps in range");
            assert_eq!(r.id, 0x100);
            let seq = u64::from_le_bytes(r.payload.as_slice().try_into().expect("u64 payload"));
            first_seq.get_or_insert(seq);
            seqs.push(seq);
        }
        if let Some(f) = first_seq {
            // Every workload event was stored (a flight ring is never full), so a record's
            // index in the ring is its sequence number.
            assert_eq!(b.first, f, "{b:?}");
            batches.push((b.first, b.records.len(), b.dropped));
        }
        if b.remaining == 0 {
            break;
        }
    }
    // Produced, from the guest's own sequence numbers: one past the newest received.
    let produced = seqs.last().map_or(0, |l| l + 1);
    assert_eq!(
        produced,
        PRODUCED,
        "the workload had not finished; log:\n{}",
        vm.log_text()
    );
    // The newest records, contiguous, each once.
    assert_eq!(seqs, (PRODUCED - RING..PRODUCED).collect::<Vec<_>>());
    // Exactly produced - received overwritten, all below the first batch.
    let received = seqs.len() as u64;
    for &(first, len, dropped) in &batches {
        assert_eq!(dropped, produced - received, "batch at {first} (+{len})");
    }
    assert_eq!(s.ask(&Message::Shutdown), Message::Exiting);
    let out = vm.wait().expect("run ends");
    assert_eq!(out.exit, VmExit::DebugExit(0), "log:\n{}", out.log);
    assert!(
        out.log.contains(&format!(
            "({PRODUCED} workload, {RING} sent, {} dropped)",
            PRODUCED - RING
        )),
        "log:\n{}",
        out.log
    );
}
