//! What a probe round measured: our bounded estimates, trace-cmd's on the same samples, and
//! round-trip statistics, printed as text or as the versioned `--json` object.
//!
//! # What "guaranteed" means
//!
//! `bound_lo..=bound_hi` contains the true offset at `at_host_tsc` for **every constant
//! guest rate in [`crate::sync::RATE_LIMITS`] (`[1/2, 2]` guest ticks per host tick, the range the probe
//! session already assumes to unwrap compact replies) that fits every sample**: the drift
//! estimator's convex-hull bounds
//! (`DriftEstimator::offset_bounds_at_within`, in [`crate::sync::round`], rounded outward to whole ticks). A guest
//! whose clock drifts (an oscillator off by 100 ppm, a software skew, TSC scaling) stays
//! inside. The assumptions: the guest's rate is constant over the round, within those limits,
//! each guest reading happened between its two host stamps, and a reading is the true clock
//! rounded down once (KVM's `>> frac`; docs/probe.md).
//!
//! The constant-offset interval (the intersection of every probe's
//! `[guest - host_recv, guest - host_send]`) is tighter but holds only if the guest's rate is
//! *exactly* the host's: under drift it can exclude the truth long before it becomes empty.
//! It is reported separately (`rate1_lo`, `rate1_hi`, "if the rate is exactly 1"), never as
//! the guaranteed bound.
//!
//! # `vmtsync probe --json`, schema 2
//!
//! One JSON object per round (continuous mode prints one line per round). Schema 2 changed
//! the meaning of `bound_lo`/`bound_hi` (schema 1 gave the constant-offset interval whenever
//! it was not empty, `model` `"offset"`) and added `rate1_lo`/`rate1_hi`:
//!
//! | key | type | meaning |
//! |---|---|---|
//! | `schema` | 2 | this table's version |
//! | `vcpu` | u32 | the vCPU the agent reads |
//! | `offset_ticks` | i64 | `guest - host` TSC offset at `at_host_tsc`: centre of the bounds |
//! | `bound_lo`, `bound_hi` | i64 | guaranteed bounds of that offset (inclusive), see above |
//! | `model` | `"drift"` | the model the guaranteed bounds come from: constant rate within the limits (schema 1 also wrote `"offset"`) |
//! | `rate1_lo`, `rate1_hi` | i64 or null | the constant-offset interval: the offset's bounds *if the guest's rate is exactly the host's*, not guaranteed otherwise; null when no constant offset fits |
//! | `at_host_tsc` | u64 | host TSC the offset refers to (middle of the sampled span) |
//! | `drift_ppb` | i64 or null | guest rate against the host, `(rate - 1)·1e9`, centre of its bounds; null until two probes bound it |
//! | `drift_ppb_lo`, `drift_ppb_hi` | i64 or null | guaranteed drift bounds |
//! | `rtt_min_ticks`, `rtt_median_ticks`, `rtt_max_ticks` | u64 | round-trip times in host TSC ticks |
//! | `probes` | u32 | samples used |
//! | `sent`, `lost_probes`, `bad_frames`, `stale_replies` | u64 | what did not become a sample (`bad_frames`: runs between delimiters that did not decode: console text on a shared UART, or damaged frames) |
//! | `console_bytes` | u64 | bytes of those runs: the guest's console text, written to `--console FILE` when given (added in schema 2 without a bump; readers treat a missing key as 0) |
//! | `unexpected`, `unknown_seq` | u64 | skipped messages: well-formed but unasked for; replies to a sequence number never sent |
//! | `ambiguous`, `out_of_window`, `wrong_vcpu`, `bad_stamps`, `flooded` | u64 | why probes were lost (each also in `lost_probes`): compact reply not uniquely unwrappable (a stall); TSC outside the window the last verified reading allows; another vCPU; host stamps out of order; the wait drowned in other traffic |
//! | `unanchored` | u64 | probes lost because an exit-anchored transport found no exits for them (added in schema 2; docs/anchor.md) |
//! | `anchor` | `"in-process"`, `"kvm-pio-uart"` or `"kvm-pio-sync-port"` | where the samples' host brackets come from (added in schema 2; readers treat a missing key as `"in-process"`) |
//! | `tracecmd_fastest_rtt_offset` | i64 | trace-cmd's PTP estimate (fastest round trip's midpoint) on the same samples, same sign |
//! | `tsc_khz` | u32 or null | guest TSC frequency if the agent reported it |
//!
//! A round whose samples give no estimate prints instead one object with an `error` key (added
//! in schema 2; readers tell the two apart by that key), and the command fails as without
//! `--json` (the same message on stderr, exit code 1, or 8 for `--anchor kvm-pio` when no
//! probe's exits were found):
//!
//! | key | type | meaning |
//! |---|---|---|
//! | `schema` | 2 | as above |
//! | `vcpu` | u32 | the vCPU probed |
//! | `error` | `"no-samples"`, `"contradictory-samples"`, `"overflow"` or `"refused-samples"` | why: every probe was lost; the samples' brackets contradict each other (no constant offset and rate fits them all); a value out of range; any other refusal |
//! | `message` | string | the same in words, and what to try |
//! | `probes` | u32 | samples the round had |
//! | `sent`, `lost_probes`, `unanchored` | u64 | as above |
//! | `anchor` | string | as above |

