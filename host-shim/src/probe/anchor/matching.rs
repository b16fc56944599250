//! Finding one exchange's exits among a vCPU thread's port exits: exact, byte by byte.

use vmtsync_core::HostTicks;

use super::{PioExit, Unmatched};
use crate::ftrace::format::PioDirection;
use crate::probe::transport::FrameStamps;

/// The exits that bracket one exchange's guest TSC read, host TSC each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UartBracket {
    /// The `in` that read the request's delimiter: the agent had the whole request.
    pub delimiter_in: u64,
    /// The vCPU thread's last traced exit before the reply's first byte (the delimiter's, or
    /// a later status-register poll): the agent does no port I/O between its TSC read and the
    /// reply's first byte (docs/anchor.md), so this exit came before the read.
    pub last_exit: u64,
    /// The `out` of the reply's first byte: the agent had read its TSC.
    pub first_out: u64,
}

impl UartBracket {
    /// The bracket the session uses: `[last_exit, first_out]`.
    #[must_use]
    pub const fn stamps(&self) -> FrameStamps {
        FrameStamps {
            send: HostTicks(self.last_exit),
            recv: HostTicks(self.first_out),
        }
    }
}

/// Finds the exits of one UART exchange: `request` (a whole frame, its delimiter last) sent no
/// earlier than `within.send`, `reply` (the last whole frame received) had by `within.recv`.
/// `exits` may hold other ports of the same device (its status register polls); bytes are
/// only ever matched on `port`.
///
/// The reply is the latest run of consecutive `out`s to `port` by one thread inside `within`
/// whose values spell `reply`; the request is the latest run of consecutive `in`s from `port`
/// by that thread, before the reply's first `out` and not before `within.send`, whose values
/// spell `request`. The agent read its TSC after the request's last `in` (and after every
/// later exit of its thread before the reply) and before the reply's first `out`. Taking the
/// latest runs can only widen the bracket if an older identical frame were still in flight,
/// never move it off the read.
///
/// # Errors
/// [`Unmatched`] naming what was not found.
pub fn match_uart(
    exits: &[PioExit],
    port: u16,
    request: &[u8],
    reply: &[u8],
    within: FrameStamps,
) -> Result<UartBracket, Unmatched> {
    if request.is_empty() || reply.is_empty() {
        return Err(Unmatched::Frames);
    }
    let all: Vec<&PioExit> = exits
        .iter()
        .filter(|e| e.ts >= within.send.0 && e.ts <= within.recv.0)
        .collect();
    let inside: Vec<&PioExit> = all.iter().copied().filter(|e| e.pio.port == port).collect();
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
    let (delimiter_in, first_out) = (ins[end - 1].ts, inside[first_out].ts);
    if delimiter_in > first_out {
        return Err(Unmatched::Request);
    }
    let last_exit = all
        .iter()
        .filter(|e| e.pio.pid == thread && e.ts >= delimiter_in && e.ts < first_out)
        .map(|e| e.ts)
        .max()
        .unwrap_or(delimiter_in);
    Ok(UartBracket {
        delimiter_in,
        last_exit,
        first_out,
    })
}

