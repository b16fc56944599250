//! The benchmark binaries' result lines, defined once for the binary that prints one and for
//! every reader (`cargo xtask bench`, the tier-2 tests).
//!
//! Each benchmark prints its result ([`to_line`]) as the last JSON object on its standard
//! output, `{"schema": "...", ...}` with the schema first, so a human scanning the output sees
//! which one it is. A reader takes it back with [`last_line`], as the same type. The schemas:
//!
//! - `vmtsync-probe-bench/1` ([`ProbeBench`]): `vmtsync-probe-bench --sessions K`, our
//!   estimators against trace-cmd's on the same real-KVM samples;
//! - `vmtsync-probe-bench-record/1` ([`RecordBench`]): `vmtsync-probe-bench --record`,
//!   `vmtsync record`'s event intervals against its rounds;
//! - `vmtsync-ingest-bench/1` ([`IngestBench`]): `vmtsync-ingest-bench`, sustained event
//!   ingest over virtio-vsock;
//! - `vmtsync-fuzz-results/1` ([`FuzzRecord`]): `cargo xtask fuzz --long`'s results as `cargo
//!   xtask bench --record-fuzz` keeps them, one [`FuzzResult`] per target (which `cargo xtask
//!   fuzz` prints as a `fuzz-result key=value …` line).
//!
//! Errors and widths are in host TSC ticks unless a field's name ends in `_ns`. `Default` is
//! there for tests that build a line by hand.

use std::collections::BTreeMap;

use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The line as printed: one JSON object, its `schema` first (each type's first field).
#[must_use]
pub fn to_line(result: &impl Serialize) -> String {
    // Plain data (numbers, strings, options, maps with string keys) always serializes.
    serde_json::to_string(result).expect("a bench line serializes")
}

/// The last line of `stdout` that is a `T` (its schema included), skipping other output
/// (tables, per-row JSON objects, progress). `None` when there is none.
#[must_use]
pub fn last_line<T: DeserializeOwned>(stdout: &str) -> Option<T> {
    stdout
        .lines()
        .rev()
        .filter(|l| l.starts_with("{\"schema\":"))
        .find_map(|l| serde_json::from_str(l).ok())
}

/// A result type's `schema` field: serializes as the schema's name and accepts only that.
///
/// A field of its own rather than `#[serde(tag = "schema")]` on an enum: serde's internally
/// tagged enums buffer numbers in a way that fails under serde_json's `arbitrary_precision`,
/// which a dependency of the test crate (defmt-decoder) turns on for every crate in the build.
macro_rules! schema {
    ($(#[$doc:meta])* $name:ident = $value:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
        pub struct $name;

        impl $name {
            /// The schema's name.
            pub const NAME: &str = $value;
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str($value)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let name = String::deserialize(d)?;
                if name == $value {
                    Ok(Self)
                } else {
                    Err(D::Error::custom(format!(
                        "schema {name:?}, expected {:?}",
                        $value
                    )))
                }
            }
        }
    };
}

schema!(
    /// `vmtsync-probe-bench/1`.
    ProbeSchema = "vmtsync-probe-bench/1"
);
schema!(
    /// `vmtsync-probe-bench-record/1`.
    RecordSchema = "vmtsync-probe-bench-record/1"
);
schema!(
    /// `vmtsync-ingest-bench/1`.
    IngestSchema = "vmtsync-ingest-bench/1"
);
schema!(
    /// `vmtsync-fuzz-results/1`.
    FuzzSchema = "vmtsync-fuzz-results/1"
);

/// `vmtsync-probe-bench --sessions K`: every path and bracket, our estimators against
/// trace-cmd's on the same samples, the truth from KVM's debugfs (and the software skew).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ProbeBench {
    /// `vmtsync-probe-bench/1`.
    pub schema: ProbeSchema,
    /// The TSC frequency the `_ns` fields convert with.
    pub tsc_khz: u64,
    /// Where that frequency came from: `agent` or `cpuinfo`.
    pub tsc_khz_source: String,
    /// Sessions per path.
    pub sessions: u64,
    /// Probes per session.
    pub probes: u64,
    /// Wall time of the whole run, build included.
    pub run_time_s: f64,
    /// The software skew the `skew/…` rows ran with.
    pub skew: Option<Skew>,
    /// Bytes on the wire per probe, counted on the wire.
    pub wire: Wire,
    /// Our estimator on our tightest path against trace-cmd's on an external tool's path.
    pub system_level: Option<SystemLevel>,
    /// The QEMU UART brackets compared on the same probes, when QEMU ran.
    pub anchoring: Option<Anchoring>,
    /// One row per path and bracket.
    pub rows: Vec<ProbeRow>,
}

