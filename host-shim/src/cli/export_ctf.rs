//! `vmtsync export ctf`: the command's glue; the work is in [`crate::formats::ctf`].

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::exit::CliError;
use crate::formats::{self, ctf};

/// `vmtsync export ctf` flags.
#[derive(Debug, Args)]
pub struct CtfArgs {
    /// The recording: `vmtsync record` JSON Lines or trace.dat (recognised by content).
    #[arg(long = "from", value_name = "IN")]
    pub from: PathBuf,
    /// The trace directory to write (must not exist, or be empty).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// The host TSC frequency in Hz for the clock class (default: from CPUID). Traces meant
    /// to line up in babeltrace2 must use the same.
    #[arg(long, value_name = "HZ", value_parser = clap::value_parser!(u64).range(1..))]
    pub tsc_hz: Option<u64>,
    /// The input is a host trace.dat (x86-tsc clock): export these host events instead, on
    /// the same clock as a guest trace, so babeltrace2 lines both up.
    #[arg(long, value_enum, value_name = "EVENTS")]
    pub host_events: Option<HostEvents>,
    /// How span records' function addresses are named.
    #[command(flatten)]
    pub names: super::spans::SpanArgs,
}

/// `--host-events`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum HostEvents {
    /// `kvm:kvm_pio`: the guests' port I/O exits.
    #[value(name = "kvm_pio")]
    KvmPio,
}

/// The clock and names for a trace written from `input` to `out`.
///
/// # Errors
/// No `--tsc-hz` and CPUID reports no TSC frequency.
pub fn ctf_options(
    tsc_hz: Option<u64>,
    input: &str,
    out: &std::path::Path,
) -> Result<ctf::CtfOptions, CliError> {
    let tsc_hz = match tsc_hz {
        Some(hz) => hz,
        None => ctf::host_tsc_hz()?,
    };
    Ok(ctf::CtfOptions {
        tsc_hz,
        name: out
            .file_name()
            .map_or_else(|| "vmtsync".into(), |n| n.to_string_lossy().into_owned()),
        env: vec![("vmtsync_input".into(), input.to_owned())],
    })
}

pub(super) fn run_export_ctf(a: &CtfArgs) -> Result<(), CliError> {
    let opts = ctf_options(a.tsc_hz, &a.from.display().to_string(), &a.out)?;
    if a.host_events == Some(HostEvents::KvmPio) {
        let s = ctf::export_kvm_pio(&a.from, &a.out, &opts)?;
        if let Some(c) = &s.stated_clock {
            eprintln!(
                "vmtsync: warning: {} states the trace clock {c:?} (trace-cmd 3.1.6 `extract -B` \
                 states \"local\" for an instance on any clock); its timestamps are taken as \
                 x86-tsc ticks: record the host trace with the x86-tsc clock",
                a.from.display()
            );
        }
        eprintln!(
            "vmtsync: wrote {} kvm_pio exits in {} streams to {} (clock host_tsc at {} Hz){}",
            s.ctf.events,
            s.ctf.streams,
            s.ctf.dir.display(),
            opts.tsc_hz,
            note(s.undecodable, |n| format!(
                "; skipped {n} kvm_pio records that did not decode"
            ))
        );
        return Ok(());
    }
    let src = formats::open(&a.from)?;
    let kind = src.kind();
    let s = ctf::export_guest(src, &a.out, &opts, &a.names.config()?)?;
    let known = match kind {
        formats::InputKind::Jsonl => "guest TSC, host TSC and guaranteed interval",
        formats::InputKind::TraceDatShifted => {
            "guest TSC and host TSC (no interval in a trace.dat)"
        }
        formats::InputKind::TraceDatHost => {
            "host TSC only (a pre-converted trace.dat has no guest TSC and no interval)"
        }
    };
    eprintln!(
        "vmtsync: wrote {} events in {} streams to {} ({known}; clock host_tsc at {} Hz){}",
        s.events,
        s.streams,
        s.dir.display(),
        opts.tsc_hz,
        note(s.raised, |n| format!(
            "; {n} timestamps raised to their stream's previous one to stay in order (their host_tsc field is exact)"
        ))
    );
    Ok(())
}

/// The summary line's note on `n` events of one kind (`text` of them), empty for none.
fn note(n: u64, text: impl FnOnce(u64) -> String) -> String {
    if n > 0 { text(n) } else { String::new() }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::cli::Cli;

    #[test]
    fn export_ctf_parses_its_contract_forms() {
        let p =
            |args: &[&str]| Cli::try_parse_from(["vmtsync", "export", "ctf"].iter().chain(args));
        assert!(p(&["--from", "g.jsonl", "--out", "t"]).is_ok());
        assert!(p(&["--from", "h.dat", "--out", "t", "--host-events", "kvm_pio"]).is_ok());
        assert!(p(&["--from", "g.dat", "--out", "t", "--tsc-hz", "2300000000"]).is_ok());
        assert!(p(&["--from", "g.dat"]).is_err(), "--out is required");
        assert!(p(&["--out", "t"]).is_err(), "--from is required");
        assert!(p(&["--from", "g", "--out", "t", "--tsc-hz", "0"]).is_err());
        assert!(p(&["--from", "g", "--out", "t", "--host-events", "kvm_exit"]).is_err());
    }
}
