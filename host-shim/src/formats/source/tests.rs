use std::io::Write as _;

use vmtsync_core::HostTicks;

use super::*;
use crate::formats::event::Bound;
use crate::formats::jsonl::parse_hex;
use crate::formats::tracedat::{
    FileVersion, ShiftMode, SyncSegment, TimeShift, TraceDatWriter, WriterOptions,
};

fn line(vcpu: u32, id: u16, guest: u64, host: u64, lo: u64, hi: u64, payload: &str) -> String {
    format!(
        r#"{{"schema":1,"vcpu":{vcpu},"id":{id},"guest_tsc":{guest},"host_tsc":{host},"host_lo":{lo},"host_hi":{hi},"payload":"{payload}","round":0}}"#
    )
}

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn all(path: &Path) -> Result<Vec<ExportEvent>, ExportError> {
    open(path)?.collect()
}

#[test]
fn jsonl_events_come_back_field_for_field() {
    let d = tempfile::tempdir().unwrap();
    let text = [
        line(0, 7, 1_000, 900, 890, 910, ""),
        String::new(),
        line(2, 65_535, u64::MAX, u64::MAX - 5, 3, u64::MAX, "00ff10"),
        line(1, 1, 5, 5, 5, 5, "000102030405060708090a0b0c0d0e0f"),
    ]
    .join("\n");
    let p = write(&d, "r.jsonl", &text);
    let src = open(&p).unwrap();
    assert_eq!(src.kind(), InputKind::Jsonl);
    let ev: Vec<_> = src.collect::<Result<_, _>>().unwrap();
    assert_eq!(ev.len(), 3);
    assert_eq!(
        ev[0],
        ExportEvent {
            vcpu: 0,
            id: 7,
            guest_tsc: Some(1_000),
            host_tsc: 900,
            bound: Some(Bound { lo: 890, hi: 910 }),
            payload: Payload::default(),
        }
    );
    assert_eq!(ev[1].payload.as_slice(), &[0x00, 0xff, 0x10]);
    assert_eq!(ev[1].host_tsc, u64::MAX - 5);
    assert_eq!(ev[2].payload.as_slice(), &(0..16).collect::<Vec<u8>>()[..]);
    // An empty file is a recording without events.
    assert!(all(&write(&d, "e.jsonl", "")).unwrap().is_empty());
}

#[test]
fn bad_jsonl_names_the_line_and_stops() {
    let d = tempfile::tempdir().unwrap();
    let good = line(0, 1, 10, 10, 9, 11, "ab");
    for (bad, want) in [
        (line(0, 1, 10, 10, 9, 11, "ABC"), "not lowercase hex"),
        (line(0, 1, 10, 10, 9, 11, &"00".repeat(17)), "at most 16"),
        (line(0, 1, 10, 12, 9, 11, ""), "outside its interval"),
        (good.replace("\"schema\":1", "\"schema\":2"), "schema 2"),
        (good.replace("\"id\":1", "\"id\":70000"), "line 2"),
        (good[..good.len() - 3].to_string(), "line 2"),
        ("{".to_string() + &" ".repeat(5000), "longer than"),
    ] {
        let p = write(&d, "b.jsonl", &format!("{good}\n{bad}\n{good}\n"));
        let mut src = open(&p).unwrap();
        assert!(src.next().unwrap().is_ok());
        let e = src.next().unwrap().unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains(want), "{e}");
        // The source ends after its first error.
        assert!(src.next().is_none());
    }
}

#[test]
fn unknown_files_are_refused_clearly() {
    let d = tempfile::tempdir().unwrap();
    let p = write(&d, "x.bin", "\x7fELF garbage");
    let e = open(&p).unwrap_err();
    assert!(matches!(e, ExportError::UnknownFormat { .. }), "{e}");
    assert!(e.to_string().contains("not a vmtsync recording"));
    let e = open(&d.path().join("missing")).unwrap_err();
    assert!(matches!(e, ExportError::Io { .. }), "{e}");
}

/// A guest trace.dat as `vmtsync record` writes it: vCPU 0 as trace CPU 0, the events' raw
/// guest TSCs (or host TSCs when `shift` is `None`), ids and payloads.
fn dat(path: &Path, events: &[(u64, u16, &[u8])], shift: Option<&TimeShift>, v: FileVersion) {
    let mut o = WriterOptions::new(1, 0x5eed);
    o.version = v;
    let mut w = TraceDatWriter::create(path, o).unwrap();
    for &(ts, id, p) in events {
        w.push(0, ts, u32::from(id), p).unwrap();
    }
    w.finish(shift).unwrap();
}

