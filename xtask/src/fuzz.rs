//! `cargo xtask fuzz [--long]`: every cargo-fuzz target of `core/fuzz` (the protocol's guest
//! side: decoder, stream receiver, agent) and `host-shim/fuzz` (the host's probe session,
//! debugfs parsing, the sync-file reader, the guest-memory reader), each started from its committed seeds
//! (`<fuzz dir>/seeds/<target>/`, generated from real encodings by
//! `cargo test -p vmtsync --test fuzz_seeds`).
//!
//! - Without flags (the `ci` step): each target runs for [`SECONDS_PER_TARGET`] seconds, built
//!   with AddressSanitizer (cargo-fuzz's default), which also checks the `unsafe` code of the
//!   dependencies (postcard, heapless, cobs, serde_json) on every input.
//! - `--long`: each target runs [`LONG_RUNS`] inputs, built without a sanitizer (into its own
//!   target directory, so the smoke build stays warm): ASan makes these targets 4-10 times
//!   slower here, and what the long run is for, panics, overflow checks (debug assertions stay
//!   on), timeouts and memory growth, needs no sanitizer.
//!
//! Inputs are capped per target ([`Target::max_len`]) near what the parser can meaningfully
//! take (a few frames, one debugfs file, a sync file of a few dozen lines), which keeps the
//! fuzzer from spending its time on ever longer inputs that exercise the same paths.
//!
//! `--target NAME` runs only the target of that name (e.g. `guestmem`).
//!
//! Both print one `fuzz-result` line per target (`key=value`: target, mode, runs, crashes,
//! timeouts, ooms, seconds, exec_per_s, corpus) for BENCHMARKS.md, and fail if any target
//! found a crash, a timeout or an out-of-memory input (libFuzzer stops at the first and leaves
//! it in `<fuzz dir>/artifacts/<target>/`).
//!
//! Only the stable toolchain exists on project machines. cargo-fuzz needs nightly-only rustc
//! flags (`-Zsanitizer=address`, sancov options); `RUSTC_BOOTSTRAP=1` lets stable accept them,
//! and stable ships the ASan runtime for x86_64-unknown-linux-gnu. cargo-fuzz itself is
//! installed once into `<root>/.cache/cargo-bin` (git-ignored), not into `~/.cargo/bin`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use vmtsync_launch::bench::FuzzResult;

use crate::{cargo, display, root, sh};

/// One cargo-fuzz target.
struct Target {
    /// The fuzz crate's directory.
    dir: &'static str,
    name: &'static str,
    /// libFuzzer's `-max_len`: the longest input tried.
    max_len: u32,
}

const TARGETS: &[Target] = &[
    // Frames are at most 149 bytes: room for several, in any chunking.
    Target {
        dir: "core/fuzz",
        name: "decode",
        max_len: 512,
    },
    Target {
        dir: "core/fuzz",
        name: "agent",
        max_len: 512,
    },
    Target {
        dir: "host-shim/fuzz",
        name: "session",
        max_len: 1024,
    },
    // The reader takes at most 64 bytes of a debugfs file.
    Target {
        dir: "host-shim/fuzz",
        name: "debugfs",
        max_len: 128,
    },
    Target {
        dir: "host-shim/fuzz",
        name: "syncfile",
        max_len: 8192,
    },
    // A VMM's memory holding a small recorder (header, rings of a few records) and the
    // guest stores made between the reader's reads.
    Target {
        dir: "host-shim/fuzz",
        name: "guestmem",
        max_len: 4096,
    },
    // A few pages of a trace.dat: the seeds are whole small files written by our writer.
    Target {
        dir: "host-shim/fuzz",
        name: "tracedat",
        max_len: 65536,
    },
];

/// The cargo-fuzz release CI installs (`--locked` pins its dependencies too), so a new
/// cargo-fuzz cannot change or break the smoke run unannounced.
const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// Seconds each target runs in CI: five targets stay under two minutes of fuzzing, and each
/// still executes hundreds of thousands of inputs here.
const SECONDS_PER_TARGET: u32 = 20;

