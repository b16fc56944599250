//! The probe-protocol client on an agent's vsock stream, and the summary of a probe run.
//!
//! The client stamps each exchange with the host TSC (`lfence; rdtsc`) just before the request
//! is written and just after the reply's last byte is read; every read has a deadline.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use vmtsync_core::proto::{
    Capabilities, Features, Feed, FrameReceiver, Hello, MAX_FRAME_SIZE, Message, PROTOCOL_VERSION,
    encode_frame,
};

use super::VsockRigError;
use crate::vmm::tsc::host_tsc;

/// One exchange and its host-TSC bracket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimedReply {
    /// The guest's reply.
    pub reply: Message,
    /// Host TSC just before the request was written: the guest cannot have seen it earlier.
    pub sent_tsc: u64,
    /// Host TSC just after the reply's last byte was read: the guest wrote it before.
    pub received_tsc: u64,
}

/// The probe-protocol client on the guest's vsock stream.
#[derive(Debug)]
pub struct VsockClient {
    stream: UnixStream,
    rx: FrameReceiver,
    /// Bytes read past the last complete frame.
    pending: Vec<u8>,
    /// Whether bytes of an unfinished frame have been fed.
    in_frame: bool,
}

impl VsockClient {
    pub(super) fn new(stream: UnixStream) -> Result<Self, VsockRigError> {
        stream
            .set_nonblocking(false)
            .map_err(|e| VsockRigError::Io("configuring the stream", e))?;
        Ok(Self {
            stream,
            rx: FrameReceiver::new(),
            pending: Vec::new(),
            in_frame: false,
        })
    }

    /// Reads until the next complete frame; an empty frame (the ready beacon) yields `None`.
    fn next_frame(&mut self, end: Instant) -> Result<Option<Message>, VsockRigError> {
        let mut buf = [0u8; 256];
        loop {
            // Byte by byte, so an empty frame (the beacon) is seen even amid other bytes.
            let data = std::mem::take(&mut self.pending);
            for (i, &b) in data.iter().enumerate() {
                match self.rx.feed(&[b]) {
                    Feed::Consumed => {
                        let empty_frame = b == 0 && !self.in_frame;
                        self.in_frame = b != 0;
                        if empty_frame {
                            self.pending = data[i + 1..].to_vec();
                            return Ok(None);
                        }
                    }
                    Feed::Message { msg, .. } => {
                        self.in_frame = false;
                        self.pending = data[i + 1..].to_vec();
                        return Ok(Some(msg));
                    }
                    Feed::Error { error, .. } => {
                        return Err(VsockRigError::Protocol(format!(
                            "undecodable frame from the agent: {error:?}"
                        )));
                    }
                }
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(VsockRigError::Timeout("a frame from the agent", left));
            }
            self.stream
                .set_read_timeout(Some(left))
                .map_err(|e| VsockRigError::Io("setting the read timeout", e))?;
            match self.stream.read(&mut buf) {
                Ok(0) => {
                    return Err(VsockRigError::Io(
                        "reading from the agent",
                        ErrorKind::UnexpectedEof.into(),
                    ));
                }
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(VsockRigError::Timeout(
                        "a frame from the agent",
                        end.saturating_duration_since(Instant::now()),
                    ));
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(VsockRigError::Io("reading from the agent", e)),
            }
        }
    }

    /// Waits at most `timeout` for the agent's ready beacon (an empty frame).
    ///
    /// # Errors
    /// [`VsockRigError`] on timeout, a closed stream, or a message instead of the beacon.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<(), VsockRigError> {
        match self.next_frame(Instant::now() + timeout)? {
            None => Ok(()),
            Some(m) => Err(VsockRigError::Protocol(format!(
                "expected the ready beacon, got {m:?}"
            ))),
        }
    }

    /// Sends `msg` and waits at most `timeout` for the next message, stamping both ends with
    /// the host TSC.
    ///
    /// # Errors
    /// [`VsockRigError`] on timeout, I/O failure or a bad frame.
    pub fn exchange(
        &mut self,
        msg: &Message,
        timeout: Duration,
    ) -> Result<TimedReply, VsockRigError> {
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let frame = encode_frame(msg, &mut buf)
            .map_err(|e| VsockRigError::Protocol(format!("request does not encode: {e:?}")))?;
        let end = Instant::now() + timeout;
        let sent_tsc = host_tsc();
        self.stream
            .write_all(frame)
            .map_err(|e| VsockRigError::Io("writing to the agent", e))?;
        loop {
            if let Some(reply) = self.next_frame(end)? {
                let received_tsc = host_tsc();
                return Ok(TimedReply {
                    reply,
                    sent_tsc,
                    received_tsc,
                });
            }
        }
    }
}

/// The result of [`probe_run`]: per-probe host brackets around the guest's TSC, summarised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeRun {
    /// The agent's `Capabilities`.
    pub caps: Capabilities,
    /// `(sent, guest_tsc, received)` per probe, in order.
    pub samples: Vec<(u64, u64, u64)>,
}

impl ProbeRun {
    /// Round-trip times (`received - sent`, host cycles), sorted.
    #[must_use]
    pub fn rtts_sorted(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .samples
            .iter()
            .map(|&(s, _, r)| r.wrapping_sub(s))
            .collect();
        v.sort_unstable();
        v
    }

    /// Probes whose guest TSC, moved to the host timeline with the offset `truth` (host −
    /// guest), lies outside their host bracket: none when `truth` is the real offset.
    #[must_use]
    pub fn outside_bracket(&self, truth: i128) -> usize {
        self.samples
            .iter()
            .filter(|&&(s, g, r)| {
                let on_host = i128::from(g) + truth;
                !(i128::from(s) <= on_host && on_host <= i128::from(r))
            })
            .count()
    }

