//! Exit-anchored probing (`--anchor kvm-pio`), tier 1: an anchor that cannot be done fails
//! before connecting. The anchored runs on real KVM with QEMU are the `tier2` target's
//! `anchor` module.

use std::process::Command;

/// Tier 1: `--anchor kvm-pio` that cannot be done fails before connecting, with exit code 8
/// and the reason (here the VM: no process has PID 4999999; on a machine without tracefs or
/// root, that).
#[test]
fn explicit_anchor_that_cannot_be_done_exits_8_before_connecting() {
    let o = Command::new(env!("CARGO_BIN_EXE_vmtsync-cli"))
        .args([
            "probe",
            "--connect",
            "unix:/nonexistent/vmtsync-anchor.sock",
        ])
        .args([
            "--anchor",
            "kvm-pio",
            "--vm",
            "4999999",
            "--connect-timeout",
            "1",
        ])
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(8), "{err}");
    assert!(err.contains("exit anchoring (--anchor kvm-pio)"), "{err}");
    assert!(
        !err.contains("nonexistent"),
        "failed before connecting: {err}"
    );
    // Without --anchor the same run is an unreachable agent (7), with a note why it would not
    // have been anchored.
    let o = Command::new(env!("CARGO_BIN_EXE_vmtsync-cli"))
        .args([
            "probe",
            "--connect",
            "unix:/nonexistent/vmtsync-anchor.sock",
        ])
        .args(["--vm", "4999999", "--connect-timeout", "1"])
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(7), "{err}");
    assert!(err.contains("not exit-anchored"), "{err}");
}
