//! `--host-trace` and `--host-out`: a copy of the host's trace.dat with the GUEST option, the
//! same two flags on `record` and `trace-cmd attach`.

use std::path::PathBuf;

use clap::Args;

/// The host trace to pair with the guest's, and where its copy goes.
#[derive(Clone, Debug, PartialEq, Eq, Args)]
pub struct HostCopyArgs {
    /// A host trace.dat (trace-cmd extract, x86-tsc clock) to pair with the guest trace: a copy
    /// of it with the GUEST option (the guest's name, its trace id, vCPU -> host thread) is
    /// written to --host-out, so `trace-cmd report -i HOST_OUT.dat -i GUEST.dat` shows both
    /// (GUEST.dat: the guest trace.dat this command writes).
    #[arg(long, value_name = "HOST.dat", requires = "host_out")]
    pub host_trace: Option<PathBuf>,
    /// Where the host trace's copy goes (the input is never modified).
    #[arg(long, value_name = "HOST_OUT.dat", requires = "host_trace")]
    // The old spelling, kept as a hidden alias (the CLI vocabulary).
    #[arg(alias = "host-output")]
    pub host_out: Option<PathBuf>,
}

impl HostCopyArgs {
    /// The host trace and its copy's path, when they were given (clap takes both or neither).
    #[must_use]
    pub fn paths(&self) -> Option<(PathBuf, PathBuf)> {
        self.host_trace.clone().zip(self.host_out.clone())
    }
}
