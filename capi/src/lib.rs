//! # vmtsync-capi
//!
//! vmtsync's recorder for C lives in `include/vmtsync.h` and `src/vmtsync.c`: firmware and
//! other freestanding code compile those two files as they are (docs/c-abi.md). This crate
//! holds their tests and the helpers that compile them: with gcc and clang, for i386 (`-m32`)
//! and x86_64 (`-m64`).
//!
//! A compiler that is not installed makes a test print why it skips; under `CI=true` it fails
//! instead (`cargo xtask setup` installs gcc, clang and gcc-multilib).
#![deny(missing_docs)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// One compiler and ABI the C recorder is built with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Toolchain {
    /// The compiler's command (`gcc` or `clang`).
    pub cc: &'static str,
    /// `-m32` (i386) or `-m64` (x86_64).
    pub abi: &'static str,
}

/// Every compiler and ABI the recorder must build with.
pub const TOOLCHAINS: [Toolchain; 4] = [
    Toolchain {
        cc: "gcc",
        abi: "-m64",
    },
    Toolchain {
        cc: "gcc",
        abi: "-m32",
    },
    Toolchain {
        cc: "clang",
        abi: "-m64",
    },
    Toolchain {
        cc: "clang",
        abi: "-m32",
    },
];

/// The warnings every build of the recorder must be free of, in C11.
pub const STRICT: &[&str] = &[
    "-std=c11",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-pedantic",
    "-O2",
];

/// Freestanding flags a firmware build uses: no libc, position-dependent code, no SSE, MMX or
/// x87 code.
pub const FREESTANDING: &[&str] = &[
    "-ffreestanding",
    "-fno-pic",
    "-mno-sse",
    "-mno-mmx",
    "-mno-80387",
];

impl Toolchain {
    /// A name for files and messages, such as `gcc-m32`.
    #[must_use]
    pub fn name(&self) -> String {
        format!("{}{}", self.cc, self.abi)
    }

    /// Whether this compiler can build and link a hosted program for this ABI here (a test
    /// program compiled into `dir`). `Err` says what is missing.
    ///
    /// # Errors
    /// The compiler is missing, or it cannot link for this ABI (no 32-bit C runtime).
    pub fn check(&self, dir: &Path) -> Result<(), String> {
        let src = dir.join("probe.c");
        std::fs::write(&src, "int main(void) { return 0; }\n").map_err(|e| e.to_string())?;
        let out = dir.join(format!("probe-{}", self.name()));
        let o = Command::new(self.cc)
            .arg(self.abi)
            .arg(&src)
            .arg("-o")
            .arg(&out)
            .output()
            .map_err(|e| format!("{} not found ({e}): run `cargo xtask setup`", self.cc))?;
        if o.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{} {} cannot link a program (install gcc-multilib for -m32: `cargo xtask setup`): {}",
                self.cc,
                self.abi,
                String::from_utf8_lossy(&o.stderr).trim()
            ))
        }
    }

    /// Builds the program `exe` from `sources` with [`STRICT`], `extra` flags, and the
    /// recorder's header and source directories on the include path.
    ///
    /// # Errors
    /// As [`Toolchain::compile`].
    pub fn program(&self, sources: &[&Path], exe: &Path, extra: &[&str]) -> Result<(), String> {
        use std::ffi::OsStr;
        let (include, src) = (include_dir(), source());
        let src_dir = src.parent().unwrap_or(Path::new("."));
        let mut args: Vec<&OsStr> = STRICT.iter().chain(extra).map(OsStr::new).collect();
        args.extend([
            OsStr::new("-I"),
            include.as_os_str(),
            OsStr::new("-I"),
            src_dir.as_os_str(),
        ]);
        args.extend(sources.iter().map(|s| s.as_os_str()));
        args.extend([OsStr::new("-o"), exe.as_os_str()]);
        self.compile(&args)
    }

    /// Runs the compiler with this ABI and `args`.
    ///
    /// # Errors
    /// The compiler could not run or failed; the message holds its stderr.
    pub fn compile(&self, args: &[&std::ffi::OsStr]) -> Result<(), String> {
        let o = Command::new(self.cc)
            .arg(self.abi)
            .args(args)
            .output()
            .map_err(|e| format!("{}: {e}", self.cc))?;
        if o.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{} {} {:?} failed:\n{}",
                self.cc,
                self.abi,
                args,
                String::from_utf8_lossy(&o.stderr)
            ))
        }
    }
}

/// `capi/include`, the header's directory.
#[must_use]
pub fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include")
}

/// `capi/src/vmtsync.c`.
#[must_use]
pub fn source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/vmtsync.c")
}

/// The toolchains usable here. A missing one is a printed skip, or under `CI=true` a panic:
/// CI must build every one.
///
/// # Panics
/// Under `CI=true` when a toolchain is missing.
#[must_use]
pub fn usable_toolchains(dir: &Path) -> Vec<Toolchain> {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    TOOLCHAINS
        .iter()
        .filter(|t| match t.check(dir) {
            Ok(()) => true,
            Err(e) => {
                assert!(!ci, "CI=true: {e}");
                eprintln!("SKIPPED for {}: {e}", t.name());
                false
            }
        })
        .copied()
        .collect()
}
