//! Finding one exchange's exits among a vCPU thread's port exits: exact, byte by byte.

use vmtsync_core::HostTicks;

use super::{PioExit, Unmatched};
use crate::ftrace::format::PioDirection;
use crate::probe::transport::FrameStamps;

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
}
