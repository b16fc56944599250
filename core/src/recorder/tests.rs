// Test data is built from small loop indices: truncation is intended.
#![allow(clippy::cast_possible_truncation)]

extern crate std;
use core::cell::{Cell, RefCell};
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::vec::Vec;

use super::*;
use crate::arch::{FakeTsc, Tsc};
use proptest::prelude::*;

/// An event id for sequence number `n`, below the ids vmtsync reserves.
#[allow(clippy::cast_possible_truncation)]
fn id_of(n: u64) -> u16 {
    (n % u64::from(RESERVED_ID_MIN)) as u16
}

#[test]
fn a_full_ring_counts_every_refused_event_exactly() {
    let ring = Ring::<4>::new();
    let ring = ring.view();
    let tsc = FakeTsc::new(100, 1);
    for i in 0..4 {
        ring.record(&tsc, i, &[]).unwrap();
    }
    for _ in 0..10 {
        assert_eq!(ring.record(&tsc, 9, &[1]), Err(RecordError::Full));
    }
    assert_eq!((ring.len(), ring.refused(), ring.dropped()), (4, 10, 10));
    let ids: Vec<u16> = core::iter::from_fn(|| ring.pop()).map(|r| r.id).collect();
    assert_eq!(ids, [0, 1, 2, 3]);
    // Freed slots are reused; refused events get no index.
    ring.record(&tsc, 5, &[]).unwrap();
    assert_eq!(ring.end(), 5);
    assert_eq!(ring.pop().map(|r| r.id), Some(5));
}

#[test]
fn payloads_round_trip_and_overlong_ones_are_refused_uncounted() {
    let ring = Ring::<2>::new();
    let ring = ring.view();
    let tsc = FakeTsc::new(7, 3);
    let p: [u8; 16] = core::array::from_fn(|i| i as u8 + 1);
    ring.record(&tsc, 0xbeef, &p).unwrap();
    assert_eq!(
        ring.record(&tsc, 1, &[0; 17]),
        Err(RecordError::PayloadTooLong)
    );
    assert_eq!(ring.dropped(), 0);
    let r = ring.pop().unwrap();
    assert_eq!((r.id, r.payload(), r.tsc.0 > 0), (0xbeef, &p[..], true));
    assert_eq!(ring.pop(), None);
}

#[test]
fn the_recorder_names_its_vcpus() {
    static R: Recorder<2, 8> = Recorder::new();
    let tsc = FakeTsc::new(1, 1);
    assert!(R.ring(2).is_none(), "no ring 2");
    R.ring(1).unwrap().record(&tsc, 1, &[]).unwrap();
    assert_eq!((R.ring(0).unwrap().len(), R.ring(1).unwrap().len()), (0, 1));
}

#[test]
fn a_ring_hands_out_one_producer_at_a_time() {
    static R: Recorder<2, 8> = Recorder::new_flight();
    let tsc = FakeTsc::new(1, 1);
    let p = R.producer(1).expect("ring 1's producer");
    assert!(R.producer(1).is_none(), "a second producer of ring 1");
    assert!(R.producer(2).is_none(), "no ring 2");
    p.record(&tsc, 3, &[1]).unwrap();
    assert_eq!(p.ring().len(), 1);
    drop(p);
    // Given back: a later producer of the same ring continues its sequence.
    let p = R.producer(1).expect("claimable again");
    p.record(&tsc, 4, &[]).unwrap();
    assert_eq!(
        (R.ring(1).unwrap().end(), R.ring(1).unwrap().mode()),
        (2, Mode::Overwrite)
    );
    assert!(R.producer(0).is_some());
}

#[test]
fn reads_by_index_leave_records_until_released() {
    let ring = Ring::<2>::new();
    let ring = ring.view();
    let tsc = FakeTsc::new(1, 1);
    ring.record(&tsc, 3, &[]).unwrap();
    assert_eq!(ring.read(0).map(|r| r.id), Ok(3));
    assert_eq!(ring.read(1), Err(ReadError::NotYet));
    assert_eq!(ring.len(), 1);
    ring.release(1);
    assert!(ring.is_empty());
    // Releasing beyond what is stored stops at the end.
    ring.release(9);
    assert_eq!(ring.start(), 1);
}

