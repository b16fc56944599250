//! `vmtsync record`'s events against its rounds, per boot configuration of the agent: runs
//! `vmtsync-probe-bench --record` ([`bench::RecordBench`], schema `vmtsync-probe-bench-record/1`) and renders one table
//! from that one run.

use std::fmt::Write as _;
use std::process::Command;

use anyhow::{Context, Result, bail};
use vmtsync_launch::bench::{self, RecordBench};

use super::format::{ratio, thousands, verdict};
use super::{Plan, Section, rel, run_capture};

/// Issue 18's bars: the median event interval at most 1.25× the median round's, the widest at
/// most 3× the widest round's, in hundredths.
const MEDIAN_BAR_X100: u64 = 125;
const WIDEST_BAR_X100: u64 = 300;

/// One configuration's figures, in host TSC ticks: the result line's row with every median
/// present (a configuration without rounds or events is a failed run, not a row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RecordRow {
    name: String,
    anchors: String,
    rounds: u64,
    events: u64,
    inside: u64,
    round_median: u64,
    round_max: u64,
    event_median: u64,
    event_max: u64,
    err_median: u64,
}

impl RecordRow {
    fn from_bench(r: &bench::RecordRow) -> Result<Self> {
        let some =
            |v: Option<u64>, k: &str| v.with_context(|| format!("row `{}` without a {k}", r.name));
        Ok(Self {
            name: r.name.clone(),
            anchors: r.anchors.join(", "),
            rounds: r.rounds,
            events: r.events,
            inside: r.inside,
            round_median: some(r.round_width_median, "median round")?,
            round_max: r.round_width_max,
            event_median: some(r.event_width_median, "median event")?,
            event_max: r.event_width_max,
            err_median: some(r.err_median, "median error")?,
        })
    }

    /// `event / round` in hundredths (rounded up, so a bar is never met by rounding).
    fn x100(event: u64, round: u64) -> u64 {
        u64::try_from((u128::from(event) * 100).div_ceil(u128::from(round.max(1))))
            .unwrap_or(u64::MAX)
    }
}

pub(super) fn record(plan: &Plan) -> Result<Section> {
    let bin = plan.bin_dir.join("vmtsync-probe-bench");
    let mut cmd = Command::new(&bin);
    cmd.arg("--record");
    let (stdout, status) = run_capture(&mut cmd)?;
    let Some(j) = bench::last_line::<RecordBench>(&stdout) else {
        bail!("`{}` printed no record bench line ({status})", rel(&bin));
    };
    let rows = j
        .rows
        .iter()
        .map(RecordRow::from_bench)
        .collect::<Result<Vec<_>>>()?;
    let mut section = record_section(&rows);
    section.command = format!("{} --record", rel(&bin));
    if !status.success() {
        bail!(
            "the record bench exited with {status} (3: an event's interval missed the \
             truth):\n\n{}",
            section.body
        );
    }
    Ok(section)
}

pub(super) fn record_section(rows: &[RecordRow]) -> Section {
    let mut body = String::from(
        "The bundled agent under QEMU microvm, its TSC 100 ppm fast (a software skew derived \
         from the host TSC), emitting 400 events a second while `vmtsync record --format jsonl \
         --anchor kvm-pio --vm PID --resync 500 [--placement one-sided]` records 2,000 of \
         them; one VM per row, all in this run. Rows: the agent's boot before issue 18 \
         (`ring=3 syncport=off`: its loop in ring 3, rounds on the UART's bytes) and its \
         default boot now (sync port `0x2400` on, loop in ring 0), each with `record`'s earlier \
         one-sided placement (the round before an event) and its default two-sided one (the \
         rounds before and after, docs/record.md). A round's width is its segment's \
         guaranteed offset interval (the sync file), an event's its `host_lo..host_hi`; \
         |error| is `host_tsc` against the truth (KVM debugfs composed with the skew). Host \
         TSC ticks.\n\n\
         | boot / placement | rounds anchored by | rounds | events | round width median / \
         max | event width median / max | median event / round | widest event / round | \
         median \\|error\\| | truth inside |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let _ = writeln!(
            body,
            "| {} | {} | {} | {} | {} / {} | {} / {} | {} | {} | {} | {}/{} |",
            r.name,
            r.anchors,
            r.rounds,
            thousands(r.events),
            thousands(r.round_median),
            thousands(r.round_max),
            thousands(r.event_median),
            thousands(r.event_max),
            x100(RecordRow::x100(r.event_median, r.round_median)),
            x100(RecordRow::x100(r.event_max, r.round_max)),
            thousands(r.err_median),
            r.inside,
            r.events,
        );
    }
    let mut summary = Vec::new();
    if let Some(last) = rows.last() {
        let (m, w) = (
            RecordRow::x100(last.event_median, last.round_median),
            RecordRow::x100(last.event_max, last.round_max),
        );
        summary.push([
            "events as tight as their rounds (default boot, `record`'s placement)".into(),
            "median ≤ 1.25×, widest ≤ 3× the round's; truth inside every event".into(),
            format!(
                "median {}, widest {}; {}/{} inside",
                x100(m),
                x100(w),
                last.inside,
                last.events
            ),
            verdict(m <= MEDIAN_BAR_X100 && w <= WIDEST_BAR_X100 && last.inside == last.events),
        ]);
    }
    Section {
        command: String::new(),
        body,
        summary,
    }
}

/// A ratio given in hundredths, as `1.23×`.
fn x100(v: u64) -> String {
    #[allow(clippy::cast_precision_loss)] // Ratios of tick counts: far below 2^52.
    ratio(v as f64 / 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, round: (u64, u64), event: (u64, u64), inside: u64) -> bench::RecordRow {
        bench::RecordRow {
            name: name.into(),
            anchors: vec!["kvm-pio-sync-port".into()],
            rounds: 10,
            events: 2000,
            inside,
            round_width_median: Some(round.0),
            round_width_max: round.1,
            event_width_median: Some(event.0),
            event_width_max: event.1,
            err_median: Some(170),
        }
    }

    #[test]
    fn renders_each_row_and_judges_the_last() {
        let rows: Vec<RecordRow> = [
            row("old", (105_000, 110_000), (406_000, 828_000), 2000),
            row("new", (12_000, 14_000), (13_000, 30_000), 2000),
        ]
        .iter()
        .map(|v| RecordRow::from_bench(v).expect("complete"))
        .collect();
        let s = record_section(&rows);
        assert!(
            s.body.contains(
                "| new | kvm-pio-sync-port | 10 | 2,000 | 12,000 / 14,000 | 13,000 / 30,000 | \
                 1.09× | 2.15× | 170 | 2000/2000 |"
            ),
            "{}",
            s.body
        );
        assert!(s.body.contains("| 3.87× | 7.53× |"), "{}", s.body);
        assert_eq!(s.summary[0][3], "met");
        let bad = RecordRow::from_bench(&row("new", (10, 10), (10, 31), 2000)).unwrap();
        assert_eq!(record_section(&[bad]).summary[0][3], "**not met**");
        let outside = RecordRow::from_bench(&row("new", (10, 10), (10, 10), 1999)).unwrap();
        assert_eq!(record_section(&[outside]).summary[0][3], "**not met**");
        let empty = bench::RecordRow {
            event_width_median: None,
            ..row("x", (1, 1), (1, 1), 0)
        };
        assert!(RecordRow::from_bench(&empty).is_err());
    }
}
