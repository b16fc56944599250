//! `vmtsync probe` end to end on loopback sockets (tier 1: no KVM needed).
//!
//! The agent is `vmtsync_core::agent`'s real state machine (`vmtsync_tests::fake_agent`) whose
//! "guest TSC" is the host's own `lfence; rdtsc` plus a known skew, so the true offset is the
//! skew and the rate is exactly 1: every guaranteed bound must contain them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

use vmtsync::link::ConnectError;
use vmtsync::link::addr::vsock_sockaddr;
use vmtsync::link::transport::host_tsc_now;
use vmtsync::link::{ProbeAddr, StreamTransport};
use vmtsync::probe::{
    ContinuousOptions, ProbeError, ProbeOptions, ProbeSummary, run_probe, run_probe_on,
};
use vmtsync::sync::convert_with_sync;
use vmtsync::syncfile::OffsetModel;
use vmtsync::syncfile::{SyncFile, SyncFileError};
use vmtsync_tests::fake_agent::{self as fake, SkewedClock};

const SKEW: i64 = 5_000_000;

fn clock() -> SkewedClock {
    SkewedClock {
        skew: SKEW,
        vcpu: 0,
    }
}

/// `name` in a fresh temp dir; the dir (with whatever the test left in it) is removed when
/// the returned guard drops, also when the test fails.
fn tmp(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("vmtsync-it-probe-")
        .tempdir()
        .unwrap();
    let p = dir.path().join(name);
    (dir, p)
}

fn quiet(addr: ProbeAddr) -> ProbeOptions {
    let mut o = ProbeOptions::new(addr);
    o.progress = false;
    o
}

/// Checks the bounds against the truth and prints what was measured.
fn check_truth(label: &str, s: &ProbeSummary) {
    println!(
        "{label}: offset {} (error {:+}), bounds [{}, {}] width {}, rtt min {} median {} max {} ticks, \
         trace-cmd fastest {} (error {:+}), drift {:?}, {} probes, {:?}",
        s.offset,
        s.offset - SKEW,
        s.bound_lo,
        s.bound_hi,
        s.width(),
        s.rtt.min,
        s.rtt.median,
        s.rtt.max,
        s.tracecmd_fastest,
        s.tracecmd_fastest - SKEW,
        s.drift,
        s.probes,
        s.stats
    );
    assert!(
        s.bound_lo <= SKEW && SKEW <= s.bound_hi,
        "{label}: truth {SKEW} outside [{}, {}]",
        s.bound_lo,
        s.bound_hi
    );
    assert_eq!(s.model, OffsetModel::Drift, "{label}");
    // The rate is exactly 1 here, so the constant-offset figure holds too: inside the
    // guaranteed bounds (which allow any constant rate), at most the fastest round trip wide
    // (the best probe's bracket).
    let (lo, hi) = s
        .rate1
        .unwrap_or_else(|| panic!("{label}: identity rate must fit: {s:?}"));
    assert!(lo <= SKEW && SKEW <= hi, "{label}: {s:?}");
    assert!(s.bound_lo <= lo && hi <= s.bound_hi, "{label}: {s:?}");
    assert!(hi.abs_diff(lo) <= s.rtt.min, "{label}: {s:?}");
    // trace-cmd's midpoint of the fastest probe lies in that probe's bracket, so it is at
    // most one RTT from the truth, but it carries no bound of its own.
    assert!(
        (s.tracecmd_fastest - SKEW).unsigned_abs() <= s.rtt.min,
        "{label}: {s:?}"
    );
    if let Some(d) = s.drift {
        assert!(
            d.lo <= 0 && 0 <= d.hi,
            "{label}: drift {d:?} excludes the true 0"
        );
    }
}

