//! The `ci` fuzz smoke run: builds every cargo-fuzz target of `core/fuzz` and runs each for a
//! bounded time; a crash (or a build failure) fails the step.
//!
//! Only the stable toolchain exists on project machines. cargo-fuzz needs nightly-only rustc
//! flags (`-Zsanitizer=address`, sancov options); `RUSTC_BOOTSTRAP=1` lets stable accept them,
//! and stable ships the ASan runtime for x86_64-unknown-linux-gnu. cargo-fuzz itself is
//! installed once into `<root>/.cache/cargo-bin` (git-ignored), not into `~/.cargo/bin`.

use std::process::Command;

use anyhow::Result;

use crate::{cargo, root, sh};

/// Fuzz targets in `core/fuzz/fuzz_targets/`.
const TARGETS: &[&str] = &["decode", "agent"];

/// The cargo-fuzz release CI installs (`--locked` pins its dependencies too), so a new
/// cargo-fuzz cannot change or break the smoke run unannounced.
const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// Seconds each target runs in CI: long enough to reach deep into the decoder (hundreds of
/// thousands of inputs here), short enough for every CI run.
const SECONDS_PER_TARGET: u32 = 20;

pub(crate) fn smoke() -> Result<()> {
    let bin_root = root().join(".cache/cargo-bin");
    let cargo_fuzz = bin_root.join("bin/cargo-fuzz");
    let installed = Command::new(&cargo_fuzz)
        .arg("--version")
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout).trim() == format!("cargo-fuzz {CARGO_FUZZ_VERSION}")
        });
    if !installed {
        sh(cargo()
            .args([
                "install",
                "cargo-fuzz",
                "--version",
                CARGO_FUZZ_VERSION,
                "--locked",
                "--force",
                "--root",
            ])
            .arg(&bin_root))?;
    }
    for target in TARGETS {
        sh(Command::new(&cargo_fuzz)
            .current_dir(root())
            .env("RUSTC_BOOTSTRAP", "1")
            .args(["run", "--fuzz-dir", "core/fuzz", target, "--"])
            .arg(format!("-max_total_time={SECONDS_PER_TARGET}")))?;
    }
    Ok(())
}
