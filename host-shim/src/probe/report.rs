//! What a probe round measured: our bounded estimates, trace-cmd's on the same samples, and
//! round-trip statistics, printed as text or as the versioned `--json` object.
//!
//! # What "guaranteed" means
//!
//! `bound_lo..=bound_hi` contains the true offset at `at_host_tsc` for **every constant
//! guest rate in [`RATE_LIMITS`] (`[1/2, 2]` guest ticks per host tick, the range the probe
//! session already assumes to unwrap compact replies) that fits every sample**: the drift
//! estimator's convex-hull bounds
//! ([`DriftEstimator::offset_bounds_at_within`], rounded outward to whole ticks). A guest
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
use vmtsync_core::HostTicks;
use vmtsync_core::estimate::{
    DriftEstimator, EstimateError, OffsetInterval, ProbeSample, RateLimits, Ratio,
    trace_cmd_fastest,
};

use super::session::{AgentInfo, RATE_MAX, RATE_MIN, SessionStats};
use crate::syncfile::OffsetModel;

/// Vertices per hull of the drift estimator (bounds stay sound when it saturates).
pub const HULL_CAPACITY: usize = 64;

/// The guest rates the guaranteed bounds allow, `[RATE_MIN, RATE_MAX]` = `[1/2, 2]` guest
/// ticks per host tick: the range the session already assumes to unwrap compact replies, so
/// the bounds add no assumption of their own.
pub const RATE_LIMITS: RateLimits = match RateLimits::new(ratio(RATE_MIN), ratio(RATE_MAX)) {
    Some(l) => l,
    None => panic!("RATE_MIN and RATE_MAX must be positive and ordered"),
};

/// A `(num, den)` rate constant as a [`Ratio`] (u64 always fits i128; `From` is not const).
#[allow(clippy::cast_lossless)]
const fn ratio((num, den): (u64, u64)) -> Ratio {
    Ratio {
        num: num as i128,
        den: den as i128,
    }
}

/// Round-trip time order statistics in host ticks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RttStats {
    /// Fastest round trip.
    pub min: u64,
    /// Median (lower middle for an even count).
    pub median: u64,
    /// Slowest round trip.
    pub max: u64,
}

/// Drift bounds of a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriftSummary {
    /// Centre of the bounds, ppb.
    pub ppb: i64,
    /// Lower bound, ppb (rounded down).
    pub lo: i64,
    /// Upper bound, ppb (rounded up).
    pub hi: i64,
}

