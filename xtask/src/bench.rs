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
//!   `tracedat`, `kvm_scan` (vmtsync), run through `cargo bench --workspace --bench NAME`;
//! - bytes per event on the wire: a full `EventBatch` of payload-less events 2600 ticks
//!   apart, encoded by `vmtsync_core::proto::encode_frame` here;
//! - max RSS of `examples/tracedat_write` at 1 M and 10 M events under `/usr/bin/time -v`;
//! - `bench-scan`'s separate-process `vmtsync kvm --json` over a generated debugfs tree;
//! - the real-KVM probe benchmark (`vmtsync-probe-bench --sessions K`, its JSON line);
//! - the agent's `.text` size (`build-agent`);
//! - fuzzing: `--fuzz-long` runs `cargo xtask fuzz --long` and records its `fuzz-result`
//!   lines in `target/fuzz-results.json`; without it the last recorded results are shown with
//!   their date.
//!
//! `--quick` is the smoke run `ci` makes: criterion's quick mode, tiny sizes, the binaries ci's
//! test step already built (dev profile), and the output in `target/BENCHMARKS.quick.md`
//! unless `--out` says otherwise. A benchmark that fails leaves its section saying so and
//! makes the command fail after the file is written.

mod criterion;
mod machine;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

use crate::{agent, bench_scan, cargo, display, root};
use criterion::{Measured, Results};
use machine::Machine;

/// The template every BENCHMARKS.md is rendered from.
const TEMPLATE: &str = include_str!("bench/template.md");

/// trace-cmd's PTP plugin: 32,778 bytes on the wire for its 339 probes (its `PTP_SYNC_LOOP`),
/// in tenths of a byte per probe.
const TRACE_CMD_PTP_BYTES_PER_PROBE_X10: u64 = 967;

/// Where `--fuzz-long` records its results, relative to the workspace root.
const FUZZ_RESULTS: &str = "target/fuzz-results.json";

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
    sessions: Option<usize>,
    out: Option<PathBuf>,
}

const USAGE: &str = "usage: cargo xtask bench [--quick] [--fuzz-long] [--sessions K] [--out PATH]";

impl Options {
    fn parse(args: &[String]) -> Result<Self> {
        let mut o = Self {
            quick: false,
            fuzz_long: false,
            sessions: None,
            out: None,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            match flag.as_str() {
                "--quick" => o.quick = true,
                "--fuzz-long" => o.fuzz_long = true,
                "--sessions" => {
                    let k = it.next().context(USAGE)?;
                    o.sessions = Some(k.parse().with_context(|| format!("--sessions {k}"))?);
                }
                "--out" => o.out = Some(PathBuf::from(it.next().context(USAGE)?)),
                other => bail!("bench: unknown argument `{other}`\n{USAGE}"),
            }
        }
        ensure!(o.sessions != Some(0), "--sessions must be at least 1");
        Ok(o)
    }
}

/// The sizes of one run.
#[derive(Debug, Clone)]
struct Plan {
    /// Arguments after `--` for every criterion bench.
    criterion_args: Vec<String>,
    /// Probe-bench sessions per path.
    sessions: usize,
    /// bench-scan: VMs, vCPUs, timed runs.
    scan: (u32, u32, usize),
    /// tracedat_write: the small and the large event count, and runs of each.
    rss: (u64, u64, usize),
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
                // ci's test step built these already (`cargo test --workspace --all-features`).
                build_profile: vec!["--workspace", "--all-features"],
                bin_dir: root().join("target/debug"),
            }
        } else {
            Self {
                criterion_args: strings(&[
                    "--warm-up-time",
                    "1",
                    "--measurement-time",
                    "3",
                    "--noplot",
                ]),
                sessions: o.sessions.unwrap_or(30),
                scan: (1000, 4, 31),
                rss: (1_000_000, 10_000_000, 3),
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
    let mut sections: BTreeMap<&'static str, Section> = BTreeMap::new();
    type Step<'a> = (&'static str, Box<dyn Fn() -> Result<Section> + 'a>);
    let steps: Vec<Step<'_>> = vec![
        ("timeline", Box::new(|| timeline(&plan, &work))),
        ("proto", Box::new(|| proto(&plan, &work))),
        ("estimate", Box::new(|| estimate(&plan, &work))),
        ("recorder", Box::new(|| recorder(&plan, &work))),
        ("tracedat", Box::new(|| tracedat(&plan, &work))),
        ("scan", Box::new(|| scan(&plan, &work))),
        ("probe", Box::new(|| probe(&plan))),
        ("fuzz", Box::new(|| fuzz(&opts))),
        ("agent", Box::new(agent_size)),
    ];
    for (name, step) in &steps {
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
        sections.insert(name, section);
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

/// What no benchmark of this run measures (static prose: it holds no figures).
const NOT_COVERED: &str = "\
- Sustained event ingest from a real agent (events/s over the UART and over vsock, with the
  dropped count) has no benchmark yet.
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
        || "not reported by CPUID".into(),
        |(khz, src)| format!("{} kHz ({src})", thousands(khz)),
    );
    let mut s = format!(
        "**Machine:** {} logical CPUs, {}{}; TSC {tsc}; /proc/cpuinfo `cpu MHz` {}; Linux {}. \
         Load average (1/5/15 min) {} at the start, {} at the end; the run took {:.0} s.",
        m.cores,
        m.cpu,
        if m.hypervisor {
            " (a virtual machine: the CPU flags say `hypervisor`)"
        } else {
            ""
        },
        m.cpuinfo_mhz.as_deref().unwrap_or("unknown"),
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
        "--example",
        "tracedat_write",
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

/// `v` rounded to the nearest integer (saturating): for figures shown as whole numbers.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // Saturating by definition.
fn whole(v: f64) -> u64 {
    v.round().clamp(0.0, u64::MAX as f64) as u64
}

// ---------------------------------------------------------------------------------------------
// Number formatting.

/// Three significant digits with an SI prefix: `1.25 G`, `340 M`, `54.9 `.
fn si(v: f64) -> String {
    let (scaled, prefix) = [(1e9, "G"), (1e6, "M"), (1e3, "k")]
        .iter()
        .find(|(f, _)| v.abs() >= *f)
        .map_or((v, ""), |(f, p)| (v / f, *p));
    format!("{} {prefix}", sig3(scaled))
}

/// Three significant digits.
fn sig3(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// A duration in ns, shown in the unit that fits: `1.44 ns`, `25.3 µs`, `51.0 ms`.
fn time_ns(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{} s", sig3(ns / 1e9))
    } else if ns >= 1e6 {
        format!("{} ms", sig3(ns / 1e6))
    } else if ns >= 1e3 {
        format!("{} µs", sig3(ns / 1e3))
    } else {
        format!("{} ns", sig3(ns))
    }
}

/// Events per second: `1.25 G/s`.
fn rate(v: f64) -> String {
    format!("{}/s", si(v))
}

/// An integer with thousands separators: `2,596,148`.
fn thousands(v: impl Into<i128>) -> String {
    let v: i128 = v.into();
    let digits = v.unsigned_abs().to_string();
    let mut s = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            s.push(',');
        }
        s.push(c);
    }
    if v < 0 { format!("−{s}") } else { s }
}

