//! `vmtsync probe --continuous --out FILE`: re-sync every `resync` period and append one
//! segment per round to a sync file (schema in [`crate::syncfile`]).
//!
//! Each round starts with a full-width probe (the guest may have been paused or migrated since
//! the last round), then `probes - 1` compact ones. The drift estimator accumulates every round
//! since the last break, so the rate bound tightens as the run grows (about `2·RTT / span`); a
//! round that no constant rate fits together with the earlier ones starts a new estimate and
//! is written with `"break": true`.
//!
//! With several vCPUs (`--all-vcpus`, or `--vcpu N`) a round syncs each in turn, in increasing
//! order, and each vCPU keeps its own cumulative estimate: every vCPU's TSC is its own clock
//! (docs/smp.md), so one vCPU's rounds never break or tighten another's. Segments carry their
//! vCPU; readers of the file pick a vCPU's segments by it.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vmtsync_core::estimate::{DriftEstimator, EstimateError, ProbeSample};

use super::progress::Progress;
use super::report::{HULL_CAPACITY, ProbeSummary, RATE_LIMITS};
use super::session::ProbeSession;
use super::{ProbeError, ProbeOptions};
use crate::link::transport::StampedTransport;
use crate::syncfile::OffsetModel;
use crate::syncfile::{SyncHeader, SyncSegment, SyncWriter};

/// Settings of continuous mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContinuousOptions {
    /// The sync file to append to (created with a header if missing or empty).
    pub out: PathBuf,
    /// Time between the starts of two rounds.
    pub resync: Duration,
    /// Stop after this many rounds; `None` runs until the stop flag is set or the process is
    /// killed (every written segment is already complete on disk).
    pub rounds: Option<u64>,
}

/// What a continuous run did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContinuousSummary {
    /// Segments appended.
    pub segments: u64,
    /// Of which started a new estimate.
    pub breaks: u64,
    /// Rounds that yielded no usable samples (all lost, or a clock step inside the round);
    /// nothing was written for them.
    pub empty_rounds: u64,
    /// Why the last round whose samples gave no estimate refused them (the run's error when
    /// no round gave a segment: not "every probe was lost" when none was).
    pub refused: Option<EstimateError>,
    /// The last round's summary.
    pub last: Option<ProbeSummary>,
}

/// The cumulative estimate across rounds since the last break (shared with `vmtsync record`).
#[derive(Debug)]
pub(crate) struct Cumulative {
    est: DriftEstimator<HULL_CAPACITY>,
    rounds: u64,
}

impl Cumulative {
    pub(crate) fn new() -> Self {
        Self {
            est: DriftEstimator::new(),
            rounds: 0,
        }
    }

    /// Adds a round; returns whether it broke the previous estimate (then the estimate
    /// restarts from this round alone).
    pub(crate) fn add(&mut self, samples: &[ProbeSample]) -> bool {
        let mut trial = self.est.clone();
        let fits = samples.iter().all(|s| trial.push(s).is_ok())
            && !matches!(trial.estimate(), Err(EstimateError::SegmentBreak));
        if fits {
            self.est = trial;
            self.rounds += 1;
            return false;
        }
        let had_rounds = self.rounds > 0;
        self.est = DriftEstimator::new();
        for s in samples {
            // A round the estimator refuses on its own leaves it empty; the round's own
            // offset bounds are used then.
            if self.est.push(s).is_err() {
                self.est = DriftEstimator::new();
                break;
            }
        }
        self.rounds = 1;
        had_rounds
    }
}

