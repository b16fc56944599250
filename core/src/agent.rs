//! The transport-agnostic guest agent: a state machine that answers the host's probe protocol.
//!
//! The agent owns a [`Link`] (bytes in and out, non-blocking) and an [`AgentClock`] (the
//! guest TSC, the vCPU id, optionally the pvclock page). The embedding code (a unikernel main
//! loop, the bare-metal `vmtsync-agent`, a test) calls [`Agent::poll`] whenever it likes;
//! each call drains what the link has received, answers every complete request, and returns.
//! Nothing blocks and nothing allocates: the receive buffer and the frame being sent are
//! fixed-size arrays inside the agent or on the stack. Events come from [`EventSources`]: a
//! [`crate::recorder::Ring`] the application records into (the agent's own vCPU), or a
//! [`crate::recorder::Recorder`] with one ring per vCPU; the agent drains them, queue by
//! queue, into [`Message::Events`] batches that name their vCPU when the host asks.
//!
//! Sessions: the agent answers nothing but [`Message::Hello`] and [`Message::Shutdown`]
//! until a hello with its [`PROTOCOL_VERSION`] arrives (others get
//! [`ErrorCode::NotReady`]). After [`Message::Shutdown`] it answers [`Message::Exiting`] and
//! stops reading.
//!
//! Probe latency: a probe reply is encoded up to the TSC bytes before the TSC is read
//! ([`ProbeReplyFrame`]), so between the read and the link's send there are only a few byte
//! stores. On nested KVM every guest ring-0 instruction costs about 1 µs (docs/host-quirks.md): that
//! path length is the probe's error.
//!
//! Garbage on the link (noise, a peer speaking another protocol, an overlong frame) is
//! answered with one [`ErrorCode::Malformed`] or [`ErrorCode::FrameTooLong`] per bad frame;
//! the receiver resynchronizes on the next `0x00` delimiter.

use crate::mapping::KvmTscMapping;
use crate::proto::{
    Capabilities, DecodeError, EVENT_BATCH_MAX, ErrorCode, EventBatch, EventClock, Features, Feed,
    FrameReceiver, MAX_FRAME_SIZE, Message, PROTOCOL_VERSION, ProbeReplyFrame, PvclockReport,
    Transport, encode_frame,
};
use crate::recorder::{EventSources, MAX_EVENT_SOURCES, NoEvents, ReadError};
use crate::units::{GuestTicks, HostTicks};

#[cfg(any(test, feature = "sim"))]
pub mod fake;

