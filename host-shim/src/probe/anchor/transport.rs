//! [`AnchoredTransport`]: any transport, its brackets replaced by the exchange's exits.

use std::path::Path;
use std::time::Instant;

use vmtsync_core::HostTicks;
use vmtsync_core::proto::MAX_FRAME_SIZE;

use vmtsync_core::proto::{Features, Message, decode_frame};

use crate::exits::{
    AnchorStats, Matcher, PioTrace, UartBracket, Unmatched, match_sync_port, match_uart,
};
use crate::link::transport::{FrameStamps, Received, StampedTransport, TransportError};
use crate::syncfile::AnchorKind;

/// Received bytes kept per exchange at most (a reply is at most [`MAX_FRAME_SIZE`]).
const MAX_RECEIVED: usize = 2 * MAX_FRAME_SIZE;

/// A transport whose brackets come from `kvm_pio` exits (see the module docs).
#[derive(Debug)]
pub struct AnchoredTransport<T> {
    inner: T,
    /// `None`: a pass-through wrapper ([`AnchoredTransport::passthrough`]).
    trace: Option<PioTrace>,
    matcher: Matcher,
    /// The last request frame (empty if it was longer than any message).
    request: Vec<u8>,
    /// Bytes received since that request, at most [`MAX_RECEIVED`].
    received: Vec<u8>,
    received_overflow: bool,
    stats: AnchorStats,
    /// [`AnchoredTransport::new_auto`]: give up on the first exchange that does not match.
    auto: bool,
    /// Anchoring was given up: stamps pass through unchanged.
    passthrough: bool,
    /// Why it was given up.
    gave_up: Option<Unmatched>,
    /// The last matched UART exchange's exits.
    last: Option<UartBracket>,
    /// The last exchange's stamps before and after anchoring.
    last_pair: Option<(FrameStamps, FrameStamps)>,
    /// [`Matcher::Uart`] only: the sync port traced next to the UART
    /// ([`AnchoredTransport::with_sync_port`]).
    sync_port: Option<u16>,
    /// The agent's hello announced [`Features::SYNC_PORT`]: its probes are bracketed on the
    /// sync port instead of the UART's bytes.
    agent_sync_port: bool,
    /// Probes of a UART transport bracketed on its sync port so far.
    sync_matched: u64,
}

impl<T: StampedTransport> AnchoredTransport<T> {
    /// Wraps `inner`, anchoring its exchanges in `trace` as `matcher` says; an exchange whose
    /// exits are not found is dropped (`refine` says `None`).
    pub fn new(inner: T, trace: PioTrace, matcher: Matcher) -> Self {
        Self::with_trace(inner, Some(trace), matcher, false)
    }

    /// As [`AnchoredTransport::new`], but if the *first* exchange's exits are not found (the
    /// agent is not in the traced VM, or not on this port), anchoring is given up for good and
    /// the inner transport's stamps are used from then on ([`AnchoredTransport::gave_up`]).
    /// Exchanges after one matched are still dropped when unmatched.
    pub fn new_auto(inner: T, trace: PioTrace, matcher: Matcher) -> Self {
        Self::with_trace(inner, Some(trace), matcher, true)
    }

    /// A wrapper that anchors nothing: the inner transport's stamps, unchanged (so a run has
    /// one transport type whether or not it is anchored).
    pub fn passthrough(inner: T) -> Self {
        let mut t = Self::with_trace(inner, None, Matcher::Uart { port: 0 }, false);
        t.passthrough = true;
        t
    }

    fn with_trace(inner: T, trace: Option<PioTrace>, matcher: Matcher, auto: bool) -> Self {
        Self {
            auto,
            passthrough: false,
            gave_up: None,
            last: None,
            last_pair: None,
            inner,
            trace,
            matcher,
            request: Vec::with_capacity(MAX_FRAME_SIZE),
            received: Vec::with_capacity(MAX_RECEIVED),
            received_overflow: false,
            stats: AnchorStats::default(),
            sync_port: None,
            agent_sync_port: false,
            sync_matched: 0,
        }
    }

    /// A UART transport whose trace also holds the agent's sync port `port`: once the hello's
    /// reply announces [`Features::SYNC_PORT`], probes are bracketed by their sync-port exits
    /// ([`match_sync_port`]), which hold nothing but the TSC read, instead of by the UART's
    /// bytes, whose bracket also holds the agent's frame handling; the hello and every other
    /// request are still matched on the UART. The UART matching only counts accesses that
    /// reach the data port, so the sync port's exits take no part in it.
    #[must_use]
    pub fn with_sync_port(mut self, port: Option<u16>) -> Self {
        if matches!(self.matcher, Matcher::Uart { .. }) {
            self.sync_port = port;
        }
        self
    }

    /// The matcher this exchange uses: the sync port for a probe of an agent that announced
    /// one on a UART traced with it, else the transport's own.
    fn matcher_now(&self, probe: bool) -> Matcher {
        match (self.matcher, self.sync_port) {
            (Matcher::Uart { .. }, Some(port)) if probe && self.agent_sync_port => {
                Matcher::SyncPort { port }
            }
            (m, _) => m,
        }
    }

