//! Tier 2: trace.dat files from `vmtsync::formats::tracedat` read by the real trace-cmd (3.1.6 here).
//!
//! Truth comes from outside the writer: the raw timestamps we pushed, host times computed with
//! the exact inverse of the segments we chose, and for the host merge the host TSC read right
//! before and after each `trace_marker` write, whose ftrace timestamp (x86-tsc) lies in between.

use std::io::Write;
use std::path::Path;

use vmtsync::formats::tracedat::timeshift::{exact_host_time, plan_cpu, trace_cmd_host_time};
use vmtsync::formats::tracedat::{
    FileVersion, GuestInfo, ShiftMode, Summary, SyncSegment, TimeShift, TraceDatError,
    TraceDatWriter, WriterOptions, copy_host_trace, read_layout, verify_file,
};
use vmtsync::kvm::hosttsc::read_host_tsc;
use vmtsync_core::HostTicks;

use crate::util::{HostTrace, have_trace_cmd, host_trace_ready, trace_cmd};

crate::trials!(
    have_trace_cmd;
    both_versions_report_raw_guest_tscs_and_exact_host_times,
    a_million_events_cross_pages_and_time_extends,
    a_truncated_file_is_caught_by_our_reader,
    trace_cmd_converts_our_files_and_reads_our_copy_of_a_compressed_trace,
    tsc2nsec_makes_trace_cmd_show_nanoseconds_after_the_shift,
    a_scaled_segment_over_a_short_span_is_within_its_bound_in_trace_cmd;
    tsc_offset_trace_ready;
    a_host_trace_copy_merges_with_the_guest_in_host_time_order,
);

/// The host-trace test's prerequisites: a host trace of `kvm:kvm_write_tsc_offset`.
fn tsc_offset_trace_ready(test: &str) -> bool {
    host_trace_ready(test, vmtsync::ftrace::tsc_offset::EVENT)
}

