//! The vocabulary the check's files share: why validation could not run ([`ValidateError`]),
//! what a report holds ([`LagStats`], [`SegmentWorst`], [`ProbeReport`], [`ProbeViolation`])
//! and the arithmetic on lags.

use std::path::PathBuf;

use serde::Serialize;
use thiserror::Error;

use crate::formats::tracedat::TraceDatError;
use crate::ftrace::format::FormatError;
use crate::probe::log::ProbePath;
use crate::syncfile::{LineRead, SyncFileError, SyncSegment, read_line_bounded};

/// Why `validate` could not check.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ValidateError {
    /// The sync file.
    #[error(transparent)]
    SyncFile(#[from] SyncFileError),
    /// A trace file.
    #[error(transparent)]
    TraceDat(#[from] TraceDatError),
    /// The host trace's `kvm_pio` format.
    #[error("{path}: {source}")]
    Format {
        /// The host trace.
        path: PathBuf,
        /// The cause.
        source: FormatError,
    },
    /// The host trace has no `kvm:kvm_pio` format.
    #[error(
        "{0}: no kvm:kvm_pio event in this trace: enable events/kvm/kvm_pio in the traced instance (x86-tsc clock) before `trace-cmd extract`"
    )]
    NoKvmPio(PathBuf),
    /// The guest trace's timestamps are not raw guest TSCs.
    #[error(
        "{0}: its timestamps were pre-converted to host time by `vmtsync record` (the guest's rate is not the host's), so it no longer holds the guest ticks to check: validate a recording at the host's rate"
    )]
    Preconverted(PathBuf),
    /// A guest JSON Lines file (`record --format jsonl`) has a line that is not an event.
    #[error("{path}: line {line}: {why}")]
    GuestLine {
        /// The file.
        path: PathBuf,
        /// The 1-based line.
        line: u64,
        /// What is wrong.
        why: String,
    },
    /// The guest trace could not be read.
    #[error("{path}: {source}")]
    GuestIo {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The guest trace has no event the rules name.
    #[error(
        "{path}: no event with id {ids} (the ids of --before/--after; --port alone means the agent's workload, 0x100/0x101: boot it with workload=RATE,COUNT,PORT)"
    )]
    NoEvents {
        /// The file.
        path: PathBuf,
        /// The ids looked for.
        ids: String,
    },
    /// Without a sync file, events must carry `record`'s conversion.
    #[error(
        "{0}: without --sync the events' host times and guaranteed intervals come from `vmtsync record --format jsonl` (host_tsc, host_lo, host_hi), which this file does not hold: give the sync file (record --sync-out) or a JSON Lines recording"
    )]
    NeedsSync(PathBuf),
    /// A probe log needs the sync file to convert its probes with.
    #[error("--probe-log needs --sync: a probe's guest TSC is converted with the sync file")]
    ProbesNeedSync,
    /// A probe log line is not a probe exchange.
    #[error("{path}: line {line}: {why}")]
    ProbeLine {
        /// The file.
        path: PathBuf,
        /// The 1-based line.
        line: u64,
        /// What is wrong.
        why: String,
    },
    /// The probe log could not be read.
    #[error("{path}: {source}")]
    ProbeLogIo {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Neither a guest trace nor a probe log: nothing to check.
    #[error(
        "nothing to check: give --from (with --port, or --before/--after) or --probe-log, or both"
    )]
    NothingToCheck,
    /// vCPU threads cannot be told apart.
    #[error(
        "cannot tell which host thread runs vCPU {vcpu}: threads {threads} did I/O on port {port:#x}; give --thread {vcpu}=PID (vmtsync kvm shows each vCPU's thread)"
    )]
    Threads {
        /// The vCPU.
        vcpu: u32,
        /// The threads seen.
        threads: String,
        /// The port.
        port: u16,
    },
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
    /// Of its events, those whose converted time lies on the wrong side of an exit of their
    /// bracket (the estimate's error; `violations` also counts false guaranteed bounds).
    pub wrong_side: u64,
    /// Its guaranteed offset interval width, ticks; without a sync file, the widest
    /// guaranteed host interval of its events.
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
            wrong_side: 0,
            width: seg.offset_hi.saturating_sub(seg.offset_lo),
        }
    }

    /// A round `record` converted events with ([`Conversion::Recorded`]): its width grows
    /// with its events' guaranteed intervals.
    pub(super) const fn of_round(vcpu: u32, round: u64) -> Self {
        Self {
            vcpu,
            round,
            events: 0,
            worst_lag: i64::MAX,
            violations: 0,
            wrong_side: 0,
            width: 0,
        }
    }

    /// One more conversion through the segment, with its tight-side lag.
    pub(super) fn add(&mut self, lag: i64, violation: bool) {
        self.events += 1;
        self.worst_lag = self.worst_lag.min(lag);
        self.violations += u64::from(violation);
    }
}

