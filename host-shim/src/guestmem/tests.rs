//! Hostile guest memory over the fake: every case ends in a clear error or exact counts.

use std::sync::{Arc, Mutex};

use proptest::prelude::*;

use super::layout::{HEADER_SIZE, RECORD_SIZE, RING_PREFIX, meta_busy};
use super::*;
use vmtsync_core::recorder::committed;

const BASE: u64 = 0x10_0000;
const MAP_LEN: usize = 1 << 20;
const NONCE: u64 = 0x1234_5678_9abc_def0;

fn header(vcpus: u32, capacity: u64, mode: Mode) -> Header {
    Header {
        nonce: NONCE,
        vcpus,
        capacity,
        tsc_khz: 0,
        mode,
        clock: ClockKind::RawTsc,
        rings_offset: 128,
        ring_stride: RING_PREFIX + RECORD_SIZE * capacity,
        beacon_port: 0,
    }
}

/// A guest's producer, written as the core's `RingRef::record` writes, one store per step, so
/// a test can stop it anywhere (including inside a record).
#[derive(Clone, Debug)]
struct Model {
    ring: u64,
    cap: u64,
    mode: Mode,
    head: u64,
    refused: u64,
    /// Store of the record in progress (0 = none begun).
    step: u8,
}

impl Model {
    fn new(addr: u64, h: &Header, vcpu: u32) -> Self {
        Self {
            ring: addr + h.ring_offset(vcpu),
            cap: h.capacity,
            mode: h.mode,
            head: 0,
            refused: 0,
            step: 0,
        }
    }

    /// The record index `n`'s contents, which a test checks delivered records against.
    /// Every fifth record has an id vmtsync reserves (a beacon's, a span's, …).
    fn id(n: u64) -> u16 {
        let id = if n % 5 == 3 {
            0xFF00 | (n % 0x100)
        } else {
            n % 0xFF00
        };
        u16::try_from(id).unwrap_or(0)
    }

    fn slot(&self, n: u64) -> u64 {
        self.ring + RING_PREFIX + (n & (self.cap - 1)) * RECORD_SIZE
    }

    /// One store of the producer.
    fn step(&mut self, m: &mut FakeMemory) {
        let n = self.head;
        if self.step == 0 && self.mode == Mode::StopWhenFull && n >= self.cap {
            self.refused += 1;
            m.write_u64(self.ring + 8, self.refused);
            return;
        }
        let s = self.slot(n);
        match self.step {
            0 => m.write_u64(s, meta_busy(n)),
            1 => m.write_u64(s + 8, n.wrapping_mul(3)),
            2 => m.write_u64(s + 16, n),
            3 => m.write_u64(s + 24, !n),
            4 => m.write_u64(s, committed(n, Self::id(n), 16)),
            _ => {
                self.head = n + 1;
                m.write_u64(self.ring, self.head);
                self.step = 0;
                return;
            }
        }
        self.step += 1;
    }

    fn record(&mut self, m: &mut FakeMemory) {
        loop {
            let before = (self.head, self.refused);
            self.step(m);
            if (self.head, self.refused) != before {
                return;
            }
        }
    }
}

/// The index the model wrote `r` at: its payload's first word.
fn index_of(r: &GuestRecord) -> u64 {
    u64::from_le_bytes(r.payload[..8].try_into().unwrap_or_default())
}

/// Whether `r` is exactly what the model wrote for its index ([`index_of`]; every other
/// field depends on the index too).
fn intact(r: &GuestRecord) -> bool {
    let n = index_of(r);
    let mut p = [0u8; 16];
    p[..8].copy_from_slice(&n.to_le_bytes());
    p[8..].copy_from_slice(&(!n).to_le_bytes());
    r.id == Model::id(n) && r.tsc == n.wrapping_mul(3) && r.len == 16 && r.payload == p
}

fn publish(m: &mut FakeMemory, addr: u64, h: &Header) {
    m.write(addr, &h.to_bytes());
    for v in 0..h.vcpus {
        m.write_u64(
            addr + h.ring_offset(v) + 16,
            u64::from(h.mode == Mode::Overwrite),
        );
    }
}

fn memory_with(h: &Header) -> FakeMemory {
    let mut m = FakeMemory::new();
    m.map(BASE, MAP_LEN, true);
    publish(&mut m, BASE + 0x4000, h);
    m
}

