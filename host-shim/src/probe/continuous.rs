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

use vmtsync_core::estimate::EstimateError;

use super::progress::Progress;
use super::report::ProbeSummary;
use super::session::ProbeSession;
use super::{ProbeError, ProbeOptions};
use crate::link::transport::StampedTransport;
use crate::sync::{Cumulative, Round};
use crate::syncfile::{SyncHeader, SyncWriter};

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

impl ContinuousSummary {
    /// The last round's summary (of the last vCPU synced), or why there is none: `stopped`
    /// before any round measured something is an interruption, not "no samples"; samples
    /// that gave no estimate are not lost probes.
    ///
    /// # Errors
    /// [`ProbeError::Interrupted`], or [`ProbeError::Estimate`] with the last refusal.
    pub fn last_or_why(self, stopped: bool) -> Result<ProbeSummary, ProbeError> {
        self.last.ok_or(if stopped {
            ProbeError::Interrupted
        } else {
            ProbeError::Estimate(self.refused.unwrap_or(EstimateError::NoSamples))
        })
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
        Some(Round::from_samples(&samples))
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
        Some(Ok(r)) => {
            let stats = session.stats();
            let seg = cumulative.add_round(&r, &samples, round, stats.anchor)?;
            let s = ProbeSummary::of(&r, session.info().tsc_khz, stats);
            let is_break = seg.is_break;
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
    use crate::probe::run_probe_on;
    use crate::probe::testutil::{SimTransport, continuous_into, sim_options, tempdir};
    use crate::sync::convert_with_sync;
    use crate::syncfile::SyncFile;

    #[test]
    fn a_migration_between_rounds_is_a_break_and_converts_exactly() {
        let dir = tempdir();
        let path = dir.path().join("migration.jsonl");
        let mut t = SimTransport::new(1_000);
        t.exact = true;
        t.gap = 1_000_000;
        // Flush + hello, then two rounds of 8 probes; the third round sees the new offset.
        t.step_at = Some((2 + 16, 9_000_000));
        let mut opts = sim_options();
        opts.continuous = continuous_into(path.clone(), Some(4));
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
        let dir = tempdir();
        let sim = || {
            let mut t = SimTransport::new(1_000);
            t.exact = true;
            t.gap = 1_000_000;
            // Flush + hello, one round of 8, then the offset steps in the middle of round
            // two: that round is skipped (inconsistent samples) and a note says so.
            t.step_at = Some((2 + 8 + 4, 9_000_000));
            t
        };
        let mut opts = sim_options();
        opts.continuous = continuous_into(dir.path().join("notes.jsonl"), Some(3));
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
        let dir = tempdir();
        let mut opts = sim_options();
        opts.stop = Some(&STOP);
        opts.continuous = continuous_into(dir.path().join("stopped.jsonl"), None);
        let r = run_probe_on(SimTransport::new(1_000), &opts, &mut Vec::new());
        assert!(matches!(r, Err(ProbeError::Interrupted)), "{r:?}");
    }
}
