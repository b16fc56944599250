//! Beacon mode writes as it reads, each record once the sync round after it is known.
//!
//! A beacon-mode record is placed two-sided: between the sync round before it and the round
//! after it, under the drift bounds of every round of its epoch (`sync::place`). The round
//! after it is made from beacons the guest emits later, so a record waits here, in memory,
//! until it is ready: its vCPU has a segment that starts after it, and its epoch's rounds
//! span at least [`SPAN_PER_DISTANCE`] times its distance from the nearest of them (so the
//! rate's uncertainty widens its interval by a fraction of one round's own uncertainty), or
//! its epoch has ended.
//! It is then placed with every round known at that moment and written into the output's
//! streaming writer. Later rounds could only narrow its interval further, never make it
//! wrong (each round's box and the newest drift bounds hold the truth), so nothing is written
//! again at the end (docs/record.md, "Memory recordings stream").
//!
//! Memory stays bounded: at most [`HOLD_RECORDS`] records wait. When more would, the records
//! of every vCPU with a segment are placed at once with what is known (the segment before them
//! alone: a wider interval, still guaranteed; counted as `early`). A vCPU with no segment yet
//! cannot be placed at all: its records go on, in order, to a spool on disk, and from the
//! spool to the output once every such vCPU has one. When the recording ends, what still
//! waits is placed with every round known.

use std::collections::VecDeque;
use std::path::Path;

use crate::guestmem::GuestRecord;
use crate::record::RecordError;
use crate::record::place::State;
use crate::record::spool::{Spool, Spooled};
use crate::record::write::Out;
use crate::syncfile::SyncSegment;

/// How many times its distance from the nearest round a record's epoch must span before it is
/// placed: the rate's uncertainty then widens its interval by about 2 / this of one round's
/// own uncertainty.
const SPAN_PER_DISTANCE: u64 = 8;

/// The most records that wait in memory for the sync round after them.
pub(super) const HOLD_RECORDS: usize = 1 << 19;

/// The records waiting for their round after, per vCPU key, in ring order.
pub(super) struct Hold {
    /// Per vCPU key: its records and where its newest epoch starts.
    queues: Vec<(u32, VecDeque<Spooled>, EpochStart)>,
    held: usize,
    /// When the hold was full: records of vCPUs that had no segment, in order, and those
    /// vCPUs (their later records follow them there until they are written).
    spill: Option<Spool>,
    spilled: Vec<u32>,
    /// The most records the spool held at once.
    pub(super) spilled_most: u64,
    spill_len: u64,
    /// Records placed before a round after them was known because the hold was full.
    pub(super) early: u64,
    cap: usize,
}

impl Hold {
    pub(super) fn new() -> Self {
        Self::with_cap(HOLD_RECORDS)
    }

    fn with_cap(cap: usize) -> Self {
        Self {
            queues: Vec::new(),
            held: 0,
            spill: None,
            spilled: Vec::new(),
            spilled_most: 0,
            spill_len: 0,
            early: 0,
            cap,
        }
    }

    /// Record `r` of vCPU key `key`, waiting for its round after.
    pub(super) fn push(
        &mut self,
        key: u32,
        r: &GuestRecord,
        out: &Path,
    ) -> Result<(), RecordError> {
        let rec = Spooled::new(key, r.tsc, r.id, r.payload());
        if self.spilled.contains(&key) {
            return self.spill_one(&rec, out);
        }
        let q = match self.queues.iter().position(|(k, ..)| *k == key) {
            Some(i) => &mut self.queues[i].1,
            None => {
                self.queues
                    .push((key, VecDeque::new(), EpochStart::default()));
                &mut self.queues.last_mut().expect("just pushed").1
            }
        };
        q.push_back(rec);
        self.held += 1;
        Ok(())
    }

    fn spill_one(&mut self, rec: &Spooled, out: &Path) -> Result<(), RecordError> {
        let spool = match &mut self.spill {
            Some(s) => s,
            None => self
                .spill
                .insert(Spool::new().map_err(RecordError::io(out))?),
        };
        spool
            .push(rec.vcpu, rec.guest, rec.id, rec.payload())
            .map_err(RecordError::io(out))?;
        self.spill_len += 1;
        self.spilled_most = self.spilled_most.max(self.spill_len);
        Ok(())
    }