use std::io::{self, Write};

use serde::Serialize;
use vmtsync_core::estimate::{EstimateError, ProbeSample};

use super::session::{AgentInfo, SessionStats};
use crate::sync::Round;
pub use crate::sync::{DriftSummary, RttStats};
use crate::syncfile::OffsetModel;

/// Everything one probe round measured: the round's estimates ([`Round`], its fields read
/// through this summary) and what the session adds to them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeSummary {
    /// The round's estimates.
    pub round: Round,
    /// Where the bounds come from.
    pub model: OffsetModel,
    /// Guest TSC frequency, if known.
    pub tsc_khz: Option<u32>,
    /// Session counters at the end of the round.
    pub stats: SessionStats,
}

impl std::ops::Deref for ProbeSummary {
    type Target = Round;

    fn deref(&self) -> &Round {
        &self.round
    }
}

/// The JSON shape of [`ProbeSummary`] (schema 2, see the module docs).
#[derive(Serialize)]
struct JsonSummary {
    schema: u32,
    vcpu: u32,
    offset_ticks: i64,
    bound_lo: i64,
    bound_hi: i64,
    model: OffsetModel,
    rate1_lo: Option<i64>,
    rate1_hi: Option<i64>,
    at_host_tsc: u64,
    drift_ppb: Option<i64>,
    drift_ppb_lo: Option<i64>,
    drift_ppb_hi: Option<i64>,
    rtt_min_ticks: u64,
    rtt_median_ticks: u64,
    rtt_max_ticks: u64,
    probes: u32,
    sent: u64,
    lost_probes: u64,
    bad_frames: u64,
    console_bytes: u64,
    stale_replies: u64,
    unexpected: u64,
    unknown_seq: u64,
    ambiguous: u64,
    out_of_window: u64,
    wrong_vcpu: u64,
    bad_stamps: u64,
    flooded: u64,
    unanchored: u64,
    anchor: crate::syncfile::AnchorKind,
    tracecmd_fastest_rtt_offset: i64,
    tsc_khz: Option<u32>,
}

/// The `--json` object of a round that gave no estimate (module docs).
#[derive(Serialize)]
struct JsonRefusal {
    schema: u32,
    vcpu: u32,
    error: &'static str,
    message: &'static str,
    probes: u32,
    sent: u64,
    lost_probes: u64,
    unanchored: u64,
    anchor: crate::syncfile::AnchorKind,
}

/// The current `--json` schema version.
pub const JSON_SCHEMA: u32 = 2;

impl ProbeSummary {
    /// Estimates from one round's samples ([`Round::from_samples`]), with what the session
    /// knows.
    ///
    /// # Errors
    /// As [`Round::from_samples`].
    pub fn from_samples(
        info: &AgentInfo,
        samples: &[ProbeSample],
        stats: SessionStats,
    ) -> Result<Self, EstimateError> {
        Round::from_samples(samples).map(|r| Self::of(&r, info.tsc_khz, stats))
    }

    /// A round's estimates as a report, with the guest's TSC frequency (if known) and the
    /// session's counters.
    #[must_use]
    pub fn of(r: &Round, tsc_khz: Option<u32>, stats: SessionStats) -> Self {
        Self {
            round: *r,
            model: OffsetModel::Drift,
            tsc_khz,
            stats,
        }
    }

