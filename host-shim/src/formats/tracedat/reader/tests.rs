use proptest::prelude::*;

use super::*;
use crate::formats::tracedat::writer::{FileVersion, TraceDatWriter, WriterOptions};

fn sample(version: FileVersion) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.dat");
    let mut opts = WriterOptions::new(2, 3);
    opts.version = version;
    let mut w = TraceDatWriter::create(&path, opts).unwrap();
    let mut ts = 1_000u64;
    for i in 0..300u32 {
        ts += if i % 50 == 0 { 1 << 30 } else { 9 };
        w.push(
            i % 2,
            ts,
            i,
            &i.to_le_bytes()[..usize::try_from(i % 5).unwrap()],
        )
        .unwrap();
    }
    w.finish(None).unwrap();
    std::fs::read(&path).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Any damage to a valid file yields Ok or an error, never a panic or a huge allocation.
    #[test]
    fn damaged_files_never_panic(
        kind in 0..3u8,
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let mut bytes = match kind {
            0 => sample(FileVersion::V7),
            1 => sample(FileVersion::V6),
            _ => ZSTD_FIXTURE.to_vec(),
        };
        for (i, b) in flips {
            let at = i.index(bytes.len());
            bytes[at] = b;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.dat");
        std::fs::write(&path, &bytes).unwrap();
        if let Ok(layout) = read_layout(&path) {
            for b in 0..layout.buffers.len() {
                let _ = for_each_event(&path, &layout, b, |_| {});
            }
            let _ = read_event_formats(&path, &layout);
            let _ = cpu_time_ranges(&path, &layout);
            let _ = for_each_record(&path, &layout, 0, |_, _, _| {});
        }
    }
}

/// `sample(FileVersion::V7)` as `trace-cmd convert --compression zstd` (3.1.6) rewrote it:
/// every metadata section and the CPU data zstd-compressed, as `trace-cmd extract` writes them.
const ZSTD_FIXTURE: &[u8] = include_bytes!("fixtures/sample-v7-zstd.dat");

fn events_of(bytes: &[u8]) -> Vec<Event> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("e.dat");
    std::fs::write(&path, bytes).unwrap();
    let layout = read_layout(&path).unwrap();
    let mut v = Vec::new();
    for b in 0..layout.buffers.len() {
        for_each_event(&path, &layout, b, |e| v.push(*e)).unwrap();
    }
    v
}

#[test]
fn compressed_cpu_data_reads_back_the_events_that_were_written() {
    let plain = events_of(&sample(FileVersion::V7));
    assert_eq!(plain.len(), 300);
    // The fixture was written before `event_data`'s payload became a dynamic array: its
    // payloads read back the same from the older layout.
    let older: Vec<Event> = events_of(ZSTD_FIXTURE)
        .into_iter()
        .map(|mut e| {
            assert_ne!(e.common_type, EVENT_DATA_ID, "{e:?}");
            if e.common_type == EVENT_DATA_FIXED_ID {
                e.common_type = EVENT_DATA_ID;
            }
            e
        })
        .collect();
    assert!(
        plain
            .iter()
            .any(|e| e.common_type == EVENT_DATA_ID && e.len > 0)
    );
    assert_eq!(older, plain);
}

#[test]
fn for_each_record_gives_raw_records_with_common_type_first() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("z.dat");
    std::fs::write(&path, ZSTD_FIXTURE).unwrap();
    let layout = read_layout(&path).unwrap();
    assert!(layout.buffers[0].compressed);
    let mut recs = Vec::new();
    for_each_record(&path, &layout, 0, |cpu, ts, data| {
        recs.push((cpu, ts, data.to_vec()));
    })
    .unwrap();
    let events = events_of(ZSTD_FIXTURE);
    assert_eq!(recs.len(), events.len());
    for ((cpu, ts, data), e) in recs.iter().zip(&events) {
        assert_eq!((*cpu, *ts), (e.cpu, e.ts));
        assert_eq!(u16::from_le_bytes([data[0], data[1]]), e.common_type);
        assert_eq!(u32::from_le_bytes(data[8..12].try_into().unwrap()), e.id);
    }
}

