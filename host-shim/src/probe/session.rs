//! The host's side of one probe session: hello, probes, shutdown, over any
//! [`StampedTransport`].
//!
//! # An untrusted guest, a bounded host
//!
//! Untrusted guest bytes go through a fixed 256-byte read buffer and the core's
//! [`FrameReceiver`] (a fixed [`vmtsync_core::proto::MAX_FRAME_SIZE`] buffer); with the
//! session's counters and the socket that is the whole per-connection state, on the stack and
//! at most [`MAX_SESSION_BYTES`] (4 KiB; 2.5 KiB today, most of it the frame buffer sized for
//! the largest event batch), whatever the guest sends. A round's samples (32 B each) grow with
//! the host's `--probes`, and an event drain's batches with the host's `max`
//! ([`ProbeSession::drain_events`]), not with guest input; continuous mode
//! adds a fixed-capacity hull ([`crate::sync::HULL_CAPACITY`] vertices). A run of bytes
//! that does not decode, or is too long, is counted in [`SessionStats::bad_frames`] and its
//! bytes in [`SessionStats::console_bytes`]: under the shared-UART wire rule it is the guest's
//! console text (written out with `--console`, [`super::console`]), streamed, never held
//! beyond the frame buffer; nothing the guest sends can make this code panic. Every wait has a deadline, so a guest that stops answering is a
//! [`ProbeError::Timeout`], never a hang; and one wait handles at most [`MAX_BYTES_PER_WAIT`]
//! bytes, so a guest that floods the link loses its probe ([`SessionStats::flooded`]) instead
//! of keeping the host busy until the deadline. Replies that cannot be true are rejected with a
//! counted reason: a sequence number never sent ([`SessionStats::unknown_seq`]), an earlier
//! probe's ([`SessionStats::stale_replies`]), another vCPU ([`SessionStats::wrong_vcpu`]),
//! host stamps out of order ([`SessionStats::bad_stamps`]), a TSC outside the window the last
//! verified reading allows ([`SessionStats::out_of_window`]: backwards, jumped, absurd).
//!
//! # Unwrapping compact replies
//!
//! The guest answers a [`Message::Probe`] with the low 32 bits of its TSC. The session keeps
//! the last verified full reading with its host bracket ([`Reference`]); when the reply arrives
//! it knows the host bracket of the new read too, so the guest TSC lies in a window
//! ([`Reference::window`], for guest/host rates in [`RATE_MIN`, `RATE_MAX`]). Only when that
//! window names exactly one value with the reply's low bits is the reply used
//! ([`vmtsync_core::proto::try_unwrap_tsc_low32_in`]); otherwise (the guest stalled, the reply
//! was late) the probe is lost ([`SessionStats::ambiguous`]) and the reference forgotten, so the
//! next probe is a [`Message::ProbeFull`]. A reference is only ever a full reading that fit its
//! window (or the first one), or a compact one that unwrapped uniquely: never a guess. The host
//! sends compact probes only within [`UNWRAP_HORIZON`] host ticks of the reference, where the
//! window stays far below 2^32 for any sane round trip.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vmtsync_core::estimate::ProbeSample;
use vmtsync_core::proto::{
    Capabilities, ErrorCode, EventBatch, Features, Feed, FrameReceiver, Hello, MAX_FRAME_SIZE,
    Message, PROTOCOL_VERSION, encode_frame,
};
use vmtsync_core::{GuestTicks, HostTicks};

use super::ProbeError;
use super::console::ConsoleLog;
use super::log::ProbeLog;
use super::progress::Progress;
pub use super::reference::{Reference, Window};
use crate::link::transport::{FrameStamps, StampedTransport, TransportError};
pub use crate::sync::{RATE_MAX, RATE_MIN};
use crate::syncfile::AnchorKind;

/// What a probe's matching reply said.
enum Reading {
    /// A compact reply's low 32 bits.
    Low32(u32),
    /// A full reply's guest tick.
    Full(GuestTicks),
}

/// Host ticks after the reference's bracket within which a compact probe is sent (2^30: about
/// 0.35 s at 3 GHz). The window then spans about 1.5 · 2^30 plus twice the round trip, so a
/// reply unwraps unless it took longer than about 2^30 ticks; later, a full probe is asked for.
pub const UNWRAP_HORIZON: u64 = 1 << 30;

/// The most memory one session over a socket holds ([`ProbeSession`] itself: fixed buffers and
/// counters, no heap), pinned by a test.
pub const MAX_SESSION_BYTES: usize = 4096;

/// The probe sequence number's width on the wire.
pub type Seq = u8;

/// Bytes one wait (a hello, a probe, the goodbye) handles at most before giving up on it. A
/// probe reply is 10 to 14 bytes; this leaves room for a thousand stale replies or a burst of
/// line noise, and bounds the work a guest can cause per probe.
pub const MAX_BYTES_PER_WAIT: u64 = 16 << 10;

/// Consecutive probes that may time out while only garbage arrives before the run fails.
const MAX_GARBAGE_LOSSES: u32 = 3;

/// How often the hello is repeated while the agent does not answer.
const HELLO_RESEND: Duration = Duration::from_millis(500);

/// The longest [`ProbeSession::shutdown`] waits for the agent's goodbye.
const SHUTDOWN_WAIT: Duration = Duration::from_millis(500);

/// With a stop flag, the longest single wait (for a reply, or between probes) before the flag
/// is looked at again.
pub const STOP_POLL: Duration = Duration::from_millis(20);

/// Bytes read from the transport at a time.
const READ_CHUNK: usize = 256;

/// What the agent said about itself in its [`Capabilities`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentInfo {
    /// The vCPU whose TSC the agent reads.
    pub vcpu: u32,
    /// The agent's protocol transport (informational).
    pub transport: vmtsync_core::proto::Transport,
    /// The agent's features.
    pub features: Features,
    /// The guest TSC frequency, if the agent knows it.
    pub tsc_khz: Option<u32>,
    /// The full guest TSC read while answering the hello.
    pub hello_tsc: GuestTicks,
    /// The host bracket of that read (refined by the transport when there was one greeting).
    pub hello_stamps: FrameStamps,
}

