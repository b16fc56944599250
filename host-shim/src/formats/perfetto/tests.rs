use super::*;
use crate::formats::{Bound, Payload};
use prost::Message;

#[derive(Clone, PartialEq, Message)]
struct Trace {
    #[prost(message, repeated, tag = "1")]
    packet: Vec<TracePacket>,
}

fn clock() -> BootClock {
    let s = |tsc, ns| ClockSnapshot {
        tsc,
        boottime_ns: ns,
        resolution: 0,
    };
    // 2 ticks per ns, BOOTTIME 1 s at TSC 0.
    BootClock::new(vec![s(0, 1_000_000_000), s(2_000_000, 1_001_000_000)]).unwrap()
}

/// A guest named `vm` on machine `machine_id`, on [`clock`].
fn options(machine_id: u32) -> PerfettoOptions {
    PerfettoOptions {
        machine_id,
        guest_name: "vm".into(),
        clock: clock(),
    }
}

#[test]
fn events_land_on_their_vcpu_tracks_in_boottime() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.perfetto-trace");
    let mut w = PerfettoWriter::create(&path, options(2)).unwrap();
    // The last one earlier than its vCPU's previous event.
    let pushed = [
        (0, 7, 1000),
        (1, 7, 2000),
        (0, 7, 3000),
        (0, 9, 4000),
        (0, 7, 2500),
    ];
    for (vcpu, id, host) in pushed {
        w.push(&ExportEvent {
            vcpu,
            id,
            guest_tsc: Some(host + 5),
            host_tsc: host,
            bound: Some(Bound {
                lo: host - 10,
                hi: host + 10,
            }),
            payload: Payload::new(if id == 9 { &[0xab, 0x01] } else { &[] }).unwrap(),
        })
        .unwrap();
    }
    let s = w.finish().unwrap();
    assert_eq!((s.events, s.vcpus, s.unmappable), (5, 2, 0));
    // Readable by the user's tools like any other trace, not tempfile's 0600.
    crate::atomic_file::assert_output_mode(&path);
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes.len() as u64, s.bytes);
    let t = Trace::decode(bytes.as_slice()).unwrap();
    let events: Vec<&TracePacket> = t
        .packet
        .iter()
        .filter(|p| p.track_event.is_some())
        .collect();
    assert_eq!(events.len(), 5);
    assert_eq!(
        boottimes(&t.packet),
        [
            1_000_000_500,
            1_000_001_000,
            1_000_001_500,
            1_000_002_000,
            1_000_001_250
        ]
    );
    // Deltas on the incremental clock, and BOOTTIME itself for the one going back.
    let raw: Vec<(u64, Option<u32>)> = events
        .iter()
        .map(|p| (p.timestamp.unwrap(), p.timestamp_clock_id))
        .collect();
    assert_eq!(
        raw,
        [
            (0, None),
            (0, None),
            (1000, None),
            (500, None),
            (1_000_001_250, Some(proto::CLOCK_BOOTTIME))
        ]
    );
    // Names interned once per vCPU sequence: vCPU 0 interns 7 then 9, vCPU 1 interns 7.
    let interned: Vec<(u32, u64)> = events
        .iter()
        .filter_map(|p| {
            let d = p.interned_data.as_ref()?;
            Some((p.trusted_packet_sequence_id?, d.event_names[0].iid?))
        })
        .collect();
    assert_eq!(interned, [(2, 8), (3, 8), (2, 10)]);
    let last = events[3].track_event.as_ref().unwrap();
    assert_eq!(
        last.debug_annotations
            .last()
            .unwrap()
            .string_value
            .as_deref(),
        Some("ab01")
    );
    // The bound is widened by one ns of rounding each way: [3990, 4010] ticks → ns, as
    // distances from the timestamp, 1_000_002_000.
    let arg = |name: &str| {
        let iid = proto::ANNOTATIONS.iter().position(|n| *n == name).unwrap() as u64 + 1;
        let d = last
            .debug_annotations
            .iter()
            .find(|d| d.name_iid == Some(iid))?;
        d.uint_value
            .or(d.int_value.and_then(|v| u64::try_from(v).ok()))
    };
    assert_eq!(arg("before_ns"), Some(1_000_002_000 - (1_000_001_995 - 1)));
    assert_eq!(arg("after_ns"), Some(1_000_002_005 + 1 - 1_000_002_000));
    assert_eq!(arg("guest_tsc"), Some(4005));
    // The id is in the name alone (no argument): `event 9`, interned on the event's sequence.
    let name = events
        .iter()
        .filter(|p| p.trusted_packet_sequence_id == events[3].trusted_packet_sequence_id)
        .filter_map(|p| p.interned_data.as_ref())
        .flat_map(|d| &d.event_names)
        .find(|n| n.iid == last.name_iid)
        .and_then(|n| n.name.as_deref());
    assert_eq!(name, Some("event 9"));
    assert_eq!(last.debug_annotations.len(), 5, "{last:?}");
    assert_eq!(s.host_tsc_range, Some((1000, 4000)));
    // Every guest packet is on the guest machine.
    assert!(
        t.packet
            .iter()
            .filter(|p| p.track_event.is_some() || p.track_descriptor.is_some())
            .all(|p| p.machine_id == Some(2))
    );
}

