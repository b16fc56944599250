//! In-memory fakes for [`Link`] and [`AgentClock`], so the agent's logic is tested on the host
//! (and driven by the simulation) without hardware. Fixed-size queues, no heap.

use heapless::Deque;

use super::{AgentClock, Link, LinkError};
use crate::proto::{DecodeError, MAX_FRAME_SIZE, Message, PvclockReport, Transport};
use crate::units::GuestTicks;

/// Bytes the fake link holds in each direction.
pub const FAKE_LINK_CAPACITY: usize = 4096;

/// A link whose two directions are byte queues: the test plays the host on the other end.
#[derive(Debug)]
pub struct FakeLink {
    /// Host → agent bytes not yet received.
    inbound: Deque<u8, FAKE_LINK_CAPACITY>,
    /// Agent → host bytes not yet taken by the test.
    outbound: Deque<u8, FAKE_LINK_CAPACITY>,
    /// The most bytes one `recv` returns, to exercise reassembly across chunks.
    pub max_recv: usize,
    /// While set, every `send` fails with [`LinkError::WouldBlock`].
    pub refuse_sends: bool,
    /// What [`Link::transport`] reports.
    pub transport: Transport,
}

impl Default for FakeLink {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeLink {
    /// Empty queues, unlimited chunk size, sends accepted.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            inbound: Deque::new(),
            outbound: Deque::new(),
            max_recv: usize::MAX,
            refuse_sends: false,
            transport: Transport::Memory,
        }
    }

    /// Queues raw bytes for the agent; all or nothing. Returns `false` if they do not fit.
    pub fn push_inbound(&mut self, bytes: &[u8]) -> bool {
        if self.inbound.capacity() - self.inbound.len() < bytes.len() {
            return false;
        }
        for &b in bytes {
            // Capacity was checked above.
            let _ = self.inbound.push_back(b);
        }
        true
    }

    /// Encodes `msg` as a frame and queues it for the agent. Returns `false` if it does not
    /// fit.
    pub fn push_message(&mut self, msg: &Message) -> bool {
        let mut buf = [0u8; MAX_FRAME_SIZE];
        match crate::proto::encode_frame(msg, &mut buf) {
            Ok(frame) => self.push_inbound(frame),
            Err(_) => false,
        }
    }

    /// Bytes the agent sent that the test has not taken yet.
    #[must_use]
    pub fn outbound_len(&self) -> usize {
        self.outbound.len()
    }

    /// Bytes queued for the agent that it has not received yet.
    #[must_use]
    pub fn inbound_len(&self) -> usize {
        self.inbound.len()
    }

    /// Takes the next frame the agent sent (delimiter included) into `out`; returns its
    /// length, or `None` if no complete frame is queued. A frame longer than `out` is
    /// consumed and reported with its full length, truncated.
    pub fn next_sent_frame(&mut self, out: &mut [u8]) -> Option<usize> {
        let end = self.outbound.iter().position(|&b| b == 0)?;
        for i in 0..=end {
            let b = self.outbound.pop_front()?;
            if let Some(slot) = out.get_mut(i) {
                *slot = b;
            }
        }
        Some(end + 1)
    }

    /// Takes and decodes the next frame the agent sent; `None` if no complete frame is queued.
    pub fn next_sent(&mut self) -> Option<Result<Message, DecodeError>> {
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let len = self.next_sent_frame(&mut buf)?;
        Some(match buf.get_mut(..len) {
            Some(frame) => crate::proto::decode_frame(frame),
            None => Err(DecodeError::FrameTooLong),
        })
    }
}

impl Link for FakeLink {
    fn send(&mut self, frame: &[u8]) -> Result<(), LinkError> {
        if self.refuse_sends || self.outbound.capacity() - self.outbound.len() < frame.len() {
            return Err(LinkError::WouldBlock);
        }
        for &b in frame {
            // Capacity was checked above.
            let _ = self.outbound.push_back(b);
        }
        Ok(())
    }

    fn recv(&mut self, buf: &mut [u8]) -> Result<usize, LinkError> {
        let n = buf.len().min(self.max_recv).min(self.inbound.len());
        for slot in buf.iter_mut().take(n) {
            if let Some(b) = self.inbound.pop_front() {
                *slot = b;
            }
        }
        Ok(n)
    }

    fn transport(&self) -> Transport {
        self.transport
    }
}

/// A guest clock that advances by `step` ticks per read, with optional pvclock data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FakeClock {
    /// The value the next [`AgentClock::read_tsc`] returns.
    pub tsc: u64,
    /// Added after every read (wrapping).
    pub step: u64,
    /// The vCPU id reported.
    pub vcpu: u32,
    /// The TSC frequency reported.
    pub tsc_khz: Option<u32>,
    /// If set, [`AgentClock::pvclock`] returns it with `tsc` replaced by a fresh read.
    pub pvclock: Option<PvclockReport>,
    /// What [`AgentClock::invariant_tsc`] reports.
    pub invariant: bool,
    /// How many times the TSC was read.
    pub reads: u32,
    /// What [`AgentClock::sync_port`] reports.
    pub sync_port: bool,
    /// The sequence number of the last probe read ([`AgentClock::read_tsc_for_probe`]).
    pub last_probe_seq: Option<u8>,
}

impl FakeClock {
    /// A clock at `tsc` advancing `step` per read on vCPU `vcpu`; no frequency, no pvclock.
    #[must_use]
    pub const fn new(tsc: u64, step: u64, vcpu: u32) -> Self {
        Self {
            tsc,
            step,
            vcpu,
            tsc_khz: None,
            pvclock: None,
            invariant: false,
            reads: 0,
            sync_port: false,
            last_probe_seq: None,
        }
    }
}

impl AgentClock for FakeClock {
    fn read_tsc(&mut self) -> GuestTicks {
        let t = self.tsc;
        self.tsc = self.tsc.wrapping_add(self.step);
        self.reads = self.reads.wrapping_add(1);
        GuestTicks(t)
    }

    fn vcpu_id(&self) -> u32 {
        self.vcpu
    }

    fn tsc_khz(&self) -> Option<u32> {
        self.tsc_khz
    }

    fn pvclock(&mut self) -> Option<PvclockReport> {
        let mut report = self.pvclock?;
        report.tsc = self.read_tsc();
        Some(report)
    }

    fn invariant_tsc(&self) -> bool {
        self.invariant
    }

    fn read_tsc_for_probe(&mut self, seq: u8) -> GuestTicks {
        self.last_probe_seq = Some(seq);
        self.read_tsc()
    }

    fn sync_port(&self) -> bool {
        self.sync_port
    }
}