#[test]
fn a_flight_ring_keeps_the_newest_and_counts_the_overwritten_once() {
    let ring = Ring::<4>::new_flight();
    let ring = ring.view();
    let tsc = FakeTsc::new(0, 1);
    for i in 0..10u8 {
        ring.record(&tsc, u16::from(i), &[i]).unwrap();
    }
    assert_eq!((ring.len(), ring.refused(), ring.overwritten()), (4, 0, 0));
    assert_eq!(ring.read(5), Err(ReadError::Overwritten));
    // The consumer had handed on records 0 and 1 (say, in a batch whose send then failed):
    // skipping from 2 counts 2..6 as overwritten, not 0 and 1.
    let next = ring.skip(2, 2);
    assert_eq!((next, ring.overwritten(), ring.start()), (6, 4, 6));
    let ids: Vec<u16> = core::iter::from_fn(|| ring.pop()).map(|r| r.id).collect();
    assert_eq!(ids, [6, 7, 8, 9]);
    assert_eq!(ring.overwritten(), 4);
    // Popping across a lap counts the records in between, once.
    for i in 10..20u8 {
        ring.record(&tsc, u16::from(i), &[i]).unwrap();
    }
    assert_eq!(ring.pop().map(|r| r.id), Some(16));
    assert_eq!(ring.overwritten(), 4 + 6);
}

proptest! {
    /// Against a model queue: any interleaving of records and pops keeps order, loses
    /// nothing that was not counted as refused, and never exceeds the capacity.
    #[test]
    fn matches_a_model_queue(ops in proptest::collection::vec((any::<bool>(), 0..RESERVED_ID_MIN, any::<u8>()), 0..400)) {
        let ring = Ring::<8>::new();
        let ring = ring.view();
        let tsc = FakeTsc::new(10, 5);
        let mut model = std::collections::VecDeque::new();
        let mut refused = 0u64;
        for (push, id, len) in ops {
            if push {
                let len = usize::from(len % 17);
                let payload: Vec<u8> = (0..len).map(|i| id as u8 ^ i as u8).collect();
                match ring.record(&tsc, id, &payload) {
                    Ok(()) => model.push_back((id, payload)),
                    Err(RecordError::Full) => {
                        prop_assert_eq!(model.len(), 8);
                        refused += 1;
                    }
                    Err(e) => prop_assert!(false, "{:?}", e),
                }
            } else {
                let got = ring.pop().map(|r| (r.id, r.payload().to_vec()));
                prop_assert_eq!(got, model.pop_front());
            }
            prop_assert_eq!(ring.len(), model.len());
            prop_assert_eq!(ring.dropped(), refused);
        }
    }

    /// A flight ring against a model that evicts its oldest entry when full: every pop gives
    /// the model's oldest, and by then every eviction before it is counted, exactly once.
    #[test]
    fn a_flight_ring_matches_an_evicting_model(ops in proptest::collection::vec(0u8..4, 0..600)) {
        let ring = Ring::<8>::new_flight();
        let ring = ring.view();
        let tsc = FakeTsc::new(10, 5);
        let mut model = std::collections::VecDeque::new();
        let (mut next, mut evicted) = (0u64, 0u64);
        for op in ops {
            if op == 0 {
                prop_assert_eq!(ring.pop().map(|r| r.tsc.0), model.pop_front());
                prop_assert_eq!(ring.overwritten(), evicted);
            } else {
                let t = tsc.read_ordered();
                tsc.advance(0);
                let _ = t;
                ring.record(&tsc, id_of(next), &next.to_le_bytes()).unwrap();
                // The fake TSC stepped once inside `record`: that read is the stamp.
                model.push_back(t + 5);
                if model.len() > 8 {
                    model.pop_front();
                    evicted += 1;
                }
                next += 1;
            }
            prop_assert_eq!(ring.len(), model.len());
        }
    }
}