/// Where a converted time and its guaranteed interval stand against an exit bracket.
#[derive(Clone, Copy, Debug)]
pub(super) struct Verdict {
    /// The converted time lies outside the bracket (the estimate is wrong).
    pub outside: bool,
    /// The guaranteed interval misses the bracket (the bound is false, not only the estimate).
    pub bound_false: bool,
}

impl Verdict {
    /// `host`, with its guaranteed interval `[lo, hi]`, against the bracket
    /// `[exit_lo, exit_hi]` (`None`: no bound on that side).
    pub(super) fn of(
        (host, lo, hi): (u64, u64, u64),
        exit_lo: Option<u64>,
        exit_hi: Option<u64>,
    ) -> Self {
        Self {
            outside: exit_lo.is_some_and(|l| host < l) || exit_hi.is_some_and(|h| host > h),
            bound_false: exit_lo.is_some_and(|l| hi < l) || exit_hi.is_some_and(|h| lo > h),
        }
    }

    /// What a listed violation shows of this verdict: `guest_tsc`, converted by the segment
    /// of round `round` to `host` with its guaranteed interval `[lo, hi]`, against `exits`.
    pub(super) fn check<X>(
        self,
        guest_tsc: u64,
        (host, lo, hi): (u64, u64, u64),
        [exit_lo, exit_hi]: [X; 2],
        round: u64,
    ) -> ExitCheck<X> {
        ExitCheck {
            guest_tsc,
            host_tsc: host,
            host_lo: lo,
            host_hi: hi,
            exit_lo,
            exit_hi,
            round,
            bound_false: self.bound_false,
        }
    }

    /// Counts the conversion into its segment `w` with its tight-side `lag` and, when it is a
    /// violation, into a report's `violations` and `bound_violations`, listing it in `first`
    /// (`listed` makes the entry) while that holds fewer than [`MAX_LISTED`].
    pub(super) fn count<V>(
        self,
        w: &mut SegmentWorst,
        lag: i64,
        [violations, bound_violations]: [&mut u64; 2],
        first: &mut Vec<V>,
        listed: impl FnOnce() -> V,
    ) {
        let violation = self.outside || self.bound_false;
        w.add(lag, violation);
        w.wrong_side += u64::from(self.outside);
        if violation {
            *violations += 1;
            *bound_violations += u64::from(self.bound_false);
            if first.len() < MAX_LISTED {
                first.push(listed());
            }
        }
    }
}

