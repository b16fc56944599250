//! Tier 2: real trace.dat files made here by `trace-cmd extract` (zstd-compressed v7, x86-tsc),
//! read by our reader and rewritten by `vmtsync trace-cmd attach`, checked with trace-cmd 3.1.6.
//!
//! Truth comes from trace-cmd itself: `trace-cmd report` of the input gives every event's CPU,
//! raw timestamp and name; `dump --events` lists the stored formats. An attached copy must show
//! every event moved by exactly what the known mapping says.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use vmtsync::formats::tracedat::{for_each_record, read_event_formats, read_layout};
use vmtsync::kvm::hosttsc::read_host_tsc;

use crate::tracedat::{Line, assert_dump_ok, report};
use crate::util::{HostTrace, attach, have_trace_cmd, host_trace_ready, ok, trace_cmd};

crate::trials!(
    sched_trace_ready;
    the_reader_decompresses_a_real_extract_like_trace_cmd_report,
    attach_moves_every_event_by_a_known_offset_in_v6_v7_and_compressed_and_pairs_the_host,
    a_three_segment_sync_file_steps_or_interpolates_exactly_as_trace_cmd_reads_it;
    have_trace_cmd;
    attach_from_debugfs_refuses_a_coarse_scaling_with_exit_6_and_accepts_it_with_max_error,
);

/// The prerequisites of a real host trace of the scheduler events ([`host_trace_ready`]).
fn sched_trace_ready(test: &str) -> bool {
    host_trace_ready(test, "sched/sched_switch")
}

/// Makes a real trace here: a private tracefs instance on `x86-tsc` with the scheduler events
/// on while this process sleeps and writes markers, then `trace-cmd extract` (v7, zstd). Its
/// tests' gate is [`sched_trace_ready`].
fn real_trace(dir: &Path, file: &str) -> PathBuf {
    let out = dir.join(file);
    traced_instance(file).extract(&out);
    out
}

/// A private tracefs instance on `x86-tsc` that recorded the scheduler events while this
/// process slept and wrote markers, tracing now off.
fn traced_instance(tag: &str) -> HostTrace {
    // Tests run in parallel: each instance gets its own name.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let purpose = format!(
        "attach{}{}",
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        tag.replace('.', "_")
    );
    let mut trace = HostTrace::start(&purpose, "sched/sched_switch");
    for ev in ["sched/sched_switch", "sched/sched_wakeup"] {
        trace.instance().enable(ev).expect(ev);
    }
    for k in 0..40 {
        std::thread::sleep(std::time::Duration::from_millis(2));
        std::fs::write(
            trace.path().join("trace_marker"),
            format!("vmtsync-attach {k}"),
        )
        .unwrap();
    }
    trace.stop();
    trace
}

