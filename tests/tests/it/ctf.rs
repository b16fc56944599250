//! CTF 1.8 output, tier 1: `vmtsync export ctf` refuses bad inputs and targets (the readings
//! back in babeltrace2 are in the `tier2` target).

use std::path::Path;

use crate::util::{export_ctf, jsonl_line, scratch, text};

/// Bad input and bad targets: clear messages, documented exit codes, nothing written.
#[test]
fn bad_inputs_and_targets_are_refused_clearly() {
    let dir = scratch("ctf-bad");
    let d = dir.path();
    let out = d.join("trace");
    let run = |input: &Path, out: &Path| {
        export_ctf(&[
            "--from",
            input.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--tsc-hz",
            "1000000000",
        ])
    };
    let garbage = d.join("garbage.bin");
    std::fs::write(&garbage, b"\x7fELF\x02\x01").unwrap();
    let o = run(&garbage, &out);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("not a vmtsync recording"));
    let bad = d.join("bad.jsonl");
    let good = jsonl_line(0, 1, 10, 10, 9, 11, &[1]);
    std::fs::write(&bad, format!("{good}\n{good}\n{{\"schema\":1,\"vcpu\":0\n")).unwrap();
    let o = run(&bad, &out);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("line 3"), "{}", text(&o.stderr));
    let truncated = d.join("cut.dat");
    let o = run(&d.join("missing.jsonl"), &out);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    // Nothing is left behind by a failed export.
    assert!(!out.exists());
    assert_eq!(std::fs::read_dir(d).unwrap().count(), 2);
    // A target that holds something else is never touched.
    let full = d.join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("keep"), "x").unwrap();
    let ok = d.join("ok.jsonl");
    std::fs::write(&ok, format!("{good}\n")).unwrap();
    let o = run(&ok, &full);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("not empty"), "{}", text(&o.stderr));
    assert_eq!(std::fs::read_to_string(full.join("keep")).unwrap(), "x");
    // A truncated trace.dat names the byte where it breaks.
    let dat = small_trace_dat(d);
    let bytes = std::fs::read(&dat).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let o = run(&truncated, &out);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("byte "), "{}", text(&o.stderr));
    assert!(!out.exists());
}

/// A small guest trace.dat written by vmtsync's writer (two events, pre-converted).
fn small_trace_dat(d: &Path) -> std::path::PathBuf {
    use vmtsync::formats::tracedat::{TraceDatWriter, WriterOptions};
    let p = d.join("small.dat");
    let mut w = TraceDatWriter::create(&p, WriterOptions::new(1, 7)).expect("create");
    for i in 0..2_000u64 {
        w.push(0, 1_000 + i, 1, &i.to_le_bytes()).expect("push");
    }
    w.finish(None).expect("finish");
    p
}
