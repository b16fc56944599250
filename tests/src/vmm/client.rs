//! The test rigs' byte channels to the agent as [`StampedTransport`]s, so every rig drives the
//! one host-side probe driver, [`vmtsync::probe::ProbeSession`]:
//!
//! - [`Com1Transport`]: the built-in VMM's COM1. It returns the host TSC of the VM exits that
//!   bracket each exchange through [`StampedTransport::refine`] (the exit where the guest read
//!   the request's last byte, the exit where it wrote the reply's first byte), and records
//!   every stamp of the last exchange ([`Com1Exchange`]) for tests and the bench.
//! - [`PipeTransport`]: QEMU's COM1 on a stdio chardev (two pipes), stamped by this thread
//!   around `write(2)` and `read(2)` ([`PipeExchange`]).
//! - The vsock rig uses vmtsync's own socket transport ([`vmtsync::link::StreamTransport`]).
//!
//! [`wait_ready`] waits for the agent's ready beacon on any of them; [`probe_run`] runs a hello
//! and a round of probes and [`ProbeRun`] summarises it, offsets as guest − host throughout,
//! checked against a [`GuestTruth`] (KVM's debugfs mapping and the agent's skew) rather than a
//! constant offset, which would hold only on a host whose guests' TSCs equal its own.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::process::{ChildStdin, ChildStdout};
use std::time::{Duration, Instant};

use vmtsync::link::{FrameStamps, Received, StampedTransport, TransportError};
use vmtsync::probe::{AgentInfo, ProbeError, ProbeSession, Progress, SessionStats};
use vmtsync_core::HostTicks;
use vmtsync_core::estimate::{EstimateError, ProbeSample, estimate_offset};

use super::serial::{SerialByte, SerialHost};
use super::tsc::host_tsc;
use crate::truth::GuestTruth;

/// Where the frame the transport is returning started, and where the last complete one
/// started and ended, from the bytes the transport hands out. Every rig transport returns at
/// most one frame's end (a `0x00` delimiter) per `recv`, so when the session takes a message,
/// the last completed frame here is that message's.
#[derive(Debug, Clone, Copy)]
struct FrameTracker<S: Copy> {
    /// The first byte of the frame in progress and its stamp, with the bytes so far.
    current: Option<(S, usize)>,
    /// The last complete frame: its first byte's stamp, its delimiter's stamp, its length
    /// with the delimiter.
    last: Option<(S, S, usize)>,
}

impl<S: Copy> FrameTracker<S> {
    const fn new() -> Self {
        Self {
            current: None,
            last: None,
        }
    }

    /// Accounts for one byte stamped `at`.
    fn byte(&mut self, b: u8, at: S) {
        match (&mut self.current, b) {
            // A delimiter with no frame in progress: an empty frame (the ready beacon).
            (None, 0) => {}
            (None, _) => self.current = Some((at, 1)),
            (Some((first, n)), 0) => {
                self.last = Some((*first, at, *n + 1));
                self.current = None;
            }
            (Some((_, n)), _) => *n += 1,
        }
    }
}

/// Every host stamp of one exchange through the built-in VMM's COM1 (host TSC ticks), and its
/// size on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Com1Exchange {
    /// Exit where the guest read the request's last byte (its delimiter): it cannot have acted
    /// on the request before.
    pub request_read: u64,
    /// Exit just before the reply's first byte. The agent's probe path polls LSR (an exit),
    /// reads the TSC and writes the first byte with no exit in between, so for probe replies
    /// `[prev_exit, first_byte]` brackets the TSC read tightly.
    pub prev_exit: u64,
    /// Exit of the reply's first byte: anything the guest put in the reply was read before.
    pub first_byte: u64,
    /// This thread, right before queueing the request.
    pub thread_send: u64,
    /// This thread, right after the reply's first byte reached it.
    pub thread_first: u64,
    /// This thread, right after the reply's delimiter reached it.
    pub thread_recv: u64,
    /// Bytes of the request frame (with its delimiter).
    pub sent: usize,
    /// Bytes of the reply frame (with its delimiter).
    pub received: usize,
}