/// A record whose every word derives from its index, so a torn one shows.
fn check_intact(r: &Record) -> u64 {
    let seq = r.tsc.0;
    let lo = u64::from_le_bytes(r.data[..8].try_into().unwrap());
    let hi = u64::from_le_bytes(r.data[8..].try_into().unwrap());
    assert_eq!(
        (r.id, r.len, lo, hi),
        (
            id_of(seq),
            16,
            seq,
            !seq.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ),
        "torn record"
    );
    seq
}

/// The producer's clock in the stress tests: the record's index, as the TSC.
struct Counter(AtomicU64);
impl Tsc for Counter {
    fn read_ordered(&self) -> u64 {
        self.0.fetch_add(1, Ordering::Relaxed)
    }
}

fn produce<const CAP: usize>(ring: &Ring<CAP>, n: u64, done: &AtomicBool) -> u64 {
    let tsc = Counter(AtomicU64::new(0));
    let p = ring.view().producer().expect("the test's one producer");
    let mut stored = 0;
    for seq in 0..n {
        let mut payload = [0u8; 16];
        payload[..8].copy_from_slice(&seq.to_le_bytes());
        payload[8..].copy_from_slice(&(!seq.wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes());
        // The counter must match `seq`: a refused event still read the clock.
        if p.record(&tsc, id_of(seq), &payload).is_ok() {
            stored += 1;
        } else {
            tsc.0.store(seq + 1, Ordering::Relaxed);
        }
    }
    done.store(true, Ordering::Release);
    stored
}

/// A producer thread laps a consumer thread in a flight ring many times: every record the
/// consumer gets is intact (each word derived from its index) and in order, and
/// popped + overwritten = produced, exactly.
#[test]
fn a_lapping_producer_never_hands_the_consumer_a_torn_record() {
    static RING: Ring<64> = Ring::new_flight();
    static DONE: AtomicBool = AtomicBool::new(false);
    const N: u64 = 1_000_000;
    let consumer = std::thread::spawn(|| {
        let (mut popped, mut last) = (0u64, None);
        loop {
            let finished = DONE.load(Ordering::Acquire);
            match RING.view().pop() {
                Some(r) => {
                    let seq = check_intact(&r);
                    assert!(last.is_none_or(|l| seq > l), "{seq} after {last:?}");
                    last = Some(seq);
                    popped += 1;
                }
                None if finished && RING.view().start() == RING.view().end() => return popped,
                None => std::thread::yield_now(),
            }
        }
    });
    let stored = produce(&RING, N, &DONE);
    let popped = consumer.join().unwrap();
    assert_eq!(stored, N, "a flight ring is never full");
    assert_eq!(popped + RING.view().overwritten(), N);
    assert!(
        RING.view().overwritten() > 0,
        "the producer never lapped the consumer"
    );
}

/// The same race through the agent's way of consuming (read a run of indices, then release
/// or skip), stop-when-full: nothing is overwritten, popped + refused = produced.
#[test]
fn a_stop_when_full_ring_under_the_same_race_only_refuses() {
    static RING: Ring<64> = Ring::new();
    static DONE: AtomicBool = AtomicBool::new(false);
    const N: u64 = 500_000;
    let consumer = std::thread::spawn(|| {
        let mut got = 0u64;
        loop {
            let finished = DONE.load(Ordering::Acquire);
            let start = RING.view().start();
            let mut at = start;
            while let Ok(r) = RING.read(at) {
                check_intact(&r);
                at += 1;
            }
            got += at - start;
            RING.release(at);
            if at == start {
                if finished && RING.view().start() == RING.view().end() {
                    return got;
                }
                std::thread::yield_now();
            }
        }
    });
    let stored = produce(&RING, N, &DONE);
    let got = consumer.join().unwrap();
    assert_eq!((got, RING.view().overwritten()), (stored, 0));
    assert_eq!(got + RING.view().refused(), N);
}

#[test]
fn a_mem_recorder_has_the_bytes_of_the_const_one() {
    use std::vec;
    static R: Recorder<3, 8> = Recorder::new_flight();
    let storage: Vec<Slot> = (0..MemRecorder::storage_slots(3, 8).unwrap() + 1)
        .map(|_| Slot::new())
        .collect();
    // A Vec<Slot> is 32-aligned; skip to a 64-byte boundary like a C buffer would be.
    let skip = usize::from(!(storage.as_ptr() as usize).is_multiple_of(64));
    let m = MemRecorder::init(&storage[skip..], 3, 8, Mode::Overwrite).unwrap();
    assert_eq!(
        MemRecorder::init(&storage[skip..skip + 10], 3, 8, Mode::Overwrite).unwrap_err(),
        LayoutError::TooSmall
    );
    assert_eq!(
        MemRecorder::init(&storage[1 - skip..], 3, 8, Mode::Overwrite).unwrap_err(),
        LayoutError::Misaligned
    );
    assert_eq!(
        MemRecorder::storage_slots(3, 12),
        None,
        "capacity not a power of two"
    );
    let info = HeaderInfo {
        nonce: 0x1234,
        tsc_khz: 2_000_000,
        clock: ClockKind::RawTsc,
        beacon_port: 0x510,
    };
    assert_eq!(R.header().magic, 0, "unpublished in the image");
    let h = R.publish(&info);
    assert_eq!(m.publish(&info), h);
    // What the guest gets back is never a whole valid header (no second copy in its
    // memory); the stored one is.
    assert_eq!(h.magic, 0);
    assert!(!h.is_valid());
    assert_eq!(R.header(), h.published());
    assert!(R.header().is_valid());
    for (v, n) in [(0usize, 3u32), (2, 11)] {
        let tsc = FakeTsc::new(100, 7);
        for i in 0..n {
            R.ring(v)
                .unwrap()
                .record(&tsc, 5, &i.to_le_bytes())
                .unwrap();
        }
        let tsc = FakeTsc::new(100, 7);
        for i in 0..n {
            m.ring(v)
                .unwrap()
                .record(&tsc, 5, &i.to_le_bytes())
                .unwrap();
        }
    }
    let size = MemRecorder::storage_bytes(3, 8).unwrap();
    assert_eq!(size, core::mem::size_of::<Recorder<3, 8>>());
    let (mut a, mut b) = (vec![0u8; size], vec![0u8; size]);
    assert_eq!((R.copy_bytes(&mut a), m.copy_bytes(&mut b)), (size, size));
    assert_eq!(a, b);
    assert_eq!(&a[..8], b"VMTSRING");
}

/// A reader outside the guest, written from docs/memory-layout.md over byte snapshots (not
/// the host's code and not this crate's layout code): what it concludes about one ring.
#[derive(Debug, Default)]
struct Drained {
    /// Valid records: (index, id, len, tsc, payload words).
    valid: Vec<(u64, u16, u8, u64, u64, u64)>,
    /// Records counted lost because the producer may have overwritten them.
    overwritten: u64,
    /// Records counted lost because their slot did not hold them whole.
    corrupt: u64,
    /// The index to read from next time.
    next: u64,
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// The header fields a reader needs, after checking magic and checksum: (vcpus, capacity,
/// rings offset, stride).
fn header_of(snap: &[u8]) -> Option<(u64, u64, u64, u64)> {
    const CRC: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
    let h = snap.get(..128)?;
    let sum = u32::from_le_bytes(h[120..124].try_into().unwrap());
    (&h[..8] == b"VMTSRING" && CRC.checksum(&h[..120]) == sum).then(|| {
        let vcpus = u64::from(u32::from_le_bytes(h[24..28].try_into().unwrap()));
        (vcpus, le64(h, 32), le64(h, 56), le64(h, 64))
    })
}

/// The reading rule for ring `r`: head `h1` from snapshot `a`, the slots from `b`, head
/// `h2` from `c` (snapshots taken in that order), records from `next` on.
fn drain(a: &[u8], b: &[u8], c: &[u8], r: u64, next: u64) -> Drained {
    let (vcpus, cap, off, stride) = header_of(a).expect("a valid header");
    assert!(r < vcpus);
    let ring = usize::try_from(off + r * stride).unwrap();
    let (h1, h2) = (le64(a, ring), le64(c, ring));
    // Stop-when-full: the producer reuses slot n only after the in-guest consumer released
    // record n (tail > n), so a tail read with h2 that is still at most n keeps n safe.
    let stop_when_full = b[ring + 16] == 0;
    let t2 = le64(c, ring + 64);
    let from = next.max(h1.saturating_sub(cap));
    let mut d = Drained {
        // Records below the oldest one a ring of `cap` can still hold are gone.
        overwritten: from - next.min(from),
        next: h1.max(next),
        ..Drained::default()
    };
    for n in from..h1 {
        let slot = ring + 128 + 32 * usize::try_from(n % cap).unwrap();
        let meta = le64(b, slot);
        let (id, len) = ((meta & 0xffff) as u16, ((meta >> 16) & 0xff) as u8);
        let stamp_ok = meta >> 25 == (n + 1) & ((1 << 39) - 1) && meta & (1 << 24) == 0;
        let not_reused = h2 < n + cap || (stop_when_full && t2 <= n);
        if not_reused && stamp_ok && len <= 16 {
            let words = (le64(b, slot + 8), le64(b, slot + 16), le64(b, slot + 24));
            d.valid.push((n, id, len, words.0, words.1, words.2));
        } else if !not_reused {
            d.overwritten += 1;
        } else {
            d.corrupt += 1;
        }
    }
    d
}

/// 64-byte aligned storage for a `MemRecorder` of this shape: the Vec and the offset of the
/// first aligned slot.
pub(super) fn aligned_storage(vcpus: usize, cap: usize) -> (Vec<Slot>, usize) {
    let n = MemRecorder::storage_slots(vcpus, cap).unwrap() + 1;
    let v: Vec<Slot> = (0..n).map(|_| Slot::new()).collect();
    let skip = usize::from(!(v.as_ptr() as usize).is_multiple_of(64));
    (v, skip)
}

fn snapshot(m: &MemRecorder<'_>) -> Vec<u8> {
    let mut out = std::vec![0u8; MemRecorder::storage_bytes(m.vcpus(), m.capacity()).unwrap()];
    assert_eq!(m.copy_bytes(&mut out), out.len());
    out
}

/// A TSC that counts, and takes a snapshot of the recorder on one chosen read: that read
/// happens inside `record`, between the slot's BUSY store and its data stores, so the
/// snapshot holds a record half written.
struct SnapTsc<'a> {
    reads: Cell<u64>,
    snap_on: Option<u64>,
    rec: MemRecorder<'a>,
    snap: RefCell<Option<Vec<u8>>>,
}

impl Tsc for SnapTsc<'_> {
    fn read_ordered(&self) -> u64 {
        let n = self.reads.get();
        self.reads.set(n + 1);
        if self.snap_on == Some(n) {
            *self.snap.borrow_mut() = Some(snapshot(&self.rec));
        }
        1000 + n
    }
}

