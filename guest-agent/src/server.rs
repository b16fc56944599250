//! The probe-protocol server: postcard + COBS frames from `vmtsync_core::proto` over a
//! [`Link`].
//!
//! This is the agent's own small dispatcher until `vmtsync_core::agent` (the transport-agnostic
//! state machine) lands; it answers exactly what the agent supports today:
//!
//! - `Hello` → `Capabilities` (always, so a host of another version sees the mismatch); the
//!   session is open only when the versions are equal, otherwise requests get
//!   `Error(NotReady)`.
//! - `Probe` / `ProbeFull` → `ProbeReply` / `ProbeReplyFull`. The reply frame is encoded up to
//!   the TSC before the link is made ready and the TSC read, so read → first byte on the wire
//!   is the TSC read, the skew (a multiply, shift and add), the frame close, and one `out`.
//! - `Shutdown` → `Exiting`, then [`Outcome::Shutdown`].
//! - `PvclockRequest`, `SetMapping`, `EventsRequest` → `Error(Unsupported)` (not yet served).
//! - guest→host messages → `Error(Unexpected)`; undecodable frames → `Error(Malformed)` or
//!   `Error(FrameTooLong)`.

use vmtsync_core::GuestTicks;
use vmtsync_core::arch::Tsc;
use vmtsync_core::proto::{
    Capabilities, DecodeError, ErrorCode, Features, Feed, FrameReceiver, MAX_FRAME_SIZE, Message,
    PROTOCOL_VERSION, ProbeReplyFrame, encode_frame,
};

use crate::link::Link;
use crate::tsc::Skew;

/// The vCPU the agent runs on: it is single-CPU.
pub const VCPU: u32 = 0;

/// What the caller should do after [`Server::poll`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing to do; poll again.
    Continue,
    /// The host ended the session (`Exiting` has been sent): stop the VM.
    Shutdown,
}

/// Counters for the log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Probes answered (compact and full).
    pub probes: u32,
    /// Frames that did not decode.
    pub bad_frames: u32,
}

/// Serves the probe protocol on `L`, reading time from `T` through a software [`Skew`].
#[derive(Debug)]
pub struct Server<L, T> {
    link: L,
    tsc: T,
    skew: Skew,
    features: Features,
    tsc_khz: Option<u32>,
    rx: FrameReceiver,
    session_open: bool,
    stats: Stats,
}

