//! The check itself, on decoded inputs: pair guest events with the host exits of their port
//! I/O, convert each event's guest tick with the sync file (or take the conversion `record`
//! wrote beside it), and test it against its bracket.
//!
//! One rule serves every guest: an event recorded before the guest's next I/O on a port
//! ([`Side::BeforeOut`], `--before ID:PORT`) truly happened before that exit's stamp, and one
//! recorded after its previous I/O on a port ([`Side::AfterIn`], `--after ID:PORT`) after it.
//! Which exit is an event's own is not taken from the conversion under test (that would
//! pass any conversion): the guest numbers its steps, each beginning with an `out` of the
//! step's number's low byte, and each event carries its step's number ([`IoEvent::seq`]).
//! The bundled agent's workload (ids 0x100/0x101) is one instance.

use std::collections::BTreeMap;

use serde::Serialize;

use super::report::{ExitCheck, LagStats, ProbeReport, SegmentWorst, Verdict, quantiles, signed};
use crate::exits::PioExit;
use crate::ftrace::format::PioDirection;
use crate::sync::{Place, Placement, covering, place};
use crate::syncfile::SyncSegment;

/// Which side of its port I/O the guest recorded an event on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    /// Recorded before the guest's next I/O on the port, the `out` that begins its step
    /// (`--before`): its true host time is before that `out`'s exit.
    BeforeOut,
    /// Recorded after the guest's previous I/O on the port (`--after`): the `in` right after
    /// its step's `out` when there is one (the workload's), else that `out`. Its true host
    /// time is after that exit.
    AfterIn,
}

/// Which events are checked against which port (`--before ID:PORT`, `--after ID:PORT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct EventRule {
    /// The guest's event id.
    pub id: u16,
    /// The port whose I/O the event is recorded next to.
    pub port: u16,
    /// Which side of that I/O.
    pub side: Side,
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
    /// The port of that I/O.
    pub port: u16,
    /// Its step's number: the low byte is the value the guest wrote with the step's `out`.
    pub seq: u64,
    /// The conversion `record` wrote beside the event (its JSON Lines' `host_tsc`, `host_lo`,
    /// `host_hi` and `round`), used when there is no sync file to convert with.
    pub recorded: Option<Place>,
}

/// One `out` of a thread on the port and the exit a `--after` event follows: the `in` the
/// thread did right after it, or the `out` itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Step {
    out_ts: u64,
    in_ts: u64,
    low: u8,
}

/// How events are converted to host time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Conversion {
    /// With the sync file's segments, as `record` does.
    SyncFile,
    /// As `record` converted them (its JSON Lines' `host_tsc`, `host_lo`, `host_hi`).
    Recorded,
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
    /// The converted time against its exit bracket.
    #[serde(flatten)]
    pub check: ExitCheck<Option<u64>>,
}

/// How wide the events' guaranteed intervals are against the sync rounds' (ticks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Widths {
    /// Events converted (checked or not).
    pub events: u64,
    /// The median of their guaranteed host interval widths (`host_hi − host_lo`).
    pub event_median: u64,
    /// The widest.
    pub event_max: u64,
    /// The median offset interval width (`offset_hi − offset_lo`) of the sync file's
    /// segments of the vCPUs whose events were converted; `None` without a sync file.
    pub round_median: Option<u64>,
    /// The widest of them.
    pub round_max: Option<u64>,
    /// `event_median / round_median`, in thousandths (1000: as wide as the rounds).
    pub median_ratio_milli: Option<u64>,
    /// `event_max / round_max`, in thousandths.
    pub max_ratio_milli: Option<u64>,
}

impl Widths {
    fn of(mut events: Vec<u64>, mut rounds: Vec<u64>) -> Option<Self> {
        events.sort_unstable();
        rounds.sort_unstable();
        let event_median = *events.get(events.len() / 2)?;
        let event_max = *events.last()?;
        let round_median = rounds.get(rounds.len() / 2).copied();
        let round_max = rounds.last().copied();
        let milli = |a: u64, b: Option<u64>| {
            let b = b.filter(|&b| b > 0)?;
            u64::try_from(u128::from(a) * 1000 / u128::from(b)).ok()
        };
        Some(Self {
            events: events.len() as u64,
            event_median,
            event_max,
            round_median,
            round_max,
            median_ratio_milli: milli(event_median, round_median),
            max_ratio_milli: milli(event_max, round_max),
        })
    }
}