    /// Notes whether the reply to a hello announced the sync port.
    fn note_hello(&mut self, reply: Option<&[u8]>) {
        let mut request = self.request.clone();
        if !matches!(decode_frame(&mut request), Ok(Message::Hello(_))) {
            return;
        }
        let Some(mut frame) = reply.map(<[u8]>::to_vec) else {
            return;
        };
        if let Ok(Message::Capabilities(caps)) = decode_frame(&mut frame) {
            self.agent_sync_port = caps.features.contains(Features::SYNC_PORT);
        }
    }

    /// Why anchoring was given up ([`AnchoredTransport::new_auto`]), if it was.
    pub const fn gave_up(&self) -> Option<Unmatched> {
        self.gave_up
    }

    /// The exits of the last UART exchange that matched (benchmarks compare its brackets).
    pub const fn last_bracket(&self) -> Option<UartBracket> {
        self.last
    }

    /// The last anchored exchange: the inner transport's stamps and the exits' (benchmarks
    /// compare the two brackets on the same probes).
    pub const fn last_pair(&self) -> Option<(FrameStamps, FrameStamps)> {
        self.last_pair
    }

    /// The counters so far.
    pub const fn stats(&self) -> AnchorStats {
        self.stats
    }

    /// The tracefs instance directory in use, if anchoring.
    pub fn instance_path(&self) -> Option<&Path> {
        self.trace.as_ref().map(PioTrace::instance_path)
    }

    /// The wrapped transport.
    pub const fn inner(&self) -> &T {
        &self.inner
    }

    /// The wrapped transport back; the instance is removed.
    pub fn into_inner(self) -> T {
        self.inner
    }

    /// The last whole frame in the bytes received since the request (its delimiter included).
    fn reply(&self) -> Option<&[u8]> {
        if self.received_overflow {
            return None;
        }
        let r = &self.received[..];
        let last = r.iter().rposition(|&b| b == 0)?;
        let start = r[..last].iter().rposition(|&b| b == 0).map_or(0, |p| p + 1);
        (last > start).then(|| &r[start..=last])
    }

    /// The sequence number of the last request, if it was a probe (our own frame: it decodes).
    fn probe_seq(&self) -> Option<u8> {
        let mut frame = self.request.clone();
        match decode_frame(&mut frame) {
            Ok(
                Message::Probe { seq } | Message::ProbeFull { seq } | Message::ProbeOn { seq, .. },
            ) => Some(seq),
            _ => None,
        }
    }
}

impl<T: StampedTransport> StampedTransport for AnchoredTransport<T> {
    fn send(&mut self, frame: &[u8]) -> Result<HostTicks, TransportError> {
        let stamp = self.inner.send(frame)?;
        // A lone delimiter (the hello's flush) is not a request: the frame after it is.
        if frame != [0] {
            self.request.clear();
            // A frame longer than any message cannot be matched: leave the request empty.
            if frame.len() <= MAX_FRAME_SIZE {
                self.request.extend_from_slice(frame);
            }
        }
        self.received.clear();
        self.received_overflow = false;
        Ok(stamp)
    }

    fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> Result<Received, TransportError> {
        let r = self.inner.recv(buf, deadline)?;
        let got = buf.get(..r.len).unwrap_or_default();
        if self.received.len() + got.len() > MAX_RECEIVED {
            self.received_overflow = true;
        } else {
            self.received.extend_from_slice(got);
        }
        Ok(r)
    }

    fn refine(&mut self, stamps: FrameStamps) -> Option<FrameStamps> {
        let stamps = self.inner.refine(stamps)?;
        if self.passthrough {
            return Some(stamps);
        }
        let reply = self.reply().map(<[u8]>::to_vec);
        if self.sync_port.is_some() {
            self.note_hello(reply.as_deref());
        }
        let seq = self.probe_seq();
        let matcher = self.matcher_now(seq.is_some());
        // Only probe replies are bracketed on the sync port: a hello or another request keeps
        // its stamps and says nothing about the anchor.
        if matches!(matcher, Matcher::SyncPort { .. }) && seq.is_none() {
            return Some(stamps);
        }
        let Some(trace) = self.trace.as_mut() else {
            return Some(stamps);
        };
        let lost_so_far = |s: &AnchorStats| (s.damaged_pages, s.exits_overflowed, s.drains_capped);
        let lost_before = lost_so_far(&self.stats);
        let polled = trace.poll(&mut self.stats);
        let lost = lost_before != lost_so_far(&self.stats);
        let m = match polled {
            // Exits lost while this exchange ran may be its own reading of the request or
            // writing of the reply; the earliest and latest runs left could then both lie on
            // one side of the read, so nothing is matched.
            Ok(()) if lost => Err(Unmatched::TraceLost),
            Ok(()) => {
                let exits = trace.exits();
                let (request, reply) = (&self.request[..], reply.as_deref());
                let first = match_one(exits, matcher, request, reply, seq, stamps);
                if first.is_err() && matcher != self.matcher && self.sync_matched == 0 {
                    // The agent announced a sync port, but its first probe left no exits on
                    // the one traced (it was booted with another): the UART's bytes, for good.
                    self.agent_sync_port = false;
                    match_one(exits, self.matcher, request, reply, seq, stamps)
                } else {
                    first
                }
            }
            Err(_) => Err(Unmatched::TraceLost),
        };
        let m = m.map(|(anchored, uart)| {
            if uart.is_some() {
                self.last = uart;
            } else if self.sync_port.is_some() {
                self.sync_matched += 1;
            }
            anchored
        });
        // Later exchanges start after this one's bracket: older exits are of no further use.
        trace.forget_before(stamps.send.0);
        if let Err(why) = m
            && self.auto
            && self.stats.matched == 0
        {
            self.passthrough = true;
            self.gave_up = Some(why);
            return Some(stamps);
        }
        match m {
            Ok(anchored) => {
                self.stats.matched += 1;
                self.last_pair = Some((stamps, anchored));
                Some(anchored)
            }
            Err(why) => {
                self.stats.count_unmatched(why);
                None
            }
        }
    }

