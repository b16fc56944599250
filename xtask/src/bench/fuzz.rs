//! The fuzzing section: `--fuzz-long` runs `cargo xtask fuzz --long` and records its
//! `fuzz-result` lines in `target/fuzz-results.json`; otherwise the last recorded results are
//! shown with their date.

use std::fmt::Write as _;
use std::process::{Command, ExitStatus};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

use super::format::{si, sig3, thousands, verdict};
use super::{Options, Section, machine, run_capture};
use crate::root;

/// Where `--fuzz-long` records its results, relative to the workspace root.
const FUZZ_RESULTS: &str = "target/fuzz-results.json";

/// The `fuzz-result key=value …` lines `cargo xtask fuzz` prints, as JSON objects.
pub(super) fn fuzz_lines(stdout: &str) -> Vec<Value> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("fuzz-result "))
        .map(|l| {
            let mut o = serde_json::Map::new();
            for (k, v) in l.split_whitespace().filter_map(|w| w.split_once('=')) {
                let v = v
                    .parse::<u64>()
                    .map(Value::from)
                    .or_else(|_| v.parse::<f64>().map(Value::from))
                    .unwrap_or_else(|_| Value::from(v));
                o.insert(k.to_owned(), v);
            }
            Value::Object(o)
        })
        .collect()
}

/// Runs `cargo xtask fuzz --long` and records its `fuzz-result` lines with the date in
/// [`FUZZ_RESULTS`]; returns its exit status (a found crash fails it, after recording).
pub(super) fn record_long_run() -> Result<ExitStatus> {
    let path = root().join(FUZZ_RESULTS);
    let exe = std::env::current_exe().context("locating the xtask binary")?;
    let mut cmd = Command::new(exe);
    cmd.current_dir(root()).args(["fuzz", "--long"]);
    let date = machine::utc_now();
    let (stdout, status) = run_capture(&mut cmd)?;
    let results = fuzz_lines(&stdout);
    ensure!(
        !results.is_empty(),
        "`cargo xtask fuzz --long` printed no `fuzz-result` lines ({status})"
    );
    let commit = Command::new("git")
        .current_dir(root())
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    let record = json!({
        "schema": "vmtsync-fuzz-results/1",
        "date": date,
        "commit": commit,
        "command": "cargo xtask fuzz --long",
        "success": status.success(),
        "results": results,
    });
    std::fs::write(&path, format!("{record}\n"))
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("bench: recorded the fuzz results in {}", path.display());
    Ok(status)
}

pub(super) fn fuzz(opts: &Options) -> Result<Section> {
    let path = root().join(FUZZ_RESULTS);
    let run_status = if opts.fuzz_long {
        Some(record_long_run()?)
    } else {
        None
    };
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(Section {
            command: "cargo xtask fuzz --long".into(),
            body: format!(
                "No `cargo xtask fuzz --long` results are recorded on this machine \
                 (`{FUZZ_RESULTS}` is missing): `cargo xtask bench --fuzz-long` runs it (it \
                 takes a while) and records them, or `cargo xtask bench --record-fuzz` alone."
            ),
            summary: vec![[
                "fuzzing, every target".into(),
                "≥ 10 M executions, 0 crashes, 0 timeouts".into(),
                "no recorded --long run".into(),
                "not measured".into(),
            ]],
        });
    };
    let section = recorded_section(&text, opts.fuzz_long)
        .with_context(|| format!("reading {}", path.display()))?;
    if let Some(status) = run_status
        && !status.success()
    {
        bail!(
            "`cargo xtask fuzz --long` failed ({status}):\n\n{}",
            section.body
        );
    }
    Ok(section)
}

