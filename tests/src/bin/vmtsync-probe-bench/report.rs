//! The printed table and the JSON line.
//!
//! The JSON line is a [`vmtsync_launch::bench::ProbeBench`] (schema `vmtsync-probe-bench/1`),
//! the type `cargo xtask bench` reads it back with. Errors and widths are in host TSC ticks;
//! `_ns` fields convert with `tsc_khz`, rounded down.

use std::fmt::Write as _;
use std::time::Duration;

use vmtsync_launch::bench::{
    self, AnchoringRow, ProbeBench, ProbeRow, ProbeSchema, Skew, SystemLevel, Wire, WireSizes,
};

use crate::stats::{Anchoring, Row, Truth};

/// trace-cmd PTP's ping-pong bytes per probe on the wire: a 36-byte PROBE message each way
/// (12-byte header + 20-byte tsync command + 4-byte payload; docs/trace-cmd.md).
const TRACE_CMD_PTP_PROBE_BYTES: usize = 72;

/// The retired goal (issue 27): our median |error| at most a quarter of trace-cmd's. Kept only
/// for the result line's `goal_met` field; no report judges it any more, since a constant path
/// asymmetry bounds every two-way estimator alike.
const RETIRED_GOAL_RATIO: f64 = 0.25;

/// One QEMU row against the in-process baseline: name, width median, our median |error|,
/// width ratio, error ratio.
type AnchorRow = (String, Option<u64>, Option<u64>, Option<f64>, Option<f64>);

/// Everything one benchmark run measured.
#[derive(Debug, Clone)]
pub struct Report {
    /// TSC frequency used for the ns columns.
    pub tsc_khz: u64,
    /// Where it came from.
    pub tsc_khz_source: &'static str,
    /// Sessions per path.
    pub sessions: usize,
    /// Probes per session.
    pub probes: usize,
    /// The skew the skew rows ran with.
    pub skew: Option<Truth>,
    /// Built-in VMM bytes per probe: `((request min, max), (reply min, max))`.
    pub builtin_wire: ((usize, usize), (usize, usize)),
    /// The same over QEMU stdio, when it ran.
    pub qemu_wire: Option<((usize, usize), (usize, usize))>,
    /// The same over virtio-vsock, when it ran.
    pub vsock_wire: Option<((usize, usize), (usize, usize))>,
    /// One row per path and bracket.
    pub rows: Vec<Row>,
    /// The QEMU UART brackets compared, when QEMU ran.
    pub anchoring: Option<Anchoring>,
    /// Wall time of the whole run (build included).
    pub run_time: Duration,
}

impl Report {
    /// Ticks to ns, rounded down.
    fn ns(&self, ticks: u64) -> u64 {
        let ns = u128::from(ticks) * 1_000_000 / u128::from(self.tsc_khz.max(1));
        u64::try_from(ns).unwrap_or(u64::MAX)
    }

    fn ticks_ns(&self, ticks: Option<u64>) -> String {
        ticks.map_or_else(|| "-".into(), |t| format!("{t} ({} ns)", self.ns(t)))
    }

    /// Rows whose guaranteed bounds missed the truth in some session: ours (what `vmtsync
    /// probe` reports, valid for any constant rate within its limits) and the drift bounds
    /// must always hold, on identity and skew rows alike.
    #[must_use]
    pub fn unsound(&self) -> Vec<String> {
        self.rows
            .iter()
            .filter(|r| r.contains != r.sessions || r.drift_contains != r.sessions)
            .map(|r| r.name.clone())
            .collect()
    }