/// Finds the sync-port exits of the probe with sequence number `seq`: the latest `out` of
/// `seq` to `port` inside `within`, by one thread, and that thread's exit on `port` just
/// before it, which must be an `in` not before `within.send`. The agent (`syncport=N`) does
/// `in`, reads its TSC, then `out`s the sequence number, so `[h(in), h(out)]` brackets the
/// read. The `out` of this probe precedes its reply, so it lies inside `within`; no other
/// request with this sequence number is outstanding, so the latest such `out` is this probe's.
///
/// # Errors
/// [`Unmatched::Reply`] without such an `out`, [`Unmatched::Request`] without its `in`.
pub fn match_sync_port(
    exits: &[PioExit],
    port: u16,
    seq: u8,
    within: FrameStamps,
) -> Result<FrameStamps, Unmatched> {
    let on_port: Vec<&PioExit> = exits
        .iter()
        .filter(|e| e.ts >= within.send.0 && e.ts <= within.recv.0 && e.pio.port == port)
        .collect();
    let plain = |e: &PioExit| e.pio.size == 1 && e.pio.count == 1;
    let out = on_port
        .iter()
        .rposition(|e| {
            e.pio.direction == PioDirection::Out && plain(e) && e.pio.val == u32::from(seq)
        })
        .ok_or(Unmatched::Reply)?;
    let thread = on_port[out].pio.pid;
    let before = on_port[..out]
        .iter()
        .rev()
        .find(|e| e.pio.pid == thread)
        .filter(|e| e.pio.direction == PioDirection::In && plain(e))
        .ok_or(Unmatched::Request)?;
    Ok(FrameStamps {
        send: HostTicks(before.ts),
        recv: HostTicks(on_port[out].ts),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ftrace::format::KvmPio;
    use crate::probe::anchor::COM1_DATA;

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
            match_uart(&ex, COM1_DATA, &req, &rep, within(900, 3_000)).map(|b| b.stamps()),
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
            match_uart(&ex, COM1_DATA, &req, &rep, within(900, 3_000)).map(|b| b.stamps()),
            Ok(within(2_520, 2_600))
        );
        // Outside the process's own bracket nothing counts: cut thread 78's reply and thread
        // 77's first request bytes off, and 77's reply has no request left.
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, within(1_015, 3_000)).map(|b| b.stamps()),
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
    fn status_polls_after_the_delimiter_tighten_the_lower_end() {
        let req = [3, 1, 2, 0];
        let rep = [4, 9, 9, 9, 0];
        let mut ex = exchange(1_000, &req, 2_000, &rep);
        // The agent polls the line status register after the delimiter (no data left), and
        // after every reply byte (waiting for THRE); another thread's poll is not its own.
        let lsr = |ts, pid| {
            let mut e = exit(ts, pid, PioDirection::In, 0x60);
            e.pio.port = COM1_DATA + 5;
            e
        };
        ex.extend([lsr(1_500, T), lsr(1_900, 78), lsr(2_005, T), lsr(2_015, T)]);
        ex.sort_by_key(|e| e.ts);
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, within(900, 3_000)),
            Ok(UartBracket {
                delimiter_in: 1_030,
                last_exit: 1_500,
                first_out: 2_000
            })
        );
    }

    #[test]
    fn the_sync_port_pair_of_the_probes_seq_brackets_it() {
        const SYNC: u16 = 0x2400;
        let at = |ts, pid, direction, val| {
            let mut e = exit(ts, pid, direction, val);
            e.pio.port = SYNC;
            e
        };
        let ex = [
            at(1_000, T, PioDirection::In, 0xff),
            at(1_100, T, PioDirection::Out, 6),
            at(2_000, T, PioDirection::In, 0xff),
            at(2_100, T, PioDirection::Out, 7),
            // Another thread's pair, and a UART byte of the same value.
            at(2_050, 78, PioDirection::In, 0xff),
            at(2_150, 78, PioDirection::Out, 8),
            exit(2_120, T, PioDirection::Out, 7),
        ];
        let mut ex = ex.to_vec();
        ex.sort_by_key(|e| e.ts);
        let w = within(1_500, 3_000);
        assert_eq!(match_sync_port(&ex, SYNC, 7, w), Ok(within(2_000, 2_100)));
        assert_eq!(match_sync_port(&ex, SYNC, 6, w), Err(Unmatched::Reply));
        assert_eq!(
            match_sync_port(&ex, SYNC, 7, within(2_010, 3_000)),
            Err(Unmatched::Request),
            "an in before the request was sent is not this probe's"
        );
        // Another exit of the thread on the port between the in and the out breaks the pair.
        ex.push(at(2_060, T, PioDirection::Out, 1));
        ex.sort_by_key(|e| e.ts);
        assert_eq!(match_sync_port(&ex, SYNC, 7, w), Err(Unmatched::Request));
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
            match_uart(&ex, COM1_DATA, &req, &rep, within(900, 3_000)).map(|b| b.stamps()),
            Ok(within(1_620, 2_000))
        );
    }
}
