//! Finding one exchange's exits among the VM's port exits, so that no guest behaviour can
//! move a bracket off the guest's TSC read.
//!
//! A bracket only uses exits the protocol itself orders around the read (docs/anchor.md, "The
//! bracket argument"): on the UART, the `in` that completed the earliest possible reading of
//! the request (the guest cannot answer a request it has not read) and the `out` that starts
//! the latest possible writing of the reply (a frame is written only once it is whole, and it
//! holds the read's value); on the sync port, the earliest `in` after the request was sent and
//! the latest `out` of the probe's sequence number. The choices are made so that any extra
//! access, on any port by any vCPU, can only move the lower end earlier or the upper end later:
//! it may widen a bracket, never make it exclude the read.

use vmtsync_core::HostTicks;

use super::{PioExit, Unmatched};
use crate::ftrace::format::PioDirection;
use crate::link::transport::FrameStamps;

/// The exits that bracket one UART exchange's guest TSC read, host TSC each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UartBracket {
    /// The `in` that ends the earliest run of data-port reads spelling the request after the
    /// host sent it: the guest had the whole request no earlier, so this precedes the read.
    pub delimiter_in: u64,
    /// The `out` that starts the latest run of data-port writes spelling the reply: the
    /// guest's own reply is one such run, and it was written after the read.
    pub first_out: u64,
}

impl UartBracket {
    /// The bracket the session uses: `[delimiter_in, first_out]`.
    #[must_use]
    pub const fn stamps(&self) -> FrameStamps {
        FrameStamps {
            send: HostTicks(self.delimiter_in),
            recv: HostTicks(self.first_out),
        }
    }
}

/// How an exit touches `port`: not at all, as one plain byte with its value, or as an access
/// whose bytes the record does not show (wider than a byte, or a `rep ins/outs`, whose record
/// carries only the first value) and which may have moved up to `n` bytes through the port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Touch {
    None,
    Byte(u8),
    Unknown(usize),
}

pub(super) fn touch(e: &PioExit, port: u16, dir: PioDirection) -> Touch {
    let p = &e.pio;
    let start = u32::from(p.port);
    // The size comes from a trace record: saturating, so no value can overflow.
    let covers = start <= u32::from(port) && u32::from(port) < start.saturating_add(p.size.max(1));
    if p.direction != dir || !covers {
        return Touch::None;
    }
    match u8::try_from(p.val) {
        Ok(v) if p.port == port && p.size == 1 && p.count == 1 => Touch::Byte(v),
        // Each repetition moves at most one byte through `port`.
        _ => Touch::Unknown(usize::try_from(p.count.max(1)).unwrap_or(usize::MAX)),
    }
}

/// Finds the exits of one UART exchange: `request` (a whole frame, its delimiter last) sent no
/// earlier than `within.send`, `reply` (the last whole frame received) had by `within.recv`.
/// `exits` may hold any port of any traced vCPU thread, in time order.
///
/// Only accesses that reach `port` count, from every thread alike (a guest may read on one
/// vCPU and answer on another), and only inside `within`:
/// - the lower end is the `in` that completes the earliest subsequence of reads spelling
///   `request`. The guest's own reading of the request is such a subsequence (every byte it
///   read came back in an `in` after the host wrote it), so the earliest one ends no later,
///   before the guest's TSC read. Extra reads (status polls elsewhere never count; reads of
///   the data port that return stale or foreign bytes) can only make it end earlier;
/// - the upper end is the `out` that starts the latest subsequence of writes spelling `reply`.
///   The guest's own reply is such a subsequence, written after the read, so the latest one
///   starts no earlier. Extra writes (console text, another vCPU) can only make it later.
///
/// An access the record does not show byte for byte (`rep ins/outs`, a wider access that
/// covers `port`) may stand for any bytes it could have moved, which again only widens. A
/// lower end after the upper one cannot come from a guest that read the request before
/// answering: the exchange is refused.
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
    let inside = || {
        exits
            .iter()
            .filter(move |e| e.ts >= within.send.0 && e.ts <= within.recv.0)
    };
    // The request, forwards: greedy matching ends every prefix as early as possible.
    let mut have = 0;
    let mut delimiter_in = None;
    for e in inside() {
        have = match touch(e, port, PioDirection::In) {
            Touch::None => continue,
            Touch::Byte(v) if v == request[have] => have + 1,
            Touch::Byte(_) => have,
            Touch::Unknown(n) => have.saturating_add(n).min(request.len()),
        };
        if have == request.len() {
            delimiter_in = Some(e.ts);
            break;
        }
    }
    let delimiter_in = delimiter_in.ok_or(Unmatched::Request)?;
    // The reply, backwards: greedy matching starts every suffix as late as possible.
    let mut left = reply.len();
    let mut first_out = None;
    for e in inside().rev() {
        left = match touch(e, port, PioDirection::Out) {
            Touch::None => continue,
            Touch::Byte(v) if v == reply[left - 1] => left - 1,
            Touch::Byte(_) => left,
            Touch::Unknown(n) => left.saturating_sub(n),
        };
        if left == 0 {
            first_out = Some(e.ts);
            break;
        }
    }
    let first_out = first_out.ok_or(Unmatched::Reply)?;
    if delimiter_in > first_out {
        return Err(Unmatched::Order);
    }
    Ok(UartBracket {
        delimiter_in,
        first_out,
    })
}

