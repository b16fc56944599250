//! The vhost-device-vsock backend the vsock rig runs (`vmtsync_tests::vmm::vsock`): its
//! version and where it is installed.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use crate::LaunchError;
use crate::prereq::{run_captured, run_echoed};

/// The backend version the rig is written against (its `--vm` syntax and `<uds-path>_<port>`
/// naming).
pub const VHOST_DEVICE_VSOCK_VERSION: &str = "0.3.0";

/// Where the backend is installed: `$HOME/.cache/vmtsync/vhost-device-vsock` (`cargo install
/// --root`), outside any worktree so every checkout shares one build.
#[must_use]
pub fn install_root() -> PathBuf {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/vmtsync/vhost-device-vsock")
}

/// The backend binary inside [`install_root`].
#[must_use]
pub fn binary() -> PathBuf {
    install_root().join("bin/vhost-device-vsock")
}

/// The installed backend binary, installing it first if missing (`cargo install --locked`,
/// ~150 s; its test suite is never run: it binds AF_VSOCK, which these machines must never
/// do). Installs at most once per process. With [`crate::agent::BuildOutput::Shown`] cargo's
/// progress is shown.
///
/// # Errors
/// cargo's failure, with the command to retry by hand.
pub fn ensure_vhost_device_vsock(
    output: crate::agent::BuildOutput,
) -> Result<PathBuf, LaunchError> {
    static BIN: OnceLock<Result<PathBuf, LaunchError>> = OnceLock::new();
    BIN.get_or_init(|| {
        let bin = binary();
        if bin.is_file() {
            return Ok(bin);
        }
        let root = install_root();
        eprintln!(
            "installing vhost-device-vsock {VHOST_DEVICE_VSOCK_VERSION} into {}",
            root.display()
        );
        let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        c.env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("CARGO_BUILD_TARGET")
            .env_remove("CARGO_TARGET_DIR")
            .args(["install", "--locked", "vhost-device-vsock", "--version"])
            .arg(VHOST_DEVICE_VSOCK_VERSION)
            .arg("--root")
            .arg(&root);
        match output {
            crate::agent::BuildOutput::Shown => run_echoed(&mut c)?,
            crate::agent::BuildOutput::Captured => {
                run_captured(&mut c)?;
            }
        }
        if bin.is_file() {
            Ok(bin)
        } else {
            Err(LaunchError::Missing(format!(
                "cargo install succeeded but {} is missing",
                bin.display()
            )))
        }
    })
    .clone()
}
