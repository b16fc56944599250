//! Beacon mode of `record --from-memory`: the guest's sync beacons, bracketed by the host's own
//! `kvm:kvm_pio` exits ([`crate::exits::BeaconChain`]), become samples of the guest's
//! clock against host time, one round per ring per drain round. They place the records of a
//! guest whose clock is not the raw TSC, and they check KVM's mapping for one whose header says
//! it is (docs/memory-reader.md, "Beacon brackets").

use vmtsync_core::estimate::ProbeSample;
use vmtsync_core::{GuestTicks, HostTicks};

use crate::exits::{AnchorStats, BeaconChain, ChainBroken, MAX_EXITS, PioTrace};
use crate::guestmem::{GuestRecord, RingCounts};

/// Beacon records read but not yet bracketed, at most (each ring's oldest dropped first).
const MAX_WAITING_RECORDS: usize = 4096;

/// What beacon mode counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BeaconStats {
    /// Beacon records read.
    pub read: u64,
    /// Beacons that became samples (bracketed).
    pub bracketed: u64,
    /// Beacon records emitted before the trace could see them whole (the first read's count
    /// and the one after it): no bracket, by the rule, not by a fault.
    pub early: u64,
    /// Other beacon records that got no bracket: after the chain broke, dropped waiting, or
    /// still waiting when the recording ended.
    pub unbracketed: u64,
    /// Beacon records whose payload is not a sequence number (length other than 8).
    pub malformed: u64,
    /// Raw-TSC guests: beacons whose record, mapped by KVM's debugfs mapping, lies outside
    /// their bracket.
    pub disagree: u64,
    /// The first such disagreement, in words.
    pub first_disagreement: Option<String>,
    /// Why a ring's chain stopped (the first one).
    pub broken: Option<String>,
    /// Chains started again because their ring stopped beaconing while exits piled up.
    pub restarts: u64,
}

/// One ring's beacon state.
#[derive(Debug)]
struct Ring {
    chain: BeaconChain,
    /// Beacon records read, waiting for their bracket: (seq, guest clock).
    waiting: std::collections::VecDeque<(u64, u64)>,
}

/// The trace and every ring's chain.
#[derive(Debug)]
pub(super) struct Beacons {
    trace: PioTrace,
    anchor: AnchorStats,
    rings: Vec<Ring>,
    pub(super) stats: BeaconStats,
}

impl Beacons {
    /// Beacons on `port` for `rings` rings, the trace already started (before the first
    /// drain round). `armed_at`: a host time before which the guest had not run and after
    /// which the trace was running (a VMM started paused), so chains bracket from beacon 0.
    pub(super) fn new(trace: PioTrace, port: u16, rings: usize, armed_at: Option<u64>) -> Self {
        Self {
            trace,
            anchor: AnchorStats::default(),
            rings: (0..rings)
                .map(|_| Ring {
                    chain: match armed_at {
                        Some(t) => BeaconChain::armed_since(port, t),
                        None => BeaconChain::new(port),
                    },
                    waiting: std::collections::VecDeque::new(),
                })
                .collect(),
            stats: BeaconStats::default(),
        }
    }

    /// A new guest boot with `rings` rings on the same port: the trace keeps running (its
    /// exits are in time order), every chain starts again. A chain of the new boot must not
    /// bracket from a base of the old boot's counts, so it follows [`BeaconChain::new`]'s
    /// rule (its first read's count plus two) as a late attach does. Beacons of the old boot
    /// still waiting count as not bracketed.
    pub(super) fn new_boot(&mut self, port: u16, rings: usize) {
        self.stats.unbracketed += self.waiting() as u64;
        self.rings = (0..rings)
            .map(|_| Ring {
                chain: BeaconChain::new(port),
                waiting: std::collections::VecDeque::new(),
            })
            .collect();
    }

    /// Beacon records waiting for their bracket.
    pub(super) fn waiting(&self) -> usize {
        self.rings.iter().map(|r| r.waiting.len()).sum()
    }

    /// A beacon record just read.
    pub(super) fn record(&mut self, r: &GuestRecord) {
        self.stats.read += 1;
        let Some(ring) = self.rings.get_mut(r.vcpu as usize) else {
            self.stats.unbracketed += 1;
            return;
        };
        let Ok(seq) = <[u8; 8]>::try_from(r.payload()).map(u64::from_le_bytes) else {
            self.stats.malformed += 1;
            return;
        };
        if ring.waiting.len() >= MAX_WAITING_RECORDS {
            ring.waiting.pop_front();
            self.stats.unbracketed += 1;
        }
        ring.waiting.push_back((seq, r.tsc));
    }

