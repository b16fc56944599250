//! `cargo xtask bench [--quick] [--fuzz-long] [--sessions K] [--out PATH]`: runs every
//! benchmark once and writes BENCHMARKS.md from that run.
//!
//! The file is `bench/template.md` with each `{{key}}` replaced by what this run measured:
//! the machine (from /proc and CPUID, with the load average at the start and the end), one
//! section per benchmark with the command that reproduces it, min / median / max over the
//! repeated measurements of the run (criterion's samples, or repeated runs of a binary), the
//! side-by-side ratios, and a summary of every goal. No number in the file comes from anywhere
//! else, so a figure cannot outlive the code it measured.
//!
//! The benchmarks:
//! - criterion benches `timeline`, `proto`, `estimate`, `recorder` (vmtsync-core) and
//!   `tracedat`, `ctf`, `perfetto`, `kvm_scan` (vmtsync), run through `cargo bench --workspace
//!   --bench NAME`;
//! - bytes per event on the wire: a full `EventBatch` of payload-less events 2600 ticks
//!   apart, encoded by `vmtsync_core::proto::encode_frame` here;
//! - max RSS of `examples/tracedat_write`, `examples/ctf_write` and `examples/perfetto_write`
//!   at 1 M and 10 M events under `/usr/bin/time -v`;
//! - `examples/attach_time`: `trace-cmd attach` on two ~100 MB guest traces of different event
//!   counts (in the trace.dat section);
//! - `bench-scan`'s separate-process `vmtsync kvm --json` over a generated debugfs tree;
//! - the real-KVM probe benchmark (`vmtsync-probe-bench --sessions K`, its JSON line);
//! - `vmtsync record`'s event and round widths per agent boot (`vmtsync-probe-bench --record`);
//! - the memory reader on a live C guest (`vmtsync record --from-memory`: the ceiling into
//!   trace.dat, Perfetto and CTF, a raw copy of the same bytes with `pread` and with
//!   `process_vm_readv` and the drain's round costs through `examples/mem_copy`, the output's
//!   write alone (the trace.dat's bytes into a fresh file), peak RSS at
//!   ~1 M and ~10 M events, 1 M events/s into a 64 Ki ring, its CPU per million events, the
//!   scan of a 4 GiB guest's memory through `examples/mem_scan`);
//! - SeaBIOS's time to its first boot attempt, stock and with its POST phases recorded;
//! - the agent's `.text` size (`build-agent`);
//! - fuzzing: `--fuzz-long` runs `cargo xtask fuzz --long` and records its `fuzz-result`
//!   lines in `target/fuzz-results.json`; without it the last recorded results are shown with
//!   their date (`--record-fuzz` runs and records only the fuzzing, writing no BENCHMARKS.md;
//!   with `--fuzz-target NAME` only that target, and the section then names it).
//!
//! `--only SECTION` runs one section (e.g. `memory`) and writes it alone to
//! `target/bench-only-SECTION.md`, leaving BENCHMARKS.md alone: for iterating on it.
//!
//! `--quick` is the smoke run `ci` makes: criterion's quick mode, tiny sizes, the binaries ci's
//! test step already built (dev profile), and the output in `target/BENCHMARKS.quick.md`
//! unless `--out` says otherwise. A benchmark that fails leaves its section saying so and
//! makes the command fail after the file is written.

mod criterion;
mod ctf;
mod firmware;
mod format;
mod fuzz;
mod ingest;
mod machine;
mod memory;
mod peers;
mod perfetto;
mod probe;
mod record;
mod sections;
mod writer;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use crate::{cargo, display, root};
use criterion::Results;
use format::thousands;
use machine::Machine;

/// The template every BENCHMARKS.md is rendered from.
const TEMPLATE: &str = include_str!("bench/template.md");

/// trace-cmd's PTP plugin: 32,778 bytes on the wire for its 339 probes (its `PTP_SYNC_LOOP`),
/// in tenths of a byte per probe.
const TRACE_CMD_PTP_BYTES_PER_PROBE_X10: u64 = 967;

/// Min, median and max of repeated measurements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Stat {
    /// The smallest value.
    pub min: f64,
    /// The median (the mean of the two middle values for an even count).
    pub median: f64,
    /// The largest value.
    pub max: f64,
}