/// A byte link to the host (UART, virtio-vsock, shared memory).
///
/// # Contract
///
/// An implementation (e.g. [`crate::arch::uart16550::Uart16550`], the bundled agent's vsock
/// stream, a test's [`fake::FakeLink`]) promises:
///
/// - **Whole frames or nothing.** [`Link::send`] takes one complete frame (COBS, its `0x00`
///   delimiter last) and either accepts all of it or refuses it with an error having sent
///   none of it; the host never sees half a frame from a refused send. A link that shares its
///   wire with other bytes (console text) delimits each frame on both sides, so those bytes
///   never merge into a frame (see [`crate::arch::uart16550`]).
/// - **Never blocks on the host.** No call waits for the peer to answer, read or grant
///   credit: a full queue is [`LinkError::WouldBlock`]. Waiting on the local device for as
///   long as it takes to accept a byte (a UART's THRE between two bytes) is allowed; the
///   caller's loop is what it stalls, so keep it short.
/// - **In order.** Frames leave in the order they were sent, received bytes are returned in
///   the order they arrived, none twice, none skipped (a byte the device lost is lost: the
///   frame fails its CRC and the host asks again).
/// - **[`Link::flush`]** pushes out everything [`Link::send`] held back, in order; after it
///   returns `Ok` every accepted frame is on its way to the host. A link that sends at once
///   holds nothing back and keeps the default.
///
/// # What the host infers from its exits
///
/// When the host brackets a probe reply's TSC read with the VM exits of the link's device
/// (`--anchor kvm-pio`: KVM stamps every port I/O with the host TSC), it trusts exactly two
/// facts, both implied by the protocol rather than by this link's habits:
///
/// - the device access that hands the agent the **last byte of the request** (a UART's read
///   of its delimiter) precedes the TSC read: the agent cannot answer a request it has not
///   received;
/// - the device access that carries the **first byte of the reply** out (a UART's `out` of
///   it) follows the read: the reply holds the value read.
///
/// Anything else may happen in between: status polls, other devices' I/O, console text, the
/// link's own bookkeeping. None of it may be taken as a bound, so none of it can break one; a
/// link only makes the bracket narrow by doing little between the read and the first byte's
/// exit (see [`crate::arch::uart16550::TxOrder`]). The agent reads the TSC after the whole
/// request is decoded and hands the reply to [`Link::send`] right after, followed by
/// [`Link::flush`].
///
/// # Flushing
///
/// A link may hold frames back until [`Link::flush`] (a packet link, where every send costs a
/// round trip to the device, coalesces them); the agent flushes after each message it answers,
/// right after a probe reply, and after the last batch of an event drain, so a drain of many
/// batches can leave in a few packets.
pub trait Link {
    /// Sends one complete frame (delimiter included), or refuses it whole, without waiting on
    /// the host. A link that buffers may keep it until [`Link::flush`] (or until its buffer
    /// needs the room), always in order.
    ///
    /// # Errors
    /// [`LinkError`] if the frame cannot go out now; the agent drops it (a probe reply sent
    /// later would carry a stale TSC, and the host re-asks on timeout).
    fn send(&mut self, frame: &[u8]) -> Result<(), LinkError>;

    /// Sends every frame [`Link::send`] held back. The default does nothing: a link that sends
    /// at once has nothing to flush.
    ///
    /// # Errors
    /// [`LinkError`] if the held frames cannot go out; they are dropped (whatever they
    /// carried is asked for again: a probe on timeout, events by their `first` index).
    fn flush(&mut self) -> Result<(), LinkError> {
        Ok(())
    }

    /// Copies received bytes into `buf`, in arrival order; returns how many (0 at once when
    /// nothing is pending: it never waits for bytes).
    ///
    /// # Errors
    /// [`LinkError`] if the link failed; [`Agent::poll`] returns it.
    fn recv(&mut self, buf: &mut [u8]) -> Result<usize, LinkError>;

    /// Which transport this is, reported in [`Capabilities`].
    fn transport(&self) -> Transport;
}

/// Why a [`Link`] call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum LinkError {
    /// No room to send right now (e.g. no vsock credit); try later.
    WouldBlock,
    /// The peer or the device went away.
    Closed,
    /// The device reported an error.
    Io,
}

/// The guest clocks the agent reads. The real implementation sits on `crate::arch`; tests use
/// [`fake::FakeClock`].
pub trait AgentClock {
    /// Reads the guest TSC (serialized: `lfence; rdtsc` or `rdtscp`).
    fn read_tsc(&mut self) -> GuestTicks;

    /// The id of the vCPU this code runs on (the APIC id KVM names `vcpuN` after).
    fn vcpu_id(&self) -> u32;

    /// The TSC frequency in kHz, if known (CPUID leaf 0x15 / 0x4000_0010, or pvclock).
    fn tsc_khz(&self) -> Option<u32> {
        None
    }

    /// A consistent pvclock snapshot with the TSC read inside it, if the vCPU has a
    /// registered kvmclock page.
    fn pvclock(&mut self) -> Option<PvclockReport> {
        None
    }

    /// Whether the TSC is invariant (CPUID 0x8000_0007 EDX bit 8).
    fn invariant_tsc(&self) -> bool {
        false
    }