/// The JSON schema of [`ValidateReport`].
pub const REPORT_SCHEMA: u32 = 4;

/// What `vmtsync validate` found (`--json`, schema [`REPORT_SCHEMA`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ValidateReport {
    /// Always 4 (schema 2 added `probes`, schema 3 `rules` and `conversion`, schema 4
    /// `placement`, `widths` and the segments' `wrong_side`).
    pub schema: u32,
    /// How events were placed with the sync file (`null`: as `record` placed them).
    pub placement: Option<PlacementName>,
    /// The events' interval widths against the rounds' (`null` without converted events).
    pub widths: Option<Widths>,
    /// Which events were checked against which port's I/O.
    pub rules: Vec<EventRule>,
    /// Where the events' host times came from.
    pub conversion: Conversion,
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
    /// Exits not in a step (an `in` not right after an `out` of its thread) or of a thread no
    /// vCPU runs on: not used.
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
    /// The first violations (at most [`MAX_LISTED`](super::report::MAX_LISTED)).
    pub first_violations: Vec<Violation>,
    /// The probe log's check (`--probe-log`), `null` without one.
    pub probes: Option<ProbeReport>,
}

/// [`Placement`] in the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PlacementName {
    /// The round before and the round after (what `record` does by default).
    TwoSided,
    /// The round before alone.
    OneSided,
}

