//! Draining a live recorder: polled, a bounded number of records per ring per round, the
//! contract's reading rule, exact loss counts, and the header checked around every ring read.

use thiserror::Error;

use super::find::Found;
use super::layout::{
    BEACON_ID, HEADER_SIZE, Header, Mode, RECORD_SIZE, RING_PREFIX, decode_committed,
};
use super::memory::{GuestMemory, MemError};
use vmtsync_core::recorder::RESERVED_ID_MIN;

/// One slot's bytes, as a buffer length.
const SLOT_BYTES: usize = 32;
// The buffer length and the layout's slot size are one number.
const _: () = assert!(SLOT_BYTES as u64 == RECORD_SIZE);

/// Records read per ring per round unless the caller asks otherwise (512 KiB of slots).
pub const DEFAULT_MAX_PER_ROUND: usize = 16384;
/// The most a caller may ask for per ring per round (2 MiB of slots).
pub const MAX_PER_ROUND_LIMIT: usize = 65536;

/// One record read out of guest memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestRecord {
    /// The ring (vCPU) it came from.
    pub vcpu: u32,
    /// The event id ([`BEACON_ID`] for a sync beacon).
    pub id: u16,
    /// The guest clock read when it was recorded (see the header's clock word).
    pub tsc: u64,
    /// Payload bytes in `payload[..len]`.
    pub len: u8,
    /// The payload; bytes past `len` are zero.
    pub payload: [u8; 16],
}

// 32 bytes, a slot's size: a drain round's records are written and read once more each
// (take_slots, then the writer thread), so every byte of them costs twice per record.
const _: () = assert!(size_of::<GuestRecord>() == 32);

impl GuestRecord {
    /// Whether this is a sync beacon (id 0xFFFF; its payload is the sequence number).
    #[must_use]
    pub fn is_beacon(&self) -> bool {
        self.id == BEACON_ID
    }

    /// The payload bytes.
    #[must_use]
    pub fn payload(&self) -> &[u8] {
        &self.payload[..usize::from(self.len.min(16))]
    }
}

/// One ring's records in a round ([`Drainer::round_rings`]): where they are in
/// [`Drainer::round_records`], which of them carry an id vmtsync reserves (beacons, spans,
/// the function graph: [`RESERVED_ID_MIN`] and up), and the extremes of their clocks, so a
/// caller can take the application's events between those as runs without looking at each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoundRing {
    /// The ring.
    pub vcpu: u32,
    /// Its records' indices in the round's records (never empty).
    pub records: std::ops::Range<usize>,
    /// Its part of [`Drainer::round_reserved`]: the indices (in the round's records, in
    /// order) of its records with a reserved id.
    pub reserved: std::ops::Range<usize>,
    /// The smallest and largest guest clock among its records.
    pub min_tsc: u64,
    /// See `min_tsc`.
    pub max_tsc: u64,
}

/// One ring's exact tallies since draining began.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingCounts {
    /// Records handed to the caller.
    pub delivered: u64,
    /// Records the guest overwrote before the reader got them (it lapped the reader), or
    /// while the reader copied them.
    pub overwritten: u64,
    /// The ring's own `refused` word as last read: events the guest dropped because the
    /// ring was full (stop-when-full). The guest counts these; the host only reports them.
    pub refused: u64,
    /// Records whose slot did not hold them complete although the guest had not lapped
    /// the reader: the guest broke the layout's rules for that slot.
    pub corrupt: u64,
    /// The ring's `head` as last read: records the guest says it stored.
    pub head: u64,
    /// The next index the reader wants (everything below was delivered or counted lost).
    pub next: u64,
    /// The ring's `beacons` word as last read (read with `head`, before the round's copy):
    /// the beacons the guest says it has emitted.
    pub beacons: u64,
}

