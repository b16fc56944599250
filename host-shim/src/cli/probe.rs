//! `vmtsync probe`: the command's glue; the work is in [`crate::probe`].

use std::io::{self, Write};

use super::exit::CliError;
use super::signals::{install_stop_handler, stop_flag};
use crate::probe::{self, ProbeArgs};

/// `vmtsync probe`: SIGINT/SIGTERM end continuous mode after the current round, and abandon
/// anything else (connect, hello, a round) with exit code 130/143.
pub(super) fn run_probe_cmd(a: &ProbeArgs) -> Result<(), CliError> {
    install_stop_handler();
    let opts = a.to_options(Some(stop_flag()));
    let mut out = io::stdout().lock();
    probe::run_probe(&opts, &mut out)?;
    out.flush()?;
    Ok(())
}