    /// After a round: every record whose vCPU now has a segment starting after it is placed
    /// and written; then, if the hold is over its bound, the rest as said in the module docs.
    pub(super) fn release(
        &mut self,
        st: &mut State,
        w: &mut Out,
        out: &Path,
    ) -> Result<(), RecordError> {
        self.release_spill(st, w, out, false)?;
        for (key, q, start) in &mut self.queues {
            let Some(v) = st.index_of(*key) else {
                continue;
            };
            let epoch = start.epoch(&st.vcpus[v].segments);
            while let Some(rec) = q
                .front()
                .filter(|r| epoch.is_some_and(|e| e.ready(&st.vcpus[v].segments, r.guest)))
            {
                write_placed(st, w, rec, out)?;
                q.pop_front();
                self.held -= 1;
            }
        }
        if self.held > self.cap {
            self.overflow(st, w, out)?;
        }
        Ok(())
    }

    /// The hold is full: records of vCPUs with a segment are placed now, the others spilled.
    fn overflow(&mut self, st: &mut State, w: &mut Out, out: &Path) -> Result<(), RecordError> {
        let mut queues = std::mem::take(&mut self.queues);
        for (key, q, _) in &mut queues {
            let placeable = st
                .index_of(*key)
                .is_some_and(|i| !st.vcpus[i].segments.is_empty());
            for rec in q.drain(..) {
                if placeable {
                    self.early += 1;
                    write_placed(st, w, &rec, out)?;
                } else {
                    self.spill_one(&rec, out)?;
                }
            }
            if !placeable && !self.spilled.contains(key) {
                self.spilled.push(*key);
            }
        }
        self.queues = queues;
        self.held = 0;
        Ok(())
    }

    /// The spill, written once each of its vCPUs has a segment (`all`: now, whatever is known).
    fn release_spill(
        &mut self,
        st: &mut State,
        w: &mut Out,
        out: &Path,
        all: bool,
    ) -> Result<(), RecordError> {
        let ready = all
            || self.spilled.iter().all(|k| {
                st.index_of(*k)
                    .is_some_and(|i| !st.vcpus[i].segments.is_empty())
            });
        if !ready {
            return Ok(());
        }
        if let Some(mut spool) = self.spill.take() {
            for rec in spool.iter().map_err(RecordError::io(out))? {
                let rec = rec.map_err(RecordError::io(out))?;
                write_placed(st, w, &rec, out)?;
            }
        }
        self.spilled.clear();
        self.spill_len = 0;
        Ok(())
    }

    /// The end of a boot or of the recording: everything still waiting, placed with every
    /// round known now.
    pub(super) fn release_all(
        &mut self,
        st: &mut State,
        w: &mut Out,
        out: &Path,
    ) -> Result<(), RecordError> {
        self.release(st, w, out)?;
        self.release_spill(st, w, out, true)?;
        for (_, q, _) in &mut self.queues {
            for rec in q.drain(..) {
                write_placed(st, w, &rec, out)?;
            }
        }
        self.held = 0;
        Ok(())
    }
}

/// A vCPU's newest epoch (the segments since its last break): where it starts, and the
/// guest ticks its rounds span.
#[derive(Clone, Copy, Debug)]
struct Epoch {
    first: usize,
    span: u64,
}

/// Where a vCPU's newest epoch starts (its last break, else its first segment), kept as its
/// segments grow: each round looks only at the segments added since the last, not at all of
/// a long recording's.
#[derive(Clone, Copy, Debug, Default)]
struct EpochStart {
    seen: usize,
    first: usize,
}

impl EpochStart {
    /// The newest epoch of `segs` (the vCPU's segments, which only grow).
    fn epoch(&mut self, segs: &[SyncSegment]) -> Option<Epoch> {
        if self.seen > segs.len() {
            *self = Self::default();
        }
        if let Some(k) = segs[self.seen..].iter().rposition(|s| s.is_break) {
            self.first = self.seen + k;
        }
        self.seen = segs.len();
        let newest = segs.last()?;
        Some(Epoch {
            first: self.first,
            span: newest
                .guest_start
                .saturating_sub(segs[self.first].guest_start),
        })
    }
}