/// Why draining stopped. Every variant carries the counts so far; what was delivered stays
/// delivered.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DrainError {
    /// The header could not be read or no longer parses: the guest reset or the VMM's
    /// memory moved.
    #[error("the recorder header at {addr:#x} is gone ({why}); find it again to continue")]
    HeaderGone {
        /// The header's address.
        addr: u64,
        /// What was seen instead.
        why: String,
        /// Counts up to the last good round.
        counts: Vec<RingCounts>,
    },
    /// The header now has another boot nonce: the guest restarted.
    #[error(
        "the guest republished its recorder at {addr:#x} with nonce {new:#x} (was {old:#x}): it restarted"
    )]
    NonceChanged {
        /// The header's address.
        addr: u64,
        /// The nonce drained so far.
        old: u64,
        /// The new one.
        new: u64,
        /// Counts up to the last good round.
        counts: Vec<RingCounts>,
    },
    /// The header is valid but describes other rings.
    #[error("the recorder header at {addr:#x} changed its geometry ({old:?} -> {new:?})")]
    GeometryChanged {
        /// The header's address.
        addr: u64,
        /// The header drained so far.
        old: Box<Header>,
        /// The new one.
        new: Box<Header>,
        /// Counts up to the last good round.
        counts: Vec<RingCounts>,
    },
    /// A ring's head went backwards with the same header: the guest broke the layout.
    #[error("ring {vcpu}'s head went back from {from} to {to} under the same header")]
    HeadRewound {
        /// The ring.
        vcpu: u32,
        /// Where it was.
        from: u64,
        /// Where it is.
        to: u64,
        /// Counts up to this ring's round.
        counts: Vec<RingCounts>,
    },
    /// Ring memory could not be read.
    #[error("reading ring {vcpu}: {source}")]
    Read {
        /// The ring.
        vcpu: u32,
        /// The read error.
        source: MemError,
        /// Counts so far.
        counts: Vec<RingCounts>,
    },
}

impl DrainError {
    /// The counts per ring when draining stopped.
    #[must_use]
    pub fn counts(&self) -> &[RingCounts] {
        match self {
            Self::HeaderGone { counts, .. }
            | Self::NonceChanged { counts, .. }
            | Self::GeometryChanged { counts, .. }
            | Self::HeadRewound { counts, .. }
            | Self::Read { counts, .. } => counts,
        }
    }
}

/// What one [`Drainer::poll`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PollSummary {
    /// Records delivered this round.
    pub delivered: u64,
    /// Records lost this round (overwritten or corrupt).
    pub lost: u64,
    /// Whether some ring had more than one round's worth when the round began, or holds half
    /// a ring's worth unread after it: poll again without waiting.
    pub more: bool,
}

/// Drains one recorder found in memory.
#[derive(Debug)]
pub struct Drainer {
    addr: u64,
    header: Header,
    header_bytes: [u8; HEADER_SIZE],
    rings: Vec<RingCounts>,
    max_per_round: usize,
    /// Slot copies of one ring's round (at most `max_per_round` slots; never shrinks, so
    /// it is not cleared between rounds).
    buf: Vec<u8>,
    /// The round's records: every ring's whose header check passed, in ring order.
    round: Vec<GuestRecord>,
    /// The round's rings that delivered records, in ring order.
    rings_read: Vec<RoundRing>,
    /// The indices of the round's records with a reserved id, in order.
    reserved: Vec<usize>,
}

/// The little-endian word at `off` of `b` (0 past its end). Inlined: the drain reads a slot's
/// words through it, and a call per word was an eighth of the drain's time (perf).
#[inline]
fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(s) = b.get(off..off + 8) {
        w.copy_from_slice(s);
    }
    u64::from_le_bytes(w)
}

/// A slot's payload: its first `len` bytes (at most 16), the rest zero. Masked as two words
/// rather than filled: a fill of a variable length is a `memset` call per record.
#[inline]
fn payload_of(slot: &[u8; SLOT_BYTES], len: u8) -> [u8; 16] {
    // MASK[k]: a word's first `k` bytes (k ≤ 8), looked up rather than computed with a shift
    // and a branch per word.
    const MASK: [u64; 9] = {
        let mut m = [u64::MAX; 9];
        let mut k = 0;
        while k < 8 {
            m[k] = (1u64 << (8 * k)) - 1;
            k += 1;
        }
        m
    };
    let len = usize::from(len.min(16));
    let lo = u64_at(slot, 16) & MASK[len.min(8)];
    let hi = u64_at(slot, 24) & MASK[len.saturating_sub(8)];
    let mut p = [0u8; 16];
    p[..8].copy_from_slice(&lo.to_le_bytes());
    p[8..].copy_from_slice(&hi.to_le_bytes());
    p
}

