//! Tier-2 prerequisites: checks ([`require`]) and the installers a fresh machine needs.
//!
//! A tier-2 test (or the demo) that lacks a prerequisite prints why it skips; under `CI=true`
//! the same lack is a failure, never a skip. The installers check first and do nothing when
//! the prerequisite is there, so they are cheap to call before every build.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::LaunchError;

/// The bare-metal target the guest agent and `vmtsync-core`'s no_std check build for.
pub const AGENT_TARGET: &str = "x86_64-unknown-none";

/// True when running under CI (`CI=true` or `CI=1`).
#[must_use]
pub fn is_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Checks a tier-2 prerequisite. Returns `true` when it holds. When it does not: under CI this
/// panics (failing the test) with `what`; elsewhere it prints a skip line and returns `false`,
/// and the caller returns early.
///
/// # Panics
/// Under `CI=true` when the prerequisite is missing.
#[must_use]
pub fn require(test: &str, ok: bool, what: &str) -> bool {
    if ok {
        return true;
    }
    // A harness asking first (`gate`) collects the reason instead, and decides itself.
    if GATE_REASONS
        .with_borrow_mut(|r| r.as_mut().map(|r| r.push(what.to_owned())))
        .is_some()
    {
        return false;
    }
    assert!(
        !is_ci() && !GATED.load(Ordering::Relaxed),
        "{test}: prerequisite missing{}: {what}",
        if is_ci() {
            " under CI=true"
        } else {
            " that the test's gate did not declare"
        }
    );
    eprintln!("SKIP {test}: {what}");
    false
}

thread_local! {
    /// While [`gate`] runs a test's prerequisite check on this thread: the reasons
    /// [`require`] found missing, instead of printing or panicking.
    static GATE_REASONS: std::cell::RefCell<Option<Vec<String>>> =
        const { std::cell::RefCell::new(None) };
}

/// Set once a harness has checked every test's declared prerequisites before running it
/// ([`gate`]): from then on a prerequisite missing inside a test is one its gate forgot, and
/// [`require`] fails the test rather than letting it return early as a pass.
static GATED: AtomicBool = AtomicBool::new(false);

/// Runs a test's prerequisite check `check` (built from [`require`]) before the test, for a
/// harness that reports a missing prerequisite as a skipped test: `Ok` when every
/// prerequisite holds, else the reasons [`require`] gave. Nothing is printed and nothing
/// panics, whether or not CI is set: the harness decides (skip off CI, fail under it).
///
/// # Errors
/// The missing prerequisites, in the order `check` met them.
pub fn gate(check: impl FnOnce() -> bool) -> Result<(), Vec<String>> {
    GATE_REASONS.set(Some(Vec::new()));
    let ok = check();
    let reasons = GATE_REASONS.take().unwrap_or_default();
    match (ok, reasons.is_empty()) {
        (true, true) => Ok(()),
        (false, true) => Err(vec!["the check failed without naming a reason".to_owned()]),
        (_, false) => Err(reasons),
    }
}

/// Marks this process as gated ([`GATED`]): every test's prerequisites were checked by
/// [`gate`] before it ran, so [`require`] inside a test fails instead of skipping.
pub fn set_gated() {
    GATED.store(true, Ordering::Relaxed);
}

/// Test support for checking a prerequisite's absence: `VMTSYNC_TEST_NO_KVM=1` makes
/// [`have_kvm`] answer false, so the skip path can be seen on a machine that has KVM.
fn kvm_hidden() -> bool {
    std::env::var_os("VMTSYNC_TEST_NO_KVM").is_some_and(|v| v == "1")
}

/// True when this process can open `/dev/kvm` read-write.
#[must_use]
pub fn have_kvm() -> bool {
    !kvm_hidden()
        && std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok()
}