fn ratio(v: f64) -> String {
    format!("{}×", sig3(v))
}

fn verdict(met: bool) -> String {
    if met {
        "met".into()
    } else {
        "**not met**".into()
    }
}

// ---------------------------------------------------------------------------------------------
// Criterion sections.

/// A table of criterion results: one row per `(label, id)`, with the time per iteration, the
/// rate when the bench declared a throughput, and optionally how many times faster `base` is.
fn criterion_table(
    r: &Results,
    rows: &[(&str, &str)],
    per_element: bool,
    faster: Option<(&str, &Measured)>,
) -> Result<String> {
    let mut s = String::new();
    let elements = rows
        .iter()
        .filter_map(|(_, id)| r.by_id.get(*id))
        .any(|m| m.elements.is_some());
    let unit = if per_element {
        "per element"
    } else {
        "per iteration"
    };
    let _ = write!(s, "| benchmark | time {unit} (min / median / max) |");
    if elements {
        s.push_str(" rate (min / median / max) |");
    }
    if let Some((label, _)) = faster {
        let _ = write!(s, " {label} |");
    }
    s.push_str("\n|---|---:|");
    if elements {
        s.push_str("---:|");
    }
    if faster.is_some() {
        s.push_str("---:|");
    }
    s.push('\n');
    for (label, id) in rows {
        let m = r.get(id)?;
        let t = if per_element {
            m.ns_per_element()
        } else {
            m.ns
        };
        let _ = write!(s, "| {label} | {} |", t.show(time_ns));
        if elements {
            let _ = write!(
                s,
                " {} |",
                m.per_second().map_or_else(|| "—".into(), |p| p.show(rate))
            );
        }
        if let Some((_, base)) = faster {
            let _ = write!(s, " {} |", ratio(m.ns.median / base.ns.median));
        }
        s.push('\n');
    }
    let samples: Vec<usize> = rows
        .iter()
        .filter_map(|(_, id)| r.by_id.get(*id).map(|m| m.samples))
        .collect();
    if let (Some(lo), Some(hi)) = (samples.iter().min(), samples.iter().max()) {
        let _ = writeln!(
            s,
            "\n{} criterion samples per benchmark.",
            if lo == hi {
                lo.to_string()
            } else {
                format!("{lo}–{hi}")
            }
        );
    }
    Ok(s)
}