/// Reads the little-endian `u64` at `addr` one byte at a time, most significant byte first.
///
/// A copy of another process's memory is atomic per byte only, so one read of a word the guest
/// is storing can mix bytes of several of its values (a head going from 0x0ff to 0x100 can read
/// as 0x1ff). For a word that only grows, and that the guest changes in one access each time
/// (docs/memory-layout.md: a 64-bit store, or on i386 a 32-bit store of the half that changes
/// or `lock cmpxchg8b`), reading the most significant byte first never gives more than the
/// word's value when the last byte was read (Lamport, "Concurrent reading and writing", 1977):
/// if the value read were larger, the highest byte where it exceeds that final value would
/// have come from an earlier, smaller value whose higher bytes were smaller still, and so on
/// up to the top byte, which has none. The result may be too small, never too large.
fn read_at_most(mem: &mut impl GuestMemory, addr: u64) -> Result<u64, MemError> {
    read_bytes_in_order(mem, addr, [7, 6, 5, 4, 3, 2, 1, 0])
}

/// [`read_at_most`]'s mirror: least significant byte first, so never less than the word's
/// value when the first byte was read (for a growing word changed in one access each time).
/// The result may be too large, never too small.
fn read_at_least(mem: &mut impl GuestMemory, addr: u64) -> Result<u64, MemError> {
    read_bytes_in_order(mem, addr, [0, 1, 2, 3, 4, 5, 6, 7])
}

/// The little-endian `u64` at `addr`, its bytes read one at a time in `order` (one
/// [`GuestMemory::read_many`]: in order, in as few system calls as the reader can).
fn read_bytes_in_order(
    mem: &mut impl GuestMemory,
    addr: u64,
    order: [usize; 8],
) -> Result<u64, MemError> {
    let mut w = [0u8; 8];
    {
        let mut bytes: Vec<&mut [u8]> = w.chunks_mut(1).collect();
        let mut parts: Vec<(u64, &mut [u8])> = order
            .iter()
            .map(|&i| (addr + i as u64, std::mem::take(&mut bytes[i])))
            .collect();
        mem.read_many(&mut parts)?;
    }
    Ok(u64::from_le_bytes(w))
}

impl Drainer {
    /// Starts draining the recorder `found` from each ring's record 0, at most
    /// `max_per_round` records per ring per round (clamped to 1..=[`MAX_PER_ROUND_LIMIT`]).
    #[must_use]
    pub fn new(found: &Found, max_per_round: usize) -> Self {
        let max = max_per_round.clamp(1, MAX_PER_ROUND_LIMIT);
        Self {
            addr: found.addr,
            header: found.header,
            header_bytes: found.header.to_bytes(),
            rings: vec![RingCounts::default(); found.header.vcpus as usize],
            max_per_round: max,
            buf: Vec::with_capacity(max * SLOT_BYTES),
            round: Vec::with_capacity(max),
            rings_read: Vec::new(),
            reserved: Vec::new(),
        }
    }

    /// The header being drained.
    #[must_use]
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Its host virtual address.
    #[must_use]
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Counts per ring so far.
    #[must_use]
    pub fn counts(&self) -> &[RingCounts] {
        &self.rings
    }

    /// The records of the last round ([`Self::poll_round`]), in ring order.
    #[must_use]
    pub fn round_records(&self) -> &[GuestRecord] {
        &self.round
    }

    /// The rings of the last round that delivered records, in ring order: the parts of
    /// [`Self::round_records`] by ring, each with its extremes.
    #[must_use]
    pub fn round_rings(&self) -> &[RoundRing] {
        &self.rings_read
    }