#[test]
fn probe_over_loopback_tcp_bounds_the_true_offset() {
    let (port, agent) = fake::spawn_tcp(clock()).unwrap();
    let opts = quiet(ProbeAddr::parse(&format!("tcp:127.0.0.1:{port}")).unwrap());
    let mut out = Vec::new();
    let s = run_probe(&opts, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    print!("{text}");
    assert!(text.contains("guaranteed in"), "{text}");
    assert_eq!(s.probes, 64);
    check_truth("tcp", &s);
    let stats = agent.join().unwrap();
    assert_eq!(stats.probes, 64);
    assert_eq!(stats.bad_frames, 0);
}

#[test]
fn probe_over_a_unix_socket_pair_prints_schema_2_json() {
    let (host, agent) = fake::spawn_unix_pair(clock()).unwrap();
    let mut opts = quiet(ProbeAddr::Unix("socketpair".into()));
    opts.json = true;
    opts.probes = 200;
    let transport = StreamTransport::new(host, opts.timeout).unwrap();
    let mut out = Vec::new();
    let s = run_probe_on(transport, &opts, &mut out).unwrap();
    check_truth("unix pair", &s);
    let j: serde_json::Value = serde_json::from_slice(&out).unwrap();
    println!("{j}");
    assert_eq!(j["schema"], 2);
    assert_eq!(j["vcpu"], 0);
    assert_eq!(j["probes"], 200);
    assert_eq!(j["offset_ticks"], s.offset);
    assert_eq!(j["bound_lo"], s.bound_lo);
    assert_eq!(j["bound_hi"], s.bound_hi);
    assert_eq!(j["rtt_min_ticks"], s.rtt.min);
    assert_eq!(j["tracecmd_fastest_rtt_offset"], s.tracecmd_fastest);
    assert!(j["drift_ppb"].is_i64() || j["drift_ppb"].is_null());
    assert_eq!(agent.join().unwrap().probes, 200);
}

#[test]
fn a_silent_peer_is_a_timeout_error_not_a_hang() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // Accepts, reads what it gets, never answers, and holds the connection open until the
    // host gives up (read returns 0 when the host closes).
    let peer = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
        sink.len()
    });
    let mut opts = quiet(ProbeAddr::parse(&format!("tcp:127.0.0.1:{port}")).unwrap());
    opts.timeout = Duration::from_millis(200);
    let start = Instant::now();
    let err = run_probe(&opts, &mut Vec::new()).unwrap_err();
    let waited = start.elapsed();
    println!("silent peer: {err} (after {waited:?})");
    assert!(
        matches!(err, ProbeError::Timeout { bad_frames: 0, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("is the agent running"), "{err}");
    // It waited for the timeout, and did return: a loose bound that only catches hangs.
    assert!(waited >= opts.timeout, "{waited:?}");
    assert!(waited < Duration::from_secs(30), "{waited:?}");
    // The peer saw the flush delimiter and the hello frame.
    assert!(peer.join().unwrap() > 1);
}

#[test]
fn a_peer_speaking_garbage_fails_cleanly_with_the_frames_counted() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let peer = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        // Noise, a frame too long for any message, and non-protocol text, five times over.
        let mut junk = vec![0xffu8; 3000];
        junk.push(0);
        junk.extend_from_slice(b"login: \0\x02\x07\x00SeaBIOS\n\0");
        let _ = s.write_all(&junk.repeat(5));
        // Then silence, until the host gives up and closes.
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    });
    let mut opts = quiet(ProbeAddr::parse(&format!("tcp:localhost:{port}")).unwrap());
    opts.timeout = Duration::from_secs(1);
    let err = run_probe(&opts, &mut Vec::new()).unwrap_err();
    println!("garbage peer: {err}");
    match err {
        ProbeError::Timeout { bad_frames, .. } => assert!(bad_frames >= 10, "{bad_frames}"),
        other => panic!("expected a timeout, got {other}"),
    }
    peer.join().unwrap();
}

#[test]
fn boot_noise_before_the_agent_is_skipped() {
    let (host, guest) = std::os::unix::net::UnixStream::pair().unwrap();
    let agent = thread::spawn(move || {
        let mut g = guest;
        // What a serial console carries before the agent starts.
        g.write_all(b"\x1b[2J booting...\n\0\xff\xfe\x00").unwrap();
        g.write_all(&[0x42; 2000]).unwrap();
        g.write_all(&[0]).unwrap();
        fake::serve(g, clock())
    });
    let opts = quiet(ProbeAddr::Unix("socketpair".into()));
    let t = StreamTransport::new(host, opts.timeout).unwrap();
    let s = run_probe_on(t, &opts, &mut Vec::new()).unwrap();
    assert!(s.stats.bad_frames >= 2, "{:?}", s.stats);
    check_truth("boot noise", &s);
    agent.join().unwrap();
}