fn timeline(plan: &Plan, work: &Path) -> Result<Section> {
    let r = criterion_run(plan, work, "timeline")?;
    let g = "timeline_guest_to_host_4096_segments";
    let id = |f: &str| format!("{g}/{f}");
    let batch = r.get(&id("cursor_batch"))?;
    let per_event = r.get(&id("cursor_per_event"))?;
    let search = r.get(&id("binary_search_per_event"))?;
    let dense = r.get(&id("binary_search_dense_starts_per_event"))?;
    let rows = [
        (
            "`Cursor::try_convert_slice_floor` (streaming batch)",
            id("cursor_batch"),
        ),
        (
            "`Cursor::try_convert_floor` (our streaming cursor, per event)",
            id("cursor_per_event"),
        ),
        (
            "baseline: binary search per event + linear map (trace-cmd's reader)",
            id("binary_search_per_event"),
        ),
        (
            "baseline variant: binary search over a dense array of starts",
            id("binary_search_dense_starts_per_event"),
        ),
        (
            "memory floor (read + add + write the buffer; not a converter)",
            id("memory_floor_add_one"),
        ),
    ];
    let rows: Vec<(&str, &str)> = rows.iter().map(|(l, i)| (*l, i.as_str())).collect();
    let mut body = criterion_table(&r, &rows, true, Some(("time vs batch", batch)))?;
    let vs_search = search.ns.median / batch.ns.median;
    let vs_cursor = per_event.ns.median / batch.ns.median;
    let vs_dense = dense.ns.median / batch.ns.median;
    let batch_rate = batch.per_second().map_or(0.0, |p| p.median);
    let _ = writeln!(
        body,
        "\nThe batch converter is **{} faster than trace-cmd's per-event binary search** \
         ({} against the dense-starts variant) and **{} faster than our own per-event \
         cursor**, same run, same buffer (medians). Goals: ≥ 300 M events/s on one core \
         ({}: {}) and ≥ 10× the per-event binary search ({}: {}).",
        ratio(vs_search),
        ratio(vs_dense),
        ratio(vs_cursor),
        rate(batch_rate),
        verdict(batch_rate >= 300e6),
        ratio(vs_search),
        verdict(vs_search >= 10.0),
    );
    let k = "timeline_kvm_guest_to_host";
    let kb = r.get(&format!("{k}/cursor_batch"))?;
    let ks = r.get(&format!("{k}/binary_search_per_event"))?;
    let kvm_rows = [
        (
            "batch (corrected reciprocal kernel)",
            format!("{k}/cursor_batch"),
        ),
        (
            "exact u128 division per event (`try_host_from_guest_ceil`)",
            format!("{k}/binary_search_per_event"),
        ),
    ];
    let kvm_rows: Vec<(&str, &str)> = kvm_rows.iter().map(|(l, i)| (*l, i.as_str())).collect();
    let _ = writeln!(
        body,
        "\nOne exact KVM segment (ratio 1.1 at 48 fractional bits; the batch output equals the \
         exact inverse bit for bit, asserted before timing):\n"
    );
    body.push_str(&criterion_table(
        &r,
        &kvm_rows,
        true,
        Some(("time vs batch", kb)),
    )?);
    let _ = writeln!(
        body,
        "\nBatch vs exact division per event: {}.",
        ratio(ks.ns.median / kb.ns.median)
    );
    Ok(Section {
        command: criterion_command(&r),
        body,
        summary: vec![
            [
                "timeline batch conversion, one core".into(),
                "≥ 300 M events/s".into(),
                batch
                    .per_second()
                    .map_or_else(|| "—".into(), |p| p.show(rate)),
                verdict(batch_rate >= 300e6),
            ],
            [
                "batch vs trace-cmd-style per-event binary search".into(),
                "≥ 10×".into(),
                ratio(vs_search),
                verdict(vs_search >= 10.0),
            ],
            [
                "batch vs our own per-event cursor".into(),
                "— (for scale)".into(),
                ratio(vs_cursor),
                "—".into(),
            ],
        ],
    })
}

/// One `name: key=value …` line the proto bench prints.
fn kv_line<'a>(text: &'a str, name: &str) -> Option<BTreeMap<&'a str, &'a str>> {
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))?;
    Some(
        line.split_whitespace()
            .filter_map(|w| w.split_once('='))
            .collect(),
    )
}

fn proto(plan: &Plan, work: &Path) -> Result<Section> {
    let r = criterion_run(plan, work, "proto")?;
    let rows = [
        (
            "probe request encode + decode",
            "probe/request encode+decode",
        ),
        ("probe reply encode + decode", "probe/reply encode+decode"),
        (
            "agent's path after reading the TSC (`ProbeReplyFrame::finish`)",
            "probe/reply finish (agent late-TSC path)",
        ),
        (
            "… of which the CRC-16 continuation over the TSC bytes",
            "probe/reply CRC-16 continuation over the TSC bytes",
        ),
        (
            "generic `encode_frame` of the same reply",
            "probe/reply encode_frame (generic)",
        ),
        (
            "host receive + decode + 32-bit TSC unwrap",
            "probe/host receive+unwrap reply",
        ),
    ];
    let mut body = criterion_table(&r, &rows, false, None)?;
    let compact = kv_line(&r.stdout, "probe_round_trip")
        .context("the proto bench printed no `probe_round_trip:` line")?;
    let full = kv_line(&r.stdout, "full_probe_round_trip")
        .context("the proto bench printed no `full_probe_round_trip:` line")?;
    let num = |m: &BTreeMap<&str, &str>, k: &str| -> Result<u64> {
        m.get(k)
            .with_context(|| format!("no {k}= in the proto bench's wire line"))?
            .parse()
            .with_context(|| format!("{k}= is not a number"))
    };
    let (lo, hi) = (num(&compact, "bytes_min")?, num(&compact, "bytes_max")?);
    let (flo, fhi) = (num(&full, "bytes_min")?, num(&full, "bytes_max")?);
    let tc = TRACE_CMD_PTP_BYTES_PER_PROBE_X10 as f64 / 10.0;
    let range = |a: u64, b: u64| {
        if a == b {
            format!("{a} B")
        } else {
            format!("{a}–{b} B")
        }
    };
    let _ = writeln!(
        body,
        "\n**Bytes per probe round trip: {}** for a compact probe (request {} B + reply {} B at \
         seq 0; COBS, checksum and the 0x00 delimiter included; every seq 0..=255, guest TSC \
         ≈ 2^45, vCPU 3), {} with the full-width TSC, printed by the bench from the real \
         encoder. trace-cmd's PTP plugin spends 32,778 B on its 339 probes ≈ {tc} B per probe: \
         {} to {} more than ours.",
        range(lo, hi),
        num(&compact, "request")?,
        num(&compact, "reply")?,
        range(flo, fhi),
        ratio(tc / hi as f64),
        ratio(tc / lo.max(1) as f64),
    );
    Ok(Section {
        command: criterion_command(&r),
        body,
        summary: vec![[
            "bytes per probe round trip (compact)".into(),
            "≤ 16 B".into(),
            format!("{} (trace-cmd PTP ≈ {tc} B)", range(lo, hi)),
            verdict(hi <= 16),
        ]],
    })
}

