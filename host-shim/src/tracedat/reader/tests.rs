use proptest::prelude::*;

use super::*;
use crate::tracedat::writer::{FileVersion, TraceDatWriter, WriterOptions};

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
        v7 in any::<bool>(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let mut bytes = sample(if v7 { FileVersion::V7 } else { FileVersion::V6 });
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
        }
    }
}