/// Counters of everything that did not become a sample.
///
/// `lost_probes` counts every probe that gave no sample; `ambiguous`, `out_of_window`,
/// `wrong_vcpu`, `bad_stamps` and `flooded` say why for some of them (the rest: the agent
/// answered with an error, or garbage ate the reply). `bad_frames`, `stale_replies`,
/// `unknown_seq` and `unexpected` count skipped messages, which need not lose a probe.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Probes sent (compact and full).
    pub sent: u64,
    /// Runs of bytes between delimiters that did not decode or were too long for a frame
    /// (skipped): console text on a shared UART, or damaged frames.
    pub bad_frames: u64,
    /// Bytes of those runs: the guest's console text (written to `--console FILE` when
    /// given), delimiters not counted.
    pub console_bytes: u64,
    /// Replies to an earlier probe (skipped).
    pub stale_replies: u64,
    /// Probes that gave no sample, for any reason.
    pub lost_probes: u64,
    /// Well-formed messages that were not expected at that point (skipped).
    pub unexpected: u64,
    /// Replies carrying a sequence number this session never sent (skipped).
    pub unknown_seq: u64,
    /// Compact replies whose window held more than one value with their low bits: the guest
    /// stalled or the reply was late (lost; the next probe asks for the full TSC).
    pub ambiguous: u64,
    /// Replies whose TSC lies outside the window the last verified reading allows: backwards,
    /// jumped, or absurd (lost; the reference is forgotten).
    pub out_of_window: u64,
    /// Replies from another vCPU than the one asked for (lost).
    pub wrong_vcpu: u64,
    /// Probes whose host stamps put the receive before the send (lost).
    pub bad_stamps: u64,
    /// Where the samples' host brackets come from ([`StampedTransport::anchor`]).
    pub anchor: AnchorKind,
    /// Probes whose transport vouches for its own stamps (exit anchoring) but found no exits
    /// for this exchange (lost: a bracket is never guessed).
    pub unanchored: u64,
    /// Probe waits abandoned after [`MAX_BYTES_PER_WAIT`] bytes without the reply (lost).
    pub flooded: u64,
    /// Samples that came from compact replies (unwrapped in their window); the others came
    /// from full-width ones.
    pub compact_samples: u64,
}

/// A connected, greeted agent.
#[derive(Debug)]
pub struct ProbeSession<T> {
    transport: T,
    rx: FrameReceiver,
    buf: [u8; READ_CHUNK],
    /// Unconsumed bytes are `buf[pos..end]`; they arrived before `buf_stamp`.
    pos: usize,
    end: usize,
    buf_stamp: HostTicks,
    info: AgentInfo,
    /// The last verified guest reading of the selected vCPU and its host bracket.
    reference: Option<Reference>,
    /// The vCPU probes ask for ([`ProbeSession::select_vcpu`]; the agent's own at first).
    target: u32,
    /// The other vCPUs' references, kept while another vCPU is selected (each vCPU's TSC is
    /// its own clock). One entry per vCPU the caller selected, so bounded by the caller.
    parked: Vec<(u32, Option<Reference>)>,
    /// The vCPUs whose event batches this session accepts: the agent's own, or the list its
    /// [`Message::Vcpus`] gave ([`ProbeSession::vcpus`]).
    served: Vec<u32>,
    seq: Seq,
    /// Bytes received during the current wait (see [`MAX_BYTES_PER_WAIT`]).
    wait_bytes: u64,
    timeout: Duration,
    stats: SessionStats,
    /// Consecutive probes lost to garbage (timeouts with bad frames received).
    garbage_losses: u32,
    /// Raised from a signal handler: every wait gives up with [`ProbeError::Interrupted`].
    stop: Option<&'static AtomicBool>,
    /// Where every probe that gave a sample is written (`--probe-log`).
    log: Option<ProbeLog>,
    /// Where console text is written (`--console`).
    console: Option<ConsoleLog>,
}

impl<T: StampedTransport> ProbeSession<T> {
    /// Greets the agent: sends a lone delimiter (flushing a receiver stuck mid-garbage) and a
    /// [`Hello`], repeated every 500 ms, until its [`Capabilities`] arrive or `timeout`
    /// passes. `timeout` is also the deadline of every later reply.
    ///
    /// # Errors
    /// [`ProbeError::Timeout`] if no capabilities arrive, [`ProbeError::VersionMismatch`],
    /// [`ProbeError::Transport`].
    pub fn hello(transport: T, timeout: Duration) -> Result<Self, ProbeError> {
        Self::hello_until_stopped(transport, timeout, None, None)
    }