    /// The schema-2 JSON object (see the module docs).
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        // A struct of integers and options always serializes.
        serde_json::to_value(self.json_summary()).unwrap_or(serde_json::Value::Null)
    }

    fn json_summary(&self) -> JsonSummary {
        JsonSummary {
            schema: JSON_SCHEMA,
            vcpu: self.vcpu,
            offset_ticks: self.offset,
            bound_lo: self.bound_lo,
            bound_hi: self.bound_hi,
            model: self.model,
            rate1_lo: self.rate1.map(|r| r.0),
            rate1_hi: self.rate1.map(|r| r.1),
            at_host_tsc: self.at_host.0,
            drift_ppb: self.drift.map(|d| d.ppb),
            drift_ppb_lo: self.drift.map(|d| d.lo),
            drift_ppb_hi: self.drift.map(|d| d.hi),
            rtt_min_ticks: self.rtt.min,
            rtt_median_ticks: self.rtt.median,
            rtt_max_ticks: self.rtt.max,
            probes: self.probes,
            sent: self.stats.sent,
            lost_probes: self.stats.lost_probes,
            bad_frames: self.stats.bad_frames,
            console_bytes: self.stats.console_bytes,
            stale_replies: self.stats.stale_replies,
            unexpected: self.stats.unexpected,
            unknown_seq: self.stats.unknown_seq,
            ambiguous: self.stats.ambiguous,
            out_of_window: self.stats.out_of_window,
            wrong_vcpu: self.stats.wrong_vcpu,
            bad_stamps: self.stats.bad_stamps,
            flooded: self.stats.flooded,
            unanchored: self.stats.unanchored,
            anchor: self.stats.anchor,
            tracecmd_fastest_rtt_offset: self.tracecmd_fastest,
            tsc_khz: self.tsc_khz,
        }
    }

    /// Writes the `--json` object of a round on `vcpu` whose `probes` samples gave no
    /// estimate (`error`, see the module docs), on one line.
    ///
    /// # Errors
    /// The writer's.
    pub fn write_json_refusal(
        out: &mut dyn Write,
        vcpu: u32,
        probes: usize,
        stats: SessionStats,
        why: EstimateError,
    ) -> io::Result<()> {
        let refusal = JsonRefusal {
            schema: JSON_SCHEMA,
            vcpu,
            error: super::error::refusal_kind(why),
            message: super::error::refusal_text(why),
            probes: u32::try_from(probes).unwrap_or(u32::MAX),
            sent: stats.sent,
            lost_probes: stats.lost_probes,
            unanchored: stats.unanchored,
            anchor: stats.anchor,
        };
        serde_json::to_writer(&mut *out, &refusal).map_err(io::Error::from)?;
        out.write_all(b"\n")
    }

    /// Writes the JSON object on one line.
    ///
    /// # Errors
    /// The writer's.
    pub fn write_json(&self, out: &mut dyn Write) -> io::Result<()> {
        // Serialized from the struct, not a `Value`, so the keys keep the documented order
        // ("schema" first) instead of being sorted.
        serde_json::to_writer(&mut *out, &self.json_summary()).map_err(io::Error::from)?;
        out.write_all(b"\n")
    }

    /// Writes the human-readable report.
    ///
    /// # Errors
    /// The writer's.
    pub fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        let ns = |ticks: u64| match self.tsc_khz {
            Some(khz) if khz > 0 => {
                format!(" ({} ns)", u128::from(ticks) * 1_000_000 / u128::from(khz))
            }
            _ => String::new(),
        };
        // Runs that did not decode are the guest's console text on a shared UART: say so
        // instead of calling a boot log "bad frames".
        let undecoded = if self.stats.console_bytes > 0 {
            format!(
                "{} bytes of console text or damaged frames in {} runs",
                self.stats.console_bytes, self.stats.bad_frames
            )
        } else {
            format!("{} bad frames", self.stats.bad_frames)
        };
        writeln!(
            out,
            "vCPU {}: {} probes ({} sent, {} lost, {undecoded}, {} stale replies)",
            self.vcpu,
            self.probes,
            self.stats.sent,
            self.stats.lost_probes,
            self.stats.stale_replies
        )?;
        let st = &self.stats;
        let rejected = [
            (st.ambiguous, "ambiguous (guest stalled)"),
            (st.out_of_window, "outside the TSC window"),
            (st.wrong_vcpu, "wrong vCPU"),
            (st.bad_stamps, "bad host stamps"),
            (st.flooded, "flooded"),
            (st.unanchored, "without their exits (not anchored)"),
            (st.unknown_seq, "unknown sequence numbers"),
            (st.unexpected, "unexpected messages"),
        ];
        // Only said when something happened, so the usual report stays one line.
        let said: Vec<String> = rejected
            .iter()
            .filter(|(n, _)| *n > 0)
            .map(|(n, what)| format!("{n} {what}"))
            .collect();
        if !said.is_empty() {
            writeln!(out, "rejected: {}", said.join(", "))?;
        }
        // Said only when the brackets are not this process's own, so the usual report stays
        // as it was.
        if self.stats.anchor != crate::syncfile::AnchorKind::InProcess {
            writeln!(
                out,
                "host brackets: the vCPU's own exits stamped by kvm:kvm_pio ({})",
                self.stats.anchor.name()
            )?;
        }
        writeln!(
            out,
            "offset (guest - host): {} ticks, guaranteed in [{}, {}] (width {}{}), {}, at host TSC {}",
            self.offset,
            self.bound_lo,
            self.bound_hi,
            self.width(),
            ns(self.width()),
            match self.model {
                OffsetModel::Offset => "constant-offset model (rate exactly 1)",
                OffsetModel::Drift => "for any constant rate in [1/2, 2] the samples allow",
            },
            self.at_host.0
        )?;
        if let Some((lo, hi)) = self.rate1 {
            writeln!(
                out,
                "if the guest's rate is exactly the host's (not guaranteed): [{lo}, {hi}] (width {}{})",
                hi.abs_diff(lo),
                ns(hi.abs_diff(lo))
            )?;
        }
        match self.drift {
            Some(d) => writeln!(
                out,
                "drift: {:+} ppb, guaranteed in [{}, {}] ppb",
                d.ppb, d.lo, d.hi
            )?,
            None => writeln!(
                out,
                "drift: not bounded yet (needs two non-overlapping probes)"
            )?,
        }
        writeln!(
            out,
            "rtt: min {}{}, median {}{}, max {}{} ticks",
            self.rtt.min,
            ns(self.rtt.min),
            self.rtt.median,
            ns(self.rtt.median),
            self.rtt.max,
            ns(self.rtt.max)
        )?;
        writeln!(
            out,
            "trace-cmd fastest-RTT estimate on the same samples: {} ticks ({:+} from ours, {} the bounds)",
            self.tracecmd_fastest,
            i128::from(self.tracecmd_fastest) - i128::from(self.offset),
            if (self.bound_lo..=self.bound_hi).contains(&self.tracecmd_fastest) {
                "inside"
            } else {
                "OUTSIDE"
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmtsync_core::{GuestTicks, HostTicks};

    fn info() -> AgentInfo {
        AgentInfo {
            vcpu: 2,
            transport: vmtsync_core::proto::Transport::Memory,
            features: vmtsync_core::proto::Features::NONE,
            tsc_khz: Some(1_000_000),
            hello_tsc: GuestTicks(0),
            hello_stamps: crate::link::FrameStamps {
                send: HostTicks(0),
                recv: HostTicks(0),
            },
        }
    }

    fn sample(send: u64, fwd: u64, back: u64, offset: i64) -> ProbeSample {
        ProbeSample {
            host_send: HostTicks(send),
            guest: GuestTicks((send + fwd).checked_add_signed(offset).unwrap()),
            host_recv: HostTicks(send + fwd + back),
            vcpu: 2,
        }
    }

    #[test]
    fn summary_bounds_contain_the_truth_and_json_has_the_schema() {
        let truth = 5_000_000;
        let samples: Vec<_> = (0..20_u64)
            .map(|i| sample(1_000_000 + i * 10_000, 100 + i * 7 % 50, 300 - i * 3, truth))
            .collect();
        let s = ProbeSummary::from_samples(&info(), &samples, SessionStats::default()).unwrap();
        assert_eq!(s.model, OffsetModel::Drift);
        assert!(s.bound_lo <= truth && truth <= s.bound_hi, "{s:?}");
        assert!(s.bound_lo <= s.offset && s.offset <= s.bound_hi);
        // At rate 1 the constant-offset interval fits too: inside the guaranteed bounds.
        let (r1_lo, r1_hi) = s.rate1.unwrap();
        assert!(r1_lo <= truth && truth <= r1_hi, "{s:?}");
        assert!(s.bound_lo <= r1_lo && r1_hi <= s.bound_hi, "{s:?}");
        assert_eq!(
            s.rtt.min,
            samples.iter().filter_map(ProbeSample::rtt).min().unwrap()
        );
        let d = s.drift.unwrap();
        assert!(d.lo <= 0 && 0 <= d.hi, "{d:?}");
        let j = s.to_json();
        assert_eq!(j["schema"], 2);
        assert_eq!(j["vcpu"], 2);
        assert_eq!(
            (j["rate1_lo"].as_i64(), j["rate1_hi"].as_i64()),
            (Some(r1_lo), Some(r1_hi))
        );
        assert_eq!(j["offset_ticks"], s.offset);
        assert_eq!(j["bound_lo"], s.bound_lo);
        assert_eq!(j["bound_hi"], s.bound_hi);
        assert_eq!(j["probes"], 20);
        assert_eq!(j["rtt_min_ticks"], s.rtt.min);
        assert_eq!(j["tracecmd_fastest_rtt_offset"], s.tracecmd_fastest);
        assert_eq!(j["model"], "drift");
        for key in [
            "unexpected",
            "unknown_seq",
            "ambiguous",
            "out_of_window",
            "wrong_vcpu",
            "bad_stamps",
            "flooded",
        ] {
            assert_eq!(j[key], 0, "{key}");
        }
        // The line keeps the documented key order, schema first (a Value would sort them).
        let mut line = Vec::new();
        s.write_json(&mut line).unwrap();
        let line = String::from_utf8(line).unwrap();
        assert!(
            line.starts_with(r#"{"schema":2,"vcpu":2,"offset_ticks":"#) && line.ends_with("}\n"),
            "{line}"
        );
        assert_eq!(serde_json::from_str::<serde_json::Value>(&line).unwrap(), j);
        let mut text = Vec::new();
        s.write_text(&mut text).unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(text.contains("guaranteed in"), "{text}");
        assert!(text.contains("for any constant rate in [1/2, 2]"), "{text}");
        assert!(
            text.contains(&format!(
                "if the guest's rate is exactly the host's (not guaranteed): [{r1_lo}, {r1_hi}]"
            )),
            "{text}"
        );
        assert!(text.contains("trace-cmd fastest-RTT"), "{text}");
    }

    #[test]
    fn rejections_are_reported_by_reason_only_when_they_happened() {
        let samples: Vec<_> = (0..4_u64)
            .map(|i| sample(1_000 + i * 100, 10, 10, 7))
            .collect();
        let text = |stats| {
            let s = ProbeSummary::from_samples(&info(), &samples, stats).unwrap();
            let mut out = Vec::new();
            s.write_text(&mut out).unwrap();
            (String::from_utf8(out).unwrap(), s.to_json())
        };
        let has = |text: &str, line: &str| assert!(text.contains(line), "{text}");
        let (quiet, _) = text(SessionStats::default());
        assert!(!quiet.contains("rejected"), "{quiet}");
        let (loud, j) = text(SessionStats {
            ambiguous: 2,
            unknown_seq: 1,
            lost_probes: 2,
            ..SessionStats::default()
        });
        has(
            &loud,
            "rejected: 2 ambiguous (guest stalled), 1 unknown sequence numbers",
        );
        assert_eq!(
            (j["ambiguous"].as_u64(), j["unknown_seq"].as_u64()),
            (Some(2), Some(1))
        );
        assert!(!quiet.contains("host brackets"), "{quiet}");
        assert_eq!(j["anchor"], "in-process");
        let (anchored, j) = text(SessionStats {
            anchor: crate::syncfile::AnchorKind::KvmPioUart,
            unanchored: 3,
            lost_probes: 3,
            ..SessionStats::default()
        });
        has(&anchored, "rejected: 3 without their exits (not anchored)");
        has(&anchored, "kvm:kvm_pio (kvm-pio-uart)");
        assert_eq!(
            (j["anchor"].as_str(), j["unanchored"].as_u64()),
            (Some("kvm-pio-uart"), Some(3))
        );
    }

    #[test]
    fn broken_pipe_is_recognised() {
        use crate::probe::ProbeError;
        let e = ProbeError::Output(io::Error::from(io::ErrorKind::BrokenPipe));
        assert!(e.is_broken_pipe());
        assert!(!ProbeError::AgentExited.is_broken_pipe());
        let e = crate::syncfile::SyncFileError::Output(io::Error::from(io::ErrorKind::BrokenPipe));
        assert!(e.is_broken_pipe());
    }
}
