//! `vmtsync export FORMAT ...`: a recording or a VM's mapping in another tool's terms. One
//! module per format.

use clap::Subcommand;

use super::exit::CliError;
use super::export_perf::{PerfArgs, run_export_perf};

/// `vmtsync export` formats.
#[derive(Debug, Subcommand)]
pub enum ExportCommand {
    /// The `perf inject --guest-data=PATH,PID,OFFSET[,SCALE]` argument for a VM's live KVM
    /// mapping, when perf can express it (one constant offset, an integer scale); otherwise
    /// what perf cannot express and the error it would make (exit 6).
    ///
    /// perf converts a guest TSC as `host = (guest - OFFSET) / SCALE` (tools/perf
    /// builtin-inject.c), the inverse of KVM's `guest = offset + host * ratio >> frac`.
    #[command(after_help = super::exit::EXIT_CODES)]
    Perf(PerfArgs),
}

/// Runs one `vmtsync export` command.
pub(super) fn run_export(c: &ExportCommand) -> Result<(), CliError> {
    match c {
        ExportCommand::Perf(a) => run_export_perf(a),
    }
}