/// The agent's software skew: `guest = offset + ((tsc * ratio) >> frac)`, wrapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skew {
    /// Added after scaling (as the signed value it stands for).
    pub offset: i64,
    /// Fixed-point rate.
    pub ratio: u64,
    /// Fractional bits of `ratio`.
    pub frac: u32,
}

/// Bytes per probe on each transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Wire {
    /// The built-in VMM.
    pub builtin: WireSizes,
    /// QEMU stdio, when it ran.
    pub qemu: Option<WireSizes>,
    /// virtio-vsock, when it ran.
    pub vsock: Option<WireSizes>,
    /// trace-cmd PTP's ping-pong bytes per probe (docs/trace-cmd.md).
    pub trace_cmd_ptp_per_probe: u64,
}

/// One transport's probe sizes, `[min, max]` bytes each way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct WireSizes {
    /// Request bytes.
    pub request: [u64; 2],
    /// Reply bytes.
    pub reply: [u64; 2],
}

/// The system-level comparison: where the host stamps, not the estimator.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SystemLevel {
    /// Our median |error| on `builtin/exit-tight`.
    pub ours: u64,
    /// trace-cmd's median |error| on QEMU stdio.
    pub trace_cmd: u64,
    /// `ours / trace_cmd`.
    pub ratio: f64,
}

/// The QEMU UART path bracketed several ways on the same probes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Anchoring {
    /// The in-process row every other is compared with (`qemu-…/stdio`).
    pub baseline: String,
    /// One row per QEMU and vsock bracket.
    pub rows: Vec<AnchoringRow>,
    /// Per row name: the median over sessions of the fewest leading probes whose interval is
    /// within twice the whole session's width.
    pub probes_to_2x: BTreeMap<String, Option<u64>>,
}

/// One bracket against the baseline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AnchoringRow {
    /// Path and bracket.
    pub name: String,
    /// Median interval width.
    pub width_median: Option<u64>,
    /// Our median |error|.
    pub ours_median_err: Option<u64>,
    /// Width over the baseline's.
    pub width_ratio: Option<f64>,
    /// Error over the baseline's.
    pub err_ratio: Option<f64>,
}

/// One path and bracket of the probe benchmark.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ProbeRow {
    /// Path and bracket, e.g. `builtin/exit-tight`, `skew/…`, `vsock/64`.
    pub name: String,
    /// Sessions on this path.
    pub sessions: u64,
    /// Probes per session.
    pub probes: u64,
    /// Our constant-offset estimator's median |error|.
    pub ours_median_err: Option<u64>,
    /// Its maximum.
    pub ours_max_err: Option<u64>,
    /// trace-cmd fastest-RTT's median |error|.
    pub tc_median_err: u64,
    /// Its maximum.
    pub tc_max_err: u64,
    /// `ours_median_err / tc_median_err`.
    pub ratio: Option<f64>,
    /// The drift estimator's median |error| over trace-cmd's.
    pub drift_ratio: Option<f64>,
    /// `ratio` (or `drift_ratio` when the truth drifts) at most 0.25: the retired goal (issue
    /// 27), kept so schema-1 lines keep their shape; BENCHMARKS.md no longer reads it.
    pub goal_met: bool,
    /// Sessions where ours was no worse than trace-cmd's.
    pub ours_not_worse: u64,
    /// Median guaranteed interval width.
    pub width_median: Option<u64>,
    /// Widest guaranteed interval.
    pub width_max: Option<u64>,
    /// Sessions whose interval contained the truth.
    pub contains: u64,
    /// Segment breaks, summed over sessions.
    pub segment_breaks: u64,
    /// The drift estimator's median |error|.
    pub drift_median_err: Option<u64>,
    /// Its median offset-interval width.
    pub drift_width_median: Option<u64>,
    /// Sessions whose drift bounds contained the truth.
    pub drift_contains: u64,
    /// The fastest bracket.
    pub rtt_min: u64,
    /// The median bracket.
    pub rtt_median: u64,
    /// `ours_median_err` in ns.
    pub ours_median_err_ns: Option<u64>,
    /// `tc_median_err` in ns.
    pub tc_median_err_ns: u64,
    /// `rtt_min` in ns.
    pub rtt_min_ns: u64,
    /// `rtt_median` in ns.
    pub rtt_median_ns: u64,
    /// Our signed error, median over sessions.
    pub ours_bias_median: Option<i64>,
    /// Its `[min, max]`.
    pub ours_bias_range: Option<[i64; 2]>,
    /// trace-cmd's signed error, median.
    pub tc_bias_median: i64,
    /// Its `[min, max]`.
    pub tc_bias_range: [i64; 2],
    /// The drift estimator's rate interval, median width in ppb.
    pub drift_ppb_width_median: Option<u64>,
    /// trace-cmd's histogram estimator's median |error|.
    pub hist_median_err: u64,
    /// Its signed error, median.
    pub hist_bias_median: i64,
    /// Ours over the histogram's median |error|.
    pub hist_ratio: Option<f64>,
    /// Our point estimate inside the guaranteed bounds
    /// (`DriftEstimator::central_offset_at_within`), median |error|.
    pub central_median_err: Option<u64>,
    /// That over trace-cmd fastest-RTT's.
    pub central_ratio: Option<f64>,
    /// The constant-offset interval's centre, median |error|.
    pub rate1_median_err: Option<u64>,
    /// Each session's smallest one-way delays from the truth, `[forward, backward]`, medians
    /// over sessions.
    pub min_delay_median: Option<[i64; 2]>,
    /// The same over all probes.
    pub delay_median: Option<[i64; 2]>,
    /// The fastest probe's `(forward - backward) / 2`, median over sessions.
    pub fastest_asymmetry_median: Option<i64>,
}

