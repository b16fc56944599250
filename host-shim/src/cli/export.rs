//! `vmtsync export FORMAT ...`: a recording or a VM's mapping in another tool's terms. One
//! module per format.

use clap::Subcommand;

use super::exit::CliError;
use super::export_ctf::{CtfArgs, run_export_ctf};
use super::export_perf::{PerfArgs, run_export_perf};
use super::export_perfetto::{PerfettoArgs, run_export_perfetto};

/// `vmtsync export` formats.
#[derive(Debug, Subcommand)]
pub enum ExportCommand {
    /// A CTF 1.8 trace directory for babeltrace2 / Trace Compass, on the host's TSC.
    ///
    /// From a recording (`vmtsync record` JSON Lines or trace.dat): event class
    /// `vmtsync:event` with id, vcpu, host_tsc, guest_tsc and host_lo/host_hi when the input
    /// has them, payload; one stream per vCPU. Timestamps are host TSC cycles on an absolute
    /// clock of the host's TSC frequency (`babeltrace2 --clock-cycles DIR` shows them as
    /// recorded).
    #[command(after_help = super::exit::EXIT_CODES)]
    Ctf(CtfArgs),
    /// The `perf inject --guest-data=PATH,PID,OFFSET[,SCALE]` argument for a VM's live KVM
    /// mapping, when perf can express it (one constant offset, an integer scale); otherwise
    /// what perf cannot express and the error it would make (exit 6).
    ///
    /// perf converts a guest TSC as `host = (guest - OFFSET) / SCALE` (tools/perf
    /// builtin-inject.c), the inverse of KVM's `guest = offset + host * ratio >> frac`.
    /// OFFSET is in TSC ticks: perf works in TSC units when both perf.data files carry a
    /// TIME_CONV record (a perf clock on the native TSC), else on their timestamps as they
    /// are. It injects the guest's side-band records (mmap, comm, task, switches), not its
    /// samples, and needs QEMU's `-name …,debug-threads=on` vCPU thread names (docs/perf.md).
    #[command(after_help = super::exit::EXIT_CODES)]
    Perf(PerfArgs),
    /// A Perfetto protobuf trace (open it in ui.perfetto.dev), on the host's CLOCK_BOOTTIME.
    ///
    /// One track per vCPU under a separate machine; each event an instant `event <id>` with
    /// host_tsc, guest_tsc, before_ns/after_ns (its guaranteed interval on
    /// BOOTTIME, as distances from its timestamp) and payload as arguments. The host TSC is mapped to BOOTTIME by two clock
    /// snapshots taken now, so the recording must come from this host since its last boot;
    /// the summary gives the worst-case error this leaves (it grows with the recording's age:
    /// `record --format perfetto` snapshots while recording instead).
    #[command(after_help = super::exit::EXIT_CODES)]
    Perfetto(PerfettoArgs),
}

/// Runs one `vmtsync export` command.
pub(super) fn run_export(c: &ExportCommand) -> Result<(), CliError> {
    match c {
        ExportCommand::Ctf(a) => run_export_ctf(a),
        ExportCommand::Perf(a) => run_export_perf(a),
        ExportCommand::Perfetto(a) => run_export_perfetto(a),
    }
}
