//! The check itself, on decoded inputs: pair guest events with the host exits of their port
//! I/O, convert each event's guest tick with the sync file, and test it against its bracket.

use std::collections::BTreeMap;

use serde::Serialize;

use super::probes::ProbeReport;
use crate::ftrace::format::PioDirection;
use crate::probe::anchor::PioExit;
use crate::record::bounds::{covering, host_bounds};
use crate::syncfile::SyncSegment;

/// Which side of its port I/O the guest recorded an event on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    /// Recorded right before the `out` of its sequence number: its true host time is before
    /// that `out`'s exit.
    BeforeOut,
    /// Recorded right after the `in` that follows that `out`: its true host time is after the
    /// `in`'s exit.
    AfterIn,
}

/// A guest event recorded next to port I/O, as the guest trace holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoEvent {
    /// The vCPU (the guest trace's CPU).
    pub vcpu: u32,
    /// The raw guest TSC of the event.
    pub guest_tsc: u64,
    /// Its side of the I/O.
    pub side: Side,
    /// The workload's sequence number (the low byte is the value written to the port).
    pub seq: u64,
}

/// One `out` and the `in` the same thread did next on the port: one workload step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Step {
    out_ts: u64,
    in_ts: u64,
    low: u8,
}

/// A converted event outside its bracket (or a guaranteed interval disjoint from it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// The vCPU.
    pub vcpu: u32,
    /// The sequence number.
    pub seq: u64,
    /// The side of the I/O.
    pub side: Side,
    /// The guest TSC.
    pub guest_tsc: u64,
    /// The converted host time.
    pub host_tsc: u64,
    /// Its guaranteed interval.
    pub host_lo: u64,
    /// Its guaranteed interval.
    pub host_hi: u64,
    /// The exit bracket: the host stamp it must not precede (the `in` for an after-event,
    /// the previous step's `in` for a before-event, when known).
    pub exit_lo: Option<u64>,
    /// The host stamp it must not follow.
    pub exit_hi: Option<u64>,
    /// The sync segment used (its round).
    pub round: u64,
    /// The guaranteed interval misses the bracket: the sync file's bound is false, not only
    /// its estimate.
    pub bound_false: bool,
}

/// Quantiles of the lags, ticks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LagStats {
    /// Smallest.
    pub min: i64,
    /// 1st percentile.
    pub p1: i64,
    /// Median.
    pub median: i64,
    /// 99th percentile.
    pub p99: i64,
    /// Largest.
    pub max: i64,
}

/// The worst case of one sync segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SegmentWorst {
    /// The vCPU.
    pub vcpu: u32,
    /// The segment's round.
    pub round: u64,
    /// Events converted through it.
    pub events: u64,
    /// Its smallest lag (negative: a violation).
    pub worst_lag: i64,
    /// Its violations.
    pub violations: u64,
    /// Its guaranteed offset interval width, ticks.
    pub width: i64,
}

impl SegmentWorst {
    /// Nothing converted through `seg` (vCPU `vcpu`'s) yet.
    pub(super) const fn of(vcpu: u32, seg: &SyncSegment) -> Self {
        Self {
            vcpu,
            round: seg.round,
            events: 0,
            worst_lag: i64::MAX,
            violations: 0,
            width: seg.offset_hi.saturating_sub(seg.offset_lo),
        }
    }

    /// One more conversion through the segment, with its tight-side lag.
    pub(super) fn add(&mut self, lag: i64, violation: bool) {
        self.events += 1;
        self.worst_lag = self.worst_lag.min(lag);
        self.violations += u64::from(violation);
    }
}