/// Finds the sync-port exits of the probe with sequence number `seq`: the latest `out` of
/// `seq` to `port` inside `within`, and the earliest `in` from `port` not before
/// `within.send` and before that `out`, of any traced thread. The agent (`syncport=N`) does
/// `in`, reads its TSC, then `out`s the sequence number, all after it got the request and
/// before its reply (so inside `within`): its own `in` is one of those the earliest is chosen
/// from, and its own `out` one of those the latest is chosen from, so `[h(in), h(out)]`
/// brackets the read whatever other accesses to the port come between.
///
/// # Errors
/// [`Unmatched::Reply`] without such an `out`, [`Unmatched::Request`] without an `in` before
/// it.
pub fn match_sync_port(
    exits: &[PioExit],
    port: u16,
    seq: u8,
    within: FrameStamps,
) -> Result<FrameStamps, Unmatched> {
    let inside: Vec<&PioExit> = exits
        .iter()
        .filter(|e| e.ts >= within.send.0 && e.ts <= within.recv.0)
        .collect();
    let out = inside
        .iter()
        .rposition(|e| touch(e, port, PioDirection::Out) == Touch::Byte(seq))
        .ok_or(Unmatched::Reply)?;
    let before = inside[..out]
        .iter()
        .find(|e| touch(e, port, PioDirection::In) != Touch::None)
        .ok_or(Unmatched::Request)?;
    Ok(FrameStamps {
        send: HostTicks(before.ts),
        recv: HostTicks(inside[out].ts),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exits::COM1_DATA;
    use crate::ftrace::format::KvmPio;
    use proptest::prelude::*;

    const T: u32 = 77;
    const SYNC: u16 = 0x2400;
    const LSR: u16 = COM1_DATA + 5;

    fn at(ts: u64, pid: u32, port: u16, direction: PioDirection, val: u8) -> PioExit {
        PioExit {
            ts,
            pio: KvmPio {
                pid,
                direction,
                port,
                size: 1,
                count: 1,
                val: u32::from(val),
            },
        }
    }

    fn exit(ts: u64, pid: u32, direction: PioDirection, val: u8) -> PioExit {
        at(ts, pid, COM1_DATA, direction, val)
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

    /// The defect of issue 17: an ordinary console `putc` polls the line status register for
    /// THRE before every byte, so the thread's last exit before the reply comes after the TSC
    /// read. Status polls before, between and after the read take no part in the bracket.
    #[test]
    fn a_putc_that_waits_for_thre_before_writing_leaves_the_read_inside() {
        let req = [3, 1, 2, 0];
        let rep = [4, 9, 9, 9, 0];
        let read = 1_500;
        let mut ex = exchange(1_000, &req, 2_000, &rep);
        // Polls for received data after the delimiter, then (after the read) for THRE before
        // every reply byte.
        ex.push(at(1_400, T, LSR, PioDirection::In, 0x60));
        ex.extend((0..5).map(|i| at(1_995 + 10 * i, T, LSR, PioDirection::In, 0x60)));
        ex.push(at(1_600, T, LSR, PioDirection::In, 0x60));
        ex.sort_by_key(|e| e.ts);
        let b = match_uart(&ex, COM1_DATA, &req, &rep, within(900, 3_000)).unwrap();
        assert_eq!(b.stamps(), within(1_030, 2_000));
        assert!(b.delimiter_in <= read && read <= b.first_out);
    }

    #[test]
    fn other_threads_and_late_copies_only_widen_and_times_outside_are_not_used() {
        let req = [2, 5, 0];
        let rep = [2, 6, 0];
        let mut ex = exchange(1_000, &req, 2_000, &rep);
        // Another vCPU thread reads and writes the same bytes later; another port sees a
        // delimiter.
        ex.extend(exchange(2_500, &req, 2_600, &rep).into_iter().map(|mut e| {
            e.pio.pid = 78;
            e
        }));
        ex.push(at(2_700, T, 0x2f8, PioDirection::Out, 0));
        ex.sort_by_key(|e| e.ts);
        // The earliest reading of the request and the latest writing of the reply: wider
        // than either thread's own, and it holds both.
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, within(900, 3_000)).map(|b| b.stamps()),
            Ok(within(1_020, 2_600))
        );
        // Outside the process's own bracket nothing counts: thread 77's first request bytes
        // cut off, the earliest whole reading is thread 78's.
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, within(1_015, 3_000)).map(|b| b.stamps()),
            Ok(within(2_520, 2_600))
        );
        // And with thread 78's reply cut off too, the only reply was written before the only
        // whole reading of the request: no guest that answers what it read does that.
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, within(1_015, 2_550)),
            Err(Unmatched::Order)
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
        assert_eq!(
            match_uart(&[], COM1_DATA, &[], &rep, w),
            Err(Unmatched::Frames)
        );
    }

    #[test]
    fn an_access_whose_bytes_are_not_shown_may_stand_for_any_and_only_widens() {
        let req = [3, 1, 2, 0];
        let rep = [4, 9, 9, 9, 0];
        let w = within(0, 10_000);
        // A `rep outsb` of two bytes in the reply's second place: it may have carried "4 9",
        // so the latest start of the reply is there, later than its real start.
        let mut ex = exchange(1_000, &req, 2_000, &rep);
        ex[5].pio.count = 2;
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, w).map(|b| b.stamps()),
            Ok(within(1_030, 2_010))
        );
        // A word read from the port below the data register covers it: it may have read the
        // request's last byte, so the request may have been whole there already.
        let mut ex = exchange(1_000, &req, 2_000, &rep);
        let mut word = at(1_025, T, COM1_DATA - 1, PioDirection::In, 0xff);
        word.pio.size = 2;
        ex.push(word);
        ex.sort_by_key(|e| e.ts);
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, w).map(|b| b.stamps()),
            Ok(within(1_025, 2_000))
        );
    }

    #[test]
    fn stale_and_repeated_reads_of_the_data_port_cannot_move_the_lower_end_later() {
        let req = [2, 9, 0];
        let rep = [2, 1, 0];
        let mut ex = exchange(1_000, &req, 2_000, &rep);
        // Reads of an empty receiver after the delimiter return its last byte or zero, and
        // a later run of them could even spell the request again.
        ex.extend(
            [2, 9, 0, 0]
                .iter()
                .zip(0..)
                .map(|(&v, i)| exit(1_100 + 10 * i, T, PioDirection::In, v)),
        );
        ex.sort_by_key(|e| e.ts);
        assert_eq!(
            match_uart(&ex, COM1_DATA, &req, &rep, within(900, 3_000)).map(|b| b.stamps()),
            Ok(within(1_020, 2_000))
        );
    }

    #[test]
    fn the_sync_port_pair_of_the_probes_seq_brackets_it() {
        let ex = [
            at(1_000, T, SYNC, PioDirection::In, 0xff),
            at(1_100, T, SYNC, PioDirection::Out, 6),
            at(2_000, T, SYNC, PioDirection::In, 0xff),
            at(2_100, T, SYNC, PioDirection::Out, 7),
            // A UART byte of the same value.
            exit(2_120, T, PioDirection::Out, 7),
        ];
        let mut ex = ex.to_vec();
        let w = within(1_500, 3_000);
        assert_eq!(match_sync_port(&ex, SYNC, 7, w), Ok(within(2_000, 2_100)));
        assert_eq!(match_sync_port(&ex, SYNC, 6, w), Err(Unmatched::Reply));
        assert_eq!(
            match_sync_port(&ex, SYNC, 7, within(2_010, 3_000)),
            Err(Unmatched::Request),
            "an in before the request was sent is not this probe's"
        );
        // Extra `in`s between the pair (one after the read, at 2_060) and another thread's
        // `out` of the same value before the read move neither end inwards.
        ex.extend([
            at(2_060, T, SYNC, PioDirection::In, 0xff),
            at(2_030, 78, SYNC, PioDirection::Out, 7),
            at(2_010, 78, SYNC, PioDirection::In, 0xff),
        ]);
        ex.sort_by_key(|e| e.ts);
        assert_eq!(match_sync_port(&ex, SYNC, 7, w), Ok(within(2_000, 2_100)));
        // A later `out` of the same value (inside the bracket) widens it.
        ex.push(at(2_200, 78, SYNC, PioDirection::Out, 7));
        assert_eq!(match_sync_port(&ex, SYNC, 7, w), Ok(within(2_000, 2_200)));
    }

    #[test]
    fn a_stale_request_read_late_only_widens_the_bracket() {
        // The guest read an older frame and this one after the send; the earliest whole
        // reading of this one ends at its own delimiter.
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

    /// An exit a generated guest adds between two protocol steps.
    #[derive(Clone, Debug)]
    struct Extra {
        port: u16,
        out: bool,
        val: u32,
        size: u32,
        count: u32,
        pid: u32,
    }

    fn extra() -> impl Strategy<Value = Extra> {
        let port = prop_oneof![
            4 => Just(COM1_DATA),
            2 => Just(LSR),
            2 => Just(SYNC),
            1 => Just(0x2f8u16),
            1 => Just(COM1_DATA - 1),
            1 => Just(COM1_DATA - 3),
            1 => any::<u16>(),
        ];
        // Values collide often with the frames' bytes (all below 16) and the sync port's.
        let val = prop_oneof![4 => 0u32..17, 1 => Just(0xff), 1 => any::<u32>()];
        // Sizes come from trace records: an absurd one must not break the matcher either.
        let size = prop_oneof![12 => Just(1u32), 2 => Just(2), 2 => Just(4), 1 => Just(u32::MAX)];
        let count = prop_oneof![6 => Just(1u32), 1 => 2u32..5];
        (
            port,
            any::<bool>(),
            val,
            size,
            count,
            prop_oneof![Just(T), Just(78)],
        )
            .prop_map(|(port, out, val, size, count, pid)| Extra {
                port,
                out,
                val,
                size,
                count,
                pid,
            })
    }

    /// One step of the protocol, in order.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Step {
        Send,
        In(u8),
        SyncIn,
        Read,
        SyncOut,
        Out(u8),
        Recv,
    }

    /// A generated exchange: its exits, the host's bracket and the read's host time.
    struct Generated {
        exits: Vec<PioExit>,
        within: FrameStamps,
        read: u64,
        delimiter_in: u64,
        first_out: u64,
        sync: Option<(u64, u64)>,
    }

    /// Lays out `steps` one after the other with `gaps[i]` inserted before step `i` (and the
    /// last gap after the last step), `dt` ticks apart (cycled).
    fn generate(steps: &[Step], gaps: &[Vec<Extra>], dt: &[u64]) -> Generated {
        let mut g = Generated {
            exits: Vec::new(),
            within: within(0, 0),
            read: 0,
            delimiter_in: 0,
            first_out: 0,
            sync: None,
        };
        let mut ts = 1_000;
        let mut tick = dt.iter().cycle();
        let mut next = || {
            ts += tick.next().copied().unwrap_or(1);
            ts
        };
        let mut sync_in = 0;
        let mut seen_out = false;
        let empty = Vec::new();
        for (i, step) in steps.iter().chain([&Step::Recv]).enumerate() {
            for x in gaps.get(i).unwrap_or(&empty) {
                let direction = if x.out {
                    PioDirection::Out
                } else {
                    PioDirection::In
                };
                g.exits.push(PioExit {
                    ts: next(),
                    pio: KvmPio {
                        pid: x.pid,
                        direction,
                        port: x.port,
                        size: x.size,
                        count: x.count,
                        val: x.val,
                    },
                });
            }
            let t = next();
            match *step {
                Step::Send => g.within.send = HostTicks(t),
                Step::Recv => g.within.recv = HostTicks(t),
                Step::Read => g.read = t,
                Step::In(b) => {
                    g.exits.push(exit(t, T, PioDirection::In, b));
                    g.delimiter_in = t;
                }
                Step::Out(b) => {
                    g.exits.push(exit(t, T, PioDirection::Out, b));
                    if !seen_out {
                        g.first_out = t;
                        seen_out = true;
                    }
                }
                Step::SyncIn => {
                    g.exits.push(at(t, T, SYNC, PioDirection::In, 0xff));
                    sync_in = t;
                }
                Step::SyncOut => {
                    g.exits.push(at(t, T, SYNC, PioDirection::Out, 5));
                    g.sync = Some((sync_in, t));
                }
            }
        }
        g
    }

    fn steps(req: &[u8], rep: &[u8], sync: bool) -> Vec<Step> {
        let mut s = vec![Step::Send];
        s.extend(req.iter().map(|&b| Step::In(b)));
        if sync {
            s.push(Step::SyncIn);
        }
        s.push(Step::Read);
        if sync {
            s.push(Step::SyncOut);
        }
        s.extend(rep.iter().map(|&b| Step::Out(b)));
        s
    }

    fn frame(body: Vec<u8>) -> Vec<u8> {
        let mut f = body;
        f.push(0);
        f
    }

    /// An exchange and what the guest adds around it: the request and reply frames, whether
    /// the sync port brackets the read, the extra accesses before each step and the ticks
    /// between steps.
    type Around = (Vec<u8>, Vec<u8>, bool, Vec<Vec<Extra>>, Vec<u64>);

    fn guest_around_an_exchange() -> impl Strategy<Value = Around> {
        use proptest::collection::vec;
        (
            vec(1u8..16, 0..6).prop_map(frame),
            vec(1u8..16, 1..10).prop_map(frame),
            any::<bool>(),
            vec(vec(extra(), 0..4), 24),
            vec(1u64..40, 1..32),
        )
    }

    proptest! {
        /// Whatever a guest adds between any two protocol steps (reads and writes of any
        /// port, the data and sync ports included, wide and repeated accesses, by its own
        /// vCPU thread or another), a bracket either matcher returns holds the read.
        #[test]
        fn no_extra_access_moves_a_bracket_off_the_read(
            (req, rep, sync, gaps, dt) in guest_around_an_exchange(),
        ) {
            let g = generate(&steps(&req, &rep, sync), &gaps, &dt);
            if let Ok(b) = match_uart(&g.exits, COM1_DATA, &req, &rep, g.within) {
                prop_assert!(b.delimiter_in <= g.read && g.read <= b.first_out, "{b:?}, read at {}", g.read);
            }
            if sync && let Ok(s) = match_sync_port(&g.exits, SYNC, 5, g.within) {
                prop_assert!(s.send.0 <= g.read && g.read <= s.recv.0, "{s:?}, read at {}", g.read);
            }
        }

        /// Accesses that do not reach the data port or the sync port (status polls, other
        /// devices) change nothing: the brackets are exactly the protocol's own exits.
        #[test]
        fn accesses_to_other_ports_widen_nothing(
            (req, rep, sync, gaps, dt) in guest_around_an_exchange(),
        ) {
            let reaches = |x: &Extra, port: u16| {
                u32::from(x.port) <= u32::from(port)
                    && u32::from(port) < u32::from(x.port).saturating_add(x.size)
            };
            let gaps: Vec<Vec<Extra>> = gaps
                .into_iter()
                .map(|gap| {
                    gap.into_iter()
                        .filter(|x| !reaches(x, COM1_DATA) && !reaches(x, SYNC))
                        .collect()
                })
                .collect();
            let g = generate(&steps(&req, &rep, sync), &gaps, &dt);
            prop_assert_eq!(
                match_uart(&g.exits, COM1_DATA, &req, &rep, g.within),
                Ok(UartBracket { delimiter_in: g.delimiter_in, first_out: g.first_out })
            );
            if let Some((a, b)) = g.sync {
                prop_assert_eq!(match_sync_port(&g.exits, SYNC, 5, g.within), Ok(within(a, b)));
            }
        }
    }
}
