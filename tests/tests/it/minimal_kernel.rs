//! The minimal kernel (`tests/minimal-kernel/`, docs/embedding.md): a guest we did not write
//! as the agent, embedding vmtsync-core.
//!
//! Tier 1 counts its glue: the non-blank, non-comment lines between its `vmtsync-glue: begin`
//! and `vmtsync-glue: end` markers must be at most 30. Tier 2 (the `tier2` target) boots it under QEMU microvm/KVM
//! twice. Once recorded with exit-anchored sync rounds into a trace.dat, read back with
//! trace-cmd itself: every event the kernel records is there (ids and sequence numbers), each
//! within the recording's guaranteed width of the truth, which comes from KVM's debugfs
//! mapping of the VM (the kernel applies no skew of its own), and `vmtsync validate` checks
//! each against the host kernel's stamps of the kernel's own port exits. Once with its console
//! and the protocol on one UART from its first byte: the text arrives byte for byte and no
//! event is lost. The ids, counts and texts below are the kernel's
//! (`tests/minimal-kernel/src/main.rs`); a change there that is not made here fails a test.

use vmtsync_launch::agent::Guest;

/// The most glue lines the embedding may take (issue 17).
const GLUE_LIMIT: usize = 30;
const BEGIN: &str = "// vmtsync-glue: begin";
const END: &str = "// vmtsync-glue: end";

/// The glue lines of one source file: the non-blank lines between a [`BEGIN`] and an [`END`]
/// marker line that are not `//` comments. Nested, unclosed or stray markers are an error, so
/// a marker typo cannot hide lines from the count.
fn glue_lines(src: &str) -> Result<Vec<&str>, String> {
    let mut inside = false;
    let mut lines = Vec::new();
    for (n, line) in src.lines().enumerate() {
        let t = line.trim();
        if t.starts_with(BEGIN) {
            if inside {
                return Err(format!("line {}: begin inside a glue block", n + 1));
            }
            inside = true;
        } else if t.starts_with(END) {
            if !inside {
                return Err(format!("line {}: end without a begin", n + 1));
            }
            inside = false;
        } else if inside && !t.is_empty() && !t.starts_with("//") {
            lines.push(t);
        }
    }
    if inside {
        return Err("a glue block is never closed".into());
    }
    Ok(lines)
}

/// The counter itself: comments, doc comments and blank lines are not counted, code is, and
/// broken markers are refused.
#[test]
fn glue_counter_counts_code_between_markers_only() {
    let src = "fn a() {}\n// vmtsync-glue: begin (x)\n\n/// doc\nlet a = 1; // why\n  // note\n\
               }\n// vmtsync-glue: end\nlet b = 2;\n  // vmtsync-glue: begin\nc();\n  \
               // vmtsync-glue: end\n";
    assert_eq!(glue_lines(src), Ok(vec!["let a = 1; // why", "}", "c();"]));
    assert!(glue_lines("// vmtsync-glue: begin\nx();\n").is_err());
    assert!(glue_lines("x();\n// vmtsync-glue: end\n").is_err());
    assert!(glue_lines("// vmtsync-glue: begin\n// vmtsync-glue: begin\n").is_err());
}

/// Tier 1: the minimal kernel's glue (Link, clock, statics, polling and its two record calls)
/// is at most [`GLUE_LIMIT`] lines, counted over every source file of the kernel.
#[test]
fn minimal_kernel_glue_is_at_most_30_lines() {
    let src_dir = Guest::MinimalKernel.dir().join("src");
    let mut total = 0;
    let mut blocks = 0;
    for entry in std::fs::read_dir(&src_dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let src = std::fs::read_to_string(&path).unwrap();
        let lines = glue_lines(&src).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        blocks += src.lines().filter(|l| l.trim().starts_with(BEGIN)).count();
        total += lines.len();
        for l in &lines {
            println!("{}: {l}", path.file_name().unwrap().to_string_lossy());
        }
    }
    println!("minimal kernel glue: {total} lines in {blocks} blocks");
    assert!(blocks > 0, "no glue markers in {}", src_dir.display());
    assert!(total <= GLUE_LIMIT, "{total} glue lines, over {GLUE_LIMIT}");
}
