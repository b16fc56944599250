use super::*;
use crate::formats::{Bound, Payload};

fn opts() -> CtfOptions {
    CtfOptions {
        tsc_hz: 2_299_998_000,
        name: "t\"r\\ace".into(),
        env: vec![("in put".into(), "a\nb".into())],
    }
}

fn ev(vcpu: u32, host: u64, payload: &[u8]) -> ExportEvent {
    ExportEvent {
        vcpu,
        id: 0xbeef,
        guest_tsc: Some(host + 10),
        host_tsc: host,
        bound: Some(Bound {
            lo: host - 1,
            hi: host + 1,
        }),
        payload: Payload::new(payload).unwrap(),
    }
}

/// Packets of one stream file: (header+context fields, event bytes).
fn packets(bytes: &[u8]) -> Vec<([u64; 7], Vec<u8>)> {
    let u = |b: &[u8], at: usize, n: usize| {
        let mut v = [0u8; 8];
        v[..n].copy_from_slice(&b[at..at + n]);
        u64::from_le_bytes(v)
    };
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let h = [
            u(bytes, at, 4),
            u(bytes, at + 4, 4),
            u(bytes, at + 8, 8),
            u(bytes, at + 16, 8),
            u(bytes, at + 24, 8),
            u(bytes, at + 32, 8),
            u(bytes, at + 48, 8),
        ];
        let len = usize::try_from(u(bytes, at + 40, 8) / 8).unwrap();
        assert_eq!(h[5], u(bytes, at + 40, 8), "content size = packet size");
        out.push((h, bytes[at + PACKET_HEADER..at + len].to_vec()));
        at += len;
    }
    out
}

#[test]
fn a_guest_trace_has_its_metadata_and_one_stream_per_vcpu() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("trace");
    let mut w = GuestCtf::create(&out, &opts(), GuestFields::ALL).unwrap();
    w.push(&ev(0, 1000, &[1, 2])).unwrap();
    w.push(&ev(3, 500, &[])).unwrap();
    w.push(&ev(0, 2000, &[0xff; 16])).unwrap();
    let s = w.finish().unwrap();
    assert_eq!((s.events, s.streams, s.raised), (3, 2, 0));
    let mut names: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["metadata", "vcpu0", "vcpu3"]);
    let m = std::fs::read_to_string(out.join("metadata")).unwrap();
    assert!(m.starts_with("/* CTF 1.8 */\n"));
    for want in [
        "freq = 2299998000;",
        "offset = 0;",
        "absolute = true;",
        "trace_name = \"t\\\"r\\\\ace\";",
        "in_put = \"a b\";",
        "uint64_t guest_tsc;",
        "uint64_t host_lo;",
        "uint8_t payload[payload_len];",
    ] {
        assert!(m.contains(want), "{want} not in\n{m}");
    }
    let p = packets(&std::fs::read(out.join("vcpu0")).unwrap());
    assert_eq!(p.len(), 1);
    let (h, body) = &p[0];
    // Magic, stream class 0, instance = vCPU, first and last timestamp, sequence 0.
    assert_eq!(h, &[0xC1FC_1FC1, 0, 0, 1000, 2000, h[5], 0]);
    // Event 1, the packet's first: extended header (kind 1, class 0, ts), then id, vcpu,
    // host, guest, lo, hi, len, payload.
    let mut e1 = vec![1u8, 0];
    e1.extend_from_slice(&1000u64.to_le_bytes());
    e1.extend_from_slice(&0xbeefu16.to_le_bytes());
    e1.extend_from_slice(&0u32.to_le_bytes());
    for v in [1000u64, 1010, 999, 1001] {
        e1.extend_from_slice(&v.to_le_bytes());
    }
    e1.extend_from_slice(&[2, 1, 2]);
    assert_eq!(&body[..e1.len()], &e1[..]);
    // Event 2: compact header (kind 0 in bit 0, the timestamp's low 31 bits above it).
    let e2 = e1.len() - 10 + 4;
    assert_eq!(body[e1.len()..e1.len() + 4], (2000u32 << 1).to_le_bytes());
    assert_eq!(body.len(), e1.len() + e2 - 2 + 16);
    assert!(!d.path().read_dir().unwrap().any(|e| {
        e.unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".partial")
    }));
}

