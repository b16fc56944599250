//! Set-up both test targets share, one way each (the `tier2` target includes this file in its
//! own `util`, which adds the tier-2 helpers): the CLI runner, scratch directories, `vmtsync
//! record` sessions against the loopback agent ([`Loopback`]), and reading recordings.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use vmtsync::kvm::hosttsc::read_host_tsc;
use vmtsync_tests::ChildGuard;
use vmtsync_tests::fake_agent::{SkewedClock, Workload, serve_with_events};

/// The fixture directory.
pub(crate) fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/debugfs")
}

/// A `vmtsync` command (the real CLI, built into this crate as `vmtsync-cli`).
pub(crate) fn vmtsync() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vmtsync-cli"))
}

/// Runs `c` with `input` on stdin and collects its output, the child guarded by
/// [`vmtsync_tests::ChildGuard`] throughout (killed by PID if the test panics meanwhile).
pub(crate) fn guarded_output(c: &mut Command, input: &[u8]) -> Output {
    use std::io::{Read, Write};
    use std::process::Stdio;
    let mut g = vmtsync_tests::ChildGuard::new(
        c.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn"),
    );
    let mut stdin = g.child().stdin.take().expect("stdin");
    let mut out = g.child().stdout.take().expect("stdout");
    let mut err = g.child().stderr.take().expect("stderr");
    let input = input.to_vec();
    // Separate threads so no pipe can fill up and stall the child.
    let w = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let e = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let mut stdout = Vec::new();
    let _ = out.read_to_end(&mut stdout);
    let stderr = e.join().expect("stderr reader");
    let _ = w.join();
    let status = g.child().wait().expect("wait");
    Output {
        status,
        stdout,
        stderr,
    }
}

/// Sends SIGINT to the guarded child by PID and waits (at most 10 s) for it to exit.
pub(crate) fn interrupt(guard: &mut ChildGuard) -> (Option<i32>, String) {
    guard.signal(libc::SIGINT).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = guard.child().try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < end, "vmtsync ignored SIGINT for 10 s");
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(guard.child().stderr.as_mut().unwrap(), &mut err).unwrap();
    (status.code(), err)
}

/// Runs `vmtsync args…` with `input` on stdin to completion ([`guarded_output`]).
pub(crate) fn run(args: &[&str], input: &[u8]) -> Output {
    guarded_output(vmtsync().args(args), input)
}

/// Runs `vmtsync trace-cmd attach` with `args`.
pub(crate) fn attach(args: &[&str]) -> Output {
    vmtsync()
        .args(["trace-cmd", "attach"])
        .args(args)
        .output()
        .expect("run vmtsync")
}

/// The stdout of a `vmtsync` run `o`, which must have succeeded (its output shown if not).
pub(crate) fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "vmtsync: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Runs `vmtsync export ctf ...` (guarded).
pub(crate) fn export_ctf(args: &[&str]) -> Output {
    guarded_output(vmtsync().args(["export", "ctf"]).args(args), b"")
}

/// A JSON line as `vmtsync record --format jsonl` writes it.
pub(crate) fn jsonl_line(
    vcpu: u64,
    id: u64,
    guest: u64,
    host: u64,
    lo: u64,
    hi: u64,
    payload: &[u8],
) -> String {
    let hex: String = payload.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        r#"{{"schema":1,"vcpu":{vcpu},"id":{id},"guest_tsc":{guest},"host_tsc":{host},"host_lo":{lo},"host_hi":{hi},"payload":"{hex}","round":0}}"#
    )
}

/// The JSON Lines output: every object.
pub(crate) fn read_jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The unsigned field `k` of a JSON object, which must be there.
pub(crate) fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"))
}

/// The sequence number in a workload event's payload (hex of a u64 LE).
pub(crate) fn seq_of(payload_hex: &str) -> u64 {
    let b: Vec<u8> = (0..payload_hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&payload_hex[i..i + 2], 16).unwrap())
        .collect();
    u64::from_le_bytes(b.try_into().unwrap())
}

/// `vmtsync export perfetto --from IN --out OUT`, its output captured.
pub(crate) fn export_perfetto(from: &Path, out: &Path) -> std::process::Output {
    vmtsync()
        .args(["export", "perfetto", "--from"])
        .arg(from)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

/// A scratch directory named after `test`, removed on drop.
pub(crate) fn scratch(test: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("vmtsync-record-{test}-"))
        .tempdir()
        .unwrap()
}

pub(crate) fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `vmtsync record …` (guarded) to completion.
pub(crate) fn record(args: &[&str]) -> Output {
    guarded_output(vmtsync().arg("record").args(args), b"")
}

/// The loopback agent on a Unix socket at `sock`, serving one session with `load`; returns the
/// thread (its result: the events its ring dropped).
fn fake_agent(sock: &Path, skew: i64, load: Workload) -> JoinHandle<u64> {
    let listener = UnixListener::bind(sock).unwrap();
    std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        serve_with_events(s, SkewedClock { skew, vcpu: 0 }, load).1
    })
}

/// A skew for the loopback agent that no run sees twice: derived from the host TSC now.
fn fake_skew() -> i64 {
    i64::try_from(read_host_tsc().0 / 3).unwrap() + 987_654_321
}

/// A scratch directory with the loopback agent listening in it.
pub(crate) struct Loopback {
    pub(crate) dir: tempfile::TempDir,
    /// The `--connect` address.
    pub(crate) addr: String,
    /// The agent's skew: an event's true host tick is its guest tick minus this.
    pub(crate) skew: i64,
    /// The agent thread (its result: the events its ring dropped).
    pub(crate) agent: JoinHandle<u64>,
}

/// Starts the loopback agent with `count` events at `rate` per second, in a scratch directory
/// named after `test`.
pub(crate) fn loopback(test: &str, count: u64, rate: u64) -> Loopback {
    loopback_with(
        test,
        Workload {
            count,
            rate,
            ..Workload::default()
        },
    )
}

/// Starts the loopback agent with workload `load`, in a scratch directory named after `test`.
pub(crate) fn loopback_with(test: &str, load: Workload) -> Loopback {
    let dir = scratch(test);
    let sock = dir.path().join("agent.sock");
    let skew = fake_skew();
    let agent = fake_agent(&sock, skew, load);
    let addr = format!("unix:{}", sock.display());
    Loopback {
        dir,
        addr,
        skew,
        agent,
    }
}

impl Loopback {
    /// `vmtsync record --connect ADDR --out OUT --events N --duration 120 --resync MS
    /// --shutdown` and `extra` (the format, the file version) to completion; a failure shows
    /// its stderr. The agent thread ends with the session.
    pub(crate) fn record(&self, out: &Path, events: u64, resync_ms: u32, extra: &[&str]) -> Output {
        let (n, resync) = (events.to_string(), resync_ms.to_string());
        let mut args = vec!["--connect", &self.addr, "--out", out.to_str().unwrap()];
        args.extend(["--events", &n, "--duration", "120", "--resync", &resync]);
        args.push("--shutdown");
        args.extend_from_slice(extra);
        let o = record(&args);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
        o
    }
}
