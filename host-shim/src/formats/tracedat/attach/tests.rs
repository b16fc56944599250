use super::*;
use crate::formats::tracedat::reader::{cpu_time_ranges, read_layout};
use crate::formats::tracedat::testutil::{all_events, two_cpu_trace};
use crate::formats::tracedat::timeshift::{TimeShiftError, TraceCmdSample, trace_cmd_host_time};
use crate::formats::tracedat::writer::FileVersion;
use crate::formats::tracedat::{ShiftMode, SyncSegment};
use vmtsync_core::HostTicks;
use vmtsync_core::mapping::KvmTscMapping;

/// A stand-in guest trace without TIME_SHIFT (the tier-2 tests use real `trace-cmd extract`
/// files): 2 CPUs, raw timestamps from 10^9 on.
fn guest_file(dir: &Path, version: FileVersion) -> PathBuf {
    two_cpu_trace(dir, "guest", version, 0x6e57, (2000, 1_000_000_000, 1_000))
}

/// The samples of CPU `cpu` decoded from a TIME_SHIFT body, independently of the encoder.
fn decode(body: &[u8], cpu: usize) -> (u32, Vec<TraceCmdSample>) {
    let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().unwrap());
    let i64_at = |at: usize| i64::from_le_bytes(body[at..at + 8].try_into().unwrap());
    let flags = u32_at(8);
    let cpus = u32_at(12) as usize;
    let mut at = 16;
    let mut counts = Vec::new();
    let mut starts = Vec::new();
    for _ in 0..cpus {
        let n = u32_at(at) as usize;
        counts.push(n);
        starts.push(at + 4);
        at += 4 + 24 * n;
    }
    let frac_at: usize = at + counts[..cpu].iter().map(|n| 8 * n).sum::<usize>();
    let (n, s) = (counts[cpu], starts[cpu]);
    let v = (0..n)
        .map(|i| TraceCmdSample {
            time: i64_at(s + 8 * i),
            offset: i64_at(s + 8 * (n + i)),
            scaling: i64_at(s + 8 * (2 * n + i)),
            fraction: i64_at(frac_at + 8 * i),
        })
        .collect();
    (flags, v)
}

#[test]
fn attach_adds_a_time_shift_moving_every_event_exactly_and_never_touches_the_input() {
    let dir = tempfile::tempdir().unwrap();
    for version in [FileVersion::V7, FileVersion::V6] {
        let input = guest_file(dir.path(), version);
        let before = std::fs::read(&input).unwrap();
        let layout = read_layout(&input).unwrap();
        let ranges = cpu_time_ranges(&input, &layout).unwrap();
        assert_eq!(
            ranges,
            [
                Some((1_000_000_000, 1_000_000_000 + 1998 * 1000)),
                Some((1_000_001_000, 1_000_000_000 + 1999 * 1000))
            ]
        );
        // Guest ahead of the host by 777 on CPU 0, behind by 5 on CPU 1.
        let shift = TimeShift {
            peer_trace_id: 0xabc,
            mode: ShiftMode::Step,
            cpus: vec![
                vec![SyncSegment::offset_only(HostTicks(0), 777)],
                vec![SyncSegment::offset_only(HostTicks(10), -5)],
            ],
        };
        let out = dir.path().join("out.dat");
        let s = attach_time_shift(&input, &out, &layout, &ranges, &shift, 1).unwrap();
        assert_eq!(std::fs::read(&input).unwrap(), before, "{version:?}");
        assert_eq!((s.guest_trace_id, s.added_trace_id), (0x6e57, false));
        assert_eq!(s.max_error, [0, 0]);
        assert_eq!(
            s.samples,
            [2, 2],
            "one segment and the step sentinel per CPU"
        );
        assert_eq!(all_events(&out), all_events(&input), "{version:?}");
        let l = read_layout(&out).unwrap();
        let body = &l.options_with(option::TIME_SHIFT).last().unwrap().data;
        assert_eq!(u64::from_le_bytes(body[..8].try_into().unwrap()), 0xabc);
        for e in all_events(&out) {
            let (flags, samples) = decode(body, e.cpu as usize);
            let off = if e.cpu == 0 { 777 } else { -5 };
            assert_eq!(
                trace_cmd_host_time(&samples, flags, e.ts),
                Some(e.ts.checked_add_signed(-off).unwrap())
            );
        }
    }
}

#[test]
fn attach_refuses_a_coarse_scaling_an_existing_time_shift_and_its_own_input() {
    let dir = tempfile::tempdir().unwrap();
    let input = guest_file(dir.path(), FileVersion::V7);
    let layout = read_layout(&input).unwrap();
    let ranges = cpu_time_ranges(&input, &layout).unwrap();
    // A guest TSC at 1.25x the host's (Intel 48 fraction bits): trace-cmd's 64-bit product
    // cannot carry it exactly over 10^9 ticks.
    let map = KvmTscMapping::try_new(-1000, 5 << 46, 48).unwrap();
    let seg = SyncSegment {
        start: HostTicks(800_000_000),
        map,
    };
    let shift = TimeShift {
        peer_trace_id: 0,
        mode: ShiftMode::Step,
        cpus: vec![vec![seg], vec![seg]],
    };
    let out = dir.path().join("o.dat");
    match attach_time_shift(&input, &out, &layout, &ranges, &shift, 0) {
        Err(TraceDatError::TimeShift(TimeShiftError::AboveLimit { bound, .. })) => {
            assert!(bound > 0);
        }
        other => panic!("{other:?}"),
    }
    assert!(!out.exists());
    let ok = TimeShift {
        peer_trace_id: 0,
        mode: ShiftMode::Step,
        cpus: vec![vec![SyncSegment::offset_only(HostTicks(0), 1)]; 2],
    };
    assert!(matches!(
        attach_time_shift(&input, &input, &layout, &ranges, &ok, 1),
        Err(TraceDatError::Unsupported { .. })
    ));
    attach_time_shift(&input, &out, &layout, &ranges, &ok, 1).unwrap();
    let l2 = read_layout(&out).unwrap();
    assert!(matches!(
        attach_time_shift(&out, &dir.path().join("o2.dat"), &l2, &ranges, &ok, 1),
        Err(TraceDatError::Unsupported { .. })
    ));
}

#[test]
fn a_compressed_file_keeps_its_compressed_sections_byte_for_byte() {
    let (dir, input) = crate::testutil::temp_file(
        "vmtsync-attach-",
        "z.dat",
        include_bytes!("../reader/fixtures/sample-v7-zstd.dat"),
    );
    let layout = read_layout(&input).unwrap();
    assert_eq!(layout.compression.as_deref(), Some("zstd"));
    let ranges = cpu_time_ranges(&input, &layout).unwrap();
    let shift = TimeShift {
        peer_trace_id: 0,
        mode: ShiftMode::Step,
        cpus: vec![vec![SyncSegment::offset_only(HostTicks(0), 100)]; 2],
    };
    let out = dir.path().join("o.dat");
    let s = attach_time_shift(&input, &out, &layout, &ranges, &shift, 1).unwrap();
    let (a, b) = (std::fs::read(&input).unwrap(), std::fs::read(&out).unwrap());
    // Everything of the input is there unchanged but the last DONE's 8-byte link.
    let link = usize::try_from(layout.options_end).unwrap();
    assert_eq!(a[..link], b[..link]);
    assert_eq!(a[link + 8..], b[link + 8..a.len()]);
    assert_eq!(s.bytes, b.len() as u64);
    assert_eq!(all_events(&out), all_events(&input));
}
