//! `vmtsync export ctf`: the command's glue; the work is in [`crate::export::ctf`].

use std::path::PathBuf;

use clap::Args;

use super::exit::CliError;
use crate::export::{self, ctf};

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
    let src = export::open(&a.from)?;
    let kind = src.kind();
    let s = ctf::export_guest(src, &a.out, &opts)?;
    let known = match kind {
        export::InputKind::Jsonl => "guest TSC, host TSC and guaranteed interval",
        export::InputKind::TraceDatShifted => "guest TSC and host TSC (no interval in a trace.dat)",
        export::InputKind::TraceDatHost => {
            "host TSC only (a pre-converted trace.dat has no guest TSC and no interval)"
        }
    };
    eprintln!(
        "vmtsync: wrote {} events in {} streams to {} ({known}; clock host_tsc at {} Hz){}",
        s.events,
        s.streams,
        s.dir.display(),
        opts.tsc_hz,
        if s.raised > 0 {
            format!(
                "; {} timestamps raised to their stream's previous one to stay in order (their host_tsc field is exact)",
                s.raised
            )
        } else {
            String::new()
        }
    );
    Ok(())
}