/// A round's rings cover its records in order, each ring's part non-empty and its own, with
/// its exact extremes.
fn check_round_rings(d: &Drainer) {
    let records = d.round_records();
    let mut at = 0;
    for ring in d.round_rings() {
        assert_eq!(
            ring.records.start, at,
            "the rings cover the records in order"
        );
        let part = &records[ring.records.clone()];
        assert!(!part.is_empty());
        assert!(part.iter().all(|r| r.vcpu == ring.vcpu));
        let reserved: Vec<usize> = ring
            .records
            .clone()
            .filter(|&i| records[i].id >= vmtsync_core::recorder::RESERVED_ID_MIN)
            .collect();
        assert_eq!(
            &d.round_reserved()[ring.reserved.clone()],
            reserved.as_slice()
        );
        assert_eq!(Some(ring.min_tsc), part.iter().map(|r| r.tsc).min());
        assert_eq!(Some(ring.max_tsc), part.iter().map(|r| r.tsc).max());
        at = ring.records.end;
    }
    assert_eq!(at, records.len(), "every record is in a ring's part");
    assert_eq!(
        d.round_rings().last().map_or(0, |r| r.reserved.end),
        d.round_reserved().len(),
        "every reserved index is in a ring's part"
    );
}

fn drain_all(d: &mut Drainer, m: &mut FakeMemory) -> Result<Vec<GuestRecord>, DrainError> {
    let mut out = Vec::new();
    loop {
        let s = d.poll(m, &mut |r| out.push(*r))?;
        check_round_rings(d);
        if !s.more {
            return Ok(out);
        }
    }
}

/// Memory with `h` published at `BASE + 0x4000` and vCPU 0's producer after `records` records.
fn recorded(h: &Header, records: u64) -> (FakeMemory, Model) {
    let mut m = memory_with(h);
    let mut p = Model::new(BASE + 0x4000, h, 0);
    for _ in 0..records {
        p.record(&mut m);
    }
    (m, p)
}

/// A drainer of at most `bound` records a round, of the header a scan finds.
fn scan_drainer(m: &mut FakeMemory, bound: usize) -> Drainer {
    let f = find(m, Location::Scan).expect("found");
    Drainer::new(&f, bound)
}

/// Has the fake run `steps[k]` (cycled) of `producer`'s stores before its `k`-th read; shared
/// with the torn-word tests.
pub(super) fn step_between_reads<P: Send + 'static>(
    m: &mut FakeMemory,
    producer: &Arc<Mutex<P>>,
    steps: Vec<u8>,
    step: fn(&mut P, &mut FakeMemory),
) {
    let hook_producer = Arc::clone(producer);
    let mut k = 0usize;
    m.set_hook(Box::new(move |m| {
        let mut p = hook_producer.lock().unwrap();
        for _ in 0..steps[k % steps.len()] {
            step(&mut p, m);
        }
        k += 1;
    }));
}

#[test]
fn scan_finds_the_one_header_and_drains_exactly() {
    let h = header(2, 64, Mode::Overwrite);
    let mut m = memory_with(&h);
    let mut p0 = Model::new(BASE + 0x4000, &h, 0);
    let mut p1 = Model::new(BASE + 0x4000, &h, 1);
    for _ in 0..10 {
        p0.record(&mut m);
    }
    for _ in 0..200 {
        p1.record(&mut m);
    }
    let f = find(&mut m, Location::Scan).expect("one header");
    assert_eq!(f.addr, BASE + 0x4000);
    assert_eq!(f.header, h);
    let mut d = Drainer::new(&f, 16);
    let got = drain_all(&mut d, &mut m).expect("drains");
    assert!(got.iter().all(intact));
    let c = d.counts();
    assert_eq!((c[0].delivered, c[0].overwritten, c[0].corrupt), (10, 0, 0));
    // Ring 1 holds the last 64 of 200 records, but with head at 200 the producer may be
    // writing record 200 over record 136 already: the reader can vouch for 63.
    assert_eq!(
        (c[1].delivered, c[1].overwritten, c[1].corrupt),
        (63, 137, 0)
    );
    assert_eq!(
        got.iter().filter(|r| r.vcpu == 1).map(index_of).min(),
        Some(137)
    );
}