    /// The indices in [`Self::round_records`] of the last round's records with an id of
    /// [`RESERVED_ID_MIN`] or above, in order (each ring's part: [`RoundRing::reserved`]).
    #[must_use]
    pub fn round_reserved(&self) -> &[usize] {
        &self.reserved
    }

    /// Takes the last round's records, leaving `spare` (emptied) to hold the next round's:
    /// a caller that hands rounds on keeps no copy.
    pub fn swap_round(&mut self, mut spare: Vec<GuestRecord>) -> Vec<GuestRecord> {
        spare.clear();
        std::mem::replace(&mut self.round, spare)
    }

    /// Checks that the header still says what it said when draining began.
    fn check_header(&self, mem: &mut impl GuestMemory) -> Result<(), DrainError> {
        let mut now = [0u8; HEADER_SIZE];
        let gone = |why: String| DrainError::HeaderGone {
            addr: self.addr,
            why,
            counts: self.rings.clone(),
        };
        mem.read(self.addr, &mut now)
            .map_err(|e| gone(e.to_string()))?;
        if now == self.header_bytes {
            return Ok(());
        }
        let new = Header::parse(&now).map_err(|e| gone(e.to_string()))?;
        if new.nonce != self.header.nonce {
            return Err(DrainError::NonceChanged {
                addr: self.addr,
                old: self.header.nonce,
                new: new.nonce,
                counts: self.rings.clone(),
            });
        }
        Err(DrainError::GeometryChanged {
            addr: self.addr,
            old: Box::new(self.header),
            new: Box::new(new),
            counts: self.rings.clone(),
        })
    }

    /// One round: for every ring, the records it holds past the reader (at most the
    /// round's bound), each delivered to `sink` or counted lost.
    ///
    /// The reading rule, per ring: read `head` (h1) as a lower bound (most significant byte
    /// first, [`read_at_most`], and at least `next`); copy the slots of indices
    /// `[max(next, h1 - cap), min(h1, next' + bound))`; read `head` again (h2), and for a
    /// stop-when-full ring the in-guest consumer's `tail` (t2), as upper bounds (least
    /// significant byte first, [`read_at_least`]); read the header again. Record `n` is
    /// delivered iff the producer cannot have begun record `n + cap` (which it does only after
    /// publishing head = `n + cap`): `h2 < n + cap`, or, stop-when-full, `t2 <= n` (such a
    /// producer refuses record `m` while `m - tail >= cap`); and its copied `meta` is record
    /// `n`'s, complete. (The tail clause refines the layout contract's rule, which would call
    /// a full stop-when-full ring's oldest record lost.) Otherwise it is overwritten
    /// (`h2 >= n + cap`) or corrupt. Because validity rests on the two bounds around the whole
    /// copy and on the stamp the copy itself holds, the order in which the copy reads bytes
    /// does not matter; the bounds hold although a copy of another process's memory is atomic
    /// per byte only (a torn head could otherwise read far too high or too low). A ring's
    /// records reach `sink` only after the header read after its copy matched: no record is
    /// delivered from memory that another boot had taken over.
    ///
    /// # Errors
    /// [`DrainError`], with the counts so far.
    pub fn poll(
        &mut self,
        mem: &mut impl GuestMemory,
        sink: &mut impl FnMut(&GuestRecord),
    ) -> Result<PollSummary, DrainError> {
        let polled = self.poll_round(mem);
        for r in &self.round {
            sink(r);
        }
        polled
    }