/// Turns one thread's exits on one port (in time order) into steps: every `out`, with the
/// `in` right after it when there is one. Only that `in` joins the step: if the host's ring
/// lost a step's `out`, its `in` is not taken for the step before (a later exit there would
/// put that step's after-events on the wrong side of it).
fn steps(exits: &[PioExit], unpaired: &mut u64) -> Vec<Step> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < exits.len() {
        let e = exits[i];
        if e.pio.direction != PioDirection::Out {
            *unpaired += 1;
            i += 1;
            continue;
        }
        let next_in = exits
            .get(i + 1)
            .filter(|n| n.pio.direction == PioDirection::In);
        out.push(Step {
            out_ts: e.ts,
            in_ts: next_in.map_or(e.ts, |n| n.ts),
            // The guest writes its step number's low byte (the workload: its sequence
            // number's).
            low: (e.pio.val & 0xff) as u8,
        });
        i += if next_in.is_some() { 2 } else { 1 };
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

/// Checks every event of `events` against the exits of `exits` on its port, converting with
/// `segments` (`None`: each event's [`IoEvent::recorded`] conversion; an event without one is
/// not converted); `threads` maps a vCPU to its host thread; `numbering` says how steps are
/// paired with the guest's sequence numbers. `rules` is only reported.
#[must_use]
pub fn check(
    events: &[IoEvent],
    exits: &[PioExit],
    segments: Option<&[SyncSegment]>,
    threads: &BTreeMap<u32, u32>,
    numbering: Numbering,
    rules: &[EventRule],
) -> ValidateReport {
    check_placed(
        events,
        exits,
        segments,
        threads,
        numbering,
        rules,
        Placement::TwoSided,
    )
}

/// [`check`], placing events with the sync file as `how` says (`--placement`).
#[must_use]
pub fn check_placed(
    events: &[IoEvent],
    exits: &[PioExit],
    segments: Option<&[SyncSegment]>,
    threads: &BTreeMap<u32, u32>,
    numbering: Numbering,
    rules: &[EventRule],
    how: Placement,
) -> ValidateReport {
    let mut c = Checker {
        r: empty_report(segments, rules, numbering, how),
        segments,
        how,
        lags: Vec::new(),
        side_lags: [Vec::new(), Vec::new()],
        worst: BTreeMap::new(),
        event_widths: Vec::new(),
    };
    let exits_of = exits_by_thread(exits, threads, events, &mut c.r.unpaired_exits);
    for (vcpu, port) in groups(events) {
        let exits = threads
            .get(&vcpu)
            .and_then(|pid| exits_of.get(&(*pid, port)))
            .map_or(&[][..], Vec::as_slice);
        c.group(vcpu, port, events, exits, numbering);
    }
    c.finish(events)
}

/// A report with nothing checked yet.
fn empty_report(
    segments: Option<&[SyncSegment]>,
    rules: &[EventRule],
    numbering: Numbering,
    how: Placement,
) -> ValidateReport {
    ValidateReport {
        schema: REPORT_SCHEMA,
        placement: segments.map(|_| match how {
            Placement::TwoSided => PlacementName::TwoSided,
            Placement::OneSided => PlacementName::OneSided,
        }),
        widths: None,
        rules: rules.to_vec(),
        conversion: if segments.is_some() {
            Conversion::SyncFile
        } else {
            Conversion::Recorded
        },
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
    }
}

/// The (vCPU, port) pairs the events name, in order.
fn groups(events: &[IoEvent]) -> Vec<(u32, u16)> {
    let mut groups: Vec<(u32, u16)> = events.iter().map(|e| (e.vcpu, e.port)).collect();
    groups.sort_unstable();
    groups.dedup();
    groups
}

/// Each thread's exits, port by port, in time order; the exits of a thread no vCPU maps to,
/// and those on a port no event of its vCPU names, are counted in `unpaired`.
fn exits_by_thread(
    exits: &[PioExit],
    threads: &BTreeMap<u32, u32>,
    events: &[IoEvent],
    unpaired: &mut u64,
) -> BTreeMap<(u32, u16), Vec<PioExit>> {
    let mut exits_of: BTreeMap<(u32, u16), Vec<PioExit>> = BTreeMap::new();
    for e in exits {
        exits_of
            .entry((e.pio.pid, e.pio.port))
            .or_default()
            .push(*e);
    }
    for ((pid, _), v) in &mut exits_of {
        if !threads.values().any(|p| p == pid) {
            *unpaired += v.len() as u64;
        }
        v.sort_by_key(|e| e.ts);
    }
    let groups = groups(events);
    // A thread's exits on a port no event names are not in any step.
    for ((pid, port), v) in &exits_of {
        let named = groups
            .iter()
            .any(|&(vcpu, p)| p == *port && threads.get(&vcpu) == Some(pid));
        if !named && threads.values().any(|p| p == pid) {
            *unpaired += v.len() as u64;
        }
    }
    exits_of
}

/// An event's host time, its guaranteed interval, and the segment (or recorded round) that
/// gave them: by the sync file's segments of its vCPU (`mine`) when there is one, else as
/// `record` claimed them (checked even with a centre outside its own interval).
fn convert(
    e: &IoEvent,
    vcpu: u32,
    mine: &[SyncSegment],
    sync_file: bool,
    how: Placement,
) -> Option<(SegmentWorst, (u64, u64, u64))> {
    if sync_file {
        let s = covering(mine, e.guest_tsc)?;
        let p = place(mine, e.guest_tsc, how)?;
        Some((SegmentWorst::of(vcpu, s), (p.host, p.lo, p.hi)))
    } else {
        let c = e.recorded?;
        Some((SegmentWorst::of_round(vcpu, c.round), (c.host, c.lo, c.hi)))
    }
}

/// Each step's sequence number (`None`: not numbered), by `numbering`.
fn numbers(
    st: &[Step],
    numbering: Numbering,
    by_seq: &BTreeMap<(u64, Side), IoEvent>,
    converted_host: impl Fn(&IoEvent) -> Option<u64>,
) -> Vec<Option<u64>> {
    match numbering {
        Numbering::FromBoot => number(st, 0, st.first().map_or(0, |s| u64::from(s.low))),
        Numbering::Nearest => {
            // One event and one step close in time anchor the numbering: the first step and
            // the event converted nearest it, or the first event and the step nearest it,
            // whichever pair is closer (the later of the two traces' starts lies in both).
            let converted: Vec<(u64, u64)> = by_seq
                .values()
                .filter_map(|e| Some((e.seq, converted_host(e)?)))
                .collect();
            let from_step = st.first().and_then(|s0| {
                converted
                    .iter()
                    .map(|&(seq, h)| (0, seq, h.abs_diff(s0.out_ts)))
                    .min_by_key(|&(_, _, d)| d)
            });
            let from_event = converted
                .first()
                .and_then(|&(seq, h)| nearest_step(st, h).map(|(j, d)| (j, seq, d)));
            match [from_step, from_event]
                .into_iter()
                .flatten()
                .min_by_key(|&(_, _, d)| d)
            {
                Some((j, seq, _)) => number(st, j, nearest_with_low(seq, st[j].low)),
                None => Vec::new(),
            }
        }
    }
}

/// The check under way: the report, and what its statistics are made from.
struct Checker<'a> {
    r: ValidateReport,
    segments: Option<&'a [SyncSegment]>,
    how: Placement,
    lags: Vec<i64>,
    /// Before-out, after-in.
    side_lags: [Vec<i64>; 2],
    worst: BTreeMap<(u32, u64), SegmentWorst>,
    event_widths: Vec<u64>,
}

