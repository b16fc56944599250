//! [`AnchoredTransport`]: any transport, its brackets replaced by the exchange's exits.

use std::path::Path;
use std::time::Instant;

use vmtsync_core::HostTicks;
use vmtsync_core::proto::MAX_FRAME_SIZE;

use vmtsync_core::proto::{Message, decode_frame};

use super::{
    AnchorKind, AnchorStats, Matcher, PioTrace, UartBracket, Unmatched, match_sync_port, match_uart,
};
use crate::probe::transport::{FrameStamps, Received, StampedTransport, TransportError};

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
            Ok(Message::Probe { seq } | Message::ProbeFull { seq }) => Some(seq),
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
        let seq = match self.matcher {
            Matcher::SyncPort { .. } => match self.probe_seq() {
                Some(seq) => Some(seq),
                // Only probe replies are bracketed on the sync port: a hello or another
                // request keeps its stamps and says nothing about the anchor.
                None => return Some(stamps),
            },
            Matcher::Uart { .. } => None,
        };
        let Some(trace) = self.trace.as_mut() else {
            return Some(stamps);
        };
        let polled = trace.poll(&mut self.stats);
        let m = match (polled, self.matcher, reply, seq) {
            (Ok(()), Matcher::Uart { port }, Some(reply), _) => {
                match_uart(trace.exits(), port, &self.request, &reply, stamps).map(|b| {
                    self.last = Some(b);
                    b.stamps()
                })
            }
            (Ok(()), Matcher::SyncPort { port }, _, Some(seq)) => {
                match_sync_port(trace.exits(), port, seq, stamps)
            }
            _ => Err(Unmatched::Frames),
        };
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
            Err(Unmatched::Frames) => {
                self.stats.no_frames += 1;
                None
            }
            Err(Unmatched::Reply) => {
                self.stats.no_reply += 1;
                None
            }
            Err(Unmatched::Request) => {
                self.stats.no_request += 1;
                None
            }
        }
    }

    fn now(&mut self) -> HostTicks {
        self.inner.now()
    }

    fn anchor(&self) -> AnchorKind {
        match (self.passthrough, self.matcher) {
            (true, _) => self.inner.anchor(),
            (false, Matcher::Uart { .. }) => AnchorKind::KvmPioUart,
            (false, Matcher::SyncPort { .. }) => AnchorKind::KvmPioSyncPort,
        }
    }
}
