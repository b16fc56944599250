//! Sync beacons: brackets for a guest's clock readings with no request and no reply.
//!
//! Beacon `s` of one recorder ring is, in the guest's program order (docs/memory-layout.md,
//! "Beacons"): `in` from the beacon port, the record's clock read, `out` of `s mod 256` to the
//! port, then the ring's beacon count becomes `s + 1`. The host never asks for a beacon, so no
//! send time bounds its exits; what bounds them instead is what the host sees of the ring and
//! the order the guest's own code imposes (docs/memory-reader.md, "Beacon brackets"):
//!
//! - a host read of the ring that saw the count at `c` or above was taken after `out` of every
//!   beacon below `c` (the count is stored after the `out`, and a guest instruction after an
//!   exiting one runs only after the exit), and a trace read after it holds their exits;
//! - beacon `c0 + 2`, where `c0` is the count of the first read after the trace started, began
//!   after that read (its `in` follows the exit of beacon `c0 + 1`'s `out`, whose handling makes
//!   the guest's store of the count `c0 + 1`, which that read did not see, visible first).
//!
//! From there a chain, one beacon at a time, of exits each no later than the next beacon's own:
//! `L(s)` is the earliest `in` of the port after `from(s)`, `X(s)` the earliest `out` that can
//! carry `s mod 256` after `L(s)`, and `from(s + 1) = X(s)`. Beacon `s`'s own `in` comes after
//! `from(s)` (induction), so `L(s) <= in(s)`; its own `out` comes after `L(s)`, so
//! `X(s) <= out(s) < in(s + 1)`. The upper end `U(s)` is the latest `out` that can carry
//! `s mod 256` before the host time `P(s)` taken after the first read that saw the count above
//! `s`: beacon `s`'s own `out` is one of them. Every exit of every traced thread counts, so
//! no other access, by any vCPU, can move `L(s)` later or `U(s)` earlier: extra accesses can
//! only widen a bracket. Exits the kernel lost break the chain for good (a missing exit could
//! be the one that bounds); the chain then says so and brackets nothing more.

use std::collections::BTreeMap;

use super::PioExit;
use super::matching::{Touch, touch};
use crate::ftrace::format::PioDirection;

/// One beacon's host bracket: `lo <= host time of its clock read <= hi` (host TSC).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BeaconBracket {
    /// The beacon's sequence number.
    pub seq: u64,
    /// `L(s)`: an `in` of the port no later than the beacon's own.
    pub lo: u64,
    /// `U(s)`: an `out` of the port no earlier than the beacon's own.
    pub hi: u64,
}

/// Why a chain stopped bracketing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainBroken {
    /// The kernel lost `kvm_pio` events, or more exits waited than are kept: an exit that
    /// would bound a beacon may be missing.
    TraceLost,
    /// The ring's count says beacon `seq` was done, but the trace holds no `in` (or no
    /// `out`) of the port where its own must be: the trace missed it, or the guest's count
    /// is not its beacons'.
    Missing {
        /// The beacon.
        seq: u64,
    },
    /// The ring's count went down.
    CountRewound {
        /// The count before.
        from: u64,
        /// The count read now.
        to: u64,
    },
}

impl ChainBroken {
    /// What happened, in words.
    #[must_use]
    pub fn describe(&self) -> String {
        match self {
            Self::TraceLost => "kvm_pio events were lost while recording".into(),
            Self::Missing { seq } => format!(
                "beacon {seq} is counted done but the trace holds no exit of the port where its own must be"
            ),
            Self::CountRewound { from, to } => {
                format!("the ring's beacon count went from {from} down to {to}")
            }
        }
    }
}

/// Beacons bracketed at most this far ahead of their records (bounds memory whatever the
/// ring's count says).
pub const MAX_WAITING: usize = 4096;

/// One ring's chain of beacon brackets (see the module docs).
#[derive(Clone, Debug)]
pub struct BeaconChain {
    port: u16,
    /// The next beacon to bracket, and a host time no later than its `in`; `None` before
    /// the first read after the trace started.
    next: Option<(u64, u64)>,
    /// The first beacon the chain can bracket (since its last start).
    first: Option<u64>,
    /// The first beacon of its first start: beacons before it began before the trace could
    /// see them whole.
    first_ever: Option<u64>,
    /// The count at the last read.
    count: u64,
    /// Before the first bracket: the beacon whose `out` starts the chain (the first
    /// read's count + 1), and the host time of that read.
    base: Option<(u64, u64)>,
    /// Brackets made, waiting for their beacon's record (oldest dropped first).
    made: BTreeMap<u64, BeaconBracket>,
    broken: Option<ChainBroken>,
}