/// Runs rounds until `cont.rounds` or the stop flag; each round syncs every vCPU of `vcpus`
/// in turn and writes one segment per vCPU.
pub(super) fn run<T: StampedTransport>(
    session: &mut ProbeSession<T>,
    opts: &ProbeOptions,
    cont: &ContinuousOptions,
    vcpus: &[u32],
    out: &mut dyn Write,
    progress: &mut Progress,
) -> Result<ContinuousSummary, ProbeError> {
    let header = SyncHeader::now(opts.addr.to_string());
    let mut writer = SyncWriter::open(&cont.out, &header)?;
    if let Some(cut) = writer.cut_on_open() {
        // A run killed mid-write left a torn last line; it is gone now, and the user hears how
        // much went before the new segments are appended after the complete ones.
        eprintln!("vmtsync: warning: {}: {cut}", cont.out.display());
    }
    // One estimate per vCPU: a round of one vCPU says nothing about another's clock.
    let mut cumulative: Vec<(u32, Cumulative)> =
        vcpus.iter().map(|&v| (v, Cumulative::new())).collect();
    let mut summary = ContinuousSummary {
        segments: 0,
        breaks: 0,
        empty_rounds: 0,
        refused: None,
        last: None,
    };
    let mut round = 0_u64;
    loop {
        if cont.rounds.is_some_and(|n| round >= n) || opts.stopped() {
            break;
        }
        let started = Instant::now();
        for (vcpu, cumulative) in &mut cumulative {
            session.select_vcpu(*vcpu)?;
            // A stop mid-round ends continuous mode like a stop between rounds: the
            // segments written so far stand.
            if !one_vcpu_round(
                session,
                opts,
                cont,
                (round, *vcpu, vcpus.len() > 1),
                cumulative,
                &mut writer,
                &mut summary,
                out,
                progress,
            )? {
                progress.clear();
                return Ok(summary);
            }
        }
        round += 1;
        if cont.rounds.is_some_and(|n| round >= n) {
            break;
        }
        // Sleep out the period in short steps so the stop flag is seen promptly.
        while let Some(left) = cont.resync.checked_sub(started.elapsed()) {
            if left.is_zero() || opts.stopped() {
                break;
            }
            std::thread::sleep(left.min(Duration::from_millis(50)));
        }
    }
    progress.clear();
    Ok(summary)
}

/// One vCPU's part of round `round` (`many`: the file holds several vCPUs, so the text
/// output names the vCPU): probes it, appends its segment. `Ok(false)` when a stop
/// interrupted the round.
#[allow(clippy::too_many_arguments)]
fn one_vcpu_round<T: StampedTransport>(
    session: &mut ProbeSession<T>,
    opts: &ProbeOptions,
    cont: &ContinuousOptions,
    (round, vcpu, many): (u64, u32, bool),
    cumulative: &mut Cumulative,
    writer: &mut SyncWriter,
    summary: &mut ContinuousSummary,
    out: &mut dyn Write,
    progress: &mut Progress,
) -> Result<bool, ProbeError> {
    let name = if many {
        format!("round {round} vCPU {vcpu}")
    } else {
        format!("round {round}")
    };
    session.forget_reference();
    let samples = match session.probe_round(opts.probes, opts.interval, &mut Progress::hidden()) {
        Err(ProbeError::Interrupted) => return Ok(false),
        r => r?,
    };
    let estimate = if samples.is_empty() {
        None
    } else {
        Some(ProbeSummary::from_samples(
            session.info(),
            &samples,
            session.stats(),
        ))
    };
    match estimate {
        None => {
            summary.empty_rounds += 1;
            note(out, opts.json, &format!("{name}: every probe was lost"))?;
        }
        // The guest clock stepped inside this round (no constant rate fits it alone):
        // nothing trustworthy to write; the next round measures the new relation.
        Some(Err(e)) => {
            summary.empty_rounds += 1;
            summary.refused = Some(e);
            note(
                out,
                opts.json,
                &format!(
                    "{name}: skipped, {} samples give no estimate: {}",
                    samples.len(),
                    super::error::refusal_text(e)
                ),
            )?;
        }
        Some(Ok(s)) => {
            let is_break = cumulative.add(&samples);
            let seg = segment(cumulative, &s, &samples, round, is_break)?;
            writer.append(&seg)?;
            summary.segments += 1;
            summary.breaks += u64::from(is_break);
            if opts.json {
                s.write_json(out).map_err(ProbeError::Output)?;
            } else {
                writeln!(
                    out,
                    "{name}: offset {} in [{}, {}] at host {}, drift {} ppb, {} probes, rtt min {}{}",
                    seg.offset,
                    seg.offset_lo,
                    seg.offset_hi,
                    seg.host_anchor,
                    seg.drift_ppb,
                    seg.probes,
                    seg.rtt_min_ticks,
                    if is_break { ", BREAK" } else { "" }
                )
                .map_err(ProbeError::Output)?;
            }
            out.flush().map_err(ProbeError::Output)?;
            progress.status(&format!(
                "vmtsync probe: {name}, {} segments in {}",
                summary.segments,
                cont.out.display()
            ));
            summary.last = Some(s);
        }
    }
    Ok(true)
}

