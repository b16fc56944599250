//! Tier 2: the probe benchmark binary on real KVM, as a soundness check of the estimators on
//! real samples: every guaranteed interval (constant offset for KVM's debugfs mapping alone,
//! offset and rate with the software skew picked from the host TSC) must contain the truth in
//! every session, which the binary reports through its exit code (3 when one missed) and its
//! result line (`vmtsync_launch::bench::ProbeBench`).

use std::process::Command;

use vmtsync_launch::bench::{ProbeBench, last_line};
use vmtsync_tests::vmm::qemu::have_qemu;

use crate::util::kvm_truth_ready;

crate::trials!(
    kvm_truth_ready;
    probe_bench_intervals_contain_the_truth_on_real_kvm,
);

fn probe_bench_intervals_contain_the_truth_on_real_kvm() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vmtsync-probe-bench"));
    // The vsock sessions are 32 probes here (trace-cmd's 339 in the benchmark itself).
    cmd.args(["--sessions", "3", "--probes", "16", "--vsock-probes", "32"]);
    if !have_qemu() {
        // The binary itself fails under CI without QEMU; elsewhere run the KVM paths only.
        cmd.args(["--no-qemu", "--no-vsock"]);
    }
    let out = cmd.output().expect("vmtsync-probe-bench starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let Some(bench) = last_line::<ProbeBench>(&stdout) else {
        panic!("no probe bench line:\n{stdout}");
    };
    let names: Vec<&str> = bench.rows.iter().map(|r| r.name.as_str()).collect();
    for name in [
        "builtin/exit-tight",
        "builtin/exit-loose",
        "builtin/host-thread",
    ] {
        let row = bench.rows.iter().find(|r| r.name == name);
        assert!(
            row.is_some_and(|r| (r.sessions, r.probes) == (3, 16)),
            "{name}: {row:?}"
        );
    }
    // Built-in VMM 4, skew 2; with QEMU: stdio, stdio-first, the exit-anchored kvm-pio row,
    // the boot vCPU's sync-port rows (loop in ring 3 and in ring 0), and the plain vsock rows
    // (all 32 probes, and the first 16); the sync-port vsock rows (stream, sync-port with the
    // loop in ring 3 and in ring 0) when vhost-device-vsock is there (always under CI).
    let sync = names
        .iter()
        .filter(|n| n.starts_with("vsock/stream") || n.starts_with("vsock/sync-port"))
        .count();
    assert!(sync == 0 || sync == 3, "{names:?}");
    assert_eq!(
        names.len(),
        4 + 7 * usize::from(have_qemu()) + sync + 2,
        "{names:?}"
    );
    if have_qemu() {
        for name in [
            "qemu-microvm/kvm-pio",
            "qemu-microvm/sync-port-ring0",
            "vsock/32",
        ] {
            assert!(names.contains(&name), "{name} missing: {names:?}");
        }
    }
    // Identity rows: every session's offset interval held the truth. Every row, skewed ones
    // included: the drift estimator's offset and rate bounds held it.
    for row in &bench.rows {
        if !row.name.starts_with("skew/") {
            assert_eq!(row.contains, 3, "{row:?}");
        }
        assert_eq!(row.drift_contains, 3, "{row:?}");
    }
    eprintln!("{}", stdout.lines().take(8).collect::<Vec<_>>().join("\n"));
}