/// What `vmtsync validate` found (`--json`, schema 2).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ValidateReport {
    /// Always 2 (schema 2 added `probes`).
    pub schema: u32,
    /// Events checked against an exit.
    pub checked: u64,
    /// Of which recorded before an `out`.
    pub before_out: u64,
    /// Of which recorded after an `in`.
    pub after_in: u64,
    /// Checked events outside their bracket (the bar: zero).
    pub violations: u64,
    /// Of which the guaranteed interval misses the bracket too.
    pub bound_violations: u64,
    /// Guest events with no exit of their step in the host trace (outside the host trace's
    /// time span, or lost by a ring buffer): not checked.
    pub unmatched_events: u64,
    /// Guest events no segment of their vCPU converts: not checked.
    pub unconverted_events: u64,
    /// Exits that do not form an `out`-then-`in` step of one thread: not used.
    pub unpaired_exits: u64,
    /// How steps were numbered.
    pub numbering: Numbering,
    /// The tight-side lag of every checked event: exit minus converted time for a
    /// before-event, converted time minus exit for an after-event (negative: a violation).
    pub lag: Option<LagStats>,
    /// The lags of the before-events alone (how much earlier than its `out` each one lies).
    pub lag_before_out: Option<LagStats>,
    /// The lags of the after-events alone (how much later than its `in` each one lies).
    pub lag_after_in: Option<LagStats>,
    /// Per segment: its worst lag and violations.
    pub segments: Vec<SegmentWorst>,
    /// The first violations (at most [`MAX_LISTED`]).
    pub first_violations: Vec<Violation>,
    /// The probe log's check (`--probe-log`), `null` without one.
    pub probes: Option<ProbeReport>,
}

/// The most violations listed in a report.
pub const MAX_LISTED: usize = 20;

/// Turns one thread's exits (in time order) into steps: an `out` whose next exit is an `in`.
fn steps(exits: &[PioExit], unpaired: &mut u64) -> Vec<Step> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < exits.len() {
        let e = exits[i];
        match (e.pio.direction, exits.get(i + 1)) {
            (PioDirection::Out, Some(n)) if n.pio.direction == PioDirection::In => {
                out.push(Step {
                    out_ts: e.ts,
                    in_ts: n.ts,
                    // The workload writes the sequence number's low byte.
                    low: (e.pio.val & 0xff) as u8,
                });
                i += 2;
            }
            _ => {
                *unpaired += 1;
                i += 1;
            }
        }
    }
    out
}

/// How steps get their sequence numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Numbering {
    /// The host trace covers the workload from its first step (tracing began before the VM
    /// booted): the k-th `out` is step k. Nothing about the pairing comes from the sync file.
    FromBoot,
    /// The first step gets the number of the guest event converted nearest its `out`,
    /// corrected by the low byte it wrote (exact while the conversion is off by less than 128
    /// event periods).
    Nearest,
}

/// Numbers `steps` outwards from step `j`, numbered `seq_j`: each neighbour gets the nearest
/// number on its side with its own low byte, so a gap of fewer than 256 steps in the host
/// trace is bridged exactly. Steps that would need a number below 0 get none.
fn number(steps: &[Step], j: usize, seq_j: u64) -> Vec<Option<u64>> {
    let mut seqs = vec![None; steps.len()];
    if j >= steps.len() {
        return seqs;
    }
    seqs[j] = Some(seq_j);
    let mut p = seq_j;
    for i in j + 1..steps.len() {
        let next = p + 1;
        p = next + u64::from(steps[i].low.wrapping_sub((next & 0xff) as u8));
        seqs[i] = Some(p);
    }
    let mut p = Some(seq_j);
    for i in (0..j).rev() {
        p = p.and_then(|p| {
            let c = p.checked_sub(1)?;
            c.checked_sub(u64::from(((c & 0xff) as u8).wrapping_sub(steps[i].low)))
        });
        seqs[i] = p;
    }
    seqs
}

/// The index of the step whose `out` is nearest `host`, and the distance.
fn nearest_step(steps: &[Step], host: u64) -> Option<(usize, u64)> {
    let j = steps.partition_point(|s| s.out_ts < host);
    [j.checked_sub(1), Some(j)]
        .into_iter()
        .flatten()
        .filter_map(|i| Some((i, steps.get(i)?.out_ts.abs_diff(host))))
        .min_by_key(|&(_, d)| d)
}

