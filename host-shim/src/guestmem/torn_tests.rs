//! The reading rule against torn 64-bit words: the host copies guest memory atomically per
//! byte only, so each of its loads of a word (head, tail, a meta stamp, the beacon count,
//! refused) may return any byte-wise mix of the values the word held during the load. A
//! producer is simulated store by store, as a 64-bit guest stores (one 8-byte store per word)
//! and as the C recorder on i386 stores (32-bit halves; a count's carry into its high half
//! through one 8-byte `lock cmpxchg8b`; docs/c-abi.md), with its counters started just below
//! byte and 32-bit carries. The fake memory serves every read one byte at a time, in a
//! scrambled order, with producer stores between the bytes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use proptest::prelude::*;

use super::layout::{HEADER_SIZE, RECORD_SIZE, RING_PREFIX, meta_busy};
use super::*;
use vmtsync_core::recorder::committed;

const BASE: u64 = 0x20_0000;
const AT: u64 = BASE + 0x1000;
const NONCE: u64 = 0x0bad_cafe_f00d_0001;

/// One store the guest makes: `bytes` at `addr`, all at once.
type Store = (u64, Vec<u8>);

/// How the simulated producer stores its words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Width {
    /// One 8-byte store per word (x86_64).
    Bits64,
    /// The C recorder on i386: see `vmtsync.h`'s `vmtsync_store_*_` functions.
    Bits32,
}

/// A producer that stores one ring, one store per step.
#[derive(Debug)]
struct Producer {
    ring: u64,
    cap: u64,
    flight: bool,
    width: Width,
    head: u64,
    tail: u64,
    refused: u64,
    beacons: u64,
    /// Stores of the operation under way, front first.
    queue: std::collections::VecDeque<Store>,
    /// What each record index was written with: (id, tsc, len, payload).
    written: HashMap<u64, (u16, u64, u8, [u8; 16])>,
    /// What to do next, cycled: 0..=5 records, 6 a beacon count.
    plan: Vec<u8>,
    k: usize,
}

/// Record `n`'s contents: a pure function of the index, so any mix-up shows.
fn contents(n: u64) -> (u16, u64, u8, [u8; 16]) {
    let len = u8::try_from(n % 17).unwrap_or(0);
    let mut p = [0u8; 16];
    for (i, b) in p.iter_mut().enumerate().take(usize::from(len)) {
        *b = u8::try_from((n.wrapping_mul(31) >> (i % 8 * 8)) & 0xff).unwrap_or(0)
            ^ u8::try_from(i).unwrap_or(0);
    }
    let id = u16::try_from(n % 0xff00).unwrap_or(0);
    (id, n.wrapping_mul(0x9e37_79b9).rotate_left(17), len, p)
}

impl Producer {
    /// A producer whose ring has already stored `head` records (the last `cap` of them in
    /// their slots) and counted `refused` and `beacons`, as if it had run that far.
    #[allow(clippy::too_many_arguments)]
    fn new(
        m: &mut FakeMemory,
        h: &Header,
        width: Width,
        head: u64,
        refused: u64,
        beacons: u64,
        plan: Vec<u8>,
    ) -> Self {
        let flight = h.mode == Mode::Overwrite;
        let mut p = Self {
            ring: AT + h.ring_offset(0),
            cap: h.capacity,
            flight,
            width,
            head,
            // A stop-when-full ring that stored `head` records has room only if an in-guest
            // consumer released them: it did, all of them.
            tail: if flight { 0 } else { head },
            refused,
            beacons,
            queue: std::collections::VecDeque::new(),
            written: HashMap::new(),
            plan,
            k: 0,
        };
        for n in head.saturating_sub(p.cap)..head {
            let (id, tsc, len, payload) = contents(n);
            let s = p.slot(n);
            m.write_u64(s, committed(n, id, len));
            m.write_u64(s + 8, tsc);
            m.write(s + 16, &payload);
            p.written.insert(n, contents(n));
        }
        m.write_u64(p.ring, head);
        m.write_u64(p.ring + 8, refused);
        m.write_u64(p.ring + 16, u64::from(flight));
        m.write_u64(p.ring + 24, beacons);
        m.write_u64(p.ring + 64, p.tail);
        p
    }

