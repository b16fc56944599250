//! `cargo xtask …`: project automation (rust-analyzer style: few dependencies, plain std).
//!
//! Subcommands:
//! - `ci`: everything CI checks, in order (including a `bench --quick` smoke run); collects every
//!   failure, then reports them all.
//! - `check-nostd`: build `vmtsync-core` for `x86_64-unknown-none`, with and without `defmt`.
//! - `bench [--quick] [--fuzz-long]`: run every benchmark and regenerate BENCHMARKS.md from that
//!   run (`bench.rs`).
//! - `bench-probe`: the real-KVM probe benchmark (`vmtsync-probe-bench`), table and JSON.
//! - `fuzz [--long]`: the `ci` fuzz smoke run on its own, or >= 10 M inputs per target.
//! - `build-agent`: build the bare-metal guest agent, print its ELF path and `.text` size.
//! - `run-agent`: boot the agent under QEMU or the built-in VMM, COM1 on this terminal.
//! - `demo`: boot the agent with a software skew, read its KVM mapping from debugfs, probe it,
//!   print both with the truth (debugfs composed with the skew; text or `--json`); fails when
//!   the truth is outside the probe's bounds. Installs what it needs on a fresh machine.
//! - `setup`: install what the tier-2 tests need on a fresh machine (rustup target, Debian
//!   packages, debugfs mount).

mod agent;
mod bench;
mod bench_scan;
mod demo;
mod fuzz;
mod probe_bench;
mod setup;

use std::env;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{Result, bail};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = env::args().skip(1).collect();
    let (cmd, rest) = match args.split_first() {
        Some((c, r)) => (c.as_str(), r),
        None => ("help", &[][..]),
    };
    match cmd {
        "ci" => ci(rest),
        "check-nostd" => check_nostd(),
        "bench" => bench::bench(rest),
        "bench-probe" => probe_bench::bench_probe(rest),
        "bench-scan" => bench_scan::bench_scan(rest),
        "fuzz" => fuzz::fuzz(rest),
        "setup" => setup::setup(),
        "build-agent" => agent::build_agent(),
        "run-agent" => agent::run_agent(rest),
        "demo" => demo::demo(rest),
        "help" | "--help" | "-h" => {
            println!("{HELP}");
            Ok(())
        }
        other => bail!("unknown subcommand `{other}`\n\n{HELP}"),
    }
}

pub(crate) const HELP: &str = "\
usage: cargo xtask <command>

