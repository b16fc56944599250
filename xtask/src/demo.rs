//! `cargo xtask demo [--json] [--vmm auto|qemu|builtin|sim] [--no-skew] [--smp N]`: the first command
//! on a fresh clone. `cargo xtask demo --firmware` shows SeaBIOS traced live instead: it builds
//! the traced SeaBIOS, boots, records and prints its phases with host times and intervals. It builds the real `vmtsync` program and the demo's helpers, then runs
//! `vmtsync-tests`' `vmtsync-demo` binary, which installs what it still needs (the rustup
//! target before building the agent, QEMU through apt when root), boots the agent with a
//! software skew picked from the host TSC, and checks `vmtsync probe`'s bounds against the
//! truth from KVM debugfs (see that binary's docs for the output and its JSON schema).
//!
//! The demo lives in the tests crate because its truth is the tests' truth
//! (`vmtsync_tests::truth`: debugfs through vmtsync's reader, composed with the skew through
//! vmtsync-core's mapping math), which xtask does not link; xtask keeps its few dependencies.

use anyhow::{Result, bail};

use crate::{cargo, root, sh};

/// Builds `vmtsync`, `vmtsync-demo` and the binaries the demo starts, then runs the demo with
/// `args` passed through.
pub(crate) fn demo(args: &[String]) -> Result<()> {
    sh(cargo().args([
        "build",
        "-p",
        "vmtsync",
        "--bin",
        "vmtsync",
        "-p",
        "vmtsync-tests",
        "--bin",
        "vmtsync-demo",
        "--bin",
        "vmtsync-vmm",
        "--bin",
        "vmtsync-fake-agent",
    ]))?;
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| root().join("target"), std::path::PathBuf::from);
    let mut c = std::process::Command::new(target.join("debug/vmtsync-demo"));
    c.args(args);
    eprintln!("$ {}", crate::display(&c));
    let status = c.status()?;
    if !status.success() {
        bail!("the demo failed ({status}; see its message above)");
    }
    Ok(())
}