fn estimate(plan: &Plan, work: &Path) -> Result<Section> {
    let r = criterion_run(plan, work, "estimate")?;
    let names = [
        ("trace-cmd fastest RTT (faithful port)", "trace_cmd_fastest"),
        ("trace-cmd histogram (port)", "trace_cmd_histogram"),
        ("ours: guaranteed offset interval", "ours_offset_interval"),
        (
            "ours: convex-hull drift bounds (hull capacity 32)",
            "ours_drift_hull32",
        ),
    ];
    let sizes = [64, 339];
    let mut body = String::from(
        "| estimator | ns per sample, 64 samples (min / median / max) | 339 samples |\n|---|---:|---:|\n",
    );
    for (label, name) in names {
        let _ = write!(body, "| {label} |");
        for n in sizes {
            let m = r.get(&format!("estimate/{name}/{n}"))?;
            let _ = write!(body, " {} |", m.ns_per_element().show(time_ns));
        }
        body.push('\n');
    }
    let _ = writeln!(
        body,
        "\n64 samples is our default round; 339 is trace-cmd's `PTP_SYNC_LOOP`."
    );
    let ours = r.get("estimate/ours_offset_interval/64")?.ns_per_element();
    let tc = r.get("estimate/trace_cmd_fastest/64")?.ns_per_element();
    Ok(Section {
        command: criterion_command(&r),
        body,
        summary: vec![[
            "offset interval estimator, 64 samples".into(),
            "— (for scale)".into(),
            format!(
                "{} per sample ({} trace-cmd fastest RTT's time)",
                time_ns(ours.median),
                ratio(ours.median / tc.median)
            ),
            "—".into(),
        ]],
    })
}

/// A full event batch as the agent sends it, encoded: `(frame bytes, events)`.
fn event_batch_frame() -> Result<(usize, usize)> {
    use vmtsync_core::proto::{
        EVENT_BATCH_MAX, EventBatch, EventClock, MAX_FRAME_SIZE, Message, encode_frame,
    };
    // A guest TSC near 2^45 (hours after boot), 2600 ticks between events: a million events
    // per second at 2.6 GHz.
    let base = (1u64 << 45) + 12_345;
    let mut batch = EventBatch::new(1, EventClock::Guest, base);
    let mut prev = base;
    for i in 0..EVENT_BATCH_MAX {
        let t = prev + 2600;
        let id = u16::try_from(i % 100).unwrap_or(0);
        ensure!(
            batch.push(prev, t, id, &[]),
            "EventBatch::push refused record {i}"
        );
        prev = t;
    }
    let events = batch.records.len();
    let mut buf = [0u8; MAX_FRAME_SIZE];
    let frame = encode_frame(&Message::Events(batch), &mut buf)
        .map_err(|e| anyhow::anyhow!("encode_frame: {e:?}"))?;
    Ok((frame.len(), events))
}