/// The built-in VMM's COM1 as a [`StampedTransport`], refined with the VM-exit stamps.
#[derive(Debug)]
pub struct Com1Transport<'a> {
    host: &'a SerialHost,
    frames: FrameTracker<(SerialByte, u64)>,
    /// Host TSC of the guest's latest read of a frame delimiter (from the delivery log).
    last_delimiter_read: u64,
    thread_send: u64,
    sent: usize,
    last: Com1Exchange,
}

impl<'a> Com1Transport<'a> {
    /// The transport on `host` (a [`super::Vm`]'s [`super::Vm::com1`]).
    #[must_use]
    pub fn new(host: &'a SerialHost) -> Self {
        Self {
            host,
            frames: FrameTracker::new(),
            last_delimiter_read: 0,
            thread_send: 0,
            sent: 0,
            last: Com1Exchange::default(),
        }
    }

    /// The stamps of the last exchange the session completed.
    #[must_use]
    pub const fn last_exchange(&self) -> Com1Exchange {
        self.last
    }
}

impl StampedTransport for Com1Transport<'_> {
    fn send(&mut self, frame: &[u8]) -> Result<HostTicks, TransportError> {
        self.thread_send = host_tsc();
        self.host.send(frame);
        self.sent = frame.len();
        Ok(HostTicks(self.thread_send))
    }

    fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> Result<Received, TransportError> {
        let Some(slot) = buf.first_mut() else {
            return Err(TransportError::Timeout(Duration::ZERO));
        };
        let left = deadline.saturating_duration_since(Instant::now());
        // One byte per call: each byte is stamped when it reached this thread, and a frame's
        // delimiter is always the last byte returned.
        let b = self
            .host
            .recv_timeout(left)
            .ok_or(TransportError::Timeout(left))?;
        let at = host_tsc();
        self.frames.byte(b.byte, (b, at));
        *slot = b.byte;
        Ok(Received {
            len: 1,
            stamp: HostTicks(at),
        })
    }

    fn refine(&mut self, stamps: FrameStamps) -> Option<FrameStamps> {
        // The vCPU thread logs a delivery before the guest can act on the byte, hence before
        // the reply's bytes were sent: every delivery of this request is queued by now.
        while let Some(d) = self.host.delivered_timeout(Duration::ZERO) {
            if d.byte == 0 {
                self.last_delimiter_read = d.host_tsc;
            }
        }
        let Some(((first, thread_first), (_, thread_recv), received)) = self.frames.last else {
            return Some(stamps);
        };
        // A reply to the last request means the guest read that request's delimiter, the last
        // delimiter sent; bytes the guest dropped unread (a FIFO reset at boot) are never
        // delivered, so the latest delimiter read is this request's. Never earlier than the
        // host's own send stamp.
        let request_read = self.last_delimiter_read;
        self.last = Com1Exchange {
            request_read,
            prev_exit: first.prev_exit_host_tsc,
            first_byte: first.host_tsc,
            thread_send: self.thread_send,
            thread_first,
            thread_recv,
            sent: self.sent,
            received,
        };
        Some(FrameStamps {
            send: HostTicks(stamps.send.0.max(request_read)),
            recv: HostTicks(stamps.recv.0.min(first.host_tsc)),
        })
    }
}

/// The host stamps of one exchange over QEMU's stdio (host TSC ticks), and its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PipeExchange {
    /// Right before `write(2)` of the request.
    pub send: u64,
    /// Right after the `read(2)` that returned the reply's first bytes. The agent reads its TSC
    /// before it writes the first byte, so this is an honest upper bound, tighter than `recv`.
    pub first_recv: u64,
    /// Right after the `read(2)` that completed the reply.
    pub recv: u64,
    /// Bytes of the request frame (with its delimiter).
    pub sent: usize,
    /// Bytes of the reply frame (with its delimiter).
    pub received: usize,
}

/// QEMU's COM1 on a stdio chardev (the child's stdin and stdout pipes) as a
/// [`StampedTransport`], stamped by this thread right around the system calls.
#[derive(Debug)]
pub struct PipeTransport {
    stdin: ChildStdin,
    stdout: ChildStdout,
    /// Bytes read but not yet returned (past a delimiter), `pending[at..]`.
    pending: [u8; 256],
    at: usize,
    end: usize,
    pending_stamp: u64,
    frames: FrameTracker<u64>,
    send: u64,
    sent: usize,
    last: PipeExchange,
}

