//! Test support: an in-process transport in the style of a built-in VMM, running the core
//! agent on a fake link against a simulated host clock.

use std::time::{Duration, Instant};

use vmtsync_core::HostTicks;
use vmtsync_core::agent::Agent;
use vmtsync_core::agent::fake::{FakeClock, FakeLink};
use vmtsync_core::proto::MAX_FRAME_SIZE;
use vmtsync_core::recorder::{EventSources, NoEvents};

use crate::link::transport::{FrameStamps, Received, StampedTransport, TransportError};

/// An in-process transport in the style of a built-in VMM: a simulated host clock, the
/// core agent on a fake link, and exact stamps of when the guest consumed the request and
/// produced the reply (returned through `refine` when `exact` is set).
pub(crate) struct SimTransport<E = NoEvents> {
    pub(crate) agent: Agent<FakeLink, FakeClock, E>,
    pub(crate) now: u64,
    pub(crate) offset: u64,
    pub(crate) fwd: u64,
    pub(crate) back: u64,
    /// Host time per probe between rounds (drives the TSC across 2^32 boundaries).
    pub(crate) gap: u64,
    pub(crate) pending: Vec<u8>,
    pub(crate) garbage: Vec<Vec<u8>>,
    pub(crate) exact: bool,
    pub(crate) guest_read_at: u64,
    /// Frames sent so far.
    pub(crate) sends: u64,
    /// After this many sends, the guest offset becomes the second value (a migration).
    pub(crate) step_at: Option<(u64, u64)>,
    /// The first this-many frames are lost (an agent not yet listening).
    pub(crate) drop_first: u64,
    /// At this send, the guest stalls this many host ticks before it reads the request (a
    /// descheduled vCPU, a paused guest).
    pub(crate) stall_at: Option<(u64, u64)>,
    /// With `stall_at`, the stalled reply arrives only after the next send (the host gave up
    /// waiting for it: a stall longer than the timeout).
    pub(crate) stall_past_timeout: bool,
    /// Reply bytes held back until the next send.
    held: Vec<u8>,
    /// Every frame the host sent and every frame the agent sent, in order (what a trace of
    /// the wire would show).
    pub(crate) wire_in: Vec<Vec<u8>>,
    pub(crate) wire_out: Vec<Vec<u8>>,
}

impl SimTransport {
    pub(crate) fn new(offset: u64) -> Self {
        SimTransport::with_events(offset, NoEvents)
    }
}

impl<E: EventSources> SimTransport<E> {
    /// An agent (on vCPU 3) that drains `events` when asked.
    pub(crate) fn with_events(offset: u64, events: E) -> Self {
        Self {
            agent: Agent::with_events(FakeLink::new(), FakeClock::new(0, 0, 3), events),
            // Near the real host TSC, so code that (wrongly) mixes in real readings behaves
            // as it would on a real host.
            now: crate::link::transport::host_tsc_now().0.max(1 << 40),
            offset,
            fwd: 700,
            back: 900,
            gap: 0,
            pending: Vec::new(),
            garbage: Vec::new(),
            exact: false,
            guest_read_at: 0,
            sends: 0,
            step_at: None,
            drop_first: 0,
            stall_at: None,
            stall_past_timeout: false,
            held: Vec::new(),
            wire_in: Vec::new(),
            wire_out: Vec::new(),
        }
    }
}

impl<E: EventSources> StampedTransport for SimTransport<E> {
    fn send(&mut self, frame: &[u8]) -> Result<HostTicks, TransportError> {
        self.sends += 1;
        if let Some((at, offset)) = self.step_at
            && self.sends > at
        {
            self.offset = offset;
        }
        self.now += self.gap;
        // A reply held past the host's timeout shows up now, before this request's.
        self.pending.append(&mut self.held);
        if self.sends <= self.drop_first {
            return Ok(HostTicks(self.now));
        }
        let stamp = HostTicks(self.now);
        self.now += self.fwd;
        let stalled = self.stall_at.is_some_and(|(at, _)| at == self.sends);
        if let Some((_, ticks)) = self.stall_at.filter(|_| stalled) {
            self.now += ticks;
        }
        assert!(self.agent.link_mut().push_inbound(frame));
        self.wire_in.push(frame.to_vec());
        self.guest_read_at = self.now;
        self.agent.clock_mut().tsc = self.now + self.offset;
        self.agent.poll().unwrap();
        self.now += self.back;
        if let Some(g) = self.garbage.pop() {
            self.pending.extend_from_slice(&g);
        }
        let mut f = [0u8; MAX_FRAME_SIZE];
        let out = if stalled && self.stall_past_timeout {
            &mut self.held
        } else {
            &mut self.pending
        };
        while let Some(n) = self.agent.link_mut().next_sent_frame(&mut f) {
            out.extend_from_slice(&f[..n.min(f.len())]);
            self.wire_out.push(f[..n.min(f.len())].to_vec());
        }
        Ok(stamp)
    }

    fn recv(&mut self, buf: &mut [u8], _deadline: Instant) -> Result<Received, TransportError> {
        if self.pending.is_empty() {
            return Err(TransportError::Timeout(Duration::ZERO));
        }
        // Hand out odd-sized chunks to exercise reassembly.
        let n = self.pending.len().min(buf.len()).min(7);
        buf[..n].copy_from_slice(&self.pending[..n]);
        self.pending.drain(..n);
        Ok(Received {
            len: n,
            stamp: HostTicks(self.now),
        })
    }

    fn now(&mut self) -> HostTicks {
        // The pause before the next send (`gap`) passes before the session sends again.
        HostTicks(self.now + self.gap)
    }

    fn refine(&mut self, stamps: FrameStamps) -> Option<FrameStamps> {
        Some(if self.exact {
            FrameStamps {
                send: HostTicks(self.guest_read_at),
                recv: HostTicks(self.guest_read_at),
            }
        } else {
            stamps
        })
    }
}

/// Probe options for the simulation: eight probes a round, no progress line.
pub(crate) fn sim_options() -> super::ProbeOptions {
    let mut opts = super::ProbeOptions::new(crate::link::ProbeAddr::Unix("sim".into()));
    opts.progress = false;
    opts.probes = 8;
    opts
}

/// Continuous mode into `out`, `rounds` rounds (`None`: until stopped) with no pause between.
pub(crate) fn continuous_into(
    out: std::path::PathBuf,
    rounds: Option<u64>,
) -> Option<super::ContinuousOptions> {
    Some(super::ContinuousOptions {
        out,
        resync: std::time::Duration::ZERO,
        rounds,
    })
}

/// A fresh directory for a test's sync files, removed when dropped.
pub(crate) fn tempdir() -> tempfile::TempDir {
    crate::testutil::temp_dir("vmtsync-probe-")
}