/// Streams that write their packets on the caller's thread (`write_here`, synced in the
/// background) make the same files as streams written by a thread of their own: over two
/// vCPUs and more than one sync's worth of packets.
#[test]
fn streams_written_here_make_the_files_a_writing_thread_makes() {
    let d = tempfile::tempdir().unwrap();
    let write = |name: &str, here: bool| {
        let out = d.path().join(name);
        let mut w = GuestCtf::create(&out, &opts(), GuestFields::ALL).unwrap();
        if here {
            w.write_here();
        }
        // About 40 MB on vCPU 0, past `SYNC_EVERY`.
        for i in 0..800_000u64 {
            let len = usize::try_from(i % 17).unwrap();
            w.push(&ev(0, 1000 + i * 3, &i.to_le_bytes().repeat(2)[..len]))
                .unwrap();
            if i % 1000 == 0 {
                w.push(&ev(1, 1000 + i, &[7])).unwrap();
            }
        }
        w.finish().unwrap();
        out
    };
    let (bg, here) = (write("bg", false), write("here", true));
    let files = |dir: &Path| {
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let (a, b) = (files(&bg), files(&here));
    assert!(a[1].1.len() > crate::atomic_file::SYNC_EVERY, "{}", a[1].0);
    assert!(a == b, "the two traces differ");
}

#[test]
fn fields_follow_what_the_input_knows() {
    let d = tempfile::tempdir().unwrap();
    let f = GuestFields {
        guest_tsc: false,
        interval: Interval::Unknown,
    };
    let out = d.path().join("h");
    let mut w = GuestCtf::create(&out, &opts(), f).unwrap();
    let mut e = ev(0, 7, &[]);
    e.guest_tsc = None;
    e.bound = None;
    w.push(&e).unwrap();
    w.finish().unwrap();
    let m = std::fs::read_to_string(out.join("metadata")).unwrap();
    assert!(!m.contains("guest_tsc") && !m.contains("host_lo"));
    // 10 header bytes (a packet's first event) + id, vcpu, host_tsc, payload_len.
    assert_eq!(
        std::fs::metadata(out.join("vcpu0")).unwrap().len(),
        (PACKET_HEADER + 10 + 2 + 4 + 8 + 1) as u64
    );
    // A trace that declares a field refuses an event without it.
    let mut w = GuestCtf::create(&d.path().join("a"), &opts(), GuestFields::ALL).unwrap();
    assert!(w.push(&e).is_err());
}

#[test]
fn timestamps_never_go_back_within_a_stream_and_packets_split() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("t");
    let mut w = CtfTrace::create(&out, &opts(), "", "s").unwrap();
    assert!(!w.event(1, 0, 100, &Fields::default()).unwrap());
    assert!(w.event(1, 0, 90, &Fields::default()).unwrap());
    // Another stream has its own order.
    assert!(!w.event(2, 0, 50, &Fields::default()).unwrap());
    let n = 3 * PACKET_BYTES / 4;
    for i in 0..n as u64 {
        assert!(!w.event(1, 0, 100 + i, &Fields::default()).unwrap());
    }
    let s = w.finish().unwrap();
    assert_eq!(s.raised, 1);
    let p = packets(&std::fs::read(out.join("s1")).unwrap());
    assert!(p.len() >= 3, "{} packets", p.len());
    let mut last = 0;
    let mut events = 0;
    for (seq, (h, body)) in p.iter().enumerate() {
        assert_eq!(h[6], seq as u64);
        assert!(h[3] >= last && h[4] >= h[3]);
        last = h[4];
        events += decode_headers(body, h[3]).len();
    }
    assert_eq!(events, n + 2);
    assert_eq!(p[0].0[3], 100);
}