#[test]
fn a_round_reads_at_most_its_bound() {
    let (mut m, _) = recorded(&header(1, 1024, Mode::StopWhenFull), 1000);
    let mut d = scan_drainer(&mut m, 300);
    let mut n = 0;
    let s = d.poll(&mut m, &mut |_| n += 1).expect("poll");
    assert_eq!((n, s.delivered, s.more), (300, 300, true));
    let rest = drain_all(&mut d, &mut m).expect("drains");
    assert_eq!(rest.len(), 700);
    assert_eq!(d.counts()[0].delivered, 1000);
}

#[test]
fn stop_when_full_reports_the_rings_refused_word() {
    let (mut m, _) = recorded(&header(1, 8, Mode::StopWhenFull), 20);
    let mut d = scan_drainer(&mut m, 64);
    let got = drain_all(&mut d, &mut m).expect("drains");
    assert_eq!(got.len(), 8);
    assert_eq!(d.counts()[0].refused, 12);
    assert_eq!(d.counts()[0].overwritten, 0);
}

#[test]
fn a_fake_header_with_a_bad_checksum_is_named_and_rejected() {
    let h = header(1, 8, Mode::Overwrite);
    let mut m = memory_with(&h);
    // One changed byte (the capacity) without a new checksum.
    m.write(BASE + 0x4000 + 32, &[16]);
    let e = find(&mut m, Location::Scan).expect_err("no valid header");
    let FindError::NotFound { rejected, .. } = &e else {
        panic!("{e}");
    };
    assert!(matches!(
        rejected.as_slice(),
        [(a, Rejected::Header(HeaderError::Checksum { .. }))] if *a == BASE + 0x4000
    ));
    assert!(e.to_string().contains("checksum"), "{e}");
    let e = find(&mut m, Location::HostAddress(BASE + 0x4000)).expect_err("invalid");
    assert!(matches!(
        e,
        FindError::Invalid {
            source: HeaderError::Checksum { .. },
            ..
        }
    ));
}

#[test]
fn capacity_two_to_the_forty_is_refused_even_with_a_good_checksum() {
    let mut h = header(1, 8, Mode::Overwrite);
    h.capacity = 1 << 40;
    let mut m = memory_with(&h);
    let e = find(&mut m, Location::HostAddress(BASE + 0x4000)).expect_err("refused");
    assert!(
        matches!(
            e,
            FindError::Invalid {
                source: HeaderError::Capacity(c),
                ..
            } if c == 1 << 40
        ),
        "{e}"
    );
}

#[test]
fn rings_past_the_mappings_end_are_refused() {
    // 4 rings of 8 Ki records need 1 MiB + a little: more than the mapping has after 0x4000.
    let h = header(4, 8192, Mode::Overwrite);
    let mut m = FakeMemory::new();
    m.map(BASE, MAP_LEN, true);
    m.write(BASE + 0x4000, &h.to_bytes());
    let e = find(&mut m, Location::HostAddress(BASE + 0x4000)).expect_err("too long");
    assert!(
        matches!(e, FindError::RingsOutside { addr, .. } if addr == BASE + 0x4000),
        "{e}"
    );
    let e = find(&mut m, Location::Scan).expect_err("not found");
    assert!(e.to_string().contains("past its mapping"), "{e}");
}

#[test]
fn a_copy_of_the_header_elsewhere_is_an_error_naming_both() {
    let h = header(1, 8, Mode::Overwrite);
    let mut m = memory_with(&h);
    m.map(0x4000_0000, 1 << 16, true);
    publish(&mut m, 0x4000_0040, &h);
    let e = find(&mut m, Location::Scan).expect_err("two");
    assert!(
        matches!(e, FindError::Ambiguous { first, second, count: 2 }
            if first == BASE + 0x4000 && second == 0x4000_0040),
        "{e}"
    );
    let text = e.to_string();
    assert!(
        text.contains("0x104000") && text.contains("0x40000040"),
        "{text}"
    );
    let f = find(&mut m, Location::HostAddress(0x4000_0040)).expect("named");
    assert_eq!(f.addr, 0x4000_0040);
}

