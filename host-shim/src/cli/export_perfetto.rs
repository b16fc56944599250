//! `vmtsync export perfetto`: a recording's events as a Perfetto trace; the work is in
//! [`crate::formats::perfetto`].

use std::path::PathBuf;

use clap::Args;

use super::exit::CliError;
use crate::formats::InputKind;
use crate::formats::perfetto::{self, DEFAULT_MACHINE_ID, ExportSummary};

/// `vmtsync export perfetto` flags.
#[derive(Debug, Args)]
pub struct PerfettoArgs {
    /// The recording: JSON Lines (`record --format jsonl`, with guaranteed intervals) or a
    /// trace.dat from `vmtsync record`.
    #[arg(long, value_name = "IN")]
    pub from: PathBuf,
    /// The Perfetto trace to write (written beside it, renamed into place when complete).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// The guest's machine id in the trace (the host is 0).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MACHINE_ID, value_parser = clap::value_parser!(u32).range(1..))]
    pub machine_id: u32,
    /// The name of the guest's process track.
    #[arg(long, value_name = "NAME", default_value = "vmtsync guest")]
    pub name: String,
    /// How span records' function addresses are named.
    #[command(flatten)]
    pub names: super::spans::SpanArgs,
}

/// Runs `vmtsync export perfetto`.
pub(super) fn run_export_perfetto(a: &PerfettoArgs) -> Result<(), CliError> {
    let s = perfetto::export_file(&a.from, &a.out, a.machine_id, &a.name, &a.names.config()?)?;
    eprintln!("{}", perfetto_summary(&s, &a.out));
    Ok(())
}

/// The summary line(s) of `export perfetto`.
fn perfetto_summary(s: &ExportSummary, out: &std::path::Path) -> String {
    let t = &s.trace;
    let what = match s.input {
        InputKind::Jsonl => "with guest TSCs and guaranteed intervals",
        InputKind::TraceDatShifted => "with guest TSCs, no intervals (not in a trace.dat)",
        InputKind::TraceDatHost => "host times only (a pre-converted trace.dat)",
    };
    let mut m = format!(
        "vmtsync export perfetto: {} events on {} vCPU track(s) {what}, {} bytes -> {}; \
         BOOTTIME from clock snapshots taken now: timestamps within {} ns of the host's \
         BOOTTIME by the snapshots' resolution",
        t.events,
        t.vcpus,
        t.bytes,
        out.display(),
        t.max_error_ns
    );
    if t.unmappable > 0 {
        m.push_str(&format!(
            "; {} events skipped (outside BOOTTIME's range)",
            t.unmappable
        ));
    }
    m
}