impl BeaconChain {
    /// A chain for beacons on `port`.
    #[must_use]
    pub fn new(port: u16) -> Self {
        Self {
            port,
            next: None,
            first: None,
            first_ever: None,
            count: 0,
            base: None,
            made: BTreeMap::new(),
            broken: None,
        }
    }

    /// A chain for beacons on `port` whose every exit came after host time `since`: the
    /// caller observed that the guest had not run yet then (its VMM was paused, and the
    /// trace was already running). The chain then brackets from beacon 0, with `since` as
    /// the lower limit of beacon 0's `in`, instead of two beacons past its first read.
    #[must_use]
    pub fn armed_since(port: u16, since: u64) -> Self {
        let mut c = Self::new(port);
        c.next = Some((0, since));
        c.first = Some(0);
        c.first_ever = Some(0);
        c
    }

    /// The first beacon the chain brackets (`None` before the first read).
    #[must_use]
    pub const fn first(&self) -> Option<u64> {
        self.first
    }

    /// Why the chain stopped, if it did.
    #[must_use]
    pub const fn broken(&self) -> Option<ChainBroken> {
        self.broken
    }

    /// Stops the chain (the caller saw the trace lose exits).
    pub fn break_off(&mut self, why: ChainBroken) {
        self.broken.get_or_insert(why);
        self.made.clear();
    }

    /// The earliest host time an exit the chain still needs can have: exits before it may
    /// be forgotten (`None`: it needs none, it is broken).
    #[must_use]
    pub fn needs_from(&self) -> Option<u64> {
        if self.broken.is_some() {
            return None;
        }
        self.next.map(|(_, from)| from)
    }

    /// Whether beacon `seq` began before the trace could see it whole (before the chain's
    /// first start).
    #[must_use]
    pub fn is_early(&self, seq: u64) -> bool {
        self.first_ever.is_some_and(|f| seq < f)
    }

    /// Starts the chain again from the next read, as a new one starts (the beacons done or
    /// begun by then get no bracket): a ring whose beacons stopped holds old exits no other
    /// chain needs. Brackets made stay.
    pub fn restart(&mut self) {
        if self.broken.is_none() {
            self.next = None;
            self.base = None;
        }
    }

    /// One read of the ring: its beacon count was `count`, read after host time `before`
    /// and before host time `after`, and `exits` (every traced thread's, time-ordered) were
    /// read from the trace after that read. The first call must come after the trace started.
    /// Brackets every beacon the count says is done.
    pub fn observe(&mut self, count: u64, before: u64, after: u64, exits: &[PioExit]) {
        if self.broken.is_some() {
            return;
        }
        if count < self.count {
            self.break_off(ChainBroken::CountRewound {
                from: self.count,
                to: count,
            });
            return;
        }
        self.count = count;
        let (mut seq, mut from) = match self.next {
            Some(n) => n,
            None => {
                // Beacon count + 2 began after this read (see the module docs); count + 1 is
                // not used, to rest on an exit's handling rather than on when KVM stamps it.
                let first = count.saturating_add(2);
                self.first = Some(first);
                self.first_ever.get_or_insert(first);
                self.next = Some((first, before));
                self.base = Some((count.saturating_add(1), before));
                return;
            }
        };
        // Beacon `first - 1`'s `out` came after this read (its own `in` exit, after the count
        // store the read did not see, lies between), so the earliest `out` that can carry its
        // number after the read is no later than it, and before beacon `first`'s `in`.
        if let Some((b, read)) = self.base
            && b < count
        {
            #[allow(clippy::cast_possible_truncation)]
            let byte = b as u8;
            let x = exits.iter().find(|e| {
                e.ts >= read
                    && match touch(e, self.port, PioDirection::Out) {
                        Touch::Byte(v) => v == byte,
                        Touch::Unknown(_) => true,
                        Touch::None => false,
                    }
            });
            let Some(x) = x else {
                self.break_off(ChainBroken::Missing { seq: b });
                return;
            };
            from = from.max(x.ts);
            self.base = None;
        }
        // Each beacon due has two kept exits of its own at or after `from`: a count that
        // claims more than the trace holds is not its beacons' (or the trace missed them).
        let start = exits.partition_point(|e| e.ts < from);
        let due = count.saturating_sub(seq);
        if due > 0 && due.saturating_mul(2) > (exits.len() - start) as u64 {
            self.break_off(ChainBroken::Missing { seq });
            return;
        }
        // Exits up to `after`, the upper ends' limit.
        let upto = exits.partition_point(|e| e.ts <= after);
        let mut i = start;
        debug_assert!(
            exits.windows(2).all(|w| w[0].ts <= w[1].ts),
            "exits in time order"
        );
        while seq < count {
            #[allow(clippy::cast_possible_truncation)]
            let byte = seq as u8;
            let carries = |e: &PioExit| match touch(e, self.port, PioDirection::Out) {
                Touch::Byte(v) => v == byte,
                Touch::Unknown(_) => true,
                Touch::None => false,
            };
            // `exits` is in time order: the first match is the earliest, the last the latest.
            let lo = exits[i..]
                .iter()
                .position(|e| e.ts >= from && touch(e, self.port, PioDirection::In) != Touch::None)
                .map(|k| i + k);
            let Some(lo) = lo else {
                self.break_off(ChainBroken::Missing { seq });
                return;
            };
            let x = exits[lo..].iter().position(carries).map(|k| lo + k);
            let hi = exits[lo..upto.max(lo)]
                .iter()
                .rposition(carries)
                .map(|k| lo + k);
            let (Some(x), Some(hi)) = (x, hi) else {
                self.break_off(ChainBroken::Missing { seq });
                return;
            };
            if self.made.len() >= MAX_WAITING {
                self.made.pop_first();
            }
            self.made.insert(
                seq,
                BeaconBracket {
                    seq,
                    lo: exits[lo].ts,
                    hi: exits[hi].ts,
                },
            );
            from = exits[x].ts;
            i = exits.partition_point(|e| e.ts < from);
            seq += 1;
        }
        self.next = Some((seq, from));
    }