/// The number nearest `near` whose low byte is `low`.
fn nearest_with_low(near: u64, low: u8) -> u64 {
    let base = near & !0xff;
    let cands = [base.checked_sub(256), Some(base), base.checked_add(256)];
    cands
        .into_iter()
        .flatten()
        .map(|b| b | u64::from(low))
        .min_by_key(|c| c.abs_diff(near))
        .unwrap_or(near)
}

/// Checks every event of `events` against the exits of `exits` on one port, converting with
/// `segments`; `threads` maps a vCPU to its host thread; `numbering` says how steps are
/// paired with the guest's sequence numbers.
#[must_use]
pub fn check(
    events: &[IoEvent],
    exits: &[PioExit],
    segments: &[SyncSegment],
    threads: &BTreeMap<u32, u32>,
    numbering: Numbering,
) -> ValidateReport {
    let mut r = ValidateReport {
        schema: 2,
        checked: 0,
        before_out: 0,
        after_in: 0,
        violations: 0,
        bound_violations: 0,
        unmatched_events: 0,
        unconverted_events: 0,
        unpaired_exits: 0,
        numbering,
        lag: None,
        lag_before_out: None,
        lag_after_in: None,
        segments: Vec::new(),
        first_violations: Vec::new(),
        probes: None,
    };
    let mut lags = Vec::new();
    let mut side_lags: [Vec<i64>; 2] = [Vec::new(), Vec::new()];
    let mut worst: BTreeMap<(u32, u64), SegmentWorst> = BTreeMap::new();
    let mut exits_of: BTreeMap<u32, Vec<PioExit>> = BTreeMap::new();
    for e in exits {
        exits_of.entry(e.pio.pid).or_default().push(*e);
    }
    for (pid, v) in &mut exits_of {
        if !threads.values().any(|p| p == pid) {
            r.unpaired_exits += v.len() as u64;
        }
        v.sort_by_key(|e| e.ts);
    }
    let mut vcpus: Vec<u32> = events.iter().map(|e| e.vcpu).collect();
    vcpus.sort_unstable();
    vcpus.dedup();
    for vcpu in vcpus {
        let mine: Vec<SyncSegment> = segments
            .iter()
            .filter(|s| s.vcpu == vcpu)
            .copied()
            .collect();
        let convert = |g: u64| covering(&mine, g).and_then(|s| Some((s, host_bounds(s, g)?)));
        // Events by sequence number and side.
        let mut by_seq: BTreeMap<(u64, Side), IoEvent> = BTreeMap::new();
        for e in events.iter().filter(|e| e.vcpu == vcpu) {
            by_seq.insert((e.seq, e.side), *e);
        }
        let exits = threads
            .get(&vcpu)
            .and_then(|pid| exits_of.get(pid))
            .map_or(&[][..], Vec::as_slice);
        let st = steps(exits, &mut r.unpaired_exits);
        let seqs = match numbering {
            Numbering::FromBoot => number(&st, 0, st.first().map_or(0, |s| u64::from(s.low))),
            Numbering::Nearest => {
                // One event and one step close in time anchor the numbering: the first step
                // and the event converted nearest it, or the first event and the step nearest
                // it, whichever pair is closer (the later of the two traces' starts lies in
                // both).
                let converted: Vec<(u64, u64)> = by_seq
                    .values()
                    .filter_map(|e| Some((e.seq, convert(e.guest_tsc)?.1.0)))
                    .collect();
                let from_step = st.first().and_then(|s0| {
                    converted
                        .iter()
                        .map(|&(seq, h)| (0, seq, h.abs_diff(s0.out_ts)))
                        .min_by_key(|&(_, _, d)| d)
                });
                let from_event = converted
                    .first()
                    .and_then(|&(seq, h)| nearest_step(&st, h).map(|(j, d)| (j, seq, d)));
                match [from_step, from_event]
                    .into_iter()
                    .flatten()
                    .min_by_key(|&(_, _, d)| d)
                {
                    Some((j, seq, _)) => number(&st, j, nearest_with_low(seq, st[j].low)),
                    None => Vec::new(),
                }
            }
        };
        let step_of: BTreeMap<u64, Step> = seqs
            .iter()
            .zip(&st)
            .filter_map(|(n, s)| Some(((*n)?, *s)))
            .collect();
        for e in by_seq.values() {
            let Some((seg, (host, lo, hi))) = convert(e.guest_tsc) else {
                r.unconverted_events += 1;
                continue;
            };
            let Some(step) = step_of.get(&e.seq) else {
                r.unmatched_events += 1;
                continue;
            };
            // The tight side is the event's own I/O; the loose side the neighbouring step's.
            let (exit_lo, exit_hi, lag) = match e.side {
                Side::BeforeOut => {
                    let prev = e.seq.checked_sub(1).and_then(|p| step_of.get(&p));
                    (
                        prev.map(|p| p.in_ts),
                        Some(step.out_ts),
                        signed(step.out_ts, host),
                    )
                }
                Side::AfterIn => {
                    let next = step_of.get(&(e.seq + 1));
                    (
                        Some(step.in_ts),
                        next.map(|n| n.out_ts),
                        signed(host, step.in_ts),
                    )
                }
            };
            r.checked += 1;
            match e.side {
                Side::BeforeOut => r.before_out += 1,
                Side::AfterIn => r.after_in += 1,
            }
            let outside = exit_lo.is_some_and(|l| host < l) || exit_hi.is_some_and(|h| host > h);
            let bound_false = exit_lo.is_some_and(|l| hi < l) || exit_hi.is_some_and(|h| lo > h);
            lags.push(lag);
            side_lags[usize::from(e.side == Side::AfterIn)].push(lag);
            worst
                .entry((vcpu, seg.round))
                .or_insert(SegmentWorst::of(vcpu, seg))
                .add(lag, outside || bound_false);
            if outside || bound_false {
                r.violations += 1;
                r.bound_violations += u64::from(bound_false);
                if r.first_violations.len() < MAX_LISTED {
                    r.first_violations.push(Violation {
                        vcpu,
                        seq: e.seq,
                        side: e.side,
                        guest_tsc: e.guest_tsc,
                        host_tsc: host,
                        host_lo: lo,
                        host_hi: hi,
                        exit_lo,
                        exit_hi,
                        round: seg.round,
                        bound_false,
                    });
                }
            }
        }
    }
    r.lag = quantiles(lags);
    let [before, after] = side_lags;
    r.lag_before_out = quantiles(before);
    r.lag_after_in = quantiles(after);
    r.segments = worst.into_values().collect();
    r
}