    /// The TSC read of a probe reply with sequence number `seq`. A clock with a sync port
    /// brackets it by port I/O the host's exits can see ([`Features::SYNC_PORT`]); the
    /// default is [`AgentClock::read_tsc`].
    fn read_tsc_for_probe(&mut self, seq: u8) -> GuestTicks {
        let _ = seq;
        self.read_tsc()
    }

    /// Whether [`AgentClock::read_tsc_for_probe`] brackets its read on a sync port.
    fn sync_port(&self) -> bool {
        false
    }

    /// The vCPUs [`AgentClock::read_tsc_on`] can read, as a bit set (bit `i`: vCPU `i`).
    /// Default: the vCPU this code runs on, alone.
    fn vcpus(&self) -> u64 {
        1u64.checked_shl(self.vcpu_id()).unwrap_or(0)
    }

    /// The TSC read of probe `seq` ON vCPU `vcpu` (skewed like [`AgentClock::read_tsc`], and
    /// bracketed by that vCPU's own sync-port I/O like [`AgentClock::read_tsc_for_probe`]),
    /// after this call began and before it returns, or `None` when that vCPU cannot answer
    /// (unknown, or it did not answer in time). Default: this vCPU only.
    fn read_tsc_on(&mut self, vcpu: u32, seq: u8) -> Option<GuestTicks> {
        (vcpu == self.vcpu_id()).then(|| self.read_tsc_for_probe(seq))
    }
}

/// Where the agent is in its session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum AgentState {
    /// Waiting for a hello with a matching protocol version.
    AwaitHello,
    /// Serving requests.
    Ready,
    /// Shut down by the host; [`Agent::poll`] does nothing more.
    Exited,
}

/// When the agent next needs [`Agent::poll`] (like smoltcp's `Interface::poll_delay`).
///
/// The agent has no timed work of its own: it answers requests, so it needs to run when
/// bytes arrive. How late that may be is up to the kernel: a late poll delays the reply (the
/// host re-asks a probe after its timeout) but widens no exit-anchored bracket, whose lower
/// end is the read of the request's last byte, which a late poll also makes late.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum PollAt {
    /// Right away: this poll read its budget of input (16 × 64 bytes) without the link
    /// running dry, so more may be waiting.
    Now,
    /// When the link has received bytes: the last `recv` returned nothing and nothing else is
    /// pending. A kernel whose link raises an interrupt may sleep until it; one that polls
    /// (a UART with interrupts off) polls again at its own pace.
    Input,
    /// Never: the host shut the session down ([`AgentState::Exited`]).
    Never,
}

/// What one [`Agent::poll`] left behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Poll {
    /// The session state after the last message handled.
    pub state: AgentState,
    /// When the agent next needs a poll.
    pub next: PollAt,
}

/// Why [`Agent::poll`] failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum AgentError {
    /// The link failed to receive or to send a reply (the first such failure of the poll).
    Link(LinkError),
}

/// Counters for logs and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct AgentStats {
    /// Frames received that decoded to a message.
    pub messages_in: u32,
    /// Frames sent.
    pub frames_out: u32,
    /// Received frames that did not decode (each answered with an error).
    pub bad_frames: u32,
    /// Probes answered (compact and full).
    pub probes: u32,
    /// Event records sent.
    pub events_out: u64,
}

/// Records waiting in every queue of `e`.
fn waiting<E: EventSources>(e: &E) -> usize {
    (0..e.queues().min(MAX_EVENT_SOURCES))
        .map(|q| e.waiting_in(q))
        .sum()
}

/// Bytes read from the link per `recv` call.
const RX_CHUNK: usize = 64;
/// `recv` calls per [`Agent::poll`] at most, so a chatty link cannot starve the caller.
const MAX_CHUNKS_PER_POLL: usize = 16;

