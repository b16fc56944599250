//! The top-level parser and dispatch: `vmtsync <command>`, and `main`'s exit-code mapping.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use super::attach::{TraceCmdCommand, run_trace_cmd};
use super::convert::{ConvertArgs, run_convert};
use super::exit::{CliError, EXIT_CODES};
use super::export::{ExportCommand, run_export};
use super::kvm::{KvmArgs, run_kvm};
use super::plot::{PlotArgs, run_plot_cmd};
use super::probe::ProbeArgs;
use super::probe::run_probe_cmd;
use super::record::{RecordArgs, run_record_cmd};
use super::spans::{SpansArgs, run_spans_cmd};
use super::tsc::{TscCommand, run_tsc};
use super::validate::{ValidateArgs, run_validate_cmd};

/// vmtsync: exact host<->guest TSC mappings from KVM, for putting VM trace events on the host
/// timeline.
#[derive(Debug, Parser)]
#[command(name = "vmtsync", bin_name = "vmtsync", version, after_help = EXIT_CODES)]
pub struct Cli {
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List VMs and each vCPU's exact TSC mapping from KVM debugfs (or watch it change).
    ///
    /// For each vCPU: guest_tsc = tsc_offset + (host_tsc * tsc_scaling_ratio) >> tsc_frac_bits,
    /// true at some host TSC in [host_tsc_before, host_tsc_after]. vCPU numbers are the VMM's
    /// vCPU ids (debugfs `vcpuN`), not guest CPU indexes. A vCPU with guest_mode=1 runs a
    /// nested guest: its values are the combined L0->L2 mapping, not its VM's. A host without
    /// TSC scaling has no tsc-scaling-ratio files: the vCPU then shows ratio 1, frac bits 0
    /// (identity, scaling_present=false), which `tsc compose` accepts with any other side.
    ///
    /// JSON (--json, schema 1): {"schema":1,"vms":[{"pid","fd","name","vcpus":[{"vcpu",
    /// "tsc_offset","tsc_scaling_ratio","tsc_frac_bits","scaling_present","guest_mode",
    /// "thread_pid","host_tsc_before","host_tsc_after"}]}]}.
    #[command(after_help = EXIT_CODES)]
    Kvm(KvmArgs),
    /// Convert TSC values read from stdin, one decimal per line (guest -> host by default).
    ///
    /// The mapping is given (--offset [--ratio --frac-bits]) or read from debugfs
    /// (--vm --vcpu). Streams with constant memory; the first bad line stops it with its line
    /// number unless --skip-bad.
    #[command(after_help = EXIT_CODES)]
    Convert(ConvertArgs),
    /// Measure a guest's TSC offset (and drift) with ping-pong probes against the vmtsync guest
    /// agent, with guaranteed bounds and trace-cmd's estimate on the same samples.
    ///
    /// JSON (--json, schema 2): one object per round with schema, vcpu, offset_ticks, bound_lo,
    /// bound_hi (guaranteed for any constant rate in [1/2, 2]), model, rate1_lo, rate1_hi
    /// (if the rate is exactly 1), at_host_tsc, drift_ppb(_lo/_hi), rtt_*_ticks, probes, sent,
    /// lost_probes, bad_frames, stale_replies, tracecmd_fastest_rtt_offset, tsc_khz.
    #[command(after_help = EXIT_CODES)]
    Probe(ProbeArgs),
    /// Record the guest agent's events into a trace file, synced to the host's TSC: one
    /// session of probe rounds (every --resync-ms) and event drains.
    ///
    /// trace-cmd format: a trace.dat (v7, or v6) with an event system `vmtsync`, one trace CPU
    /// for the vCPU, raw guest TSC timestamps (x86-tsc) and a TIME_SHIFT holding the sync
    /// segments — or timestamps pre-converted to host TSC when the guest's TSC rate differs from
    /// the host's (then said in the file's uname). jsonl format: one object per event:
    /// {"schema":1,"vcpu","id","guest_tsc","host_tsc","host_lo","host_hi","payload","round"}
    /// with [host_lo, host_hi] its guaranteed interval. ctf format: a CTF 1.8 directory for
    /// babeltrace2 on the host's TSC (docs/ctf.md). perfetto format: a Perfetto trace on the
    /// host's CLOCK_BOOTTIME, one track per vCPU (docs/perfetto.md). SIGINT/SIGTERM end the
    /// recording cleanly; everything received is written.
    #[command(after_help = EXIT_CODES)]
    Record(Box<RecordArgs>),
    /// Draw a sync file as an SVG: per vCPU, the offset estimate and its guaranteed interval
    /// over host time, exit-anchored and in-process segments in their own colours, segment
    /// breaks marked.
    #[command(after_help = EXIT_CODES)]
    Plot(PlotArgs),
    /// Check a guest's events against the host's kvm_pio exits: every event a --before
    /// ID:PORT rule names must convert to a host time at or before the guest's next I/O on
    /// PORT, every --after event at or after its previous one (--port PORT: the bundled
    /// agent's workload); converted with a sync file, or as `vmtsync record --format jsonl`
    /// converted them. Prints violations, the lag distribution and each segment's worst
    /// case, and exits 9 on any violation.
    ///
    /// JSON (--json, schema 3): {"schema","rules","conversion","checked","before_out",
    /// "after_in","violations","bound_violations","unmatched_events","unconverted_events",
    /// "unpaired_exits","numbering" ("from-boot"|"nearest"),"lag","lag_before_out",
    /// "lag_after_in" (each {"min","p1","median","p99","max"} or null),"segments":[{"vcpu",
    /// "round","events","worst_lag","violations","width"}],"first_violations":[…],"probes"}
    /// (docs/validate.md).
    #[command(after_help = EXIT_CODES)]
    Validate(ValidateArgs),
    /// A recording's spans: the guest's named phases and function calls (span records, e.g.
    /// from `-finstrument-functions`), paired on the host timeline and named from the
    /// guest's ELF image (`--symbols`, relocations undone).
    ///
    /// Prints the longest spans with the guaranteed interval of each duration, the spans the
    /// guest was inside when the recording ended (open: their exit never came, as in a hang),
    /// and the last spans closed before that. An exit whose entry was not seen, or an entry
    /// whose exit will never come, is shown with its one end, never with a duration
    /// (docs/spans.md). --out writes every span as a JSON line.
    #[command(after_help = EXIT_CODES)]
    Spans(SpansArgs),
    /// TSC mapping arithmetic.
    #[command(subcommand)]
    Tsc(TscCommand),
    /// Export a recording to another tool's format.
    #[command(subcommand)]
    Export(ExportCommand),
    /// trace-cmd pipelines for Linux guests (`attach`: a guest trace.dat onto the host's
    /// timeline).
    #[command(subcommand, name = "trace-cmd")]
    TraceCmd(TraceCmdCommand),
}