/// Inputs each target runs with `--long`.
const LONG_RUNS: u64 = 10_000_000;

/// Seconds one input may take before libFuzzer calls it a timeout (its default is 20 minutes);
/// every target handles an input in well under a millisecond.
const TIMEOUT_PER_INPUT_S: u32 = 10;

const USAGE: &str = "usage: cargo xtask fuzz [--long] [--target NAME]";

/// `cargo xtask fuzz [--long] [--target NAME]`.
pub(crate) fn fuzz(args: &[String]) -> Result<()> {
    let mut long = false;
    let mut only = None;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--long" => long = true,
            "--target" => only = Some(it.next().context(USAGE)?.as_str()),
            other => bail!("fuzz: unknown argument `{other}`\n{USAGE}"),
        }
    }
    run(long, only)
}

/// The `ci` step: the bounded-time run.
pub(crate) fn smoke() -> Result<()> {
    run(false, None)
}

/// The targets `only` selects (every target when `None`); an unknown name is an error
/// listing the known ones.
fn selected(only: Option<&str>) -> Result<Vec<&'static Target>> {
    let picked: Vec<&Target> = TARGETS
        .iter()
        .filter(|t| only.is_none_or(|n| n == t.name))
        .collect();
    if picked.is_empty() {
        let names: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
        bail!(
            "fuzz: no target named `{}` (known: {})",
            only.unwrap_or_default(),
            names.join(", ")
        );
    }
    Ok(picked)
}

/// What one target's run found.
#[derive(Debug, Default)]
struct Outcome {
    runs: u64,
    corpus: u64,
    crashes: usize,
    timeouts: usize,
    ooms: usize,
    seconds: f64,
}

fn run(long: bool, only: Option<&str>) -> Result<()> {
    let targets = selected(only)?;
    let cargo_fuzz = install_cargo_fuzz()?;
    let mut dirs: Vec<&str> = targets.iter().map(|t| t.dir).collect();
    dirs.dedup();
    for dir in &dirs {
        // The fuzz crates are outside the workspace, so `cargo fmt --all` does not see them.
        sh(cargo()
            .args(["fmt", "--check", "--manifest-path"])
            .arg(format!("{dir}/Cargo.toml")))?;
        sh(&mut fuzz_command(&cargo_fuzz, "build", dir, long))?;
    }
    let mut lines = Vec::new();
    let mut failed = Vec::new();
    for t in targets {
        let (dir, target) = (t.dir, t.name);
        let o = run_target(&cargo_fuzz, t, long)?;
        let line = FuzzResult {
            target: format!("{dir}:{target}"),
            mode: if long { "long" } else { "smoke" }.into(),
            runs: o.runs,
            crashes: o.crashes as u64,
            timeouts: o.timeouts as u64,
            ooms: o.ooms as u64,
            seconds: o.seconds,
            exec_per_s: per_second(o.runs, o.seconds),
            corpus: o.corpus,
        }
        .line();
        println!("{line}");
        lines.push(line);
        if o.crashes + o.timeouts + o.ooms > 0 || (long && o.runs < LONG_RUNS) {
            failed.push(format!("{dir}:{target} (see {dir}/artifacts/{target}/)"));
        }
    }
    eprintln!("\nfuzz summary:");
    for line in &lines {
        eprintln!("{line}");
    }
    if !failed.is_empty() {
        bail!("fuzzing found problems in: {}", failed.join(", "));
    }
    Ok(())
}

#[allow(clippy::cast_precision_loss)] // A rate for display; counts are far below 2^52.
fn per_second(runs: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        runs as f64 / seconds
    } else {
        0.0
    }
}

/// Installs the pinned cargo-fuzz into the project cache unless it is there.
fn install_cargo_fuzz() -> Result<std::path::PathBuf> {
    let bin_root = root().join(".cache/cargo-bin");
    let cargo_fuzz = bin_root.join("bin/cargo-fuzz");
    let installed = Command::new(&cargo_fuzz)
        .arg("--version")
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout).trim() == format!("cargo-fuzz {CARGO_FUZZ_VERSION}")
        });
    if !installed {
        sh(cargo()
            .args([
                "install",
                "cargo-fuzz",
                "--version",
                CARGO_FUZZ_VERSION,
                "--locked",
                "--force",
                "--root",
            ])
            .arg(&bin_root))?;
    }
    Ok(cargo_fuzz)
}