#[test]
fn continuous_mode_writes_a_sync_file_that_convert_reads_back() {
    let (_tmp_dir, path) = tmp("continuous.jsonl");
    let (host, agent) = fake::spawn_unix_pair(clock()).unwrap();
    let mut opts = quiet(ProbeAddr::Unix("socketpair".into()));
    opts.probes = 16;
    opts.continuous = Some(ContinuousOptions {
        out: path.clone(),
        resync: Duration::from_millis(20),
        rounds: Some(4),
    });
    let t = StreamTransport::new(host, opts.timeout).unwrap();
    let mut out = Vec::new();
    let last = run_probe_on(t, &opts, &mut out).unwrap();
    print!("{}", String::from_utf8_lossy(&out));
    check_truth("continuous last round", &last);
    assert_eq!(agent.join().unwrap().probes, 64);

    let text = std::fs::read_to_string(&path).unwrap();
    for line in text.lines().take(2) {
        println!("sync file: {line}");
    }
    let sync = SyncFile::read(&path).unwrap();
    assert_eq!(sync.header.schema, 1);
    assert_eq!(sync.segments.len(), 4);
    assert_eq!(sync.vcpus(), [0]);
    for (i, seg) in sync.segments.iter().enumerate() {
        assert_eq!(seg.round, u64::try_from(i).unwrap());
        assert!(seg.offset_lo <= SKEW && SKEW <= seg.offset_hi, "{seg:?}");
        assert!(!seg.is_break, "{seg:?}");
        if let (Some(lo), Some(hi)) = (seg.drift_ppb_lo, seg.drift_ppb_hi) {
            assert!(lo <= 0 && 0 <= hi, "{seg:?}");
        }
    }
    let (first, last_seg) = (sync.segments[0], sync.segments[3]);
    println!("sync segments: first {first:?}\nlast {last_seg:?}");
    // Later rounds carry the whole run's rate bound: tighter than the first round's.
    if let (Some(lo0), Some(hi0), Some(lo3), Some(hi3)) = (
        first.drift_ppb_lo,
        first.drift_ppb_hi,
        last_seg.drift_ppb_lo,
        last_seg.drift_ppb_hi,
    ) {
        assert!(hi3 - lo3 <= hi0 - lo0, "{first:?} {last_seg:?}");
    }

    // `vmtsync convert --sync FILE --vcpu 0`: guest TSC values of "now" map back to the
    // host TSC they were taken at, within the segment's guaranteed offset width.
    let hosts: Vec<u64> = (0..5).map(|_| host_tsc_now().0).collect();
    let input: String = hosts
        .iter()
        .map(|h| format!("{}\n", h.checked_add_signed(SKEW).unwrap()))
        .collect();
    let mut converted = Vec::new();
    let stats = convert_with_sync(&sync, 0, &mut input.as_bytes(), &mut converted, false).unwrap();
    assert_eq!(stats.converted, 5);
    let width = last_seg.offset_hi.abs_diff(last_seg.offset_lo);
    for (line, h) in BufReader::new(&converted[..]).lines().zip(&hosts) {
        let got: u64 = line.unwrap().parse().unwrap();
        println!(
            "convert: true host {h}, converted {got}, error {:+}",
            i128::from(got) - i128::from(*h)
        );
        assert!(got.abs_diff(*h) <= width, "{got} vs {h}, width {width}");
    }
    std::fs::remove_file(path).unwrap();
}

/// A fake vhost-device-vsock host socket: drops the first connection after reading the
/// `CONNECT` line (the guest's queues are "not up"), then answers `OK` and serves the agent.
#[test]
fn vsock_uds_handshake_retries_then_probes() {
    let (_tmp_dir, path) = tmp("vhost.vsock");
    let listener = UnixListener::bind(&path).unwrap();
    let server = thread::spawn(move || {
        let mut lines = Vec::new();
        for attempt in 0..2 {
            let (s, _) = listener.accept().unwrap();
            let mut r = BufReader::new(s);
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            lines.push(line);
            if attempt == 0 {
                continue; // Dropped without an answer.
            }
            let mut s = r.into_inner();
            s.write_all(b"OK 1073741824\n").unwrap();
            return (lines, fake::serve(s, clock()));
        }
        unreachable!()
    });
    let opts = quiet(ProbeAddr::parse(&format!("vsock-uds:{}:5000", path.display())).unwrap());
    let s = run_probe(&opts, &mut Vec::new()).unwrap();
    check_truth("vsock-uds", &s);
    let (lines, stats) = server.join().unwrap();
    assert_eq!(lines, ["CONNECT 5000\n", "CONNECT 5000\n"]);
    assert_eq!(stats.probes, 64);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn vsock_uds_refusal_is_reported() {
    let (_tmp_dir, path) = tmp("refuse.vsock");
    let listener = UnixListener::bind(&path).unwrap();
    let server = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut b = [0u8; 32];
        let _ = s.read(&mut b).unwrap();
        s.write_all(b"ERROR no such port\n").unwrap();
    });
    let opts = quiet(ProbeAddr::parse(&format!("vsock-uds:{}:5001", path.display())).unwrap());
    let err = run_probe(&opts, &mut Vec::new()).unwrap_err();
    assert!(
        matches!(&err, ProbeError::Connect(ConnectError::Handshake { reply, .. }) if reply == "ERROR no such port"),
        "{err}"
    );
    server.join().unwrap();
    std::fs::remove_file(path).unwrap();
}

