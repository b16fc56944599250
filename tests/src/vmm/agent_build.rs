//! Builds the guest agent (once per test process) and finds its ELF, through
//! `vmtsync_launch::agent`, the build xtask and the demo use too.

use std::path::PathBuf;

use super::VmmError;

/// Builds `guest-agent/` in release mode for `x86_64-unknown-none` (installing the rustup
/// target first when missing) and returns the ELF path. The build runs once per process;
/// later calls return the cached result.
///
/// # Errors
/// When the target cannot be installed or the build fails (the error carries its stderr).
pub fn agent_elf() -> Result<PathBuf, VmmError> {
    vmtsync_launch::agent::agent_elf().map_err(|e| VmmError::Build(e.to_string()))
}
