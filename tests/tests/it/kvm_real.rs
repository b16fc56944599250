//! Tier 1 of `vmtsync kvm`'s real-KVM module (the rest is in the `tier2` target): the binary
//! the tier-2 tests run is this build's CLI.

use std::process::Command;

/// The binary this module runs is the real CLI; make sure `Command` is not shadowed by a stale
/// build of another crate's `vmtsync`.
#[test]
fn cli_binary_is_this_builds() {
    let o = Command::new(env!("CARGO_BIN_EXE_vmtsync-cli"))
        .arg("--version")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        format!("vmtsync {}", env!("CARGO_PKG_VERSION"))
    );
}