/// `trace-cmd dump -v` exits non-zero on a file it cannot parse (report does not).
pub(crate) fn assert_dump_ok(path: &Path) {
    let o = trace_cmd(&["dump", "-v", "-i", path.to_str().unwrap()]);
    assert!(
        o.status.success()
            && String::from_utf8_lossy(&o.stdout).contains("is a valid trace-cmd file"),
        "trace-cmd dump -v {}: {}{}",
        path.display(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// One `trace-cmd report` line: CPU, timestamp (dots removed: `-t` prints every digit) and
/// what follows it.
#[derive(Debug)]
pub(crate) struct Line {
    pub(crate) cpu: u32,
    pub(crate) ts: u64,
    pub(crate) rest: String,
}

fn parse_report(out: &[u8]) -> Vec<Line> {
    let text = String::from_utf8_lossy(out);
    text.lines()
        .filter_map(|l| {
            // The CPU is the first "[digits]"; the timestamp follows it up to ':'.
            let b = l.as_bytes();
            let open = (0..b.len()).find(|&i| {
                b[i] == b'['
                    && b[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count() > 0
                    && b[i + 1..].iter().find(|c| !c.is_ascii_digit()) == Some(&b']')
            })?;
            let close = open + l[open..].find(']')?;
            let cpu = l[open + 1..close].parse().ok()?;
            let after = &l[close + 1..];
            let colon = after.find(':')?;
            let ts = after[..colon].trim().replace('.', "").parse().ok()?;
            Some(Line {
                cpu,
                ts,
                rest: after[colon + 1..].trim().to_string(),
            })
        })
        .collect()
}

pub(crate) fn report(args: &[&str]) -> Vec<Line> {
    let o = trace_cmd(args);
    assert!(
        o.status.success(),
        "trace-cmd {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    parse_report(&o.stdout)
}

fn write(
    path: &Path,
    version: FileVersion,
    cpus: u32,
    events: &[(u32, u64, u32, Vec<u8>)],
    shift: Option<&TimeShift>,
) -> Summary {
    let mut opts = WriterOptions::new(cpus, 0x6e57_0000 + u64::from(cpus));
    opts.version = version;
    let mut w = TraceDatWriter::create(path, opts).unwrap();
    for (cpu, ts, id, p) in events {
        w.push(*cpu, *ts, *id, p).unwrap();
    }
    w.finish(shift).unwrap()
}

fn id_of(rest: &str) -> u32 {
    let i = rest.find("id=").expect("a vmtsync event") + 3;
    rest[i..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn both_versions_report_raw_guest_tscs_and_exact_host_times() {
    let dir = tempfile::tempdir().unwrap();
    // Two vCPUs, gaps that need time extends, and three segments per vCPU with non-zero
    // offsets that change in both directions (guest starts fall inside the event range).
    let mut events = Vec::new();
    let mut ts = [5_000_000_000u64, 5_000_000_500];
    for i in 0..6000u32 {
        let cpu = i % 2;
        ts[cpu as usize] += if i % 500 == 0 { 1 << 28 } else { 997 };
        let payload = if i % 3 == 0 {
            vec![0xaa, 0xbb, u8::try_from(i % 256).unwrap()]
        } else {
            vec![]
        };
        events.push((cpu, ts[cpu as usize], i, payload));
    }
    let segments = |cpu: i64| -> Vec<SyncSegment> {
        [(0u64, 0i64), (1, -37_000), (2, 52_000)]
            .iter()
            .map(|&(j, step)| {
                let off = 1_000_000_007 + cpu * 1_000 + step;
                SyncSegment::offset_only(HostTicks(4_000_000_000 + j * 150_000_000), off)
            })
            .collect()
    };
    for mode in [ShiftMode::Step, ShiftMode::Interpolate] {
        let shift = TimeShift {
            peer_trace_id: 0x4057,
            mode,
            cpus: vec![segments(0), segments(1)],
        };
        for version in [FileVersion::V6, FileVersion::V7] {
            let path = dir.path().join(format!("g-{mode:?}-{version:?}.dat"));
            let s = write(&path, version, 2, &events, Some(&shift));
            assert_dump_ok(&path);
            let p = path.to_str().unwrap();

            let raw = report(&["report", "--raw-ts", "-i", p]);
            assert_eq!(raw.len(), events.len(), "{mode:?} {version:?}");
            for l in &raw {
                let (cpu, ts, _, payload) = &events[id_of(&l.rest) as usize];
                assert_eq!(
                    (l.cpu, l.ts),
                    (*cpu, *ts),
                    "{mode:?} {version:?}: {}",
                    l.rest
                );
                if !payload.is_empty() {
                    let hex = format!("len=3 payload=aa bb {:02x}", payload[2]);
                    assert!(l.rest.contains(&hex), "{}", l.rest);
                }
            }

            let host = report(&["report", "-t", "-i", p]);
            assert_eq!(host.len(), events.len());
            let flags = u32::from(mode == ShiftMode::Interpolate);
            let plans: Vec<_> = (0..2)
                .map(|c| plan_cpu(c, &shift.cpus[c], mode, s.ranges[c]).unwrap())
                .collect();
            for l in &host {
                let (cpu, g, _, _) = &events[id_of(&l.rest) as usize];
                let c = *cpu as usize;
                let exact = exact_host_time(&shift.cpus[c], mode, *g).unwrap();
                let model = trace_cmd_host_time(&plans[c].samples, flags, *g).unwrap();
                assert_eq!(
                    l.ts, model,
                    "{mode:?} {version:?} guest {g}: trace-cmd vs model"
                );
                assert!(
                    l.ts.abs_diff(exact) <= s.shift_error.as_ref().unwrap()[c],
                    "{mode:?} {version:?} guest {g}: {} vs exact {exact}",
                    l.ts
                );
                if mode == ShiftMode::Step {
                    assert_eq!(l.ts, exact, "identity step segments are exact");
                }
            }
        }
    }
}

fn a_million_events_cross_pages_and_time_extends() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.dat");
    let n = 1_000_000u64;
    let gap = |i: u64| match i {
        500_000 => 1 << 60, // beyond a time extend's 59 bits: a new page
        _ if i.is_multiple_of(100) => (1 << 31) + i,
        _ => 3 + i % 50,
    };
    let mut opts = WriterOptions::new(1, 77);
    opts.version = FileVersion::V7;
    let mut w = TraceDatWriter::create(&path, opts).unwrap();
    let mut ts = 10u64;
    for i in 0..n {
        ts += gap(i);
        w.push(0, ts, u32::try_from(i).unwrap(), &[]).unwrap();
    }
    let s = w.finish(None).unwrap();
    // 16 bytes per event (12 of data, 4 of header) on 4080-byte pages, plus time extends.
    assert!(s.pages[0] >= n * 16 / 4080, "{} pages", s.pages[0]);
    assert_dump_ok(&path);
    let lines = report(&["report", "--raw-ts", "-i", path.to_str().unwrap()]);
    assert_eq!(lines.len() as u64, n);
    let mut ts = 10u64;
    for (i, l) in (0..n).zip(&lines) {
        ts += gap(i);
        assert_eq!(
            (l.ts, id_of(&l.rest)),
            (ts, u32::try_from(i).unwrap()),
            "event {i}"
        );
    }
}

fn a_truncated_file_is_caught_by_our_reader() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.dat");
    let events: Vec<_> = (0..2000u32)
        .map(|i| (0, 1_000 + u64::from(i), i, vec![]))
        .collect();
    write(&path, FileVersion::V7, 1, &events, None);
    let full = std::fs::read(&path).unwrap();
    // Cut inside the second data page: report still prints what it can.
    std::fs::write(&path, &full[..4096 * 2 + 1000]).unwrap();
    let rep = trace_cmd(&["report", "-i", path.to_str().unwrap()]);
    let dump = trace_cmd(&["dump", "-v", "-i", path.to_str().unwrap()]);
    eprintln!(
        "truncated file: trace-cmd report exit {:?}, dump -v exit {:?}",
        rep.status.code(),
        dump.status.code()
    );
    match verify_file(&path) {
        Err(TraceDatError::Parse { offset, reason, .. }) => {
            assert!(offset <= full.len() as u64, "{offset}: {reason}");
        }
        other => panic!("truncation not detected: {other:?}"),
    }
}

fn a_host_trace_copy_merges_with_the_guest_in_host_time_order() {
    let trace = HostTrace::start("tracedat", vmtsync::ftrace::tsc_offset::EVENT);

    // Each marker's ftrace timestamp lies between the host TSC reads around its write.
    let mut marker = std::fs::OpenOptions::new()
        .write(true)
        .open(trace.path().join("trace_marker"))
        .unwrap();
    let mut brackets = Vec::new();
    for k in 0..300 {
        let h0 = read_host_tsc().0;
        marker
            .write_all(format!("vmtsync-mark {k}").as_bytes())
            .unwrap();
        let h1 = read_host_tsc().0;
        brackets.push((h0, h1));
    }
    drop(marker);
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("host.dat");
    trace.extract(&host);
    let host6 = dir.path().join("host6.dat");
    let o = trace_cmd(&[
        "convert",
        "--file-version",
        "6",
        "-i",
        host.to_str().unwrap(),
        "-o",
        host6.to_str().unwrap(),
    ]);
    assert!(
        o.status.success(),
        "convert: {}",
        String::from_utf8_lossy(&o.stderr)
    );

    // The guest: one vCPU whose TSC runs ahead of the host by an offset derived from the host
    // TSC now (never a constant that only holds on a long-running machine), with an event
    // stamped right before and right after each marker.
    let off = -i64::try_from(brackets[0].0 / 2).unwrap() + 12_345;
    let guest_ts = |h: u64| h.checked_add_signed(off).unwrap();
    let mut events = Vec::new();
    for (k, &(h0, h1)) in (0u32..).zip(&brackets) {
        events.push((0, guest_ts(h0), 2 * k, vec![]));
        events.push((0, guest_ts(h1), 2 * k + 1, vec![]));
    }
    let tid = u32::try_from(unsafe_free_gettid()).unwrap();
    for (host_in, guest_version) in [(&host, FileVersion::V7), (&host6, FileVersion::V6)] {
        let host_layout = read_layout(host_in).unwrap();
        let shift = TimeShift {
            peer_trace_id: host_layout.trace_id().unwrap_or(0),
            mode: ShiftMode::Step,
            cpus: vec![vec![SyncSegment::offset_only(
                HostTicks(brackets[0].0 - 1_000),
                off,
            )]],
        };
        let guest = dir.path().join(format!("guest-{guest_version:?}.dat"));
        let mut opts = WriterOptions::new(1, 0x9e57);
        opts.version = guest_version;
        let mut w = TraceDatWriter::create(&guest, opts).unwrap();
        for (cpu, ts, id, p) in &events {
            w.push(*cpu, *ts, *id, p).unwrap();
        }
        w.finish(Some(&shift)).unwrap();
        let out = dir.path().join(format!("host-guest-{guest_version:?}.dat"));
        let before = std::fs::read(host_in).unwrap();
        let info = GuestInfo {
            name: "vmtsync-test-guest".into(),
            trace_id: 0x9e57,
            vcpu_pids: vec![(0, tid)],
        };
        copy_host_trace(host_in, &out, &info, None).unwrap();
        assert_eq!(std::fs::read(host_in).unwrap(), before, "input modified");
        assert_dump_ok(&out);
        assert_dump_ok(&guest);
        let opts_dump = trace_cmd(&["dump", "--options", "-i", out.to_str().unwrap()]);
        let text = String::from_utf8_lossy(&opts_dump.stdout);
        assert!(
            text.contains("vmtsync-test-guest"),
            "GUEST not shown by dump: {text}"
        );

        let lines = report(&[
            "report",
            "-t",
            "-i",
            out.to_str().unwrap(),
            "-i",
            guest.to_str().unwrap(),
        ]);
        // Position of each guest event and marker in the merged order, and their times.
        let mut pos_guest = vec![usize::MAX; events.len()];
        let mut pos_mark = vec![usize::MAX; brackets.len()];
        for (i, l) in lines.iter().enumerate() {
            if let Some(k) = l.rest.split("vmtsync-mark ").nth(1) {
                let k: usize = k.trim().parse().unwrap();
                let (h0, h1) = brackets[k];
                assert!(
                    h0 < l.ts && l.ts < h1,
                    "marker {k} at {} outside [{h0}, {h1}]",
                    l.ts
                );
                pos_mark[k] = i;
            } else if l.rest.contains("id=") {
                let id = id_of(&l.rest) as usize;
                let (h0, h1) = brackets[id / 2];
                assert_eq!(
                    l.ts,
                    if id.is_multiple_of(2) { h0 } else { h1 },
                    "guest event {id}"
                );
                pos_guest[id] = i;
            }
        }
        let mut violations = 0;
        for k in 0..brackets.len() {
            assert!(pos_mark[k] != usize::MAX && pos_guest[2 * k] != usize::MAX);
            if !(pos_guest[2 * k] < pos_mark[k] && pos_mark[k] < pos_guest[2 * k + 1]) {
                violations += 1;
            }
        }
        assert_eq!(
            violations, 0,
            "{guest_version:?}: merged order wrong for {violations} markers"
        );
    }
}

/// The calling thread's id, the host thread a vCPU would be (any stable id works here).
fn unsafe_free_gettid() -> i64 {
    // SAFETY: gettid has no preconditions and cannot fail.
    i64::from(unsafe { libc::gettid() })
}

fn trace_cmd_converts_our_files_and_reads_our_copy_of_a_compressed_trace() {
    let dir = tempfile::tempdir().unwrap();
    let ours = dir.path().join("ours.dat");
    let events: Vec<_> = (0..5000u32)
        .map(|i| {
            (
                i % 3,
                10_000 + u64::from(i) * 31,
                i,
                vec![u8::try_from(i % 256).unwrap()],
            )
        })
        .collect();
    write(&ours, FileVersion::V7, 3, &events, None);
    let text = |args: &[&str]| {
        let o = trace_cmd(args);
        assert!(
            o.status.success(),
            "trace-cmd {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let p = |q: &Path| q.to_str().unwrap().to_owned();
    let want = text(&["report", "-t", "-i", &p(&ours)]);
    // trace-cmd's own converter rewrites our file (to v6, and to zstd sections like
    // `trace-cmd extract` writes) without changing a single report line.
    let v6 = dir.path().join("v6.dat");
    let zstd = dir.path().join("zstd.dat");
    text(&[
        "convert",
        "--file-version",
        "6",
        "-i",
        &p(&ours),
        "-o",
        &p(&v6),
    ]);
    text(&[
        "convert",
        "--compression",
        "zstd",
        "-i",
        &p(&ours),
        "-o",
        &p(&zstd),
    ]);
    assert_eq!(text(&["report", "-t", "-i", &p(&v6)]), want);
    assert_eq!(text(&["report", "-t", "-i", &p(&zstd)]), want);
    // The compressed file stands in for a host trace: our GUEST copy keeps every event and
    // trace-cmd shows the GUEST option.
    let out = dir.path().join("with-guest.dat");
    let info = GuestInfo {
        name: "vmtsync-copy-test".into(),
        trace_id: 0x77,
        vcpu_pids: vec![(0, 101), (1, 102)],
    };
    let s = copy_host_trace(&zstd, &out, &info, None).unwrap();
    assert!(!s.added_trace_id);
    assert_dump_ok(&out);
    assert_eq!(text(&["report", "-t", "-i", &p(&out)]), want);
    let opts = text(&["dump", "--options", "-i", &p(&out)]);
    assert!(opts.contains("vmtsync-copy-test"), "{opts}");
}

fn tsc2nsec_makes_trace_cmd_show_nanoseconds_after_the_shift() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns.dat");
    let t = vmtsync::formats::tracedat::Tsc2Nsec {
        mult: 6_462_042,
        shift: 24,
        offset: 0,
    };
    let mut opts = WriterOptions::new(1, 5);
    opts.tsc2nsec = Some(t);
    let mut w = TraceDatWriter::create(&path, opts).unwrap();
    let g = 2_600_000_123_456u64;
    w.push(0, g, 1, &[]).unwrap();
    let shift = TimeShift {
        peer_trace_id: 0,
        mode: ShiftMode::Step,
        cpus: vec![vec![SyncSegment::offset_only(HostTicks(0), 1_000_000)]],
    };
    w.finish(Some(&shift)).unwrap();
    let lines = report(&["report", "-t", "-i", path.to_str().unwrap()]);
    // Shift first (guest - 1e6), then trace-cmd's 64x32 multiply in two halves.
    let host = g - 1_000_000;
    let ns = (((host & 0xffff_ffff) * u64::from(t.mult)) >> t.shift)
        + (((host >> 32) * u64::from(t.mult)) << (32 - t.shift));
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0].ts, ns);
}

fn a_scaled_segment_over_a_short_span_is_within_its_bound_in_trace_cmd() {
    // guest = offset + host * 1.0001 (Intel fraction bits), a host TSC like a fresh boot's,
    // 2000 events over 2 ms of guest time: trace-cmd's 64-bit fixed point fits within a tick.
    let ratio = (1u64 << 48) + (1u64 << 48) / 10_000;
    let map = vmtsync_core::mapping::KvmTscMapping::try_new(-7_777_777, ratio, 48).unwrap();
    let h0 = 2_300_000_000_000u64;
    let g0 = map.try_guest_from_host(HostTicks(h0)).unwrap().0;
    let events: Vec<_> = (0..2000u32)
        .map(|i| (0, g0 + u64::from(i) * 2_503, i, vec![]))
        .collect();
    let shift = TimeShift {
        peer_trace_id: 0,
        mode: ShiftMode::Step,
        cpus: vec![vec![SyncSegment {
            start: HostTicks(h0),
            map,
        }]],
    };
    let dir = tempfile::tempdir().unwrap();
    for version in [FileVersion::V6, FileVersion::V7] {
        let path = dir.path().join("scaled.dat");
        let s = write(&path, version, 1, &events, Some(&shift));
        let bound = s.shift_error.unwrap()[0];
        assert!(bound <= 1, "bound {bound}");
        assert_dump_ok(&path);
        let lines = report(&["report", "-t", "-i", path.to_str().unwrap()]);
        assert_eq!(lines.len(), events.len());
        let mut worst = 0;
        for l in &lines {
            let g = events[id_of(&l.rest) as usize].1;
            let exact = map
                .try_host_from_guest_ceil(vmtsync_core::GuestTicks(g))
                .unwrap()
                .0;
            worst = worst.max(l.ts.abs_diff(exact));
        }
        assert!(worst <= bound, "{version:?}: off by {worst}, bound {bound}");
        eprintln!("{version:?}: scaled segment, worst {worst} ticks, bound {bound}");
    }
}