/// A converted time against the exits that bracket it, as a listed violation shows it. A guest
/// event and a probe are checked the same way ([`Verdict`]), so both lists show the same fields,
/// flattened into [`Violation`](super::check::Violation) and [`ProbeViolation`] after what names
/// the event or probe. `X` is how an exit is known: `Option<u64>` for an event (a side may have
/// no exit), `u64` for a probe (it always has both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ExitCheck<X> {
    /// The guest TSC (a probe's: the one the agent replied).
    pub guest_tsc: u64,
    /// The converted host time.
    pub host_tsc: u64,
    /// Its guaranteed interval.
    pub host_lo: u64,
    /// Its guaranteed interval.
    pub host_hi: u64,
    /// The exit the host time must not precede: for an after-event its `in`, for a
    /// before-event the previous step's `in` when known; for a probe the exit before the read.
    pub exit_lo: X,
    /// The exit the host time must not follow (a probe's: the exit after the read).
    pub exit_hi: X,
    /// The sync segment used (its round).
    pub round: u64,
    /// The guaranteed interval misses the bracket: the sync file's bound is false, not only
    /// its estimate.
    pub bound_false: bool,
}

/// A converted probe outside its exit bracket (or a guaranteed interval disjoint from it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ProbeViolation {
    /// The vCPU.
    pub vcpu: u32,
    /// The probe's sequence number.
    pub seq: u8,
    /// Which exits bracket it.
    pub path: ProbePath,
    /// The converted time against its exits.
    #[serde(flatten)]
    pub check: ExitCheck<u64>,
}

/// What the probe log's check found (`"probes"` in `--json`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ProbeReport {
    /// Exchanges in the log.
    pub logged: u64,
    /// Of which paired with their exits and checked.
    pub checked: u64,
    /// Checked probes outside their bracket (the bar: zero).
    pub violations: u64,
    /// Of which the guaranteed interval misses the bracket too.
    pub bound_violations: u64,
    /// Exchanges whose exits are not all in the host trace (not recording then, a ring buffer
    /// that overflowed, another port or VM): not checked.
    pub unpaired: u64,
    /// Exchanges no segment of their vCPU converts: not checked.
    pub unconverted: u64,
    /// Bytes after the log's last newline (a run killed while writing): not read.
    pub cut_bytes: u64,
    /// Converted time minus the lower exit, per checked probe (negative: a violation).
    pub lag_after_in: Option<LagStats>,
    /// The upper exit minus converted time (negative: a violation).
    pub lag_before_out: Option<LagStats>,
    /// Per segment: probes converted through it (`events`), the smaller of each probe's two
    /// lags at its worst, violations.
    pub segments: Vec<SegmentWorst>,
    /// The first violations (at most [`MAX_LISTED`]).
    pub first_violations: Vec<ProbeViolation>,
}

/// The most violations listed in a report.
pub const MAX_LISTED: usize = 20;

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

/// How a JSON Lines input ended ([`each_line`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LinesEnd {
    /// At its end, after a newline (or empty).
    Eof,
    /// Inside a line: `bytes` after the last newline.
    Partial {
        /// Bytes after the last newline.
        bytes: u64,
    },
    /// At a line longer than the sync file's line bound.
    TooLong,
}

/// Hands every whole line of `input` (without its newline) and its 1-based number to `each`,
/// each line at most the sync file's line bound ([`read_line_bounded`]), until the input ends,
/// a line is too long, or `each` fails; returns how it ended and the number of the line it
/// ended at. `io` names a read error.
pub(super) fn each_line(
    input: &mut impl std::io::BufRead,
    io: impl Fn(std::io::Error) -> ValidateError,
    mut each: impl FnMut(u64, &[u8]) -> Result<(), ValidateError>,
) -> Result<(LinesEnd, u64), ValidateError> {
    let mut line = Vec::new();
    let mut n = 0_u64;
    loop {
        line.clear();
        let r = read_line_bounded(input, &mut line).map_err(&io)?;
        n += 1;
        let end = match r {
            LineRead::Line => {
                each(n, &line)?;
                continue;
            }
            LineRead::Eof => LinesEnd::Eof,
            LineRead::Partial { bytes } => LinesEnd::Partial { bytes },
            LineRead::TooLong => LinesEnd::TooLong,
        };
        return Ok((end, n));
    }
}