/// The section for a recorded fuzz run (`ran_now`: by this benchmark run).
fn recorded_section(text: &str, ran_now: bool) -> Result<Section> {
    let j: Value = serde_json::from_str(text).context("not a fuzz results file")?;
    let results = j["results"].as_array().context("no results")?;
    let date = j["date"].as_str().unwrap_or("an unknown date");
    let commit = j["commit"]
        .as_str()
        .map_or_else(String::new, |c| format!(", commit {c}"));
    let mut body = format!(
        "`cargo xtask fuzz --long` ({}), every cargo-fuzz target from its committed seeds:\n\n\
         | target | executions | crashes | timeouts | out-of-memory | seconds | executions/s |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
        if ran_now {
            format!("run by this benchmark run, {date}{commit}")
        } else {
            format!(
                "**not run by this benchmark run**: the results recorded in `{FUZZ_RESULTS}` \
                 on {date}{commit}; `cargo xtask bench --fuzz-long` (or `--record-fuzz` alone) \
                 refreshes them"
            )
        }
    );
    let mut min_runs = u64::MAX;
    let mut bad = 0;
    for r in results {
        let n = |k: &str| r[k].as_u64().unwrap_or(0);
        min_runs = min_runs.min(n("runs"));
        bad += n("crashes") + n("timeouts") + n("ooms");
        let _ = writeln!(
            body,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r["target"].as_str().unwrap_or("?"),
            thousands(n("runs")),
            n("crashes"),
            n("timeouts"),
            n("ooms"),
            r["seconds"].as_f64().map_or_else(|| "?".into(), sig3),
            r["exec_per_s"]
                .as_f64()
                .map_or_else(|| "?".into(), |x| si(x).trim_end().to_owned()),
        );
    }
    let long = results.iter().all(|r| r["mode"].as_str() == Some("long"));
    Ok(Section {
        command: "cargo xtask fuzz --long".into(),
        body,
        summary: vec![[
            format!(
                "fuzzing, {} targets{}",
                results.len(),
                if ran_now {
                    String::new()
                } else {
                    format!(" (recorded {date})")
                }
            ),
            "≥ 10 M executions each, 0 crashes, 0 timeouts".into(),
            format!(
                "≥ {} executions each, {bad} crashes/timeouts/OOMs",
                thousands(if min_runs == u64::MAX { 0 } else { min_runs })
            ),
            verdict(long && min_runs >= 10_000_000 && bad == 0),
        ]],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_lines_become_json() {
        let v = fuzz_lines(
            "noise\nfuzz-result target=core/fuzz:decode mode=long runs=10000000 crashes=0 \
             timeouts=0 ooms=0 seconds=81.5 exec_per_s=122699 corpus=310\n",
        );
        assert_eq!(v.len(), 1);
        assert_eq!(v[0]["target"], "core/fuzz:decode");
        assert_eq!(v[0]["runs"], 10_000_000);
        assert_eq!(v[0]["seconds"], 81.5);
    }

    #[test]
    fn a_recorded_run_is_shown_with_its_date_and_judged() {
        let results = fuzz_lines(
            "fuzz-result target=a:x mode=long runs=10000000 crashes=0 timeouts=0 ooms=0 \
             seconds=180.3 exec_per_s=55471 corpus=2\n\
             fuzz-result target=a:y mode=long runs=9000000 crashes=0 timeouts=0 ooms=0 \
             seconds=10 exec_per_s=1 corpus=2\n",
        );
        let record = json!({"date": "2026-12-01 09:00 UTC", "commit": "abc1234",
            "results": results});
        let s = recorded_section(&record.to_string(), false).expect("renders");
        assert!(
            s.body.contains("2026-12-01 09:00 UTC, commit abc1234"),
            "{}",
            s.body
        );
        assert!(
            s.body.contains("| a:x | 10,000,000 | 0 | 0 | 0 | 180 |"),
            "{}",
            s.body
        );
        assert!(
            s.body.contains("not run by this benchmark run"),
            "{}",
            s.body
        );
        assert_eq!(
            s.summary[0][3], "**not met**",
            "one target ran fewer than 10 M inputs"
        );
        assert!(recorded_section("{}", true).is_err());
    }
}