/// A recorder's rings are passed over, not read: a header-like copy inside them (a record's
/// bytes, to the scan) is not a second recorder, and the pages past them are read.
#[test]
fn a_recorders_rings_are_not_scanned_for_headers() {
    let (at, len) = (0x2000_0000, 4 << 20);
    let h = header(2, 32_768, Mode::Overwrite);
    let mut m = FakeMemory::new();
    m.map(at, len, true);
    publish(&mut m, at, &h);
    // A copy in the first chunk read (inside ring 0) and one in a later chunk (ring 1).
    for inside in [at + h.ring_offset(0) + 4096, at + h.ring_offset(1) + 4096] {
        publish(&mut m, inside, &header(1, 8, Mode::Overwrite));
    }
    let regions = m.regions().expect("regions");
    let (found, stats) = scan(&mut m, &regions).expect("scan");
    assert_eq!(found.len(), 1, "{stats:?}");
    assert_eq!(found[0].addr, at);
    let unread = (at + h.span()).div_ceil(4096) - (at + (1 << 20)) / 4096;
    assert_eq!(stats.pages_in_recorders, unread);
    assert_eq!(stats.bytes_read, len as u64 - unread * 4096);
    // A second recorder past the first one's rings is still found.
    let after = (at + h.span()).next_multiple_of(4096) + 0x1000;
    publish(&mut m, after, &header(1, 8, Mode::Overwrite));
    let e = find(&mut m, Location::Scan).expect_err("two");
    assert!(
        matches!(e, FindError::Ambiguous { second, .. } if second == after),
        "{e}"
    );
}

#[test]
fn pages_the_page_map_calls_absent_are_not_read() {
    let h = header(1, 8, Mode::Overwrite);
    let mut m = memory_with(&h);
    m.mark_absent(BASE + 0x4000);
    let e = find(&mut m, Location::Scan).expect_err("skipped");
    assert!(matches!(e, FindError::NotFound { .. }), "{e}");
    let regions = m.regions().expect("regions");
    let (_, stats) = scan(&mut m, &regions).expect("scan");
    assert_eq!(stats.pages_skipped, 1);
    assert_eq!(stats.bytes_read, MAP_LEN as u64 - 4096);
    // Without a page map every page is read, and the header is found.
    m.pagemap = false;
    assert_eq!(
        find(&mut m, Location::Scan).expect("found").addr,
        BASE + 0x4000
    );
}

#[test]
fn guest_physical_is_start_plus_address_in_the_mapping_where_the_header_validates() {
    let h = header(1, 8, Mode::Overwrite);
    let mut m = FakeMemory::new();
    m.map(BASE, MAP_LEN, true);
    m.map(0x7000_0000, MAP_LEN, true);
    publish(&mut m, 0x7000_0000 + 0x2_0000, &h);
    let f = find(&mut m, Location::GuestPhysical(0x2_0000)).expect("one mapping validates");
    assert_eq!(f.addr, 0x7000_0000 + 0x2_0000);
    let e = find(&mut m, Location::GuestPhysical(0x3_0000)).expect_err("none");
    assert!(matches!(e, FindError::NoRamMapping { tried: 2, .. }), "{e}");
}