    /// The copied slots `slots` (of the ring round's copy in `buf`, whose first is record
    /// `start`), each one the record its index says and complete appended to the round's
    /// records (its position marked when its id is reserved), the others counted corrupt.
    /// Returns (corrupt, the smallest and the largest guest clock appended).
    fn take_slots(
        &mut self,
        vcpu: u32,
        start: u64,
        slots: std::ops::Range<usize>,
    ) -> (u64, u64, u64) {
        let mut corrupt = 0u64;
        let (mut min_tsc, mut max_tsc) = (u64::MAX, 0u64);
        self.round.reserve(slots.len());
        // Fixed-size slots: each word's offset is a constant, with no bounds check.
        let copied = self.buf[..slots.end * SLOT_BYTES]
            .as_chunks::<SLOT_BYTES>()
            .0;
        for (k, slot) in copied.iter().enumerate().skip(slots.start) {
            let n = start + k as u64;
            let Some((id, len)) = decode_committed(u64_at(slot, 0), n) else {
                corrupt += 1;
                continue;
            };
            let tsc = u64_at(slot, 8);
            if id >= RESERVED_ID_MIN {
                self.reserved.push(self.round.len());
            }
            min_tsc = min_tsc.min(tsc);
            max_tsc = max_tsc.max(tsc);
            self.round.push(GuestRecord {
                vcpu,
                id,
                tsc,
                len,
                payload: payload_of(slot, len),
            });
        }
        (corrupt, min_tsc, max_tsc)
    }