/// A real guest-style trace: the events in the file's **top** buffer, as `trace-cmd record`
/// in a guest writes them (trace-cmd 3.1.6 applies TIME_SHIFT to the top buffer only, and
/// `extract -B` files hold an instance buffer). Made by reading a private instance's
/// `per_cpu/cpuN/trace_pipe_raw` and `trace-cmd restore` (header file, then the CPU files):
/// v7 uncompressed; then `trace-cmd convert` to v7 zstd and to v6. Returns `[v7, v7 zstd, v6]`.
fn real_guest_traces(dir: &Path) -> [PathBuf; 3] {
    let mut trace = traced_instance("guest");
    let inst = trace.instance();
    let mut cpu_files = Vec::new();
    let mut cpus: Vec<u32> = std::fs::read_dir(inst.path().join("per_cpu"))
        .unwrap()
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_prefix("cpu")?
                .parse()
                .ok()
        })
        .collect();
    cpus.sort_unstable();
    for c in cpus {
        let mut f = inst
            .open_nonblocking(&format!("per_cpu/cpu{c}/trace_pipe_raw"))
            .unwrap();
        let mut data = Vec::new();
        let mut page = vec![0; 4096];
        loop {
            match f.read(&mut page) {
                Ok(0) => break,
                Ok(n) => data.extend_from_slice(&page[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("trace_pipe_raw cpu{c}: {e}"),
            }
        }
        let p = dir.join(format!("raw.cpu{c}"));
        std::fs::write(&p, &data).unwrap();
        cpu_files.push(p);
    }
    drop(trace);
    let head = dir.join("head.dat");
    let v7 = dir.join("guest7.dat");
    let run = |args: &[&str]| {
        let o = Command::new("trace-cmd")
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "trace-cmd {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    run(&["restore", "-c", "-o", head.to_str().unwrap()]);
    let mut args = vec![
        "restore",
        "-i",
        head.to_str().unwrap(),
        "-o",
        v7.to_str().unwrap(),
    ];
    args.extend(cpu_files.iter().map(|p| p.to_str().unwrap()));
    run(&args);
    let z = dir.join("guest7z.dat");
    let v6 = dir.join("guest6.dat");
    let (v7s, zs, v6s) = (
        v7.to_str().unwrap(),
        z.to_str().unwrap(),
        v6.to_str().unwrap(),
    );
    run(&["convert", "--compression", "zstd", "-i", v7s, "-o", zs]);
    run(&["convert", "--file-version", "6", "-i", v7s, "-o", v6s]);
    [v7, z, v6]
}

/// `(cpu, raw ts, event name)` of every event `trace-cmd report` shows.
fn reported_events(path: &Path) -> Vec<(u32, u64, String)> {
    let mut v: Vec<_> = report(&["report", "-t", "--raw-ts", "-i", path.to_str().unwrap()])
        .into_iter()
        .map(|l| {
            let name = l.rest.split(':').next().unwrap_or("").trim().to_string();
            (l.cpu, l.ts, name)
        })
        .collect();
    v.sort();
    v
}

fn the_reader_decompresses_a_real_extract_like_trace_cmd_report() {
    let dir = tempfile::tempdir().unwrap();
    let path = real_trace(dir.path(), "host.dat");
    let dir6 = dir.path().join("host6.dat");
    let o = trace_cmd(&[
        "convert",
        "--file-version",
        "6",
        "-i",
        path.to_str().unwrap(),
        "-o",
        dir6.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = reported_events(&path);
    assert!(want.len() > 40, "too few events to compare: {}", want.len());
    for file in [&path, &dir6] {
        let layout = read_layout(file).unwrap();
        if file == &path {
            assert_eq!(layout.compression.as_deref(), Some("zstd"));
            assert!(layout.buffers.iter().any(|b| b.compressed));
        }
        let formats = read_event_formats(file, &layout).unwrap();
        let names: std::collections::BTreeMap<u16, String> = formats
            .iter()
            .filter_map(|f| Some((f.id?, f.name.clone())))
            .collect();
        // Every stored format, as `trace-cmd dump --events` lists them (name and ID lines).
        let dump = trace_cmd(&["dump", "--events", "-i", file.to_str().unwrap()]);
        let text = String::from_utf8_lossy(&dump.stdout);
        let dumped: BTreeSet<(String, u16)> = text
            .split("\nname: ")
            .skip(1)
            .filter_map(|b| {
                let name = b.lines().next()?.trim().to_string();
                let id = b
                    .lines()
                    .nth(1)?
                    .strip_prefix("ID: ")?
                    .trim()
                    .parse()
                    .ok()?;
                Some((name, id))
            })
            .collect();
        let ours: BTreeSet<(String, u16)> = formats
            .iter()
            .filter(|f| f.system != "ftrace")
            .filter_map(|f| Some((f.name.clone(), f.id?)))
            .collect();
        assert!(
            dumped.len() > 100,
            "dump --events: {} formats",
            dumped.len()
        );
        assert_eq!(ours, dumped, "{}", file.display());
        assert!(
            formats
                .iter()
                .any(|f| f.system == "sched" && f.name == "sched_switch")
        );
        let mut got = Vec::new();
        for b in 0..layout.buffers.len() {
            for_each_record(file, &layout, b, |cpu, ts, data| {
                let ty = u16::from_le_bytes([data[0], data[1]]);
                got.push((cpu, ts, names.get(&ty).cloned().unwrap_or_default()));
            })
            .unwrap();
        }
        got.sort();
        assert_eq!(got, want, "{}", file.display());
    }
}

/// The report lines of a file in trace-cmd's order, with the raw (uncorrected) timestamps of
/// the input alongside: `trace-cmd report -t` of the copy against `report -t` of the input
/// (which has no TIME_SHIFT: its timestamps are the raw guest TSC).
fn raw_and_shifted(input: &Path, output: &Path) -> (Vec<Line>, Vec<Line>) {
    let raw = report(&["report", "-t", "-i", input.to_str().unwrap()]);
    let shifted = report(&["report", "-t", "-i", output.to_str().unwrap()]);
    assert!(raw.len() > 40, "too few events: {}", raw.len());
    assert_eq!(raw.len(), shifted.len());
    (raw, shifted)
}

/// Pairs each shifted line with its raw line: same CPU and text, and per CPU the same order
/// (TIME_SHIFT is monotonic per CPU, so each CPU's events keep their order).
fn paired(raw: &[Line], shifted: &[Line]) -> Vec<(u32, u64, u64)> {
    let mut by_cpu = std::collections::BTreeMap::<u32, (Vec<&Line>, Vec<&Line>)>::new();
    for l in raw {
        by_cpu.entry(l.cpu).or_default().0.push(l);
    }
    for l in shifted {
        by_cpu.entry(l.cpu).or_default().1.push(l);
    }
    let mut v = Vec::new();
    for (cpu, (r, s)) in by_cpu {
        assert_eq!(r.len(), s.len(), "CPU {cpu}");
        for (a, b) in r.iter().zip(&s) {
            assert_eq!(a.rest, b.rest, "CPU {cpu}: same event");
            v.push((cpu, a.ts, b.ts));
        }
    }
    v
}

fn attach_moves_every_event_by_a_known_offset_in_v6_v7_and_compressed_and_pairs_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let guests = real_guest_traces(dir.path());
    let host = real_trace(dir.path(), "host.dat");
    // Our sign: offset = guest - host. Derived from the host TSC now, never a constant: the
    // guest's clock reads half the host's TSC behind, plus an odd amount.
    let h = read_host_tsc().0;
    let off = -i64::try_from(h / 2).unwrap() - 12_345;
    let host_before = std::fs::read(&host).unwrap();
    for (i, guest) in guests.iter().enumerate() {
        let before = std::fs::read(guest).unwrap();
        let out = dir.path().join(format!("attached{i}.dat"));
        let host_out = dir.path().join(format!("host-out{i}.dat"));
        let text = ok(&attach(&[
            "--guest",
            guest.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--offset",
            &off.to_string(),
            "--host",
            host.to_str().unwrap(),
            "--host-output",
            host_out.to_str().unwrap(),
            "--vcpu-pid",
            "0=4242",
            "--vcpu-pid",
            "1=4243",
            "--guest-name",
            "linux-guest",
        ]));
        eprintln!("{text}");
        assert_eq!(&std::fs::read(guest).unwrap(), &before, "input modified");
        assert_eq!(
            std::fs::read(&host).unwrap(),
            host_before,
            "host input modified"
        );
        assert_dump_ok(&out);
        assert_dump_ok(&host_out);
        let opts = trace_cmd(&["dump", "--options", "-i", out.to_str().unwrap()]);
        let dump = String::from_utf8_lossy(&opts.stdout);
        // trace-cmd's sign is the opposite of ours.
        assert!(dump.contains("[Option TimeShift"), "{dump}");
        assert!(
            dump.contains(&format!("\t{} 1 0 ", -off)),
            "TIME_SHIFT sample with offset {}: {dump}",
            -off
        );
        let hd = trace_cmd(&["dump", "--options", "-i", host_out.to_str().unwrap()]);
        assert!(String::from_utf8_lossy(&hd.stdout).contains("linux-guest"));
        let (raw, shifted) = raw_and_shifted(guest, &out);
        for (cpu, g, h) in paired(&raw, &shifted) {
            assert_eq!(
                h,
                g.checked_add_signed(-off).unwrap(),
                "{} CPU {cpu}: guest {g}",
                guest.display()
            );
        }
        // The pair reads as one trace: every event of both files, merged.
        let merged = report(&[
            "report",
            "-t",
            "-i",
            host_out.to_str().unwrap(),
            "-i",
            out.to_str().unwrap(),
        ]);
        let host_n = report(&["report", "-t", "-i", host.to_str().unwrap()]).len();
        assert_eq!(merged.len(), host_n + raw.len());
    }
}

/// A sync file (schema 1) with three constant-offset segments of vCPU 0, written as text.
fn sync_file(path: &Path, segs: &[(u64, i64)]) {
    let mut t = String::from(
        "{\"type\":\"header\",\"schema\":1,\"tool\":\"test\",\"host_clock\":\"x86-tsc\",\"created_unix_s\":1796000000,\"source\":\"test\"}\n",
    );
    for (round, &(g, o)) in segs.iter().enumerate() {
        let h = g.checked_add_signed(-o).unwrap();
        t.push_str(&format!(
            "{{\"type\":\"segment\",\"vcpu\":0,\"round\":{round},\"guest_start\":{g},\"host_anchor\":{h},\"guest_anchor\":{g},\"offset\":{o},\"offset_lo\":{},\"offset_hi\":{},\"drift_ppb\":0,\"drift_ppb_lo\":0,\"drift_ppb_hi\":0,\"model\":\"drift\",\"probes\":64,\"rtt_min_ticks\":1000,\"host_first\":{h},\"host_last\":{h},\"break\":{}}}\n",
            o - 10,
            o + 10,
            round > 0
        ));
    }
    std::fs::write(path, t).unwrap();
}

fn a_three_segment_sync_file_steps_or_interpolates_exactly_as_trace_cmd_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let guests = real_guest_traces(dir.path());
    let raw = report(&["report", "-t", "-i", guests[0].to_str().unwrap()]);
    let (lo, hi) = (
        raw.iter().map(|l| l.ts).min().unwrap(),
        raw.iter().map(|l| l.ts).max().unwrap(),
    );
    // Segments starting at the first event, a third and two thirds into the trace; offsets
    // (guest - host) from the host TSC, changing in both directions.
    let base = -i64::try_from(lo / 3).unwrap();
    let third = (hi - lo) / 3;
    let segs = [
        (lo, base),
        (lo + third, base - 37_000),
        (lo + 2 * third, base + 52_000),
    ];
    let sync = dir.path().join("sync.jsonl");
    sync_file(&sync, &segs);
    for interpolate in [false, true] {
        for (i, guest) in guests.iter().enumerate() {
            let before = std::fs::read(guest).unwrap();
            let out = dir.path().join(format!("s{interpolate}{i}.dat"));
            let mut args = vec![
                "--guest",
                guest.to_str().unwrap(),
                "--output",
                out.to_str().unwrap(),
                "--sync",
                sync.to_str().unwrap(),
                "--vcpu",
                "0",
            ];
            if interpolate {
                args.push("--interpolate");
            }
            eprintln!("{}", ok(&attach(&args)));
            assert_eq!(&std::fs::read(guest).unwrap(), &before, "input modified");
            assert_dump_ok(&out);
            let dump = trace_cmd(&["dump", "--options", "-i", out.to_str().unwrap()]);
            let dump = String::from_utf8_lossy(&dump.stdout);
            assert!(
                dump.contains(&format!(
                    "0x{} [peer's protocol flags]",
                    u8::from(interpolate)
                )),
                "{dump}"
            );
            for &(g, o) in &segs {
                assert!(dump.contains(&format!("\t{} 1 0 {g}[", -o)), "{dump}");
            }
            let (raw, shifted) = raw_and_shifted(guest, &out);
            for (cpu, g, h) in paired(&raw, &shifted) {
                let want = if interpolate {
                    interpolated(&segs, hi, g)
                } else {
                    // The segment holding g (the first one before its start).
                    let j = segs.iter().rposition(|s| s.0 <= g).unwrap_or(0);
                    g.checked_add_signed(-segs[j].1).unwrap()
                };
                assert_eq!(
                    h,
                    want,
                    "interpolate={interpolate} {} CPU {cpu}: guest {g}",
                    guest.display()
                );
            }
        }
    }
}

/// trace-cmd's interpolation (trace-input.c, C integer arithmetic: the product in 64 bits,
/// division truncating toward zero, half the interval added first) between the points
/// `(guest start, -offset)` of each segment plus the last one's at the trace's last tick `hi`,
/// extrapolated past both ends; written independently of vmtsync's model.
fn interpolated(segs: &[(u64, i64)], hi: u64, g: u64) -> u64 {
    let mut pts: Vec<(i128, i128)> = segs
        .iter()
        .map(|&(t, o)| (i128::from(t), -i128::from(o)))
        .collect();
    pts.push((i128::from(hi), pts[pts.len() - 1].1));
    let gi = i128::from(g);
    let j = if gi <= pts[0].0 {
        0
    } else if gi >= pts[pts.len() - 1].0 {
        pts.len() - 2
    } else {
        pts.iter().rposition(|p| p.0 <= gi).unwrap()
    };
    let (a, b) = (pts[j], pts[j + 1]);
    let delta = b.0 - a.0;
    let x = (gi - a.0) * (b.1 - a.1);
    let off = a.1 + (x + delta / 2) / delta;
    u64::try_from(gi + off).unwrap()
}

fn attach_from_debugfs_refuses_a_coarse_scaling_with_exit_6_and_accepts_it_with_max_error() {
    use vmtsync::formats::tracedat::{TraceDatWriter, WriterOptions};
    let dir = tempfile::tempdir().unwrap();
    // A 2-CPU guest trace (our writer stands in for a Linux guest's here: the subject is the
    // mapping from debugfs), raw guest TSCs from 10^12 on.
    let guest = dir.path().join("g.dat");
    let mut w = TraceDatWriter::create(&guest, WriterOptions::new(2, 0x77)).unwrap();
    let mut events = Vec::new();
    for i in 0..4000u64 {
        let (cpu, ts) = (u32::from(i % 2 == 1), 1_000_000_000_000 + i * 250_001);
        w.push(cpu, ts, u32::try_from(i).unwrap(), &[]).unwrap();
        events.push((cpu, ts));
    }
    w.finish(None).unwrap();
    // The fixture VM 1001-11: two vCPUs at 1.25x the host rate (Intel, 48 fraction bits),
    // threads 1010 and 1011.
    let tree = crate::util::fixtures().join("intel");
    let kvm = tree.join("kvm");
    let proc_root = tree.join("proc");
    let out = dir.path().join("o.dat");
    let host_out = dir.path().join("h.dat");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--guest",
            guest.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--vm",
            "1001",
            "--debugfs-root",
            kvm.to_str().unwrap(),
            "--proc-root",
            proc_root.to_str().unwrap(),
            "--host",
            guest.to_str().unwrap(),
            "--host-output",
            host_out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        attach(&args)
    };
    let o = run(&[]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(6), "{err}");
    assert!(err.contains("--max-error"), "{err}");
    assert!(!out.exists() && !host_out.exists());
    let bound: u64 = err
        .split("off by up to ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no figure in {err}"));
    assert!(bound > 1, "{err}");
    // Accepting that figure writes the copy; every event is within it of the exact inverse
    // host = ceil(((guest - offset) << 48) / ratio) of its vCPU (the first host tick at which
    // KVM's guest TSC reaches the value: the project's rounding of guest -> host).
    let text = ok(&run(&["--max-error", &bound.to_string()]));
    eprintln!("{text}");
    let hd = trace_cmd(&["dump", "--options", "-i", host_out.to_str().unwrap()]);
    let hd = String::from_utf8_lossy(&hd.stdout);
    assert!(hd.contains("1010") && hd.contains("1011"), "{hd}");
    let offsets = [-123_456_789i128, -123_456_000];
    let ratio = 351_843_720_888_320i128;
    let shifted = report(&["report", "-t", "-i", out.to_str().unwrap()]);
    assert_eq!(shifted.len(), events.len());
    let mut per_cpu: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
    for (cpu, ts) in &events {
        per_cpu[*cpu as usize].push(*ts);
    }
    let mut seen = [0usize; 2];
    for l in &shifted {
        let c = l.cpu as usize;
        let g = i128::from(per_cpu[c][seen[c]]);
        seen[c] += 1;
        let num = (g - offsets[c]) << 48;
        let exact = num / ratio + i128::from(num % ratio != 0);
        assert!(
            (i128::from(l.ts) - exact).unsigned_abs() <= u128::from(bound),
            "CPU {c} guest {g}: trace-cmd {} vs exact {exact} (bound {bound})",
            l.ts
        );
    }
}