impl Checker<'_> {
    /// The events of `vcpu` on `port` against that vCPU thread's exits on it.
    fn group(
        &mut self,
        vcpu: u32,
        port: u16,
        events: &[IoEvent],
        exits: &[PioExit],
        numbering: Numbering,
    ) {
        let mine: Vec<SyncSegment> = self
            .segments
            .unwrap_or_default()
            .iter()
            .filter(|s| s.vcpu == vcpu)
            .copied()
            .collect();
        let (sync_file, how) = (self.segments.is_some(), self.how);
        let conv = |e: &IoEvent| convert(e, vcpu, &mine, sync_file, how);
        // Events by sequence number and side.
        let mut by_seq: BTreeMap<(u64, Side), IoEvent> = BTreeMap::new();
        for e in events.iter().filter(|e| (e.vcpu, e.port) == (vcpu, port)) {
            by_seq.insert((e.seq, e.side), *e);
        }
        let st = steps(exits, &mut self.r.unpaired_exits);
        let seqs = numbers(&st, numbering, &by_seq, |e| conv(e).map(|c| c.1.0));
        let step_of: BTreeMap<u64, Step> = seqs
            .iter()
            .zip(&st)
            .filter_map(|(n, s)| Some(((*n)?, *s)))
            .collect();
        for e in by_seq.values() {
            let Some((seg, placed)) = conv(e) else {
                self.r.unconverted_events += 1;
                continue;
            };
            self.event(vcpu, e, seg, placed, &step_of);
        }
    }

    /// One event placed at `host` in `[lo, hi]` by segment `seg`, against its steps.
    fn event(
        &mut self,
        vcpu: u32,
        e: &IoEvent,
        seg: SegmentWorst,
        (host, lo, hi): (u64, u64, u64),
        step_of: &BTreeMap<u64, Step>,
    ) {
        let r = &mut self.r;
        self.event_widths.push(hi.saturating_sub(lo));
        let Some(step) = step_of.get(&e.seq) else {
            r.unmatched_events += 1;
            return;
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
        let verdict = Verdict::of((host, lo, hi), exit_lo, exit_hi);
        self.lags.push(lag);
        self.side_lags[usize::from(e.side == Side::AfterIn)].push(lag);
        let w = self.worst.entry((vcpu, seg.round)).or_insert(seg);
        if self.segments.is_none() {
            w.width = w.width.max(signed(hi, lo));
        }
        verdict.count(
            w,
            lag,
            [&mut r.violations, &mut r.bound_violations],
            &mut r.first_violations,
            || Violation {
                vcpu,
                seq: e.seq,
                side: e.side,
                check: verdict.check(e.guest_tsc, (host, lo, hi), [exit_lo, exit_hi], seg.round),
            },
        );
    }

    /// The statistics into the report.
    fn finish(self, events: &[IoEvent]) -> ValidateReport {
        let mut r = self.r;
        r.lag = quantiles(self.lags);
        let [before, after] = self.side_lags;
        r.lag_before_out = quantiles(before);
        r.lag_after_in = quantiles(after);
        r.segments = self.worst.into_values().collect();
        // The rounds of the vCPUs whose events were checked, each once (a vCPU may use
        // several ports).
        let vcpus: std::collections::BTreeSet<u32> = events.iter().map(|e| e.vcpu).collect();
        let round_widths = self
            .segments
            .unwrap_or_default()
            .iter()
            .filter(|s| vcpus.contains(&s.vcpu))
            .map(|s| s.offset_hi.abs_diff(s.offset_lo))
            .collect();
        r.widths = Widths::of(self.event_widths, round_widths);
        r
    }
}