fn recorder(plan: &Plan, work: &Path) -> Result<Section> {
    let r = criterion_run(plan, work, "recorder")?;
    let rows = [
        (
            "TSC read alone (`lfence; rdtsc`)",
            "recorder/tsc_read_alone",
        ),
        (
            "`Ring::record`, no payload (includes the TSC read)",
            "recorder/record_no_payload",
        ),
        (
            "`Ring::record`, 8-byte payload",
            "recorder/record_8B_payload",
        ),
        (
            "record (8 B) then pop (producer + consumer)",
            "recorder/record_8B_payload_then_pop",
        ),
    ];
    let mut body = criterion_table(&r, &rows, true, None)?;
    let tsc = r.get("recorder/tsc_read_alone")?.ns_per_element();
    let rec = r.get("recorder/record_no_payload")?.ns_per_element();
    let rec8 = r.get("recorder/record_8B_payload")?.ns_per_element();
    let (frame, events) = event_batch_frame()?;
    let per_event = frame as f64 / events as f64;
    let _ = writeln!(
        body,
        "\nRecorder cost per event (median, with the real ordered TSC read): {} without a \
         payload, {} with 8 bytes; the TSC read alone is {}, so the ring itself adds {}. \
         Goal ≤ 20 ns/event: {}.\n\n\
         **Bytes per event on the wire: {:.2} B** — one full batch of {events} payload-less \
         events 2600 ticks apart (a million events per second at 2.6 GHz, guest TSC ≈ 2^45) \
         encoded by `vmtsync_core::proto::encode_frame` (in `cargo xtask bench` itself) into a \
         {frame}-byte frame (tag, \
         counters, base timestamp, checksum, COBS and delimiter shared by the batch). Goal \
         ≤ 4 B/event: {}.",
        time_ns(rec.median),
        time_ns(rec8.median),
        time_ns(tsc.median),
        time_ns(rec.median - tsc.median),
        verdict(rec.median <= 20.0),
        per_event,
        verdict(per_event <= 4.0),
    );
    Ok(Section {
        command: criterion_command(&r),
        body,
        summary: vec![
            [
                "recorder cost per event (no payload, real TSC read)".into(),
                "≤ 20 ns".into(),
                rec.show(time_ns),
                verdict(rec.median <= 20.0),
            ],
            [
                "bytes per payload-less event on the wire (full batch)".into(),
                "≤ 4 B".into(),
                format!("{per_event:.2} B"),
                verdict(per_event <= 4.0),
            ],
        ],
    })
}

/// `Maximum resident set size` of one `tracedat_write` run, in KiB, and the file's size.
fn max_rss(bin: &Path, file: &Path, events: u64, version: u32) -> Result<(u64, u64)> {
    let mut cmd = Command::new("/usr/bin/time");
    cmd.arg("-v")
        .arg(bin)
        .arg(file)
        .arg(events.to_string())
        .arg("2")
        .arg(version.to_string());
    let shown_cmd = shown(&cmd);
    eprintln!("$ {}", display(&cmd));
    let out = cmd
        .output()
        .with_context(|| format!("running {shown_cmd} (is /usr/bin/time installed?)"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "{shown_cmd} failed: {stderr}");
    let kib = stderr
        .lines()
        .find_map(|l| l.trim().strip_prefix("Maximum resident set size (kbytes):"))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("no maximum RSS in the output of {shown_cmd}"))?;
    let bytes = std::fs::metadata(file).map_or(0, |m| m.len());
    let _ = std::fs::remove_file(file);
    Ok((kib, bytes))
}

fn tracedat(plan: &Plan, work: &Path) -> Result<Section> {
    let r = criterion_run(plan, work, "tracedat")?;
    let rows = [
        (
            "v7 `push` only (pages written as they fill)",
            "tracedat/push_v7",
        ),
        (
            "v7 `push` + `finish` (spill append, fsync, full read-back verification)",
            "tracedat/push_and_finish_v7",
        ),
        ("v6 `push` only", "tracedat/push_v6"),
        ("v6 `push` + `finish`", "tracedat/push_and_finish_v6"),
    ];
    let mut body = criterion_table(&r, &rows, true, None)?;
    let push = r
        .get("tracedat/push_v7")?
        .per_second()
        .context("tracedat bench has no throughput")?;
    let _ = writeln!(
        body,
        "\nGoal ≥ 20 M events/s in-process (`push`, v7): {} ({}).",
        rate(push.median),
        verdict(push.median >= 20e6)
    );

    let bin = plan.bin_dir.join("examples/tracedat_write");
    let file = std::env::temp_dir().join(format!("vmtsync-bench-rss-{}.dat", std::process::id()));
    let (small, large, runs) = plan.rss;
    let mut table = String::from(
        "| events | max RSS v7 (KiB, min / median / max) | max RSS v6 | file (v7) |\n|---:|---:|---:|---:|\n",
    );
    let mut medians = BTreeMap::new();
    for n in [small, large] {
        let mut cells = Vec::new();
        let mut size = 0;
        for v in [7u32, 6] {
            let mut kib = Vec::new();
            for _ in 0..runs {
                let (k, bytes) = max_rss(&bin, &file, n, v)?;
                kib.push(k as f64);
                if v == 7 {
                    size = bytes;
                }
            }
            let st = Stat::of(&kib).context("no runs")?;
            medians.insert((n, v), st.median);
            cells.push(st.show(|x| thousands(whole(x))));
        }
        let _ = writeln!(
            table,
            "| {} | {} | {} | {} MB |",
            thousands(n),
            cells[0],
            cells[1],
            sig3(size as f64 / 1e6)
        );
    }
    let growth = |v: u32| medians[&(large, v)] / medians[&(small, v)] - 1.0;
    let (g7, g6) = (growth(7), growth(6));
    let within = g7.abs() <= 0.10 && g6.abs() <= 0.10;
    let _ = writeln!(
        body,
        "\nMemory: `/usr/bin/time -v {} OUT.dat N 2 V` (built by `cargo build {} --example \
         tracedat_write`), {runs} run(s) per cell; `N` is the event count, `V` the file \
         version:\n\n{table}\n\
         Max RSS at {} events vs {}: {:+.1} % (v7), {:+.1} % (v6). Goal: within 10 %: {}.",
        rel(&bin),
        plan.build_profile.join(" "),
        thousands(large),
        thousands(small),
        g7 * 100.0,
        g6 * 100.0,
        verdict(within),
    );
    Ok(Section {
        command: criterion_command(&r),
        body,
        summary: vec![
            [
                "trace.dat `push`, in-process (v7)".into(),
                "≥ 20 M events/s".into(),
                push.show(rate),
                verdict(push.median >= 20e6),
            ],
            [
                format!(
                    "trace.dat max RSS, {} vs {} events",
                    thousands(large),
                    thousands(small)
                ),
                "within 10 %".into(),
                format!("{:+.1} % (v7), {:+.1} % (v6)", g7 * 100.0, g6 * 100.0),
                verdict(within),
            ],
        ],
    })
}

