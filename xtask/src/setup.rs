//! Installs what the tier-2 tests need on a fresh machine of this project: the rustup target,
//! Debian packages, vhost-device-vsock (into the project's cache under
//! `$HOME/.cache/vmtsync/`), and a mounted debugfs. Each step checks first and does nothing when the
//! prerequisite is already there. Under `CI=true` a step that cannot be done fails the run.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

use crate::{is_ci, sh};

/// Debian packages the tier-2 tests and the fuzz smoke run use, with a binary that proves
/// each is installed.
const APT_PACKAGES: &[(&str, &str)] = &[
    ("qemu-system-x86", "/usr/bin/qemu-system-x86_64"),
    ("trace-cmd", "/usr/bin/trace-cmd"),
    // cc/c++ for libfuzzer-sys (the `ci` fuzz smoke run compiles libFuzzer's C++ sources).
    ("build-essential", "/usr/bin/c++"),
];

pub(crate) fn setup() -> Result<()> {
    let mut problems = Vec::new();

    if let Err(e) = sh(Command::new("rustup").args(["target", "add", "x86_64-unknown-none"])) {
        problems.push(format!("rustup target x86_64-unknown-none: {e:#}"));
    }

    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .filter(|(_, bin)| !Path::new(bin).exists())
        .map(|(pkg, _)| *pkg)
        .collect();
    if !missing.is_empty() {
        let install = || {
            sh(Command::new("apt-get")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args(["install", "-y", "-qq", "--no-install-recommends"])
                .args(&missing))
        };
        // Try the cached package lists first; refresh them only when that fails.
        let r = install().or_else(|_| {
            sh(Command::new("apt-get").args(["update", "-qq"])).and_then(|()| install())
        });
        if let Err(e) = r {
            problems.push(format!("apt-get install {}: {e:#}", missing.join(" ")));
        }
    }

    let debugfs = Path::new("/sys/kernel/debug/kvm");
    if !debugfs.exists()
        && let Err(e) =
            sh(Command::new("mount").args(["-t", "debugfs", "none", "/sys/kernel/debug"]))
    {
        problems.push(format!("mount debugfs: {e:#}"));
    }

    if let Err(e) = vhost_device_vsock() {
        problems.push(format!("vhost-device-vsock: {e:#}"));
    }

    if problems.is_empty() {
        return Ok(());
    }
    let msg = problems.join("\n  ");
    if is_ci() {
        bail!("tier-2 prerequisites missing under CI=true:\n  {msg}");
    }
    eprintln!(
        "xtask setup: some tier-2 prerequisites are missing (tier-2 tests will skip):\n  {msg}"
    );
    Ok(())
}

/// vhost-device-vsock's version, as the vsock rig (`tests/src/vmm/vsock`) expects it.
const VHOST_DEVICE_VSOCK_VERSION: &str = "0.3.0";

/// Installs vhost-device-vsock into `$HOME/.cache/vmtsync/vhost-device-vsock` (where the vsock
/// tests look) unless it is there. `cargo install` only: its own test suite binds AF_VSOCK,
/// which these machines must never do.
fn vhost_device_vsock() -> Result<()> {
    let home = std::env::var_os("HOME").map_or_else(|| "/root".into(), std::path::PathBuf::from);
    let root = home.join(".cache/vmtsync/vhost-device-vsock");
    if root.join("bin/vhost-device-vsock").exists() {
        return Ok(());
    }
    sh(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["install", "--locked", "vhost-device-vsock", "--version"])
            .arg(VHOST_DEVICE_VSOCK_VERSION)
            .arg("--root")
            .arg(&root),
    )
}