#[test]
fn event_formats_come_back_from_every_layout() {
    use crate::formats::tracedat::format::{
        EVENT_DATA_FIXED_FORMAT, EVENT_DATA_FIXED_ID, EVENT_DATA_FORMAT, EVENT_DATA_ID,
        EVENT_FORMAT, EVENT_ID,
    };
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in [
        ("v7", sample(FileVersion::V7)),
        ("v6", sample(FileVersion::V6)),
        ("zstd", ZSTD_FIXTURE.to_vec()),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, &bytes).unwrap();
        let layout = read_layout(&path).unwrap();
        let f = read_event_formats(&path, &layout).unwrap();
        let got: Vec<_> = f
            .iter()
            .map(|f| (f.system.as_str(), f.name.as_str(), f.id, f.format.as_str()))
            .collect();
        // The fixture is older: its `event_data` has the fixed layout.
        let data = if name == "zstd" {
            (EVENT_DATA_FIXED_ID, EVENT_DATA_FIXED_FORMAT)
        } else {
            (EVENT_DATA_ID, EVENT_DATA_FORMAT)
        };
        let mut want = vec![
            ("vmtsync", "event", Some(EVENT_ID), EVENT_FORMAT),
            ("vmtsync", "event_data", Some(data.0), data.1),
        ];
        // Files of this version also carry the function graph's formats (the fixture is
        // older).
        if name != "zstd" {
            use crate::formats::tracedat::format as g;
            want.insert(
                0,
                (
                    "ftrace",
                    "funcgraph_entry",
                    Some(g::FUNCGRAPH_ENTRY_ID),
                    g::FUNCGRAPH_ENTRY_FORMAT,
                ),
            );
            want.insert(
                1,
                (
                    "ftrace",
                    "funcgraph_exit",
                    Some(g::FUNCGRAPH_EXIT_ID),
                    g::FUNCGRAPH_EXIT_FORMAT,
                ),
            );
            want.push((
                "vmtsync",
                "span_orphan",
                Some(g::SPAN_ORPHAN_ID),
                g::SPAN_ORPHAN_FORMAT,
            ));
        }
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn a_truncated_or_damaged_compressed_file_names_the_offset() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("z.dat");
    // Cut inside the compressed CPU data of CPU 1 (0x2000 + 100): the layout still reads (the
    // section table is checked first) or fails, but never silently.
    std::fs::write(&path, &ZSTD_FIXTURE[..0x2000 + 100]).unwrap();
    match read_layout(&path) {
        Err(TraceDatError::Parse { offset, .. }) => assert!(offset <= 0x2000 + 100),
        other => panic!("truncation not detected: {other:?}"),
    }
    // A flipped byte inside CPU 0's compressed chunk: zstd's checks or the page walk refuse it,
    // naming the chunk's offset.
    let mut bad = ZSTD_FIXTURE.to_vec();
    for b in &mut bad[0x1000 + 40..0x1000 + 48] {
        *b ^= 0x5a;
    }
    std::fs::write(&path, &bad).unwrap();
    let layout = read_layout(&path).unwrap();
    match for_each_record(&path, &layout, 0, |_, _, _| {}) {
        Err(TraceDatError::Parse { offset, reason, .. }) => {
            assert!((0x1000..0x2000).contains(&offset), "{offset}: {reason}");
        }
        other => panic!("damage not detected: {other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Damage inside compressed CPU data and compressed sections (zstd frames, chunk headers)
    /// yields Ok or an error, never a panic: the decoder sees arbitrary bytes.
    #[test]
    fn damaged_zstd_data_never_panics(
        flips in proptest::collection::vec((0usize..ZSTD_FIXTURE.len(), any::<u8>()), 1..6),
    ) {
        let mut bytes = ZSTD_FIXTURE.to_vec();
        for (at, b) in flips {
            bytes[at] ^= b | 1;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.dat");
        std::fs::write(&path, &bytes).unwrap();
        if let Ok(layout) = read_layout(&path) {
            let _ = for_each_record(&path, &layout, 0, |_, _, _| {});
            let _ = read_event_formats(&path, &layout);
            let _ = cpu_time_ranges(&path, &layout);
        }
    }
}
