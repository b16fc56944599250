//! Guest events for the trace pipeline, recorded into the agent's
//! `vmtsync_core::recorder::Ring`:
//!
//! - `events=N`: one event per handled message. The agent binary wraps its link in
//!   [`FramePerPoll`], so every `Agent::poll` handles at most one received frame, and calls
//!   [`MessageEvents::after_poll`] after each poll. A poll that handled a message (its reply
//!   already sent) records one event [`MESSAGE_EVENT`], stamped with the guest TSC right then,
//!   whose payload is the number of messages handled so far (`u32` LE). Event `k` therefore
//!   lies between the reply to message `k` and the agent's read of message `k + 1`, a bracket
//!   the host can check exactly.
//! - `workload=RATE,COUNT[,PORT]`: [`Workload`] emits [`WORKLOAD_EVENT`]s at RATE per second
//!   (COUNT of them, 0: until shutdown), each with its sequence number as payload (`u64` LE),
//!   between polls, so probes and event drains go on in the same session. With PORT, each
//!   event is recorded right before an `out` to PORT, and a second one
//!   ([`WORKLOAD_AFTER_IN_EVENT`], same payload) right after an `in` from PORT: the host's
//!   `kvm_pio` exits of that port bracket them, which checks the sync end to end.
//!
//! Without [`FramePerPoll`] a poll drains everything received, and on a fast host the next
//! request often arrives before the poll returns: several messages would share one event.

use core::sync::atomic::{AtomicBool, Ordering};

use vmtsync_core::agent::{Agent, AgentClock, Link, LinkError};
use vmtsync_core::arch::{PortIo, Tsc};
use vmtsync_core::proto::Transport;
use vmtsync_core::recorder::{EventSources, Mode, ReadError, Record, Recorder, Ring, RingRef};

/// Event id of a handled message (`events=N`).
pub const MESSAGE_EVENT: u16 = 1;
/// Event id of a probe answered on an application processor (`events=N`), recorded on that
/// vCPU right after its reply's TSC read; its payload is the probe's sequence number.
pub const AP_PROBE_EVENT: u16 = 2;
/// Event id of a workload event (`workload=`), recorded before the optional port write.
pub const WORKLOAD_EVENT: u16 = 0x100;
/// Event id recorded right after the workload's port read (`workload=RATE,COUNT,PORT`).
pub const WORKLOAD_AFTER_IN_EVENT: u16 = 0x101;

/// The agent's events as the protocol loop drains them: the boot vCPU's ring (the loop's own
/// `events=`/`workload=` record into it), then one ring per vCPU for the application
/// processors (ring N is APIC id N's; the boot vCPU's slot there stays empty), so each AP
/// records into a ring only it produces into.
#[derive(Debug)]
pub struct AgentEvents<'a, const BSP: usize, const VCPUS: usize, const AP: usize> {
    /// The boot vCPU's ring.
    pub bsp: &'a Ring<BSP>,
    /// The application processors' rings, by APIC id.
    pub aps: &'a Recorder<VCPUS, AP>,
}

impl<const BSP: usize, const VCPUS: usize, const AP: usize> EventSources
    for AgentEvents<'_, BSP, VCPUS, AP>
{
    fn queues(&self) -> usize {
        1 + self.aps.queues()
    }
    fn queue_vcpu(&self, q: usize) -> Option<u32> {
        q.checked_sub(1).and_then(|a| self.aps.queue_vcpu(a))
    }
    fn start_in(&self, q: usize) -> u64 {
        match q.checked_sub(1) {
            None => self.bsp.view().start(),
            Some(a) => self.aps.start_in(a),
        }
    }
    fn end_in(&self, q: usize) -> u64 {
        match q.checked_sub(1) {
            None => self.bsp.view().end(),
            Some(a) => self.aps.end_in(a),
        }
    }
    fn read_in(&self, q: usize, index: u64) -> Result<Record, ReadError> {
        match q.checked_sub(1) {
            None => self.bsp.view().read(index),
            Some(a) => self.aps.read_in(a, index),
        }
    }
    fn skip_in(&self, q: usize, from: u64, sent: u64) -> u64 {
        match q.checked_sub(1) {
            None => self.bsp.view().skip(from, sent),
            Some(a) => self.aps.skip_in(a, from, sent),
        }
    }
    fn release_in(&self, q: usize, end: u64) {
        match q.checked_sub(1) {
            None => self.bsp.view().release(end),
            Some(a) => self.aps.release_in(a, end),
        }
    }
    fn waiting_in(&self, q: usize) -> usize {
        match q.checked_sub(1) {
            None => self.bsp.view().len(),
            Some(a) => self.aps.waiting_in(a),
        }
    }
    fn dropped_in(&self, q: usize) -> u64 {
        match q.checked_sub(1) {
            None => self.bsp.view().dropped(),
            Some(a) => self.aps.dropped_in(a),
        }
    }
    fn overwrites_in(&self, q: usize) -> bool {
        match q.checked_sub(1) {
            None => self.bsp.view().mode() == Mode::Overwrite,
            Some(a) => self.aps.overwrites_in(a),
        }
    }
    fn records_events(&self) -> bool {
        true
    }
}