/// Everything one probe round measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeSummary {
    /// The vCPU.
    pub vcpu: u32,
    /// Samples used.
    pub probes: u32,
    /// Offset `guest - host` at `at_host`, centre of the bounds.
    pub offset: i64,
    /// Guaranteed lower bound of the offset (any constant rate in [`RATE_LIMITS`]).
    pub bound_lo: i64,
    /// Guaranteed upper bound of the offset.
    pub bound_hi: i64,
    /// Where the bounds come from.
    pub model: OffsetModel,
    /// The constant-offset interval `(lo, hi)`: the offset's bounds only *if the guest's rate
    /// is exactly the host's*; `None` when no constant offset fits. Not guaranteed.
    pub rate1: Option<(i64, i64)>,
    /// Host TSC the offset refers to.
    pub at_host: HostTicks,
    /// Drift bounds, once two probes bound the rate.
    pub drift: Option<DriftSummary>,
    /// Round-trip statistics.
    pub rtt: RttStats,
    /// trace-cmd's fastest-RTT offset on the same samples (our sign).
    pub tracecmd_fastest: i64,
    /// Guest TSC frequency, if known.
    pub tsc_khz: Option<u32>,
    /// Session counters at the end of the round.
    pub stats: SessionStats,
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
    /// Estimates from one round's samples.
    ///
    /// # Errors
    /// `NoSamples` for an empty round; `SegmentBreak` if not even a constant rate within
    /// [`RATE_LIMITS`] explains the samples (the clock stepped mid-round); `VcpuMismatch`,
    /// `OutOfOrder`, `Overflow` for samples the estimators refuse.
    pub fn from_samples(
        info: &AgentInfo,
        samples: &[ProbeSample],
        stats: SessionStats,
    ) -> Result<Self, EstimateError> {
        let first = samples.first().ok_or(EstimateError::NoSamples)?;
        let last = samples.last().ok_or(EstimateError::NoSamples)?;
        let mut drift_est = DriftEstimator::<HULL_CAPACITY>::new();
        let mut interval = OffsetInterval::new();
        let mut interval_ok = true;
        for s in samples {
            drift_est.push(s)?;
            if interval_ok && interval.push(s).is_err() {
                interval_ok = false;
            }
        }
        let at =
            HostTicks(first.host_send.0 + last.host_recv.0.saturating_sub(first.host_send.0) / 2);
        let drift = match drift_est.estimate() {
            Ok(d) => Some(DriftSummary {
                ppb: d.drift_ppb,
                lo: d.drift_ppb_min,
                hi: d.drift_ppb_max,
            }),
            Err(EstimateError::Unbounded) => None,
            Err(e) => return Err(e),
        };
        // The guaranteed bounds hold for any constant rate in the limits; they contain every
        // offset the constant-offset interval allows (rate 1 is one such rate), which is
        // kept only as the "if the rate is exactly 1" figure.
        let (lo, hi) = drift_est.offset_bounds_at_within(at, &RATE_LIMITS)?;
        let rate1 = if interval_ok {
            interval.estimate().ok().map(|e| (e.min, e.max))
        } else {
            None
        };
        let tc = trace_cmd_fastest(samples)?;
        let mut rtts: Vec<u64> = samples.iter().filter_map(ProbeSample::rtt).collect();
        rtts.sort_unstable();
        let rtt = RttStats {
            min: rtts.first().copied().unwrap_or(0),
            median: rtts
                .get(rtts.len().saturating_sub(1) / 2)
                .copied()
                .unwrap_or(0),
            max: rtts.last().copied().unwrap_or(0),
        };
        Ok(Self {
            vcpu: first.vcpu,
            probes: u32::try_from(samples.len()).unwrap_or(u32::MAX),
            offset: lo + i64::try_from((i128::from(hi) - i128::from(lo)) / 2).unwrap_or(0),
            bound_lo: lo,
            bound_hi: hi,
            model: OffsetModel::Drift,
            rate1,
            at_host: at,
            drift,
            rtt,
            tracecmd_fastest: tc.offset,
            tsc_khz: info.tsc_khz,
            stats,
        })
    }

    /// The guaranteed width of the offset bounds, `bound_hi - bound_lo`.
    #[must_use]
    pub const fn width(&self) -> u64 {
        self.bound_hi.abs_diff(self.bound_lo)
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
    use vmtsync_core::GuestTicks;
    use vmtsync_core::sim::{Delay, GuestClock, Link, Sim};

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
    fn rate_limits_are_the_sessions() {
        // The text report spells the limits out: it must change with them.
        assert_eq!((RATE_MIN, RATE_MAX), ((1, 2), (2, 1)));
        assert_eq!(RATE_LIMITS.min(), Ratio { num: 1, den: 2 });
        assert_eq!(RATE_LIMITS.max(), Ratio { num: 2, den: 1 });
    }

    /// Probes of `clock` over `link`, `n` of them, vCPU 2.
    fn simulated(seed: u64, clock: GuestClock, link: Link, n: usize) -> Vec<ProbeSample> {
        let mut sim = Sim::new(seed, HostTicks(1 << 41), clock, link, 2);
        (0..n).map(|_| sim.probe().unwrap()).collect()
    }

    /// The exit-stamped shape: a long forward leg, the reply leaving right after the read.
    fn tight_asymmetric_link() -> Link {
        Link::tight_asymmetric()
    }

    #[test]
    fn a_guest_100_ppm_fast_stays_inside_the_guaranteed_bounds() {
        // What the built-in VMM's exit stamps showed with a +100 ppm skew: about 1000 ticks of
        // drift over the round, less than a round trip, so a constant offset still "fits",
        // but the constant-offset interval sits at the late probes' offsets and misses the
        // truth at the middle. Schema 1 reported that interval as guaranteed.
        const RUNS: u64 = 300;
        let (mut missed, mut old_w, mut new_w) = (0, Vec::new(), Vec::new());
        for seed in 0..RUNS {
            let clock = GuestClock::with_drift_ppb(5_098_309_658_643, 100_000).unwrap();
            let samples = simulated(seed, clock, tight_asymmetric_link(), 64);
            let s = ProbeSummary::from_samples(&info(), &samples, SessionStats::default())
                .unwrap_or_else(|e| panic!("seed {seed}: {e:?}"));
            assert_eq!(
                clock.offset_within(s.at_host, s.bound_lo, s.bound_hi),
                Some(true),
                "seed {seed}: {s:?}"
            );
            let (lo, hi) = s.rate1.unwrap_or_else(|| panic!("seed {seed}: {s:?}"));
            assert!(s.bound_lo <= lo && hi <= s.bound_hi, "seed {seed}: {s:?}");
            missed += u32::from(clock.offset_within(s.at_host, lo, hi) == Some(false));
            old_w.push(hi.abs_diff(lo));
            new_w.push(s.width());
        }
        old_w.sort_unstable();
        new_w.sort_unstable();
        println!(
            "+100 ppm, {RUNS} runs x 64 tight probes: the constant-offset interval missed the \
             truth in {missed}; median width constant-offset {} ticks, guaranteed {} ticks",
            old_w[old_w.len() / 2],
            new_w[new_w.len() / 2]
        );
        assert!(missed > 0, "the runs never exposed the rate-1 assumption");
    }

    proptest::proptest! {
        /// Any constant rate within ±1000 ppm, any delays, one probe or many: the guaranteed
        /// bounds contain the true offset at `at_host`, and the drift bounds the true drift.
        #[test]
        fn guaranteed_bounds_hold_for_any_drift(
            seed in 0_u64..1 << 32,
            offset in -(1_i64 << 40)..(1_i64 << 40),
            ppb in -1_000_000_i64..1_000_000,
            n in 1_usize..48,
            fwd in 0_u64..5_000,
            back in 0_u64..5_000,
            gap in 0_u64..1_000_000,
        ) {
            let link = Link {
                forward: Delay::Uniform { min: 0, max: fwd },
                backward: Delay::Uniform { min: 0, max: back },
                outlier_ppm: 0,
                outlier: Delay::Constant(0),
                gap: Delay::Uniform { min: 0, max: gap },
            };
            let clock = GuestClock::with_drift_ppb(offset, ppb).unwrap();
            let samples = simulated(seed, clock, link, n);
            let s = ProbeSummary::from_samples(&info(), &samples, SessionStats::default()).unwrap();
            proptest::prop_assert_eq!(
                clock.offset_within(s.at_host, s.bound_lo, s.bound_hi),
                Some(true),
                "{:?}", s
            );
            proptest::prop_assert!(s.bound_lo <= s.offset && s.offset <= s.bound_hi);
            if let Some(d) = s.drift {
                proptest::prop_assert_eq!(clock.drift_ppb_within(d.lo, d.hi), Some(true));
            }
        }
    }

    #[test]
    fn a_fast_drift_no_constant_offset_fits_has_no_rate1_figure() {
        // 1000 ppm fast guest: no constant offset fits over this span.
        let samples: Vec<_> = (0..40_u64)
            .map(|i| {
                let send = 10_000_000 + i * 1_000_000;
                let t = send + 50;
                ProbeSample {
                    host_send: HostTicks(send),
                    guest: GuestTicks(t + t / 1000),
                    host_recv: HostTicks(t + 50),
                    vcpu: 2,
                }
            })
            .collect();
        let s = ProbeSummary::from_samples(&info(), &samples, SessionStats::default()).unwrap();
        assert_eq!(s.model, OffsetModel::Drift);
        assert_eq!(s.rate1, None);
        let d = s.drift.unwrap();
        assert!(d.lo <= 1_000_000 && 1_000_000 <= d.hi, "{d:?}");
        let at = i64::try_from(s.at_host.0).unwrap();
        // The true offset at `at` is at/1000 (real); integer bounds containing it contain its floor.
        let truth = at / 1000;
        assert!(
            s.bound_lo <= truth && truth <= s.bound_hi,
            "{s:?} truth {truth}"
        );
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
        let (quiet, _) = text(SessionStats::default());
        assert!(!quiet.contains("rejected"), "{quiet}");
        let (loud, j) = text(SessionStats {
            ambiguous: 2,
            unknown_seq: 1,
            lost_probes: 2,
            ..SessionStats::default()
        });
        assert!(
            loud.contains("rejected: 2 ambiguous (guest stalled), 1 unknown sequence numbers"),
            "{loud}"
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
        assert!(
            anchored.contains("rejected: 3 without their exits (not anchored)"),
            "{anchored}"
        );
        assert!(
            anchored.contains("kvm:kvm_pio (kvm-pio-uart)"),
            "{anchored}"
        );
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

    #[test]
    fn no_samples_is_an_error() {
        assert_eq!(
            ProbeSummary::from_samples(&info(), &[], SessionStats::default()),
            Err(EstimateError::NoSamples)
        );
    }
}