fn scan(plan: &Plan, work: &Path) -> Result<Section> {
    let (vms, vcpus, runs) = plan.scan;
    let bin = plan.bin_dir.join("vmtsync");
    let m = bench_scan::measure(&bin, vms, vcpus, runs)?;
    let ms: Vec<f64> = m.times.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    let st = Stat::of(&ms).context("no scan runs")?;
    let ms_text = |v: f64| format!("{} ms", sig3(v));
    let full_size = vms == 1000 && vcpus == 4;
    let command = format!("cargo xtask bench-scan --vms {vms} --vcpus {vcpus} --runs {runs}");
    let mut body = format!(
        "`bench-scan` generates a KVM \
         debugfs tree of {vms} VMs × {vcpus} vCPUs (five files per vCPU, Intel-style scaling: \
         {} files), runs `vmtsync kvm --json --debugfs-root TREE` {runs} times as a separate \
         process after one untimed warm-up, checks each output lists all {vms} VMs, and times \
         it: **{}** wall time per scan (min / median / max). Goal ≤ 100 ms for 1000 × 4: {}. \
         Nearly all of it is three system calls per file (openat, read, close) on this host.\n",
        thousands(m.files),
        st.show(ms_text),
        if full_size {
            verdict(st.median <= 100.0)
        } else {
            "not judged at this size".into()
        },
    );
    let r = criterion_run(plan, work, "kvm_scan")?;
    let _ = writeln!(
        body,
        "\nIn-process (`{}`): the scan and JSON serialisation of 1000 × 4, and `vmtsync \
         convert`'s streaming conversion of 100,000 decimal guest TSCs (lines):\n",
        criterion_command(&r)
    );
    let rows = [
        (
            "scan + JSON, 1000 VMs × 4 vCPUs",
            "kvm_scan/scan_json_1000vms_x4",
        ),
        ("convert, offset-only mapping", "convert/offset_only"),
        (
            "convert, Intel-scaled mapping (exact u128)",
            "convert/intel_scaled",
        ),
    ];
    body.push_str(&criterion_table(&r, &rows, false, None)?);
    Ok(Section {
        command,
        body,
        summary: vec![[
            format!("`vmtsync kvm --json`, {vms} VMs × {vcpus} vCPUs, separate process"),
            "≤ 100 ms (1000 × 4)".into(),
            st.show(ms_text),
            if full_size {
                verdict(st.median <= 100.0)
            } else {
                "not judged at this size".into()
            },
        ]],
    })
}

fn agent_size() -> Result<Section> {
    let elf = agent::build()?;
    let text = agent::section_size(&elf, ".text")?;
    let limit = agent::TEXT_LIMIT;
    Ok(Section {
        command: "cargo xtask build-agent".into(),
        body: format!(
            "`.text` of the release agent: **{} bytes** ({:.1} KiB of the {} KiB budget), with \
             both transports (16550 UART and virtio-vsock over PCI or MMIO), defmt logging and \
             the core agent state machine.",
            thousands(text),
            text as f64 / 1024.0,
            limit / 1024
        ),
        summary: vec![[
            "guest agent `.text`".into(),
            format!("≤ {} KiB", limit / 1024),
            format!("{} B", thousands(text)),
            verdict(text <= limit),
        ]],
    })
}

// ---------------------------------------------------------------------------------------------
// The probe benchmark on real KVM.

fn probe(plan: &Plan) -> Result<Section> {
    let bin = plan.bin_dir.join("vmtsync-probe-bench");
    let mut cmd = Command::new(&bin);
    cmd.args(["--sessions", &plan.sessions.to_string()]);
    let (stdout, status) = run_capture(&mut cmd)?;
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with("{\"schema\":\"vmtsync-probe-bench/"))
        .with_context(|| format!("`{}` printed no JSON line ({status})", shown(&cmd)))?;
    let j: Value = serde_json::from_str(line).context("parsing the probe bench's JSON line")?;
    let mut section = probe_section(&j)?;
    section.command = format!("{} --sessions {}", rel(&bin), plan.sessions);
    section.body = format!(
        "Built by `cargo build {} --bin vmtsync-probe-bench`; `cargo xtask bench-probe \
         --sessions {}` runs the same benchmark from a release build.\n\n{}",
        plan.build_profile.join(" "),
        plan.sessions,
        section.body
    );
    if !status.success() {
        bail!(
            "the probe bench exited with {status} (3: a guaranteed interval missed the \
             truth):\n\n{}",
            section.body
        );
    }
    Ok(section)
}