/// The timestamps of a packet of events without fields, decoded as babeltrace2 does: a compact
/// header's 31 bits replace the low bits of the previous timestamp, adding 2^31 when they are
/// below them (a wrap); an extended header's 64 bits replace it.
fn decode_headers(mut body: &[u8], begin: u64) -> Vec<u64> {
    let mut clock = begin;
    let mut out = Vec::new();
    while !body.is_empty() {
        if body[0] & 1 == 0 {
            let low = u64::from(u32::from_le_bytes(body[..4].try_into().unwrap()) >> 1);
            let mask = (1u64 << 31) - 1;
            if low < clock & mask {
                clock = clock.wrapping_add(1 << 31);
            }
            clock = (clock & !mask) | low;
            body = &body[4..];
        } else {
            assert_eq!(body[1], 0, "class");
            clock = u64::from_le_bytes(body[2..10].try_into().unwrap());
            body = &body[10..];
        }
        out.push(clock);
    }
    out
}

#[test]
fn compact_headers_give_back_every_timestamp() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("t");
    let mut w = CtfTrace::create(&out, &opts(), "", "s").unwrap();
    // Steps below, at and above 2^31 ticks, across wraps of the low 31 bits, up to 2^64 - 1.
    let mut ts = vec![(1 << 31) - 3, (1 << 31) + 2, 1 << 32];
    for step in [
        (1u64 << 31) - 1,
        1 << 31,
        (1 << 31) + 1,
        0,
        1,
        12345,
        1 << 40,
    ] {
        ts.push(ts[ts.len() - 1] + step);
    }
    ts.extend([u64::MAX - (1 << 31), u64::MAX - 1, u64::MAX]);
    for &t in &ts {
        assert!(!w.event(0, 0, t, &Fields::default()).unwrap());
    }
    w.finish().unwrap();
    let p = packets(&std::fs::read(out.join("s0")).unwrap());
    assert_eq!(p.len(), 1);
    let (h, body) = &p[0];
    assert_eq!(decode_headers(body, h[3]), ts);
    // Extended: the first event, the steps of 2^31 and more (three) and the jump near 2^64.
    assert_eq!(body.len(), 4 * ts.len() + 6 * 5);
}

#[test]
fn targets_are_checked_and_memory_is_bounded() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("file"), "x").unwrap();
    let e = CtfTrace::create(&d.path().join("file"), &opts(), "", "s").unwrap_err();
    assert!(e.to_string().contains("is a file"), "{e}");
    std::fs::create_dir(d.path().join("full")).unwrap();
    std::fs::write(d.path().join("full/x"), "x").unwrap();
    let e = CtfTrace::create(&d.path().join("full"), &opts(), "", "s").unwrap_err();
    assert!(e.to_string().contains("not empty"), "{e}");
    // An empty directory is replaced.
    std::fs::create_dir(d.path().join("empty")).unwrap();
    let w = CtfTrace::create(&d.path().join("empty"), &opts(), "", "s").unwrap();
    w.finish().unwrap();
    assert!(d.path().join("empty/metadata").exists());
    let mut o = opts();
    o.tsc_hz = 0;
    assert!(CtfTrace::create(&d.path().join("z"), &o, "", "s").is_err());
    // More vCPUs than a trace holds is refused, not allocated.
    let mut w = CtfTrace::create(&d.path().join("many"), &opts(), "", "s").unwrap();
    let max = u32::try_from(MAX_STREAMS).unwrap();
    for i in 0..max {
        w.event(i, 0, 1, &Fields::default()).unwrap();
    }
    let e = w.event(max, 0, 1, &Fields::default()).unwrap_err();
    assert!(e.to_string().contains("streams"), "{e}");
    // A trace dropped unfinished leaves nothing at its target.
    drop(w);
    assert!(!d.path().join("many").exists());
}