/// `vmtsync-probe-bench --record`: one VM per agent boot configuration and placement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct RecordBench {
    /// `vmtsync-probe-bench-record/1`.
    pub schema: RecordSchema,
    /// One row per configuration, in the table's order.
    pub rows: Vec<RecordRow>,
}

/// One configuration's events against its rounds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordRow {
    /// Boot and placement.
    pub name: String,
    /// The anchor kinds the sync file's rounds carry.
    pub anchors: Vec<String>,
    /// Rounds (segments in the sync file).
    pub rounds: u64,
    /// Events recorded.
    pub events: u64,
    /// Events whose `host_lo..host_hi` contained the truth.
    pub inside: u64,
    /// Median round width (the segment's guaranteed offset interval).
    pub round_width_median: Option<u64>,
    /// Widest round.
    pub round_width_max: u64,
    /// Median event interval width.
    pub event_width_median: Option<u64>,
    /// Widest event interval.
    pub event_width_max: u64,
    /// Median |`host_tsc` − truth|.
    pub err_median: Option<u64>,
}

/// `vmtsync-ingest-bench`: events drained from the real agent over virtio-vsock.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IngestBench {
    /// `vmtsync-ingest-bench/1`.
    pub schema: IngestSchema,
    /// `drain-only` (back-to-back drains, no output file) or `record` (`vmtsync record`).
    pub mode: String,
    /// Events asked for per drain.
    pub drain_max: u32,
    /// The workload's events per second.
    pub rate: u64,
    /// How long the host drained.
    pub seconds: f64,
    /// Events that arrived (and, with `record`, were written).
    pub events: u64,
    /// `events / seconds`.
    pub events_per_s: f64,
    /// Events the agent's ring refused.
    pub dropped: u64,
    /// The agent's own count (its shutdown line).
    pub sent: Option<u64>,
    /// Everything the host read, probe replies included.
    pub bytes: u64,
    /// `bytes / events`: an upper bound of the event batches' cost.
    pub bytes_per_event: f64,
    /// vsock packets the agent sent (its shutdown line).
    pub packets: Option<u64>,
    /// Drains (`drain-only`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drains: Option<u64>,
    /// Events over the time spent inside drains (`drain-only`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_events_per_s: Option<f64>,
    /// The pause before each drain, ms (`drain-only`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fill_ms: Option<u64>,
}

/// `cargo xtask fuzz --long`'s results, recorded with the date for a later `cargo xtask bench`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FuzzRecord {
    /// `vmtsync-fuzz-results/1`.
    pub schema: FuzzSchema,
    /// When the run started (UTC).
    pub date: String,
    /// The commit it ran on, when known.
    pub commit: Option<String>,
    /// The command that ran.
    pub command: String,
    /// Whether it exited successfully (no crash, every target's runs reached).
    pub success: bool,
    /// One per target.
    pub results: Vec<FuzzResult>,
}