proptest! {
    /// Rounds of: produce, snapshot A, produce, snapshot B (possibly in the middle of a
    /// record), produce, snapshot C, drain by the reading rule. Every record the reader
    /// accepts is exactly the one produced at its index, none is accepted twice, and every
    /// stored record is either accepted or counted lost: exactly, in both modes. A flight
    /// ring's losses are all overwrites; nothing is ever corrupt in a snapshot, and a
    /// stop-when-full ring loses nothing and counts every refused event.
    #[test]
    fn a_reader_of_the_bytes_sees_every_record_exactly_or_counts_it_lost(
        flight in any::<bool>(),
        cap_log in 1u32..5,
        rounds in proptest::collection::vec((0u64..40, 0u64..40, 0u64..40, any::<bool>()), 1..12),
    ) {
        let cap = 1usize << cap_log;
        let mode = if flight { Mode::Overwrite } else { Mode::StopWhenFull };
        let (storage, skip) = aligned_storage(2, cap);
        let m = MemRecorder::init(&storage[skip..], 2, cap, mode).unwrap();
        m.publish(&HeaderInfo { nonce: 9, tsc_khz: 0, clock: ClockKind::RawTsc, beacon_port: 0 });
        let mut tsc = SnapTsc { reads: Cell::new(0), snap_on: None, rec: m, snap: RefCell::new(None) };
        let (mut attempts, mut next, mut seen) = (0u64, 0u64, std::collections::BTreeSet::new());
        let (mut overwritten, mut corrupt) = (0u64, 0u64);
        // Ring 1 is produced into as well, so the reader must find ring 0 by the stride.
        let mut produce = |k: u64, tsc: &SnapTsc<'_>| {
            for _ in 0..k {
                let n = attempts;
                attempts += 1;
                let _ = m.ring(0).unwrap().record(tsc, id_of(n), &n.to_le_bytes());
                let _ = m.ring(1).unwrap().record(tsc, 7, &[1, 2, 3]);
            }
        };
        for (a, b, c, torn) in rounds {
            produce(a, &tsc);
            let sa = snapshot(&m);
            // With `torn`, snapshot B is taken by the TSC read of the next record.
            tsc.snap_on = torn.then(|| tsc.reads.get());
            produce(b.max(u64::from(torn)), &tsc);
            let sb = tsc.snap.borrow_mut().take().unwrap_or_else(|| snapshot(&m));
            produce(c, &tsc);
            let sc = snapshot(&m);
            let d = drain(&sa, &sb, &sc, 0, next);
            for &(n, id, len, _tsc, lo, hi) in &d.valid {
                prop_assert!(seen.insert(n), "record {} accepted twice", n);
                // Stop-when-full stores the first `cap` attempts; the stored record at index
                // n is attempt n either way (refused attempts get no index).
                prop_assert_eq!((id, len, lo, hi), (id_of(n), 8, n, 0));
            }
            overwritten += d.overwritten;
            corrupt += d.corrupt;
            next = d.next;
        }
        let ring = m.ring(0).unwrap();
        prop_assert_eq!(corrupt, 0, "whole snapshots of a single producer are never torn");
        prop_assert_eq!(seen.len() as u64 + overwritten, next, "every record up to the last h1");
        if flight {
            prop_assert_eq!(ring.refused(), 0);
        } else {
            prop_assert_eq!(overwritten, 0, "a stop-when-full ring without a consumer overwrites nothing");
            prop_assert_eq!(ring.end() + ring.refused(), attempts);
        }
    }
}

