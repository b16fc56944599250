//! Tier 2: exit-anchored probing (`--anchor kvm-pio`) on real KVM with QEMU: the agent on a
//! QEMU serial chardev socket, its COM1 exits read from a private tracefs instance.
//!
//! Truth: KVM's mapping of QEMU's vCPU (debugfs) composed with the agent's software skew
//! (`Skew::pick()`: an offset derived from the host TSC now, rate 1.0001), so the anchored
//! brackets must contain a line that is not "offset 0, rate 1". Every sample's bracket and
//! every session's guaranteed interval are checked against it; the instance must be gone
//! afterwards, also after SIGINT.

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
