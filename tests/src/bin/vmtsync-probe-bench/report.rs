//! The printed table and the JSON line.
//!
//! JSON schema `vmtsync-probe-bench/1`, one object on one line:
//!
//! ```text
//! { "schema": "vmtsync-probe-bench/1", "tsc_khz": u64, "tsc_khz_source": "agent"|"cpuinfo",
//!   "sessions": K, "probes": N, "run_time_s": f64,
//!   "skew": null | {"offset": i64, "ratio": u64, "frac": u32},
//!   "wire": {"builtin": {"request": [min, max], "reply": [min, max]}, "qemu": same | null,
//!            "trace_cmd_ptp_per_probe": 72},
//!   "system_level": null | {"ours": ticks (builtin/exit-tight, our estimator),
//!                           "trace_cmd": ticks (QEMU stdio, trace-cmd's), "ratio": f64},
//!   "anchoring": null | {"baseline": "qemu-…/stdio" (in-process, today's QEMU path),
//!                        "rows": [{"name": str, "width_median": ticks|null,
//!                                  "ours_median_err": ticks|null, "width_ratio": f64|null,
//!                                  "err_ratio": f64|null (both over the baseline's)}],
//!                        "probes_to_2x": {row name: median probes|null}},
//!   "rows": [{ "name": str, "sessions": K, "probes": N,
//!              "ours_median_err": ticks|null, "ours_max_err": ticks|null,
//!              "tc_median_err": ticks, "tc_max_err": ticks, "ratio": f64|null,
//!              "drift_ratio": f64|null (drift estimator's median |error| over trace-cmd's),
//!              "goal_met": bool (ratio, or drift_ratio when the truth drifts, <= 0.25),
//!              "ours_not_worse": count,
//!              "width_median": ticks|null, "width_max": ticks|null,
//!              "contains": count, "segment_breaks": count,
//!              "drift_median_err": ticks|null, "drift_width_median": ticks|null,
//!              "drift_contains": count, "rtt_min": ticks, "rtt_median": ticks,
//!              "ours_median_err_ns": …, "tc_median_err_ns": …, "rtt_min_ns": …,
//!              "rtt_median_ns": …, "ours_bias_median": signed ticks|null,
//!              "ours_bias_range": [min, max]|null, "tc_bias_median": signed ticks,
//!              "tc_bias_range": [min, max], "drift_ppb_width_median": ppb|null }] }
//! ```
//!
//! Errors and widths are in host TSC ticks; `_ns` fields convert with `tsc_khz`, rounded down.

use std::fmt::Write as _;
use std::time::Duration;

use crate::stats::{Anchoring, Row, Truth};

/// trace-cmd PTP's ping-pong bytes per probe on the wire: a 36-byte PROBE message each way
/// (12-byte header + 20-byte tsync command + 4-byte payload; docs/trace-cmd.md).
const TRACE_CMD_PTP_PROBE_BYTES: usize = 72;

