//! Exit anchoring: each probe's host bracket taken from the host kernel's `kvm:kvm_pio` stamps
//! of the guest's own port I/O instead of from this process (docs/anchor.md).
//!
//! A guest agent on a UART reads the request byte by byte (`in` on the data port) and writes
//! its reply byte by byte (`out`); KVM stamps every such exit with the host TSC (trace clock
//! `x86-tsc`) before the VMM sees it. The agent reads its TSC after it has read the request's
//! delimiter and before it writes the reply's first byte, so
//! `h(delimiter in) ≤ host time of the guest's read ≤ h(first reply byte out)`: the exits of
//! the vCPU thread bracket the read, whatever the VMM and the host socket add on top.
//!
//! [`AnchoredTransport`] wraps any [`StampedTransport`]: it remembers the last request frame it
//! sent and the bytes received since, and in [`StampedTransport::refine`] drains the private
//! tracefs instance's `trace_pipe_raw` ([`PioTrace`]) and looks for the exchange's exits
//! ([`match_uart`]): the request's bytes read in order ending in its delimiter, then the
//! reply's bytes written in order, all by one vCPU thread, inside the process's own bracket.
//! The refined pair is returned only when every byte matches; otherwise the probe is dropped
//! and counted ([`AnchorStats`], `SessionStats::unanchored`), never guessed.

use std::collections::VecDeque;
use std::path::Path;
use std::time::Instant;

use vmtsync_core::HostTicks;
use vmtsync_core::proto::MAX_FRAME_SIZE;

use super::transport::{FrameStamps, Received, StampedTransport, TransportError};
use crate::ftrace::format::{KvmPio, KvmPioLayout, PioDirection};
use crate::ftrace::{Instance, RawPipes, TraceError, find_tracefs};

/// The tracepoint, as tracefs names its directory.
pub const EVENT: &str = "kvm/kvm_pio";

/// The first 16550's data register (COM1), where the agent's UART protocol runs.
pub const COM1_DATA: u16 = 0x3f8;

/// Exits kept between two probes at most; older ones are dropped first (a probe needs the
/// exits of its own request and reply, a few dozen). Bounds memory whatever the guest does.
pub const MAX_EXITS: usize = 4096;

/// Received bytes kept per exchange at most (a reply is at most [`MAX_FRAME_SIZE`]).
const MAX_RECEIVED: usize = 2 * MAX_FRAME_SIZE;

/// Which stamps a probe's bracket came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AnchorKind {
    /// `lfence; rdtsc` in this process around the system calls (or a test VMM's own stamps).
    InProcess,
    /// `kvm:kvm_pio` exits of the UART data port (request delimiter `in`, first reply `out`).
    KvmPioUart,
}

impl AnchorKind {
    /// The name used in reports and sync files.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::InProcess => "in-process",
            Self::KvmPioUart => "kvm-pio-uart",
        }
    }
}

/// One port exit of a traced vCPU thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PioExit {
    /// The exit's host TSC (the event timestamp, trace clock `x86-tsc`).
    pub ts: u64,
    /// The record.
    pub pio: KvmPio,
}

/// Why an exchange's exits were not found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unmatched {
    /// The request frame or the reply frame is not known (nothing sent, no complete reply,
    /// too many bytes).
    Frames,
    /// No run of `out`s by one thread inside the bracket spells the reply.
    Reply,
    /// No run of `in`s before the reply, by its thread, spells the request.
    Request,
}

/// Counters of the anchor (reported next to the session's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnchorStats {
    /// Exchanges whose bracket came from the exits.
    pub matched: u64,
    /// Exchanges dropped: frames unknown.
    pub no_frames: u64,
    /// Exchanges dropped: the reply's `out`s were not all found.
    pub no_reply: u64,
    /// Exchanges dropped: the request's `in`s were not all found.
    pub no_request: u64,
    /// Exits dropped because more than [`MAX_EXITS`] were waiting.
    pub exits_overflowed: u64,
    /// Ring-buffer pages that flagged events lost by the kernel, or did not walk.
    pub damaged_pages: u64,
}

/// `kvm_pio` in a private instance, filtered to some vCPU threads and ports, read as it comes.
#[derive(Debug)]
pub struct PioTrace {
    /// Declared before `instance`: the pipes close first, so the instance can be removed.
    pipes: RawPipes,
    layout: KvmPioLayout,
    threads: Vec<u32>,
    exits: VecDeque<PioExit>,
    instance: Instance,
}