/// The agent: protocol state, the pushed mapping, and the source of its events.
pub struct Agent<L, C, E = NoEvents> {
    link: L,
    clock: C,
    rx: FrameReceiver,
    state: AgentState,
    mapping: Option<KvmTscMapping>,
    events: E,
    /// Per event queue, the end of the records ever handed to the link (one past the highest
    /// index): a record below it that is overwritten before a successful send was sent at
    /// least once, so its queue does not count it as overwritten (the host counts it lost).
    sent_end: [u64; MAX_EVENT_SOURCES],
    stats: AgentStats,
}

impl<L, C, E: EventSources> core::fmt::Debug for Agent<L, C, E> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Agent")
            .field("state", &self.state)
            .field("mapping", &self.mapping)
            .field("waiting_events", &waiting(&self.events))
            .field("queues", &self.events.queues())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<L: Link, C: AgentClock> Agent<L, C, NoEvents> {
    /// An agent without events, waiting for the host's hello.
    pub const fn new(link: L, clock: C) -> Self {
        Self::with_events(link, clock, NoEvents)
    }
}

impl<L: Link, C: AgentClock, E: EventSources> Agent<L, C, E> {
    /// An agent that drains `events` when the host asks, waiting for the host's hello.
    pub const fn with_events(link: L, clock: C, events: E) -> Self {
        Self {
            link,
            clock,
            rx: FrameReceiver::new(),
            state: AgentState::AwaitHello,
            mapping: None,
            events,
            sent_end: [0; MAX_EVENT_SOURCES],
            stats: AgentStats {
                messages_in: 0,
                frames_out: 0,
                bad_frames: 0,
                probes: 0,
                events_out: 0,
            },
        }
    }

    /// Drains received bytes (at most 16 × 64 per call) and answers every complete request.
    /// Returns the state after the last message handled and when the agent next needs a poll
    /// ([`PollAt`]).
    ///
    /// # Errors
    /// [`AgentError::Link`] for a failed `recv` (returned at once) or the first failed `send`
    /// (the remaining input is still handled).
    pub fn poll(&mut self) -> Result<Poll, AgentError> {
        let mut first_err = None;
        let mut chunk = [0u8; RX_CHUNK];
        // Until the link runs dry, more input may be waiting.
        let mut next = PollAt::Now;
        for _ in 0..MAX_CHUNKS_PER_POLL {
            if self.state == AgentState::Exited {
                break;
            }
            let n = self.link.recv(&mut chunk).map_err(AgentError::Link)?;
            if n == 0 {
                next = PollAt::Input;
                break;
            }
            let mut input = chunk.get(..n).unwrap_or_default();
            while self.state != AgentState::Exited {
                let sent = match self.rx.feed(input) {
                    Feed::Consumed => break,
                    Feed::Message { msg, rest } => {
                        input = rest;
                        self.stats.messages_in = self.stats.messages_in.wrapping_add(1);
                        let handled = self.handle(msg);
                        let flushed = self.link.flush();
                        handled.and(flushed)
                    }
                    Feed::Error { error, rest } => {
                        input = rest;
                        self.stats.bad_frames = self.stats.bad_frames.wrapping_add(1);
                        let code = match error {
                            DecodeError::FrameTooLong => ErrorCode::FrameTooLong,
                            _ => ErrorCode::Malformed,
                        };
                        let sent = self.send(&Message::Error(code));
                        sent.and(self.link.flush())
                    }
                };
                if let Err(e) = sent {
                    first_err.get_or_insert(e);
                }
            }
        }
        if self.state == AgentState::Exited {
            next = PollAt::Never;
        }
        match first_err {
            Some(e) => Err(AgentError::Link(e)),
            None => Ok(Poll {
                state: self.state,
                next,
            }),
        }
    }

    /// The host TSC now, rounded up, via the pushed mapping; `None` without a mapping or if
    /// the conversion does not fit.
    pub fn host_now_ceil(&mut self) -> Option<HostTicks> {
        let mapping = self.mapping?;
        mapping.try_host_from_guest_ceil(self.clock.read_tsc())
    }

    /// The mapping the host pushed for this vCPU, if any.
    pub const fn mapping(&self) -> Option<KvmTscMapping> {
        self.mapping
    }