/// Writes a note about a round: to `out` in text mode, to stderr (`vmtsync: ` prefixed) under
/// `--json`, where stdout carries only schema-2 objects.
fn note(out: &mut dyn Write, json: bool, text: &str) -> Result<(), ProbeError> {
    if json {
        writeln!(std::io::stderr(), "vmtsync: {text}")
    } else {
        writeln!(out, "{text}")
    }
    .map_err(ProbeError::Output)
}

/// Builds the round's segment from the cumulative estimate (constant rate since the last
/// break, within [`RATE_LIMITS`]); when that estimate is empty (a round it refused on its own),
/// from the round's own guaranteed bounds. Both hold for any constant rate within the limits
/// that fits the samples, so the first round's segment is valid even before the samples bound
/// the rate; its drift bounds are then the limits themselves, never "exactly 0".
pub(crate) fn segment(
    cumulative: &Cumulative,
    s: &ProbeSummary,
    samples: &[ProbeSample],
    round: u64,
    is_break: bool,
) -> Result<SyncSegment, ProbeError> {
    let anchor = s.at_host;
    let (model, lo, hi) = match cumulative.est.offset_bounds_at_within(anchor, &RATE_LIMITS) {
        Ok((lo, hi)) => (OffsetModel::Drift, lo, hi),
        Err(_) => (s.model, s.bound_lo, s.bound_hi),
    };
    // Drift bounds to match: outward (the lower rate rounded down, the upper up), the
    // round's own when the cumulative estimate is empty, the limits when nothing tighter is
    // known.
    let limits = (
        RATE_LIMITS.min().drift_ppb_floor(),
        RATE_LIMITS.max().drift_ppb_ceil(),
    );
    let (dlo, dhi) = match cumulative.est.rate_bounds_within(&RATE_LIMITS) {
        Ok((a, b)) => (a.drift_ppb_floor(), b.drift_ppb_ceil()),
        Err(_) => s.drift.map_or(limits, |d| (Some(d.lo), Some(d.hi))),
    };
    // Identity (KVM's default) when it fits; otherwise the centre of the bounds, which halves
    // the worst-case conversion error away from the anchor. The bound closest to identity
    // would convert a guest 100 ppm fast with the slowest rate that fits, early by up to the
    // whole drift width times the distance: measured, enough to put events recorded after a
    // port read before its exit (docs/validate.md).
    let used = match (dlo, dhi) {
        (Some(lo), Some(hi)) if lo > 0 || hi.max(lo) < 0 => {
            lo + i64::try_from((i128::from(hi.max(lo)) - i128::from(lo)) / 2).unwrap_or(0)
        }
        _ => 0,
    };
    let offset = lo + i64::try_from((i128::from(hi) - i128::from(lo)) / 2).unwrap_or(0);
    let guest_anchor = anchor
        .0
        .checked_add_signed(offset)
        .ok_or(ProbeError::Estimate(EstimateError::Overflow))?;
    let first = samples
        .first()
        .ok_or(ProbeError::Estimate(EstimateError::NoSamples))?;
    let last = samples
        .last()
        .ok_or(ProbeError::Estimate(EstimateError::NoSamples))?;
    Ok(SyncSegment {
        vcpu: s.vcpu,
        round,
        guest_start: first.guest.0,
        host_anchor: anchor.0,
        guest_anchor,
        offset,
        offset_lo: lo,
        offset_hi: hi,
        drift_ppb: used,
        drift_ppb_lo: dlo,
        drift_ppb_hi: dhi,
        model,
        probes: s.probes,
        rtt_min_ticks: s.rtt.min,
        host_first: first.host_send.0,
        host_last: last.host_recv.0,
        is_break,
        anchor: s.stats.anchor,
    })
}