impl PioTrace {
    /// Creates the instance (`vmtsync-anchor-<pid>`) under `tracefs` (or the standard mount
    /// points), clock `x86-tsc`, `kvm_pio` filtered to `threads` and `ports`, and opens every
    /// CPU's `trace_pipe_raw`.
    ///
    /// # Errors
    /// [`TraceError`]; [`TraceError::is_unavailable`] tells "not here" (no tracefs, no event,
    /// not root) from a fault. A clock that cannot be set to `x86-tsc` is refused: its
    /// stamps would not be host TSC readings.
    pub fn start(
        tracefs: Option<&Path>,
        threads: &[u32],
        ports: &[u16],
    ) -> Result<Self, TraceError> {
        let root = find_tracefs(tracefs, EVENT)?;
        let mut instance = Instance::create(&root, "anchor")?;
        if !instance.tsc_clock() {
            let clock = instance.path().join("trace_clock");
            return Err(TraceError::Io {
                action: "set x86-tsc in",
                path: clock,
                source: std::io::Error::new(
                    std::io::ErrorKind::Unsupported,
                    "the kernel offers no x86-tsc trace clock",
                ),
            });
        }
        let layout =
            KvmPioLayout::new(&instance.format(EVENT)?).map_err(|source| TraceError::Format {
                path: instance.path().join("events").join(EVENT).join("format"),
                source,
            })?;
        instance.set_filter(EVENT, &filter(threads, ports))?;
        instance.enable(EVENT)?;
        let pipes = RawPipes::open(&instance)?;
        Ok(Self {
            pipes,
            layout,
            threads: threads.to_vec(),
            exits: VecDeque::new(),
            instance,
        })
    }

    /// The instance directory (removed when this is dropped).
    #[must_use]
    pub fn instance_path(&self) -> &Path {
        self.instance.path()
    }

    /// Reads every exit that is ready into the window of kept exits (time-ordered).
    ///
    /// # Errors
    /// Read errors of `trace_pipe_raw`.
    pub fn poll(&mut self, stats: &mut AnchorStats) -> Result<(), TraceError> {
        let mut fresh = Vec::new();
        let (layout, threads) = (&self.layout, &self.threads);
        let st = self.pipes.drain(|_, ts, rec| {
            // The kernel filter already selects; checking again keeps a wrong filter (or a
            // kernel that ignored it) from matching another thread's bytes.
            if let Some(pio) = layout.decode(rec)
                && threads.contains(&pio.pid)
            {
                fresh.push(PioExit { ts, pio });
            }
        })?;
        stats.damaged_pages += st.bad_pages + st.lost_flagged;
        // Per-CPU buffers are each in order; a thread that migrated interleaves them. The
        // x86-tsc clock is the same on every CPU, so time order is the order of the exits.
        fresh.sort_by_key(|e| e.ts);
        for e in fresh {
            if self.exits.len() >= MAX_EXITS {
                self.exits.pop_front();
                stats.exits_overflowed += 1;
            }
            self.exits.push_back(e);
        }
        Ok(())
    }

    /// Forgets exits before `ts` (an exchange that started at `ts` cannot use them).
    pub fn forget_before(&mut self, ts: u64) {
        while self.exits.front().is_some_and(|e| e.ts < ts) {
            self.exits.pop_front();
        }
    }

    /// The kept exits, oldest first.
    pub fn exits(&mut self) -> &[PioExit] {
        self.exits.make_contiguous()
    }
}

/// The kernel filter: the ports, and the threads (an empty thread list filters by port only).
#[must_use]
pub fn filter(threads: &[u32], ports: &[u16]) -> String {
    let any = |terms: Vec<String>| format!("({})", terms.join(" || "));
    let ports = any(ports.iter().map(|p| format!("port == {p:#x}")).collect());
    if threads.is_empty() {
        ports
    } else {
        let t = any(threads
            .iter()
            .map(|t| format!("common_pid == {t}"))
            .collect());
        format!("{ports} && {t}")
    }
}