#[test]
fn kernel_log_lines_give_tsc_khz_exactly() {
    assert_eq!(
        tsc_khz_from_log("tsc: Detected 2299.998 MHz processor"),
        Some((0, 2_299_998))
    );
    assert_eq!(
        tsc_khz_from_log("tsc: Detected 3000.010 MHz TSC"),
        Some((1, 3_000_010))
    );
    assert_eq!(
        tsc_khz_from_log("tsc: Refined TSC clocksource calibration: 2995.201 MHz"),
        Some((2, 2_995_201))
    );
    for bad in [
        "tsc: Detected 2299.99 MHz processor",
        "tsc: Detected 2299 MHz processor",
        "tsc: Detected x.998 MHz processor",
        "tsc: Marking TSC unstable",
        "clocksource: tsc: mask: 0xffffffffffffffff",
    ] {
        assert_eq!(tsc_khz_from_log(bad), None, "{bad}");
    }
}

#[test]
fn fields_keep_their_bounds() {
    let mut f = Fields::default();
    f.put(0x0102u16.to_le_bytes());
    f.put_payload(&Payload::new(&[9, 8, 7]).unwrap());
    assert_eq!(f.bytes(), &[2, 1, 3, 9, 8, 7]);
    // Fixed-size fields past FIELDS_MAX are dropped, never written past the array.
    let mut f = Fields::default();
    for _ in 0..FIELDS_MAX / 8 + 2 {
        f.put(u64::MAX.to_le_bytes());
    }
    assert_eq!(f.bytes().len(), FIELDS_MAX);
    f.put_payload(&Payload::new(&[1; 16]).unwrap());
    assert_eq!(f.bytes().len(), FIELDS_MAX + 16);
}

#[test]
fn a_trace_without_kvm_pio_is_refused_and_writes_nothing() {
    use crate::formats::tracedat::{TraceDatWriter, WriterOptions};
    let d = tempfile::tempdir().unwrap();
    let dat = d.path().join("guest.dat");
    let mut w = TraceDatWriter::create(&dat, WriterOptions::new(1, 1)).unwrap();
    w.push(0, 10, 1, &[]).unwrap();
    w.finish(None).unwrap();
    let out = d.path().join("host");
    let e = export_kvm_pio(&dat, &out, &opts()).unwrap_err();
    assert!(e.to_string().contains("no kvm:kvm_pio format"), "{e}");
    assert!(!out.exists());
    let e = export_kvm_pio(&d.path().join("missing.dat"), &out, &opts()).unwrap_err();
    assert!(matches!(e, ExportError::TraceDat(_)), "{e}");
}

/// Streams written by a thread of their own and streams written directly hold the same
/// packets: every stream past [`BACKGROUND_STREAMS`] too, each packet in sequence, every event.
#[test]
fn background_and_direct_streams_hold_every_packet_in_order() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("t");
    let mut w = CtfTrace::create(&out, &opts(), "", "s").unwrap();
    let streams = u32::try_from(BACKGROUND_STREAMS).unwrap() + 3;
    let n = PACKET_BYTES / 2;
    for i in 0..n as u64 {
        for s in 0..streams {
            assert!(!w.event(s, 0, 100 + i, &Fields::default()).unwrap());
        }
    }
    let summary = w.finish().unwrap();
    assert_eq!(summary.streams, streams as usize);
    for s in 0..streams {
        let p = packets(&std::fs::read(out.join(format!("s{s}"))).unwrap());
        assert!(p.len() >= 2, "stream {s}: {} packets", p.len());
        let mut events = 0;
        for (seq, (h, body)) in p.iter().enumerate() {
            assert_eq!((h[2], h[6]), (u64::from(s), seq as u64), "stream {s}");
            events += decode_headers(body, h[3]).len();
        }
        assert_eq!(events, n, "stream {s}");
    }
}