/// The quantiles of `v`, `None` when empty.
pub(super) fn quantiles(mut v: Vec<i64>) -> Option<LagStats> {
    v.sort_unstable();
    let q = |p: usize| v.get(v.len().checked_sub(1)? * p / 100).copied();
    Some(LagStats {
        min: q(0)?,
        p1: q(1)?,
        median: q(50)?,
        p99: q(99)?,
        max: q(100)?,
    })
}

/// `a − b` as a signed tick count, saturating.
pub(super) fn signed(a: u64, b: u64) -> i64 {
    let d = i128::from(a) - i128::from(b);
    i64::try_from(d).unwrap_or(if d < 0 { i64::MIN } else { i64::MAX })
}

#[cfg(test)]
mod tests {
    //! A simulated run with a known truth: guest = host + `OFFSET`, a workload step every
    //! `PERIOD` host ticks whose exits come `GAP_B` after the before-event and `GAP_A` before
    //! the after-event.

    use super::*;
    use crate::syncfile::OffsetModel;

    const OFFSET: i64 = 1_000_000_000_000;
    const PERIOD: u64 = 2_300_000;
    const GAP_B: u64 = 4_000;
    const GAP_A: u64 = 3_000;
    const PID: u32 = 4242;
    const START: u64 = 50_000_000_000;

