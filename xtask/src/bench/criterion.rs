//! Running one criterion bench target and reading what it measured.
//!
//! Criterion writes, per benchmark, `<CRITERION_HOME>/<directory_name>/new/benchmark.json` (its
//! id and throughput) and `sample.json` (each sample's iteration count and total time). The
//! report takes the per-iteration time of every sample and gives their minimum, median and
//! maximum: the samples are criterion's repeated runs of the same code in this run.
//! `CRITERION_HOME` points at a directory emptied before the run, so nothing from an earlier
//! run can be read back as this one's.

use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::{Stat, run_capture, shown};
use crate::cargo;

/// One criterion benchmark's result.
#[derive(Debug, Clone)]
pub(crate) struct Measured {
    /// Nanoseconds per iteration over the samples.
    pub ns: Stat,
    /// Elements per iteration, when the bench declared an element throughput.
    pub elements: Option<u64>,
    /// Samples taken.
    pub samples: usize,
}

impl Measured {
    /// Elements per second (min, median, max), when the bench declared a throughput. The
    /// fastest sample gives the highest rate.
    pub(crate) fn per_second(&self) -> Option<Stat> {
        let e = self.elements? as f64;
        Some(Stat {
            min: e / self.ns.max * 1e9,
            median: e / self.ns.median * 1e9,
            max: e / self.ns.min * 1e9,
        })
    }

    /// Nanoseconds per element (min, median, max).
    pub(crate) fn ns_per_element(&self) -> Stat {
        let e = self.elements.unwrap_or(1).max(1) as f64;
        Stat {
            min: self.ns.min / e,
            median: self.ns.median / e,
            max: self.ns.max / e,
        }
    }
}

/// The results of one bench target, by criterion's full id (`group/function[/value]`).
#[derive(Debug, Default, Clone)]
pub(crate) struct Results {
    /// Results by full id.
    pub by_id: BTreeMap<String, Measured>,
    /// What the bench printed on stdout (the proto bench prints its wire sizes there).
    pub stdout: String,
    /// The command that reproduces the run (without `CRITERION_HOME`, which only keeps this
    /// run's results apart).
    pub command: String,
}

impl Results {
    /// The result named `id`, or an error naming what the run produced instead.
    pub(crate) fn get(&self, id: &str) -> Result<&Measured> {
        self.by_id.get(id).with_context(|| {
            format!(
                "criterion produced no result `{id}` (it has: {})",
                self.by_id.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        })
    }
}

/// Runs `cargo bench --workspace --bench <bench> -- <criterion_args>` with criterion's
/// output in `home` (emptied first) and reads every result back.
///
/// `--workspace` selects the same packages and features as ci's `cargo bench --workspace
/// --no-run`, so the benches run from the binaries that step already built.
pub(crate) fn run(bench: &str, criterion_args: &[String], home: &Path) -> Result<Results> {
    if home.exists() {
        std::fs::remove_dir_all(home).with_context(|| format!("emptying {}", home.display()))?;
    }
    std::fs::create_dir_all(home)?;
    let mut cmd = cargo();
    cmd.args(["bench", "--workspace", "--bench", bench, "--"])
        .args(criterion_args)
        .env("CRITERION_HOME", home);
    let command = shown(&cmd);
    let (stdout, status) = run_capture(&mut cmd)?;
    if !status.success() {
        bail!("`{command}` failed: {status}");
    }
    let mut by_id = BTreeMap::new();
    for dir in result_dirs(home)? {
        let (id, m) = read_one(&dir).with_context(|| format!("reading {}", dir.display()))?;
        by_id.insert(id, m);
    }
    if by_id.is_empty() {
        bail!("`{command}` left no results in {}", home.display());
    }
    Ok(Results {
        by_id,
        stdout,
        command,
    })
}

/// Every `…/new` directory under `home` that holds a `sample.json`.
fn result_dirs(home: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![home.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if !path.is_dir() {
                continue;
            }
            if path.file_name().is_some_and(|n| n == "new") && path.join("sample.json").is_file() {
                out.push(path);
            } else {
                stack.push(path);
            }
        }
    }
    Ok(out)
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn read_one(dir: &Path) -> Result<(String, Measured)> {
    let info = read_json(&dir.join("benchmark.json"))?;
    let sample = read_json(&dir.join("sample.json"))?;
    let id = info["full_id"]
        .as_str()
        .context("benchmark.json has no full_id")?
        .to_owned();
    let elements = info["throughput"]["Elements"].as_u64();
    let numbers = |key: &str| -> Result<Vec<f64>> {
        sample[key]
            .as_array()
            .with_context(|| format!("sample.json has no {key}"))?
            .iter()
            .map(|v| v.as_f64().context("a sample is not a number"))
            .collect()
    };
    let (iters, times) = (numbers("iters")?, numbers("times")?);
    if iters.len() != times.len() || iters.is_empty() {
        bail!(
            "sample.json: {} iteration counts, {} times",
            iters.len(),
            times.len()
        );
    }
    let per_iter: Vec<f64> = times
        .iter()
        .zip(&iters)
        .map(|(t, n)| t / n.max(1.0))
        .collect();
    let ns = Stat::of(&per_iter).context("no samples")?;
    Ok((
        id,
        Measured {
            ns,
            elements,
            samples: per_iter.len(),
        },
    ))
}