impl PipeTransport {
    /// The transport on a QEMU child's piped stdin and stdout.
    #[must_use]
    pub fn new(stdin: ChildStdin, stdout: ChildStdout) -> Self {
        Self {
            stdin,
            stdout,
            pending: [0; 256],
            at: 0,
            end: 0,
            pending_stamp: 0,
            frames: FrameTracker::new(),
            send: 0,
            sent: 0,
            last: PipeExchange::default(),
        }
    }

    /// The stamps of the last exchange the session completed.
    #[must_use]
    pub const fn last_exchange(&self) -> PipeExchange {
        self.last
    }

    /// Waits until stdout is readable or `deadline` passes.
    fn readable(&self, deadline: Instant) -> Result<(), TransportError> {
        let left = deadline.saturating_duration_since(Instant::now());
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
        let mut pfd = libc::pollfd {
            fd: self.stdout.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&raw mut pfd, 1, ms) };
        match n {
            n if n > 0 => Ok(()),
            0 => Err(TransportError::Timeout(left)),
            _ => Err(TransportError::Io(std::io::Error::last_os_error())),
        }
    }
}

impl StampedTransport for PipeTransport {
    fn send(&mut self, frame: &[u8]) -> Result<HostTicks, TransportError> {
        self.send = host_tsc();
        self.stdin.write_all(frame)?;
        self.stdin.flush()?;
        self.sent = frame.len();
        Ok(HostTicks(self.send))
    }

    fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> Result<Received, TransportError> {
        if self.at >= self.end {
            self.readable(deadline)?;
            let n = self.stdout.read(&mut self.pending)?;
            if n == 0 {
                return Err(TransportError::Closed);
            }
            self.pending_stamp = host_tsc();
            (self.at, self.end) = (0, n);
        }
        let avail = self.pending.get(self.at..self.end).unwrap_or_default();
        // Up to and including the first delimiter, so a frame's end is the last byte returned.
        let n = avail
            .iter()
            .position(|&b| b == 0)
            .map_or(avail.len(), |i| i + 1)
            .min(buf.len());
        for &b in avail.get(..n).unwrap_or_default() {
            self.frames.byte(b, self.pending_stamp);
        }
        buf.get_mut(..n)
            .unwrap_or_default()
            .copy_from_slice(avail.get(..n).unwrap_or_default());
        self.at += n;
        Ok(Received {
            len: n,
            stamp: HostTicks(self.pending_stamp),
        })
    }

    fn refine(&mut self, stamps: FrameStamps) -> Option<FrameStamps> {
        if let Some((first_recv, recv, received)) = self.frames.last {
            self.last = PipeExchange {
                send: self.send,
                first_recv,
                recv,
                sent: self.sent,
                received,
            };
        }
        Some(stamps)
    }
}

/// Waits for the agent's ready beacon (an empty frame, a lone `0x00`) on `transport`, at most
/// until `deadline`; bytes before it are not protocol (boot noise). The agent sends nothing
/// after its beacon until it is asked, so nothing the session needs is consumed here.
///
/// # Errors
/// [`TransportError::Timeout`] when no beacon comes in time, or the transport's error.
pub fn wait_ready<T: StampedTransport>(
    transport: &mut T,
    deadline: Instant,
) -> Result<(), TransportError> {
    let mut buf = [0u8; 64];
    loop {
        let r = transport.recv(&mut buf, deadline)?;
        if buf.get(..r.len).unwrap_or_default().contains(&0) {
            return Ok(());
        }
    }
}

/// A hello and a round of probes, as one session saw them.
#[derive(Debug, Clone)]
pub struct ProbeRun {
    /// What the agent said in its capabilities.
    pub info: AgentInfo,
    /// The samples, in order.
    pub samples: Vec<ProbeSample>,
    /// The session's counters after the round.
    pub stats: SessionStats,
}

/// Greets the agent on `transport` and runs `probes` probes.
///
/// # Errors
/// The session's [`ProbeError`].
pub fn probe_run<T: StampedTransport>(
    transport: T,
    probes: u32,
    timeout: Duration,
) -> Result<(ProbeSession<T>, ProbeRun), ProbeError> {
    let mut session = ProbeSession::hello(transport, timeout)?;
    let samples = session.probe_round(probes, Duration::ZERO, &mut Progress::hidden())?;
    let run = ProbeRun {
        info: *session.info(),
        samples,
        stats: session.stats(),
    };
    Ok((session, run))
}

