//! `vmtsync trace-cmd attach` and `export perf` on fixtures, tier 1: refusals (a truncated
//! guest trace, an incomplete vCPU map) and the perf argument. The real trace.dat files made
//! with `trace-cmd extract` are the `tier2` target's `attach` module.

use std::process::Output;

use crate::util::{attach, ok, vmtsync};

#[test]
fn a_truncated_guest_trace_is_refused_with_the_offset_and_no_output() {
    use vmtsync::formats::tracedat::{TraceDatWriter, WriterOptions};
    let dir = tempfile::tempdir().unwrap();
    let guest = dir.path().join("g.dat");
    let mut w = TraceDatWriter::create(&guest, WriterOptions::new(1, 1)).unwrap();
    for i in 0..3000u64 {
        w.push(0, 1_000_000 + i * 100, 0, &[]).unwrap();
    }
    w.finish(None).unwrap();
    let full = std::fs::read(&guest).unwrap();
    let cut = dir.path().join("cut.dat");
    std::fs::write(&cut, &full[..full.len() / 2]).unwrap();
    let out = dir.path().join("o.dat");
    let o = attach(&[
        "--guest",
        cut.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--offset",
        "5",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(5), "{err}");
    assert!(
        err.contains(": byte ") && err.contains("truncated"),
        "{err}"
    );
    assert!(!out.exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        2,
        "no temporary file left"
    );
}

/// `vmtsync export perf` on a fixture debugfs tree.
fn export_perf(tree: &str, extra: &[&str]) -> Output {
    let tree = crate::util::fixtures().join(tree);
    vmtsync()
        .args(["export", "perf", "--debugfs-root"])
        .arg(tree.join("kvm"))
        .arg("--proc-root")
        .arg(tree.join("proc"))
        .args(extra)
        .output()
        .expect("run vmtsync")
}

#[test]
fn export_perf_prints_the_guest_data_argument_or_explains_what_perf_cannot_express() {
    // Two vCPUs at offset 0, no TSC scaling files (identity): exact.
    let o = export_perf("noscaling", &["--vm", "5005"]);
    assert_eq!(ok(&o), "--guest-data=guest.perf.data,5005,0\n");
    // One vCPU of the second intel VM: offset 5000, ratio exactly 2^48.
    let o = export_perf(
        "intel",
        &["--vm", "2002", "--vcpu", "0", "--perf-data", "/tmp/g.data"],
    );
    assert_eq!(ok(&o), "--guest-data=/tmp/g.data,2002,5000\n");
    // The first intel VM runs its guests at 1.25x: no integer scale (perf's double 1.25 does
    // not invert KVM's fixed-point product exactly), and its two vCPUs' offsets differ by 789
    // ticks.
    let o = export_perf("intel", &["--vm", "1001"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(6), "{err}");
    assert!(o.stdout.is_empty());
    assert!(
        err.contains("not an integer") && err.contains("differs from vcpu0"),
        "{err}"
    );
    assert!(
        err.contains("off by ") && err.contains("at its current guest TSC"),
        "{err}"
    );
    // AMD, ratio 0xffff0000 / 2^32 (just below 1): perf's nearest scale 1 is wrong.
    let o = export_perf("amd", &["--vm", "3003", "--vcpu", "10"]);
    assert_eq!(o.status.code(), Some(6));
    // A vCPU that does not exist.
    let o = export_perf("noscaling", &["--vm", "5005", "--vcpu", "9"]);
    assert_eq!(o.status.code(), Some(4));
}

#[test]
fn attach_with_host_refuses_an_incomplete_vcpu_map_before_writing_anything() {
    use vmtsync::formats::tracedat::{TraceDatWriter, WriterOptions};
    let dir = tempfile::tempdir().unwrap();
    let guest = dir.path().join("g.dat");
    let mut w = TraceDatWriter::create(&guest, WriterOptions::new(2, 1)).unwrap();
    w.push(0, 1_000_000, 0, &[]).unwrap();
    w.push(1, 1_000_100, 0, &[]).unwrap();
    w.finish(None).unwrap();
    let (out, host_out) = (dir.path().join("o.dat"), dir.path().join("h.dat"));
    let o = attach(&[
        "--guest",
        guest.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--offset",
        "5",
        "--host",
        guest.to_str().unwrap(),
        "--host-output",
        host_out.to_str().unwrap(),
        "--vcpu-pid",
        "1=4242",
    ]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!out.exists() && !host_out.exists());
}