    fn guest(host: u64) -> u64 {
        host.checked_add_signed(OFFSET).unwrap()
    }

    /// `n` steps from sequence number 0: the guest's events and the host's exits.
    fn run(n: u64) -> (Vec<IoEvent>, Vec<PioExit>) {
        let mut events = Vec::new();
        let mut exits = Vec::new();
        for seq in 0..n {
            let before = START + seq * PERIOD;
            let out_ts = before + GAP_B;
            let in_ts = out_ts + 20_000;
            let after = in_ts + GAP_A;
            events.push(IoEvent {
                vcpu: 0,
                guest_tsc: guest(before),
                side: Side::BeforeOut,
                seq,
            });
            events.push(IoEvent {
                vcpu: 0,
                guest_tsc: guest(after),
                side: Side::AfterIn,
                seq,
            });
            exits.push(exit(out_ts, PioDirection::Out, (seq & 0xff) as u32));
            exits.push(exit(in_ts, PioDirection::In, 0xff));
        }
        (events, exits)
    }

    /// One segment with offset `offset` and guaranteed bounds `half` either side, at identity
    /// rate.
    fn segment(offset: i64, half: i64) -> SyncSegment {
        SyncSegment {
            vcpu: 0,
            round: 0,
            guest_start: 0,
            host_anchor: START,
            guest_anchor: START.checked_add_signed(offset).unwrap(),
            offset,
            offset_lo: offset - half,
            offset_hi: offset + half,
            drift_ppb: 0,
            drift_ppb_lo: Some(0),
            drift_ppb_hi: Some(0),
            model: OffsetModel::Drift,
            probes: 64,
            rtt_min_ticks: 30_000,
            host_first: START,
            host_last: START,
            is_break: false,
            anchor: crate::probe::anchor::AnchorKind::KvmPioUart,
        }
    }

    fn exit(ts: u64, direction: PioDirection, val: u32) -> PioExit {
        PioExit {
            ts,
            pio: crate::ftrace::format::KvmPio {
                pid: PID,
                direction,
                port: 0x3f0,
                size: 1,
                count: 1,
                val,
            },
        }
    }

    fn threads() -> BTreeMap<u32, u32> {
        BTreeMap::from([(0, PID)])
    }

    #[test]
    fn the_true_offset_passes_with_the_gaps_as_lags() {
        let (events, exits) = run(1000);
        let r = check(
            &events,
            &exits,
            &[segment(OFFSET, 15_000)],
            &threads(),
            Numbering::Nearest,
        );
        assert_eq!((r.checked, r.before_out, r.after_in), (2000, 1000, 1000));
        assert_eq!(
            (r.violations, r.unmatched_events, r.unpaired_exits),
            (0, 0, 0)
        );
        let lag = r.lag.unwrap();
        assert_eq!(
            (lag.min, lag.max),
            (GAP_A.cast_signed(), GAP_B.cast_signed())
        );
        assert_eq!(r.segments.len(), 1);
        assert_eq!(r.segments[0].worst_lag, GAP_A.cast_signed());
    }

    #[test]
    fn an_offset_shifted_by_one_bracket_width_is_caught_either_way() {
        let (events, exits) = run(1000);
        let width = 30_000;
        // Converted times a bracket width late: every before-event follows its `out`; the
        // guaranteed interval (shifted too) misses the exit, so the bound is false as well.
        let r = check(
            &events,
            &exits,
            &[segment(OFFSET - width, 10_000)],
            &threads(),
            Numbering::Nearest,
        );
        assert_eq!(r.violations, 1000);
        assert_eq!(r.bound_violations, 1000);
        assert!(
            r.first_violations
                .iter()
                .all(|v| v.side == Side::BeforeOut && v.bound_false)
        );
        assert_eq!(r.first_violations.len(), MAX_LISTED);
        assert_eq!(r.lag.unwrap().min, GAP_B.cast_signed() - width);
        // A bracket width early: every after-event precedes its `in`.
        let r = check(
            &events,
            &exits,
            &[segment(OFFSET + width, 10_000)],
            &threads(),
            Numbering::Nearest,
        );
        assert_eq!(r.violations, 1000);
        assert!(r.first_violations.iter().all(|v| v.side == Side::AfterIn));
        // An estimate off by more than a gap whose guaranteed interval still holds the truth
        // is a violation of the estimate only.
        let r = check(
            &events,
            &exits,
            &[segment(OFFSET + 5_000, 6_000)],
            &threads(),
            Numbering::Nearest,
        );
        assert_eq!((r.violations, r.bound_violations), (1000, 0));
    }