impl ProbeOptions {
    pub(crate) fn stopped(&self) -> bool {
        self.stop
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::ProbeAddr;
    use crate::probe::run_probe_on;
    use crate::probe::testutil::SimTransport;
    use crate::syncfile::{SyncFile, convert_with_sync};
    use vmtsync_core::{GuestTicks, HostTicks};

    #[test]
    fn a_migration_between_rounds_is_a_break_and_converts_exactly() {
        let dir = tempfile::Builder::new()
            .prefix("vmtsync-cont-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("migration.jsonl");
        let mut t = SimTransport::new(1_000);
        t.exact = true;
        t.gap = 1_000_000;
        // Flush + hello, then two rounds of 8 probes; the third round sees the new offset.
        t.step_at = Some((2 + 16, 9_000_000));
        let mut opts = ProbeOptions::new(ProbeAddr::Unix("sim".into()));
        opts.progress = false;
        opts.probes = 8;
        opts.continuous = Some(ContinuousOptions {
            out: path.clone(),
            resync: Duration::ZERO,
            rounds: Some(4),
        });
        let mut out = Vec::new();
        let last = run_probe_on(t, &opts, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.matches("BREAK").count(), 1, "{text}");
        assert_eq!((last.bound_lo, last.offset), (9_000_000, 9_000_000));
        let sync = SyncFile::read(&path).unwrap();
        let breaks: Vec<bool> = sync.segments.iter().map(|s| s.is_break).collect();
        assert_eq!(breaks, [false, false, true, false]);
        for (i, seg) in sync.segments.iter().enumerate() {
            let truth = if i < 2 { 1_000 } else { 9_000_000 };
            // Exact stamps: the bounds are the truth, widened by at most the one tick of the
            // rate model's rounding (a reading is the line rounded down).
            assert_eq!((seg.offset_lo, seg.offset), (truth, truth), "{seg:?}");
            assert!(seg.offset_hi - truth <= 1, "{seg:?}");
            assert_eq!(seg.drift_ppb, 0);
        }
        // Guest ticks inside each segment convert back exactly.
        let (s1, s2) = (sync.segments[1], sync.segments[2]);
        let input = format!("{}\n{}\n", s1.guest_start + 5, s2.guest_start + 5);
        let mut conv = Vec::new();
        convert_with_sync(&sync, 3, &mut input.as_bytes(), &mut conv, false).unwrap();
        let want = format!(
            "{}\n{}\n",
            s1.guest_start + 5 - 1_000,
            s2.guest_start + 5 - 9_000_000
        );
        assert_eq!(String::from_utf8(conv).unwrap(), want);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn json_mode_keeps_round_notes_off_stdout() {
        let dir = tempfile::Builder::new()
            .prefix("vmtsync-cont-")
            .tempdir()
            .unwrap();
        let sim = || {
            let mut t = SimTransport::new(1_000);
            t.exact = true;
            t.gap = 1_000_000;
            // Flush + hello, one round of 8, then the offset steps in the middle of round
            // two: that round is skipped (inconsistent samples) and a note says so.
            t.step_at = Some((2 + 8 + 4, 9_000_000));
            t
        };
        let mut opts = ProbeOptions::new(ProbeAddr::Unix("sim".into()));
        opts.progress = false;
        opts.probes = 8;
        opts.continuous = Some(ContinuousOptions {
            out: dir.path().join("notes.jsonl"),
            resync: Duration::ZERO,
            rounds: Some(3),
        });
        let mut text = Vec::new();
        run_probe_on(sim(), &opts, &mut text).unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(text.contains("round 1: skipped"), "{text}");
        opts.json = true;
        let mut out = Vec::new();
        run_probe_on(sim(), &opts, &mut out).unwrap();
        let out = String::from_utf8(out).unwrap();
        // Two measured rounds, two schema-2 objects, nothing else (the note went to stderr).
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out}");
        for l in lines {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            assert_eq!(v["schema"], 2, "{l}");
        }
    }

    #[test]
    fn stopped_before_any_round_is_interrupted_not_no_samples() {
        static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
        let dir = tempfile::Builder::new()
            .prefix("vmtsync-cont-")
            .tempdir()
            .unwrap();
        let mut opts = ProbeOptions::new(ProbeAddr::Unix("sim".into()));
        opts.progress = false;
        opts.stop = Some(&STOP);
        opts.continuous = Some(ContinuousOptions {
            out: dir.path().join("stopped.jsonl"),
            resync: Duration::ZERO,
            rounds: None,
        });
        let r = run_probe_on(SimTransport::new(1_000), &opts, &mut Vec::new());
        assert!(matches!(r, Err(ProbeError::Interrupted)), "{r:?}");
    }

    fn round(start: u64, n: u64, offset: u64) -> Vec<ProbeSample> {
        (0..n)
            .map(|i| {
                let send = start + i * 1000;
                ProbeSample {
                    host_send: HostTicks(send),
                    guest: GuestTicks(send + 100 + offset),
                    host_recv: HostTicks(send + 200),
                    vcpu: 0,
                }
            })
            .collect()
    }

    /// A summary of `samples` as `run` makes it (vCPU 0, no session counters).
    fn summary(samples: &[ProbeSample]) -> ProbeSummary {
        let info = crate::probe::session::AgentInfo {
            vcpu: 0,
            transport: vmtsync_core::proto::Transport::Memory,
            features: vmtsync_core::proto::Features::NONE,
            tsc_khz: None,
            hello_tsc: GuestTicks(0),
            hello_stamps: crate::link::FrameStamps {
                send: HostTicks(0),
                recv: HostTicks(0),
            },
        };
        ProbeSummary::from_samples(&info, samples, crate::probe::SessionStats::default()).unwrap()
    }

    #[test]
    fn segments_of_a_drifting_guest_hold_the_truth_from_the_first_round() {
        use vmtsync_core::sim::{Delay, GuestClock, Link, Sim};
        // A guest 100 ppm fast behind tight asymmetric brackets (the exit-stamped shape). The
        // first round has one probe: the samples bound neither the rate nor, alone, the
        // offset, so the segment's bounds and drift come from the rate limits.
        let clock = GuestClock::with_drift_ppb(5_098_309_658_643, 100_000).unwrap();
        let link = Link::tight_asymmetric();
        let mut sim = Sim::new(7, HostTicks(1 << 41), clock, link, 0);
        let mut c = Cumulative::new();
        let mut centred = 0;
        for (round, probes) in [(0_u64, 1_usize), (1, 64), (2, 64)] {
            let samples: Vec<ProbeSample> = (0..probes).map(|_| sim.probe().unwrap()).collect();
            let s = summary(&samples);
            let is_break = c.add(&samples);
            let seg = segment(&c, &s, &samples, round, is_break).unwrap();
            assert!(!seg.is_break);
            assert_eq!(seg.model, OffsetModel::Drift);
            let at = HostTicks(seg.host_anchor);
            assert_eq!(
                clock.offset_within(at, seg.offset_lo, seg.offset_hi),
                Some(true),
                "round {round}: {seg:?}"
            );
            let (dlo, dhi) = (seg.drift_ppb_lo.unwrap(), seg.drift_ppb_hi.unwrap());
            assert_eq!(
                clock.drift_ppb_within(dlo, dhi),
                Some(true),
                "round {round}: {seg:?}"
            );
            if round == 0 {
                // Only the limits bound the first round's rate: [1/2, 2] as ppb.
                assert_eq!((dlo, dhi), (-500_000_000, 1_000_000_000));
            } else {
                assert!(dhi - dlo < 1_000_000, "round {round}: {seg:?}");
                // Identity while it fits; once it does not, the centre of the bounds, not an
                // end.
                if dlo > 0 {
                    assert!(
                        (seg.drift_ppb - (dlo + (dhi - dlo) / 2)).abs() <= 1,
                        "{seg:?}"
                    );
                    centred += 1;
                } else {
                    assert_eq!(seg.drift_ppb, 0, "{seg:?}");
                }
            }
        }
        assert_eq!(centred, 1, "round 2 excludes identity");
        // A one-probe round three host seconds later: the cumulative hull bounds it alone.
        sim.link.gap = Delay::Constant(3_000_000_000);
        let samples = [sim.probe().unwrap()];
        let s = summary(&samples);
        assert!(!c.add(&samples));
        let seg = segment(&c, &s, &samples, 3, false).unwrap();
        assert_eq!(
            clock.offset_within(HostTicks(seg.host_anchor), seg.offset_lo, seg.offset_hi),
            Some(true),
            "{seg:?}"
        );
    }

    #[test]
    fn cumulative_estimate_tightens_and_detects_a_step() {
        let mut c = Cumulative::new();
        assert!(!c.add(&round(1_000_000, 16, 5_000)));
        let short = c.est.estimate().unwrap();
        assert!(!c.add(&round(1_000_000_000, 16, 5_000)));
        let long = c.est.estimate().unwrap();
        assert_eq!(c.rounds, 2);
        // A span a thousand times longer bounds the rate far more tightly.
        assert!(
            long.drift_ppb_max - long.drift_ppb_min
                < (short.drift_ppb_max - short.drift_ppb_min) / 100,
            "{short:?} {long:?}"
        );
        assert!(long.drift_ppb_min <= 0 && 0 <= long.drift_ppb_max);
        // The guest TSC jumps by a million ticks: a break, and the estimate restarts.
        assert!(c.add(&round(2_000_000_000, 16, 1_005_000)));
        assert_eq!(c.rounds, 1);
        let (lo, hi) = c.est.offset_bounds_at(HostTicks(2_000_000_000)).unwrap();
        assert!(lo <= 1_005_000 && 1_005_000 <= hi, "{lo} {hi}");
    }
}
