//! One ftrace ring-buffer page: the 16-byte page header, then events with 5/27-bit headers,
//! time deltas and time extends, exactly as `kernel/trace/ring_buffer.c` lays them out and
//! libtraceevent's `kbuffer-parse.c` reads them back. [`PageBuf`] fills one (the trace.dat
//! writer); [`walk_records`] reads one back (the trace.dat reader, and the live pages
//! `trace_pipe_raw` returns, `crate::ftrace::raw`).
//!
//! The page timestamp is the first event's timestamp and that event's delta is 0. A later event
//! stores the distance to the previous one: in the header's 27 bits when it fits, else behind a
//! `TIME_EXTEND` record (27 + 32 bits) with the event's own delta 0. A gap beyond 59 bits, or an
//! event that does not fit the page, closes the page; the caller starts a new one (a page
//! timestamp is absolute, so any gap is representable across pages).

use super::consts::{
    MAX_DELTA, MAX_EXTENDED_DELTA, PAGE_DATA_SIZE, PAGE_HEADER_SIZE, PAGE_SIZE, TS_SHIFT,
    TYPE_DATA_MAX, TYPE_PADDING, TYPE_TIME_EXTEND, TYPE_TIME_STAMP,
};
use super::format::{
    EVENT_DATA_ID, EVENT_ID, EVENT_SIZE, MAX_PAYLOAD, PAYLOAD_AT, event_data_size, payload_loc,
};

/// A page under construction, in a store of one or more whole pages: the page at `at` is
/// filled, and [`PageBuf::seal`] moves to the next one, back to the first after the last. A
/// store of one page is reused page after page; a longer one collects the sealed pages so
/// that they go out as they are ([`PageBuf::take_store`]), with no copy.
#[derive(Debug)]
pub(super) struct PageBuf {
    store: Vec<u8>,
    /// The page being filled.
    at: usize,
    /// Data bytes used after the page header (the future `commit`).
    used: usize,
    /// Timestamp of the last event on the page.
    last_ts: u64,
    /// Events on the page.
    events: u32,
}

impl PageBuf {
    pub(super) fn new() -> Self {
        Self::with_pages(1)
    }

    /// A store of `pages` pages (at least one).
    pub(super) fn with_pages(pages: usize) -> Self {
        Self {
            store: vec![0; pages.max(1) * PAGE_SIZE],
            at: 0,
            used: 0,
            last_ts: 0,
            events: 0,
        }
    }

    /// The pages sealed since the store began: all of them right after the last one was
    /// sealed (then `at` is back at the first).
    pub(super) fn sealed(&self) -> usize {
        self.at
    }

    /// The store's pages.
    pub(super) fn pages(&self) -> usize {
        self.store.len() / PAGE_SIZE
    }

    /// Hands the store out (its sealed pages: [`Self::sealed`], or all of them) and fills
    /// `fresh` from its first page on (as many whole pages as it holds, at least one).
    pub(super) fn take_store(&mut self, mut fresh: Vec<u8>) -> Vec<u8> {
        if fresh.len() < PAGE_SIZE {
            fresh.resize(PAGE_SIZE, 0);
        }
        fresh.truncate(fresh.len() / PAGE_SIZE * PAGE_SIZE);
        self.at = 0;
        std::mem::replace(&mut self.store, fresh)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.events == 0
    }

    /// The timestamp of the page's last event (of the page before when it is empty).
    pub(super) fn last_ts(&self) -> u64 {
        self.last_ts
    }

    /// Appends an event at `ts` (not before the page's last event: the caller checks), or
    /// returns `false` if it needs a new page. `payload` is at most [`MAX_PAYLOAD`] bytes
    /// (checked by the caller).
    #[inline]
    pub(super) fn try_push(&mut self, ts: u64, id: u32, payload: &[u8]) -> bool {
        debug_assert!(payload.len() <= MAX_PAYLOAD);
        let mut padded = [0u8; MAX_PAYLOAD];
        let len = payload.len().min(MAX_PAYLOAD);
        padded[..len].copy_from_slice(&payload[..len]);
        self.try_push_padded(ts, id, len, &padded)
    }