/// The boot vCPU's event ring in both modes, one of them picked at boot (`flight=`): both
/// are `static` storage (zeroed .bss), so the choice needs no heap and no `unsafe`.
#[derive(Debug)]
pub struct BootRing<const CAP: usize> {
    stop: Ring<CAP>,
    flight: Ring<CAP>,
    use_flight: AtomicBool,
}

impl<const CAP: usize> BootRing<CAP> {
    /// Both rings empty, the stop-when-full one in use.
    pub const fn new() -> Self {
        Self {
            stop: Ring::new(),
            flight: Ring::new_flight(),
            use_flight: AtomicBool::new(false),
        }
    }

    /// Picks the flight recorder (`true`) or the stop-when-full ring; call once at boot,
    /// before anything records.
    pub fn choose(&self, flight: bool) {
        self.use_flight.store(flight, Ordering::Relaxed);
    }

    /// The ring in use.
    pub fn ring(&self) -> &Ring<CAP> {
        if self.use_flight.load(Ordering::Relaxed) {
            &self.flight
        } else {
            &self.stop
        }
    }
}

impl<const CAP: usize> Default for BootRing<CAP> {
    fn default() -> Self {
        Self::new()
    }
}

/// A [`Link`] that ends each poll's input at the first frame delimiter (`0x00`): after it,
/// `recv` returns 0 until [`FramePerPoll::rearm`]. Bytes after the delimiter stay in the
/// inner link (it is read one byte at a time), so nothing is lost.
#[derive(Debug)]
pub struct FramePerPoll<L> {
    inner: L,
    frame_done: bool,
}

impl<L> FramePerPoll<L> {
    /// Wraps `inner`, ready to deliver one frame.
    pub const fn new(inner: L) -> Self {
        Self {
            inner,
            frame_done: false,
        }
    }

    /// Lets the next poll receive the next frame.
    pub fn rearm(&mut self) {
        self.frame_done = false;
    }

    /// The wrapped link.
    pub const fn inner(&self) -> &L {
        &self.inner
    }
}

impl<L: Link> Link for FramePerPoll<L> {
    #[inline]
    fn send(&mut self, frame: &[u8]) -> Result<(), LinkError> {
        self.inner.send(frame)
    }

    fn flush(&mut self) -> Result<(), LinkError> {
        self.inner.flush()
    }

    fn recv(&mut self, buf: &mut [u8]) -> Result<usize, LinkError> {
        let mut n = 0;
        for slot in buf.iter_mut() {
            if self.frame_done {
                break;
            }
            let mut b = [0u8; 1];
            if self.inner.recv(&mut b)? == 0 {
                break;
            }
            *slot = b[0];
            n += 1;
            self.frame_done = b[0] == 0;
        }
        Ok(n)
    }

    fn transport(&self) -> Transport {
        self.inner.transport()
    }
}

/// Records up to a budget of events, one per poll that handled a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageEvents {
    budget: u32,
    recorded: u32,
    handled: u32,
}

impl MessageEvents {
    /// At most `budget` events (0: none).
    pub const fn new(budget: u32) -> Self {
        Self {
            budget,
            recorded: 0,
            handled: 0,
        }
    }

    /// Call after every `agent.poll()`: records one event into `ring` if the poll handled
    /// messages and the budget allows. An event the full ring refuses still counts against
    /// the budget (the ring counts it as dropped, and the agent reports that in its batches).
    pub fn after_poll<L: Link, C: AgentClock, E, const CAP: usize>(
        &mut self,
        agent: &Agent<L, C, E>,
        ring: &Ring<CAP>,
        tsc: &impl Tsc,
    ) where
        E: EventSources,
    {
        let now = agent.stats().messages_in;
        if now != self.handled && self.recorded < self.budget {
            let _ = ring.view().record(tsc, MESSAGE_EVENT, &now.to_le_bytes());
            self.recorded += 1;
        }
        self.handled = now;
    }

