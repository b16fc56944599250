//! The guest agent build: `guest-agent/` in release mode for `x86_64-unknown-none`.
//!
//! The build runs with `guest-agent/` as its working directory so the agent's own
//! `.cargo/config.toml` (target, relocation model, linker script) applies, and with the outer
//! build's `RUSTFLAGS` and target removed so host flags never reach the bare-metal build. The
//! rustup target is installed first when missing ([`crate::prereq::ensure_rustup_target`]), so
//! the first command on a fresh clone works.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::LaunchError;
use crate::prereq::{ensure_rustup_target, run_captured, run_echoed};

/// The workspace root (two levels above this crate, `tests/launch/`).
#[must_use]
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("tests/launch lives two levels below the workspace root")
        .to_path_buf()
}

/// The agent crate's directory, `guest-agent/`.
#[must_use]
pub fn agent_dir() -> PathBuf {
    workspace_root().join("guest-agent")
}

/// Where the build's cargo output goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildOutput {
    /// On this process's stderr, with the command echoed (xtask: the user sees progress).
    Shown,
    /// Captured; only a failure shows its tail (tests: no noise around the harness).
    Captured,
}

/// `cargo` for the agent: the toolchain's cargo (`$CARGO` when run from cargo), in
/// `guest-agent/`, without the outer build's flags.
#[must_use]
pub fn agent_cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(agent_dir())
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET");
    c
}

/// Builds the agent (installing the rustup target first when missing) and returns its ELF.
///
/// # Errors
/// The target install's or the build's failure; a build that leaves no ELF.
pub fn build(output: BuildOutput) -> Result<PathBuf, LaunchError> {
    let dir = agent_dir();
    ensure_rustup_target(&dir)?;
    let target_dir = dir.join("target");
    let mut c = agent_cargo();
    c.args(["build", "--release", "--target-dir"])
        .arg(&target_dir);
    match output {
        BuildOutput::Shown => run_echoed(&mut c)?,
        BuildOutput::Captured => {
            run_captured(&mut c)?;
        }
    }
    let elf = target_dir.join("x86_64-unknown-none/release/vmtsync-agent");
    if elf.is_file() {
        Ok(elf)
    } else {
        Err(LaunchError::Missing(format!(
            "the agent build succeeded but {} is missing",
            elf.display()
        )))
    }
}

/// [`build`] with captured output, once per process; later calls return the cached result.
///
/// # Errors
/// As [`build`] (the same error on every call).
pub fn agent_elf() -> Result<PathBuf, LaunchError> {
    static ELF: OnceLock<Result<PathBuf, LaunchError>> = OnceLock::new();
    ELF.get_or_init(|| build(BuildOutput::Captured)).clone()
}