    /// The system-level comparison: our estimator on our tightest path (the VMM's exit
    /// stamps) against trace-cmd's estimator on the path an external tool has (QEMU stdio):
    /// `(ours ticks, trace-cmd ticks, ratio)`. The gain here comes from the bracket, not the
    /// estimator; the per-row ratios isolate the estimator.
    #[must_use]
    pub fn system_level(&self) -> Option<(u64, u64, f64)> {
        let ours = self
            .rows
            .iter()
            .find(|r| r.name == "builtin/exit-tight")?
            .ours_median_err?;
        let tc = self
            .rows
            .iter()
            .find(|r| r.name.starts_with("qemu-") && r.name.ends_with("/stdio"))?
            .tc_median_err;
        #[allow(clippy::cast_precision_loss)] // A displayed ratio of tick counts far below 2^52.
        let ratio = ours as f64 / tc.max(1) as f64;
        Some((ours, tc, ratio))
    }

    /// The QEMU rows against the in-process baseline, per QEMU row.
    #[allow(clippy::cast_precision_loss)] // Displayed ratios of tick counts far below 2^52.
    fn anchoring_rows(&self) -> Vec<AnchorRow> {
        let Some(a) = &self.anchoring else {
            return Vec::new();
        };
        let Some(base) = self.rows.iter().find(|r| r.name == a.baseline) else {
            return Vec::new();
        };
        let prefix = a.baseline.split('/').next().unwrap_or_default();
        let ratio = |x: Option<u64>, b: Option<u64>| match (x, b) {
            (Some(x), Some(b)) if b > 0 => Some(x as f64 / b as f64),
            _ => None,
        };
        self.rows
            .iter()
            .filter(|r| r.name.starts_with(prefix) || r.name.starts_with("vsock/"))
            .map(|r| {
                (
                    r.name.clone(),
                    r.width_median,
                    r.ours_median_err,
                    ratio(r.width_median, base.width_median),
                    ratio(r.ours_median_err, base.ours_median_err),
                )
            })
            .collect()
    }

