//! Builds the guest agent (once per test process) and finds its ELF.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::VmmError;

/// Builds `guest-agent/` in release mode for `x86_64-unknown-none` and returns the ELF path.
/// The build runs once per process; later calls return the cached result.
///
/// The build runs with `guest-agent/` as its working directory so that the agent's own
/// `.cargo/config.toml` (target, rustflags) applies, and with the outer build's `RUSTFLAGS`
/// removed so host flags never reach the bare-metal build.
///
/// # Errors
/// When cargo cannot be started or the build fails (the error carries its stderr).
pub fn agent_elf() -> Result<PathBuf, VmmError> {
    static ELF: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    ELF.get_or_init(build).clone().map_err(VmmError::Build)
}

fn build() -> Result<PathBuf, String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or("tests/ has no parent directory")?
        .join("guest-agent");
    let target_dir = dir.join("target");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(&dir)
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET")
        .args(["build", "--release", "--target-dir"])
        .arg(&target_dir)
        .output()
        .map_err(|e| format!("starting cargo in {}: {e}", dir.display()))?;
    if !out.status.success() {
        return Err(format!(
            "cargo build in {} failed ({}):\n{}",
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let elf = target_dir.join("x86_64-unknown-none/release/vmtsync-agent");
    if elf.is_file() {
        Ok(elf)
    } else {
        Err(format!("build succeeded but {} is missing", elf.display()))
    }
}
