//! Tier 1 of `vmtsync record --from-memory` (issue 16): the flags that choose a front end.
//! Its recordings of real guests are in the tier2 target's module of the same name.

use crate::util::{text, vmtsync};

/// Tier 1: the flags that choose a front end: exactly one of `--connect` and
/// `--from-memory`, the latter with `--vm`, and the protocol-only flags refused with it.
#[test]
fn record_needs_exactly_one_front_end_and_says_which_flags_go_with_it() {
    let cases: [(&[&str], &str); 5] = [
        (&["--out", "x.dat"], "--connect"),
        (
            &[
                "--out",
                "x.dat",
                "--from-memory",
                "--connect",
                "unix:/nonexistent",
            ],
            "cannot be used with",
        ),
        (&["--out", "x.dat", "--from-memory"], "--vm"),
        (
            &[
                "--out",
                "x.dat",
                "--from-memory",
                "--vm",
                "1",
                "--probe-log",
                "p.jsonl",
            ],
            "cannot be used with",
        ),
        (
            &[
                "--out",
                "x.dat",
                "--from-memory",
                "--vm",
                "1",
                "--elf",
                "guest.elf",
            ],
            "--symbol",
        ),
    ];
    for (args, says) in cases {
        let o = crate::util::guarded_output(vmtsync().arg("record").args(args), b"");
        let stderr = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(says),
            "{args:?} should mention {says}: {stderr}"
        );
    }
}

/// Tier 1: a flag of one front end given to the other is refused by the parser (exit 2) and
/// named in the message, never silently ignored: the protocol's sync flags with
/// `--from-memory`, and the memory reader's flags with `--connect` (or with neither).
#[test]
fn a_flag_of_the_other_front_end_is_refused_never_ignored() {
    let memory = ["--out", "x.dat", "--from-memory", "--vm", "1"];
    let protocol_only: [&[&str]; 9] = [
        &["--placement", "one-sided"],
        &["--probes", "8"],
        &["--timeout", "100"],
        &["--resync", "50"],
        &["--anchor", "none"],
        &["--shutdown"],
        &["--console", "c.txt"],
        &["--probe-log", "p.jsonl"],
        &["--connect", "unix:/nonexistent"],
    ];
    let connect = ["--out", "x.dat", "--connect", "unix:/nonexistent"];
    let memory_only: [&[&str]; 8] = [
        &["--poll-ms", "5"],
        &["--trust-raw-tsc"],
        &["--beacon-port", "0x2400"],
        &["--addr", "0x1000"],
        &["--guest-phys", "0x1000"],
        &["--elf", "g.elf", "--symbol", "ring"],
        &["--from-memory"],
        &["--", "qemu-system-x86_64"],
    ];
    let cases = protocol_only
        .iter()
        .map(|f| (&memory[..], *f, "--from-memory"))
        .chain(memory_only.iter().map(|f| (&connect[..], *f, "--connect")));
    for (base, flag, other) in cases {
        let o = crate::util::guarded_output(vmtsync().arg("record").args(base).args(flag), b"");
        let stderr = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{flag:?}: {stderr}");
        let name = if flag[0] == "--" { "<VMM>" } else { flag[0] };
        assert!(
            stderr.contains("cannot be used with")
                && stderr.contains(name)
                && stderr.contains(other),
            "{flag:?} with {other} should be refused by name: {stderr}"
        );
    }
    // A memory-only flag with no front end at all: the parser asks for --from-memory.
    let o = crate::util::guarded_output(
        vmtsync()
            .arg("record")
            .args(["--out", "x.dat", "--poll-ms", "5"]),
        b"",
    );
    let stderr = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--from-memory"), "{stderr}");
}

/// A copy of a fixture's `proc/` tree with a readable (empty) `mem` for `pid`: enough for
/// the memory reader to open the "VMM" and reach its first step after that.
fn proc_with_mem(fixture: &str, pid: u32) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = crate::util::fixtures().join(fixture).join("proc");
    for entry in std::fs::read_dir(&src).expect("fixture proc") {
        let entry = entry.expect("entry");
        let to = dir.path().join(entry.file_name());
        std::fs::create_dir(&to).expect("mkdir");
        for f in std::fs::read_dir(entry.path()).expect("pid dir") {
            let f = f.expect("file");
            std::fs::copy(f.path(), to.join(f.file_name())).expect("copy");
        }
    }
    std::fs::write(dir.path().join(pid.to_string()).join("mem"), b"").expect("mem");
    dir
}

/// Tier 1: `--from-memory` on a fixture debugfs tree: a VM that is not there exits 4 (as
/// for every command), and `--tracefs` is the tracefs the beacons' kvm_pio trace is started
/// in (a directory without kvm_pio: exit 3, "no tracefs", naming that directory and no
/// other).
#[test]
fn memory_mode_keeps_the_exit_codes_and_honours_tracefs() {
    let tree = crate::util::fixtures().join("intel");
    let proc = proc_with_mem("intel", 1001);
    let run = |extra: &[&str]| {
        let mut c = vmtsync();
        c.args(["record", "--from-memory", "--out"])
            .arg(proc.path().join("x.jsonl"))
            .args(["--format", "jsonl", "--no-progress", "--debugfs-root"])
            .arg(tree.join("kvm"))
            .arg("--proc-root")
            .arg(proc.path())
            .args(extra);
        crate::util::guarded_output(&mut c, b"")
    };
    let o = run(&["--vm", "99999"]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o.stderr));
    let fake = tempfile::tempdir().expect("tempdir");
    let fake_name = fake.path().display().to_string();
    let o = run(&[
        "--vm",
        "1001",
        "--beacon-port",
        "0x2400",
        "--tracefs",
        &fake_name,
    ]);
    let stderr = text(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains(&format!("tried {fake_name})")),
        "the trace should be looked for in --tracefs alone: {stderr}"
    );
    assert!(stderr.contains("port 0x2400"), "{stderr}");
}
