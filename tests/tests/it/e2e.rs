//! End to end through the real `vmtsync` program: `probe` and `convert --sync` against the
//! loopback agent (tier 1), then (the `tier2` target) the agent under QEMU on real KVM: a software
//! skew recovered by probes and undone by `convert`, the KVM debugfs mapping checked against
//! the agent's own TSC readings, and a VM killed in the middle of a probe run.
//!
//! Truth in tier 2 (`vmtsync_tests::truth`): the vCPU's KVM mapping read from debugfs, then the
//! agent's `skew=O,R,F` boot option (its reported TSC is `O + (tsc * R) >> F` of the TSC KVM
//! shows it), with the skew picked from the host TSC at the time. No test assumes this host's
//! offset 0: on an ordinary KVM host the guest TSC starts near zero and they hold all the same.

use std::process::{Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use vmtsync::link::transport::host_tsc_now;
use vmtsync::sync::convert_with_sync;
use vmtsync::syncfile::SyncFile;
use vmtsync_tests::ChildGuard;
use vmtsync_tests::fake_agent::{self as fake, SkewedClock};

use crate::util::{interrupt, vmtsync};

/// A scratch directory unique to this test and `test`, removed when the returned guard drops
/// (also when the test fails).
fn scratch(test: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("vmtsync-e2e-{test}-"))
        .tempdir()
        .unwrap()
}