    /// The human-readable table.
    #[must_use]
    pub fn table(&self) -> String {
        let opt = |v: Option<u64>| v.map_or_else(|| "-".into(), |x| x.to_string());
        let mut s = String::new();
        let _ = writeln!(
            s,
            "probe benchmark: {} sessions x {} compact probes per path; TSC {} kHz ({}); \
             errors in TSC ticks (ns)",
            self.sessions, self.probes, self.tsc_khz, self.tsc_khz_source
        );
        let _ = writeln!(
            s,
            "{:<25} {:>17} {:>17} {:>6} {:>17} {:>6} {:>13} {:>6} {:>17} {:>7} {:>6} {:>6} {:>21}",
            "path/bracket",
            "ours med|err|",
            "trace-cmd med|err|",
            "ratio",
            "tc-histogram|err|",
            "ours<=",
            "width med/max",
            "truth",
            "drift med|err|",
            "d.ratio",
            "d.wid",
            "d.in",
            "bracket min/med (ns)"
        );
        for r in &self.rows {
            let ratio = r.ratio.map_or_else(|| "-".into(), |x| format!("{x:.3}"));
            let width = match (r.width_median, r.width_max) {
                (Some(m), Some(x)) => format!("{m}/{x}"),
                _ => "-".into(),
            };
            let _ = writeln!(
                s,
                "{:<25} {:>17} {:>17} {:>6} {:>17} {:>6} {:>13} {:>6} {:>17} {:>7} {:>6} {:>6} {:>21}",
                r.name,
                self.ticks_ns(r.ours_median_err),
                self.ticks_ns(Some(r.tc_median_err)),
                ratio,
                self.ticks_ns(Some(r.hist_median_err)),
                format!("{}/{}", r.ours_not_worse, r.sessions),
                width,
                format!("{}/{}", r.contains, r.sessions),
                self.ticks_ns(r.drift_median_err),
                r.drift_ratio
                    .map_or_else(|| "-".into(), |x| format!("{x:.3}")),
                r.drift_width_median
                    .map_or_else(|| "-".into(), |w| w.to_string()),
                format!("{}/{}", r.drift_contains, r.sessions),
                format!(
                    "{}/{} ({}/{})",
                    r.rtt_min,
                    r.rtt_median,
                    self.ns(r.rtt_min),
                    self.ns(r.rtt_median)
                ),
            );
        }
        let _ = writeln!(
            s,
            "signed error median [min..max] ours | trace-cmd (ticks; one sign = path asymmetry): {}",
            self.rows
                .iter()
                .map(|r| format!(
                    "{} {} | {} [{}..{}]",
                    r.name,
                    match (r.ours_bias_median, r.ours_bias_range) {
                        (Some(m), Some((lo, hi))) => format!("{m} [{lo}..{hi}]"),
                        _ => "-".into(),
                    },
                    r.tc_bias_median,
                    r.tc_bias_range.0,
                    r.tc_bias_range.1
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let _ = writeln!(
            s,
            "one-way delays from the truth, ticks: session minima forward/backward (medians), \
             all probes forward/backward (medians), fastest probe (fwd-back)/2; constant-offset \
             centre med|err|; ours central-rate point med|err| (ratio to fastest-RTT): {}",
            self.rows
                .iter()
                .map(|r| {
                    let p = |x: Option<(i64, i64)>| {
                        x.map_or_else(|| "-".into(), |(a, b)| format!("{a}/{b}"))
                    };
                    format!(
                        "{} {} | {} | {} | {} | {} ({})",
                        r.name,
                        p(r.min_delay_median),
                        p(r.delay_median),
                        r.fastest_asymmetry_median
                            .map_or_else(|| "-".into(), |x| x.to_string()),
                        opt(r.rate1_median_err),
                        opt(r.central_median_err),
                        r.central_ratio
                            .map_or_else(|| "-".into(), |x| format!("{x:.3}")),
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        );
        let _ = writeln!(
            s,
            "drift estimator rate interval, median width (ppb): {}",
            self.rows
                .iter()
                .map(|r| format!("{} {}", r.name, opt(r.drift_ppb_width_median)))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let wire = |w: ((usize, usize), (usize, usize))| {
            let one = |(a, b): (usize, usize)| {
                if a == b {
                    a.to_string()
                } else {
                    format!("{a}..{b}")
                }
            };
            format!("{} B request + {} B reply", one(w.0), one(w.1))
        };
        let _ = write!(s, "wire per probe: built-in {}", wire(self.builtin_wire));
        if let Some(q) = self.qemu_wire {
            let _ = write!(s, "; QEMU {}", wire(q));
        }
        if let Some(v) = self.vsock_wire {
            let _ = write!(s, "; vsock {}", wire(v));
        }
        let _ = writeln!(
            s,
            "; trace-cmd PTP {TRACE_CMD_PTP_PROBE_BYTES} B ping-pong (+24 B result slots)"
        );
        if let Some(k) = self.skew {
            let _ = writeln!(
                s,
                "skew rows: guest = {} + ((tsc * {}) >> {}); 'ours' holds there too (any \
                 constant rate within the limits; segment breaks {}): their ratio is the drift \
                 estimator's (d.ratio)",
                k.offset.cast_signed(),
                k.ratio,
                k.frac,
                self.rows
                    .iter()
                    .filter(|r| r.drifting)
                    .map(|r| format!("{}/{}", r.segment_breaks, r.sessions))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        if let Some(a) = &self.anchoring {
            let f = |x: Option<f64>| x.map_or_else(|| "-".into(), |x| format!("{x:.4}"));
            let _ = writeln!(
                s,
                "QEMU UART brackets on the same probes (ratio to {}): {}",
                a.baseline,
                self.anchoring_rows()
                    .iter()
                    .map(|(n, w, e, wr, er)| format!(
                        "{n} width {} err {} (x{} / x{})",
                        self.ticks_ns(*w),
                        self.ticks_ns(*e),
                        f(*wr),
                        f(*er)
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            let _ = writeln!(
                s,
                "probes for an interval within 2x of the session's (median): {}",
                a.probes_to_2x
                    .iter()
                    .map(|(n, k)| format!(
                        "{n} {}",
                        k.map_or_else(|| "-".into(), |k| k.to_string())
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        if let Some((ours, tc, ratio)) = self.system_level() {
            let _ = writeln!(
                s,
                "system level (bracket + estimator): ours on builtin/exit-tight {ours} ({} ns) vs \
                 trace-cmd on the external-tool path (QEMU stdio) {tc} ({} ns): ratio {ratio:.4}",
                self.ns(ours),
                self.ns(tc)
            );
        }
        let _ = writeln!(
            s,
            "ours / trace-cmd median |error|, same samples (a figure: a constant path \
             asymmetry bounds both alike): {}; run time {:.1?}",
            self.rows
                .iter()
                .map(|r| format!(
                    "{} {}",
                    r.name,
                    r.headline_ratio()
                        .map_or_else(|| "-".into(), |x| format!("{x:.3}"))
                ))
                .collect::<Vec<_>>()
                .join(", "),
            self.run_time
        );
        s
    }

    /// The result line, typed ([`vmtsync_launch::bench::ProbeBench`]).
    #[must_use]
    pub fn bench(&self) -> ProbeBench {
        let n = |x: usize| x as u64;
        let sizes = |w: ((usize, usize), (usize, usize))| WireSizes {
            request: [n(w.0.0), n(w.0.1)],
            reply: [n(w.1.0), n(w.1.1)],
        };
        let pair = |(a, b): (i64, i64)| [a, b];
        let rows = self
            .rows
            .iter()
            .map(|r| ProbeRow {
                name: r.name.clone(),
                sessions: n(r.sessions),
                probes: n(r.probes),
                ours_median_err: r.ours_median_err,
                ours_max_err: r.ours_max_err,
                tc_median_err: r.tc_median_err,
                tc_max_err: r.tc_max_err,
                ratio: r.ratio,
                drift_ratio: r.drift_ratio,
                goal_met: r.headline_ratio().is_some_and(|x| x <= RETIRED_GOAL_RATIO),
                ours_not_worse: n(r.ours_not_worse),
                width_median: r.width_median,
                width_max: r.width_max,
                contains: n(r.contains),
                segment_breaks: n(r.segment_breaks),
                drift_median_err: r.drift_median_err,
                drift_width_median: r.drift_width_median,
                drift_contains: n(r.drift_contains),
                rtt_min: r.rtt_min,
                rtt_median: r.rtt_median,
                ours_median_err_ns: r.ours_median_err.map(|t| self.ns(t)),
                tc_median_err_ns: self.ns(r.tc_median_err),
                rtt_min_ns: self.ns(r.rtt_min),
                rtt_median_ns: self.ns(r.rtt_median),
                ours_bias_median: r.ours_bias_median,
                ours_bias_range: r.ours_bias_range.map(pair),
                tc_bias_median: r.tc_bias_median,
                tc_bias_range: pair(r.tc_bias_range),
                drift_ppb_width_median: r.drift_ppb_width_median,
                hist_median_err: r.hist_median_err,
                hist_bias_median: r.hist_bias_median,
                hist_ratio: r.hist_ratio(),
                central_median_err: r.central_median_err,
                central_ratio: r.central_ratio,
                rate1_median_err: r.rate1_median_err,
                min_delay_median: r.min_delay_median.map(pair),
                delay_median: r.delay_median.map(pair),
                fastest_asymmetry_median: r.fastest_asymmetry_median,
            })
            .collect();
        let anchoring = self.anchoring.as_ref().map(|a| bench::Anchoring {
            baseline: a.baseline.clone(),
            rows: self
                .anchoring_rows()
                .into_iter()
                .map(
                    |(name, width_median, ours_median_err, width_ratio, err_ratio)| AnchoringRow {
                        name,
                        width_median,
                        ours_median_err,
                        width_ratio,
                        err_ratio,
                    },
                )
                .collect(),
            probes_to_2x: a.probes_to_2x.iter().cloned().collect(),
        });
        ProbeBench {
            schema: ProbeSchema,
            tsc_khz: self.tsc_khz,
            tsc_khz_source: self.tsc_khz_source.to_owned(),
            sessions: n(self.sessions),
            probes: n(self.probes),
            run_time_s: self.run_time.as_secs_f64(),
            skew: self.skew.map(|k| Skew {
                offset: k.offset.cast_signed(),
                ratio: k.ratio,
                frac: k.frac,
            }),
            wire: Wire {
                builtin: sizes(self.builtin_wire),
                qemu: self.qemu_wire.map(sizes),
                vsock: self.vsock_wire.map(sizes),
                trace_cmd_ptp_per_probe: n(TRACE_CMD_PTP_PROBE_BYTES),
            },
            system_level: self
                .system_level()
                .map(|(ours, trace_cmd, ratio)| SystemLevel {
                    ours,
                    trace_cmd,
                    ratio,
                }),
            anchoring,
            rows,
        }
    }

    /// The JSON line (schema `vmtsync-probe-bench/1`, [`vmtsync_launch::bench`]).
    #[must_use]
    pub fn json(&self) -> String {
        bench::to_line(&self.bench())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::SessionEval;

    fn report(contains: bool) -> Report {
        let e = SessionEval {
            ours_err: Some(2),
            ours_width: Some(10),
            ours_contains: contains,
            drift_err: Some(3),
            drift_width: Some(12),
            drift_contains: true,
            tc_err: 8,
            ours_bias: Some(-2),
            tc_bias: 8,
            hist_bias: -5,
            central_bias: Some(-1),
            rate1_bias: Some(1),
            delays: vec![(1_000, 1_600), (2_000, 3_200)],
            drift_ppb_width: Some(100),
            rtts: vec![2_600, 5_200],
        };
        Report {
            tsc_khz: 2_600_000,
            tsc_khz_source: "agent",
            sessions: 1,
            probes: 2,
            skew: None,
            builtin_wire: ((4, 4), (10, 11)),
            qemu_wire: None,
            vsock_wire: None,
            rows: vec![Row::aggregate(
                "builtin/exit-tight",
                2,
                Truth::IDENTITY,
                &[e],
            )],
            anchoring: None,
            run_time: Duration::from_secs(1),
        }
    }

    #[test]
    fn table_and_json_carry_the_figures() {
        let r = report(true);
        assert!(r.unsound().is_empty());
        let t = r.table();
        assert!(t.contains("builtin/exit-tight"), "{t}");
        assert!(t.contains("2600/5200 (1000/2000)"), "{t}");
        assert!(t.contains("4 B request + 10..11 B reply"), "{t}");
        assert!(t.contains("builtin/exit-tight 0.250"), "{t}");
        assert!(r.system_level().is_none(), "no QEMU row");
        let j = r.json();
        let Some(b) = bench::last_line::<ProbeBench>(&j) else {
            panic!("not a probe bench line: {j}");
        };
        assert_eq!(b, r.bench(), "reads back as it was written");
        let row = &b.rows[0];
        assert_eq!((row.ratio, row.drift_ratio), (Some(0.25), Some(0.375)));
        assert!(row.goal_met);
        assert_eq!(
            b.wire.builtin,
            WireSizes {
                request: [4, 4],
                reply: [10, 11]
            }
        );
        assert_eq!(row.rtt_median_ns, 2000);
        assert_eq!(
            (row.ours_bias_range, row.tc_bias_median, row.tc_bias_range),
            (Some([-2, -2]), 8, [8, 8])
        );
        assert_eq!(b.system_level, None);
    }

    #[test]
    fn a_missed_truth_is_reported_as_unsound() {
        assert_eq!(
            report(false).unsound(),
            vec!["builtin/exit-tight".to_owned()]
        );
    }
}