    fn slot(&self, n: u64) -> u64 {
        self.ring + RING_PREFIX + (n & (self.cap - 1)) * RECORD_SIZE
    }

    /// The stores that set a data word (any order of halves: the rule never trusts a slot
    /// that may be under way).
    fn data(&self, addr: u64, v: u64) -> Vec<Store> {
        let b = v.to_le_bytes();
        match self.width {
            Width::Bits64 => vec![(addr, b.to_vec())],
            Width::Bits32 => vec![(addr, b[..4].to_vec()), (addr + 4, b[4..].to_vec())],
        }
    }

    /// The store that adds one to the count at `addr` (now `old`).
    fn inc(&self, addr: u64, old: u64) -> Store {
        let new = old.wrapping_add(1);
        let b = new.to_le_bytes();
        match self.width {
            // i386: the low half alone unless it wraps; then one 8-byte cmpxchg8b.
            Width::Bits32 if new & 0xffff_ffff != 0 => (addr, b[..4].to_vec()),
            _ => (addr, b.to_vec()),
        }
    }

    /// Queues the next operation's stores.
    fn plan_next(&mut self) {
        let what = self.plan[self.k % self.plan.len()];
        self.k += 1;
        if what == 6 {
            let st = self.inc(self.ring + 24, self.beacons);
            self.beacons += 1;
            self.queue.push_back(st);
            return;
        }
        let n = self.head;
        if !self.flight && n - self.tail >= self.cap {
            let st = self.inc(self.ring + 8, self.refused);
            self.refused += 1;
            self.queue.push_back(st);
            return;
        }
        let s = self.slot(n);
        let (id, tsc, len, payload) = contents(n);
        let busy = meta_busy(n).to_le_bytes();
        match self.width {
            Width::Bits64 => self.queue.push_back((s, busy.to_vec())),
            // Low half first: the in-between state carries BUSY.
            Width::Bits32 => {
                self.queue.push_back((s, busy[..4].to_vec()));
                self.queue.push_back((s + 4, busy[4..].to_vec()));
            }
        }
        let mut lo = [0u8; 8];
        let mut hi = [0u8; 8];
        lo.copy_from_slice(&payload[..8]);
        hi.copy_from_slice(&payload[8..]);
        let mut words = self.data(s + 16, u64::from_le_bytes(lo));
        words.extend(self.data(s + 24, u64::from_le_bytes(hi)));
        words.extend(self.data(s + 8, tsc));
        self.queue.extend(words);
        let commit = committed(n, id, len).to_le_bytes();
        self.queue.push_back(match self.width {
            Width::Bits64 => (s, commit.to_vec()),
            // The high halves of BUSY and commit are equal: one 32-bit store.
            Width::Bits32 => (s, commit[..4].to_vec()),
        });
        self.queue.push_back(self.inc(self.ring, n));
        self.head += 1;
        self.written.insert(n, (id, tsc, len, payload));
    }

    /// One guest store.
    fn step(&mut self, m: &mut FakeMemory) {
        if self.queue.is_empty() {
            self.plan_next();
        }
        if let Some((addr, bytes)) = self.queue.pop_front() {
            m.write(addr, &bytes);
        }
    }

    /// Finishes the operation under way (the guest stops between operations).
    fn settle(&mut self, m: &mut FakeMemory) {
        while let Some((addr, bytes)) = self.queue.pop_front() {
            m.write(addr, &bytes);
        }
    }
}

fn header(capacity: u64, mode: Mode) -> Header {
    Header {
        nonce: NONCE,
        vcpus: 1,
        capacity,
        tsc_khz: 0,
        mode,
        clock: ClockKind::RawTsc,
        rings_offset: HEADER_SIZE as u64,
        ring_stride: RING_PREFIX + RECORD_SIZE * capacity,
        beacon_port: 0,
    }
}