#[test]
fn a_pointer_variable_names_the_header_once_the_guest_sets_it() {
    let h = header(1, 8, Mode::Overwrite);
    let mut m = FakeMemory::new();
    m.map(BASE, MAP_LEN, true);
    let loc = Location::Pointer {
        gpa: 0x1000,
        width: 4,
    };
    // Null: not yet, and the error says so.
    let e = find(&mut m, loc).expect_err("null pointer");
    assert!(
        matches!(
            e,
            FindError::NoPointerTarget {
                tried: 1,
                last: 0,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.not_yet());
    // Set, but nothing published there yet.
    m.write(BASE + 0x1000, &0x2_0000u32.to_le_bytes());
    let e = find(&mut m, loc).expect_err("unpublished");
    assert!(
        matches!(e, FindError::NoPointerTarget { last: 0x2_0000, .. }),
        "{e}"
    );
    publish(&mut m, BASE + 0x2_0000, &h);
    let f = find(&mut m, loc).expect("found through the pointer");
    assert_eq!(f.addr, BASE + 0x2_0000);
    // A pointer out of every mapping is never followed outside it.
    m.write(BASE + 0x1000, &u32::MAX.to_le_bytes());
    assert!(find(&mut m, loc).is_err());
}

/// Drains a few rounds, then lets `change` rewrite the header, and checks the error and
/// that the counts in it are those of the rounds before.
fn drain_then(change: impl FnOnce(&mut FakeMemory, &Header)) -> (DrainError, Vec<GuestRecord>) {
    let h = header(1, 16, Mode::Overwrite);
    let (mut m, mut p) = recorded(&h, 5);
    let mut d = scan_drainer(&mut m, 64);
    let got = drain_all(&mut d, &mut m).expect("drains");
    for _ in 0..5 {
        p.record(&mut m);
    }
    change(&mut m, &h);
    let mut later = Vec::new();
    let e = d
        .poll(&mut m, &mut |r| later.push(*r))
        .expect_err("changed");
    assert!(later.is_empty(), "nothing delivered after the change");
    assert_eq!(e.counts()[0].delivered, 5);
    assert!(got.iter().all(intact));
    (e, got)
}

#[test]
fn a_nonce_change_is_a_restart() {
    let (e, _) = drain_then(|m, h| {
        let mut h2 = *h;
        h2.nonce = 99;
        m.write(BASE + 0x4000, &h2.to_bytes());
    });
    assert!(
        matches!(
            e,
            DrainError::NonceChanged {
                old: NONCE,
                new: 99,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn a_header_that_moves_is_gone_and_found_again_elsewhere() {
    let (e, _) = drain_then(|m, h| {
        m.write(BASE + 0x4000, &[0; HEADER_SIZE]);
        m.write(BASE + 0x8000, &h.to_bytes());
    });
    assert!(
        matches!(e, DrainError::HeaderGone { addr, .. } if addr == BASE + 0x4000),
        "{e}"
    );
    assert!(e.to_string().contains("magic"), "{e}");
}

#[test]
fn changed_geometry_is_an_error() {
    let (e, _) = drain_then(|m, h| {
        let mut h2 = *h;
        h2.capacity = 8;
        h2.ring_stride = RING_PREFIX + RECORD_SIZE * 8;
        m.write(BASE + 0x4000, &h2.to_bytes());
    });
    assert!(matches!(e, DrainError::GeometryChanged { .. }), "{e}");
}

#[test]
fn a_header_changed_during_a_rings_copy_delivers_nothing_of_it() {
    let h = header(1, 16, Mode::Overwrite);
    let (mut m, _) = recorded(&h, 5);
    let mut d = scan_drainer(&mut m, 64);
    // The guest republishes while the reader is between its header check and its copy.
    let mut calls = 0;
    m.set_hook(Box::new(move |m| {
        calls += 1;
        if calls == 3 {
            let mut h2 = h;
            h2.nonce = 7;
            m.write(BASE + 0x4000, &h2.to_bytes());
        }
    }));
    let mut got = 0;
    let e = d.poll(&mut m, &mut |_| got += 1).expect_err("restart");
    assert!(matches!(e, DrainError::NonceChanged { new: 7, .. }), "{e}");
    assert_eq!((got, e.counts()[0].delivered), (0, 0));
}

#[test]
fn a_slot_with_a_wrong_stamp_inside_the_window_is_corrupt_not_delivered() {
    let (mut m, p) = recorded(&header(1, 16, Mode::Overwrite), 6);
    // Slot 2 claims record 18 (a stamp from the future), slot 4 is left BUSY.
    m.write_u64(p.slot(2), committed(18, 1, 0));
    m.write_u64(p.slot(4), meta_busy(4));
    let mut d = scan_drainer(&mut m, 64);
    let got = drain_all(&mut d, &mut m).expect("drains");
    assert_eq!(got.iter().map(index_of).collect::<Vec<_>>(), [0, 1, 3, 5]);
    assert_eq!((d.counts()[0].corrupt, d.counts()[0].overwritten), (2, 0));
}

#[test]
fn a_hostile_head_costs_one_bounded_round_and_an_exact_count() {
    let h = header(1, 16, Mode::Overwrite);
    let mut m = memory_with(&h);
    m.write_u64(BASE + 0x4000 + 128, u64::MAX);
    let mut d = scan_drainer(&mut m, 64);
    let got = drain_all(&mut d, &mut m).expect("drains");
    // Every slot is empty: 15 corrupt; the oldest of them and all before it the guest may
    // have overwritten (head claims it has begun record u64::MAX).
    assert!(got.is_empty());
    let c = d.counts()[0];
    assert_eq!((c.corrupt, c.overwritten), (15, u64::MAX - 15));
    // Then the head goes back: a clear error.
    m.write_u64(BASE + 0x4000 + 128, 3);
    let e = d.poll(&mut m, &mut |_| {}).expect_err("rewound");
    assert!(matches!(e, DrainError::HeadRewound { to: 3, .. }), "{e}");
}

/// Records the guest stores while a round reads wait for the next round, made after the
/// poll interval: they are not "more" (a live guest's head always moves, and polling again
/// at once for them kept a core busy at any rate). More than a round's bound waiting when a
/// round begins is, and so is half a ring unread after it.
#[test]
fn only_a_backlog_past_the_bound_is_more() {
    let (mut m, p) = recorded(&header(1, 1024, Mode::Overwrite), 10);
    let mut d = scan_drainer(&mut m, 300);
    let model = Arc::new(Mutex::new(p));
    step_between_reads(&mut m, &model, vec![3], Model::step);
    let s = d.poll(&mut m, &mut |_| {}).expect("poll");
    let stored = model.lock().unwrap().head;
    assert!(
        stored > d.counts()[0].next,
        "the guest stored during the round"
    );
    assert!(!s.more, "records stored during the round are not more");
    // The guest stops with more than a bound waiting: more, until the reader caught up.
    m.set_hook(Box::new(|_| {}));
    for _ in 0..400 {
        model.lock().unwrap().record(&mut m);
    }
    let s = d.poll(&mut m, &mut |_| {}).expect("poll");
    assert_eq!((s.delivered, s.more), (300, true));
    let rest = drain_all(&mut d, &mut m).expect("drains");
    assert_eq!(d.counts()[0].next, model.lock().unwrap().head);
    assert!(!rest.is_empty());
    // A ring smaller than the bound that is half full again after a round: more (it must
    // not wait a poll interval).
    let (mut m, p) = recorded(&header(1, 8, Mode::Overwrite), 2);
    let mut d = scan_drainer(&mut m, 300);
    let model = Arc::new(Mutex::new(p));
    step_between_reads(&mut m, &model, vec![40], Model::step);
    let s = d.poll(&mut m, &mut |_| {}).expect("poll");
    let unread = model.lock().unwrap().head - d.counts()[0].next;
    assert!(
        unread >= 4,
        "the guest stored half a ring during the round: {unread}"
    );
    assert!(s.more, "half a ring unread after the round is more");
}

#[test]
fn records_rewritten_while_being_read_are_counted_overwritten_exactly() {
    let (mut m, p) = recorded(&header(1, 8, Mode::Overwrite), 8);
    let mut d = scan_drainer(&mut m, 8);
    // Between every 8-byte piece the reader takes, the guest stores 3 words more: it laps
    // the reader inside its copy of the slots.
    m.set_granule(8, 0);
    step_between_reads(&mut m, &Arc::new(Mutex::new(p)), vec![3], Model::step);
    let mut got = Vec::new();
    d.poll(&mut m, &mut |r| got.push(*r)).expect("poll");
    let c = d.counts()[0];
    assert!(got.iter().all(intact));
    assert!(c.overwritten > 0, "the guest lapped the copy");
    assert_eq!(c.delivered + c.overwritten + c.corrupt, c.next);
    assert_eq!(c.corrupt, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// An honest producer stores between (and inside) the reader's reads, in any pattern,
    /// with the reader's pieces taken in a scrambled order: every record delivered is the
    /// one the producer wrote for its index, none is corrupt, and after the producer stops
    /// delivered + overwritten is every record it stored.
    #[test]
    fn an_honest_producer_racing_the_reader_loses_nothing_uncounted(
        cap_log in 1u32..5,
        flight in any::<bool>(),
        steps in proptest::collection::vec(0u8..12, 1..64),
        granule in prop_oneof![Just(0usize), Just(8), Just(24), Just(64)],
        scramble in any::<u64>(),
        bound in 1usize..20,
        rounds in 1usize..30,
    ) {
        let mode = if flight { Mode::Overwrite } else { Mode::StopWhenFull };
        let h = header(1, 1 << cap_log, mode);
        let mut m = memory_with(&h);
        let mut d = scan_drainer(&mut m, bound);
        let model = Arc::new(Mutex::new(Model::new(BASE + 0x4000, &h, 0)));
        m.set_granule(granule, scramble);
        step_between_reads(&mut m, &model, steps, Model::step);
        let mut got = Vec::new();
        for _ in 0..rounds {
            d.poll(&mut m, &mut |r| got.push(*r)).expect("honest producer");
        }
        // The producer stops (it may stand inside a record) and the reader catches up.
        m.set_granule(0, 0);
        m.set_hook(Box::new(|_| {}));
        drain_all(&mut d, &mut m).map(|r| got.extend(r)).expect("drains");
        let p = model.lock().unwrap().clone();
        let c = d.counts()[0];
        prop_assert!(got.iter().all(intact));
        prop_assert!(got.windows(2).all(|w| index_of(&w[0]) < index_of(&w[1])));
        prop_assert_eq!(c.corrupt, 0);
        prop_assert_eq!(c.delivered + c.overwritten, p.head);
        prop_assert_eq!(c.refused, p.refused);
        if !flight {
            prop_assert_eq!(c.overwritten, 0);
        }
    }

    /// Random bytes written anywhere into a published recorder, between any two reads: the
    /// reader ends with Ok or a typed error, and any record it delivers carries its own
    /// index's stamp and a payload length of at most 16.
    #[test]
    fn random_mutations_never_panic_or_deliver_unstamped_records(
        writes in proptest::collection::vec((0u64..0x800, any::<u64>(), 0u8..4), 0..40),
        rounds in 1usize..8,
    ) {
        let (mut m, _) = recorded(&header(2, 8, Mode::Overwrite), 11);
        let base = BASE + 0x4000;
        let mut i = 0usize;
        m.set_hook(Box::new(move |m| {
            if let Some(&(off, v, _)) = writes.get(i) {
                m.write_u64(base + (off & !7), v);
            }
            i += 1;
        }));
        let Ok(f) = find(&mut m, Location::HostAddress(base)) else {
            return Ok(());
        };
        let mut d = Drainer::new(&f, 4);
        for _ in 0..rounds {
            let mut bad = false;
            let r = d.poll(&mut m, &mut |r| bad |= r.len > 16 || r.payload().len() > 16);
            prop_assert!(!bad);
            if r.is_err() {
                break;
            }
        }
        let c = d.counts();
        for ring in c {
            prop_assert!(ring.delivered <= ring.next);
        }
    }
}

/// The fuzz seeds are the core's own recorder bytes (`Recorder<2, 4>` after six events per
/// ring): the reader finds them and counts them exactly as the core's producer stored them.
#[test]
fn the_cores_recorder_bytes_drain_with_exact_counts() {
    for (seed, delivered, overwritten, refused) in [
        (
            &include_bytes!("../../fuzz/seeds/guestmem/flight-lapped")[..],
            3,
            3,
            0,
        ),
        (
            &include_bytes!("../../fuzz/seeds/guestmem/stop-full")[..],
            4,
            0,
            2,
        ),
    ] {
        let image = &seed[2..];
        let mut m = FakeMemory::new();
        m.map(BASE, 4096, true);
        m.write(BASE, image);
        let f = find(&mut m, Location::Scan).expect("the core's header");
        assert_eq!((f.addr, f.header.vcpus, f.header.capacity), (BASE, 2, 4));
        let mut d = Drainer::new(&f, 64);
        let got = drain_all(&mut d, &mut m).expect("drains");
        for c in d.counts() {
            assert_eq!(
                (c.delivered, c.overwritten, c.refused, c.corrupt),
                (delivered, overwritten, refused, 0)
            );
        }
        // Each record's payload is its event number: each ring's come in order, one apart.
        assert!(got.iter().all(|r| r.id == 7 && r.len == 8));
        for vcpu in 0..2 {
            let numbers: Vec<u64> = got
                .iter()
                .filter(|r| r.vcpu == vcpu)
                .map(index_of)
                .collect();
            assert!(numbers.windows(2).all(|w| w[1] == w[0] + 1), "{numbers:?}");
        }
    }
}
