//! The recorder against its peer and its floors, per event on one clock in one process
//! (`vmtsync-recorder-bench`, tests/src/bin/): the C recorder (capi/), core's `Recorder` and
//! `MemRecorder`, barectf 3.1.2, and three floors.

use std::fmt::Write as _;

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

use super::format::{ratio, verdict};
use super::{Plan, run_capture, shown};
use crate::{cargo, sh};

/// The firmware work's goal for the recorders: at most this many nanoseconds above floor 2.
/// The summary shows it as the ratio to floor 2 it comes to in the run.
const FLOOR_SLACK_NS: f64 = 1.5;

/// `m` over `floor` with what it adds: `1.09× (+2.21 ns)`.
fn over_floor(m: f64, floor: f64) -> String {
    format!("{} ({:+.2} ns)", ratio(m / floor), m - floor)
}

/// Builds the bench binary with barectf generated in (installing barectf when missing), runs
/// it, and renders its table, its text and its summary rows.
pub(super) fn side_by_side(plan: &Plan) -> Result<(String, String, Vec<[String; 4]>)> {
    let barectf = vmtsync_launch::barectf::ensure_barectf()
        .context("barectf is the bench's peer: `cargo xtask setup` installs it")?;
    sh(cargo()
        .env("VMTSYNC_BARECTF", &barectf)
        .arg("build")
        .args(&plan.build_profile)
        .args(["-p", "vmtsync-tests", "--bin", "vmtsync-recorder-bench"]))?;
    let (rounds, events) = if plan.quick {
        ("5", "20000")
    } else {
        ("41", "200000")
    };
    let mut cmd = std::process::Command::new(plan.bin_dir.join("vmtsync-recorder-bench"));
    cmd.args(["--rounds", rounds, "--events", events, "--cpu", "1"]);
    let command = shown(&cmd);
    let (out, status) = run_capture(&mut cmd)?;
    ensure!(status.success(), "`{command}` failed: {status}");
    let v: Value = serde_json::from_str(out.trim()).context("the bench's JSON line")?;
    ensure!(
        v["barectf_built"] == Value::Bool(true),
        "the bench binary was built without barectf"
    );
    let ns = |key: &str| -> Result<(f64, f64)> {
        let m = v[key]["ns_median"].as_f64();
        let n = v[key]["ns_min"].as_f64();
        match (m, n) {
            (Some(m), Some(n)) => Ok((m, n)),
            _ => bail!("no {key} in the bench's output"),
        }
    };
    let rows = [
        ("`lfence; rdtsc` alone (floor 1)", "floor_tsc"),
        (
            "`lfence; rdtsc` + a plain 32-byte slot store (floor 2)",
            "floor_tsc_store",
        ),
        (
            "floor 2 + the head word: load it, slot busy, commit, store it (floor 3)",
            "floor_tsc_store_head",
        ),
        ("C recorder `vmtsync_record` (capi/, gcc -O2)", "c_recorder"),
        ("Rust `Recorder::ring(0)` + `record`", "rust_recorder"),
        (
            "Rust `MemRecorder::ring(0)` + `record`",
            "rust_mem_recorder",
        ),
        ("barectf 3.1.2 tracing function", "barectf"),
    ];
    let floor2 = ns("floor_tsc_store")?.0;
    let floor3 = ns("floor_tsc_store_head")?.0;
    let mut body = String::from(
        "| contender | ns per event (median; fastest round) | ÷ floor 2 | ÷ floor 3 | vs barectf |\n\
         |---|---:|---:|---:|---:|\n",
    );
    let bt = ns("barectf")?.0;
    for (label, key) in rows {
        let (m, n) = ns(key)?;
        let _ = writeln!(
            body,
            "| {label} | {m:.2}; {n:.2} | {} | {} | {} |",
            over_floor(m, floor2),
            over_floor(m, floor3),
            ratio(m / bt)
        );
    }
    let mhz = v["tsc_mhz"].as_f64().unwrap_or(f64::NAN);
    let _ = write!(
        body,
        "\nOne process pinned to CPU 1 ({}), {rounds} interleaved rounds of {events} events per \
         contender (the order rotates each round), medians over rounds; every event has an \
         8-byte payload and every ring is a flight ring of 4096 records, so nothing is refused \
         and nothing drains in the timed loop. Every contender reads the same clock \
         (`lfence; rdtsc`), and the same stamps time the loops (TSC at {mhz:.0} MHz, calibrated \
         against CLOCK_MONOTONIC). barectf writes CTF packets into one 128 KiB buffer that its \
         platform closes and reopens in place when full. Floor 3 is the least a ring whose \
         reader follows a head word must add to floor 2 (docs/memory-layout.md's protocol \
         without its checks): a recorder of this layout cannot go below it. The recorders' rows \
         in the summary are their medians over floor 2 and floor 3 of this same run; the \
         firmware work's goal, at most {FLOOR_SLACK_NS} ns above floor 2, is shown as the \
         ratio it comes to in this run.\n",
        if v["pinned"] == Value::Bool(true) {
            "pinned"
        } else {
            "pinning refused"
        }
    );
    let c = ns("c_recorder")?.0;
    let mut summary = vec![[
        "C recorder per event vs barectf (same clock, one process)".into(),
        "≤ barectf".into(),
        format!("{c:.2} vs {bt:.2} ns ({})", ratio(c / bt)),
        verdict(c <= bt),
    ]];
    for (name, key) in [
        ("C recorder", "c_recorder"),
        ("Rust `Recorder`", "rust_recorder"),
        ("Rust `MemRecorder`", "rust_mem_recorder"),
    ] {
        let m = ns(key)?.0;
        summary.push(floor_row(name, m, floor2, floor3));
    }
    Ok((command, body, summary))
}

/// A recorder's summary row: its median per event over floor 2 (`lfence; rdtsc` + a 32-byte
/// slot store) and over floor 3 (floor 2 + the head word), all from one run, against the
/// firmware work's goal as a ratio to this run's floor 2.
fn floor_row(name: &str, m: f64, floor2: f64, floor3: f64) -> [String; 4] {
    let limit = floor2 + FLOOR_SLACK_NS;
    [
        format!("{name} per event / floor 2 (`lfence; rdtsc` + a 32-byte slot store)"),
        // Three decimals: near the goal, two would show a miss and the goal as one number.
        format!("≤ {:.3}× (floor 2 + {FLOOR_SLACK_NS} ns)", limit / floor2),
        format!(
            "{:.3}× ({m:.2} vs {floor2:.2} ns); {:.3}× floor 3 ({floor3:.2} ns)",
            m / floor2,
            m / floor3
        ),
        verdict(m <= limit),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorder_rows_are_ratios_against_the_floors_of_the_run() {
        let row = floor_row("C recorder", 28.04, 25.83, 27.66);
        assert_eq!(
            row[0],
            "C recorder per event / floor 2 (`lfence; rdtsc` + a 32-byte slot store)"
        );
        assert_eq!(
            row[2],
            "1.086× (28.04 vs 25.83 ns); 1.014× floor 3 (27.66 ns)"
        );
        assert_eq!(row[1], "≤ 1.058× (floor 2 + 1.5 ns)");
        assert_eq!(row[3], "**not met**");
        assert_eq!(floor_row("x", 27.25, 25.83, 27.66)[3], "met");
        assert_eq!(over_floor(27.25, 27.66), "0.99× (-0.41 ns)");
    }
}
