//! barectf 3.1.2 (PyPI), the bare-metal C tracer generator the recorder is compared with in
//! `cargo xtask bench`: installed once into a virtual environment in the project's cache
//! (`$HOME/.cache/vmtsync/barectf-3.1.2`). barectf pins PyYAML 5, which no longer builds
//! under Cython 3, so PyYAML is built first with `cython<3` and no build isolation.

use std::path::PathBuf;
use std::process::Command;

use crate::error::LaunchError;
use crate::prereq::run_echoed;

/// The pinned release.
pub const VERSION: &str = "3.1.2";

/// The virtual environment's directory.
#[must_use]
pub fn install_dir() -> PathBuf {
    crate::trace_processor::install_dir().with_file_name(format!("barectf-{VERSION}"))
}

/// The `barectf` executable, installing it first when missing.
///
/// # Errors
/// python3's venv or pip failing, with the command that failed.
pub fn ensure_barectf() -> Result<PathBuf, LaunchError> {
    let dir = install_dir();
    let exe = dir.join("bin/barectf");
    if exe.is_file() {
        return Ok(exe);
    }
    eprintln!("installing barectf {VERSION} into {}", dir.display());
    let _ = std::fs::remove_dir_all(&dir);
    run_echoed(Command::new("python3").args(["-m", "venv"]).arg(&dir))?;
    let pip = dir.join("bin/pip");
    let pinned = format!("barectf=={VERSION}");
    let steps: [&[&str]; 3] = [
        &["install", "--quiet", "cython<3", "wheel", "setuptools"],
        &[
            "install",
            "--quiet",
            "--no-build-isolation",
            "pyyaml==5.4.1",
        ],
        &["install", "--quiet", &pinned],
    ];
    for args in steps {
        if let Err(e) = run_echoed(Command::new(&pip).args(args)) {
            // A half-made environment would pass the check above next time.
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
    }
    if exe.is_file() {
        Ok(exe)
    } else {
        Err(LaunchError::Missing(format!(
            "pip installed barectf {VERSION} but {} is missing",
            exe.display()
        )))
    }
}