/// Parses the process arguments, runs the command and maps the outcome to an exit code;
/// errors go to stderr as `vmtsync: …`.
#[must_use]
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_broken_pipe() => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vmtsync: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// Runs a parsed command line against the real stdin/stdout/stderr.
///
/// # Errors
/// Any [`CliError`].
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Kvm(a) => run_kvm(&a),
        Command::Convert(a) => run_convert(&a),
        Command::Probe(a) => run_probe_cmd(&a),
        Command::Record(a) => run_record_cmd(&a),
        Command::Plot(a) => run_plot_cmd(&a),
        Command::Validate(a) => run_validate_cmd(&a),
        Command::Spans(a) => run_spans_cmd(&a),
        Command::Tsc(c) => run_tsc(&c),
        Command::Export(c) => run_export(&c),
        Command::TraceCmd(c) => run_trace_cmd(&c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_contract_forms() {
        let p = |args: &[&str]| Cli::try_parse_from(args.iter().copied());
        assert!(p(&["vmtsync", "kvm", "--json", "--vm", "123"]).is_ok());
        assert!(
            p(&[
                "vmtsync",
                "kvm",
                "--watch",
                "--interval-ms",
                "50",
                "--trace-events"
            ])
            .is_ok()
        );
        assert!(
            p(&["vmtsync", "kvm", "--interval-ms", "50"]).is_err(),
            "--interval-ms needs --watch"
        );
        assert!(p(&["vmtsync", "convert", "--offset", "-5"]).is_ok());
        assert!(
            p(&[
                "vmtsync",
                "convert",
                "--offset",
                "-5",
                "--ratio",
                "3",
                "--frac-bits",
                "1",
                "--to",
                "guest"
            ])
            .is_ok()
        );
        assert!(
            p(&["vmtsync", "convert", "--offset", "1", "--ratio", "3"]).is_err(),
            "ratio needs frac bits"
        );
        assert!(p(&["vmtsync", "convert", "--vm", "web", "--vcpu", "2"]).is_ok());
        assert!(
            p(&["vmtsync", "convert", "--vm", "web"]).is_err(),
            "--vm needs --vcpu"
        );
        assert!(p(&["vmtsync", "convert"]).is_err(), "a mapping is required");
        assert!(
            p(&[
                "vmtsync", "convert", "--offset", "1", "--vm", "1", "--vcpu", "0"
            ])
            .is_err()
        );
        assert!(
            p(&[
                "vmtsync", "tsc", "compose", "--l1", "-5,1,0", "--l2", "7,1,0", "--json"
            ])
            .is_ok()
        );
        assert!(p(&["vmtsync", "convert", "--sync", "s.jsonl", "--vcpu", "0"]).is_ok());
        assert!(
            p(&["vmtsync", "convert", "--sync", "s.jsonl"]).is_err(),
            "--sync needs --vcpu"
        );
        for extra in [&["--offset", "5"][..], &["--vm", "1"], &["--to", "guest"]] {
            let mut args = vec!["vmtsync", "convert", "--sync", "s", "--vcpu", "0"];
            args.extend_from_slice(extra);
            assert!(p(&args).is_err(), "--sync conflicts with {extra:?}");
        }
        assert!(
            p(&["vmtsync", "convert", "--offset", "5", "--vcpu", "0"]).is_err(),
            "--vcpu is meaningless with --offset"
        );
        assert!(
            p(&[
                "vmtsync",
                "probe",
                "--connect",
                "unix:/tmp/x.sock",
                "--json",
                "--probes",
                "10",
                "--timeout-ms",
                "500"
            ])
            .is_ok()
        );
        assert!(p(&["vmtsync", "probe"]).is_err(), "--connect is required");
        assert!(p(&["vmtsync", "plot", "--sync", "s.jsonl", "--out", "s.svg"]).is_ok());
        assert!(
            p(&["vmtsync", "plot", "--sync", "s.jsonl"]).is_err(),
            "--out is required"
        );
        assert!(
            p(&["vmtsync", "plot", "--out", "s.svg"]).is_err(),
            "the sync file is required"
        );
        assert!(
            p(&[
                "vmtsync", "plot", "s.jsonl", "--sync", "t", "--out", "s.svg"
            ])
            .is_err(),
            "the sync file twice"
        );
    }
}