    /// [`Self::try_push`] of the payload `padded[..len]`, whose bytes past `len` are zero (`len`
    /// at most [`MAX_PAYLOAD`]): every store has a fixed size.
    #[inline(always)]
    pub(super) fn try_push_padded(
        &mut self,
        ts: u64,
        id: u32,
        len: usize,
        padded: &[u8; MAX_PAYLOAD],
    ) -> bool {
        debug_assert!(len <= MAX_PAYLOAD);
        let size = if len == 0 {
            EVENT_SIZE
        } else {
            event_data_size(len)
        };
        let Some((at, event_delta)) = self.reserve(ts, size) else {
            return false;
        };
        // The record is assembled in registers and stored in fixed-size pieces: header word,
        // then common_type, zero flags/preempt_count/pid, id; for `event_data` then the
        // payload's `__data_loc` word and its 8 or 16 bytes (little endian throughout).
        // type_len counts 4-byte words of data.
        let (type_len, event) = if len == 0 {
            (3, EVENT_ID)
        } else {
            (words(size), EVENT_DATA_ID)
        };
        let w0 = u64::from(type_len | (event_delta << 5)) | (u64::from(event) << 32);
        let w1 = u64::from(id) << 32;
        let head = (u128::from(w1) << 64) | u128::from(w0);
        let page = page_at(&mut self.store, self.at);
        page[at..at + 16].copy_from_slice(&head.to_le_bytes());
        if len > 0 {
            put_payload(page, at, len, padded);
        }
        true
    }

    /// Appends `event(r)` for each `r` of `recs` in turn, the way [`Self::try_push_padded`]
    /// would, while it is `Some`, not before the page's last event, and fits this page with
    /// no time extend. The page must hold an event already (its timestamp is set). One
    /// loop with a store per piece and no call per event: the memory path's runs go through
    /// it. Returns how many it appended and why it stopped.
    #[inline(always)]
    pub(super) fn fill_padded<R>(
        &mut self,
        recs: &[R],
        event: &impl Fn(&R) -> Option<Padded>,
    ) -> (usize, Stop) {
        debug_assert!(self.events > 0);
        // The page's counters in locals (stored back once): the stores into the page could
        // otherwise alias them, and each would be stored again per event.
        let (mut used, mut last_ts, mut events) = (self.used, self.last_ts, self.events);
        let page = page_at(&mut self.store, self.at);
        let mut stop = Stop::End;
        let mut k = 0;
        for r in recs {
            let Some(e) = event(r) else {
                stop = Stop::Refused;
                break;
            };
            // Wrapping: an event before the page's last shows as a delta above MAX_DELTA.
            let delta = e.ts.wrapping_sub(last_ts);
            let (size, type_len, id) = if e.len == 0 {
                (EVENT_SIZE, 3, EVENT_ID)
            } else {
                let size = event_data_size(e.len);
                (size, words(size), EVENT_DATA_ID)
            };
            // Room for the longest record ([`FILL_ROOM`]) whatever this one's size, so that
            // every piece below is stored at once, past the record's end too (the next
            // record overwrites those bytes, [`Self::seal`] zeroes what is left); a page's
            // last few records take the general path instead.
            let Some(rec) = page
                .get_mut(PAGE_HEADER_SIZE + used..PAGE_SIZE)
                .and_then(|tail| tail.first_chunk_mut::<FILL_ROOM>())
                .filter(|_| delta <= MAX_DELTA && e.len <= MAX_PAYLOAD)
            else {
                stop = if e.ts < last_ts {
                    Stop::Refused
                } else {
                    Stop::General(e)
                };
                break;
            };
            // As `try_push_padded`: header word, common_type, zero flags/preempt_count/pid,
            // id; then (meaningful for `event_data` only) the payload's `__data_loc` word
            // and its 16 bytes.
            let delta = u32::try_from(delta).unwrap_or(0);
            let w0 = u64::from(type_len | (delta << 5)) | (u64::from(id) << 32);
            let w1 = u64::from(e.id) << 32;
            let (lo, hi) = e.payload.split_at(8);
            rec[..8].copy_from_slice(&w0.to_le_bytes());
            rec[8..16].copy_from_slice(&w1.to_le_bytes());
            rec[16..20].copy_from_slice(&payload_loc(e.len).to_le_bytes());
            rec[20..28].copy_from_slice(lo);
            rec[28..36].copy_from_slice(hi);
            used += 4 + size;
            last_ts = e.ts;
            events += 1;
            k += 1;
        }
        (self.used, self.last_ts, self.events) = (used, last_ts, events);
        (k, stop)
    }

