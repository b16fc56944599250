//! The fuzzing section: `--fuzz-long` runs `cargo xtask fuzz --long` and records its
//! `fuzz-result` lines in `target/fuzz-results.json`; otherwise the last recorded results are
//! shown with their date.

use std::fmt::Write as _;
use std::process::{Command, ExitStatus};

use anyhow::{Context, Result, bail, ensure};
use vmtsync_launch::bench::{self, FuzzRecord, FuzzResult, FuzzSchema};

use super::format::{si, sig3, thousands, verdict};
use super::{Options, Section, machine, run_capture};
use crate::root;

/// Where `--fuzz-long` records its results, relative to the workspace root.
const FUZZ_RESULTS: &str = "target/fuzz-results.json";

/// Runs `cargo xtask fuzz --long` (only the target `only` when given) and records its
/// `fuzz-result` lines with the date and the command in [`FUZZ_RESULTS`]; returns its exit
/// status (a found crash fails it, after recording).
pub(super) fn record_long_run(only: Option<&str>) -> Result<ExitStatus> {
    let path = root().join(FUZZ_RESULTS);
    let exe = std::env::current_exe().context("locating the xtask binary")?;
    let mut cmd = Command::new(exe);
    cmd.current_dir(root()).args(["fuzz", "--long"]);
    let mut command = String::from("cargo xtask fuzz --long");
    if let Some(name) = only {
        cmd.args(["--target", name]);
        command.push_str(" --target ");
        command.push_str(name);
    }
    let date = machine::utc_now();
    let (stdout, status) = run_capture(&mut cmd)?;
    let results = FuzzResult::parse_all(&stdout).map_err(anyhow::Error::msg)?;
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
    let record = FuzzRecord {
        schema: FuzzSchema,
        date,
        commit,
        command,
        success: status.success(),
        results,
    };
    std::fs::write(&path, format!("{}\n", bench::to_line(&record)))
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("bench: recorded the fuzz results in {}", path.display());
    Ok(status)
}

pub(super) fn fuzz(opts: &Options) -> Result<Section> {
    let path = root().join(FUZZ_RESULTS);
    let run_status = if opts.fuzz_long {
        Some(record_long_run(None)?)
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
    let j: FuzzRecord = serde_json::from_str(text).context("not a fuzz results file")?;
    let results = &j.results;
    let date = &j.date;
    let commit = j
        .commit
        .as_ref()
        .map_or_else(String::new, |c| format!(", commit {c}"));
    let every = j.command == "cargo xtask fuzz --long";
    let mut body = format!(
        "`{}` ({}), {} from its committed seeds:\n\n\
         | target | executions | crashes | timeouts | out-of-memory | seconds | executions/s |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
        j.command,
        if ran_now {
            format!("run by this benchmark run, {date}{commit}")
        } else {
            format!(
                "**not run by this benchmark run**: the results recorded in `{FUZZ_RESULTS}` \
                 on {date}{commit}; `cargo xtask bench --fuzz-long` (or `--record-fuzz` alone) \
                 refreshes them"
            )
        },
        if every {
            "every cargo-fuzz target"
        } else {
            "only the target named (the other targets are not in this record)"
        }
    );
    let mut min_runs = u64::MAX;
    let mut bad = 0;
    for r in results {
        min_runs = min_runs.min(r.runs);
        bad += r.crashes + r.timeouts + r.ooms;
        let _ = writeln!(
            body,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.target,
            thousands(r.runs),
            r.crashes,
            r.timeouts,
            r.ooms,
            sig3(r.seconds),
            si(r.exec_per_s).trim_end(),
        );
    }
    let long = results.iter().all(|r| r.mode == "long");
    let names: Vec<&str> = results.iter().map(|r| r.target.as_str()).collect();
    Ok(Section {
        command: j.command.clone(),
        body,
        summary: vec![[
            format!(
                "fuzzing, {}{}",
                if every {
                    format!("{} targets", results.len())
                } else {
                    format!("only {}", names.join(", "))
                },
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
    fn a_recorded_run_is_shown_with_its_date_and_judged() {
        let results = FuzzResult::parse_all(
            "fuzz-result target=a:x mode=long runs=10000000 crashes=0 timeouts=0 ooms=0 \
             seconds=180.3 exec_per_s=55471 corpus=2\n\
             fuzz-result target=a:y mode=long runs=9000000 crashes=0 timeouts=0 ooms=0 \
             seconds=10 exec_per_s=1 corpus=2\n",
        )
        .expect("parses");
        let record = FuzzRecord {
            schema: FuzzSchema,
            date: "2026-12-01 09:00 UTC".into(),
            commit: Some("abc1234".into()),
            command: "cargo xtask fuzz --long".into(),
            success: true,
            results,
        };
        let s = recorded_section(&bench::to_line(&record), false).expect("renders");
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
        // A one-target record names its target and its command, and judges that target only.
        let one = FuzzRecord {
            command: "cargo xtask fuzz --long --target x".into(),
            results: record.results[..1].to_vec(),
            ..record
        };
        let s = recorded_section(&bench::to_line(&one), true).expect("renders");
        assert_eq!(s.command, "cargo xtask fuzz --long --target x");
        assert!(s.body.contains("only the target named"), "{}", s.body);
        assert_eq!(s.summary[0][0], "fuzzing, only a:x");
        assert_eq!(s.summary[0][3], "met");
    }
}
