//! A vCPU's accounting of the event batches the agent sends: which records arrived twice,
//! which were lost in transit, and what a flight ring overwrote before sending them. Exact
//! from the batches' `first` indices and the rings' own counters.

use vmtsync_core::proto::EventBatch;

/// Where a batch of `len` records whose first has index `first` stands against the index the
/// next record should have (`expected`, `None` before the first batch): how many of its records
/// were delivered already (skip them), how many the agent sent before it that never arrived,
/// and the next expected index.
pub(super) fn account(expected: Option<u64>, first: u64, len: usize) -> (usize, u64, u64) {
    let end = first.saturating_add(len as u64);
    match expected {
        None => (0, 0, end),
        Some(n) if first < n => (
            usize::try_from(n - first).unwrap_or(usize::MAX).min(len),
            0,
            n.max(end),
        ),
        Some(n) => (0, first - n, end),
    }
}

/// One vCPU's accounting of its batches: where the next record should start, and what the
/// guest says it lost before it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Ledger {
    /// The index the next batch's first record should have (`None` before the first batch).
    pub(super) next: Option<u64>,
    /// Events a stop-when-full ring refused (its cumulative counter; they have no index).
    pub(super) refused: u64,
    /// Records a flight ring overwrote before they were sent, attributed gap by gap.
    pub(super) overwritten: u64,
    /// The flight ring's cumulative `dropped` already attributed.
    pub(super) attributed: u64,
}

impl Ledger {
    /// Accounts batch `b`: returns how many of its records were delivered already (skip
    /// them) and how many records sent before it never arrived. A flight ring's `dropped`
    /// counts only records below `first`, so the growth since the last batch is the part of
    /// the gap in indices the ring overwrote (never more than the gap: a guest cannot make
    /// the host count more than it missed); the rest of the gap was lost in transit. Before
    /// the first batch the host expected nothing, so the ring's whole count (at most `first`)
    /// is what it overwrote.
    pub(super) fn batch(&mut self, b: &EventBatch) -> (usize, u64) {
        let (skip, gap, next) = account(self.next, b.first, b.records.len());
        let mut lost = gap;
        if b.overwrite {
            let new = b.dropped.saturating_sub(self.attributed);
            let over = if self.next.is_none() {
                new.min(b.first)
            } else {
                new.min(gap)
            };
            self.overwritten += over;
            lost -= over.min(lost);
            self.attributed = self.attributed.max(b.dropped);
        } else {
            self.refused = self.refused.max(b.dropped);
        }
        self.next = Some(next);
        (skip, lost)
    }
}