    /// Events recorded (or dropped by a full queue) so far.
    pub const fn recorded(&self) -> u32 {
        self.recorded
    }
}

/// Events at a steady rate between polls (`workload=RATE,COUNT[,PORT]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    /// TSC ticks between two events (at least 1).
    period: u64,
    /// Events still to emit (`None`: until shutdown).
    left: Option<u64>,
    /// The TSC at which the next event is due.
    next_due: u64,
    /// The next event's sequence number.
    seq: u64,
    /// The port written before and read after each event, if any.
    port: Option<u16>,
}

/// At most this many overdue events are emitted per [`Workload::tick`], so a long stall (a
/// slow drain, a descheduled vCPU) cannot keep the agent from answering the host.
const MAX_BURST: u64 = 64;

impl Workload {
    /// `rate` events per second on a TSC of `tsc_khz`, `count` of them (0: unlimited),
    /// starting at TSC `now`; `None` when `rate` is 0.
    pub fn new(rate: u64, count: u64, port: Option<u16>, tsc_khz: u32, now: u64) -> Option<Self> {
        if rate == 0 {
            return None;
        }
        let period = (u64::from(tsc_khz) * 1000 / rate).max(1);
        Some(Self {
            period,
            left: (count != 0).then_some(count),
            next_due: now,
            seq: 0,
            port,
        })
    }

    /// Emits every event due by now (at most [`MAX_BURST`]); returns how many were recorded
    /// (refused ones are counted by the ring as dropped).
    pub fn tick(&mut self, ring: RingRef<'_>, tsc: &impl Tsc, io: &impl PortIo) -> u64 {
        let now = tsc.read_ordered();
        // Ticks by which the next event is overdue (negative: not yet due).
        let overdue = |due: u64| now.wrapping_sub(due).cast_signed();
        let mut n = 0;
        while self.left != Some(0) && n < MAX_BURST && overdue(self.next_due) >= 0 {
            let payload = self.seq.to_le_bytes();
            let _ = ring.record(tsc, WORKLOAD_EVENT, &payload);
            if let Some(port) = self.port {
                // The low byte of the sequence number travels with the exits, so the host can
                // pair exits with events.
                #[allow(clippy::cast_possible_truncation)]
                io.outb(port, self.seq as u8);
                let _ = io.inb(port);
                let _ = ring.record(tsc, WORKLOAD_AFTER_IN_EVENT, &payload);
            }
            self.seq += 1;
            if let Some(left) = &mut self.left {
                *left -= 1;
            }
            self.next_due = self.next_due.wrapping_add(self.period);
            n += 1;
        }
        // After a stall, start again from now rather than firing a long backlog.
        let backlog = i64::try_from(self.period.saturating_mul(MAX_BURST)).unwrap_or(i64::MAX);
        if overdue(self.next_due) > backlog {
            self.next_due = now;
        }
        n
    }

    /// Events emitted so far.
    pub const fn emitted(&self) -> u64 {
        self.seq
    }

    /// Whether every requested event was emitted.
    pub const fn done(&self) -> bool {
        matches!(self.left, Some(0))
    }
}

#[cfg(test)]
mod tests {
    use core::cell::RefCell;

    use vmtsync_core::agent::fake::{FakeClock, FakeLink};
    use vmtsync_core::arch::FakeTsc;
    use vmtsync_core::proto::{EventClock, Features, Hello, Message, PROTOCOL_VERSION};

    use super::*;

    type TestAgent = Agent<FramePerPoll<FakeLink>, FakeClock, &'static Ring<64>>;