    fn now(&mut self) -> HostTicks {
        self.inner.now()
    }

    fn anchor(&self) -> AnchorKind {
        match (self.passthrough, self.matcher_now(true)) {
            (true, _) => self.inner.anchor(),
            (false, Matcher::Uart { .. }) => AnchorKind::KvmPioUart,
            (false, Matcher::SyncPort { .. }) => AnchorKind::KvmPioSyncPort,
        }
    }
}

/// One exchange's bracket by `matcher` among `exits`, with the UART's exits when it matched
/// there.
fn match_one(
    exits: &[crate::exits::PioExit],
    matcher: Matcher,
    request: &[u8],
    reply: Option<&[u8]>,
    seq: Option<u8>,
    stamps: FrameStamps,
) -> Result<(FrameStamps, Option<UartBracket>), Unmatched> {
    match (matcher, reply, seq) {
        (Matcher::Uart { port }, Some(reply), _) => {
            match_uart(exits, port, request, reply, stamps).map(|b| (b.stamps(), Some(b)))
        }
        (Matcher::SyncPort { port }, _, Some(seq)) => {
            match_sync_port(exits, port, seq, stamps).map(|b| (b, None))
        }
        _ => Err(Unmatched::Frames),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exits::{COM1_DATA, DEFAULT_SYNC_PORT, PioExit};
    use crate::ftrace::format::{KvmPio, PioDirection};

    fn exit(ts: u64, port: u16, direction: PioDirection, val: u8) -> PioExit {
        PioExit {
            ts,
            pio: KvmPio {
                pid: 7,
                direction,
                port,
                size: 1,
                count: 1,
                val: u32::from(val),
            },
        }
    }

    /// An agent with a sync port on a UART: it reads the request, does `in` / TSC read /
    /// `out` of the sequence number on the sync port, then writes the reply.
    fn exchange(seq: u8) -> Vec<PioExit> {
        let (d, s) = (COM1_DATA, DEFAULT_SYNC_PORT);
        vec![
            exit(1_000, d, PioDirection::In, 2),
            exit(1_010, d, PioDirection::In, seq),
            exit(1_020, d, PioDirection::In, 0),
            exit(1_100, s, PioDirection::In, 0xff),
            // The TSC read is here, between 1_100 and 1_150.
            exit(1_150, s, PioDirection::Out, seq),
            exit(1_300, d, PioDirection::Out, 5),
            exit(1_310, d, PioDirection::Out, 0),
        ]
    }

    fn within(a: u64, b: u64) -> FrameStamps {
        FrameStamps {
            send: HostTicks(a),
            recv: HostTicks(b),
        }
    }

    #[test]
    fn a_uart_probe_is_bracketed_on_the_sync_port_or_on_the_data_port_alone() {
        let ex = exchange(9);
        let (req, rep) = ([2, 9, 0], [5, 0]);
        let w = within(0, 10_000);
        let uart = Matcher::Uart { port: COM1_DATA };
        let sync = Matcher::SyncPort {
            port: DEFAULT_SYNC_PORT,
        };
        // On the sync port: nothing but the read between the two exits.
        assert_eq!(
            match_one(&ex, sync, &req, Some(&rep), Some(9), w).map(|m| m.0),
            Ok(within(1_100, 1_150))
        );
        // On the UART the sync port's exits take no part: the lower end is the delimiter's
        // `in` before the read, not the sync port's `out` after it.
        assert_eq!(
            match_one(&ex, uart, &req, Some(&rep), Some(9), w).map(|m| m.0),
            Ok(within(1_020, 1_300))
        );
        // Another probe's sequence number has no sync-port exits here.
        assert_eq!(
            match_one(&ex, sync, &req, Some(&rep), Some(8), w),
            Err(Unmatched::Reply)
        );
    }
}