fn probe_section(j: &Value) -> Result<Section> {
    let u = |v: &Value| v.as_u64();
    let ticks = |v: &Value| u(v).map_or_else(|| "—".into(), thousands);
    let khz = u(&j["tsc_khz"]).unwrap_or(0).max(1);
    let ns =
        |t: u64| u64::try_from(u128::from(t) * 1_000_000 / u128::from(khz)).unwrap_or(u64::MAX);
    let ticks_ns = |v: &Value| {
        u(v).map_or_else(
            || "—".into(),
            |t| format!("{} ({} ns)", thousands(t), thousands(ns(t))),
        )
    };
    let sessions = u(&j["sessions"]).context("no sessions in the JSON line")?;
    let probes = u(&j["probes"]).unwrap_or(0);
    let rows = j["rows"].as_array().context("no rows in the JSON line")?;
    let mut body = format!(
        "{sessions} sessions per path (each a hello and {probes} compact probes; **a session \
         is one independent sample**, the {probes} probes in it are one estimate), TSC {} kHz \
         ({}), run time {} s. Truth: each VM's KVM debugfs mapping composed with the agent's \
         software skew where the row says `skew`. Both estimators see the same samples. Errors \
         in host TSC ticks (ns); medians and maxima are over the {sessions} sessions.\n\n\
         | path / bracket | ours median \\|err\\| | trace-cmd fastest-RTT median \\|err\\| | \
         ratio | ours max \\|err\\| | truth inside the guaranteed bounds | bracket min / median |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
        thousands(khz),
        j["tsc_khz_source"].as_str().unwrap_or("?"),
        j["run_time_s"]
            .as_f64()
            .map_or_else(|| "?".into(), |s| format!("{s:.1}")),
    );
    let mut inside = 0;
    let mut total = 0;
    let mut goal = Vec::new();
    for r in rows {
        let name = r["name"].as_str().unwrap_or("?");
        let drifting = name.starts_with("skew");
        // Under a skew the constant-offset interval is the wrong model: the drift bounds are
        // the guarantee there (the probe bench's own soundness rule).
        let contains = if drifting {
            u(&r["drift_contains"])
        } else {
            u(&r["contains"])
        }
        .unwrap_or(0);
        let n = u(&r["sessions"]).unwrap_or(sessions);
        inside += contains;
        total += n;
        let (ours, ratio_v) = if drifting {
            (&r["drift_median_err"], &r["drift_ratio"])
        } else {
            (&r["ours_median_err"], &r["ratio"])
        };
        let _ = writeln!(
            body,
            "| {name}{} | {} | {} | {} | {} | {contains}/{n} | {} / {} |",
            if drifting { " (drift estimator)" } else { "" },
            ticks_ns(ours),
            ticks_ns(&r["tc_median_err"]),
            ratio_v
                .as_f64()
                .map_or_else(|| "—".into(), |x| format!("{x:.3}")),
            ticks(&r["ours_max_err"]),
            ticks(&r["rtt_min"]),
            ticks(&r["rtt_median"]),
        );
        goal.push((name.to_owned(), r["goal_met"].as_bool().unwrap_or(false)));
    }
    let met: Vec<&str> = goal
        .iter()
        .filter(|(_, m)| *m)
        .map(|(n, _)| n.as_str())
        .collect();
    let _ = writeln!(
        body,
        "\n- **Soundness:** the guaranteed bounds contained the truth in {inside} of {total} \
         sessions (every path, every session).\n- **Goal \"ours ≤ ¼ of trace-cmd's median \
         |error| on the same samples\":** met on {} of {} paths{}. On paths whose one-way \
         delays barely vary, every probe proves nearly the same interval and both estimators \
         sit on the same constant path asymmetry, which no estimator working from two-way \
         brackets can separate from the offset.",
        met.len(),
        goal.len(),
        if met.is_empty() {
            String::new()
        } else {
            format!(" ({})", met.join(", "))
        },
    );
    if let Some(sl) = j["system_level"].as_object() {
        let _ = writeln!(
            body,
            "- **System level:** our exit-stamped bracket + estimator gets {} ticks of median \
             error where trace-cmd's estimator on an external tool's path (QEMU stdio) gets {}: \
             a ratio of {}. That gain comes from where the host stamps, not from the estimator.",
            ticks(&sl["ours"]),
            ticks(&sl["trace_cmd"]),
            sl["ratio"]
                .as_f64()
                .map_or_else(|| "?".into(), |x| format!("{x:.4}")),
        );
    }
    let wire = |w: &Value| -> Option<String> {
        let pair = |v: &Value| -> Option<String> {
            let (a, b) = (u(&v[0])?, u(&v[1])?);
            Some(if a == b {
                format!("{a}")
            } else {
                format!("{a}–{b}")
            })
        };
        Some(format!(
            "{} B request + {} B reply",
            pair(&w["request"])?,
            pair(&w["reply"])?
        ))
    };
    if let Some(w) = wire(&j["wire"]["builtin"]) {
        let _ = writeln!(
            body,
            "- **Bytes on the wire per probe, counted on the wire:** {w} (built-in VMM){}.",
            wire(&j["wire"]["qemu"]).map_or_else(String::new, |q| format!("; {q} (QEMU)"))
        );
    }
    let unsound = total - inside;
    Ok(Section {
        command: String::new(),
        body,
        summary: vec![
            [
                "truth inside the guaranteed bounds, real KVM".into(),
                "every session".into(),
                format!("{inside}/{total} sessions"),
                verdict(unsound == 0),
            ],
            [
                "our median |error| vs trace-cmd's, same samples".into(),
                "≤ ¼ on each path".into(),
                format!("met on {} of {} paths", met.len(), goal.len()),
                verdict(met.len() == goal.len()),
            ],
        ],
    })
}

