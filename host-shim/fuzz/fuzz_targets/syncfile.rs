//! The sync-file reader (`vmtsync::syncfile`): arbitrary bytes as a sync file, then every
//! vCPU's timeline and conversions through it. A panic is a crash, and so is a timeline that
//! does not map a segment's own anchor (`guest_anchor = host_anchor + offset`, checked by the
//! reader) back to its host anchor, to within the one tick of slope rounding the reader
//! documents, wherever that anchor lies inside the segment's range.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmtsync::syncfile::SyncFile;
use vmtsync_core::GuestTicks;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = SyncFile::parse(data) else {
        return;
    };
    // A few guest ticks from the input itself, besides the segments' own.
    let extra: Vec<u64> = data
        .chunks_exact(8)
        .take(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect();
    for vcpu in file.vcpus() {
        let Ok(timeline) = file.timeline(vcpu) else {
            continue;
        };
        let records = timeline.records();
        for (i, seg) in records.iter().enumerate() {
            let _ = timeline.try_host_from_guest_floor(GuestTicks(seg.guest_start));
            let next_start = records.get(i + 1).map_or(u64::MAX, |n| n.guest_start);
            let host = timeline.try_host_from_guest_floor(GuestTicks(seg.guest_anchor));
            if (seg.guest_start..next_start).contains(&seg.guest_anchor) {
                let host = host.expect("a segment's anchor converts").0;
                assert!(
                    host == seg.host_anchor || host.checked_add(1) == Some(seg.host_anchor),
                    "anchor {} -> {host}, segment says {}",
                    seg.guest_anchor,
                    seg.host_anchor
                );
            }
        }
        for &g in &extra {
            let _ = timeline.try_host_from_guest_floor(GuestTicks(g));
        }
        assert!(timeline.timeline().is_ok());
    }
});
