//! `vmtsync plot` through the real CLI, on the sync file behind the README's picture (made on
//! this project's machine: 20 in-process rounds, then 20 exit-anchored ones).

use std::path::{Path, PathBuf};

use crate::util::{guarded_output, vmtsync};

fn readme_sync_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/sync-plot.jsonl")
}

fn plot(args: &[&str]) -> std::process::Output {
    guarded_output(vmtsync().arg("plot").args(args), b"")
}

#[test]
fn the_readme_sync_file_plots_a_bar_per_segment_in_its_anchors_colour() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.svg");
    let o = plot(&[
        readme_sync_file().to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--truth",
        "0",
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("40 segments of 1 vCPU(s)"));
    let svg = std::fs::read_to_string(&out).unwrap();
    // A bar per segment: two-point vertical polylines in the kind's colour (the legend's
    // swatches are rectangles).
    let bars = |colour: &str| {
        svg.lines()
            .filter(|l| {
                l.starts_with("<polyline")
                    && l.contains(&format!("stroke=\"{colour}\""))
                    && l.contains("stroke-width=\"2\"")
            })
            .count()
    };
    assert_eq!(bars("#FF7F0E"), 20, "in-process rounds");
    assert_eq!(bars("#1F77B4"), 20, "exit-anchored rounds");
    assert!(
        svg.contains("exit-anchored width 110083..118852"),
        "caption widths"
    );
    assert!(svg.contains("true offset (--truth)"));
}

#[test]
fn plot_exit_codes_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.svg");
    let out = out.to_str().unwrap();
    let header_only = dir.path().join("h.jsonl");
    std::fs::write(
        &header_only,
        "{\"type\":\"header\",\"schema\":1,\"tool\":\"t\",\"host_clock\":\"x86-tsc\",\"created_unix_s\":0}\n",
    )
    .unwrap();
    assert_eq!(
        plot(&[header_only.to_str().unwrap(), "--out", out])
            .status
            .code(),
        Some(4)
    );
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "not json\n").unwrap();
    assert_eq!(
        plot(&[bad.to_str().unwrap(), "--out", out]).status.code(),
        Some(5)
    );
    let missing = dir.path().join("missing.jsonl");
    assert_eq!(
        plot(&[missing.to_str().unwrap(), "--out", out])
            .status
            .code(),
        Some(1)
    );
    assert!(!Path::new(out).exists(), "no picture from a failed plot");
}