impl ProbeRun {
    /// Round-trip times (`host_recv - host_send`, host cycles), sorted.
    #[must_use]
    pub fn rtts_sorted(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.samples.iter().filter_map(ProbeSample::rtt).collect();
        v.sort_unstable();
        v
    }

    /// Probes whose guest reading is not what `truth` gives inside their host bracket
    /// `[host_send, host_recv]` ([`GuestTruth::in_bracket`]): none when `truth` is the real
    /// mapping.
    #[must_use]
    pub fn outside_bracket(&self, truth: &GuestTruth) -> Vec<ProbeSample> {
        self.samples
            .iter()
            .filter(|s| !truth.in_bracket(s.host_send, s.guest, s.host_recv))
            .copied()
            .collect()
    }

    /// The offset (guest − host) interval every probe allows: the core estimator's
    /// intersection of the probes' intervals.
    ///
    /// # Errors
    /// `NoSamples`, or `SegmentBreak` when the probes contradict each other.
    pub fn offset_interval(&self) -> Result<(i64, i64), EstimateError> {
        estimate_offset(&self.samples).map(|e| (e.min, e.max))
    }

    /// |guest reading − the truth's guest TSC at the bracket's midpoint| per probe, in guest
    /// ticks rounded down, sorted: the error of taking the midpoint as the reading's host
    /// time. A probe whose truth overflows 64 bits counts as `u128::MAX`.
    #[must_use]
    pub fn midpoint_errors_sorted(&self, truth: &GuestTruth) -> Vec<u128> {
        let mut v: Vec<u128> = self
            .samples
            .iter()
            .map(
                |s| match (truth.guest_at(s.host_send), truth.guest_at(s.host_recv)) {
                    // Doubled so the midpoint stays an integer, halved at the end.
                    (Some(lo), Some(hi)) => {
                        (2 * i128::from(s.guest.0) - i128::from(lo.0) - i128::from(hi.0))
                            .unsigned_abs()
                            / 2
                    }
                    _ => u128::MAX,
                },
            )
            .collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use vmtsync::link::FrameStamps;
    use vmtsync_core::GuestTicks;
    use vmtsync_core::mapping::KvmTscMapping;
    use vmtsync_core::proto::{Features, Transport};

    use super::*;
    use crate::truth::Skew;

    /// A truth of constant offset `o` (guest − host).
    fn constant(o: i64) -> GuestTruth {
        GuestTruth::new(KvmTscMapping::offset_only(o), None)
    }

    fn run(samples: &[(u64, u64, u64)]) -> ProbeRun {
        ProbeRun {
            info: AgentInfo {
                vcpu: 0,
                transport: Transport::VirtioVsock,
                features: Features::NONE,
                tsc_khz: None,
                hello_tsc: GuestTicks(0),
                hello_stamps: FrameStamps {
                    send: HostTicks(0),
                    recv: HostTicks(0),
                },
            },
            samples: samples
                .iter()
                .map(|&(s, g, r)| ProbeSample {
                    host_send: HostTicks(s),
                    guest: GuestTicks(g),
                    host_recv: HostTicks(r),
                    vcpu: 0,
                })
                .collect(),
            stats: SessionStats::default(),
        }
    }

    #[test]
    fn summaries_follow_the_brackets() {
        let r = run(&[(100, 130, 200), (300, 320, 330), (400, 399, 500)]);
        assert_eq!(r.rtts_sorted(), vec![30, 100, 100]);
        assert_eq!(r.outside_bracket(&constant(0)), vec![r.samples[2]]);
        // Guest − host: with offset -1 the third probe fits (399 - 400) and the first two
        // still do; the offset interval below is [-10, -1], so -11 and -71 push probes out.
        assert!(r.outside_bracket(&constant(-1)).is_empty());
        assert_eq!(r.outside_bracket(&constant(-11)).len(), 1);
        assert_eq!(r.outside_bracket(&constant(-71)).len(), 2);
        // [130-200, 130-100] ∩ [320-330, 320-300] ∩ [399-500, 399-400] = [-10, -1].
        assert_eq!(r.offset_interval(), Ok((-10, -1)));
        // Midpoints: 130-150 = -20, 320-315 = 5, 399-450 = -51.
        assert_eq!(r.midpoint_errors_sorted(&constant(0)), vec![5, 20, 51]);
        assert_eq!(r.midpoint_errors_sorted(&constant(-20)), vec![0, 25, 31]);
    }

    #[test]
    fn a_skewed_truth_moves_the_brackets_with_time() {
        // KVM's guest starts near zero (offset -1000); the agent doubles and adds 7.
        let skew = Skew(KvmTscMapping::try_new(7, 1 << 49, 48).unwrap());
        let truth = GuestTruth::new(KvmTscMapping::offset_only(-1_000), Some(skew));
        // Host 1100..1200 -> KVM 100..200 -> reported 207..407; host 2000..2010 -> 2007..2027.
        let r = run(&[(1_100, 300, 1_200), (2_000, 2_027, 2_010)]);
        assert!(r.outside_bracket(&truth).is_empty());
        assert_eq!(r.midpoint_errors_sorted(&truth), vec![7, 10]);
        // One tick past either edge is outside; so is any constant offset for both probes.
        let late = run(&[(1_100, 408, 1_200), (2_000, 2_006, 2_010)]);
        assert_eq!(late.outside_bracket(&truth).len(), 2);
        assert!(!(-3_000..3_000).any(|o| r.outside_bracket(&constant(o)).is_empty()));
    }

    #[test]
    fn an_empty_run_has_no_interval() {
        let r = run(&[]);
        assert_eq!(r.offset_interval(), Err(EstimateError::NoSamples));
        assert!(r.rtts_sorted().is_empty());
    }

    #[test]
    fn frame_tracker_skips_beacons_and_keeps_the_last_frame() {
        let mut t = FrameTracker::<u32>::new();
        for (i, b) in [0u8, 0, 5, 6, 0, 0, 7, 0].into_iter().enumerate() {
            t.byte(b, u32::try_from(i).unwrap());
        }
        assert_eq!(t.last, Some((6, 7, 2)));
        t.byte(9, 8);
        assert_eq!(t.current, Some((8, 1)));
    }

    #[test]
    fn beacons_and_frames_split_across_reads_reach_the_session() {
        use std::os::unix::net::UnixStream;
        use vmtsync::link::StreamTransport;
        use vmtsync_core::proto::{Capabilities, MAX_FRAME_SIZE, Message, encode_frame};

        let (a, mut b) = UnixStream::pair().expect("pair");
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let caps = Message::Capabilities(Capabilities {
            version: vmtsync_core::proto::PROTOCOL_VERSION,
            transport: Transport::VirtioVsock,
            features: Features::NONE,
            vcpu: 7,
            tsc: GuestTicks(1 << 40),
            tsc_khz: None,
        });
        let frame = encode_frame(&caps, &mut buf).expect("encodes").to_vec();
        let agent = std::thread::spawn(move || {
            b.write_all(&[0]).expect("beacon");
            // Wait for the hello (a delimiter, then the hello frame), then answer one byte at a
            // time.
            let mut got = Vec::new();
            let mut one = [0u8; 1];
            while got.iter().filter(|&&x| x == 0).count() < 2 {
                b.read_exact(&mut one).expect("hello");
                got.push(one[0]);
            }
            for chunk in frame.chunks(1) {
                b.write_all(chunk).expect("chunk");
                std::thread::sleep(Duration::from_millis(2));
            }
            b
        });
        let mut t = StreamTransport::new(a, Duration::from_secs(10)).expect("transport");
        wait_ready(&mut t, Instant::now() + Duration::from_secs(10)).expect("beacon");
        let mut s = ProbeSession::hello(t, Duration::from_millis(500)).expect("capabilities");
        assert_eq!(
            (s.info().vcpu, s.info().hello_tsc),
            (7, GuestTicks(1 << 40))
        );
        let _b = agent.join().expect("agent");
        // Nothing more comes: the wait ends at its deadline instead of hanging.
        let err = s.request(&Message::Shutdown).expect_err("no reply");
        assert!(matches!(err, ProbeError::Timeout { .. }), "{err}");
    }
}