#[test]
fn an_exact_trace_says_so_and_refuses_any_other_interval() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("x");
    let mut w = GuestCtf::create(&out, &opts(), GuestFields::EXACT).unwrap();
    let mut e = ev(0, 7, &[1, 2]);
    e.bound = Some(Bound { lo: 7, hi: 7 });
    w.push(&e).unwrap();
    // Wider on either side, or unknown: refused, whatever the event's host TSC.
    for bound in [
        Some(Bound { lo: 6, hi: 7 }),
        Some(Bound { lo: 7, hi: 8 }),
        None,
    ] {
        e.bound = bound;
        let err = w.push(&e).unwrap_err().to_string();
        assert!(err.contains("declares every interval exact"), "{err}");
    }
    w.finish().unwrap();
    let m = std::fs::read_to_string(out.join("metadata")).unwrap();
    assert!(m.contains("\tvmtsync_interval = \"exact\";\n"), "{m}");
    assert!(m.contains("guest_tsc") && !m.contains("host_lo"), "{m}");
    // 10 header bytes (a packet's first event) + id, vcpu, host_tsc, guest_tsc, payload_len,
    // the payload: the one event written.
    assert_eq!(
        std::fs::metadata(out.join("vcpu0")).unwrap().len(),
        (PACKET_HEADER + 10 + 2 + 4 + 8 + 8 + 1 + 2) as u64
    );
    // Only an exact trace says so.
    let all = d.path().join("a");
    GuestCtf::create(&all, &opts(), GuestFields::ALL)
        .unwrap()
        .finish()
        .unwrap();
    let m = std::fs::read_to_string(all.join("metadata")).unwrap();
    assert!(!m.contains("vmtsync_interval"), "{m}");
}

/// Runs pushed with `push_exact_while` (an exact trace's plain events, in one loop) make the
/// same files as `push` of each event: over packets it fills, payloads of every length, steps
/// too long for a compact header, an event before the stream's last (raised by `push`), span
/// records (refused by the run) and a second vCPU. A trace of another layout takes no run.
#[test]
fn exact_runs_write_what_pushing_each_event_writes() {
    let events: Vec<ExportEvent> = (0..300_000u64)
        .map(|i| {
            let vcpu = u32::from(i % 5000 == 0);
            let host = match i {
                1000 => 500,                           // before the stream's last
                2000 => 10_000 + 3 * 2000 + (1 << 31), // a step too long for a compact header
                _ if i > 2000 => 10_000 + 3 * i + (1 << 31),
                _ => 10_000 + 3 * i,
            };
            let len = usize::try_from(i % 17).unwrap();
            let mut e = ev(vcpu, host, &i.to_le_bytes().repeat(2)[..len]);
            e.bound = Some(Bound { lo: host, hi: host });
            if i % 777 == 0 {
                e.id = vmtsync_core::recorder::SPAN_BEGIN_ID;
            }
            e
        })
        .collect();
    let d = tempfile::tempdir().unwrap();
    let write = |name: &str, runs: bool| {
        let out = d.path().join(name);
        let mut w = GuestCtf::create(&out, &opts(), GuestFields::EXACT).unwrap();
        w.write_here();
        let exact = |e: &ExportEvent| {
            Some(ExactEvent {
                id: e.id,
                host_tsc: e.host_tsc,
                guest_tsc: e.guest_tsc?,
                payload: e.payload,
            })
        };
        for run in events.chunk_by(|a, b| a.vcpu == b.vcpu) {
            let mut rest = run;
            while let Some(first) = rest.first() {
                let n = if runs {
                    w.push_exact_while(first.vcpu, rest, exact).unwrap()
                } else {
                    0
                };
                rest = &rest[n..];
                if let Some(e) = rest.first() {
                    w.push(e).unwrap();
                    rest = &rest[1..];
                }
            }
        }
        w.finish().unwrap();
        out
    };
    let (one, runs) = (write("one", false), write("runs", true));
    for f in ["vcpu0", "vcpu1"] {
        let (a, b) = (
            std::fs::read(one.join(f)).unwrap(),
            std::fs::read(runs.join(f)).unwrap(),
        );
        assert!(
            a.len() > 2 * PACKET_BYTES || f == "vcpu1",
            "{f}: {}",
            a.len()
        );
        assert!(a == b, "{f}: the two traces differ");
    }
    // Another layout: no run is taken.
    let mut w = GuestCtf::create(&d.path().join("all"), &opts(), GuestFields::ALL).unwrap();
    w.push(&events[0]).unwrap();
    assert!(!w.takes_exact_runs());
    assert_eq!(
        w.push_exact_while(0, &events[1..], |_| None::<ExactEvent>)
            .unwrap(),
        0
    );
}