commands:
  ci            fmt, clippy, tests (incl. tier 2 on real KVM), demo, no_std build, fuzz smoke run
  check-nostd   build vmtsync-core for x86_64-unknown-none, with and without defmt
  bench [--quick] [--fuzz-long] [--sessions K] [--out PATH]
                run every benchmark once (criterion benches, trace.dat RSS, bench-scan,
                bench-probe with K sessions, agent size) and write BENCHMARKS.md from that
                run; --fuzz-long also runs `fuzz --long` (else its last recorded results are
                shown, dated); --quick is ci's smoke run (writes target/BENCHMARKS.quick.md)
  bench --record-fuzz [--fuzz-target NAME]
                only run `fuzz --long` (one target with --fuzz-target) and record its
                results for the next `bench`
  bench-scan [--vms N] [--vcpus N] [--runs N]
                median wall time of `vmtsync kvm --json` over a generated debugfs tree
  bench-probe [--sessions K] [--probes N] [--machine microvm|q35] [--no-qemu] [--no-skew]
                real-KVM probe benchmark: our estimator vs trace-cmd fastest-RTT on the same
                samples (built-in VMM, QEMU stdio, software skew); table + JSON line
  fuzz [--long] [--target NAME]
                build the core/fuzz and host-shim/fuzz targets and run each from its seeds
                for 20 s (the ci fuzz step), or for 10 M inputs with --long; one
                `fuzz-result` key=value line per target (runs, crashes, timeouts, ...)
  setup         install tier-2 prerequisites (rustup target, apt packages, debugfs mount,
                Perfetto's trace processor)
  build-agent   build guest-agent/ (release, x86_64-unknown-none); print ELF path, .text size
  run-agent [--vmm qemu|builtin] [--machine microvm|q35] [--timeout SECS] [-- AGENT OPTIONS]
                boot the agent; COM1 on this terminal, COM2 defmt log decoded on stderr.
                Agent options: transport=uart wire=postcard|line ring=0|3 exit=N events=N
                syncport=N|off skew=OFFSET,RATIO,FRAC (first value: the default);
                with `-- wire=line` type p (probe: T<hex tsc>) and q (quit)
  run-agent --transport vsock [--machine microvm|q35] [--timeout SECS] [-- AGENT OPTIONS]
                QEMU + vhost-user-vsock + vhost-device-vsock (installed on first use): the
                agent connects to host port 1234 (`-- vsock=listen`: the host connects to
                it), 100 probes run over the stream
  demo [--json] [--vmm auto|qemu|builtin|sim] [--no-skew] [--smp N]
                the first command on a fresh clone: installs the rustup target (and QEMU via
                apt when root), boots the agent (QEMU, else the built-in VMM, else a loopback
                simulation) with a skew derived from the host TSC, reads its vCPU's mapping
                from KVM debugfs (`vmtsync kvm`), probes it (`vmtsync probe`), prints
                method/offset/interval/truth/error, and fails when the truth (debugfs mapping
                then skew) is outside the interval; JSON: {\"schema\":1,\"vmm\",\"transport\",
                \"skew\":{\"offset\",\"ratio\",\"frac_bits\"}|null,\"vcpus\":[{\"vcpu\",
                \"method\":\"kvm\"|\"probe\",\"offset_ticks\",\"bound_lo\",\"bound_hi\",\"truth_ticks\",
                \"error_ticks\",\"at_host_tsc\"}],\"skews\":[...]}; under QEMU the guest
                has --smp N vCPUs (default 2), each with its own skew, probed on itself
                (`vmtsync probe --all-vcpus`): a kvm row and a probe row per vCPU

environment:
  CI=true       a missing tier-2 prerequisite fails the run instead of skipping (the demo never
                falls back to its simulation)";

/// The workspace root (the parent of `xtask/`).
pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

pub(crate) use vmtsync_launch::is_ci;
pub(crate) use vmtsync_launch::prereq::display;

/// Runs `cmd`, echoing it first; fails if it exits non-zero.
pub(crate) fn sh(cmd: &mut Command) -> Result<()> {
    Ok(vmtsync_launch::prereq::run_echoed(cmd)?)
}

pub(crate) fn cargo() -> Command {
    let mut c = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn ci(_args: &[String]) -> Result<()> {
    type Step = (&'static str, fn() -> Result<()>);
    let steps: &[Step] = &[
        ("setup", setup::setup),
        ("fmt", || sh(cargo().args(["fmt", "--all", "--check"]))),
        ("clippy", || {
            sh(cargo().args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--all-features",
                "--",
                "-D",
                "warnings",
            ]))
        }),
        ("tests", || {
            // Tier-2 tests look at CI to decide between "skip with a reason" and "fail".
            sh(cargo().args(["test", "--workspace", "--all-features", "--no-fail-fast"]))
        }),
        // The README's first command, end to end: real VM, skewed agent, truth from debugfs.
        // Under CI=true it fails instead of falling back to the simulation.
        ("demo", || demo::demo(&[])),
        ("demo --firmware", || demo::demo(&["--firmware".into()])),
        ("no_std build", check_nostd),
        ("guest agent", agent::ci_check),
        ("minimal kernel", agent::ci_check_minimal_kernel),
        ("benches compile", || {
            sh(cargo().args(["bench", "--workspace", "--no-run"]))
        }),
        // `cargo xtask bench --quick` into a temporary file: every benchmark runs (from the
        // binaries the steps above built) and the generator fills every section.
        ("bench smoke", || {
            let out =
                std::env::temp_dir().join(format!("vmtsync-bench-quick-{}.md", std::process::id()));
            let result =
                bench::bench(&["--quick".into(), "--out".into(), out.display().to_string()]);
            let _ = std::fs::remove_file(&out);
            result
        }),
        ("fuzz", fuzz::smoke),
    ];

    let mut failed = Vec::new();
    for (name, step) in steps {
        let t = Instant::now();
        eprintln!("\n==> {name}");
        match step() {
            Ok(()) => eprintln!("==> {name}: ok ({:.1?})", t.elapsed()),
            Err(e) => {
                eprintln!("==> {name}: FAILED: {e:#}");
                failed.push(*name);
            }
        }
    }
    if failed.is_empty() {
        eprintln!("\nci: all {} steps passed", steps.len());
        Ok(())
    } else {
        bail!(
            "{} of {} steps failed: {}",
            failed.len(),
            steps.len(),
            failed.join(", ")
        )
    }
}

fn check_nostd() -> Result<()> {
    vmtsync_launch::prereq::ensure_rustup_target(&root())?;
    for features in [&[][..], &["--features", "defmt"][..]] {
        sh(cargo()
            .args([
                "build",
                "-p",
                "vmtsync-core",
                "--target",
                "x86_64-unknown-none",
            ])
            .args(features))?;
    }
    Ok(())
}