impl Stat {
    /// The statistics of `values`, `None` when empty.
    pub(crate) fn of(values: &[f64]) -> Option<Self> {
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = match n {
            0 => return None,
            _ if !n.is_multiple_of(2) => v[n / 2],
            _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        };
        Some(Self {
            min: v[0],
            median,
            max: v[n - 1],
        })
    }

    /// `min / **median** / max`, each through `f`.
    fn show(&self, f: impl Fn(f64) -> String) -> String {
        format!("{} / **{}** / {}", f(self.min), f(self.median), f(self.max))
    }
}

/// Command-line options.
#[derive(Debug, Clone)]
struct Options {
    quick: bool,
    fuzz_long: bool,
    record_fuzz: bool,
    /// `--fuzz-target NAME`: `--record-fuzz` runs only this fuzz target.
    fuzz_target: Option<String>,
    /// `--only NAME`: run only this section and write it alone to
    /// `target/bench-only-NAME.md` (BENCHMARKS.md is left alone).
    only: Option<String>,
    sessions: Option<usize>,
    out: Option<PathBuf>,
}

const USAGE: &str = "usage: cargo xtask bench [--quick] [--fuzz-long] [--sessions K] [--out PATH] \
                     [--only SECTION]";

impl Options {
    fn parse(args: &[String]) -> Result<Self> {
        let mut o = Self {
            quick: false,
            fuzz_long: false,
            record_fuzz: false,
            fuzz_target: None,
            only: None,
            sessions: None,
            out: None,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            match flag.as_str() {
                "--quick" => o.quick = true,
                "--fuzz-long" => o.fuzz_long = true,
                "--record-fuzz" => o.record_fuzz = true,
                "--fuzz-target" => o.fuzz_target = Some(it.next().context(USAGE)?.clone()),
                "--only" => o.only = Some(it.next().context(USAGE)?.clone()),
                "--sessions" => {
                    let k = it.next().context(USAGE)?;
                    o.sessions = Some(k.parse().with_context(|| format!("--sessions {k}"))?);
                }
                "--out" => o.out = Some(PathBuf::from(it.next().context(USAGE)?)),
                other => bail!("bench: unknown argument `{other}`\n{USAGE}"),
            }
        }
        ensure!(o.sessions != Some(0), "--sessions must be at least 1");
        ensure!(
            o.fuzz_target.is_none() || o.record_fuzz,
            "--fuzz-target only goes with --record-fuzz"
        );
        Ok(o)
    }
}

/// The sizes of one run.
#[derive(Debug, Clone)]
struct Plan {
    /// `--quick`: the smoke run's sizes.
    quick: bool,
    /// Arguments after `--` for every criterion bench.
    criterion_args: Vec<String>,
    /// Probe-bench sessions per path.
    sessions: usize,
    /// bench-scan: VMs, vCPUs, timed runs.
    scan: (u32, u32, usize),
    /// tracedat_write: the small and the large event count, and runs of each.
    rss: (u64, u64, usize),
    /// attach_time: the guest trace's size in MB, and runs per file.
    attach: (u64, usize),
    /// `cargo build` arguments selecting the profile of the binaries this run executes, and
    /// the directory they land in.
    build_profile: Vec<&'static str>,
    bin_dir: PathBuf,
}

impl Plan {
    fn new(o: &Options) -> Self {
        let strings = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect();
        if o.quick {
            Self {
                quick: true,
                criterion_args: strings(&[
                    "--quick",
                    "--measurement-time",
                    "0.3",
                    "--nresamples",
                    "1000",
                    "--noplot",
                ]),
                sessions: o.sessions.unwrap_or(2),
                scan: (100, 4, 3),
                rss: (20_000, 200_000, 1),
                attach: (4, 1),
                // ci's test step built these already (`cargo test --workspace --all-features`).
                build_profile: vec!["--workspace", "--all-features"],
                bin_dir: root().join("target/debug"),
            }
        } else {
            Self {
                quick: false,
                criterion_args: strings(&[
                    "--warm-up-time",
                    "1",
                    "--measurement-time",
                    "3",
                    "--noplot",
                ]),
                // About 0.5 s per session and path here (three paths): 100 sessions keep
                // the probe bench near two and a half minutes.
                sessions: o.sessions.unwrap_or(100),
                scan: (1000, 4, 31),
                rss: (1_000_000, 10_000_000, 7),
                attach: (100, 5),
                // The profile and features of `cargo bench --workspace`, so these binaries
                // share every dependency the criterion benches were built with.
                build_profile: vec!["--profile", "bench", "--workspace"],
                bin_dir: root().join("target/release"),
            }
        }
    }
}