/// Counters just below a carry of their low byte, of their low 32 bits, of 40 bits, or at 0.
fn near_carry() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        (0xf0u64..=0xff),
        (0xffff_fff0u64..=0xffff_ffff),
        (0xff_ffff_fff0u64..=0xff_ffff_ffff),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    /// Torn loads of every word, a 32-bit or 64-bit producer, counters at carries: every
    /// record delivered is exactly one the producer wrote for its index, none twice, none
    /// corrupt, the reader never errs, its beacon and refused counts are never above the
    /// guest's, and once the producer stops delivered + overwritten is every record stored.
    #[test]
    fn torn_words_never_deliver_a_wrong_record_or_lose_count(
        cap_log in 1u32..5,
        flight in any::<bool>(),
        bits32 in any::<bool>(),
        head in near_carry(),
        refused in near_carry(),
        beacons in near_carry(),
        plan in proptest::collection::vec(0u8..7, 1..16),
        steps in proptest::collection::vec(0u8..6, 1..48),
        scramble in any::<u64>(),
        bound in 1usize..24,
        rounds in 1usize..24,
    ) {
        let mode = if flight { Mode::Overwrite } else { Mode::StopWhenFull };
        let h = header(1 << cap_log, mode);
        let mut m = FakeMemory::new();
        m.map(BASE, 1 << 16, true);
        m.write(AT, &h.to_bytes());
        let width = if bits32 { Width::Bits32 } else { Width::Bits64 };
        let p = Producer::new(&mut m, &h, width, head, refused, beacons, plan);
        let f = find(&mut m, Location::HostAddress(AT)).expect("the header");
        let p = Arc::new(Mutex::new(p));
        // Every read one byte at a time, in a scrambled order, guest stores between bytes.
        m.set_granule(1, scramble);
        super::tests::step_between_reads(&mut m, &p, steps, Producer::step);
        let mut d = Drainer::new(&f, bound);
        let mut got = Vec::new();
        for _ in 0..rounds {
            let r = d.poll(&mut m, &mut |r| got.push(*r));
            prop_assert!(r.is_ok(), "an honest producer: {:?}", r.err());
            let g = p.lock().unwrap();
            let c = d.counts()[0];
            prop_assert!(c.beacons <= g.beacons, "beacons {} > {}", c.beacons, g.beacons);
            prop_assert!(c.refused <= g.refused, "refused {} > {}", c.refused, g.refused);
        }
        // The producer stops between two operations; the reader catches up.
        m.set_granule(0, 0);
        m.set_hook(Box::new(|_| {}));
        p.lock().unwrap().settle(&mut m);
        loop {
            let s = d.poll(&mut m, &mut |r| got.push(*r));
            prop_assert!(s.is_ok(), "{:?}", s.err());
            if !s.unwrap().more {
                break;
            }
        }
        let g = p.lock().unwrap();
        // Each record's index, from what the producer wrote: its clock is a bijection of the
        // index (`contents`), so a record is found by it, not by the reader's word.
        let index: HashMap<u64, u64> = g.written.iter().map(|(&n, w)| (w.1, n)).collect();
        let mut at = Vec::with_capacity(got.len());
        for r in &got {
            let n = index.get(&r.tsc).copied();
            prop_assert_eq!(
                n.and_then(|n| g.written.get(&n)),
                Some(&(r.id, r.tsc, r.len, r.payload)),
                "record {:?} is not what the producer wrote", r
            );
            at.extend(n);
        }
        prop_assert!(at.windows(2).all(|w| w[0] < w[1]), "delivered twice or out of order");
        let c = d.counts()[0];
        prop_assert_eq!(c.corrupt, 0);
        prop_assert_eq!(c.delivered + c.overwritten, g.head);
        prop_assert_eq!(c.refused, g.refused);
        prop_assert_eq!(c.beacons, g.beacons);
    }
}
