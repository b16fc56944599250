//! Tier 1: nothing is lost when `vmtsync probe --continuous` dies in the middle of writing its
//! sync file. The real program runs against the loopback agent and is killed: by SIGKILL at
//! several points of a run, and by SIGXFSZ in the middle of a segment's `write(2)` (a file-size
//! limit makes the kernel write part of the line and then kill the process, which tears the
//! last line deterministically). Each file must read as exactly its complete lines, with every
//! byte after the last `\n` reported as cut, by the library and by `vmtsync convert --sync`
//! (a warning on stderr); reading never modifies the file, and a new run on the same file cuts
//! the torn line, warns how much it cut, and appends after it.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use vmtsync::syncfile::{CutTail, SyncFile};
use vmtsync_tests::ChildGuard;
use vmtsync_tests::fake_agent::{self as fake, SkewedClock};

use crate::util::{guarded_output, vmtsync};

/// The agent's skew: the offset every segment must bound.
const SKEW: i64 = 77_000;

fn scratch(test: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("vmtsync-sync-crash-{test}-"))
        .tempdir()
        .unwrap()
}

/// `probe --continuous` arguments against `tcp:127.0.0.1:port`, rounds back to back.
fn probe_args(port: u16, file: &Path, rounds: Option<u32>) -> Vec<String> {
    let mut a: Vec<String> = [
        "probe",
        "--connect",
        &format!("tcp:127.0.0.1:{port}"),
        "--probes",
        "4",
        "--continuous",
        "--out",
        file.to_str().unwrap(),
        "--resync",
        "0",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    if let Some(n) = rounds {
        a.extend(["--rounds".to_owned(), n.to_string()]);
    }
    a
}

/// Newline-terminated lines in `file` so far (0 while it does not exist).
fn complete_lines(file: &Path) -> usize {
    std::fs::read(file).map_or(0, |b| b.iter().filter(|&&c| c == b'\n').count())
}

/// Checks that `file`, as a killed writer left it, reads as exactly its complete lines (a
/// header and segments that bound the agent's skew) with the rest reported as cut, through
/// the library and the CLI, and that reading leaves the file as it was. Returns the cut.
fn reads_up_to_the_last_complete_line(file: &Path) -> Option<CutTail> {
    let bytes = std::fs::read(file).unwrap();
    let newlines = bytes.iter().filter(|&&c| c == b'\n').count();
    let kept = bytes.iter().rposition(|&c| c == b'\n').map_or(0, |i| i + 1);
    assert!(newlines >= 1, "the header is always whole: {bytes:?}");
    let sync = SyncFile::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    assert_eq!(
        sync.segments.len(),
        newlines - 1,
        "every complete segment line is kept"
    );
    for s in &sync.segments {
        assert!(s.offset_lo <= SKEW && SKEW <= s.offset_hi, "{s:?}");
    }
    let want = (bytes.len() > kept).then(|| CutTail {
        bytes: u64::try_from(bytes.len() - kept).unwrap(),
        complete_lines: u64::try_from(newlines).unwrap(),
    });
    assert_eq!(
        sync.cut, want,
        "the cut is exactly the bytes after the last newline"
    );

    let file_arg = file.to_str().unwrap();
    let out = guarded_output(
        vmtsync().args(["convert", "--sync", file_arg, "--vcpu", "0"]),
        b"123456789\n",
    );
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if sync.segments.is_empty() {
        assert_eq!(out.status.code(), Some(4), "no segment yet: {stderr}");
    } else {
        assert_eq!(out.status.code(), Some(0), "{stderr}");
    }
    match want {
        Some(cut) => assert!(
            stderr.contains(&format!(
                "vmtsync: warning: {file_arg}: cut an incomplete last line ({} bytes, 1 line) after line {}",
                cut.bytes, cut.complete_lines
            )),
            "{stderr}"
        ),
        None => assert!(!stderr.contains("warning"), "{stderr}"),
    }
    assert_eq!(
        std::fs::read(file).unwrap(),
        bytes,
        "readers never modify the file"
    );
    want
}

/// Waits (at most 60 s) for the guarded child to end.
fn wait(guard: &mut ChildGuard) -> ExitStatus {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(s) = guard.child().try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < end, "vmtsync did not end within 60 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `kill -9` of a running `probe --continuous`, after 1, 3, 8 and 20 segments: whatever the
/// kill interrupted, the file reads up to its last complete segment.
#[test]
fn kill_9_mid_run_leaves_a_file_read_up_to_its_last_complete_segment() {
    for after in [1, 3, 8, 20] {
        let dir = scratch("kill9");
        let file = dir.path().join("sync.jsonl");
        let (port, agent) = fake::spawn_tcp(SkewedClock {
            skew: SKEW,
            vcpu: 0,
        })
        .unwrap();
        let mut guard = ChildGuard::new(
            vmtsync()
                .args(probe_args(port, &file, None))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("vmtsync-cli starts"),
        );
        let end = Instant::now() + Duration::from_secs(60);
        while complete_lines(&file) < 1 + after {
            assert!(
                guard.child().try_wait().unwrap().is_none(),
                "vmtsync ended before it was killed"
            );
            assert!(Instant::now() < end, "no {after} segments within 60 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Child::kill is SIGKILL to this PID.
        guard.child().kill().unwrap();
        let status = wait(&mut guard);
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
        agent.join().unwrap();
        assert!(complete_lines(&file) > after);
        reads_up_to_the_last_complete_line(&file);
    }
}

/// A file-size limit tears a segment line in the middle of its `write(2)` and the kernel kills
/// the writer (SIGXFSZ): the reader cuts the torn line and says how much, and the next run on
/// the same file cuts it too and appends whole segments after it.
#[test]
fn a_write_torn_by_a_signal_is_cut_and_the_next_run_appends_after_it() {
    let mut torn = 0;
    // Several limits, so that at least one falls inside a line (a limit could coincide with a
    // line's end, which the checks accept but which tears nothing).
    for limit in [1_000_u64, 1_700, 2_500] {
        let dir = scratch("fsize");
        let file = dir.path().join("sync.jsonl");
        let (port, agent) = fake::spawn_tcp(SkewedClock {
            skew: SKEW,
            vcpu: 0,
        })
        .unwrap();
        let mut guard = ChildGuard::new(
            Command::new("prlimit")
                .arg(format!("--fsize={limit}"))
                .arg("--")
                .arg(env!("CARGO_BIN_EXE_vmtsync-cli"))
                .args(probe_args(port, &file, None))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("prlimit (util-linux) starts"),
        );
        let status = wait(&mut guard);
        assert_eq!(status.signal(), Some(libc::SIGXFSZ), "{status:?}");
        agent.join().unwrap();
        let len = std::fs::metadata(&file).unwrap().len();
        assert_eq!(len, limit, "the kernel wrote up to the limit");
        let Some(cut) = reads_up_to_the_last_complete_line(&file) else {
            continue;
        };
        torn += 1;
        let before = SyncFile::read(&file).unwrap().segments;
        let mut kept = std::fs::read(&file).unwrap();
        kept.truncate(usize::try_from(limit - cut.bytes).unwrap());

        let (port, agent) = fake::spawn_tcp(SkewedClock {
            skew: SKEW,
            vcpu: 0,
        })
        .unwrap();
        let args = probe_args(port, &file, Some(2));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = guarded_output(vmtsync().args(&args), b"");
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!(
                "vmtsync: warning: {}: cut an incomplete last line ({} bytes, 1 line) after line {}",
                file.display(),
                cut.bytes,
                cut.complete_lines
            )),
            "the resumed run says what it cut: {stderr}"
        );
        agent.join().unwrap();
        assert_eq!(reads_up_to_the_last_complete_line(&file), None);
        let after = SyncFile::read(&file).unwrap().segments;
        assert_eq!(after.len(), before.len() + 2);
        assert_eq!(
            after[..before.len()],
            before[..],
            "the complete segments stand"
        );
        let text = std::fs::read(&file).unwrap();
        assert_eq!(
            text[..kept.len()],
            kept[..],
            "the complete lines are byte for byte as they were"
        );
    }
    assert!(torn >= 1, "no limit tore a line");
}
