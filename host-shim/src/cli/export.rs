//! `vmtsync export FORMAT ...`: a finished recording into another tool's format. One module
//! per format; the work is in [`crate::export`].

use clap::Subcommand;

use super::exit::CliError;
use super::export_ctf::{CtfArgs, run_export_ctf};

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
}

/// Runs one `vmtsync export` command.
pub(super) fn run_export(c: &ExportCommand) -> Result<(), CliError> {
    match c {
        ExportCommand::Ctf(a) => run_export_ctf(a),
    }
}