    fn hello() -> Message {
        Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            features: Features::NONE,
        })
    }

    fn agent(link: FakeLink, clock: FakeClock) -> TestAgent {
        let ring: &'static Ring<64> = Box::leak(Box::new(Ring::new()));
        Agent::with_events(FramePerPoll::new(link), clock, ring)
    }

    /// Polls like the agent binary until the link has nothing left.
    fn run(agent: &mut TestAgent, ev: &mut MessageEvents, tsc: &FakeTsc) {
        while agent.link().inner().inbound_len() > 0 {
            agent.poll().expect("fake link works");
            let ring = *agent.events();
            ev.after_poll(agent, ring, tsc);
            agent.link_mut().rearm();
        }
    }

    #[test]
    fn frames_arriving_together_get_one_event_each_in_order() {
        let mut link = FakeLink::new();
        assert!(link.push_message(&hello()));
        for seq in 0..4 {
            assert!(link.push_message(&Message::Probe { seq }));
        }
        let mut agent = agent(link, FakeClock::new(1000, 10, 0));
        let mut ev = MessageEvents::new(100);
        let tsc = FakeTsc::new(5000, 3);
        run(&mut agent, &mut ev, &tsc);
        assert_eq!(ev.recorded(), 5);
        assert_eq!(agent.waiting_events(), 5);
        assert!(
            agent
                .link_mut()
                .inner
                .push_message(&Message::EventsRequest { max: 8 })
        );
        agent.poll().expect("poll");
        // Drain the five replies, then read the batch.
        let mut batch = None;
        while let Some(m) = agent.link_mut().inner.next_sent() {
            if let Ok(Message::Events(b)) = m {
                batch = Some(b);
            }
        }
        let b = batch.expect("an event batch");
        assert_eq!(b.clock, EventClock::Guest, "no mapping pushed");
        let recs: Vec<(u64, u16, u32)> = b
            .timestamped()
            .map(|r| {
                let (t, r) = r.unwrap();
                (
                    t,
                    r.id,
                    u32::from_le_bytes(r.payload.as_slice().try_into().unwrap()),
                )
            })
            .collect();
        let counts: Vec<u32> = recs.iter().map(|r| r.2).collect();
        assert_eq!(counts, vec![1, 2, 3, 4, 5]);
        assert!(recs.iter().all(|r| r.1 == MESSAGE_EVENT));
        let tscs: Vec<u64> = recs.iter().map(|r| r.0).collect();
        assert!(tscs.windows(2).all(|w| w[0] < w[1]), "{tscs:?}");
    }

    #[test]
    fn the_budget_caps_events_and_idle_polls_record_none() {
        let mut link = FakeLink::new();
        assert!(link.push_message(&hello()));
        assert!(link.push_message(&Message::Probe { seq: 1 }));
        assert!(link.push_message(&Message::Probe { seq: 2 }));
        let mut agent = agent(link, FakeClock::new(0, 1, 0));
        let mut ev = MessageEvents::new(2);
        let tsc = FakeTsc::new(0, 1);
        run(&mut agent, &mut ev, &tsc);
        for _ in 0..3 {
            agent.poll().expect("idle poll");
            let ring = *agent.events();
            ev.after_poll(&agent, ring, &tsc);
        }
        assert_eq!((ev.recorded(), agent.waiting_events()), (2, 2));
        assert_eq!(agent.stats().messages_in, 3);
    }

    /// Port I/O that logs what it did, interleaved with the ring's records.
    #[derive(Default)]
    struct IoLog(RefCell<Vec<(bool, u16, u8)>>);

    impl PortIo for IoLog {
        fn outb(&self, port: u16, v: u8) {
            self.0.borrow_mut().push((true, port, v));
        }
        fn inb(&self, port: u16) -> u8 {
            self.0.borrow_mut().push((false, port, 0));
            0
        }
    }

    #[test]
    fn the_workload_keeps_its_rate_count_and_sequence() {
        static RING: Ring<1024> = Ring::new();
        // 1 MHz TSC (1000 kHz), 1000 events/s: one event every 1000 ticks; the fake TSC
        // advances 10 ticks per read.
        let tsc = FakeTsc::new(0, 10);
        let mut w = Workload::new(1000, 5, None, 1000, 0).unwrap();
        let io = IoLog::default();
        let mut ticks = 0;
        while !w.done() {
            w.tick(RING.view(), &tsc, &io);
            ticks += 1;
            assert!(ticks < 10_000, "the workload never finished");
        }
        assert_eq!((w.emitted(), RING.view().len()), (5, 5));
        let recs: Vec<_> = core::iter::from_fn(|| RING.view().pop()).collect();
        for (i, r) in recs.iter().enumerate() {
            assert_eq!(r.id, WORKLOAD_EVENT);
            assert_eq!(r.payload(), (i as u64).to_le_bytes());
        }
        // Rate: consecutive events at least one period apart (they fire when due).
        assert!(
            recs.windows(2).all(|p| p[1].tsc.0 - p[0].tsc.0 >= 1000),
            "{recs:?}"
        );
        assert!(io.0.borrow().is_empty());
        assert_eq!(
            w.tick(RING.view(), &tsc, &io),
            0,
            "done means no more events"
        );
        assert!(Workload::new(0, 5, None, 1000, 0).is_none());
    }

    #[test]
    fn with_a_port_each_event_is_bracketed_by_an_out_and_an_in() {
        static RING: Ring<64> = Ring::new();
        let tsc = FakeTsc::new(0, 1);
        // Far more events due than one tick may emit: capped at MAX_BURST.
        let mut w = Workload::new(1_000_000, 0, Some(0x3f0), 1_000_000, 0).unwrap();
        let io = IoLog::default();
        tsc.advance(1_000_000_000);
        let n = w.tick(RING.view(), &tsc, &io);
        assert_eq!(n, MAX_BURST);
        let log = io.0.borrow();
        assert_eq!(log.len(), 2 * usize::try_from(n).unwrap());
        for (i, pair) in log.chunks(2).enumerate() {
            assert_eq!(
                pair,
                [(true, 0x3f0, u8::try_from(i).unwrap()), (false, 0x3f0, 0)]
            );
        }
        // Two records per event, before-out then after-in, same payload; the ring (64) holds
        // 32 events' worth, the rest were counted as dropped.
        let recs: Vec<_> = core::iter::from_fn(|| RING.view().pop()).collect();
        assert_eq!((recs.len() as u64, RING.view().dropped()), (64, 2 * n - 64));
        for (i, pair) in recs.chunks(2).enumerate() {
            assert_eq!(
                (pair[0].id, pair[1].id),
                (WORKLOAD_EVENT, WORKLOAD_AFTER_IN_EVENT)
            );
            assert_eq!(pair[0].payload(), (i as u64).to_le_bytes());
            assert_eq!(pair[1].payload(), pair[0].payload());
        }
    }

    #[test]
    fn recv_stops_after_the_delimiter_until_rearmed() {
        let mut link = FakeLink::new();
        assert!(link.push_inbound(&[1, 2, 0, 3, 0]));
        let mut l = FramePerPoll::new(link);
        let mut buf = [0u8; 8];
        assert_eq!(l.recv(&mut buf), Ok(3));
        assert_eq!(&buf[..3], &[1, 2, 0]);
        assert_eq!(l.recv(&mut buf), Ok(0));
        l.rearm();
        assert_eq!(l.recv(&mut buf), Ok(2));
        assert_eq!(&buf[..2], &[3, 0]);
        l.rearm();
        assert_eq!(l.recv(&mut buf), Ok(0));
        assert_eq!(l.transport(), Transport::Memory);
    }

    /// The boot vCPU's ring and the APs' rings drain as one source: the BSP's batches name the
    /// agent's own vCPU, each AP's its APIC id, each counted on its own.
    #[test]
    fn agent_events_drain_the_boot_ring_then_each_ap_ring() {
        let bsp: &'static Ring<64> = Box::leak(Box::new(Ring::new()));
        let aps: &'static Recorder<4, 8> = Box::leak(Box::new(Recorder::new()));
        let mut link = FakeLink::new();
        assert!(link.push_message(&hello()));
        let mut agent = Agent::with_events(
            FramePerPoll::new(link),
            FakeClock::new(1000, 10, 0),
            AgentEvents { bsp, aps },
        );
        assert!(
            bsp.view()
                .record(&FakeTsc::new(5, 0), MESSAGE_EVENT, &[])
                .is_ok()
        );
        assert!(
            aps.ring(2)
                .unwrap()
                .record(&FakeTsc::new(7, 0), AP_PROBE_EVENT, &[9])
                .is_ok()
        );
        assert!(
            aps.ring(3)
                .unwrap()
                .record(&FakeTsc::new(8, 0), AP_PROBE_EVENT, &[4])
                .is_ok()
        );
        assert_eq!(agent.waiting_events(), 3);
        assert!(
            agent
                .link_mut()
                .inner
                .push_message(&Message::EventsRequest { max: 10 })
        );
        while agent.link().inner().inbound_len() > 0 {
            agent.poll().expect("fake link works");
            agent.link_mut().rearm();
        }
        let mut got = Vec::new();
        while let Some(m) = agent.link_mut().inner.next_sent() {
            if let Message::Events(b) = m.expect("decodes") {
                let r = b.records.first().map(|r| r.id);
                got.push((b.vcpu, b.first, b.records.len(), r, b.last));
            }
        }
        assert_eq!(
            got,
            [
                (0, 0, 1, Some(MESSAGE_EVENT), false),
                (2, 0, 1, Some(AP_PROBE_EVENT), false),
                (3, 0, 1, Some(AP_PROBE_EVENT), true),
            ]
        );
        assert_eq!(agent.waiting_events(), 0);
    }
}