/// `cargo fuzz <sub> --fuzz-dir <dir>` with the toolchain override; `long` builds without a
/// sanitizer into `<dir>/target/long`.
fn fuzz_command(cargo_fuzz: &Path, sub: &str, dir: &str, long: bool) -> Command {
    let mut c = Command::new(cargo_fuzz);
    c.current_dir(root()).env("RUSTC_BOOTSTRAP", "1").arg(sub);
    if long {
        c.args(["--sanitizer", "none", "--target-dir"])
            .arg(root().join(dir).join("target/long"));
    }
    c.args(["--fuzz-dir", dir]);
    c
}

/// Artifact files of `target` whose names start with `prefix` (`crash-`, `timeout-`, `oom-`).
fn artifacts(dir: &Path, prefix: &str) -> usize {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .count()
}

/// Runs one target from its seeds (into a git-ignored working corpus), echoing libFuzzer's
/// progress, and reads its final statistics.
fn run_target(cargo_fuzz: &Path, t: &Target, long: bool) -> Result<Outcome> {
    let (dir, target) = (t.dir, t.name);
    let root = root();
    let corpus = root.join(dir).join("corpus").join(target);
    let seeds = root.join(dir).join("seeds").join(target);
    let artifact_dir = root.join(dir).join("artifacts").join(target);
    std::fs::create_dir_all(&corpus).with_context(|| format!("creating {}", corpus.display()))?;
    if !seeds.is_dir() {
        bail!(
            "no seeds in {} (cargo test -p vmtsync --test fuzz_seeds)",
            seeds.display()
        );
    }
    let before = ["crash-", "timeout-", "oom-"].map(|p| artifacts(&artifact_dir, p));
    let mut cmd = fuzz_command(cargo_fuzz, "run", dir, long);
    cmd.arg(target)
        .arg(&corpus)
        .arg(&seeds)
        .arg("--")
        .arg(if long {
            format!("-runs={LONG_RUNS}")
        } else {
            format!("-max_total_time={SECONDS_PER_TARGET}")
        })
        .arg(format!("-timeout={TIMEOUT_PER_INPUT_S}"))
        .arg(format!("-max_len={}", t.max_len))
        .arg("-print_final_stats=1")
        .stderr(Stdio::piped());
    eprintln!("$ {}", display(&cmd));
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("could not start `{}`", display(&cmd)))?;
    let mut o = Outcome::default();
    if let Some(stderr) = child.stderr.take() {
        for line in BufReader::new(stderr).lines() {
            let line = line.context("reading libFuzzer's output")?;
            // Status lines come every power of two of runs: show them, without the noise of
            // every new coverage feature.
            if !line.contains("NEW_FUNC") && !line.starts_with("#") || line.contains("pulse") {
                eprintln!("{line}");
            }
            if let Some(v) = line
                .strip_prefix("stat::number_of_executed_units:")
                .and_then(|v| v.trim().parse::<u64>().ok())
            {
                o.runs = v;
            }
        }
    }
    let status = child.wait().context("waiting for cargo fuzz")?;
    o.seconds = start.elapsed().as_secs_f64();
    let after = ["crash-", "timeout-", "oom-"].map(|p| artifacts(&artifact_dir, p));
    o.crashes = after[0].saturating_sub(before[0]);
    o.timeouts = after[1].saturating_sub(before[1]);
    o.ooms = after[2].saturating_sub(before[2]);
    // Corpus size: the seeds plus what this and earlier runs added.
    o.corpus =
        u64::try_from(std::fs::read_dir(&corpus).map_or(0, |d| d.count()) + artifacts(&seeds, ""))
            .unwrap_or(u64::MAX);
    if !status.success() && o.crashes + o.timeouts + o.ooms == 0 {
        bail!("`cargo fuzz run {target}` failed ({status}) without leaving an artifact");
    }
    Ok(o)
}