    /// Appends a record of another event type at `ts` (same rules as [`Self::try_push`]):
    /// `data` is the whole record from `common_type` on, a multiple of 4 bytes from 8 to
    /// `4 * TYPE_DATA_MAX` (checked by the caller).
    pub(super) fn try_push_raw(&mut self, ts: u64, data: &[u8]) -> bool {
        debug_assert!(
            data.len().is_multiple_of(4) && (8..=4 * TYPE_DATA_MAX as usize).contains(&data.len())
        );
        let Some((at, event_delta)) = self.reserve(ts, data.len()) else {
            return false;
        };
        let type_len = u32::try_from(data.len() / 4).unwrap_or(0);
        let page = page_at(&mut self.store, self.at);
        page[at..at + 4].copy_from_slice(&(type_len | (event_delta << 5)).to_le_bytes());
        page[at + 4..at + 4 + data.len()].copy_from_slice(data);
        true
    }

    /// Makes room for a record of `size` data bytes at `ts` (a time extend first when the
    /// delta needs one) and counts it; returns where its header goes and the delta it
    /// carries, or `None` when the page cannot take it.
    #[inline]
    fn reserve(&mut self, ts: u64, size: usize) -> Option<(usize, u32)> {
        let page = page_at(&mut self.store, self.at);
        let delta = if self.events == 0 {
            page[..8].copy_from_slice(&ts.to_le_bytes());
            0
        } else {
            let delta = ts - self.last_ts;
            if delta > MAX_EXTENDED_DELTA {
                return None;
            }
            delta
        };
        let extend = delta > MAX_DELTA;
        let need = 4 + size + if extend { 8 } else { 0 };
        if self.used + need > PAGE_DATA_SIZE {
            return None;
        }
        let mut at = PAGE_HEADER_SIZE + self.used;
        let event_delta = if extend {
            // The low 27 bits ride in the header, the rest in array[0].
            let low = u32::try_from(delta & MAX_DELTA).unwrap_or(0);
            let high = u32::try_from(delta >> TS_SHIFT).unwrap_or(u32::MAX);
            let ext = u64::from(TYPE_TIME_EXTEND | (low << 5)) | (u64::from(high) << 32);
            page[at..at + 8].copy_from_slice(&ext.to_le_bytes());
            at += 8;
            0
        } else {
            u32::try_from(delta).unwrap_or(0)
        };
        self.used += need;
        self.last_ts = ts;
        self.events += 1;
        Some((at, event_delta))
    }

    /// Seals the page (writes `commit`, zeroes the unused tail) and returns it; the next page
    /// of the store (the first after the last) is filled next, empty.
    pub(super) fn seal(&mut self) -> &[u8; PAGE_SIZE] {
        let commit = self.used as u64;
        let sealed = self.at;
        let page = page_at(&mut self.store, sealed);
        page[8..16].copy_from_slice(&commit.to_le_bytes());
        page[PAGE_HEADER_SIZE + self.used..].fill(0);
        self.used = 0;
        self.events = 0;
        self.at = (sealed + 1) % self.pages();
        page_at(&mut self.store, sealed)
    }
}

/// The `type_len` of a record with `size` data bytes (a multiple of 4, at most
/// `4 * TYPE_DATA_MAX`): its 4-byte words.
#[inline(always)]
fn words(size: usize) -> u32 {
    u32::try_from(size / 4).unwrap_or(0)
}

