//! Installs what the tier-2 tests need on a fresh machine of this project: the rustup target,
//! Debian packages, and a mounted debugfs. Each step checks first and does nothing when the
//! prerequisite is already there. Under `CI=true` a step that cannot be done fails the run.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

use crate::{is_ci, sh};

/// Debian packages the tier-2 tests use, with a binary that proves each is installed.
const APT_PACKAGES: &[(&str, &str)] = &[
    ("qemu-system-x86", "/usr/bin/qemu-system-x86_64"),
    ("trace-cmd", "/usr/bin/trace-cmd"),
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
        let r = sh(Command::new("apt-get").args(["update", "-qq"])).and_then(|()| {
            sh(Command::new("apt-get")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args(["install", "-y", "-qq", "--no-install-recommends"])
                .args(&missing))
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