/// One section's rendered text.
#[derive(Debug, Default)]
struct Section {
    /// The command that reproduces it (for `{{<key>_command}}`).
    command: String,
    /// The Markdown body.
    body: String,
    /// Summary rows: claim, goal, measured, verdict.
    summary: Vec<[String; 4]>,
}

/// `cargo xtask bench …`.
pub(crate) fn bench(args: &[String]) -> Result<()> {
    let opts = Options::parse(args)?;
    if opts.record_fuzz {
        // Only the long fuzz run, recorded for the next `bench` (which shows it with its date).
        let status = fuzz::record_long_run(opts.fuzz_target.as_deref())?;
        ensure!(
            status.success(),
            "`cargo xtask fuzz --long` failed: {status}"
        );
        return Ok(());
    }
    let plan = Plan::new(&opts);
    let out = opts.out.clone().unwrap_or_else(|| {
        root().join(if opts.quick {
            "target/BENCHMARKS.quick.md"
        } else {
            "BENCHMARKS.md"
        })
    });
    let started = Instant::now();
    let machine = Machine::now();
    let work = root().join("target/bench-run");
    std::fs::create_dir_all(&work)?;

    build_binaries(&plan)?;

    let mut failed = Vec::new();
    let mut sections: Vec<(&'static str, Section)> = Vec::new();
    type Step<'a> = (&'static str, Box<dyn Fn() -> Result<Section> + 'a>);
    let steps: Vec<Step<'_>> = vec![
        ("timeline", Box::new(|| sections::timeline(&plan, &work))),
        ("proto", Box::new(|| sections::proto(&plan, &work))),
        ("estimate", Box::new(|| sections::estimate(&plan, &work))),
        ("recorder", Box::new(|| sections::recorder(&plan, &work))),
        ("tracedat", Box::new(|| sections::tracedat(&plan, &work))),
        ("ctf", Box::new(|| ctf::ctf(&plan, &work))),
        ("perfetto", Box::new(|| perfetto::perfetto(&plan, &work))),
        ("scan", Box::new(|| sections::scan(&plan, &work))),
        ("probe", Box::new(|| probe::probe(&plan))),
        ("record", Box::new(|| record::record(&plan))),
        ("ingest", Box::new(|| ingest::ingest(&plan))),
        ("memory", Box::new(|| memory::memory(&plan, &work))),
        ("firmware", Box::new(|| firmware::firmware(&plan, &work))),
        ("fuzz", Box::new(|| fuzz::fuzz(&opts))),
        ("agent", Box::new(sections::agent_size)),
    ];
    if let Some(only) = &opts.only {
        ensure!(
            steps.iter().any(|(name, _)| name == only),
            "--only {only}: no such section (one of: {})",
            steps.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
        );
    }
    for (name, step) in &steps {
        if opts.only.as_ref().is_some_and(|o| o != name) {
            continue;
        }
        let t = Instant::now();
        eprintln!("\n==> bench: {name}");
        let section = step().unwrap_or_else(|e| {
            eprintln!("==> bench: {name} FAILED: {e:#}");
            failed.push(*name);
            Section {
                command: "(not run)".into(),
                body: format!("**Not measured in this run:** {e:#}"),
                summary: Vec::new(),
            }
        });
        eprintln!("==> bench: {name} done ({:.1?})", t.elapsed());
        sections.push((name, section));
    }

    if let Some(only) = &opts.only {
        return write_only(only, &sections, &failed, &machine, started.elapsed());
    }
    let mut keys: BTreeMap<String, String> = BTreeMap::new();
    let mut command = String::from("cargo xtask bench");
    for a in args {
        command.push(' ');
        command.push_str(a);
    }
    keys.insert("command".into(), command);
    keys.insert("date".into(), machine.date.clone());
    keys.insert(
        "machine".into(),
        machine_text(&machine, started.elapsed(), opts.quick),
    );
    let mut summary = String::from("| claim | goal | measured | verdict |\n|---|---|---|---|\n");
    for (name, s) in &sections {
        keys.insert(format!("{name}_command"), s.command.clone());
        keys.insert((*name).to_owned(), s.body.trim_end().to_owned());
        for row in &s.summary {
            let _ = writeln!(summary, "| {} |", row.join(" | "));
        }
    }
    for name in &failed {
        let _ = writeln!(
            summary,
            "| {name} | — | not measured in this run | **failed** |"
        );
    }
    keys.insert("summary".into(), summary.trim_end().to_owned());
    keys.insert("not_covered".into(), NOT_COVERED.trim_end().to_owned());

    let text = render(TEMPLATE, &keys)?;
    let tmp = out.with_extension("md.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &out).with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "\nbench: wrote {} ({:.0?})",
        out.display(),
        started.elapsed()
    );
    if !failed.is_empty() {
        bail!(
            "{} of {} benchmarks failed: {}",
            failed.len(),
            steps.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

/// `--only NAME`: the one section's body and summary rows, with the machine, written to
/// `target/bench-only-NAME.md` for iterating on it; BENCHMARKS.md is not touched.
fn write_only(
    only: &str,
    sections: &[(&'static str, Section)],
    failed: &[&str],
    machine: &Machine,
    took: Duration,
) -> Result<()> {
    let path = root().join(format!("target/bench-only-{only}.md"));
    let mut text = format!(
        "# `cargo xtask bench --only {only}` (not BENCHMARKS.md)\n\n{}\n\n",
        machine_text(machine, took, false)
    );
    for (name, s) in sections {
        let _ = write!(
            text,
            "## {name}\n\n`{}`\n\n{}\n\n| claim | goal | measured | verdict |\n|---|---|---|---|\n",
            s.command,
            s.body.trim_end()
        );
        for row in &s.summary {
            let _ = writeln!(text, "| {} |", row.join(" | "));
        }
    }
    std::fs::write(&path, &text).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("\nbench: wrote {}", path.display());
    ensure!(failed.is_empty(), "{only} failed");
    Ok(())
}

/// What no benchmark of this run measures (static prose: it holds no figures).
const NOT_COVERED: &str = "\
- Sustained event ingest over the UART has no benchmark yet (vsock: section 8).
- The estimators' accuracy on simulation is asserted by tests, not timed here:
  `cargo test -p vmtsync-core --all-features estimate_ -- --nocapture` prints it.
- Probe round-trip times over virtio-vsock: `cargo run --release -p vmtsync-tests --bin
  vmtsync-vsock -- ELF --machine microvm|q35 --probes 200` (needs vhost-device-vsock).
";

/// Replaces every `{{key}}` of `template`; fails on a placeholder without a value or a value
/// without a placeholder, so the template and the generator cannot drift apart silently.
fn render(template: &str, keys: &BTreeMap<String, String>) -> Result<String> {
    let mut out = String::with_capacity(template.len() * 4);
    let mut rest = template;
    let mut used = std::collections::BTreeSet::new();
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find("}}").context("template: unclosed {{")?;
        let key = &after[..end];
        let value = keys
            .get(key)
            .with_context(|| format!("template: no value for {{{{{key}}}}}"))?;
        out.push_str(value);
        used.insert(key.to_owned());
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    let unused: Vec<&String> = keys.keys().filter(|k| !used.contains(*k)).collect();
    ensure!(unused.is_empty(), "template: unused values {unused:?}");
    Ok(out)
}

fn machine_text(m: &Machine, took: Duration, quick: bool) -> String {
    let tsc = m.tsc_khz.map_or_else(
        || "not reported by CPUID or /proc/cpuinfo".into(),
        |(khz, src)| format!("{} kHz ({src})", thousands(khz)),
    );
    let cpuinfo = match (&m.tsc_khz, &m.cpuinfo_mhz) {
        (Some((_, src)), Some(mhz)) if !src.contains("cpuinfo") => {
            format!("; /proc/cpuinfo `cpu MHz` {mhz}")
        }
        _ => String::new(),
    };
    let mut s = format!(
        "**Machine:** {} logical CPUs, {}{}; TSC {tsc}{cpuinfo}; Linux {}. Load average \
         (1/5/15 min) {} at the start, {} at the end; the run took {:.0} s.",
        m.cores,
        m.cpu,
        if m.hypervisor {
            " (a virtual machine: the CPU flags say `hypervisor`)"
        } else {
            ""
        },
        m.kernel,
        m.load,
        machine::load_average(),
        took.as_secs_f64()
    );
    if quick {
        s.push_str(
            "\n\n**This is a `--quick` smoke run**: criterion's quick mode (two samples per \
             benchmark), tiny sizes and unoptimised binaries. Its numbers only show that every \
             benchmark runs; do not quote them.",
        );
    }
    s
}

/// Builds the binaries the run executes (the probe bench, the CLI for the scan, the
/// trace.dat writer), in the plan's profile.
fn build_binaries(plan: &Plan) -> Result<()> {
    crate::sh(cargo().arg("build").args(&plan.build_profile).args([
        "--bin",
        "vmtsync",
        "--bin",
        "vmtsync-probe-bench",
        "--bin",
        "vmtsync-ingest-bench",
        "--example",
        "tracedat_write",
        "--example",
        "ctf_write",
        "--example",
        "attach_time",
        "--example",
        "perfetto_write",
        "--example",
        "mem_scan",
        "--example",
        "mem_copy",
    ]))
}

/// The command as a reader types it: the program's file name instead of its full path.
fn shown(cmd: &Command) -> String {
    let full = display(cmd);
    let program = cmd.get_program().to_string_lossy().into_owned();
    let name = Path::new(&program)
        .file_name()
        .map_or_else(|| program.clone(), |n| n.to_string_lossy().into_owned());
    full.replacen(&program, &name, 1)
}

/// Runs `cmd` with stdout captured (and echoed) and stderr inherited.
fn run_capture(cmd: &mut Command) -> Result<(String, ExitStatus)> {
    use std::io::{BufRead, BufReader};
    eprintln!("$ {}", display(cmd));
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start `{}`", display(cmd)))?;
    let mut out = String::new();
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines() {
            let line = line.context("reading the command's output")?;
            println!("{line}");
            out.push_str(&line);
            out.push('\n');
        }
    }
    Ok((out, child.wait()?))
}

fn criterion_run(plan: &Plan, work: &Path, bench: &str) -> Result<Results> {
    criterion::run(
        bench,
        &plan.criterion_args,
        &work.join("criterion").join(bench),
    )
}

fn criterion_command(r: &Results) -> String {
    r.command.clone()
}

/// `path` relative to the workspace root, as a reader in the root would type it.
fn rel(path: &Path) -> String {
    let root = root();
    path.strip_prefix(&root)
        .unwrap_or(path)
        .display()
        .to_string()
}

#[cfg(test)]
mod tests {
    use vmtsync_launch::bench::{
        self as bench, Anchoring, AnchoringRow, ProbeBench, ProbeRow, Wire, WireSizes,
    };

    use super::format::{rate, ratio, thousands, time_ns};
    use super::*;

    #[test]
    fn stat_takes_the_middle_of_sorted_values() {
        let s = Stat::of(&[3.0, 1.0, 2.0]).expect("values");
        assert_eq!((s.min, s.median, s.max), (1.0, 2.0, 3.0));
        let s = Stat::of(&[4.0, 1.0, 2.0, 3.0]).expect("values");
        assert_eq!(s.median, 2.5);
        assert!(Stat::of(&[]).is_none());
    }

    #[test]
    fn render_fills_every_key_and_rejects_leftovers() {
        let mut keys = BTreeMap::new();
        keys.insert("a".to_owned(), "1".to_owned());
        assert_eq!(render("x {{a}} y", &keys).expect("renders"), "x 1 y");
        assert!(render("{{b}}", &keys).is_err(), "missing value");
        assert!(render("no keys", &keys).is_err(), "unused value");
    }

    #[test]
    fn the_template_names_every_section() {
        for key in [
            "timeline", "proto", "estimate", "recorder", "tracedat", "ctf", "perfetto", "scan",
            "probe", "record", "ingest", "memory", "firmware", "fuzz", "agent", "summary",
            "machine",
        ] {
            assert!(
                TEMPLATE.contains(&format!("{{{{{key}}}}}")),
                "template lacks {key}"
            );
        }
    }

    #[test]
    fn numbers_read_as_in_the_tables() {
        assert_eq!(thousands(2_596_148_u64), "2,596,148");
        assert_eq!(thousands(-1_000_i64), "−1,000");
        assert_eq!(rate(1.25e9), "1.25 G/s");
        assert_eq!(rate(340e6), "340 M/s");
        assert_eq!(time_ns(54.94), "54.9 ns");
        assert_eq!(time_ns(25_300.0), "25.3 µs");
        assert_eq!(ratio(29.43), "29.4×");
    }

    #[test]
    fn a_full_event_batch_encodes() {
        let (frame, events) = sections::event_batch_frame().expect("encodes");
        assert_eq!(events, vmtsync_core::proto::EVENT_BATCH_MAX);
        // Each payload-less record takes at least its header and its 2-byte delta, and the
        // batch meets the ≤ 4 B/event goal with its overhead (docs/wire-integrity.md).
        assert!(frame >= 3 * events, "{frame} bytes");
        assert!(frame <= 4 * events, "{frame} bytes");
        println!("full batch: {frame} B for {events} events");
    }

    /// A probe bench line with the fields these tests read (the rest zero).
    fn probe_line(rows: Vec<ProbeRow>, anchoring: Option<Anchoring>) -> ProbeBench {
        ProbeBench {
            tsc_khz: 2_600_000,
            tsc_khz_source: "agent".into(),
            sessions: 3,
            probes: 64,
            run_time_s: 1.0,
            wire: Wire {
                builtin: WireSizes {
                    request: [4, 4],
                    reply: [10, 11],
                },
                ..Wire::default()
            },
            anchoring,
            rows,
            ..ProbeBench::default()
        }
    }

    fn row(name: &str) -> ProbeRow {
        ProbeRow {
            name: name.into(),
            sessions: 3,
            contains: 3,
            drift_contains: 3,
            rtt_min: 1,
            rtt_median: 2,
            ..ProbeRow::default()
        }
    }

    #[test]
    fn probe_rows_count_sessions() {
        let j = probe_line(
            vec![
                ProbeRow {
                    ours_median_err: Some(2600),
                    ours_max_err: Some(5200),
                    tc_median_err: 2600,
                    ratio: Some(1.0),
                    ..row("builtin/exit-tight")
                },
                ProbeRow {
                    ours_median_err: Some(9),
                    drift_median_err: Some(10),
                    tc_median_err: 40,
                    ratio: Some(0.2),
                    drift_ratio: Some(0.25),
                    goal_met: true,
                    contains: 0,
                    drift_contains: 2,
                    ..row("skew/exit-tight")
                },
            ],
            None,
        );
        let s = probe::probe_section(&j);
        assert!(s.body.contains("3 sessions per path"), "{}", s.body);
        assert!(s.body.contains("2,600 (1,000 ns)"), "{}", s.body);
        assert!(
            s.body.contains("| 0/3; 2/3 |"),
            "both guarantees count on skew rows: {}",
            s.body
        );
        assert!(
            s.body
                .contains("4 B request + 10–11 B reply (built-in VMM)."),
            "{}",
            s.body
        );
        assert_eq!(s.summary[0][2], "interval 3/6, drift bounds 5/6 sessions");
        assert_eq!(s.summary[0][3], "**not met**");
        // A figure, no verdict: the constant-offset ratio on identity rows, the drift
        // estimator's on skew rows.
        assert_eq!(
            s.summary[1][2],
            "0.250 / **0.625** / 1.000 over 2 paths (min / median / max)"
        );
        assert_eq!(s.summary[1][3], "—");
        assert!(!s.body.contains('¼'), "{}", s.body);
        assert_eq!(
            s.summary.len(),
            2,
            "no vsock or anchoring rows without those paths"
        );
    }

    #[test]
    fn vsock_rows_render_every_estimator_as_figures() {
        let j = probe_line(
            vec![ProbeRow {
                ours_median_err: Some(600),
                tc_median_err: 1000,
                ratio: Some(0.6),
                central_ratio: Some(0.45),
                central_median_err: Some(450),
                rate1_median_err: Some(500),
                hist_median_err: 1200,
                min_delay_median: Some([3000, 1000]),
                delay_median: Some([5000, 1200]),
                fastest_asymmetry_median: Some(-1000),
                ..row("vsock/339")
            }],
            None,
        );
        let s = probe::probe_section(&j);
        assert!(
            s.body.contains("| vsock/339 | 600 (230 ns) | 450 (173 ns) | 500 (192 ns) | 1,000 (384 ns) | 1,200 (461 ns) | 0.600; 0.450 |"),
            "{}",
            s.body
        );
        assert!(
            s.body
                .contains("| vsock/339 | 3,000 / 1,000 | 5,000 / 1,200 | −1,000 |"),
            "{}",
            s.body
        );
        assert_eq!(s.summary[2][2], "0.450 (best of ours)");
        assert_eq!(s.summary[2][3], "—", "a figure, not a goal");
        assert!(!s.body.contains('½'), "{}", s.body);
    }

    #[test]
    fn anchoring_rows_render_with_their_goals() {
        let arow = |name: &str, width: u64, err: u64, wr: f64, er: f64| AnchoringRow {
            name: name.into(),
            width_median: Some(width),
            ours_median_err: Some(err),
            width_ratio: Some(wr),
            err_ratio: Some(er),
        };
        let mut anchoring = Anchoring {
            baseline: "qemu-microvm/stdio".into(),
            rows: vec![
                arow("qemu-microvm/stdio", 2_600_000, 260_000, 1.0, 1.0),
                arow("qemu-microvm/kvm-pio", 26_000, 26_000, 0.01, 0.1),
                arow("vsock/sync-port-ring0", 13_000, 10_400, 0.005, 0.04),
            ],
            probes_to_2x: [
                ("qemu-microvm/stdio".to_owned(), Some(5)),
                ("qemu-microvm/kvm-pio".to_owned(), Some(2)),
            ]
            .into_iter()
            .collect(),
        };
        let s = probe::probe_section(&probe_line(Vec::new(), Some(anchoring.clone())));
        assert!(
            s.body.contains("| qemu-microvm/kvm-pio | 26,000 (10,000 ns) | 26,000 (10,000 ns) | 0.0100 | 0.1000 | 2 |"),
            "{}",
            s.body
        );
        let goals: Vec<(&str, &str)> = s.summary[2..]
            .iter()
            .map(|r| (r[2].as_str(), r[3].as_str()))
            .collect();
        assert_eq!(
            goals,
            [
                ("0.0100", "met"),
                (
                    "4,000 ns on `vsock/sync-port-ring0`; 10,000 ns on the UART bytes alone (`ring=3 syncport=off`)",
                    "met"
                ),
                ("2", "met")
            ]
        );
        // Without a path under 5 µs the best one decides the verdict, named.
        anchoring.rows[2].ours_median_err = Some(26_000);
        let s = probe::probe_section(&probe_line(Vec::new(), Some(anchoring)));
        assert_eq!(s.summary[3][3], "**not met**");
        assert!(
            s.summary[3][2].starts_with("10,000 ns on `qemu-microvm/kvm-pio`"),
            "{:?}",
            s.summary[3]
        );
    }

    #[test]
    fn a_probe_line_reads_back_as_the_producer_wrote_it() {
        let j = probe_line(vec![row("builtin/exit-tight")], None);
        let line = bench::to_line(&j);
        assert!(
            line.starts_with("{\"schema\":\"vmtsync-probe-bench/1\","),
            "{line}"
        );
        assert_eq!(bench::last_line::<ProbeBench>(&line), Some(j));
    }
}