    /// The bracket of beacon `seq`, taken out of the chain (each record uses its own once).
    pub fn take(&mut self, seq: u64) -> Option<BeaconBracket> {
        self.made.remove(&seq)
    }

    /// Whether beacon `seq` can still get a bracket (it is not before the chain's first and
    /// the chain is not broken): its record waits for one.
    #[must_use]
    pub fn may_bracket(&self, seq: u64) -> bool {
        self.broken.is_none() && self.first.is_some_and(|f| seq >= f)
    }

    /// Whether beacon `seq`'s bracket is due: the count passed it (then [`Self::take`] has
    /// it, or it was dropped).
    #[must_use]
    pub fn is_due(&self, seq: u64) -> bool {
        self.next.is_some_and(|(n, _)| seq < n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ftrace::format::KvmPio;
    use proptest::prelude::*;

    const PORT: u16 = 0x2400;

    fn pio(ts: u64, pid: u32, direction: PioDirection, val: u8) -> PioExit {
        PioExit {
            ts,
            pio: KvmPio {
                pid,
                direction,
                port: PORT,
                size: 1,
                count: 1,
                val: u32::from(val),
            },
        }
    }

    /// The exits of beacons `seqs` on thread 1, the k-th of them in at `200 + 100k` and out
    /// (the beacon's number's low byte) 50 later.
    fn beacons(seqs: std::ops::RangeInclusive<u8>) -> Vec<PioExit> {
        let mut exits = Vec::new();
        for (k, s) in seqs.enumerate() {
            let t = 200 + 100 * k as u64;
            exits.push(pio(t, 1, PioDirection::In, 0));
            exits.push(pio(t + 50, 1, PioDirection::Out, s));
        }
        exits
    }

    #[test]
    fn a_chain_starts_two_beacons_past_the_first_count_and_brackets_each_beacon() {
        let mut c = BeaconChain::new(PORT);
        // First read: count 5; beacons 5 and 6 may have begun before, 7 on are bracketed.
        c.observe(5, 100, 110, &[]);
        assert_eq!(c.first(), Some(7));
        assert!(!c.may_bracket(6) && c.may_bracket(7));
        // Beacons 5..=8 happen: in at 200 + 100k, out at 250 + 100k.
        c.observe(9, 700, 710, &beacons(5..=8));
        // The chain starts after beacon 6's `out` (the first `out` of 6 after the first
        // read), so beacon 7's bracket is its own exits.
        assert_eq!(
            c.take(7),
            Some(BeaconBracket {
                seq: 7,
                lo: 400,
                hi: 450
            })
        );
        assert_eq!(
            c.take(8),
            Some(BeaconBracket {
                seq: 8,
                lo: 500,
                hi: 550
            })
        );
        assert_eq!(c.take(8), None);
        assert!(c.is_due(8) && !c.is_due(9));
    }

    #[test]
    fn a_chain_armed_before_the_guest_ran_brackets_from_beacon_zero() {
        // The trace ran from 100 on, before the guest's first instruction; the first read,
        // at 700, already sees 3 beacons done.
        let mut c = BeaconChain::armed_since(PORT, 100);
        assert_eq!(c.needs_from(), Some(100));
        assert!(c.may_bracket(0) && !c.is_early(0));
        let exits = beacons(0..=2);
        c.observe(3, 700, 710, &exits);
        for s in 0..3u64 {
            assert_eq!(
                c.take(s),
                Some(BeaconBracket {
                    seq: s,
                    lo: 200 + 100 * s,
                    hi: 250 + 100 * s
                })
            );
        }
        // An exit before the arming time is not this guest's beacon: it cannot lower a bound.
        let mut c = BeaconChain::armed_since(PORT, 150);
        let early = [pio(120, 1, PioDirection::In, 0)];
        let all: Vec<PioExit> = early.iter().copied().chain(exits.iter().copied()).collect();
        c.observe(1, 700, 710, &all);
        assert_eq!(c.take(0).map(|b| b.lo), Some(200));
    }

    #[test]
    fn a_count_without_exits_breaks_the_chain_for_good() {
        let mut c = BeaconChain::new(PORT);
        c.observe(0, 0, 1, &[]);
        c.observe(3, 10, 11, &[pio(5, 1, PioDirection::In, 0)]);
        assert_eq!(c.broken(), Some(ChainBroken::Missing { seq: 1 }));
        assert!(!c.may_bracket(5));
        let mut c = BeaconChain::new(PORT);
        c.observe(4, 0, 1, &[]);
        c.observe(3, 10, 11, &[]);
        assert_eq!(
            c.broken(),
            Some(ChainBroken::CountRewound { from: 4, to: 3 })
        );
    }

    /// What one guest step does on the port, besides beacons.
    #[derive(Clone, Debug)]
    enum Extra {
        In,
        Out(u8),
        Wide,
    }

    fn extra() -> impl Strategy<Value = Extra> {
        prop_oneof![
            Just(Extra::In),
            any::<u8>().prop_map(Extra::Out),
            Just(Extra::Wide)
        ]
    }

    proptest! {
        /// A guest that beacons in order on one or two vCPUs' rings, with any other accesses
        /// to the port (by any thread) anywhere, read by the host at random moments: every
        /// bracket the chain makes holds its beacon's read.
        #[test]
        fn every_bracket_holds_its_beacons_read(
            steps in proptest::collection::vec((0u8..4, extra(), 0u8..3), 1..200),
        ) {
            // One ring's beacons: exits of the beacon (thread 1) and extras (threads 1, 2).
            let mut exits = Vec::new();
            let mut reads: Vec<(u64, u64)> = Vec::new(); // (count, host time)
            let mut truth = BTreeMap::new();
            let mut t = 10u64;
            let mut seq = 0u64;
            for (kind, x, pid) in &steps {
                t += 7;
                match kind {
                    0 => {
                        // A beacon: in, read, out.
                        exits.push(pio(t, 1, PioDirection::In, 0));
                        truth.insert(seq, t + 2);
                        #[allow(clippy::cast_possible_truncation)]
                        exits.push(pio(t + 4, 1, PioDirection::Out, seq as u8));
                        seq += 1;
                        t += 5;
                    }
                    1 => reads.push((seq, t)),
                    _ => {
                        let mut e = match x {
                            Extra::In => pio(t, u32::from(*pid), PioDirection::In, 0),
                            Extra::Out(v) => pio(t, u32::from(*pid), PioDirection::Out, *v),
                            Extra::Wide => {
                                let mut e = pio(t, u32::from(*pid), PioDirection::Out, 0);
                                e.pio.size = 4;
                                e.pio.val = 0xdead_beef;
                                e
                            }
                        };
                        if matches!(x, Extra::Wide) && *pid == 2 {
                            e.pio.direction = PioDirection::In;
                        }
                        exits.push(e);
                    }
                }
            }
            reads.push((seq, t + 10));
            let mut c = BeaconChain::new(PORT);
            // The trace starts at host time 0: the first read is the count at time 5 (0).
            c.observe(0, 5, 6, &[]);
            for &(count, at) in &reads {
                // The host sees the exits committed up to its read, but another thread's
                // exits may show up a while later (its CPU's buffer was read just before):
                // a beacon's own exits are there once its count is (they were committed
                // before the guest went on).
                let late = |e: &PioExit| e.pio.pid == 2 && e.ts.is_multiple_of(3) && e.ts + 30 > at;
                let seen: Vec<PioExit> =
                    exits.iter().copied().filter(|e| e.ts <= at && !late(e)).collect();
                c.observe(count, at, at + 1, &seen);
            }
            prop_assert!(c.broken().is_none(), "{:?}", c.broken());
            for (s, read) in truth {
                if let Some(b) = c.take(s) {
                    prop_assert!(b.lo <= read && read <= b.hi, "beacon {s}: {b:?}, read at {read}");
                }
            }
        }
    }
}