impl Epoch {
    /// Whether a record at guest tick `g` is placed now (see the module docs).
    fn ready(self, segs: &[SyncSegment], g: u64) -> bool {
        let i = segs.partition_point(|s| s.guest_start <= g);
        let Some(next) = segs.get(i) else {
            return false;
        };
        // The covering segment (`i - 1`) lies before the newest epoch's break: its epoch
        // ended there.
        if i > 0 && i <= self.first {
            return true;
        }
        let near = match i.checked_sub(1) {
            Some(before) => (next.guest_start - g).min(g - segs[before].guest_start),
            None => next.guest_start - g,
        };
        self.span >= near.saturating_mul(SPAN_PER_DISTANCE)
    }
}

/// `rec` placed with the rounds known now and written (counted: [`State::place_counted`]).
fn write_placed(st: &mut State, w: &mut Out, rec: &Spooled, out: &Path) -> Result<(), RecordError> {
    match st.place_counted(rec) {
        Some(p) => w.push(&p, out),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::jsonl::Line;
    use crate::record::RecordFormat;
    use crate::record::memory::mapping::{Reading, exact_segment};
    use crate::record::target::Target;
    use crate::record::write::finish;
    use crate::sync::Placement;

    const OFFSET: i64 = 1000;

    fn rec(vcpu: u32, tsc: u64) -> GuestRecord {
        GuestRecord {
            vcpu,
            id: 7,
            tsc,
            len: 2,
            payload: [u8::try_from(tsc % 251).unwrap(); 16],
        }
    }

    /// A JSON Lines output in a fresh directory, vCPUs 0 and 1 placed two-sided with no
    /// segment yet, and a hold of `cap` records.
    fn setup(cap: usize) -> (tempfile::TempDir, Target, State, Out, Hold) {
        let d = tempfile::tempdir().unwrap();
        let t = Target::test(&d.path().join("out.jsonl"), RecordFormat::Jsonl);
        let st = State::new(&[0, 1], None, Placement::TwoSided);
        let out = Out::create(&t, Placement::OneSided).unwrap();
        (d, t, st, out, Hold::with_cap(cap))
    }

    /// A segment of vCPU `key` starting at guest tick `start` (offset [`OFFSET`], width 0).
    fn segment(st: &mut State, key: u32, start: u64) {
        let r = Reading {
            offset: OFFSET,
            before: start,
            after: start,
        };
        let i = st.index_of(key).unwrap();
        st.vcpus[i].segments.push(exact_segment(key, 0, start, r));
    }

    /// The written lines as (vCPU, guest tick), in file order, with every host tick checked.
    fn written(out: Out, target: &Target, st: &State) -> Vec<(u32, u64)> {
        finish(out, target, st).unwrap();
        std::fs::read_to_string(&target.out)
            .unwrap()
            .lines()
            .map(|l| {
                let l: Line = serde_json::from_str(l).unwrap();
                assert_eq!(l.host_tsc, l.guest_tsc - OFFSET.cast_unsigned(), "{l:?}");
                (l.vcpu, l.guest_tsc)
            })
            .collect()
    }

    /// A record is written once its vCPU has a segment that starts after it, in ring order;
    /// at the end the rest are placed with what is known, and a vCPU no segment ever placed
    /// is counted, not written.
    #[test]
    fn records_wait_for_the_round_after_them_and_are_written_once_in_order() {
        let (_d, t, mut st, mut out, mut hold) = setup(HOLD_RECORDS);
        for g in 2000..2010 {
            hold.push(0, &rec(0, g), &t.out).unwrap();
            st.events += 1;
        }
        for g in 3000..3005 {
            hold.push(1, &rec(1, g), &t.out).unwrap();
            st.events += 1;
        }
        hold.release(&mut st, &mut out, &t.out).unwrap();
        assert_eq!(hold.held, 15, "no segment: nothing placed");
        segment(&mut st, 0, 1500);
        hold.release(&mut st, &mut out, &t.out).unwrap();
        assert_eq!(
            hold.held, 15,
            "a segment before them is not the round after"
        );
        segment(&mut st, 0, 2005);
        hold.release(&mut st, &mut out, &t.out).unwrap();
        assert_eq!(hold.held, 10);
        hold.release_all(&mut st, &mut out, &t.out).unwrap();
        assert_eq!((hold.held, hold.early), (0, 0));
        assert_eq!((st.unplaceable, st.events), (5, 10));
        let want: Vec<(u32, u64)> = (2000..2010).map(|g| (0, g)).collect();
        assert_eq!(written(out, &t, &st), want);
    }

    /// A full hold places at once the records of vCPUs with a segment (counted early) and
    /// spills the others, with every later record of theirs, to disk; they are written in
    /// order once their vCPU has a segment.
    #[test]
    fn a_full_hold_places_what_it_can_and_spills_the_rest_in_order() {
        let (_d, t, mut st, mut out, mut hold) = setup(4);
        segment(&mut st, 0, 100);
        for g in 0..5 {
            hold.push(0, &rec(0, 2000 + g), &t.out).unwrap();
            hold.push(1, &rec(1, 3000 + g), &t.out).unwrap();
        }
        hold.release(&mut st, &mut out, &t.out).unwrap();
        assert_eq!((hold.held, hold.early, hold.spill_len), (0, 5, 5));
        for g in 5..7 {
            hold.push(1, &rec(1, 3000 + g), &t.out).unwrap();
        }
        hold.push(0, &rec(0, 2005), &t.out).unwrap();
        hold.release(&mut st, &mut out, &t.out).unwrap();
        assert_eq!((hold.held, hold.spill_len, hold.spilled_most), (1, 7, 7));
        segment(&mut st, 1, 100);
        hold.release(&mut st, &mut out, &t.out).unwrap();
        assert_eq!((hold.held, hold.spill_len), (1, 0));
        // Vcpu 1 takes the memory again.
        hold.push(1, &rec(1, 3007), &t.out).unwrap();
        hold.release_all(&mut st, &mut out, &t.out).unwrap();
        let mut want: Vec<(u32, u64)> = (2000..2005).map(|g| (0, g)).collect();
        want.extend((3000..3007).map(|g| (1, g)));
        want.extend([(0, 2005), (1, 3007)]);
        assert_eq!(written(out, &t, &st), want);
    }

    /// A record is ready once a round follows it and its epoch's rounds span
    /// [`SPAN_PER_DISTANCE`] times its distance from the nearest; a break after it ends its
    /// epoch at once.
    #[test]
    fn a_record_is_ready_when_its_epoch_spans_its_distance_to_a_round_enough_times() {
        let seg = |start: u64, is_break: bool| SyncSegment {
            is_break,
            ..exact_segment(
                0,
                0,
                start,
                Reading {
                    offset: 0,
                    before: start,
                    after: start,
                },
            )
        };
        let ready = |segs: &[SyncSegment], g: u64| {
            EpochStart::default().epoch(segs).unwrap().ready(segs, g)
        };
        let k = SPAN_PER_DISTANCE;
        let mut segs = vec![seg(1000, false), seg(1000 + 100 * k, false)];
        assert!(ready(&segs, 1000 + 100 * k - 100), "100 from a round");
        assert!(ready(&segs, 900), "100 before the first round");
        assert!(!ready(&segs, 1101), "101 from the nearest round");
        assert!(!ready(&segs, 1001 + 100 * k), "no round after it");
        segs.push(seg(1000 + 101 * k, false));
        assert!(ready(&segs, 1101));
        segs.push(seg(1000 + 200 * k, true));
        assert!(ready(&segs, 1000 + 150 * k), "its epoch ended at the break");
        assert!(!ready(&segs, 1001 + 200 * k), "no round after it");
    }

    /// The epoch kept as the segments grow is the one found by looking at all of them.
    #[test]
    fn the_epoch_kept_as_segments_grow_is_the_one_of_all_of_them() {
        let mut segs = Vec::new();
        let mut kept = EpochStart::default();
        for (k, is_break) in [false, false, true, false, false, true, true, false]
            .into_iter()
            .enumerate()
        {
            let start = 1000 * (k as u64 + 1);
            let r = Reading {
                offset: 0,
                before: start,
                after: start,
            };
            segs.push(SyncSegment {
                is_break,
                ..exact_segment(0, 0, start, r)
            });
            let (a, b) = (
                kept.epoch(&segs).unwrap(),
                EpochStart::default().epoch(&segs).unwrap(),
            );
            assert_eq!((a.first, a.span), (b.first, b.span), "{k}");
        }
    }
}