    /// The session state.
    pub const fn state(&self) -> AgentState {
        self.state
    }

    /// Counters since creation.
    pub const fn stats(&self) -> AgentStats {
        self.stats
    }

    /// Events waiting to be sent, in every queue.
    pub fn waiting_events(&self) -> usize {
        waiting(&self.events)
    }

    /// The event source (e.g. the ring to record into).
    pub const fn events(&self) -> &E {
        &self.events
    }

    /// The link (e.g. to inspect a fake).
    pub const fn link(&self) -> &L {
        &self.link
    }

    /// The link, mutably (e.g. to feed a fake).
    pub const fn link_mut(&mut self) -> &mut L {
        &mut self.link
    }

    /// The clock, mutably (e.g. to advance a fake).
    pub const fn clock_mut(&mut self) -> &mut C {
        &mut self.clock
    }

    /// Takes the agent apart.
    pub fn into_parts(self) -> (L, C) {
        (self.link, self.clock)
    }

    /// Answers one message.
    fn handle(&mut self, msg: Message) -> Result<(), LinkError> {
        match msg {
            Message::Hello(hello) => self.on_hello(hello.version),
            Message::Shutdown => {
                self.state = AgentState::Exited;
                self.send(&Message::Exiting)
            }
            // Never answer an error with an error: two confused peers would ping-pong forever.
            Message::Error(_) => Ok(()),
            _ if self.state != AgentState::Ready => self.send(&Message::Error(ErrorCode::NotReady)),
            // One probe path for every vCPU, this one included: the agent's .text is budgeted.
            Message::Probe { seq } => self.send_probe_reply(seq, self.clock.vcpu_id(), false),
            Message::ProbeFull { seq } => self.send_probe_reply(seq, self.clock.vcpu_id(), true),
            Message::SetMapping(push) => {
                let vcpu = self.clock.vcpu_id();
                let reply = if push.vcpu != vcpu {
                    Message::Error(ErrorCode::UnknownVcpu)
                } else if push
                    .mapping
                    .try_host_from_guest_ceil(self.clock.read_tsc())
                    .is_none()
                {
                    // It cannot place even the present on the host timeline: keep the old one.
                    Message::Error(ErrorCode::InvalidMapping)
                } else {
                    self.mapping = Some(push.mapping);
                    Message::MappingApplied { vcpu }
                };
                self.send(&reply)
            }
            Message::PvclockRequest => {
                let reply = match self.clock.pvclock() {
                    Some(report) => Message::PvclockReport(report),
                    None => Message::Error(ErrorCode::Unsupported),
                };
                self.send(&reply)
            }
            Message::EventsRequest { max } => self.send_events(max),
            Message::ProbeOn { seq, vcpu, full } => self.send_probe_reply(seq, vcpu, full),
            Message::VcpusRequest => {
                let online = self.clock.vcpus();
                self.send(&Message::Vcpus { online })
            }
            Message::Capabilities(_)
            | Message::Vcpus { .. }
            | Message::ProbeReply(_)
            | Message::ProbeReplyFull(_)
            | Message::MappingApplied { .. }
            | Message::PvclockReport(_)
            | Message::Events(_)
            | Message::Exiting => self.send(&Message::Error(ErrorCode::Unexpected)),
        }
    }

