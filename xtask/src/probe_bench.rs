//! `cargo xtask bench-probe`: the real-KVM probe benchmark (ours vs trace-cmd's fastest-RTT
//! estimator on the same samples).
//!
//! It runs `vmtsync-tests`' `vmtsync-probe-bench` binary in release mode (the VMM's exit
//! handling sits inside the measured brackets, so an unoptimised build would widen them). The
//! binary builds the guest agent itself (through `vmtsync-launch`, which installs the rustup
//! target when missing), so this works from a fresh clone. Arguments after `bench-probe` are
//! passed through (`--sessions K --probes N --machine microvm|q35 --no-qemu --no-vsock --no-skew --skew
//! O,R,F`; the default skew is derived from the host TSC when the run starts). Its truth is
//! each VM's KVM debugfs mapping composed with the skew, so it needs root. It prints a table
//! and one JSON line on stdout and exits 3 if a guaranteed interval ever missed the truth.

use anyhow::Result;

use crate::{cargo, sh};

/// Runs the probe benchmark with `args` passed through.
pub(crate) fn bench_probe(args: &[String]) -> Result<()> {
    sh(cargo()
        .args([
            "run",
            "--release",
            "--quiet",
            "-p",
            "vmtsync-tests",
            "--bin",
            "vmtsync-probe-bench",
            "--",
        ])
        .args(args))
}
