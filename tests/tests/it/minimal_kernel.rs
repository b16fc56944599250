//! The minimal kernel (`tests/minimal-kernel/`, docs/embedding.md): a guest we did not write
//! as the agent, embedding vmtsync-core.
//!
//! Tier 1 counts its glue: the non-blank, non-comment lines between its `vmtsync-glue: begin`
//! and `vmtsync-glue: end` markers must be at most 30. Tier 2 boots it under QEMU microvm/KVM,
//! records it with `vmtsync record` into a trace.dat, and reads that back with trace-cmd
//! itself: every event the kernel records is there (ids and sequence numbers), and each lies
//! on the host's timeline within the recording's guaranteed width of the truth, which comes
//! from KVM's debugfs mapping of the VM (the kernel applies no skew of its own).

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use vmtsync_core::GuestTicks;
use vmtsync_launch::agent::{Guest, guest_elf};
use vmtsync_tests::truth::{GuestTruth, truth_mapping};
use vmtsync_tests::vmm::qemu::debug_exit_status;

use crate::tracedat::{assert_dump_ok, report};
use crate::util::{QemuAgent, anchor_ready, have_trace_cmd, scratch, text};

/// The most glue lines the embedding may take (issue 17).
const GLUE_LIMIT: usize = 30;
/// The kernel's request count and event ids (`tests/minimal-kernel/src/main.rs`).
const REQUESTS: u64 = 1000;
const REQUEST_START: u64 = 0x51;
const REQUEST_DONE: u64 = 0x52;

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

/// One event of `trace-cmd report`: (timestamp, id, sequence number from the payload).
fn events(dat: &Path, how: &str) -> Vec<(u64, u64, u64)> {
    report(&["report", how, "-i", dat.to_str().unwrap()])
        .into_iter()
        .filter(|l| l.rest.starts_with("event_data:"))
        .map(|l| {
            let field = |k: &str| {
                l.rest
                    .split(k)
                    .nth(1)
                    .unwrap_or_else(|| panic!("no {k} in {}", l.rest))
                    .to_string()
            };
            let id = field("id=")
                .split_whitespace()
                .next()
                .unwrap()
                .parse()
                .unwrap();
            let hex: String = field("payload=").split_whitespace().collect();
            (l.ts, id, crate::record::seq_of(&hex[..16]))
        })
        .collect()
}

/// Tier 2: the minimal kernel under QEMU microvm/KVM, recorded by `vmtsync record` (sync
/// rounds exit-anchored on the VM's `kvm_pio` exits) into a trace.dat until it has all of its 2,000 events; a second recording finds no more and shuts
/// it down. `trace-cmd dump -v`
/// accepts the file; `trace-cmd report --raw-ts` shows every event the kernel recorded
/// exactly once (a start and a done per request, in order); `trace-cmd report -t` puts each
/// within the recording's widest guaranteed interval of its true host tick (KVM debugfs).
/// The kernel ends the VM through isa-debug-exit with 0 on the host's shutdown.
#[test]
fn minimal_kernel_events_land_in_trace_cmd_on_the_host_timeline() {
    let test = "minimal_kernel_events_land_in_trace_cmd_on_the_host_timeline";
    if !(anchor_ready(test) && have_trace_cmd(test)) {
        return;
    }
    let elf = guest_elf(Guest::MinimalKernel).expect("the minimal kernel builds");
    let dir = scratch("minimal-kernel");
    let mut vm = QemuAgent::boot_elf(&elf, dir.path(), false);
    let dat = dir.path().join("guest.dat");
    let n = 2 * REQUESTS;
    // Sync rounds anchored on the VM's own port exits (`kvm:kvm_pio`), as a user with root
    // records a VM they name: the kernel's Link writes each byte then waits for THRE.
    let pid = vm.guard.pid().to_string();
    let out = vm.record(&dat, n, 200, &["--anchor", "kvm-pio", "--vm", &pid]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    // The truth is read while the VM runs (after its vCPU has run, so QEMU's set-up of the
    // TSC is behind it); the session is then ended by a second, short recording, which must
    // find nothing more to record.
    let truth = GuestTruth::new(
        truth_mapping(vm.guard.pid(), 0).expect("debugfs truth"),
        None,
    );
    let rest = dir.path().join("rest.jsonl");
    let end = crate::util::record(&[
        "--connect",
        &vm.addr,
        "--out",
        rest.to_str().unwrap(),
        "--format",
        "jsonl",
        "--duration",
        "1",
        "--timeout",
        "10000",
        "--shutdown",
    ]);
    assert_eq!(end.status.code(), Some(0), "{}", text(&end.stderr));
    assert_eq!(
        std::fs::read_to_string(&rest).unwrap(),
        "",
        "events beyond the kernel's {n}"
    );
    let status = vm
        .guard
        .wait_timeout(Duration::from_secs(20))
        .unwrap()
        .expect("the kernel ends the VM after the shutdown");
    assert_eq!(status.code(), Some(debug_exit_status(0)), "{stderr}");
    println!("minimal kernel recorded: {}", stderr.trim());

    assert_dump_ok(&dat);
    let raw = events(&dat, "--raw-ts");
    let host = events(&dat, "-t");
    assert_eq!(raw.len() as u64, n, "{stderr}");
    assert_eq!(host.len(), raw.len());
    let mut want: BTreeSet<(u64, u64)> = (0..REQUESTS)
        .flat_map(|s| [(REQUEST_START, s), (REQUEST_DONE, s)])
        .collect();
    for &(_, id, seq) in &raw {
        assert!(
            want.remove(&(id, seq)),
            "event {id:#x} #{seq} twice or unknown"
        );
    }
    assert!(want.is_empty(), "missing: {want:?}");
    // One ring, one producer: the file's order is the kernel's, start before done.
    let order: Vec<(u64, u64)> = raw.iter().map(|&(_, id, seq)| (seq, id)).collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "events out of order");
    assert!(raw.windows(2).all(|w| w[0].0 <= w[1].0), "raw TSCs go back");

    // The truth's rate is 1 (no TSC scaling, no skew), so a sound recording keeps identity
    // segments: raw guest TSCs plus TIME_SHIFT, which trace-cmd applies itself.
    assert!(
        !stderr.contains("pre-converted"),
        "identity truth but pre-converted: {stderr}"
    );
    let max_width: u64 = stderr
        .split("max ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.trim_end_matches(',').parse().ok())
        .unwrap_or_else(|| panic!("summary without widths: {stderr}"));
    let exact = truth.composed().expect("truth composes");
    let mut far = 0;
    let mut worst = 0;
    for (&(g, id, seq), &(h, id2, seq2)) in raw.iter().zip(&host) {
        assert_eq!((id, seq), (id2, seq2), "the same event in both reports");
        let t = exact
            .try_host_from_guest_ceil(GuestTicks(g))
            .expect("maps")
            .0;
        worst = worst.max(h.abs_diff(t));
        if h.abs_diff(t) > max_width {
            far += 1;
        }
    }
    println!(
        "trace-cmd: {} events, worst |host - truth| {worst} ticks, widest interval {max_width}",
        raw.len()
    );
    assert_eq!(far, 0, "trace-cmd host times beyond the guaranteed width");
}