    fn on_hello(&mut self, version: u16) -> Result<(), LinkError> {
        let mut features = Features::MAPPING;
        if self.events.records_events() {
            features = features.union(Features::EVENTS);
        }
        // A new session starts from the guest clock: a mapping pushed in an earlier session
        // (perhaps by another tool) would otherwise stamp every event in a clock this host
        // did not ask for.
        self.mapping = None;
        if self.clock.pvclock().is_some() {
            features = features.union(Features::PVCLOCK);
        }
        if self.clock.invariant_tsc() {
            features = features.union(Features::INVARIANT_TSC);
        }
        if self.clock.sync_port() {
            features = features.union(Features::SYNC_PORT);
        }
        let own = 1u64.checked_shl(self.clock.vcpu_id()).unwrap_or(0);
        if self.clock.vcpus() & !own != 0 {
            features = features.union(Features::SMP);
        }
        // A different version is told ours and gets nothing else until it says hello in it.
        self.state = if version == PROTOCOL_VERSION {
            AgentState::Ready
        } else {
            AgentState::AwaitHello
        };
        let transport = self.link.transport();
        let vcpu = self.clock.vcpu_id();
        let tsc_khz = self.clock.tsc_khz();
        let tsc = self.clock.read_tsc();
        self.send(&Message::Capabilities(Capabilities {
            version: PROTOCOL_VERSION,
            transport,
            features,
            vcpu,
            tsc,
            tsc_khz,
        }))
    }

    /// The latency-critical path: prepare the reply up to the TSC, have vCPU `vcpu` read its
    /// TSC (this vCPU: a plain read; another: docs/smp.md), patch it in, send, flush.
    fn send_probe_reply(&mut self, seq: u8, vcpu: u32, full: bool) -> Result<(), LinkError> {
        let mut frame = if full {
            ProbeReplyFrame::full(seq, vcpu)
        } else {
            ProbeReplyFrame::compact(seq, vcpu)
        };
        let Some(tsc) = self.clock.read_tsc_on(vcpu, seq) else {
            return self.send(&Message::Error(ErrorCode::UnknownVcpu));
        };
        let sent = self
            .link
            .send(frame.finish(tsc))
            .and_then(|()| self.link.flush());
        self.stats.probes = self.stats.probes.wrapping_add(1);
        self.count_sent(sent)
    }

    /// Sends up to `max` waiting events in batches of at most [`EVENT_BATCH_MAX`], queue by
    /// queue (each batch names its queue's vCPU and the index of its first record in that
    /// queue), the last batch of the answer flagged; one empty batch when none is waiting.
    /// Timestamps are in the host clock when the pushed mapping converts them, which it does
    /// only for this vCPU's own records (the mapping is this vCPU's; another vCPU's TSC is its
    /// own clock). A batch holds one clock and consecutive indices: a record whose clock
    /// differs from the batch's, or a record the producer overwrote, starts the next batch.
    /// Overwritten records are skipped (and counted by their queue) only before a batch's
    /// first record, so each batch's `dropped` counts exactly the records lost below its
    /// `first`. The batches go to the link one after another (a buffering link coalesces
    /// them) and records leave their queues only once the link has flushed the last one: a
    /// failed send or flush ends the answer and keeps every record still stored, so the next
    /// drain sends them again under the same indices (the host skips what it already has).
    fn send_events(&mut self, max: u32) -> Result<(), LinkError> {
        let own = self.clock.vcpu_id();
        let queues = self.events.queues().min(MAX_EVENT_SOURCES);
        let mut left = usize::try_from(max).unwrap_or(usize::MAX);
        // The next index to send per queue in this answer.
        let mut next = [0u64; MAX_EVENT_SOURCES];
        for (q, n) in next.iter_mut().enumerate().take(queues) {
            *n = self.events.start_in(q);
        }
        let total = waiting(&self.events);
        let mut sent_now = 0;
        let mut q = 0;
        loop {
            // The next queue with records this answer has not taken yet.
            while q < queues && next[q] >= self.events.end_in(q) {
                q += 1;
            }
            let (mut batch, taken, from) = if q < queues && left > 0 {
                let (b, taken) = self.fill_batch(q, &mut next[q], left.min(EVENT_BATCH_MAX), own);
                (b, taken, q)
            } else {
                // Nothing waiting: one empty batch of the agent's own vCPU's queue (the
                // first one for a single queue), so it names a vCPU the hello announced.
                let mine = (0..queues)
                    .find(|&i| self.events.queue_vcpu(i).is_none_or(|v| v == own))
                    .unwrap_or(0);
                (EventBatch::new(own, EventClock::Guest, 0), 0, mine)
            };
            left -= taken;
            batch.vcpu = self.events.queue_vcpu(from).unwrap_or(own);
            // Read after the batch is filled: it counts every record skipped below `first`,
            // and none above (a skip happens only before a batch's first record).
            batch.dropped = self.events.dropped_in(from);
            batch.overwrite = self.events.overwrites_in(from);
            batch.first = next[from].wrapping_sub(taken as u64);
            if taken > 0 {
                self.sent_end[from] = self.sent_end[from].max(next[from]);
            }
            // What is still waiting (records producers add meanwhile are counted next time).
            sent_now += taken;
            let waiting = total.saturating_sub(sent_now);
            batch.remaining = u32::try_from(waiting).unwrap_or(u32::MAX);
            batch.last = left == 0 || waiting == 0 || taken == 0;
            let last = batch.last;
            self.send(&Message::Events(batch))?;
            if last {
                self.link.flush()?;
                self.stats.events_out = self.stats.events_out.wrapping_add(sent_now as u64);
                for (i, end) in next.iter().enumerate().take(queues) {
                    self.events.release_in(i, *end);
                }
                return Ok(());
            }
        }
    }