/// One fuzz target's run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FuzzResult {
    /// `crate-dir:target`.
    pub target: String,
    /// `smoke` or `long`.
    pub mode: String,
    /// Inputs executed.
    pub runs: u64,
    /// Crashes found.
    pub crashes: u64,
    /// Timeouts found.
    pub timeouts: u64,
    /// Out-of-memory inputs found.
    pub ooms: u64,
    /// Wall time.
    pub seconds: f64,
    /// `runs / seconds`.
    pub exec_per_s: f64,
    /// Corpus entries at the end.
    pub corpus: u64,
}

impl FuzzResult {
    /// The line `cargo xtask fuzz` prints: `fuzz-result target=… mode=… runs=… …`.
    #[must_use]
    pub fn line(&self) -> String {
        format!(
            "fuzz-result target={} mode={} runs={} crashes={} timeouts={} ooms={} \
             seconds={:.1} exec_per_s={:.0} corpus={}",
            self.target,
            self.mode,
            self.runs,
            self.crashes,
            self.timeouts,
            self.ooms,
            self.seconds,
            self.exec_per_s,
            self.corpus
        )
    }

    /// Every [`FuzzResult::line`] in `stdout`, skipping other output; a line that does not
    /// parse is an error naming it.
    ///
    /// # Errors
    /// A `fuzz-result` line with a missing or malformed field.
    pub fn parse_all(stdout: &str) -> Result<Vec<Self>, String> {
        stdout
            .lines()
            .filter_map(|l| l.strip_prefix("fuzz-result "))
            .map(|l| Self::parse(l).ok_or_else(|| format!("bad fuzz-result line: {l}")))
            .collect()
    }

    fn parse(fields: &str) -> Option<Self> {
        let kv: BTreeMap<&str, &str> = fields
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .collect();
        let num = |k: &str| kv.get(k)?.parse::<u64>().ok();
        let float = |k: &str| kv.get(k)?.parse::<f64>().ok();
        Some(Self {
            target: (*kv.get("target")?).to_owned(),
            mode: (*kv.get("mode")?).to_owned(),
            runs: num("runs")?,
            crashes: num("crashes")?,
            timeouts: num("timeouts")?,
            ooms: num("ooms")?,
            seconds: float("seconds")?,
            exec_per_s: float("exec_per_s")?,
            corpus: num("corpus")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ingest() -> IngestBench {
        IngestBench {
            schema: IngestSchema,
            mode: "record".into(),
            drain_max: 4096,
            rate: 1_000_000,
            seconds: 3.0,
            events: 900,
            events_per_s: 300.0,
            dropped: 7,
            sent: Some(900),
            bytes: 1300,
            bytes_per_event: 13.0,
            packets: None,
            drains: None,
            link_events_per_s: None,
            fill_ms: None,
        }
    }

    #[test]
    fn a_line_names_its_schema_first_and_reads_back() {
        let line = to_line(&ingest());
        assert!(
            line.starts_with("{\"schema\":\"vmtsync-ingest-bench/1\",\"mode\":\"record\""),
            "{line}"
        );
        assert!(!line.contains("drains"), "absent drain-only fields: {line}");
        let out = format!("table\n{line}\n{{\"name\":\"a row\"}}\ndone\n");
        assert_eq!(last_line::<IngestBench>(&out), Some(ingest()));
    }

    #[test]
    fn no_line_or_another_schema_is_none() {
        assert_eq!(last_line::<IngestBench>("table only\n"), None);
        let probe = to_line(&ProbeBench::default());
        assert!(last_line::<ProbeBench>(&probe).is_some());
        assert_eq!(last_line::<IngestBench>(&probe), None, "another schema");
        assert_eq!(last_line::<RecordBench>(&probe), None, "another schema");
    }

    #[test]
    fn a_fuzz_result_line_reads_back() {
        let r = FuzzResult {
            target: "core/fuzz:decode".into(),
            mode: "long".into(),
            runs: 10_000_000,
            crashes: 0,
            timeouts: 1,
            ooms: 0,
            seconds: 81.5,
            exec_per_s: 122_699.0,
            corpus: 310,
        };
        let out = format!("noise\n{}\n", r.line());
        assert_eq!(FuzzResult::parse_all(&out), Ok(vec![r]));
        assert!(FuzzResult::parse_all("fuzz-result target=x runs=1\n").is_err());
    }
}
