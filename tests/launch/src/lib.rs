//! One way to build and launch a guest (the agent, the minimal kernel), shared by the tier-2
//! tests (`vmtsync-tests`), `cargo xtask` and the demo.
//!
//! - [`prereq`]: tier-2 prerequisite checks ([`require`]: skip with a reason, fail under
//!   `CI=true`) and the installers a fresh machine needs (the `x86_64-unknown-none` rustup
//!   target, QEMU through apt).
//! - [`agent`]: the guest builds (`guest-agent/`, `tests/minimal-kernel/`; release, each with
//!   its own `.cargo/config.toml`).
//! - [`qemu`]: the QEMU command line (microvm or q35 + qboot, COM1, COM2, isa-debug-exit).
//! - [`firmware`]: SeaBIOS from Debian's source package, stock or traced (patched with the C
//!   recorder), built into the project cache.
//! - [`vhost`]: the vhost-device-vsock backend's version and install location.
//! - [`trace_processor`]: Perfetto's trace processor (wasm, run by Node), fetched into the
//!   project cache and checksum-checked.
//! - [`bench`]: the benchmark binaries' result lines, typed, for the binary that prints one and
//!   every reader.
//! - [`ChildGuard`]: every process started here is killed by its PID when its guard drops.
//!
//! The crate depends on std, libc, thiserror, serde and serde_json only, so `xtask` keeps its
//! few dependencies.

pub mod agent;
pub mod barectf;
pub mod bench;
mod error;
pub mod firmware;
mod guard;
pub mod prereq;
pub mod qemu;
pub mod trace_processor;
pub mod vhost;

pub use error::LaunchError;
pub use guard::ChildGuard;
pub use prereq::{gate, have_kvm, is_ci, is_root, require, set_gated};