    /// [`Self::poll`] without a sink: the round's records stay in the drainer, for
    /// [`Self::round_records`] to lend until the next round (also after an error: the rings
    /// read before it).
    ///
    /// # Errors
    /// As [`Self::poll`].
    pub fn poll_round(&mut self, mem: &mut impl GuestMemory) -> Result<PollSummary, DrainError> {
        self.round.clear();
        self.rings_read.clear();
        self.reserved.clear();
        let mut summary = PollSummary::default();
        self.check_header(mem)?;
        for vcpu in 0..self.header.vcpus {
            let base = self.addr + self.header.ring_offset(vcpu);
            let read_err = |source, rings: &[RingCounts]| DrainError::Read {
                vcpu,
                source,
                counts: rings.to_vec(),
            };
            let ring = self.rings[vcpu as usize];
            // A ring whose head, refused and beacons words all read as last time has nothing
            // new: skipping it for a round is always sound (a torn read that happens to show
            // the old values only delays its records to the next round), and costs one read
            // instead of the byte-by-byte reads below.
            let mut quick = [0u8; 32];
            mem.read(base, &mut quick)
                .map_err(|e| read_err(e, &self.rings))?;
            if ring.next == u64_at(&quick, 0)
                && ring.refused == u64_at(&quick, 8)
                && ring.beacons == u64_at(&quick, 24)
            {
                continue;
            }
            // head, refused and beacons (docs/memory-layout.md, the ring header), each read
            // byte by byte from its most significant byte down: never above the word's value
            // at the end of the read, whatever the guest stores meanwhile (see `read_at_most`).
            // A count the quick read shows unchanged keeps its known lower bound.
            let h1_read = read_at_most(mem, base).map_err(|e| read_err(e, &self.rings))?;
            let refused = if u64_at(&quick, 8) == ring.refused {
                ring.refused
            } else {
                read_at_most(mem, base + 8).map_err(|e| read_err(e, &self.rings))?
            };
            let beacons = if u64_at(&quick, 24) == ring.beacons {
                ring.beacons
            } else {
                read_at_most(mem, base + 24).map_err(|e| read_err(e, &self.rings))?
            };
            // Every record below `next` was committed already (an earlier round's lower
            // bound), so the larger of the two is still a lower bound of the head.
            let h1 = h1_read.max(ring.next);
            let cap = self.header.capacity;
            let start = ring.next.max(h1.saturating_sub(cap));
            let lapped = start - ring.next;
            let end = h1.min(start.saturating_add(self.max_per_round as u64));
            // Copy the slots of [start, end): at most two contiguous runs (the ring wraps).
            let count = usize::try_from(end - start).unwrap_or(0);
            if self.buf.len() < count * SLOT_BYTES {
                self.buf.resize(count * SLOT_BYTES, 0);
            }
            let slots = base + RING_PREFIX;
            let first_slot = start & (cap - 1);
            let first_run = usize::try_from((cap - first_slot).min(end - start)).unwrap_or(0);
            let (a, b) = self.buf[..count * SLOT_BYTES].split_at_mut(first_run * SLOT_BYTES);
            mem.read(slots + first_slot * RECORD_SIZE, a)
                .map_err(|e| read_err(e, &self.rings))?;
            if !b.is_empty() {
                mem.read(slots, b).map_err(|e| read_err(e, &self.rings))?;
            }
            // The head again, and for a stop-when-full ring the in-guest consumer's tail too
            // (read after the head, so it is no older than the producer's last check), each
            // from its least significant byte up: never below the word's value when the read
            // began, so never below what it was when the copy ended.
            let h2 = read_at_least(mem, base).map_err(|e| read_err(e, &self.rings))?;
            let tail2 = match self.header.mode {
                Mode::StopWhenFull => {
                    Some(read_at_least(mem, base + 64).map_err(|e| read_err(e, &self.rings))?)
                }
                Mode::Overwrite => None,
            };
            // An upper bound below a lower bound: the head really went back.
            if h2 < h1 {
                return Err(DrainError::HeadRewound {
                    vcpu,
                    from: h1,
                    to: h2,
                    counts: self.rings.clone(),
                });
            }
            let ring_start = self.round.len();
            let reserved_start = self.reserved.len();
            // Past 2^64 the producer can never have begun record n + cap. A stop-when-full
            // producer begins record n + cap only once its consumer has released record n
            // (tail > n), so a tail at or below n also rules it out. Both bounds are upper
            // bounds on n: the records the producer may have begun again are a prefix, those
            // below `rewritten_below`.
            let rewritten_below = h2
                .checked_sub(cap)
                .map_or(0, |last| last + 1)
                .min(tail2.unwrap_or(u64::MAX));
            let overwritten = usize::try_from(rewritten_below.saturating_sub(start))
                .map_or(count, |r| r.min(count));
            let (corrupt, min_tsc, max_tsc) = self.take_slots(vcpu, start, overwritten..count);
            let overwritten = overwritten as u64;
            if let Err(e) = self.check_header(mem) {
                self.round.truncate(ring_start);
                self.reserved.truncate(reserved_start);
                return Err(e);
            }
            if self.round.len() > ring_start {
                self.rings_read.push(RoundRing {
                    vcpu,
                    records: ring_start..self.round.len(),
                    reserved: reserved_start..self.reserved.len(),
                    min_tsc,
                    max_tsc,
                });
            }
            let delivered = (self.round.len() - ring_start) as u64;
            let ring = &mut self.rings[vcpu as usize];
            ring.delivered = ring.delivered.saturating_add(delivered);
            ring.overwritten = ring
                .overwritten
                .saturating_add(lapped)
                .saturating_add(overwritten);
            ring.corrupt = ring.corrupt.saturating_add(corrupt);
            // Both are lower bounds of counts that only grow: the largest seen is the best.
            ring.refused = ring.refused.max(refused);
            ring.beacons = ring.beacons.max(beacons);
            ring.head = h2;
            ring.next = end;
            summary.delivered += delivered;
            summary.lost = summary
                .lost
                .saturating_add(lapped)
                .saturating_add(overwritten)
                .saturating_add(corrupt);
            // More than one round's worth waited when the round began, or half the ring is
            // unread after it (a ring smaller than a round's bound, filling fast, must not
            // wait a poll interval). A few records the guest stored during the round are not
            // "more": with a live guest the head always moves, and polling again at once for
            // them spun a core at any rate.
            summary.more |= end < h1 || h2 - end >= (cap / 2).max(1);
        }
        Ok(summary)
    }
}

#[cfg(test)]
mod payload_tests {
    use super::payload_of;

    /// Every length keeps exactly the slot's first `len` payload bytes and zeroes the rest.
    #[test]
    fn payload_keeps_its_length_and_zeroes_the_rest() {
        let slot: [u8; 32] = std::array::from_fn(|b| u8::try_from(b).unwrap().wrapping_mul(7) | 1);
        for len in 0u8..=16 {
            let mut want = [0u8; 16];
            want[..usize::from(len)].copy_from_slice(&slot[16..16 + usize::from(len)]);
            assert_eq!(payload_of(&slot, len), want, "len {len}");
        }
    }
}