/// Runs `vmtsync args…` with `input` on stdin ([`crate::util::run`]).
fn run(args: &[&str], input: &str) -> Output {
    crate::util::run(args, input.as_bytes())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Tier 1: `vmtsync probe --json` over TCP to the loopback agent (true offset = its skew).
#[test]
fn cli_probe_json_bounds_the_loopback_agents_skew() {
    let skew = -7_654_321_i64;
    let (port, agent) = fake::spawn_tcp(SkewedClock { skew, vcpu: 2 }).unwrap();
    let addr = format!("tcp:127.0.0.1:{port}");
    let out = run(
        &["probe", "--connect", &addr, "--json", "--probes", "40"],
        "",
    );
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    println!("cli probe: {v}");
    assert_eq!(v["schema"], 2);
    assert_eq!(v["vcpu"], 2);
    assert_eq!(v["probes"], 40);
    let (lo, hi) = (
        v["bound_lo"].as_i64().unwrap(),
        v["bound_hi"].as_i64().unwrap(),
    );
    assert!(
        lo <= skew && skew <= hi,
        "truth {skew} outside [{lo}, {hi}]"
    );
    let stats = agent.join().unwrap();
    assert!(stats.probes >= 40, "{stats:?}");
}

/// Tier 1: `vmtsync probe --json | head -c0`: stdout closed before the report is written is
/// not an error (exit 0, nothing on stderr), like any filter.
#[test]
fn cli_probe_into_a_closed_pipe_exits_0() {
    let (port, agent) = fake::spawn_tcp(SkewedClock { skew: 0, vcpu: 0 }).unwrap();
    let addr = format!("tcp:127.0.0.1:{port}");
    let mut guard = ChildGuard::new(
        vmtsync()
            .args(["probe", "--connect", &addr, "--json", "--probes", "8"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("vmtsync-cli starts"),
    );
    // Close the read end before vmtsync can write anything: its write fails with EPIPE.
    drop(guard.child().stdout.take());
    let mut stderr = Vec::new();
    std::io::Read::read_to_end(guard.child().stderr.as_mut().unwrap(), &mut stderr).unwrap();
    let status = guard.child().wait().unwrap();
    let out = Output {
        status,
        stdout: Vec::new(),
        stderr,
    };
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    assert!(agent.join().unwrap().probes >= 8);
}

/// Tier 1: SIGINT ends a one-shot `vmtsync probe` promptly with exit code 130, both in the
/// pause between probes (an hour-long --interval) and while retrying a connect (an hour-long
/// --connect-timeout). Before, the signal was swallowed until the interval had passed.
#[test]
fn cli_probe_sigint_exits_130_promptly() {
    let (port, _agent) = fake::spawn_tcp(SkewedClock { skew: 0, vcpu: 0 }).unwrap();
    let addr = format!("tcp:127.0.0.1:{port}");
    let spawn = |args: &[&str]| {
        ChildGuard::new(
            vmtsync()
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("vmtsync-cli starts"),
        )
    };
    let mut g = spawn(&[
        "probe",
        "--connect",
        &addr,
        "--probes",
        "4",
        "--interval",
        "3600000",
    ]);
    // Let it connect, greet and send its first probe; it then waits an hour for the next.
    std::thread::sleep(Duration::from_millis(500));
    let (code, err) = interrupt(&mut g);
    assert_eq!(code, Some(130), "stderr: {err}");
    assert_eq!(err, "vmtsync: interrupted\n");

    let scratch_dir = scratch("sigint");
    let addr = format!("unix:{}", scratch_dir.path().join("nobody.sock").display());
    let mut g = spawn(&["probe", "--connect", &addr, "--connect-timeout", "3600000"]);
    std::thread::sleep(Duration::from_millis(300));
    let (code, err) = interrupt(&mut g);
    assert_eq!(code, Some(130), "stderr: {err}");
    assert!(err.contains("interrupted while connecting"), "{err}");
}

/// Tier 1: nothing listening → exit 7 and a message that says what to check.
#[test]
fn cli_probe_without_an_agent_exits_7_with_a_clear_message() {
    let scratch_dir = scratch("noagent");
    let dir = scratch_dir.path();
    let sock = dir.join("nobody.sock");
    let addr = format!("unix:{}", sock.display());
    let out = run(
        &["probe", "--connect", &addr, "--connect-timeout", "300"],
        "",
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "stderr: {err}");
    assert!(err.starts_with("vmtsync: "), "{err}");
    assert!(err.contains("is the VM running"), "{err}");
    assert!(out.stdout.is_empty());
}

/// Tier 1: a sync file written by `vmtsync probe --continuous` is read back by `vmtsync
/// convert --sync`, which agrees exactly with the library and undoes the agent's skew within
/// the probe bounds; a vCPU without segments exits 4, a bad input line 5.
#[test]
fn cli_convert_sync_reads_what_cli_probe_continuous_wrote() {
    let skew = 123_456_789_i64;
    let scratch_dir = scratch("sync");
    let dir = scratch_dir.path();
    let file = dir.join("sync.jsonl");
    let (port, agent) = fake::spawn_tcp(SkewedClock { skew, vcpu: 0 }).unwrap();
    let addr = format!("tcp:127.0.0.1:{port}");
    let file_arg = file.to_str().unwrap();
    let out = run(
        &[
            "probe",
            "--connect",
            &addr,
            "--probes",
            "16",
            "--continuous",
            "--out",
            file_arg,
            "--rounds",
            "3",
            "--resync",
            "20",
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    agent.join().unwrap();
    let sync = SyncFile::read(&file).expect("a valid sync file");
    assert_eq!(sync.vcpus(), [0]);

    // Guest stamps the agent would have taken now: host TSC + skew.
    let (before, after) = (host_tsc_now().0, host_tsc_now().0 + 1_000_000);
    let guests: Vec<u64> = (0..50)
        .map(|i| before.wrapping_add_signed(skew) + i * 20_000)
        .collect();
    let input: String = guests.iter().map(|g| format!("{g}\n")).collect();
    let out = run(&["convert", "--sync", file_arg, "--vcpu", "0"], &input);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    let mut expect = Vec::new();
    convert_with_sync(&sync, 0, &mut input.as_bytes(), &mut expect, false).unwrap();
    assert_eq!(text(&out.stdout), text(&expect));
    // Each segment's offset is inside its probe bounds, which contain the skew, so the
    // conversion is off by at most the widest bound width.
    let width = sync
        .timeline(0)
        .unwrap()
        .records()
        .iter()
        .map(|s| s.offset_hi.abs_diff(s.offset_lo))
        .max()
        .unwrap();
    for (line, g) in text(&out.stdout).lines().zip(&guests) {
        let host: u64 = line.parse().unwrap();
        let exact = g.wrapping_add_signed(-skew);
        assert!(
            host.abs_diff(exact) <= width,
            "{g} -> {host}, exact {exact}, bound width {width}"
        );
        assert!(host + width >= before && host <= after + width);
    }

    let out = run(&["convert", "--sync", file_arg, "--vcpu", "5"], "1\n");
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("no segment for vCPU 5"));
    let out = run(&["convert", "--sync", file_arg, "--vcpu", "0"], "12x\n");
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    assert!(text(&out.stderr).starts_with("vmtsync: input line 1"));
}