#[cfg(test)]
mod tests {
    //! A simulated run with a known truth: guest = host + `OFFSET`, a workload step every
    //! `PERIOD` host ticks whose exits come `GAP_B` after the before-event and `GAP_A` before
    //! the after-event.

    use super::*;
    use crate::validate::report::MAX_LISTED;
    use crate::validate::testutil::{exit_check, segment_at};

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
                port: 0x3f0,
                seq,
                recorded: None,
            });
            events.push(IoEvent {
                vcpu: 0,
                guest_tsc: guest(after),
                side: Side::AfterIn,
                port: 0x3f0,
                seq,
                recorded: None,
            });
            exits.push(exit(out_ts, PioDirection::Out, (seq & 0xff) as u32));
            exits.push(exit(in_ts, PioDirection::In, 0xff));
        }
        (events, exits)
    }

    /// One segment with offset `offset` and guaranteed bounds `half` either side, at identity
    /// rate.
    fn segment(offset: i64, half: i64) -> SyncSegment {
        segment_at(START, offset, half, 30_000)
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

    /// The workload's rules on its port.
    fn workload_rules() -> [EventRule; 2] {
        [
            EventRule {
                id: 0x100,
                port: 0x3f0,
                side: Side::BeforeOut,
            },
            EventRule {
                id: 0x101,
                port: 0x3f0,
                side: Side::AfterIn,
            },
        ]
    }

    /// [`super::check`] with a sync file, [`threads`] and the workload's rules.
    fn check(
        events: &[IoEvent],
        exits: &[PioExit],
        segments: &[SyncSegment],
        numbering: Numbering,
    ) -> ValidateReport {
        super::check(
            events,
            exits,
            Some(segments),
            &threads(),
            numbering,
            &workload_rules(),
        )
    }

    /// [`super::check`] with [`threads`], numbered from boot.
    fn from_boot(
        events: &[IoEvent],
        exits: &[PioExit],
        segments: Option<&[SyncSegment]>,
        rules: &[EventRule],
    ) -> ValidateReport {
        super::check(
            events,
            exits,
            segments,
            &threads(),
            Numbering::FromBoot,
            rules,
        )
    }

    #[test]
    fn the_true_offset_passes_with_the_gaps_as_lags() {
        let (events, exits) = run(1000);
        let r = check(
            &events,
            &exits,
            &[segment(OFFSET, 15_000)],
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
        assert_eq!(r.segments[0].wrong_side, 0);
        // Every event as wide as its one round: a ratio of exactly 1.
        let w = r.widths.unwrap();
        assert_eq!(
            (w.events, w.event_median, w.event_max),
            (2000, 30_000, 30_000)
        );
        assert_eq!((w.round_median, w.round_max), (Some(30_000), Some(30_000)));
        assert_eq!(
            (w.median_ratio_milli, w.max_ratio_milli),
            (Some(1000), Some(1000))
        );
    }

    /// Two rounds 2.3 G ticks apart whose drift bounds are ±1000 ppm: one-sided, the events
    /// late in the span are widened by up to 4.6 M ticks; two-sided, the round after bounds
    /// them too, and the report says how much narrower.
    #[test]
    fn two_sided_placement_is_reported_narrower_than_one_sided() {
        let (events, exits) = run(1000);
        let mut a = segment(OFFSET, 15_000);
        (a.drift_ppb_lo, a.drift_ppb_hi) = (Some(-1_000_000), Some(1_000_000));
        let mut b = a;
        let later = START + 1000 * PERIOD;
        (b.round, b.host_anchor, b.guest_anchor) = (1, later, guest(later));
        b.guest_start = guest(later);
        let segs = [a, b];
        let placed = |how| {
            super::check_placed(
                &events,
                &exits,
                Some(&segs),
                &threads(),
                Numbering::Nearest,
                &workload_rules(),
                how,
            )
        };
        let (one, two) = (placed(Placement::OneSided), placed(Placement::TwoSided));
        assert_eq!((one.violations, two.violations), (0, 0));
        assert_eq!(one.placement, Some(PlacementName::OneSided));
        let (w1, w2) = (one.widths.unwrap(), two.widths.unwrap());
        assert!(w1.event_max > 4_000_000, "{w1:?}");
        assert!(w2.event_max <= 30_000 + 2_400_000, "{w2:?}");
        assert!(w2.event_median < w1.event_median, "{w1:?} {w2:?}");
        assert!(w2.max_ratio_milli < w1.max_ratio_milli, "{w1:?} {w2:?}");
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
            Numbering::Nearest,
        );
        assert_eq!(r.violations, 1000);
        assert_eq!(r.bound_violations, 1000);
        assert_eq!(r.segments[0].wrong_side, 1000);
        assert!(
            r.first_violations
                .iter()
                .all(|v| v.side == Side::BeforeOut && v.check.bound_false)
        );
        assert_eq!(r.first_violations.len(), MAX_LISTED);
        assert_eq!(r.lag.unwrap().min, GAP_B.cast_signed() - width);
        // A bracket width early: every after-event precedes its `in`.
        let r = check(
            &events,
            &exits,
            &[segment(OFFSET + width, 10_000)],
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
            Numbering::Nearest,
        );
        assert_eq!((r.violations, r.bound_violations), (1000, 0));
    }

    #[test]
    fn a_host_trace_that_starts_late_and_loses_steps_is_numbered_right() {
        let (events, exits) = run(1000);
        // The host trace starts at step 300 and loses steps 500..510 (a full ring buffer),
        // and an `out` whose `in` is lost (a step of its own, numbered 1000, which no event
        // has), and an `in` whose `out` is lost.
        let mut host: Vec<PioExit> = exits[600..1000]
            .iter()
            .chain(&exits[1020..])
            .copied()
            .collect();
        host.push(exit(START + 1000 * PERIOD - 1_000, PioDirection::In, 0xff));
        host.push(exit(START + 1000 * PERIOD, PioDirection::Out, 0));
        let r = check(
            &events,
            &host,
            &[segment(OFFSET, 15_000)],
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
            let r = check(late, &exits, &[segment(OFFSET, 15_000)], numbering);
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
            Numbering::FromBoot,
        );
        // Every event but the last after-event, which has no later `out` to be late for.
        assert_eq!(r.violations, r.checked - 1);
        assert_eq!(r.checked, 2000);
        let fooled = check(
            &events,
            &exits,
            &[segment(OFFSET - off, 15_000)],
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
        let r = check(&events, &exits, &[], Numbering::Nearest);
        assert_eq!((r.checked, r.unconverted_events), (0, 20));
    }

    /// A guest that is not the agent: `record(7); out PORT, s; record(8)` for step `s`, so
    /// its after-event follows an `out` (no `in` at all), on another port.
    fn foreign(n: u64, port: u16) -> (Vec<IoEvent>, Vec<PioExit>) {
        let mut events = Vec::new();
        let mut exits = Vec::new();
        for seq in 0..n {
            let before = START + seq * PERIOD + PERIOD / 2;
            let out_ts = before + GAP_B;
            let after = out_ts + GAP_A;
            for (side, at) in [(Side::BeforeOut, before), (Side::AfterIn, after)] {
                events.push(IoEvent {
                    vcpu: 0,
                    guest_tsc: guest(at),
                    side,
                    port,
                    seq,
                    recorded: None,
                });
            }
            let mut e = exit(out_ts, PioDirection::Out, (seq & 0xff) as u32);
            e.pio.port = port;
            exits.push(e);
        }
        (events, exits)
    }

    fn foreign_rules(port: u16) -> [EventRule; 2] {
        [
            EventRule {
                id: 7,
                port,
                side: Side::BeforeOut,
            },
            EventRule {
                id: 8,
                port,
                side: Side::AfterIn,
            },
        ]
    }

    #[test]
    fn a_foreign_guests_events_around_outs_alone_are_checked_and_a_shift_caught() {
        let (events, exits) = foreign(600, 0x80);
        let seg = [segment(OFFSET, 15_000)];
        let rules = foreign_rules(0x80);
        let r = from_boot(&events, &exits, Some(&seg), &rules);
        assert_eq!((r.checked, r.violations, r.unpaired_exits), (1200, 0, 0));
        assert_eq!(r.rules, rules);
        assert_eq!(r.conversion, Conversion::SyncFile);
        let lag = r.lag.unwrap();
        assert_eq!(
            (lag.min, lag.max),
            (GAP_A.cast_signed(), GAP_B.cast_signed())
        );
        // Converted a little more than the before-gap late: every before-event follows its
        // `out`, every after-event is still after it.
        let late = [segment(OFFSET - GAP_B.cast_signed() - 1, 15_000)];
        let r = from_boot(&events, &exits, Some(&late), &rules);
        assert_eq!(r.violations, 600);
        assert!(r.first_violations.iter().all(|v| v.side == Side::BeforeOut));
        // And early by more than the after-gap: every after-event precedes its `out`.
        let early = [segment(OFFSET + GAP_A.cast_signed() + 1, 15_000)];
        let r = from_boot(&events, &exits, Some(&early), &rules);
        assert_eq!(r.violations, 600);
        assert!(r.first_violations.iter().all(|v| v.side == Side::AfterIn));
    }

    #[test]
    fn events_on_two_ports_are_each_paired_with_their_own_ports_exits() {
        let (mut events, mut exits) = run(500);
        let (e2, x2) = foreign(500, 0x80);
        events.extend(e2);
        exits.extend(x2);
        let mut rules = workload_rules().to_vec();
        rules.extend(foreign_rules(0x80));
        let seg = [segment(OFFSET, 15_000)];
        for numbering in [Numbering::FromBoot, Numbering::Nearest] {
            let r = super::check(&events, &exits, Some(&seg), &threads(), numbering, &rules);
            assert_eq!((r.checked, r.violations, r.unpaired_exits), (2000, 0, 0));
        }
        // The foreign guest's steps sit half a period after the workload's: paired with the
        // other port's exits, its events would be violations.
        for e in &mut events {
            e.port = 0x3f0;
        }
        let r = from_boot(&events, &exits, Some(&seg), &rules);
        assert!(r.violations >= 500, "{}", r.violations);
    }

    #[test]
    fn without_a_sync_file_records_own_conversion_is_checked() {
        let (mut events, exits) = run(300);
        let truth = |e: &IoEvent| e.guest_tsc.checked_add_signed(-OFFSET).unwrap();
        for e in &mut events {
            let h = truth(e);
            e.recorded = Some(Place {
                host: h,
                lo: h - 1_000,
                hi: h + 2_000,
                round: 4,
            });
        }
        let rules = workload_rules();
        let r = from_boot(&events, &exits, None, &rules);
        assert_eq!((r.checked, r.violations), (600, 0));
        assert_eq!(r.conversion, Conversion::Recorded);
        assert_eq!(r.segments.len(), 1);
        assert_eq!((r.segments[0].round, r.segments[0].width), (4, 3_000));
        // A recording whose conversion is a bracket width late, its interval with it: every
        // before-event follows its `out`, and the interval misses it too.
        for e in &mut events {
            let c = e.recorded.as_mut().unwrap();
            c.host += 30_000;
            c.lo += 30_000;
            c.hi += 30_000;
        }
        let r = from_boot(&events, &exits, None, &rules);
        assert_eq!((r.violations, r.bound_violations), (300, 300));
        // An event `record` did not convert is counted, not checked.
        events[0].recorded = None;
        let r = from_boot(&events, &exits, None, &rules);
        assert_eq!(r.unconverted_events, 1);
    }

    /// A listed violation, an event's or a probe's, is one flat JSON object: what it names,
    /// then its [`ExitCheck`] flattened in, in this order (`--json` schema 4, as before the two
    /// shared the check's fields).
    #[test]
    fn violations_serialize_flat_in_the_schema_order() {
        let v = Violation {
            vcpu: 1,
            seq: 2,
            side: Side::AfterIn,
            check: exit_check(None, Some(8), true),
        };
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            r#"{"vcpu":1,"seq":2,"side":"after_in","guest_tsc":3,"host_tsc":4,"host_lo":5,"host_hi":6,"exit_lo":null,"exit_hi":8,"round":9,"bound_false":true}"#
        );
        let p = crate::validate::ProbeViolation {
            vcpu: 1,
            seq: 2,
            path: crate::probe::log::ProbePath::SyncPort,
            check: exit_check(7, 8, false),
        };
        assert_eq!(
            serde_json::to_string(&p).unwrap(),
            r#"{"vcpu":1,"seq":2,"path":"sync-port","guest_tsc":3,"host_tsc":4,"host_lo":5,"host_hi":6,"exit_lo":7,"exit_hi":8,"round":9,"bound_false":false}"#
        );
    }
}
