//! Test support for vmtsync's end-to-end tests: tier-2 prerequisite checks and process guards.
//!
//! Tier-2 tests need root, `/dev/kvm`, debugfs, QEMU or trace-cmd. On a machine without one
//! they print why they skip; under `CI=true` a missing prerequisite fails the test instead
//! (see [`require`]).

use std::process::Child;

pub mod fake_agent;
pub mod idle_vmm;
pub mod vmm;

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
    assert!(
        !is_ci(),
        "{test}: prerequisite missing under CI=true: {what}"
    );
    eprintln!("SKIP {test}: {what}");
    false
}

/// True when this process can open `/dev/kvm` read-write.
#[must_use]
pub fn have_kvm() -> bool {
    std::fs::OpenOptions::new()
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

/// Kills and reaps a child process by its PID when dropped, also when the test panics.
#[derive(Debug)]
pub struct ChildGuard(pub Option<Child>);

impl ChildGuard {
    /// Guards `child`.
    #[must_use]
    pub fn new(child: Child) -> Self {
        Self(Some(child))
    }

    /// The guarded child's PID.
    ///
    /// # Panics
    /// If the child was already taken.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.0.as_ref().expect("child present").id()
    }

    /// Mutable access to the child.
    ///
    /// # Panics
    /// If the child was already taken.
    pub fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("child present")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            // Kill by PID (Child::kill sends SIGKILL to this exact process), then reap it so
            // no zombie outlives the test.
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