/// Finds the exits of one UART exchange: `request` (a whole frame, its delimiter last) sent no
/// earlier than `within.send`, `reply` (the last whole frame received) had by `within.recv`.
///
/// The reply is the latest run of consecutive `out`s to `port` by one thread inside `within`
/// whose values spell `reply`; the request is the latest run of consecutive `in`s from `port`
/// by that thread, before the reply's first `out` and not before `within.send`, whose values
/// spell `request`. The bracket is `[h(the request's last in), h(the reply's first out)]`:
/// the agent read its TSC after the one and before the other. Taking the latest runs can only
/// widen the bracket if an older identical frame were still in flight, never move it off the
/// read.
///
/// # Errors
/// [`Unmatched`] naming what was not found.
pub fn match_uart(
    exits: &[PioExit],
    port: u16,
    request: &[u8],
    reply: &[u8],
    within: FrameStamps,
) -> Result<FrameStamps, Unmatched> {
    if request.is_empty() || reply.is_empty() {
        return Err(Unmatched::Frames);
    }
    let inside: Vec<&PioExit> = exits
        .iter()
        .filter(|e| e.ts >= within.send.0 && e.ts <= within.recv.0 && e.pio.port == port)
        .collect();
    let byte = |e: &PioExit, dir: PioDirection| {
        (e.pio.direction == dir && e.pio.size == 1 && e.pio.count == 1)
            .then(|| u8::try_from(e.pio.val).ok())
            .flatten()
    };
    // The reply: scan from the end for a run of `out`s of one thread spelling it.
    let mut found = None;
    'reply: for end in (0..inside.len()).rev() {
        let thread = inside[end].pio.pid;
        let mut k = reply.len();
        let mut i = end + 1;
        while k > 0 {
            // The previous exit of this thread on this port.
            let Some(j) = (0..i).rev().find(|&j| inside[j].pio.pid == thread) else {
                continue 'reply;
            };
            if byte(inside[j], PioDirection::Out) != Some(reply[k - 1]) {
                continue 'reply;
            }
            k -= 1;
            i = j;
        }
        found = Some((thread, i));
        break;
    }
    let Some((thread, first_out)) = found else {
        return Err(Unmatched::Reply);
    };
    // The request: the latest run of `in`s of that thread before the reply, spelling it.
    let ins: Vec<&PioExit> = inside[..first_out]
        .iter()
        .copied()
        .filter(|e| e.pio.pid == thread && e.pio.direction == PioDirection::In)
        .collect();
    let end = (request.len()..=ins.len()).rev().find(|&end| {
        ins[end - request.len()..end]
            .iter()
            .zip(request)
            .all(|(e, &b)| byte(e, PioDirection::In) == Some(b))
    });
    let Some(end) = end else {
        return Err(Unmatched::Request);
    };
    let (lo, hi) = (ins[end - 1].ts, inside[first_out].ts);
    if lo > hi {
        return Err(Unmatched::Request);
    }
    Ok(FrameStamps {
        send: HostTicks(lo),
        recv: HostTicks(hi),
    })
}

/// A transport whose brackets come from `kvm_pio` exits (see the module docs).
#[derive(Debug)]
pub struct AnchoredTransport<T> {
    inner: T,
    trace: PioTrace,
    port: u16,
    /// The last request frame (empty if it was longer than any message).
    request: Vec<u8>,
    /// Bytes received since that request, at most [`MAX_RECEIVED`].
    received: Vec<u8>,
    received_overflow: bool,
    stats: AnchorStats,
}

impl<T: StampedTransport> AnchoredTransport<T> {
    /// Wraps `inner`, anchoring its exchanges on `port` (the UART data register) in `trace`.
    pub fn new(inner: T, trace: PioTrace, port: u16) -> Self {
        Self {
            inner,
            trace,
            port,
            request: Vec::with_capacity(MAX_FRAME_SIZE),
            received: Vec::with_capacity(MAX_RECEIVED),
            received_overflow: false,
            stats: AnchorStats::default(),
        }
    }

    /// The counters so far.
    pub const fn stats(&self) -> AnchorStats {
        self.stats
    }

