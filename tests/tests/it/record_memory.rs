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