/// A producer thread laps a reader that copies the bytes word by word while they change:
/// every record the reading rule accepts is intact and at its index, and accepted plus
/// counted lost is every record, exactly.
#[test]
fn a_reader_of_live_bytes_never_accepts_a_torn_record() {
    const CAP: usize = 64;
    const N: u64 = 300_000;
    let (storage, skip) = aligned_storage(1, CAP);
    let storage: &'static [Slot] = Vec::leak(storage);
    let m = MemRecorder::init(&storage[skip..], 1, CAP, Mode::Overwrite).unwrap();
    m.publish(&HeaderInfo {
        nonce: 1,
        tsc_khz: 0,
        clock: ClockKind::Other,
        beacon_port: 0,
    });
    static DONE: AtomicBool = AtomicBool::new(false);
    let producer = std::thread::spawn(move || {
        let tsc = Counter(AtomicU64::new(0));
        let p = m.producer(0).unwrap();
        for seq in 0..N {
            let mut payload = [0u8; 16];
            payload[..8].copy_from_slice(&seq.to_le_bytes());
            payload[8..].copy_from_slice(&(!seq).to_le_bytes());
            p.record(&tsc, id_of(seq), &payload).unwrap();
        }
        DONE.store(true, Ordering::Release);
    });
    let (mut next, mut valid, mut lost) = (0u64, 0u64, 0u64);
    loop {
        let finished = DONE.load(Ordering::Acquire);
        let a = snapshot(&m);
        let b = snapshot(&m);
        let c = snapshot(&m);
        let d = drain(&a, &b, &c, 0, next);
        for &(n, id, len, tsc, lo, hi) in &d.valid {
            assert_eq!(
                (id, len, tsc, lo, hi),
                (id_of(n), 16, n, n, !n),
                "record {n}"
            );
        }
        valid += d.valid.len() as u64;
        lost += d.overwritten + d.corrupt;
        next = d.next;
        if finished && next == N {
            break;
        }
    }
    producer.join().unwrap();
    assert_eq!(valid + lost, N);
    assert!(lost > 0, "the producer never lapped the reader");
    assert!(valid > 0, "the reader never kept up");
}

