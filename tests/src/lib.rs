//! Test support for vmtsync's end-to-end tests: tier-2 prerequisite checks and process guards.
//!
//! Tier-2 tests need root, `/dev/kvm`, debugfs, QEMU or trace-cmd. On a machine without one
//! they print why they skip; under `CI=true` a missing prerequisite fails the test instead
//! (see [`require`]). Those checks and the process guard [`ChildGuard`] live in
//! `vmtsync-launch`, shared with `cargo xtask`, and are re-exported here. The truth tier-2
//! tests check against (debugfs composed with the agent's software skew) is [`truth`]'s.

pub mod fake_agent;
pub mod idle_vmm;
pub mod truth;
pub mod vmm;

pub use vmtsync_launch::{ChildGuard, gate, have_kvm, is_ci, is_root, require, set_gated};

/// Serializes the tests that exit-anchor probes inside this process: the anchor's private
/// tracefs instance is named after the process (`vmtsync-anchor-PID`), so two at once collide
/// ("File exists"), and one test's "instance gone" check would see the other's. Poisoning is
/// ignored: the lock only orders the tests.
pub fn anchor_lock() -> std::sync::MutexGuard<'static, ()> {
    static ANCHOR: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ANCHOR
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