    /// [`ProbeSession::hello`] with a stop flag (the CLI's SIGINT/SIGTERM flag): this and
    /// every later wait of the session (hello, replies, the pause between probes) gives up
    /// with [`ProbeError::Interrupted`] within about [`STOP_POLL`] of `stop` being raised.
    /// Console text the guest prints between frames, from the first byte received on (its
    /// boot log may arrive during the hello), goes to `console` (`--console`).
    ///
    /// # Errors
    /// As [`ProbeSession::hello`], plus [`ProbeError::Interrupted`] and
    /// [`ProbeError::Console`].
    pub fn hello_until_stopped(
        transport: T,
        timeout: Duration,
        stop: Option<&'static AtomicBool>,
        console: Option<ConsoleLog>,
    ) -> Result<Self, ProbeError> {
        let mut s = Self {
            transport,
            rx: FrameReceiver::new(),
            buf: [0; READ_CHUNK],
            pos: 0,
            end: 0,
            buf_stamp: HostTicks(0),
            info: AgentInfo {
                vcpu: 0,
                transport: vmtsync_core::proto::Transport::Other,
                features: Features::NONE,
                tsc_khz: None,
                hello_tsc: GuestTicks(0),
                hello_stamps: FrameStamps {
                    send: HostTicks(0),
                    recv: HostTicks(0),
                },
            },
            reference: None,
            target: 0,
            parked: Vec::new(),
            served: Vec::new(),
            seq: 0,
            wait_bytes: 0,
            timeout,
            stats: SessionStats::default(),
            garbage_losses: 0,
            stop,
            log: None,
            console,
        };
        let deadline = Instant::now() + timeout;
        // The capabilities may answer any of the hellos: the first send bounds them all.
        let mut first_send = None;
        let mut greetings = 0u32;
        s.wait_bytes = 0;
        let caps: Capabilities = 'greet: loop {
            // An agent that is still booting (or drains its receiver when it becomes ready)
            // never sees an early hello: say it again every HELLO_RESEND until the deadline.
            let sent = s.transport.send(&[0]).map_err(|e| s.io("hello", e))?;
            first_send.get_or_insert(sent);
            greetings += 1;
            s.send(&Message::Hello(Hello {
                version: PROTOCOL_VERSION,
                features: Features::NONE,
            }))?;
            let step = (Instant::now() + HELLO_RESEND).min(deadline);
            loop {
                match s.next_message(step, "the capabilities (hello reply)") {
                    Ok((Message::Capabilities(c), _)) => break 'greet c,
                    // An error answering the delimiter or earlier garbage: keep waiting.
                    Ok(_) => s.stats.unexpected += 1,
                    Err(ProbeError::Timeout { .. }) if Instant::now() < deadline => {
                        continue 'greet;
                    }
                    Err(ProbeError::Timeout {
                        what, bad_frames, ..
                    }) => {
                        return Err(ProbeError::Timeout {
                            what,
                            after: timeout,
                            bad_frames,
                        });
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        if caps.version != PROTOCOL_VERSION {
            return Err(ProbeError::VersionMismatch {
                host: PROTOCOL_VERSION,
                agent: caps.version,
            });
        }
        let raw = FrameStamps {
            send: first_send.unwrap_or(HostTicks(0)),
            recv: s.buf_stamp,
        };
        // A transport's refinement is tied to the last request it carried: only sound when
        // there was one greeting.
        let stamps = if greetings == 1 {
            s.transport.refine(raw).unwrap_or(raw)
        } else {
            raw
        };
        s.target = caps.vcpu;
        s.info = AgentInfo {
            vcpu: caps.vcpu,
            transport: caps.transport,
            features: caps.features,
            tsc_khz: caps.tsc_khz,
            hello_tsc: caps.tsc,
            hello_stamps: stamps,
        };
        // The first reading: nothing to check it against yet.
        s.reference = (stamps.send <= stamps.recv).then_some(Reference {
            send: stamps.send,
            recv: stamps.recv,
            guest: caps.tsc,
        });
        Ok(s)
    }

    /// What the agent reported in its hello reply.
    pub const fn info(&self) -> &AgentInfo {
        &self.info
    }

    /// Counters so far, with the transport's anchor.
    pub fn stats(&self) -> SessionStats {
        SessionStats {
            anchor: self.transport.anchor(),
            ..self.stats
        }
    }

    /// Writes every later probe that gives a sample to `log` (`--probe-log`), for `vmtsync
    /// validate`.
    pub fn log_probes(&mut self, log: ProbeLog) {
        self.log = Some(log);
    }

    /// Forgets the unwrap reference, so the next probe asks for the full TSC (done at the start
    /// of each continuous-mode round, when the guest may have been paused or migrated).
    pub fn forget_reference(&mut self) {
        self.reference = None;
    }

    /// The vCPUs that answer probes: the agent's own, or with [`Features::SMP`] the ones its
    /// [`Message::Vcpus`] lists, in increasing order.
    ///
    /// # Errors
    /// [`ProbeError::Protocol`] for another answer (or a list without the agent's own vCPU),
    /// else as [`ProbeSession::request`].
    pub fn vcpus(&mut self) -> Result<Vec<u32>, ProbeError> {
        if !self.info.features.contains(Features::SMP) {
            return Ok(vec![self.info.vcpu]);
        }
        let mut reply = self.request(&Message::VcpusRequest)?.0;
        let deadline = Instant::now() + self.timeout;
        loop {
            match reply {
                Message::Vcpus { online } => {
                    let list: Vec<u32> = (0..64).filter(|i| online >> i & 1 == 1).collect();
                    return if list.contains(&self.info.vcpu) {
                        self.served.clone_from(&list);
                        Ok(list)
                    } else {
                        Err(ProbeError::Protocol(format!(
                            "its vCPU list {online:#x} lacks its own vCPU {}",
                            self.info.vcpu
                        )))
                    };
                }
                Message::Error(ErrorCode::NotReady) => return Err(ProbeError::AgentNotReady),
                Message::Error(e) => {
                    return Err(ProbeError::Protocol(format!(
                        "answered the vCPU list request with {e:?}"
                    )));
                }
                // A late answer to something earlier (the capabilities of a hello said twice
                // while the agent booted, a probe reply after a timeout): skip it.
                _ => {
                    self.stats.unexpected += 1;
                    reply = self.next_message(deadline, "the vCPU list")?.0;
                }
            }
        }
    }

    /// Makes later probes ask for vCPU `vcpu`'s TSC, read on that vCPU ([`Message::ProbeOn`];
    /// the agent's own vCPU keeps the plain [`Message::Probe`]). Each vCPU keeps its own
    /// unwrap reference.
    ///
    /// # Errors
    /// [`ProbeError::UnknownVcpu`] for another vCPU than the agent's when it lacks
    /// [`Features::SMP`]. An SMP agent refuses a vCPU it does not serve probe by probe.
    pub fn select_vcpu(&mut self, vcpu: u32) -> Result<(), ProbeError> {
        if vcpu != self.info.vcpu && !self.info.features.contains(Features::SMP) {
            return Err(ProbeError::UnknownVcpu {
                vcpu,
                online: vec![self.info.vcpu],
            });
        }
        if vcpu == self.target {
            return Ok(());
        }
        let here = (self.target, self.reference.take());
        match self.parked.iter_mut().find(|(v, _)| *v == vcpu) {
            Some(slot) => {
                self.reference = slot.1.take();
                *slot = here;
            }
            None => self.parked.push(here),
        }
        self.target = vcpu;
        Ok(())
    }

    /// The vCPU probes ask for.
    pub const fn selected_vcpu(&self) -> u32 {
        self.target
    }

    /// One probe round trip. `Ok(None)` if this probe was lost (the agent answered with an
    /// error, or the reply could not be used); it is counted in [`SessionStats::lost_probes`]
    /// and, where there is one, under its reason.
    ///
    /// # Errors
    /// [`ProbeError::Timeout`] when no reply arrives within the session timeout,
    /// [`ProbeError::AgentNotReady`] / [`ProbeError::AgentExited`] when the agent lost the
    /// session, [`ProbeError::Flooded`] when several probes in a row drowned in other traffic,
    /// [`ProbeError::Transport`].
    pub fn probe(&mut self) -> Result<Option<ProbeSample>, ProbeError> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let now = self.transport.now();
        let compact = self
            .reference
            .is_some_and(|r| now.0.saturating_sub(r.send.0) < UNWRAP_HORIZON);
        let msg = match (self.target == self.info.vcpu, compact) {
            (true, true) => Message::Probe { seq },
            (true, false) => Message::ProbeFull { seq },
            (false, full) => Message::ProbeOn {
                seq,
                vcpu: self.target,
                full: !full,
            },
        };
        let send = self.send(&msg)?;
        self.stats.sent += 1;
        let deadline = Instant::now() + self.timeout;
        let bad_before = self.stats.bad_frames;
        self.wait_bytes = 0;
        let (reading, reply, vcpu, recv) = loop {
            let (msg, stamp) = match self.next_message(deadline, "a probe reply") {
                Ok(m) => m,
                // Garbage arrived instead of the reply (noise on a serial line eats a frame),
                // or a flood: the guest is not silent, so lose this probe, up to a few in a row.
                Err(ProbeError::Timeout { .. })
                    if self.stats.bad_frames > bad_before
                        && self.garbage_losses < MAX_GARBAGE_LOSSES =>
                {
                    self.garbage_losses += 1;
                    return Ok(self.lost());
                }
                Err(ProbeError::Flooded { .. }) if self.garbage_losses < MAX_GARBAGE_LOSSES => {
                    self.garbage_losses += 1;
                    self.stats.flooded += 1;
                    return Ok(self.lost());
                }
                Err(e) => return Err(e),
            };
            match msg {
                Message::ProbeReply(r) if r.seq == seq => {
                    if !compact {
                        // We asked for a full reply: a compact one has no window to unwrap in.
                        self.stats.unexpected += 1;
                        continue;
                    }
                    break (
                        Reading::Low32(r.tsc_low32),
                        Message::ProbeReply(r),
                        r.vcpu,
                        stamp,
                    );
                }
                Message::ProbeReplyFull(r) if r.seq == seq => {
                    break (
                        Reading::Full(r.guest_tsc()),
                        Message::ProbeReplyFull(r),
                        r.vcpu,
                        stamp,
                    );
                }
                Message::ProbeReply(vmtsync_core::proto::ProbeReply { seq: other, .. })
                | Message::ProbeReplyFull(vmtsync_core::proto::ProbeReplyFull {
                    seq: other, ..
                }) => {
                    if self.was_sent(other) {
                        self.stats.stale_replies += 1;
                    } else {
                        self.stats.unknown_seq += 1;
                    }
                }
                Message::Error(ErrorCode::NotReady) => return Err(ProbeError::AgentNotReady),
                Message::Error(_) => return Ok(self.lost()),
                Message::Exiting => return Err(ProbeError::AgentExited),
                _ => self.stats.unexpected += 1,
            }
        };
        if vcpu != self.target {
            self.stats.wrong_vcpu += 1;
            return Ok(self.lost());
        }
        let Some(stamps) = self.transport.refine(FrameStamps { send, recv }) else {
            self.stats.unanchored += 1;
            return Ok(self.lost());
        };
        if stamps.recv < stamps.send {
            self.stats.bad_stamps += 1;
            return Ok(self.lost());
        }
        let Some(guest) = self.guest_reading(reading, stamps) else {
            return Ok(self.lost());
        };
        self.reference = Some(Reference {
            send: stamps.send,
            recv: stamps.recv,
            guest,
        });
        self.garbage_losses = 0;
        let sample = ProbeSample {
            host_send: stamps.send,
            guest,
            host_recv: stamps.recv,
            vcpu,
        };
        if let Some(log) = &mut self.log {
            let anchor = self.transport.anchor();
            log.append(
                seq,
                &msg,
                &reply,
                &sample,
                FrameStamps { send, recv },
                anchor,
            )?;
        }
        Ok(Some(sample))
    }

    /// The guest tick a matching reply read, checked against (or, compact, unwrapped in)
    /// the window the last reference gives for `stamps`; `None`, counted under its reason,
    /// when it cannot be used.
    fn guest_reading(&mut self, reading: Reading, stamps: FrameStamps) -> Option<GuestTicks> {
        let window = self.reference.map(|r| r.window(stamps.send, stamps.recv));
        match (reading, window) {
            // The first reading after the reference was forgotten: nothing to check against.
            (Reading::Full(g), None) => Some(g),
            (Reading::Full(g), Some(Some(w))) if w.contains(g) => Some(g),
            (Reading::Low32(low), Some(Some(w))) if w.is_unambiguous() => {
                match w.unwrap_low32(low) {
                    Some(g) => {
                        self.stats.compact_samples += 1;
                        Some(g)
                    }
                    None => {
                        self.stats.out_of_window += 1;
                        None
                    }
                }
            }
            (Reading::Low32(_), Some(Some(_))) => {
                self.stats.ambiguous += 1;
                None
            }
            // A full reading outside its window, or a window that is empty (a reference whose
            // bracket ends after this one's, which in-order stamps cannot produce).
            (Reading::Full(_), Some(_)) | (Reading::Low32(_), Some(None)) => {
                self.stats.out_of_window += 1;
                None
            }
            // A compact probe is only sent with a reference; a lost reference makes this
            // reply unusable.
            (Reading::Low32(_), None) => {
                self.stats.ambiguous += 1;
                None
            }
        }
    }

    /// Whether a probe with sequence number `seq` was sent in this session: one of the last
    /// `min(sent, 2^bits)` numbers before and including the current one.
    fn was_sent(&self, seq: Seq) -> bool {
        u64::from(self.seq.wrapping_sub(seq)) < self.stats.sent
    }

    /// Any other request (a pvclock report, events, a mapping push, shutdown): sends `msg` and
    /// returns the next well-formed message with the host stamps around the exchange, refined
    /// by the transport like a probe's. Those stamps bracket the reply only if it answers
    /// `msg` (these messages carry no sequence number): callers check the reply's kind. Garbage frames are skipped and counted; the wait has
    /// the session's deadline and byte budget. Probes go through [`ProbeSession::probe`],
    /// which checks and unwraps their replies.
    ///
    /// # Errors
    /// [`ProbeError::Timeout`], [`ProbeError::Flooded`], [`ProbeError::Transport`].
    pub fn request(&mut self, msg: &Message) -> Result<(Message, FrameStamps), ProbeError> {
        let send = self.send(msg)?;
        let deadline = Instant::now() + self.timeout;
        self.wait_bytes = 0;
        let (reply, recv) = self.next_message(deadline, "a reply")?;
        let raw = FrameStamps { send, recv };
        Ok((reply, self.transport.refine(raw).unwrap_or(raw)))
    }

    /// Drains up to `max` of the agent's waiting events: one [`Message::EventsRequest`], then
    /// every [`Message::Events`] batch of the answer until the one flagged `last`. Memory is
    /// bounded by `max` (at most `max + 1` batches of about 2.6 KiB each, far fewer from an
    /// honest agent, which fills them); each batch has the session's deadline and byte budget.
    ///
    /// The answer is checked, not trusted: a batch from another vCPU, an empty batch that is not
    /// the last, an answer with more than `max` records in all, a timestamp that leaves `u64`,
    /// or a non-event message in the middle is a [`ProbeError::Protocol`]; late probe replies
    /// are skipped (counted as stale). Every batch holds at least one record but the last, so
    /// an answer is at most `max + 1` batches, whatever the guest sends, and the stop flag is
    /// looked at between batches. Batches received before an error are not returned: the
    /// agent has already let go of them, and each batch's `first` index lets the caller count
    /// such a loss exactly at the next drain.
    ///
    /// # Errors
    /// [`ProbeError::Protocol`], [`ProbeError::AgentExited`], [`ProbeError::AgentNotReady`],
    /// [`ProbeError::Timeout`], [`ProbeError::Flooded`], [`ProbeError::Transport`].
    pub fn drain_events(&mut self, max: u32) -> Result<Vec<EventBatch>, ProbeError> {
        self.send(&Message::EventsRequest { max })?;
        let mut batches = Vec::new();
        let mut records: u64 = 0;
        loop {
            if self.stopped() {
                return Err(ProbeError::Interrupted);
            }
            let deadline = Instant::now() + self.timeout;
            self.wait_bytes = 0;
            let (msg, _) = self.next_message(deadline, "an event batch")?;
            let b = match msg {
                Message::Events(b) => b,
                // A reply to a probe given up on earlier: in-order links deliver it first.
                Message::ProbeReply(_) | Message::ProbeReplyFull(_) => {
                    self.stats.stale_replies += 1;
                    continue;
                }
                Message::Exiting => return Err(ProbeError::AgentExited),
                Message::Error(ErrorCode::NotReady) => return Err(ProbeError::AgentNotReady),
                other => {
                    return Err(ProbeError::Protocol(format!(
                        "expected an event batch, got {other:?}"
                    )));
                }
            };
            if b.vcpu != self.info.vcpu && !self.served.contains(&b.vcpu) {
                return Err(ProbeError::Protocol(format!(
                    "an event batch from vCPU {}, which the agent (on vCPU {}) does not serve",
                    b.vcpu, self.info.vcpu
                )));
            }
            // Only the final batch of an answer may be empty: otherwise a guest could stream
            // empty batches forever, each costing the host a whole batch of memory.
            if b.records.is_empty() && !b.last {
                return Err(ProbeError::Protocol(
                    "an empty event batch that is not the last of its answer".into(),
                ));
            }
            if b.timestamped().any(|r| r.is_none()) {
                return Err(ProbeError::Protocol(
                    "an event timestamp outside the 64-bit range".into(),
                ));
            }
            records += b.records.len() as u64;
            if records > u64::from(max) {
                return Err(ProbeError::Protocol(format!(
                    "the agent sent {records} events for a request of at most {max}"
                )));
            }
            let last = b.last;
            batches.push(b);
            if last {
                return Ok(batches);
            }
        }
    }

    /// The transport (e.g. to read stamps a VMM transport recorded for the last exchange).
    pub const fn transport(&self) -> &T {
        &self.transport
    }

    /// `n` probes, `interval` apart (0: back to back); lost probes are skipped, so fewer than
    /// `n` samples may come back.
    ///
    /// # Errors
    /// As [`ProbeSession::probe`]; the samples gathered so far are discarded.
    pub fn probe_round(
        &mut self,
        n: u32,
        interval: Duration,
        progress: &mut Progress,
    ) -> Result<Vec<ProbeSample>, ProbeError> {
        let mut samples = Vec::with_capacity(usize::try_from(n).unwrap_or(0).min(1 << 16));
        for i in 0..n {
            if i > 0 && !interval.is_zero() {
                // In short steps, so a stop is seen promptly even with a long --interval-ms.
                let until = Instant::now() + interval;
                while let Some(left) = until.checked_duration_since(Instant::now()) {
                    if left.is_zero() || self.stopped() {
                        break;
                    }
                    std::thread::sleep(left.min(STOP_POLL));
                }
            }
            if self.stopped() {
                progress.clear();
                return Err(ProbeError::Interrupted);
            }
            if let Some(s) = self.probe()? {
                samples.push(s);
            }
            progress.step(u64::from(i) + 1, u64::from(n));
        }
        progress.clear();
        Ok(samples)
    }

    /// Ends the session: sends [`Message::Shutdown`] and waits for
    /// [`Message::Exiting`] (at most 500 ms). Errors are ignored: the samples are already taken.
    pub fn shutdown(mut self) -> SessionStats {
        self.wait_bytes = 0;
        if self.send(&Message::Shutdown).is_ok() {
            // Best effort: do not make a failing run wait a second full timeout.
            let deadline = Instant::now() + self.timeout.min(SHUTDOWN_WAIT);
            while let Ok((msg, _)) = self.next_message(deadline, "exit") {
                if msg == Message::Exiting {
                    break;
                }
            }
        }
        self.stats()
    }

    /// The transport back (e.g. to reuse it).
    pub fn into_transport(self) -> T {
        self.transport
    }

    /// Whether the stop flag is raised.
    pub fn stopped(&self) -> bool {
        self.stop.is_some_and(|f| f.load(Ordering::Relaxed))
    }

    fn lost(&mut self) -> Option<ProbeSample> {
        self.stats.lost_probes += 1;
        // The reply we could not use may mean we lost track of the guest TSC.
        self.reference = None;
        None
    }

    fn send(&mut self, msg: &Message) -> Result<HostTicks, ProbeError> {
        let mut frame = [0u8; MAX_FRAME_SIZE];
        // MAX_FRAME_SIZE holds every message by construction.
        let frame = encode_frame(msg, &mut frame).map_err(|_| ProbeError::Internal("encode"))?;
        self.transport.send(frame).map_err(|e| self.io("send", e))
    }

    /// The next decodable message and a stamp taken after its last byte arrived.
    fn next_message(
        &mut self,
        deadline: Instant,
        what: &'static str,
    ) -> Result<(Message, HostTicks), ProbeError> {
        loop {
            if self.pos >= self.end {
                // With a stop flag, wait in STOP_POLL slices and look at the flag in between.
                let slice = match self.stop {
                    Some(_) => deadline.min(Instant::now() + STOP_POLL),
                    None => deadline,
                };
                let r = match self.transport.recv(&mut self.buf, slice) {
                    Ok(r) => r,
                    Err(TransportError::Timeout(_)) if self.stopped() => {
                        return Err(ProbeError::Interrupted);
                    }
                    Err(TransportError::Timeout(_)) if slice < deadline => continue,
                    Err(TransportError::Timeout(_)) => {
                        return Err(ProbeError::Timeout {
                            what,
                            after: self.timeout,
                            bad_frames: self.stats.bad_frames,
                        });
                    }
                    Err(e) => return Err(self.io(what, e)),
                };
                self.pos = 0;
                self.end = r.len.min(self.buf.len());
                self.buf_stamp = r.stamp;
                self.wait_bytes = self.wait_bytes.saturating_add(self.end as u64);
                if self.wait_bytes > MAX_BYTES_PER_WAIT {
                    // Drop what is buffered: the next wait starts afresh.
                    self.pos = self.end;
                    return Err(ProbeError::Flooded {
                        what,
                        bytes: self.wait_bytes,
                    });
                }
            }
            let input = self.buf.get(self.pos..self.end).unwrap_or_default();
            let (console, text_bytes) = (&mut self.console, &mut self.stats.console_bytes);
            let mut text = |t: &[u8]| {
                *text_bytes += t.len() as u64;
                if let Some(c) = console.as_mut() {
                    c.write(t);
                }
            };
            let (msg, rest_len) = match self.rx.feed_text(input, &mut text) {
                Feed::Consumed => (None, 0),
                Feed::Message { msg, rest } => (Some(msg), rest.len()),
                Feed::Error { rest, .. } => {
                    self.stats.bad_frames += 1;
                    (None, rest.len())
                }
            };
            self.pos = self.end - rest_len.min(self.end);
            if let Some(c) = &mut self.console {
                c.check()?;
            }
            if let Some(msg) = msg {
                return Ok((msg, self.buf_stamp));
            }
        }
    }

    fn io(&self, what: &'static str, e: TransportError) -> ProbeError {
        match e {
            TransportError::Timeout(after) => ProbeError::Timeout {
                what,
                after,
                bad_frames: self.stats.bad_frames,
            },
            e => ProbeError::Transport { what, source: e },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::transport::Received;
    use crate::probe::testutil::SimTransport;
    use proptest::prelude::*;
    use vmtsync_core::estimate::estimate_offset;

    fn run(t: SimTransport, n: u32) -> (Vec<ProbeSample>, SessionStats) {
        let mut s = ProbeSession::hello(t, Duration::from_secs(1)).unwrap();
        assert_eq!(s.info().vcpu, 3);
        let samples = s
            .probe_round(n, Duration::ZERO, &mut Progress::hidden())
            .unwrap();
        let stats = s.shutdown();
        (samples, stats)
    }

    #[test]
    fn samples_bracket_the_truth_across_tsc_low_word_wraps() {
        let offset = 5_000_000;
        let mut t = SimTransport::new(offset);
        // 0.5 * 2^30 host ticks between probes: 64 probes cross 2^32 eight times, each compact
        // reply unwrapped against the previous one.
        t.gap = 1 << 29;
        let (samples, stats) = run(t, 64);
        assert_eq!(samples.len(), 64);
        assert_eq!(stats.sent, 64);
        // Every probe but the first was compact, each unwrapped in its window. (The sim's gap
        // passes before every send, the hello's delimiter and hello included, so the first
        // probe comes 2^30 ticks after the hello's first send: past the horizon, a full one.)
        assert_eq!(stats.compact_samples, 63);
        assert_eq!(
            (stats.bad_frames, stats.lost_probes, stats.stale_replies),
            (0, 0, 0)
        );
        let e = estimate_offset(&samples).unwrap();
        let truth = i64::try_from(offset).unwrap();
        assert!(e.min <= truth && truth <= e.max, "{e:?}");
        // Every sample brackets a reading 700 ticks after send.
        for s in &samples {
            assert_eq!(s.guest.0 - offset, s.host_send.0 + 700);
        }
    }

    /// 1.2 s at 3 GHz, in simulated host ticks.
    const STALL: u64 = 3_600_000_000;

    /// Every sample brackets the truth, and so does the interval over all of them.
    fn assert_sound(samples: &[ProbeSample], offset: u64) {
        let truth = i64::try_from(offset).unwrap();
        for s in samples {
            let e = estimate_offset(std::slice::from_ref(s)).unwrap();
            assert!(e.min <= truth && truth <= e.max, "{s:?} misses {truth}");
        }
        let e = estimate_offset(samples).unwrap();
        assert!(e.min <= truth && truth <= e.max, "{e:?} misses {truth}");
    }

    #[test]
    fn a_guest_stalled_before_the_first_compact_reply_loses_that_probe_not_the_truth() {
        // Sends 1 and 2 are the hello's delimiter and hello; 3 is the first (compact) probe.
        one_stall_loses_one_probe(77_000, 3, 8);
    }

    #[test]
    fn a_guest_stalled_mid_run_loses_that_probe_not_the_truth() {
        one_stall_loses_one_probe(1 << 33, 10, 20);
    }

    /// A run of `n` probes whose guest stalls [`STALL`] ticks before answering send `send`:
    /// the stalled reply's window spans ~2 * 3.6e9 ticks, so that probe alone is ambiguous and
    /// lost; the next probe asks for the full TSC, the session carries on, and every other
    /// probe is a sound sample.
    fn one_stall_loses_one_probe(offset: u64, send: u64, n: u32) {
        let mut t = SimTransport::new(offset);
        t.stall_at = Some((send, STALL));
        let (samples, stats) = run(t, n);
        assert_eq!((stats.ambiguous, stats.lost_probes), (1, 1), "{stats:?}");
        assert_eq!(samples.len(), n as usize - 1);
        assert_sound(&samples, offset);
    }

    #[test]
    fn a_guest_stalled_past_the_timeout_fails_that_probe_and_its_late_reply_is_stale() {
        let offset = 5;
        let mut t = SimTransport::new(offset);
        t.stall_at = Some((4, STALL));
        t.stall_past_timeout = true;
        let mut s = ProbeSession::hello(t, Duration::from_secs(1)).unwrap();
        let mut samples = vec![s.probe().unwrap().unwrap()];
        // The stalled probe: no reply before the deadline.
        assert!(matches!(s.probe(), Err(ProbeError::Timeout { .. })));
        // Its reply arrives during the next probe: skipped as stale, never used.
        for _ in 0..5 {
            samples.extend(s.probe().unwrap());
        }
        let stats = s.stats();
        assert_eq!(stats.stale_replies, 1, "{stats:?}");
        assert_eq!(samples.len(), 6);
        assert_sound(&samples, offset);
    }

    #[test]
    fn a_stall_at_any_probe_loses_exactly_that_probe() {
        // A 1.2 s stall before each probe in turn (with pauses between probes): the stalled
        // probe is lost, every other one is used, and every sample holds the truth.
        let offset = 123_456_789;
        for at in 3..12 {
            let mut t = SimTransport::new(offset);
            t.stall_at = Some((at, STALL));
            t.gap = 1 << 20;
            let (samples, stats) = run(t, 12);
            assert_eq!(stats.lost_probes, 1, "stall at {at}: {stats:?}");
            assert_sound(&samples, offset);
        }
    }

    #[test]
    fn a_full_reply_outside_the_window_is_rejected_and_the_next_one_trusted() {
        // The guest TSC steps back by 2^40 (a migration, a reset, a lie) before probe 3.
        let mut t = SimTransport::new(1 << 41);
        t.step_at = Some((3, 1 << 40));
        t.gap = UNWRAP_HORIZON + 1;
        let mut s = ProbeSession::hello(t, Duration::from_secs(1)).unwrap();
        let first = s.probe().unwrap().unwrap();
        assert_eq!(first.guest.0 - (1 << 41), first.host_send.0 + 700);
        // Backwards against the reference: rejected, reference forgotten.
        assert_eq!(s.probe().unwrap(), None);
        assert_eq!(s.stats().out_of_window, 1);
        // With no reference the next full reply starts afresh, on the new offset.
        let next = s.probe().unwrap().unwrap();
        assert_eq!(next.guest.0 - (1 << 40), next.host_send.0 + 700);
    }

    #[test]
    fn replies_with_unsent_sequence_numbers_are_counted_and_skipped() {
        let mut t = SimTransport::new(3);
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let forged = |seq| {
            Message::ProbeReplyFull(vmtsync_core::proto::ProbeReplyFull {
                seq,
                vcpu: 3,
                tsc: 1,
            })
        };
        let a = encode_frame(&forged(Seq::MAX), &mut buf).unwrap().to_vec();
        let b = encode_frame(&forged(1), &mut buf).unwrap().to_vec();
        // Before probe 1's reply: the largest seq (never sent); before probe 2's: seq 1 (stale).
        t.garbage = vec![b, a, vec![], vec![]];
        let (samples, stats) = run(t, 3);
        assert_eq!(samples.len(), 3);
        assert_eq!(
            (stats.unknown_seq, stats.stale_replies),
            (1, 1),
            "{stats:?}"
        );
        assert_sound(&samples, 3);
    }

    #[test]
    fn a_flooding_guest_loses_probes_then_the_session_fails_without_spinning() {
        let mut t = SimTransport::new(3);
        // 64 KiB of well-formed but unsolicited messages before each reply.
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let one = encode_frame(&Message::PvclockRequest, &mut buf)
            .unwrap()
            .to_vec();
        let flood: Vec<u8> = one.iter().copied().cycle().take(64 << 10).collect();
        t.garbage = vec![
            flood.clone(),
            flood.clone(),
            flood.clone(),
            flood,
            vec![],
            vec![],
        ];
        let mut s = ProbeSession::hello(t, Duration::from_secs(1)).unwrap();
        for _ in 0..3 {
            assert_eq!(s.probe().unwrap(), None);
        }
        assert!(matches!(s.probe(), Err(ProbeError::Flooded { .. })));
        let stats = s.stats();
        assert_eq!((stats.flooded, stats.lost_probes), (3, 3), "{stats:?}");
    }

    #[test]
    fn each_vcpu_is_probed_on_itself_with_its_own_unwrap_reference() {
        let offset = 5_000_000;
        let apart = 1 << 36;
        let mut t = SimTransport::new(offset);
        let clock = t.agent.clock_mut();
        clock.peers = 0b101;
        clock.peer_offset = apart;
        let mut s = ProbeSession::hello(t, Duration::from_secs(1)).unwrap();
        assert_eq!(s.vcpus().unwrap(), [0, 2, 3]);
        // Interleaved rounds: each vCPU's compact replies unwrap against its own reference.
        let mut progress = Progress::hidden();
        for _ in 0..2 {
            for v in [2, 0, 3] {
                s.select_vcpu(v).unwrap();
                assert_eq!(s.selected_vcpu(), v);
                let samples = s.probe_round(8, Duration::ZERO, &mut progress).unwrap();
                assert_eq!(samples.len(), 8, "vCPU {v}: {:?}", s.stats());
                let truth = offset + if v == 3 { 0 } else { apart * u64::from(v) };
                for x in &samples {
                    assert_eq!(x.vcpu, v);
                }
                assert_sound(&samples, truth);
            }
        }
        let stats = s.stats();
        assert_eq!((stats.lost_probes, stats.wrong_vcpu), (0, 0), "{stats:?}");
        // Only the first probe of each vCPU (and its own first, after the hello's reference)
        // needed the full TSC.
        assert_eq!(stats.compact_samples, 48 - 2, "{stats:?}");
        // A vCPU the agent does not serve: its probes are refused, one by one.
        s.select_vcpu(1).unwrap();
        assert_eq!(s.probe().unwrap(), None);
        assert_eq!(s.stats().lost_probes, 1);
    }

    #[test]
    fn a_late_second_capabilities_does_not_answer_the_vcpu_list() {
        // A hello said twice while the agent booted is answered twice: the second
        // capabilities arrive after the session began and must be skipped, not taken for
        // the vCPU list.
        let mut t = SimTransport::new(3);
        t.agent.clock_mut().peers = 0b11;
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let caps = Message::Capabilities(Capabilities {
            version: PROTOCOL_VERSION,
            transport: vmtsync_core::proto::Transport::Memory,
            features: Features::SMP,
            vcpu: 3,
            tsc: GuestTicks(1),
            tsc_khz: None,
        });
        t.garbage = vec![encode_frame(&caps, &mut buf).unwrap().to_vec()];
        let mut s = ProbeSession::hello(t, Duration::from_secs(1)).unwrap();
        assert_eq!(s.vcpus().unwrap(), [0, 1, 3]);
        assert_eq!(s.stats().unexpected, 1, "{:?}", s.stats());
    }

    #[test]
    fn a_single_vcpu_agent_lists_itself_and_refuses_others_up_front() {
        let mut s = ProbeSession::hello(SimTransport::new(3), Duration::from_secs(1)).unwrap();
        assert_eq!(s.vcpus().unwrap(), [3]);
        assert!(s.select_vcpu(3).is_ok());
        assert!(matches!(
            s.select_vcpu(0),
            Err(ProbeError::UnknownVcpu { vcpu: 0, .. })
        ));
    }

    #[test]
    fn the_per_connection_state_fits_the_documented_bound() {
        use std::os::unix::net::UnixStream;
        // The whole state a connection holds, whatever the guest sends (module docs).
        let size = std::mem::size_of::<ProbeSession<crate::link::StreamTransport<UnixStream>>>();
        eprintln!("ProbeSession over a socket: {size} bytes, MAX_FRAME_SIZE {MAX_FRAME_SIZE}");
        assert!(size <= MAX_SESSION_BYTES, "{size} > {MAX_SESSION_BYTES}");
    }

    #[test]
    fn a_raised_stop_flag_abandons_a_round_with_interrupted() {
        static STOP: AtomicBool = AtomicBool::new(false);
        let mut s = ProbeSession::hello_until_stopped(
            SimTransport::new(1_000),
            Duration::from_secs(2),
            Some(&STOP),
            None,
        )
        .unwrap();
        assert_eq!(
            s.probe_round(3, Duration::ZERO, &mut Progress::hidden())
                .unwrap()
                .len(),
            3
        );
        STOP.store(true, Ordering::Relaxed);
        // An hour between probes: only the flag can end this round (it did not, before).
        assert!(matches!(
            s.probe_round(3, Duration::from_secs(3600), &mut Progress::hidden()),
            Err(ProbeError::Interrupted)
        ));
        // Waiting for a reply that never comes also ends on the flag, not the deadline.
        assert!(matches!(
            s.next_message(Instant::now() + Duration::from_secs(3600), "x"),
            Err(ProbeError::Interrupted)
        ));
    }

    #[test]
    fn the_hello_is_repeated_until_a_late_agent_answers() {
        let mut t = SimTransport::new(11);
        // Two greetings (delimiter + hello each) go unheard.
        t.drop_first = 4;
        let (samples, stats) = run(t, 3);
        assert_eq!(samples.len(), 3);
        assert_eq!(stats.lost_probes, 0);
    }

    #[test]
    fn a_long_pause_switches_to_full_width_probes() {
        let mut t = SimTransport::new(123);
        t.gap = UNWRAP_HORIZON + 1;
        let mut s = ProbeSession::hello(t, Duration::from_secs(1)).unwrap();
        for _ in 0..4 {
            let sample = s.probe().unwrap().unwrap();
            assert_eq!(sample.guest.0 - 123, sample.host_send.0 + 700);
        }
        assert_eq!(s.stats().compact_samples, 0);
        let t = s.into_transport();
        // Every probe after a gap beyond the horizon was a ProbeFull (8 TSC bytes).
        assert_eq!(t.agent.stats().probes, 4);
    }

    #[test]
    fn in_process_stamps_through_refine_give_exact_bounds() {
        let mut t = SimTransport::new(42);
        t.exact = true;
        let (samples, _) = run(t, 8);
        let e = estimate_offset(&samples).unwrap();
        assert_eq!((e.min, e.max), (42, 42));
    }

    #[test]
    fn garbage_and_overlong_frames_are_counted_and_skipped() {
        let mut t = SimTransport::new(7);
        // Popped from the end, one per send: before the hello's delimiter, before the
        // capabilities, before probe 1's reply, before probe 2's reply.
        let mut overlong = vec![0x11; MAX_FRAME_SIZE * 3];
        overlong.push(0);
        t.garbage = vec![
            vec![0xde, 0xad, 0xbe, 0xef, 0],
            overlong,
            vec![0x00, 0x00, 0x05, 0x01, 0x00],
            vec![0x11; 5000],
        ];
        let (samples, stats) = run(t, 10);
        assert_eq!(samples.len(), 10);
        // 5000 bytes ended by the next delimiter (too long), a bad COBS code, an overlong
        // frame with its own delimiter, a malformed one: four, each skipped.
        assert_eq!(stats.bad_frames, 4, "{stats:?}");
        assert_eq!(stats.lost_probes, 0);
        let e = estimate_offset(&samples).unwrap();
        assert!(e.min <= 7 && 7 <= e.max);
    }

    #[test]
    fn a_reply_eaten_by_garbage_is_a_lost_probe_not_a_failed_run() {
        let mut t = SimTransport::new(9);
        // No delimiter: the run swallows probe 1's reply up to its delimiter.
        t.garbage = vec![vec![0x11; MAX_FRAME_SIZE * 2], vec![], vec![]];
        let (samples, stats) = run(t, 5);
        assert_eq!(samples.len(), 4);
        assert_eq!((stats.lost_probes, stats.bad_frames), (1, 1), "{stats:?}");
    }

    #[test]
    fn silence_is_a_timeout_not_a_hang() {
        struct Silent;
        impl StampedTransport for Silent {
            fn send(&mut self, _: &[u8]) -> Result<HostTicks, TransportError> {
                Ok(HostTicks(1))
            }
            fn recv(&mut self, _: &mut [u8], _: Instant) -> Result<Received, TransportError> {
                Err(TransportError::Timeout(Duration::from_millis(5)))
            }
        }
        let Err(err) = ProbeSession::hello(Silent, Duration::from_millis(5)) else {
            panic!("a silent peer must not complete the hello");
        };
        assert!(
            matches!(err, ProbeError::Timeout { what, .. } if what.contains("capabilities")),
            "{err}"
        );
    }

    #[test]
    fn console_text_between_frames_is_written_byte_for_byte_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.txt");
        let mut t = SimTransport::new(17);
        // Popped from the end: text before the hello's reply, then before each probe reply,
        // each ended by the delimiter a shared-UART guest writes before its next frame.
        let texts: Vec<Vec<u8>> = vec![
            b"boot: vmtsync test kernel\r\n".to_vec(),
            Vec::new(),
            b"\x01\xff high bytes and a long line: ".repeat(200),
            b"tick\n".to_vec(),
        ];
        t.garbage = texts
            .iter()
            .rev()
            .map(|x| {
                let mut g = x.clone();
                g.push(0);
                g
            })
            .collect();
        let console = ConsoleLog::create(&path).unwrap();
        let mut s =
            ProbeSession::hello_until_stopped(t, Duration::from_secs(1), None, Some(console))
                .unwrap();
        let samples = s
            .probe_round(6, Duration::ZERO, &mut Progress::hidden())
            .unwrap();
        let stats = s.stats();
        assert_eq!((samples.len(), stats.lost_probes), (6, 0), "{stats:?}");
        let want: Vec<u8> = texts.concat();
        assert_eq!(std::fs::read(&path).unwrap(), want);
        assert_eq!(stats.console_bytes, want.len() as u64);
        // The empty one is only a delimiter: three runs of text.
        assert_eq!(stats.bad_frames, 3);
        assert_sound(&samples, 17);
    }

    proptest! {
        /// Console text (any bytes but NUL, short or longer than any frame) before any
        /// reply, ended by the delimiter a shared-UART guest writes before each frame: no
        /// probe is lost and the console file holds the text byte for byte.
        #[test]
        fn console_text_at_random_loses_no_probe(
            texts in proptest::collection::vec(
                proptest::collection::vec(1u8..=255, 0..4000), 1..10),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("console.txt");
            let mut t = SimTransport::new(1 << 40);
            t.garbage = texts.iter().rev().map(|x| [&x[..], &[0]].concat()).collect();
            let console = ConsoleLog::create(&path).unwrap();
            let mut s =
                ProbeSession::hello_until_stopped(t, Duration::from_secs(1), None, Some(console))
                    .unwrap();
            let samples = s.probe_round(12, Duration::ZERO, &mut Progress::hidden()).unwrap();
            prop_assert_eq!(samples.len(), 12, "{:?}", s.stats());
            prop_assert_eq!(std::fs::read(&path).unwrap(), texts.concat());
        }

        /// Any stall at any probe, any pause between probes, any offset: every sample the
        /// session returns brackets the truth (a stalled reply is lost, never misread).
        #[test]
        fn stalls_and_pauses_never_yield_a_sample_that_misses_the_truth(
            offset in any::<u64>().prop_map(|o| o >> 2),
            at in 3u64..12,
            stall in 0u64..(1 << 34),
            gap in prop_oneof![Just(0u64), 0u64..(1 << 31)],
            past_timeout in any::<bool>(),
        ) {
            let mut t = SimTransport::new(offset);
            t.stall_at = Some((at, stall));
            t.stall_past_timeout = past_timeout;
            t.gap = gap;
            let mut s = ProbeSession::hello(t, Duration::from_secs(1)).unwrap();
            let mut samples = Vec::new();
            for _ in 0..10 {
                match s.probe() {
                    Ok(Some(x)) => samples.push(x),
                    Ok(None) | Err(ProbeError::Timeout { .. }) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            let truth = i64::try_from(offset).unwrap();
            for x in &samples {
                let e = estimate_offset(std::slice::from_ref(x)).unwrap();
                prop_assert!(e.min <= truth && truth <= e.max, "{x:?} misses {truth}");
            }
            prop_assert!(samples.len() >= 8, "{:?}", s.stats());
        }

        /// Whatever bytes the "guest" sends, the session returns samples or an error, never
        /// panics, and its memory stays bounded (fixed buffers).
        #[test]
        fn arbitrary_guest_bytes_never_panic(chunks in proptest::collection::vec(
            proptest::collection::vec(any::<u8>(), 0..300), 0..20)) {
            struct Scripted(Vec<Vec<u8>>);
            impl StampedTransport for Scripted {
                fn send(&mut self, _: &[u8]) -> Result<HostTicks, TransportError> {
                    Ok(HostTicks(10))
                }
                fn recv(&mut self, buf: &mut [u8], _: Instant) -> Result<Received, TransportError> {
                    loop {
                        let Some(c) = self.0.pop() else {
                            return Err(TransportError::Closed);
                        };
                        if c.is_empty() { continue; }
                        let n = c.len().min(buf.len());
                        buf[..n].copy_from_slice(&c[..n]);
                        return Ok(Received { len: n, stamp: HostTicks(20) });
                    }
                }
            }
            if let Ok(mut s) = ProbeSession::hello(Scripted(chunks), Duration::from_millis(1)) {
                for _ in 0..5 {
                    if s.probe().is_err() { break; }
                }
            }
        }
    }
}