    /// The instance directory in use.
    pub fn instance_path(&self) -> &Path {
        self.trace.instance_path()
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
        if self.trace.poll(&mut self.stats).is_err() {
            self.stats.no_frames += 1;
            return None;
        }
        let Some(reply) = self.reply() else {
            self.stats.no_frames += 1;
            return None;
        };
        let reply = reply.to_vec();
        let m = match_uart(self.trace.exits(), self.port, &self.request, &reply, stamps);
        // Later exchanges start after this one's bracket: older exits are of no further use.
        self.trace.forget_before(stamps.send.0);
        match m {
            Ok(anchored) => {
                self.stats.matched += 1;
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
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: u32 = 77;

    fn exit(ts: u64, pid: u32, direction: PioDirection, val: u8) -> PioExit {
        PioExit {
            ts,
            pio: KvmPio {
                pid,
                direction,
                port: COM1_DATA,
                size: 1,
                count: 1,
                val: u32::from(val),
            },
        }
    }

    /// The exits of a guest reading `req` from `t0` on, one byte every 10 ticks, then writing
    /// `rep` from `t1` on.
    fn exchange(t0: u64, req: &[u8], t1: u64, rep: &[u8]) -> Vec<PioExit> {
        let mut v: Vec<_> = req
            .iter()
            .zip(0..)
            .map(|(&b, i)| exit(t0 + 10 * i, T, PioDirection::In, b))
            .collect();
        v.extend(
            rep.iter()
                .zip(0..)
                .map(|(&b, i)| exit(t1 + 10 * i, T, PioDirection::Out, b)),
        );
        v
    }

    fn within(a: u64, b: u64) -> FrameStamps {
        FrameStamps {
            send: HostTicks(a),
            recv: HostTicks(b),
        }
    }

    #[test]
    fn the_bracket_is_the_delimiter_in_and_the_first_reply_out() {
        let req = [3, 1, 2, 0];
        let rep = [4, 9, 9, 9, 0];
        let ex = exchange(1_000, &req, 2_000, &rep);
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, within(900, 3_000)),
            Ok(within(1_030, 2_000))
        );
    }

    #[test]
    fn exits_of_other_threads_ports_and_times_are_not_used() {
        let req = [2, 5, 0];
        let rep = [2, 6, 0];
        let mut ex = exchange(1_000, &req, 2_000, &rep);
        // Another vCPU thread writes the same bytes later, another port sees a delimiter.
        ex.extend(exchange(2_500, &req, 2_600, &rep).into_iter().map(|mut e| {
            e.pio.pid = 78;
            e
        }));
        let mut other_port = exit(2_700, T, PioDirection::Out, 0);
        other_port.pio.port = 0x2f8;
        ex.push(other_port);
        ex.sort_by_key(|e| e.ts);
        // The latest run spelling the reply is thread 78's; its own thread has the request.
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, within(900, 3_000)),
            Ok(within(2_520, 2_600))
        );
        // Outside the process's own bracket nothing counts: cut thread 78's reply and thread
        // 77's first request bytes off, and 77's reply has no request left.
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, within(1_015, 3_000)),
            Ok(within(2_520, 2_600))
        );
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, within(1_015, 2_550)),
            Err(Unmatched::Request)
        );
    }

    #[test]
    fn a_missing_or_wrong_byte_drops_the_exchange() {
        let req = [3, 1, 2, 0];
        let rep = [4, 9, 9, 9, 0];
        let full = exchange(1_000, &req, 2_000, &rep);
        let w = within(0, 10_000);
        for skip in 0..full.len() {
            let mut ex = full.clone();
            ex.remove(skip);
            let want = if skip < req.len() {
                Unmatched::Request
            } else {
                Unmatched::Reply
            };
            assert_eq!(
                match_uart(&ex, COM1_DATA, &req, &rep, w),
                Err(want),
                "{skip}"
            );
        }
        let mut ex = full.clone();
        ex[1].pio.val = 7;
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, w),
            Err(Unmatched::Request)
        );
        // A `rep outsb` carries only its first byte: never taken for a byte of the frame.
        let mut ex = full;
        ex[5].pio.count = 2;
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, w),
            Err(Unmatched::Reply)
        );
        assert_eq!(
            match_uart(&[], COM1_DATA, &[], &rep, w),
            Err(Unmatched::Frames)
        );
    }

    #[test]
    fn a_stale_request_read_late_only_widens_the_bracket() {
        // The guest read an older frame and this one after the send; the reply follows the
        // later one, whose delimiter is taken.
        let old = [2, 8, 0];
        let req = [2, 9, 0];
        let rep = [2, 1, 0];
        let mut ex = exchange(1_000, &old, 1_500, &[2, 7, 0]);
        ex.extend(exchange(1_600, &req, 2_000, &rep));
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, within(900, 3_000)),
            Ok(within(1_620, 2_000))
        );
    }

    #[test]
    fn the_filter_names_ports_and_threads() {
        assert_eq!(filter(&[], &[0x3f8]), "(port == 0x3f8)");
        assert_eq!(
            filter(&[12, 13], &[0x3f8, 0x510]),
            "(port == 0x3f8 || port == 0x510) && (common_pid == 12 || common_pid == 13)"
        );
    }
}