/// An `event_data`'s payload into the record at `at` (4 header bytes, then the data): its
/// `__data_loc` word, then `padded`'s first 8 bytes, and the other 8 when `len` is above 8
/// ([`event_data_size`]: only the record's own bytes are written).
#[inline(always)]
fn put_payload(page: &mut [u8; PAGE_SIZE], at: usize, len: usize, padded: &[u8; MAX_PAYLOAD]) {
    let p = at + 4 + PAYLOAD_AT;
    page[p - 4..p].copy_from_slice(&payload_loc(len).to_le_bytes());
    page[p..p + 8].copy_from_slice(&padded[..8]);
    if len > 8 {
        page[p + 8..p + 16].copy_from_slice(&padded[8..]);
    }
}

/// The bytes [`PageBuf::fill_padded`] stores per record: the longest record (an
/// `event_data` with a 16-byte payload) and its 4-byte header.
const FILL_ROOM: usize = 4 + PAYLOAD_AT + MAX_PAYLOAD;

/// Page `at` of a store of whole pages.
#[inline(always)]
fn page_at(store: &mut [u8], at: usize) -> &mut [u8; PAGE_SIZE] {
    &mut store.as_chunks_mut::<PAGE_SIZE>().0[at]
}

/// An event the way [`PageBuf::fill_padded`] takes it: at `ts`, event `id`, its payload
/// `payload[..len]` with the bytes past `len` zero.
#[derive(Clone, Copy, Debug)]
pub struct Padded {
    /// Its timestamp.
    pub ts: u64,
    /// The event id.
    pub id: u32,
    /// Payload bytes used.
    pub len: usize,
    /// The payload, zero past `len`.
    pub payload: [u8; MAX_PAYLOAD],
}

/// Why [`PageBuf::fill_padded`] stopped.
#[derive(Clone, Copy, Debug)]
pub(super) enum Stop {
    /// Every record was appended.
    End,
    /// A record gave no event, or one before the page's last.
    Refused,
    /// This event needs a time extend or a new page (or is too long): the general path.
    General(Padded),
}

/// Why a page could not be walked: the byte offset in the page and what was wrong there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PageError {
    /// Offset of the damage from the start of the page.
    pub(crate) at: usize,
    /// What is wrong.
    pub(crate) reason: &'static str,
}