    /// One batch of at most `n` consecutive records of queue `q`, from index `*at` on
    /// (moved past records found overwritten before the first one, and past every record
    /// taken); returns it and how many records it took.
    // Not inlined: one copy serves every agent a guest builds (its `.text` is budgeted).
    #[inline(never)]
    fn fill_batch(&self, q: usize, at: &mut u64, n: usize, own: u32) -> (EventBatch, usize) {
        // The pushed mapping is this vCPU's: only its own queue's records may use it.
        let mapping = self
            .mapping
            .filter(|_| self.events.queue_vcpu(q).is_none_or(|v| v == own));
        let mut batch: Option<EventBatch> = None;
        let mut prev = 0;
        let mut taken = 0;
        // Skips allowed before the first record: each one moves forward, and a producer that
        // laps the consumer this often only ends this batch early.
        let mut skips = 4;
        while taken < n {
            let r = match self.events.read_in(q, *at) {
                Ok(r) => r,
                Err(ReadError::Overwritten) if taken == 0 && skips > 0 => {
                    skips -= 1;
                    *at = self.events.skip_in(q, *at, self.sent_end[q]);
                    continue;
                }
                Err(_) => break,
            };
            let (clock, ts) = match mapping.and_then(|m| m.try_host_from_guest_ceil(r.tsc)) {
                Some(h) => (EventClock::Host, h.0),
                None => (EventClock::Guest, r.tsc.0),
            };
            let b = batch.get_or_insert_with(|| {
                prev = ts;
                EventBatch::new(own, clock, ts)
            });
            if b.clock != clock || !b.push(prev, ts, r.id, r.payload()) {
                break;
            }
            prev = ts;
            taken += 1;
            *at = at.wrapping_add(1);
        }
        (
            batch.unwrap_or_else(|| EventBatch::new(own, EventClock::Guest, 0)),
            taken,
        )
    }

    fn send(&mut self, msg: &Message) -> Result<(), LinkError> {
        let mut buf = [0u8; MAX_FRAME_SIZE];
        // MAX_FRAME_SIZE holds every message, so this cannot fail; if it ever did, the host
        // would time out and retry, which is better than sending a truncated frame.
        let Ok(frame) = encode_frame(msg, &mut buf) else {
            return Ok(());
        };
        let sent = self.link.send(frame);
        self.count_sent(sent)
    }

    fn count_sent(&mut self, sent: Result<(), LinkError>) -> Result<(), LinkError> {
        if sent.is_ok() {
            self.stats.frames_out = self.stats.frames_out.wrapping_add(1);
        }
        sent
    }
}

#[cfg(test)]
mod tests;