/// True when running as root.
#[must_use]
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The command line of `c` as one string, for messages.
#[must_use]
pub fn display(c: &Command) -> String {
    let mut s = c.get_program().to_string_lossy().into_owned();
    for a in c.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs `c` to completion, echoing it to stderr first, with its output on this process's
/// stdout/stderr (a build or an install shows its progress).
///
/// # Errors
/// [`LaunchError::Spawn`] when it cannot start, [`LaunchError::Failed`] when it exits non-zero.
pub fn run_echoed(c: &mut Command) -> Result<(), LaunchError> {
    eprintln!("$ {}", display(c));
    let status = c.status().map_err(|e| LaunchError::Spawn {
        cmd: display(c),
        why: e.to_string(),
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(LaunchError::Failed {
            cmd: display(c),
            status: status.to_string(),
            detail: String::new(),
        })
    }
}

/// Runs `c` to completion with its output captured; returns stdout. A failure carries the
/// last lines of stderr.
///
/// # Errors
/// [`LaunchError::Spawn`] when it cannot start, [`LaunchError::Failed`] when it exits non-zero.
pub fn run_captured(c: &mut Command) -> Result<String, LaunchError> {
    let out = c
        .stdin(Stdio::null())
        .output()
        .map_err(|e| LaunchError::Spawn {
            cmd: display(c),
            why: e.to_string(),
        })?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = err.lines().rev().take(20).collect();
    Err(LaunchError::Failed {
        cmd: display(c),
        status: out.status.to_string(),
        detail: tail
            .into_iter()
            .rev()
            .fold(String::new(), |s, l| s + "\n  " + l),
    })
}

/// Makes sure rustup has [`AGENT_TARGET`] for the toolchain that builds in `dir` (the
/// workspace root or `guest-agent/`): lists the installed targets and adds it only when it is
/// missing. Needed because xtask and the tests call the toolchain's cargo directly, so
/// `rust-toolchain.toml`'s `targets` line is never applied by a rustup proxy.
///
/// Without rustup (a distribution's toolchain) there is nothing to install from here: it
/// says so on stderr and returns `Ok`, and the build itself reports a missing target.
///
/// # Errors
/// [`LaunchError::Missing`] when rustup runs but cannot list the targets, or the error of
/// `rustup target add`.
pub fn ensure_rustup_target(dir: &Path) -> Result<(), LaunchError> {
    ensure_target_with(std::ffi::OsStr::new("rustup"), dir)
}

/// [`ensure_rustup_target`] with the rustup program given (a fake one in tests).
fn ensure_target_with(rustup: &std::ffi::OsStr, dir: &Path) -> Result<(), LaunchError> {
    let mut list = Command::new(rustup);
    list.current_dir(dir)
        .args(["target", "list", "--installed"]);
    let installed = match run_captured(&mut list) {
        Ok(out) => out,
        Err(LaunchError::Spawn { why, .. }) => {
            eprintln!(
                "no rustup ({why}): make sure your toolchain has the {AGENT_TARGET} standard \
                 library (rustup: `rustup target add {AGENT_TARGET}`)"
            );
            return Ok(());
        }
        Err(e) => {
            return Err(LaunchError::Missing(format!(
                "cannot ask rustup for the installed targets: {e}"
            )));
        }
    };
    if target_listed(&installed, AGENT_TARGET) {
        return Ok(());
    }
    eprintln!("rustup target {AGENT_TARGET} is missing: installing it (once, ~20 MB)");
    run_echoed(
        Command::new(rustup)
            .current_dir(dir)
            .args(["target", "add", AGENT_TARGET]),
    )
}

/// True when `rustup target list --installed` output names `target` on a line of its own.
fn target_listed(installed: &str, target: &str) -> bool {
    installed.lines().any(|l| l.trim() == target)
}

/// Installs Debian packages with apt-get (non-interactive, no recommends): tries the cached
/// package lists first and refreshes them only when that fails. Only root can do this.
///
/// # Errors
/// [`LaunchError::Missing`] when not root or apt-get is absent (with the command to run), or
/// apt-get's failure.
pub fn apt_install(packages: &[&str]) -> Result<(), LaunchError> {
    let how = format!("apt-get install {}", packages.join(" "));
    if !is_root() {
        return Err(LaunchError::Missing(format!("not root: run `sudo {how}`")));
    }
    if !Path::new("/usr/bin/apt-get").exists() {
        return Err(LaunchError::Missing(format!(
            "no apt-get on this machine: install the equivalent of `{how}` with your package manager"
        )));
    }
    let install = || {
        run_echoed(
            Command::new("apt-get")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args(["install", "-y", "-qq", "--no-install-recommends"])
                .args(packages),
        )
    };
    install().or_else(|_| {
        run_echoed(Command::new("apt-get").args(["update", "-qq"])).and_then(|()| install())
    })
}

/// Makes sure `qemu-system-x86_64` runs, installing Debian's `qemu-system-x86` when it is
/// missing and this process may (root, apt-get present).
///
/// # Errors
/// [`LaunchError::Missing`] saying how to install it, or apt-get's failure.
pub fn ensure_qemu() -> Result<(), LaunchError> {
    if crate::qemu::have_qemu() {
        return Ok(());
    }
    apt_install(&["qemu-system-x86"])?;
    if crate::qemu::have_qemu() {
        Ok(())
    } else {
        Err(LaunchError::Missing(format!(
            "apt-get installed qemu-system-x86 but `{}` still does not run",
            crate::qemu::QEMU
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_must_be_listed_on_its_own_line() {
        let out = "x86_64-unknown-linux-gnu\nx86_64-unknown-none\n";
        assert!(target_listed(out, "x86_64-unknown-none"));
        assert!(!target_listed(
            "x86_64-unknown-linux-gnu\n",
            "x86_64-unknown-none"
        ));
        assert!(!target_listed(
            "x86_64-unknown-none-softfloat\n",
            "x86_64-unknown-none"
        ));
        assert!(!target_listed("", "x86_64-unknown-none"));
    }

    /// A fake rustup (a shell script) that lists `installed` and logs every call.
    fn fake_rustup(name: &str, installed: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let dir =
            std::env::temp_dir().join(format!("vmtsync-launch-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (bin, log) = (dir.join("rustup"), dir.join("calls"));
        let script = format!(
            "#!/bin/sh\necho \"$@\" >> '{}'\n[ \"$2\" = list ] && printf '{installed}'\nexit 0\n",
            log.display()
        );
        std::fs::write(&bin, script).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        (bin, log)
    }

    #[test]
    fn the_target_is_added_only_when_rustup_does_not_list_it() {
        let (bin, log) = fake_rustup("missing", "x86_64-unknown-linux-gnu\\n");
        ensure_target_with(bin.as_os_str(), Path::new("/")).unwrap();
        let calls = std::fs::read_to_string(&log).unwrap();
        assert_eq!(
            calls,
            "target list --installed\ntarget add x86_64-unknown-none\n"
        );
        let (bin, log) = fake_rustup(
            "present",
            "x86_64-unknown-linux-gnu\\nx86_64-unknown-none\\n",
        );
        ensure_target_with(bin.as_os_str(), Path::new("/")).unwrap();
        let calls = std::fs::read_to_string(&log).unwrap();
        assert_eq!(calls, "target list --installed\n");
        for b in [bin, log] {
            let _ = std::fs::remove_dir_all(b.parent().unwrap());
        }
        // No rustup at all: a warning, and the build reports what is missing.
        ensure_target_with(std::ffi::OsStr::new("/nonexistent/rustup"), Path::new("/")).unwrap();
    }

    #[test]
    fn display_joins_program_and_args() {
        let mut c = Command::new("rustup");
        c.args(["target", "add", AGENT_TARGET]);
        assert_eq!(display(&c), "rustup target add x86_64-unknown-none");
    }

    #[test]
    fn a_failing_command_reports_its_stderr_tail() {
        let e = run_captured(Command::new("sh").args(["-c", "echo oops >&2; exit 3"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("oops") && e.contains("exit status: 3"), "{e}");
        let e = run_captured(&mut Command::new("/nonexistent/x")).unwrap_err();
        assert!(matches!(e, LaunchError::Spawn { .. }), "{e}");
    }
}