/// Calls `f(timestamp, data_offset, record)` for every data record of `page` in order,
/// checking that every record lies inside the page's `commit`; `record` starts at the event's
/// `common_type`. Padding and time records are applied, not passed on. `f` returning `false`
/// stops the walk. Returns how many records `f` saw.
///
/// # Errors
/// [`PageError`] for a page shorter than its header, a `commit` beyond the page, or a record
/// that crosses `commit`. Nothing in `page` can make this panic.
pub(crate) fn walk_records(
    page: &[u8],
    mut f: impl FnMut(u64, usize, &[u8]) -> bool,
) -> Result<u64, PageError> {
    let hdr = PAGE_HEADER_SIZE;
    let bad = |at: usize, reason: &'static str| PageError { at, reason };
    if page.len() < hdr {
        return Err(bad(0, "page shorter than its header"));
    }
    let rd32 = |at: usize| u32::from_le_bytes(page[at..at + 4].try_into().unwrap_or([0; 4]));
    let mut ts = u64::from_le_bytes(page[..8].try_into().unwrap_or([0; 8]));
    // The upper bits of `commit` flag missed events; the size is the low 27 bits.
    let commit =
        (u64::from_le_bytes(page[8..16].try_into().unwrap_or([0; 8])) & 0x07ff_ffff) as usize;
    if hdr + commit > page.len() {
        return Err(bad(8, "page commit exceeds the page"));
    }
    let end = hdr + commit;
    let mut at = hdr;
    let mut n = 0;
    while at < end {
        if at + 4 > end {
            return Err(bad(at, "event header crosses the page's commit"));
        }
        let h = rd32(at);
        let type_len = h & 31;
        let delta = u64::from(h >> 5);
        let array = |at: usize| {
            if at + 8 > end {
                Err(bad(at, "event length word crosses the page's commit"))
            } else {
                Ok(rd32(at + 4))
            }
        };
        match type_len {
            TYPE_PADDING => {
                // A padding with delta 0 fills the rest of the page.
                if delta == 0 {
                    break;
                }
                let len = array(at)? as usize;
                at += 4 + len;
                continue;
            }
            TYPE_TIME_EXTEND => {
                ts = ts.wrapping_add((u64::from(array(at)?) << 27) + delta);
                at += 8;
                continue;
            }
            TYPE_TIME_STAMP => {
                let msb = ts & !((1u64 << 59) - 1);
                ts = ((u64::from(array(at)?) << 27) + delta) | msb;
                at += 8;
                continue;
            }
            _ => {}
        }
        let (data, len) = if type_len == 0 {
            let l = (array(at)? as usize).saturating_sub(4).next_multiple_of(4);
            (at + 8, l)
        } else {
            debug_assert!(type_len <= TYPE_DATA_MAX);
            (at + 4, type_len as usize * 4)
        };
        if data + len > end {
            return Err(bad(at, "event data crosses the page's commit"));
        }
        ts = ts.wrapping_add(delta);
        n += 1;
        if !f(ts, data, &page[data..data + len]) {
            break;
        }
        at = data + len;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u32_at(p: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(p[at..at + 4].try_into().unwrap())
    }

    #[test]
    fn first_event_has_delta_zero_and_page_timestamp() {
        let mut p = PageBuf::new();
        assert!(p.try_push(1_000, 7, &[]));
        assert!(p.try_push(1_005, 8, &[1, 2, 3]));
        let page = p.seal().to_vec();
        assert_eq!(u64::from_le_bytes(page[..8].try_into().unwrap()), 1_000);
        assert_eq!(
            u64::from_le_bytes(page[8..16].try_into().unwrap()),
            (4 + 12 + 4 + 24) as u64
        );
        // Event 1: type_len 3, delta 0.
        assert_eq!(u32_at(&page, 16), 3);
        assert_eq!(u32_at(&page, 16 + 4 + 8), 7);
        // Event 2: type_len 6 (a payload of up to 8 bytes), delta 5, the payload's
        // `__data_loc` (at 16, 3 bytes), the payload and its zero padding.
        let e2 = 16 + 16;
        assert_eq!(u32_at(&page, e2), 6 | (5 << 5));
        assert_eq!(u32_at(&page, e2 + 4 + 12), 16 | 3 << 16);
        assert_eq!(&page[e2 + 4 + 16..e2 + 4 + 24], &[1, 2, 3, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn a_payload_above_8_bytes_takes_16() {
        let mut p = PageBuf::new();
        let payload: Vec<u8> = (1..=9).collect();
        assert!(p.try_push(1_000, 7, &payload));
        let page = p.seal().to_vec();
        assert_eq!(u64::from_le_bytes(page[8..16].try_into().unwrap()), 4 + 32);
        assert_eq!(u32_at(&page, 16), 8);
        assert_eq!(u32_at(&page, 16 + 4 + 12), 16 | 9 << 16);
        assert_eq!(&page[16 + 4 + 16..16 + 4 + 25], &payload[..]);
        assert_eq!(&page[16 + 4 + 25..16 + 4 + 32], &[0; 7]);
    }

    #[test]
    fn big_delta_gets_a_time_extend_and_huge_one_a_new_page() {
        let mut p = PageBuf::new();
        assert!(p.try_push(0, 1, &[]));
        let d = (1u64 << 40) + 12_345;
        assert!(p.try_push(d, 2, &[]));
        let page = p.seal().to_vec();
        let ext = 16 + 16;
        let h = u32_at(&page, ext);
        assert_eq!(h & 31, TYPE_TIME_EXTEND);
        let low = u64::from(h >> 5);
        let high = u64::from(u32_at(&page, ext + 4));
        assert_eq!((high << 27) | low, d);
        assert_eq!(u32_at(&page, ext + 8) >> 5, 0);
        assert!(p.try_push(0, 1, &[]));
        assert!(!p.try_push(1 << 60, 2, &[]));
    }

    #[test]
    fn page_fills_and_reports_full() {
        let mut p = PageBuf::new();
        let mut n = 0;
        while p.try_push(n, 0, &[0xaa; 16]) {
            n += 1;
        }
        assert_eq!(n, (PAGE_DATA_SIZE / 36) as u64);
        let page = p.seal();
        assert!(page[PAGE_HEADER_SIZE + 36 * 113..].iter().all(|&b| b == 0));
        assert!(p.is_empty());
    }
}