impl<L: Link, T: Tsc> Server<L, T> {
    /// A server that advertises `features` and `tsc_khz` in its `Capabilities`.
    pub fn new(link: L, tsc: T, skew: Skew, features: Features, tsc_khz: Option<u32>) -> Self {
        Self {
            link,
            tsc,
            skew,
            features,
            tsc_khz,
            rx: FrameReceiver::new(),
            session_open: false,
            stats: Stats::default(),
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// The link (tests inspect what was sent).
    pub fn link_mut(&mut self) -> &mut L {
        &mut self.link
    }

    /// Takes at most one received byte and answers the frame it completes, if any.
    pub fn poll(&mut self) -> Outcome {
        let Some(b) = self.link.try_recv() else {
            return Outcome::Continue;
        };
        let byte = [b];
        match self.rx.feed(&byte) {
            Feed::Consumed => Outcome::Continue,
            Feed::Message { msg, .. } => self.handle(msg),
            Feed::Error { error, .. } => {
                self.stats.bad_frames = self.stats.bad_frames.wrapping_add(1);
                let code = match error {
                    DecodeError::FrameTooLong => ErrorCode::FrameTooLong,
                    _ => ErrorCode::Malformed,
                };
                self.send(&Message::Error(code));
                Outcome::Continue
            }
        }
    }

    fn now(&self) -> GuestTicks {
        GuestTicks(self.skew.apply(self.tsc.read_ordered()))
    }

    fn handle(&mut self, msg: Message) -> Outcome {
        match msg {
            Message::Hello(h) => {
                self.session_open = h.version == PROTOCOL_VERSION;
                let caps = Capabilities {
                    version: PROTOCOL_VERSION,
                    transport: self.link.transport(),
                    features: self.features,
                    vcpu: VCPU,
                    tsc: self.now(),
                    tsc_khz: self.tsc_khz,
                };
                self.send(&Message::Capabilities(caps));
            }
            Message::Probe { seq } | Message::ProbeFull { seq } if self.session_open => {
                let mut frame = if matches!(msg, Message::Probe { .. }) {
                    ProbeReplyFrame::compact(seq, VCPU)
                } else {
                    ProbeReplyFrame::full(seq, VCPU)
                };
                self.link.wait_ready();
                let t = self.now();
                self.link.send_now(frame.finish(t));
                self.stats.probes = self.stats.probes.wrapping_add(1);
            }
            Message::Shutdown if self.session_open => {
                self.send(&Message::Exiting);
                return Outcome::Shutdown;
            }
            Message::Probe { .. }
            | Message::ProbeFull { .. }
            | Message::Shutdown
            | Message::PvclockRequest
            | Message::SetMapping(_)
            | Message::EventsRequest { .. }
                if !self.session_open =>
            {
                self.send(&Message::Error(ErrorCode::NotReady));
            }
            Message::PvclockRequest | Message::SetMapping(_) | Message::EventsRequest { .. } => {
                self.send(&Message::Error(ErrorCode::Unsupported));
            }
            Message::Capabilities(_)
            | Message::ProbeReply(_)
            | Message::ProbeReplyFull(_)
            | Message::MappingApplied { .. }
            | Message::PvclockReport(_)
            | Message::Events(_)
            | Message::Exiting
            | Message::Error(_) => self.send(&Message::Error(ErrorCode::Unexpected)),
            // Unreachable by the guards above; kept so a new variant is a compile-time match
            // error only in the arms that matter.
            Message::Probe { .. } | Message::ProbeFull { .. } | Message::Shutdown => {}
        }
        Outcome::Continue
    }

    fn send(&mut self, msg: &Message) {
        let mut buf = [0u8; MAX_FRAME_SIZE];
        // MAX_FRAME_SIZE holds every message's frame (proto::frame), so this cannot fail; if it
        // ever did, dropping the reply is the only option without a heap.
        if let Ok(frame) = encode_frame(msg, &mut buf) {
            self.link.wait_ready();
            self.link.send_now(frame);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::vec::Vec;

    use vmtsync_core::arch::FakeTsc;
    use vmtsync_core::proto::{
        FrameReceiver, Hello, ProbeReply, ProbeReplyFull, Transport, decode_frame,
    };

    use super::*;

    /// A link over two byte queues that records, for each `send_now`, how many TSC reads had
    /// happened before its first byte went out.
    #[derive(Debug, Default)]
    struct FakeLink {
        inbox: VecDeque<u8>,
        sent: Vec<u8>,
        ready_calls: u32,
    }

    impl Link for FakeLink {
        fn try_recv(&mut self) -> Option<u8> {
            self.inbox.pop_front()
        }
        fn wait_ready(&mut self) {
            self.ready_calls += 1;
        }
        fn send_now(&mut self, bytes: &[u8]) {
            self.sent.extend_from_slice(bytes);
        }
    }

    fn server(skew: Skew) -> Server<FakeLink, FakeTsc> {
        Server::new(
            FakeLink::default(),
            FakeTsc::new(1_000, 10),
            skew,
            Features::INVARIANT_TSC,
            Some(2_000_000),
        )
    }

    fn push(s: &mut Server<FakeLink, FakeTsc>, msg: &Message) {
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let f = encode_frame(msg, &mut buf).expect("encodes");
        s.link_mut().inbox.extend(f.iter().copied());
    }

    fn run(s: &mut Server<FakeLink, FakeTsc>) -> Vec<Outcome> {
        let mut out = Vec::new();
        while !s.link_mut().inbox.is_empty() {
            out.push(s.poll());
        }
        out
    }

    fn replies(s: &mut Server<FakeLink, FakeTsc>) -> Vec<Message> {
        let sent = core::mem::take(&mut s.link_mut().sent);
        let mut rx = FrameReceiver::new();
        let mut msgs = Vec::new();
        let mut rest: &[u8] = &sent;
        loop {
            match rx.feed(rest) {
                Feed::Consumed => return msgs,
                Feed::Message { msg, rest: r } => {
                    msgs.push(msg);
                    rest = r;
                }
                Feed::Error { error, .. } => panic!("agent sent a bad frame: {error:?}"),
            }
        }
    }

    fn hello() -> Message {
        Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            features: Features::NONE,
        })
    }

    #[test]
    fn hello_then_probes_then_shutdown() {
        let mut s = server(Skew::IDENTITY);
        push(&mut s, &hello());
        push(&mut s, &Message::Probe { seq: 7 });
        push(&mut s, &Message::ProbeFull { seq: 8 });
        push(&mut s, &Message::Shutdown);
        let outcomes = run(&mut s);
        assert_eq!(outcomes.last(), Some(&Outcome::Shutdown));
        let r = replies(&mut s);
        let Message::Capabilities(c) = r[0] else {
            panic!("{r:?}")
        };
        assert_eq!(c.version, PROTOCOL_VERSION);
        assert_eq!(c.transport, Transport::Uart16550);
        assert_eq!(c.features, Features::INVARIANT_TSC);
        assert_eq!(c.tsc_khz, Some(2_000_000));
        // FakeTsc starts at 1000 and steps by 10 per read.
        assert_eq!(c.tsc, GuestTicks(1_000));
        assert_eq!(
            r[1],
            Message::ProbeReply(ProbeReply {
                seq: 7,
                vcpu: VCPU,
                tsc_low32: 1_010
            })
        );
        assert_eq!(
            r[2],
            Message::ProbeReplyFull(ProbeReplyFull {
                seq: 8,
                vcpu: VCPU,
                tsc: 1_020
            })
        );
        assert_eq!(r[3], Message::Exiting);
        assert_eq!(r.len(), 4);
        assert_eq!(s.stats().probes, 2);
    }

    #[test]
    fn skew_applies_to_every_reported_tsc() {
        let skew = Skew {
            offset: 0u64.wrapping_sub(500),
            ratio: 3,
            frac_bits: 1,
        };
        let mut s = server(skew);
        push(&mut s, &hello());
        push(&mut s, &Message::ProbeFull { seq: 1 });
        run(&mut s);
        let r = replies(&mut s);
        let Message::Capabilities(c) = r[0] else {
            panic!("{r:?}")
        };
        assert_eq!(c.tsc, GuestTicks(1_000 * 3 / 2 - 500));
        let Message::ProbeReplyFull(p) = r[1] else {
            panic!("{r:?}")
        };
        assert_eq!(p.tsc, 1_010 * 3 / 2 - 500);
    }

    #[test]
    fn requests_before_a_matching_hello_are_refused() {
        let mut s = server(Skew::IDENTITY);
        push(&mut s, &Message::Probe { seq: 1 });
        push(
            &mut s,
            &Message::Hello(Hello {
                version: PROTOCOL_VERSION + 1,
                features: Features::NONE,
            }),
        );
        push(&mut s, &Message::Shutdown);
        let outcomes = run(&mut s);
        assert!(outcomes.iter().all(|o| *o == Outcome::Continue));
        let r = replies(&mut s);
        assert_eq!(r[0], Message::Error(ErrorCode::NotReady));
        assert!(matches!(r[1], Message::Capabilities(c) if c.version == PROTOCOL_VERSION));
        assert_eq!(r[2], Message::Error(ErrorCode::NotReady));
        assert_eq!(s.stats().probes, 0);
    }

    #[test]
    fn unsupported_unexpected_and_garbage_get_errors() {
        let mut s = server(Skew::IDENTITY);
        push(&mut s, &hello());
        push(&mut s, &Message::PvclockRequest);
        push(&mut s, &Message::Exiting);
        // A frame whose body is not a valid message (tag 0xff), then a valid probe: the
        // receiver resyncs at the delimiter.
        s.link_mut().inbox.extend([0x02, 0xff, 0x00]);
        push(&mut s, &Message::Probe { seq: 3 });
        run(&mut s);
        let r = replies(&mut s);
        assert_eq!(r[1], Message::Error(ErrorCode::Unsupported));
        assert_eq!(r[2], Message::Error(ErrorCode::Unexpected));
        assert_eq!(r[3], Message::Error(ErrorCode::Malformed));
        assert!(matches!(r[4], Message::ProbeReply(p) if p.seq == 3));
        assert_eq!(s.stats().bad_frames, 1);
    }

    #[test]
    fn probe_reply_is_byte_identical_to_encode_frame() {
        let mut s = server(Skew::IDENTITY);
        push(&mut s, &hello());
        push(&mut s, &Message::Probe { seq: 300 });
        run(&mut s);
        let sent = core::mem::take(&mut s.link_mut().sent);
        let cut = sent.iter().position(|&b| b == 0).expect("caps frame") + 1;
        let mut probe = sent[cut..].to_vec();
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let want = encode_frame(
            &Message::ProbeReply(ProbeReply {
                seq: 300,
                vcpu: VCPU,
                tsc_low32: 1_010,
            }),
            &mut buf,
        )
        .expect("encodes");
        assert_eq!(probe.as_slice(), &*want);
        assert!(decode_frame(&mut probe).is_ok());
    }
}