#[test]
fn vsock_addresses_parse_and_build_without_opening_a_socket() {
    // AF_VSOCK must never be opened here (docs/host-quirks.md): only the address is checked.
    let ProbeAddr::Vsock { cid, port } = ProbeAddr::parse("vsock:3:5000").unwrap() else {
        panic!("not a vsock address");
    };
    // The family and layout are checked in `addr`'s unit test.
    let sa = vsock_sockaddr(cid, port);
    assert_eq!((sa.cid(), sa.port()), (3, 5000));
}

#[test]
fn continuous_mode_without_a_round_limit_stops_on_the_flag() {
    static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let (_tmp_dir, path) = tmp("stop.jsonl");
    let (host, agent) = fake::spawn_unix_pair(clock()).unwrap();
    let mut opts = quiet(ProbeAddr::Unix("socketpair".into()));
    opts.probes = 8;
    opts.stop = Some(&STOP);
    opts.continuous = Some(ContinuousOptions {
        out: path.clone(),
        resync: Duration::from_millis(10),
        rounds: None,
    });
    // A reader polls the file while it is being written: every read parses (complete lines,
    // at most a partial tail that is ignored), and segments only ever get added.
    let reader_path = path.clone();
    let stopper = thread::spawn(move || {
        let start = Instant::now();
        let (mut reads, mut seen) = (0_u32, 0_usize);
        // Stop once three segments are on disk (the deadline only guards against a hang).
        while seen < 3 && start.elapsed() < Duration::from_secs(60) {
            match SyncFile::read(&reader_path) {
                Ok(f) => {
                    assert!(f.segments.len() >= seen, "segments disappeared");
                    seen = f.segments.len();
                    reads += 1;
                }
                // Before the writer created the file (it appears with its header, by rename).
                Err(SyncFileError::Io { source, .. })
                    if seen == 0 && source.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => panic!("reading while written: {e}"),
            }
            thread::sleep(Duration::from_millis(2));
        }
        STOP.store(true, std::sync::atomic::Ordering::Relaxed);
        (reads, seen)
    });
    let t = StreamTransport::new(host, opts.timeout).unwrap();
    let mut out = Vec::new();
    let last = run_probe_on(t, &opts, &mut out).unwrap();
    let (reads, seen) = stopper.join().unwrap();
    println!("concurrent reader: {reads} reads, up to {seen} segments seen while writing");
    assert!(reads > 0);
    check_truth("stopped continuous", &last);
    let rounds = String::from_utf8(out).unwrap().lines().count();
    let sync = SyncFile::read(&path).unwrap();
    println!("stopped after {rounds} rounds");
    assert!(rounds >= 3);
    assert_eq!(sync.segments.len(), rounds);
    assert_eq!(
        agent.join().unwrap().probes,
        u32::try_from(rounds * 8).unwrap()
    );
    std::fs::remove_file(path).unwrap();
}

/// vhost-device-vsock sometimes accepts a host connection and never answers the `CONNECT`
/// line (docs/vsock.md): the attempt times out and a new connection succeeds.
#[test]
fn vsock_uds_handshake_survives_a_hung_attempt() {
    let (_tmp_dir, path) = tmp("hung.vsock");
    let listener = UnixListener::bind(&path).unwrap();
    let server = thread::spawn(move || {
        // Attempt 0: read the line, then hold the connection open without answering.
        let (hung, _) = listener.accept().unwrap();
        let mut r = BufReader::new(hung);
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        // Attempt 1: answer.
        let (s, _) = listener.accept().unwrap();
        let mut r2 = BufReader::new(s);
        let mut line2 = String::new();
        r2.read_line(&mut line2).unwrap();
        let mut s = r2.into_inner();
        s.write_all(b"OK 5\n").unwrap();
        let stats = fake::serve(s, clock());
        drop(r);
        (line, line2, stats)
    });
    let mut opts = quiet(ProbeAddr::parse(&format!("vsock-uds:{}:77", path.display())).unwrap());
    opts.probes = 8;
    let s = run_probe(&opts, &mut Vec::new()).unwrap();
    check_truth("vsock-uds after a hung attempt", &s);
    let (l1, l2, stats) = server.join().unwrap();
    assert_eq!((l1.as_str(), l2.as_str()), ("CONNECT 77\n", "CONNECT 77\n"));
    assert_eq!(stats.probes, 8);
    std::fs::remove_file(path).unwrap();
}