// ---------------------------------------------------------------------------------------------
// Fuzzing.

/// The `fuzz-result key=value …` lines `cargo xtask fuzz` prints, as JSON objects.
fn fuzz_lines(stdout: &str) -> Vec<Value> {
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

fn fuzz(opts: &Options) -> Result<Section> {
    let path = root().join(FUZZ_RESULTS);
    let mut run_status = None;
    if opts.fuzz_long {
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
        let record = json!({
            "schema": "vmtsync-fuzz-results/1",
            "date": date,
            "command": "cargo xtask fuzz --long",
            "success": status.success(),
            "results": results,
        });
        std::fs::write(&path, format!("{record}\n"))
            .with_context(|| format!("writing {}", path.display()))?;
        run_status = Some(status);
    }
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(Section {
            command: "cargo xtask fuzz --long".into(),
            body: format!(
                "No `cargo xtask fuzz --long` results are recorded on this machine \
                 (`{FUZZ_RESULTS}` is missing): `cargo xtask bench --fuzz-long` runs it (it \
                 takes a while) and records them."
            ),
            summary: vec![[
                "fuzzing, every target".into(),
                "≥ 10 M executions, 0 crashes, 0 timeouts".into(),
                "no recorded --long run".into(),
                "not measured".into(),
            ]],
        });
    };
    let j: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let results = j["results"].as_array().context("no results")?;
    let date = j["date"].as_str().unwrap_or("an unknown date");
    let mut body = format!(
        "`cargo xtask fuzz --long` ({}), every cargo-fuzz target from its committed seeds:\n\n\
         | target | executions | crashes | timeouts | out-of-memory | seconds | executions/s |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
        if opts.fuzz_long {
            format!("run by this benchmark run, {date}")
        } else {
            format!(
                "**not run by this benchmark run**: the results recorded in `{FUZZ_RESULTS}` \
                 on {date}; `cargo xtask bench --fuzz-long` refreshes them"
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
    if let Some(status) = run_status
        && !status.success()
    {
        bail!("`cargo xtask fuzz --long` failed ({status}):\n\n{body}");
    }
    Ok(Section {
        command: "cargo xtask fuzz --long".into(),
        body,
        summary: vec![[
            format!(
                "fuzzing, {} targets{}",
                results.len(),
                if opts.fuzz_long {
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
            "timeline", "proto", "estimate", "recorder", "tracedat", "scan", "probe", "fuzz",
            "agent", "summary", "machine",
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
    fn fuzz_result_lines_become_json() {
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
    fn a_full_event_batch_encodes() {
        let (frame, events) = event_batch_frame().expect("encodes");
        assert_eq!(events, vmtsync_core::proto::EVENT_BATCH_MAX);
        // Each payload-less record takes at least its id, delta and payload length.
        assert!(frame >= 3 * events, "{frame} bytes");
    }

    #[test]
    fn probe_rows_count_sessions() {
        let j: Value = serde_json::from_str(
            r#"{"schema":"vmtsync-probe-bench/1","tsc_khz":2600000,"tsc_khz_source":"agent",
            "sessions":3,"probes":64,"run_time_s":1.0,
            "wire":{"builtin":{"request":[4,4],"reply":[10,11]},"qemu":null},
            "system_level":null,
            "rows":[{"name":"builtin/exit-tight","sessions":3,"ours_median_err":2600,
            "ours_max_err":5200,"tc_median_err":2600,"ratio":1.0,"drift_ratio":null,
            "goal_met":false,"contains":3,"drift_contains":3,"rtt_min":1,"rtt_median":2},
            {"name":"skew/exit-tight","sessions":3,"ours_median_err":9,"drift_median_err":10,
            "tc_median_err":40,"ratio":0.2,"drift_ratio":0.25,"goal_met":true,"contains":0,
            "drift_contains":2,"rtt_min":1,"rtt_median":2}]}"#,
        )
        .expect("json");
        let s = probe_section(&j).expect("renders");
        assert!(s.body.contains("3 sessions per path"), "{}", s.body);
        assert!(s.body.contains("2,600 (1,000 ns)"), "{}", s.body);
        assert!(
            s.body.contains("| 2/3 |"),
            "drift bounds count for skew rows"
        );
        assert_eq!(s.summary[0][2], "5/6 sessions");
        assert_eq!(s.summary[1][2], "met on 1 of 2 paths");
    }
}
