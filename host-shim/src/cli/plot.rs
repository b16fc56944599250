//! `vmtsync plot`: the command's glue; the drawing is in [`crate::plot`].

use std::path::PathBuf;

use clap::Args;

use super::exit::CliError;
use crate::plot::plot_sync_file;

/// `vmtsync plot` flags.
#[derive(Debug, Args)]
pub struct PlotArgs {
    /// The sync file to draw (`vmtsync probe --continuous --out FILE`); one still being
    /// written is read up to its last complete line.
    #[arg(value_name = "SYNCFILE")]
    pub sync: PathBuf,
    /// The SVG file to write (written beside it and renamed into place).
    #[arg(long, value_name = "FILE.svg")]
    pub out: PathBuf,
    /// A true offset (guest - host ticks) known from elsewhere, e.g. `vmtsync kvm`'s exact
    /// tsc-offset: drawn as a dashed line on every panel.
    #[arg(long, value_name = "TICKS", allow_negative_numbers = true)]
    pub truth: Option<i64>,
}

/// `vmtsync plot`: draws the sync file and says what it drew on stderr.
///
/// # Errors
/// [`CliError::Plot`].
pub fn run_plot_cmd(args: &PlotArgs) -> Result<(), CliError> {
    let summary = plot_sync_file(&args.sync, &args.out, args.truth)?;
    let cut = if summary.cut_bytes > 0 {
        format!(
            " (cut {} bytes of an incomplete last line: a writer is still appending)",
            summary.cut_bytes
        )
    } else {
        String::new()
    };
    eprintln!(
        "vmtsync: wrote {}: {} segments of {} vCPU(s){cut}",
        args.out.display(),
        summary.segments,
        summary.vcpus
    );
    Ok(())
}