#[test]
fn trace_dat_with_time_shift_gives_guest_and_exact_host_ticks() {
    let d = tempfile::tempdir().unwrap();
    // Two identity segments: guest = host + 1_000 from host 0, guest = host - 250 from host
    // 50_000 (guest 49_750) on. The truth is computed here from that definition.
    let shift = TimeShift {
        peer_trace_id: 0,
        mode: ShiftMode::Step,
        cpus: vec![vec![
            SyncSegment::offset_only(HostTicks(0), 1_000),
            SyncSegment::offset_only(HostTicks(50_000), -250),
        ]],
    };
    let truth = |g: u64| if g >= 49_750 { g + 250 } else { g - 1_000 };
    let events: Vec<(u64, u16, &[u8])> = vec![
        (1_500, 1, &[]),
        (49_749, 2, &[1, 2, 3]),
        (49_750, 3, &[0xff; 16]),
        (9_000_000, 4, &[]),
    ];
    for v in [FileVersion::V6, FileVersion::V7] {
        let p = d.path().join(format!("g{v:?}.dat"));
        dat(&p, &events, Some(&shift), v);
        let src = open(&p).unwrap();
        assert_eq!(src.kind(), InputKind::TraceDatShifted);
        let got: Vec<_> = src.collect::<Result<_, _>>().unwrap();
        assert_eq!(got.len(), events.len());
        for (e, &(g, id, p)) in got.iter().zip(&events) {
            assert_eq!(e.vcpu, 0);
            assert_eq!(e.id, id);
            assert_eq!(e.guest_tsc, Some(g));
            assert_eq!(e.host_tsc, truth(g), "guest {g}");
            assert_eq!(e.bound, None);
            assert_eq!(e.payload.as_slice(), p);
        }
    }
}

#[test]
fn pre_converted_trace_dat_gives_host_ticks_only() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("h.dat");
    dat(&p, &[(77, 9, &[5]), (78, 10, &[])], None, FileVersion::V7);
    let src = open(&p).unwrap();
    assert_eq!(src.kind(), InputKind::TraceDatHost);
    let got: Vec<_> = src.collect::<Result<_, _>>().unwrap();
    assert_eq!(
        got.iter()
            .map(|e| (e.host_tsc, e.guest_tsc, e.id))
            .collect::<Vec<_>>(),
        vec![(77, None, 9), (78, None, 10)]
    );
}

#[test]
fn a_large_trace_dat_streams_and_can_be_dropped_early() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("big.dat");
    let n = 5 * BATCH as u64 + 17;
    let mut w = TraceDatWriter::create(&p, WriterOptions::new(1, 1)).unwrap();
    for i in 0..n {
        w.push(0, 1_000 + i * 3, (i % 60_000) as u32, &i.to_le_bytes())
            .unwrap();
    }
    w.finish(None).unwrap();
    let mut count = 0u64;
    for (i, e) in open(&p).unwrap().enumerate() {
        let e = e.unwrap();
        assert_eq!(e.host_tsc, 1_000 + i as u64 * 3);
        assert_eq!(e.payload.as_slice(), &(i as u64).to_le_bytes());
        count += 1;
    }
    assert_eq!(count, n);
    // Dropping a source mid-stream neither hangs nor leaks a blocked thread's batches.
    let mut src = open(&p).unwrap();
    assert!(src.next().unwrap().is_ok());
    drop(src);
}

#[test]
fn damaged_trace_dat_is_an_error_never_a_panic() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("t.dat");
    let events: Vec<(u64, u16, &[u8])> = (0..200).map(|i| (100 + i, 1, &[7u8; 9][..])).collect();
    dat(&p, &events, None, FileVersion::V7);
    let bytes = std::fs::read(&p).unwrap();
    let q = d.path().join("cut.dat");
    let mut errors = 0;
    // Every truncation point either fails to open or ends the stream with an error (or, cut
    // after the last page, yields a prefix), and never panics.
    for cut in (3..bytes.len()).step_by(97) {
        std::fs::File::create(&q)
            .unwrap()
            .write_all(&bytes[..cut])
            .unwrap();
        match open(&q).and_then(|src| src.collect::<Result<Vec<_>, _>>()) {
            Ok(v) => assert!(v.len() <= events.len()),
            Err(_) => errors += 1,
        }
    }
    assert!(errors > bytes.len() / 97 / 2, "{errors} errors");
}

#[test]
fn hex_is_strict() {
    assert_eq!(parse_hex("").unwrap().as_slice(), &[] as &[u8]);
    assert_eq!(parse_hex("0a").unwrap().as_slice(), &[10]);
    for bad in ["0", "0A", "zz", "0g", " 0"] {
        assert!(parse_hex(bad).is_none(), "{bad}");
    }
    assert!(Payload::new(&[0; 17]).is_none());
    assert_eq!(format!("{:?}", Payload::new(&[0xab, 1]).unwrap()), "ab01");
}