    #[test]
    fn a_host_trace_that_starts_late_and_loses_steps_is_numbered_right() {
        let (events, exits) = run(1000);
        // The host trace starts at step 300 and loses steps 500..510 (a full ring buffer),
        // and an `out` whose `in` is lost.
        let mut host: Vec<PioExit> = exits[600..1000]
            .iter()
            .chain(&exits[1020..])
            .copied()
            .collect();
        host.push(exit(START + 1000 * PERIOD, PioDirection::Out, 0));
        let r = check(
            &events,
            &host,
            &[segment(OFFSET, 15_000)],
            &threads(),
            Numbering::Nearest,
        );
        assert_eq!(r.violations, 0);
        assert_eq!(r.unpaired_exits, 1);
        assert_eq!(r.checked, 2 * (1000 - 300 - 10));
        assert_eq!(r.unmatched_events, 2 * 310);
        // Had the numbering been off by 256 steps, converted times would miss their exits by
        // 256 periods.
        assert_eq!(r.lag.unwrap().max, GAP_B.cast_signed());
    }

    #[test]
    fn a_guest_trace_that_starts_late_is_numbered_right_either_way() {
        let (events, exits) = run(1000);
        // The guest's ring dropped its first 500 steps' events; the host saw every step.
        let late = &events[1000..];
        for numbering in [Numbering::Nearest, Numbering::FromBoot] {
            let r = check(
                late,
                &exits,
                &[segment(OFFSET, 15_000)],
                &threads(),
                numbering,
            );
            assert_eq!((r.checked, r.violations), (1000, 0), "{numbering:?}");
            assert_eq!(r.numbering, numbering);
        }
    }

    #[test]
    fn from_boot_pairing_does_not_lean_on_the_sync_file() {
        let (events, exits) = run(1000);
        // A conversion off by exactly 256 event periods fits every step 256 away: numbering
        // by the nearest step would pair each event with the wrong one and see no problem.
        // Numbered from boot, every event misses its own exit.
        let off = 256 * PERIOD.cast_signed();
        let r = check(
            &events,
            &exits,
            &[segment(OFFSET - off, 15_000)],
            &threads(),
            Numbering::FromBoot,
        );
        // Every event but the last after-event, which has no later `out` to be late for.
        assert_eq!(r.violations, r.checked - 1);
        assert_eq!(r.checked, 2000);
        let fooled = check(
            &events,
            &exits,
            &[segment(OFFSET - off, 15_000)],
            &threads(),
            Numbering::Nearest,
        );
        assert_eq!(
            fooled.violations, 0,
            "the documented limit of nearest numbering"
        );
    }

    #[test]
    fn exits_of_another_thread_are_not_used() {
        let (events, mut exits) = run(10);
        for e in &mut exits {
            e.pio.pid = PID + 1;
        }
        let r = check(
            &events,
            &exits,
            &[segment(OFFSET, 15_000)],
            &threads(),
            Numbering::Nearest,
        );
        assert_eq!(
            (r.checked, r.unmatched_events, r.unpaired_exits),
            (0, 20, 20)
        );
        assert!(r.lag.is_none());
    }

    #[test]
    fn events_no_segment_converts_are_counted() {
        let (events, exits) = run(10);
        let r = check(&events, &exits, &[], &threads(), Numbering::Nearest);
        assert_eq!((r.checked, r.unconverted_events), (0, 20));
    }
}