/// The events' BOOTTIME, replaying Perfetto's rule: a packet on a sequence's incremental
/// clock adds its timestamp to the clock's value, which a snapshot sets.
fn boottimes(packets: &[TracePacket]) -> Vec<u64> {
    let mut clocks = std::collections::HashMap::new();
    let mut out = Vec::new();
    for p in packets {
        let seq = p.trusted_packet_sequence_id.unwrap();
        if let Some(s) = &p.clock_snapshot {
            for c in &s.clocks {
                if c.clock_id == Some(proto::CLOCK_EVENT_DELTA) {
                    assert_eq!(c.is_incremental, Some(true));
                    clocks.insert(seq, c.timestamp.unwrap());
                }
            }
        }
        if p.track_event.is_some() {
            let ts = p.timestamp.unwrap();
            if p.timestamp_clock_id == Some(proto::CLOCK_BOOTTIME) {
                out.push(ts);
            } else {
                let c = clocks.get_mut(&seq).unwrap();
                *c += ts;
                out.push(*c);
            }
        }
    }
    out
}

#[test]
fn machine_zero_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let r = PerfettoWriter::create(&dir.path().join("t"), options(0));
    assert!(matches!(r, Err(PerfettoError::HostMachineId)));
}

#[test]
fn vcpu_numbers_cannot_collide_or_grow_without_bound() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t");
    let mut w = PerfettoWriter::create(&path, options(1)).unwrap();
    let ev = |vcpu| ExportEvent {
        vcpu,
        id: 1,
        guest_tsc: None,
        host_tsc: 1000,
        bound: None,
        payload: Payload::default(),
    };
    // Numbers that would meet in a sequence id or uuid derived from the number itself.
    for vcpu in [u32::MAX, u32::MAX - 1, 0x8_0000, 0] {
        w.push(&ev(vcpu)).unwrap();
    }
    for vcpu in 1..u32::try_from(MAX_VCPUS - 3).unwrap() {
        w.push(&ev(vcpu)).unwrap();
    }
    assert!(matches!(
        w.push(&ev(7_777_777)),
        Err(PerfettoError::TooManyVcpus { vcpu: 7_777_777 })
    ));
    let s = w.finish().unwrap();
    assert_eq!(s.vcpus as usize, MAX_VCPUS);
    let t = Trace::decode(std::fs::read(&path).unwrap().as_slice()).unwrap();
    let mut uuids: Vec<u64> = t
        .packet
        .iter()
        .filter_map(|p| p.track_descriptor.as_ref()?.uuid)
        .collect();
    let n = uuids.len();
    uuids.sort_unstable();
    uuids.dedup();
    assert_eq!(
        (n, uuids.len()),
        (MAX_VCPUS + 1, MAX_VCPUS + 1),
        "unique tracks"
    );
}
