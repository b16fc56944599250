//! The guest ELF builds: `guest-agent/` (the bundled agent), `tests/minimal-kernel/` (a
//! kernel that is not ours, docs/embedding.md), each in release mode for
//! `x86_64-unknown-none`, and `tests/c-guest/` (a freestanding C guest: gcc, with the C
//! recorder's `capi/src/vmtsync.c` as one of its sources).
//!
//! A build runs with the guest crate's directory as its working directory so that crate's own
//! `.cargo/config.toml` (target, relocation model, linker script) applies, and with the outer
//! build's `RUSTFLAGS` and target removed so host flags never reach the bare-metal build. The
//! rustup target is installed first when missing ([`crate::prereq::ensure_rustup_target`]), so
//! the first command on a fresh clone works.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::LaunchError;
use crate::prereq::{ensure_rustup_target, run_captured, run_echoed};

/// The workspace root (two levels above this crate, `tests/launch/`).
#[must_use]
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("tests/launch lives two levels below the workspace root")
        .to_path_buf()
}

/// The agent crate's directory, `guest-agent/`.
#[must_use]
pub fn agent_dir() -> PathBuf {
    Guest::Agent.dir()
}

/// A bare-metal guest crate of this repository, built the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guest {
    /// `guest-agent/`: the bundled agent, `vmtsync-agent`.
    Agent,
    /// `tests/minimal-kernel/`: a minimal kernel embedding vmtsync-core (docs/embedding.md).
    MinimalKernel,
    /// `tests/c-guest/`: a freestanding C guest built with the C recorder (`capi/`).
    CGuest,
}

impl Guest {
    /// The crate's directory.
    #[must_use]
    pub fn dir(self) -> PathBuf {
        workspace_root().join(match self {
            Self::Agent => "guest-agent",
            Self::MinimalKernel => "tests/minimal-kernel",
            Self::CGuest => "tests/c-guest",
        })
    }

    /// The name of the ELF the crate builds.
    #[must_use]
    pub const fn bin(self) -> &'static str {
        match self {
            Self::Agent => "vmtsync-agent",
            Self::MinimalKernel => "minimal-kernel",
            Self::CGuest => "c-guest",
        }
    }
}

/// Where the build's cargo output goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildOutput {
    /// On this process's stderr, with the command echoed (xtask: the user sees progress).
    Shown,
    /// Captured; only a failure shows its tail (tests: no noise around the harness).
    Captured,
}

/// `cargo` for the agent: the toolchain's cargo (`$CARGO` when run from cargo), in
/// `guest-agent/`, without the outer build's flags.
#[must_use]
pub fn agent_cargo() -> Command {
    guest_cargo(Guest::Agent)
}

/// [`agent_cargo`] for any [`Guest`]: in its directory, without the outer build's flags.
#[must_use]
pub fn guest_cargo(guest: Guest) -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(guest.dir())
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET");
    c
}

/// Builds the agent (installing the rustup target first when missing) and returns its ELF.
///
/// # Errors
/// The target install's or the build's failure; a build that leaves no ELF.
pub fn build(output: BuildOutput) -> Result<PathBuf, LaunchError> {
    build_guest(Guest::Agent, output)
}

/// [`build`] for any [`Guest`]: its ELF, under its own `target/`.
///
/// # Errors
/// As [`build`].
pub fn build_guest(guest: Guest, output: BuildOutput) -> Result<PathBuf, LaunchError> {
    let dir = guest.dir();
    if guest == Guest::CGuest {
        return build_c_guest(&dir, output);
    }
    ensure_rustup_target(&dir)?;
    let target_dir = dir.join("target");
    let mut c = guest_cargo(guest);
    c.args(["build", "--release", "--target-dir"])
        .arg(&target_dir);
    match output {
        BuildOutput::Shown => run_echoed(&mut c)?,
        BuildOutput::Captured => {
            run_captured(&mut c)?;
        }
    }
    let elf = target_dir
        .join("x86_64-unknown-none/release")
        .join(guest.bin());
    if elf.is_file() {
        Ok(elf)
    } else {
        Err(LaunchError::Missing(format!(
            "the {} build succeeded but {} is missing",
            guest.bin(),
            elf.display()
        )))
    }
}

/// The C guest: gcc compiles `entry.S`, `main.c` and the C recorder (`capi/src/vmtsync.c`, as
/// a firmware build takes it) and links them by `link.ld` into
/// `tests/c-guest/target/c-guest`, freestanding: no libc, no PIE, no SSE (the guest never
/// enables it), no red zone.
fn build_c_guest(dir: &Path, output: BuildOutput) -> Result<PathBuf, LaunchError> {
    let root = workspace_root();
    let target_dir = dir.join("target");
    std::fs::create_dir_all(&target_dir).map_err(|e| {
        LaunchError::Missing(format!("cannot create {}: {e}", target_dir.display()))
    })?;
    let run = |c: &mut Command| match output {
        BuildOutput::Shown => run_echoed(c),
        BuildOutput::Captured => run_captured(c).map(drop),
    };
    let elf = target_dir.join(Guest::CGuest.bin());
    let mut gcc = Command::new("gcc");
    gcc.current_dir(dir)
        .args([
            "-std=c11",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-ffreestanding",
            "-nostdlib",
            "-static",
            "-no-pie",
            "-fno-pic",
            "-fno-stack-protector",
            "-fcf-protection=none",
            "-mno-red-zone",
            "-mgeneral-regs-only",
            "-Wl,--gc-sections",
            "-Wl,--build-id=none",
            "-Wl,--strip-debug",
            "-T",
            "link.ld",
            "-I",
        ])
        .arg(root.join("capi/include"))
        .args(["entry.S", "main.c"])
        .arg(root.join("capi/src/vmtsync.c"))
        .arg("-o")
        .arg(&elf);
    run(&mut gcc)?;
    if elf.is_file() {
        Ok(elf)
    } else {
        Err(LaunchError::Missing(format!(
            "the C guest's link succeeded but {} is missing",
            elf.display()
        )))
    }
}

/// [`build`] with captured output, once per process; later calls return the cached result.
///
/// # Errors
/// As [`build`] (the same error on every call).
pub fn agent_elf() -> Result<PathBuf, LaunchError> {
    guest_elf(Guest::Agent)
}

/// [`agent_elf`] for any [`Guest`]: built with captured output once per process and guest.
///
/// # Errors
/// As [`build`] (the same error on every call).
pub fn guest_elf(guest: Guest) -> Result<PathBuf, LaunchError> {
    static AGENT: OnceLock<Result<PathBuf, LaunchError>> = OnceLock::new();
    static MINIMAL_KERNEL: OnceLock<Result<PathBuf, LaunchError>> = OnceLock::new();
    static C_GUEST: OnceLock<Result<PathBuf, LaunchError>> = OnceLock::new();
    let cell = match guest {
        Guest::Agent => &AGENT,
        Guest::MinimalKernel => &MINIMAL_KERNEL,
        Guest::CGuest => &C_GUEST,
    };
    cell.get_or_init(|| build_guest(guest, BuildOutput::Captured))
        .clone()
}