/// The issue's goal: our median |error| at most a quarter of trace-cmd's.
const GOAL_RATIO: f64 = 0.25;

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
            "{:<25} {:>17} {:>17} {:>6} {:>6} {:>13} {:>6} {:>17} {:>7} {:>6} {:>6} {:>21}",
            "path/bracket",
            "ours med|err|",
            "trace-cmd med|err|",
            "ratio",
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
                "{:<25} {:>17} {:>17} {:>6} {:>6} {:>13} {:>6} {:>17} {:>7} {:>6} {:>6} {:>21}",
                r.name,
                self.ticks_ns(r.ours_median_err),
                self.ticks_ns(Some(r.tc_median_err)),
                ratio,
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
        let _ = writeln!(
            s,
            "; trace-cmd PTP {TRACE_CMD_PTP_PROBE_BYTES} B ping-pong (+24 B result slots)"
        );
        if let Some(k) = self.skew {
            let _ = writeln!(
                s,
                "skew rows: guest = {} + ((tsc * {}) >> {}); 'ours' holds there too (any \
                 constant rate within the limits; segment breaks {}): the goal is judged on \
                 the drift estimator (d.ratio)",
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
            "goal, same samples (ours <= {GOAL_RATIO} x trace-cmd): {}; run time {:.1?}",
            self.rows
                .iter()
                .map(|r| format!(
                    "{} {}",
                    r.name,
                    if r.headline_ratio().is_some_and(|x| x <= GOAL_RATIO) {
                        "met"
                    } else {
                        "not met"
                    }
                ))
                .collect::<Vec<_>>()
                .join(", "),
            self.run_time
        );
        s
    }

    /// The JSON line (schema in the module docs).
    #[must_use]
    pub fn json(&self) -> String {
        let opt = |v: Option<u64>| v.map_or_else(|| "null".into(), |x| x.to_string());
        let pair = |(a, b): (usize, usize)| format!("[{a},{b}]");
        let wire = |w: ((usize, usize), (usize, usize))| {
            format!("{{\"request\":{},\"reply\":{}}}", pair(w.0), pair(w.1))
        };
        let rows: Vec<String> = self
            .rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"name\":\"{}\",\"sessions\":{},\"probes\":{},\"ours_median_err\":{},\
                     \"ours_max_err\":{},\"tc_median_err\":{},\"tc_max_err\":{},\"ratio\":{},\
                     \"drift_ratio\":{},\"goal_met\":{},\"ours_not_worse\":{},\"width_median\":{},\"width_max\":{},\
                     \"contains\":{},\"segment_breaks\":{},\"drift_median_err\":{},\
                     \"drift_width_median\":{},\"drift_contains\":{},\"rtt_min\":{},\
                     \"rtt_median\":{},\"ours_median_err_ns\":{},\"tc_median_err_ns\":{},\
                     \"rtt_min_ns\":{},\"rtt_median_ns\":{},\"ours_bias_median\":{},\
                     \"ours_bias_range\":{},\"tc_bias_median\":{},\"tc_bias_range\":[{},{}],\
                     \"drift_ppb_width_median\":{}}}",
                    r.name,
                    r.sessions,
                    r.probes,
                    opt(r.ours_median_err),
                    opt(r.ours_max_err),
                    r.tc_median_err,
                    r.tc_max_err,
                    r.ratio.map_or_else(|| "null".into(), |x| format!("{x:.4}")),
                    r.drift_ratio
                        .map_or_else(|| "null".into(), |x| format!("{x:.4}")),
                    r.headline_ratio().is_some_and(|x| x <= GOAL_RATIO),
                    r.ours_not_worse,
                    opt(r.width_median),
                    opt(r.width_max),
                    r.contains,
                    r.segment_breaks,
                    opt(r.drift_median_err),
                    opt(r.drift_width_median),
                    r.drift_contains,
                    r.rtt_min,
                    r.rtt_median,
                    opt(r.ours_median_err.map(|t| self.ns(t))),
                    self.ns(r.tc_median_err),
                    self.ns(r.rtt_min),
                    self.ns(r.rtt_median),
                    r.ours_bias_median
                        .map_or_else(|| "null".into(), |b| b.to_string()),
                    r.ours_bias_range
                        .map_or_else(|| "null".into(), |(a, b)| format!("[{a},{b}]")),
                    r.tc_bias_median,
                    r.tc_bias_range.0,
                    r.tc_bias_range.1,
                    opt(r.drift_ppb_width_median),
                )
            })
            .collect();
        let skew = self.skew.map_or_else(
            || "null".into(),
            |k| {
                format!(
                    "{{\"offset\":{},\"ratio\":{},\"frac\":{}}}",
                    k.offset.cast_signed(),
                    k.ratio,
                    k.frac
                )
            },
        );
        let f = |x: Option<f64>| x.map_or_else(|| "null".into(), |x| format!("{x:.4}"));
        let anchoring = self.anchoring.as_ref().map_or_else(
            || "null".into(),
            |a| {
                let rows: Vec<String> = self
                    .anchoring_rows()
                    .iter()
                    .map(|(n, w, e, wr, er)| {
                        format!(
                            "{{\"name\":\"{n}\",\"width_median\":{},\"ours_median_err\":{},\
                             \"width_ratio\":{},\"err_ratio\":{}}}",
                            opt(*w),
                            opt(*e),
                            f(*wr),
                            f(*er)
                        )
                    })
                    .collect();
                let p2: Vec<String> = a
                    .probes_to_2x
                    .iter()
                    .map(|(n, k)| format!("\"{n}\":{}", opt(*k)))
                    .collect();
                format!(
                    "{{\"baseline\":\"{}\",\"rows\":[{}],\"probes_to_2x\":{{{}}}}}",
                    a.baseline,
                    rows.join(","),
                    p2.join(",")
                )
            },
        );
        format!(
            "{{\"schema\":\"vmtsync-probe-bench/1\",\"tsc_khz\":{},\"tsc_khz_source\":\"{}\",\
             \"sessions\":{},\"probes\":{},\"run_time_s\":{:.1},\"skew\":{skew},\
             \"wire\":{{\"builtin\":{},\"qemu\":{},\"trace_cmd_ptp_per_probe\":{}}},\
             \"system_level\":{},\"anchoring\":{anchoring},\"rows\":[{}]}}",
            self.tsc_khz,
            self.tsc_khz_source,
            self.sessions,
            self.probes,
            self.run_time.as_secs_f64(),
            wire(self.builtin_wire),
            self.qemu_wire.map_or_else(|| "null".into(), wire),
            TRACE_CMD_PTP_PROBE_BYTES,
            self.system_level().map_or_else(
                || "null".into(),
                |(o, t, r)| format!("{{\"ours\":{o},\"trace_cmd\":{t},\"ratio\":{r:.4}}}")
            ),
            rows.join(",")
        )
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
        assert!(t.contains("builtin/exit-tight met"), "{t}");
        assert!(r.system_level().is_none(), "no QEMU row");
        let j = r.json();
        assert!(
            j.starts_with("{\"schema\":\"vmtsync-probe-bench/1\""),
            "{j}"
        );
        assert!(
            j.contains("\"ratio\":0.2500,\"drift_ratio\":0.3750,\"goal_met\":true"),
            "{j}"
        );
        assert!(
            j.contains("\"builtin\":{\"request\":[4,4],\"reply\":[10,11]}"),
            "{j}"
        );
        assert!(j.contains("\"rtt_median_ns\":2000"), "{j}");
        assert!(
            j.contains("\"ours_bias_range\":[-2,-2],\"tc_bias_median\":8,\"tc_bias_range\":[8,8]"),
            "{j}"
        );
        assert!(j.contains("\"system_level\":null"), "{j}");
        assert_eq!(j.matches('{').count(), j.matches('}').count());
    }

    #[test]
    fn a_missed_truth_is_reported_as_unsound() {
        assert_eq!(
            report(false).unsound(),
            vec!["builtin/exit-tight".to_owned()]
        );
    }
}
