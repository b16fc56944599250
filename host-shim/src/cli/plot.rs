//! `vmtsync plot`: the command's glue; the drawing is in [`crate::plot`].

use std::path::{Path, PathBuf};

use clap::Args;

use super::exit::CliError;
use crate::plot::plot_sync_file;

/// `vmtsync plot` flags.
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("sync_input").required(true).args(["sync", "sync_file"]))]
pub struct PlotArgs {
    /// The sync file to draw (`vmtsync probe --continuous --out FILE`); one still being
    /// written is read up to its last complete line. Also accepted as the positional
    /// SYNCFILE of earlier versions (not both).
    #[arg(long, value_name = "SYNCFILE")]
    pub sync: Option<PathBuf>,
    /// The old spelling of --sync: a positional SYNCFILE.
    #[arg(value_name = "SYNCFILE", hide = true)]
    pub sync_file: Option<PathBuf>,
    /// The SVG file to write (written beside it and renamed into place).
    #[arg(long, value_name = "FILE.svg")]
    pub out: PathBuf,
    /// A true offset (guest - host ticks) known from elsewhere, e.g. `vmtsync kvm`'s exact
    /// tsc-offset: drawn as a dashed line on every panel.
    #[arg(long, value_name = "TICKS", allow_negative_numbers = true)]
    pub truth: Option<i64>,
}

impl PlotArgs {
    /// The sync file, from --sync or the positional SYNCFILE (clap lets exactly one through).
    pub(super) fn sync_path(&self) -> &Path {
        self.sync
            .as_deref()
            .or(self.sync_file.as_deref())
            .unwrap_or(Path::new(""))
    }
}

/// `vmtsync plot`: draws the sync file and says what it drew on stderr.
///
/// # Errors
/// [`CliError::Plot`].
pub fn run_plot_cmd(args: &PlotArgs) -> Result<(), CliError> {
    let summary = plot_sync_file(args.sync_path(), &args.out, args.truth)?;
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