    /// After a drain round that read the rings' counts `counts` between host times `before`
    /// and `after`: reads the trace, extends every chain, and returns each ring's new samples
    /// (in guest order), the records of beacons whose bracket is due. A trace that could not
    /// be read, or lost exits, breaks every chain (said in [`BeaconStats::broken`]).
    pub(super) fn round(
        &mut self,
        counts: &[RingCounts],
        before: u64,
        after: u64,
    ) -> Vec<Vec<ProbeSample>> {
        let damaged_before = self.anchor.damaged_pages;
        let capped_before = self.anchor.drains_capped;
        let read = self.trace.poll(&mut self.anchor);
        // Pages the kernel lost hold exits of unknown times: every chain may miss one.
        if read.is_err() || self.anchor.damaged_pages != damaged_before {
            for r in &mut self.rings {
                r.chain.break_off(ChainBroken::TraceLost);
            }
            if let Err(e) = read {
                self.stats
                    .broken
                    .get_or_insert_with(|| format!("the kvm_pio trace could not be read: {e}"));
            }
        }
        // Exits dropped from the kept window: only chains that still need exits that old.
        if let Some(dropped) = self.trace.dropped_until() {
            for r in &mut self.rings {
                if r.chain.needs_from().is_some_and(|from| from <= dropped) {
                    r.chain.break_off(ChainBroken::TraceLost);
                }
            }
        }
        // A drain that left pages unread may not hold every exit before this round's read:
        // the chains wait for the next round, which reads the counts again.
        let complete = self.anchor.drains_capped == capped_before;
        let exits = self.trace.exits();
        let mut samples = Vec::with_capacity(self.rings.len());
        for (vcpu, (ring, c)) in self.rings.iter_mut().zip(counts).enumerate() {
            if complete {
                ring.chain.observe(c.beacons, before, after, exits);
            }
            if let Some(b) = ring.chain.broken() {
                self.stats
                    .broken
                    .get_or_insert_with(|| format!("vCPU {vcpu}: {}", b.describe()));
            }
            let mut got = Vec::new();
            let chain = &mut ring.chain;
            let stats = &mut self.stats;
            ring.waiting.retain(|&(seq, tsc)| {
                if !chain.may_bracket(seq) {
                    if chain.is_early(seq) {
                        stats.early += 1;
                    } else {
                        stats.unbracketed += 1;
                    }
                    return false;
                }
                if !chain.is_due(seq) {
                    return true;
                }
                match chain.take(seq) {
                    Some(b) => {
                        got.push(ProbeSample {
                            host_send: HostTicks(b.lo),
                            guest: GuestTicks(tsc),
                            host_recv: HostTicks(b.hi),
                            #[allow(clippy::cast_possible_truncation)]
                            vcpu: vcpu as u32,
                        });
                        stats.bracketed += 1;
                    }
                    None => stats.unbracketed += 1,
                }
                false
            });
            got.sort_by_key(|s| s.guest.0);
            samples.push(got);
        }
        // A ring whose beacons stopped holds the oldest exits: past half the window it starts
        // again (its next beacons are bracketed from a later read), so the others lose none.
        if self.trace.exits().len() > MAX_EXITS / 2
            && let Some(oldest) = self.rings.iter().filter_map(|r| r.chain.needs_from()).min()
        {
            for r in &mut self.rings {
                if r.chain.needs_from() == Some(oldest) {
                    r.chain.restart();
                    self.stats.restarts += 1;
                }
            }
        }
        // Exits no chain needs any more.
        match self.rings.iter().filter_map(|r| r.chain.needs_from()).min() {
            Some(from) => self.trace.forget_before(from),
            // No chain needs any (all broken or restarting): keep none.
            None => self.trace.forget_before(after),
        }
        samples
    }

    /// Checks raw-TSC samples against KVM's mapping (`host = guest - offset`, any of
    /// `offsets`, the vCPU's mappings around the round): a sample no offset puts inside its
    /// bracket is a disagreement, counted and described.
    pub(super) fn check_exact(&mut self, s: &ProbeSample, offsets: &[i64]) {
        let fits = offsets.iter().any(|&o| {
            s.guest
                .0
                .checked_add_signed(o.wrapping_neg())
                .is_some_and(|h| (s.host_send.0..=s.host_recv.0).contains(&h))
        });
        if !fits {
            self.stats.disagree += 1;
            let offset = offsets.first().copied().unwrap_or(0);
            let host = s.guest.0.checked_add_signed(offset.wrapping_neg());
            self.stats.first_disagreement.get_or_insert_with(|| {
                format!(
                    "vCPU {}: a beacon's TSC {} maps by KVM's offset {offset} to host {}, \
                     outside its kvm_pio bracket [{}, {}]",
                    s.vcpu,
                    s.guest.0,
                    host.map_or_else(|| "outside u64".into(), |h| h.to_string()),
                    s.host_send.0,
                    s.host_recv.0
                )
            });
        }
    }
}
