use super::*;
use crate::formats::tracedat::reader::read_layout;
use crate::formats::tracedat::testutil::{all_events, two_cpu_trace};
use crate::formats::tracedat::writer::FileVersion;

/// A stand-in host trace written by our own writer (the tier-2 tests use a real one).
fn host_file(dir: &Path, version: FileVersion) -> PathBuf {
    two_cpu_trace(dir, "host", version, 0xfeed, (1000, 1_000, 10))
}

fn guest() -> GuestInfo {
    GuestInfo {
        name: "agent".into(),
        trace_id: 0xabc,
        vcpu_pids: vec![(0, 4242), (1, 4243)],
    }
}

#[test]
fn copy_adds_guest_keeps_data_and_never_touches_the_input() {
    let dir = tempfile::tempdir().unwrap();
    for version in [FileVersion::V7, FileVersion::V6] {
        let input = host_file(dir.path(), version);
        let before = std::fs::read(&input).unwrap();
        let out = dir.path().join("out.dat");
        let s = copy_host_trace(&input, &out, &guest(), None).unwrap();
        crate::atomic_file::assert_output_mode(&out);
        assert_eq!(std::fs::read(&input).unwrap(), before, "{version:?}");
        assert_eq!((s.host_trace_id, s.added_trace_id), (0xfeed, false));
        let l = read_layout(&out).unwrap();
        let g = l.options_with(option::GUEST).last().unwrap();
        assert_eq!(g.data, guest_option(&guest()));
        assert_eq!(all_events(&out), all_events(&input), "{version:?}");
        // A different requested id is added after the old one, which the reader then uses.
        let s = copy_host_trace(&input, &out, &guest(), Some(7)).unwrap();
        assert!(s.added_trace_id);
        assert_eq!(read_layout(&out).unwrap().trace_id(), Some(7));
    }
}

#[test]
fn copy_refuses_to_overwrite_its_input_and_bad_vcpu_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let input = host_file(dir.path(), FileVersion::V7);
    assert!(matches!(
        copy_host_trace(&input, &input, &guest(), None),
        Err(TraceDatError::Unsupported { .. })
    ));
    let mut g = guest();
    g.vcpu_pids[1].0 = 5;
    assert!(matches!(
        copy_host_trace(&input, &dir.path().join("o.dat"), &g, None),
        Err(TraceDatError::Unsupported { .. })
    ));
}

#[test]
fn a_truncated_host_trace_is_refused_with_an_offset() {
    let dir = tempfile::tempdir().unwrap();
    let input = host_file(dir.path(), FileVersion::V7);
    let full = std::fs::read(&input).unwrap();
    let cut = dir.path().join("cut.dat");
    std::fs::write(&cut, &full[..full.len() - 3]).unwrap();
    let out = dir.path().join("o.dat");
    assert!(matches!(
        copy_host_trace(&cut, &out, &guest(), None),
        Err(TraceDatError::Parse { .. })
    ));
    assert!(!out.exists());
}