    /// The offset (host − guest) interval every probe allows: the intersection of
    /// `[sent − tsc, received − tsc]`. `lo > hi` means the probes contradict each other.
    #[must_use]
    pub fn offset_interval(&self) -> (i128, i128) {
        self.samples
            .iter()
            .fold((i128::MIN, i128::MAX), |(lo, hi), &(s, g, r)| {
                (
                    lo.max(i128::from(s) - i128::from(g)),
                    hi.min(i128::from(r) - i128::from(g)),
                )
            })
    }

    /// |midpoint offset estimate − `truth`| per probe, in host cycles rounded down, sorted. The
    /// midpoint estimate is `(sent + received) / 2 − tsc`.
    #[must_use]
    pub fn midpoint_errors_sorted(&self, truth: i128) -> Vec<u128> {
        let mut v: Vec<u128> = self
            .samples
            .iter()
            .map(|&(s, g, r)| {
                // Doubled so the midpoint stays an integer, halved at the end.
                (i128::from(s) + i128::from(r) - 2 * i128::from(g) - 2 * truth).unsigned_abs() / 2
            })
            .collect();
        v.sort_unstable();
        v
    }
}

/// Says hello, then sends `probes` `ProbeFull` requests, each answered before the next.
///
/// # Errors
/// [`VsockRigError`] when an exchange fails or a reply is not the expected message.
pub fn probe_run(
    client: &mut VsockClient,
    probes: u16,
    timeout: Duration,
) -> Result<ProbeRun, VsockRigError> {
    let hello = Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        features: Features::NONE,
    });
    let caps = match client.exchange(&hello, timeout)?.reply {
        Message::Capabilities(c) => c,
        other => {
            return Err(VsockRigError::Protocol(format!(
                "expected Capabilities, got {other:?}"
            )));
        }
    };
    let mut samples = Vec::with_capacity(usize::from(probes));
    // The wire's sequence number is one byte; each probe is answered before the next.
    for seq in (0..=u8::MAX).cycle().take(usize::from(probes)) {
        let t = client.exchange(&Message::ProbeFull { seq }, timeout)?;
        match t.reply {
            Message::ProbeReplyFull(r) if r.seq == seq => {
                samples.push((t.sent_tsc, r.tsc, t.received_tsc));
            }
            other => {
                return Err(VsockRigError::Protocol(format!(
                    "probe {seq}: unexpected reply {other:?}"
                )));
            }
        }
    }
    Ok(ProbeRun { caps, samples })
}

#[cfg(test)]
mod tests {
    use vmtsync_core::GuestTicks;
    use vmtsync_core::proto::Transport;

    use super::*;

    fn run(samples: Vec<(u64, u64, u64)>) -> ProbeRun {
        ProbeRun {
            caps: Capabilities {
                version: PROTOCOL_VERSION,
                transport: Transport::VirtioVsock,
                features: Features::NONE,
                vcpu: 0,
                tsc: GuestTicks(0),
                tsc_khz: None,
            },
            samples,
        }
    }

    #[test]
    fn summaries_follow_the_brackets() {
        let r = run(vec![(100, 130, 200), (300, 320, 330), (400, 399, 500)]);
        assert_eq!(r.rtts_sorted(), vec![30, 100, 100]);
        assert_eq!(r.outside_bracket(0), 1);
        // With offset 1 the third probe fits (399 + 1 = 400) and the first two still do; the
        // offset interval below is [1, 10], so 11 and 71 push probes out (331 > 330; 201 > 200).
        assert_eq!(r.outside_bracket(1), 0);
        assert_eq!(r.outside_bracket(11), 1);
        assert_eq!(r.outside_bracket(71), 2);
        // [100-130, 200-130] ∩ [300-320, 330-320] ∩ [400-399, 500-399] = [1, 10].
        assert_eq!(r.offset_interval(), (1, 10));
        // Midpoints: 150-130 = 20, 315-320 = -5, 450-399 = 51.
        assert_eq!(r.midpoint_errors_sorted(0), vec![5, 20, 51]);
        assert_eq!(r.midpoint_errors_sorted(20), vec![0, 25, 31]);
    }

    #[test]
    fn an_empty_run_allows_every_offset() {
        let r = run(Vec::new());
        assert_eq!(r.offset_interval(), (i128::MIN, i128::MAX));
        assert!(r.rtts_sorted().is_empty());
    }

    #[test]
    fn frames_split_across_reads_and_beacons_are_reassembled() {
        let (a, mut b) = UnixStream::pair().expect("pair");
        let mut client = VsockClient::new(a).expect("client");
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let frame = encode_frame(&Message::Exiting, &mut buf)
            .expect("encodes")
            .to_vec();
        let writer = std::thread::spawn(move || {
            b.write_all(&[0]).expect("beacon");
            for chunk in frame.chunks(1) {
                b.write_all(chunk).expect("chunk");
                std::thread::sleep(Duration::from_millis(2));
            }
            b
        });
        client.wait_ready(Duration::from_secs(10)).expect("beacon");
        let end = Instant::now() + Duration::from_secs(10);
        assert_eq!(
            client.next_frame(end).expect("frame"),
            Some(Message::Exiting)
        );
        let _b = writer.join().expect("writer");
        // Nothing more comes: the wait ends at its deadline instead of hanging.
        let err = client
            .next_frame(Instant::now() + Duration::from_millis(50))
            .expect_err("no more frames");
        assert!(matches!(err, VsockRigError::Timeout(..)), "{err}");
    }
}