/// A beacon is, in this order: an `in` from the port, the record's TSC read, the `out` of
/// the sequence number's low byte; its record has the reserved id and the sequence number,
/// and the sequence goes on across a refused record.
#[test]
fn a_beacon_is_in_then_its_record_then_out() {
    use crate::arch::{FakePorts, PortAccess};
    struct MarkingTsc<'a>(&'a FakePorts, Cell<u64>);
    impl Tsc for MarkingTsc<'_> {
        fn read_ordered(&self) -> u64 {
            self.0.mark(0x75c);
            self.1.set(self.1.get() + 10);
            self.1.get()
        }
    }
    static R: Recorder<1, 2> = Recorder::new();
    let ports = FakePorts::new();
    let tsc = MarkingTsc(&ports, Cell::new(0));
    let beacon = || -> Result<u64, RecordError> {
        let port = R.beacon_port().ok_or(RecordError::NoBeaconPort)?;
        R.ring(0).unwrap().beacon(&tsc, &ports, port)
    };
    assert_eq!(beacon(), Err(RecordError::NoBeaconPort));
    assert!(ports.accesses().is_empty(), "no port, no exits");
    R.publish(&HeaderInfo {
        nonce: 3,
        tsc_khz: 1,
        clock: ClockKind::Other,
        beacon_port: 0x2400,
    });
    assert_eq!(beacon(), Ok(0));
    assert_eq!(beacon(), Ok(1));
    // The ring (capacity 2) is full: the third beacon's exits still happen, numbered 2.
    assert_eq!(beacon(), Err(RecordError::Full));
    let mut expected = Vec::new();
    for seq in 0..3u8 {
        expected.push(PortAccess::In {
            port: 0x2400,
            // FakePorts reads 0xff from a port with nothing behind it, like QEMU.
            value: 0xff,
        });
        if seq < 2 {
            expected.push(PortAccess::Mark(0x75c));
        }
        expected.push(PortAccess::Out {
            port: 0x2400,
            value: seq,
        });
    }
    assert_eq!(ports.accesses().as_slice(), expected.as_slice());
    let ring = R.ring(0).unwrap();
    assert_eq!((ring.beacons(), ring.refused()), (3, 1));
    for seq in 0..2u64 {
        let r = ring.read(seq).unwrap();
        assert_eq!(
            (r.id, r.payload(), r.tsc.0),
            (BEACON_ID, &seq.to_le_bytes()[..], 10 * (seq + 1))
        );
    }
}

/// Ids from `RESERVED_ID_MIN` are vmtsync's (a beacon's record is the beacon's alone): a
/// record with one is refused with nothing stored or counted; a beacon still stores its own.
#[test]
fn reserved_ids_are_refused_and_a_beacon_keeps_its_own() {
    let ring = Ring::<4>::new();
    let ring = ring.view();
    let tsc = FakeTsc::new(10, 5);
    for id in [RESERVED_ID_MIN, BEACON_ID] {
        assert_eq!(ring.record(&tsc, id, &[]), Err(RecordError::ReservedId));
    }
    assert_eq!((ring.len(), ring.refused()), (0, 0));
    ring.record(&tsc, RESERVED_ID_MIN - 1, &[]).unwrap();
    let ports = crate::arch::FakePorts::new();
    assert_eq!(ring.beacon(&tsc, &ports, 0x2400), Ok(0));
    assert_eq!(ring.pop().map(|r| r.id), Some(RESERVED_ID_MIN - 1));
    assert_eq!(ring.pop().map(|r| r.id), Some(BEACON_ID));
}
