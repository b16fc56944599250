//! Streaming conversion: amortized O(1) per timestamp for non-decreasing guest streams.
//!
//! Trace events of one vCPU arrive in guest-time order, so the segment of the next event is
//! almost always the current one or the next. The cursor keeps the current segment and the
//! guest range where its fast path is valid; moving forward gallops (1, 2, 4, … segments, then
//! a binary search in the last step), so even a sparse stream that skips many segments pays
//! O(log gap), and a dense one pays O(1). Going backwards costs one binary search.

use super::error::ConvertError;
use super::lookup::Timeline;
use super::segment::Segment;
use super::{exact_inverse, fast};
use crate::units::{GuestTicks, HostTicks};

impl<'a> Timeline<'a> {
    /// A streaming converter positioned on the first segment.
    #[must_use]
    pub fn cursor(&self) -> Cursor<'a> {
        Cursor::new(*self)
    }

    /// Converts `ticks` (guest ticks in, host ticks out) in place with a fresh [`Cursor`]; see
    /// [`Cursor::try_convert_slice_floor`].
    ///
    /// # Errors
    ///
    /// [`ConvertError`] names the first element whose host value is out of range.
    pub fn try_convert_slice_floor(&self, ticks: &mut [u64]) -> Result<(), ConvertError> {
        self.cursor().try_convert_slice_floor(ticks)
    }
}

/// A position in a [`Timeline`] that converts guest ticks to host ticks, fastest when the ticks
/// do not decrease. Results equal [`Timeline::try_convert_floor`] for every input sequence.
#[derive(Clone, Copy, Debug)]
pub struct Cursor<'a> {
    timeline: Timeline<'a>,
    /// Index of `segment` in the timeline.
    index: usize,
    /// The current segment.
    segment: &'a Segment,
    /// Last guest tick (inclusive) the current segment applies to.
    end: u64,
    /// Guest distance from the segment start up to which (inclusive) the unchecked fast path is
    /// exact: inside the segment and no overflow, `min(end - start, segment.fast_span)`.
    fast_span: u64,
}

impl<'a> Cursor<'a> {
    /// A cursor on the first segment of `timeline`.
    #[must_use]
    pub fn new(timeline: Timeline<'a>) -> Self {
        let segments = timeline.segments();
        // A Timeline is never empty; this arm only satisfies the type system.
        let (first, rest) = segments.split_first().unwrap_or((&EMPTY_GUARD, &[]));
        let mut cursor = Self {
            timeline,
            index: 0,
            segment: first,
            end: 0,
            fast_span: 0,
        };
        cursor.set_bounds(rest.first());
        cursor
    }

    /// Index of the segment the cursor is on.
    #[must_use]
    pub const fn segment_index(&self) -> usize {
        self.index
    }

    /// Converts one guest tick, rounding down; `None` if the host value is below 0 or above
    /// `u64::MAX`. Amortized O(1) when calls come in non-decreasing guest order.
    #[must_use]
    pub fn try_convert_floor(&mut self, guest: GuestTicks) -> Option<HostTicks> {
        self.seek(guest.0);
        self.segment.try_convert_floor(guest)
    }

    /// Converts `ticks` in place, guest ticks in, host ticks out, each rounded down: the batch
    /// fast path. Results equal [`Cursor::try_convert_floor`] element by element.
    ///
    /// While the input stays inside the current segment's fast range, each element costs one
    /// wrapping subtract and compare (checked eight at a time; it tests both ends of the range
    /// at once), one 64×64→128 multiply and a few adds; no bounds checks and no overflow checks,
    /// because the range was computed so that none can fail (see the `fast` module). Anything
    /// else (next segment, a backwards step, a value near overflow) takes the checked path for
    /// that one element.
    ///
    /// # Errors
    ///
    /// [`ConvertError`] with the index of the first element whose host value is out of range;
    /// elements before it are converted, it and those after it are unchanged.
    pub fn try_convert_slice_floor(&mut self, ticks: &mut [u64]) -> Result<(), ConvertError> {
        let mut rest = ticks;
        let mut done = 0usize;
        loop {
            let run = match self.segment.kvm() {
                None => fast::convert_run(self.segment, self.fast_span, rest),
                Some(map) => exact_inverse::convert_run(self.segment, map, self.fast_span, rest),
            };
            done += run;
            let Some((tick, tail)) = rest.get_mut(run..).and_then(<[u64]>::split_first_mut) else {
                return Ok(());
            };
            *tick = self
                .try_convert_floor(GuestTicks(*tick))
                .ok_or(ConvertError { index: done })?
                .0;
            done += 1;
            rest = tail;
        }
    }

    /// Moves to the segment that applies to `t`.
    fn seek(&mut self, t: u64) {
        if t > self.end {
            self.seek_forward(t);
        } else if t < self.segment.start && self.index > 0 {
            let index = self.timeline.segment_index(GuestTicks(t));
            self.go_to(index);
        }
    }

    /// Moves forward to the segment of `t`, known to be after the current one: try the next
    /// segment, then gallop.
    fn seek_forward(&mut self, t: u64) {
        let segments = self.timeline.segments();
        let after = self.index + 1;
        let Some(ahead) = segments.get(after..) else {
            return;
        };
        // ahead[0].start <= t because t > end = ahead[0].start - 1. Find the first power of
        // two `hi` with ahead[hi].start > t (or past the end); the answer is in [hi/2, hi).
        let mut hi = 1usize;
        while ahead.get(hi).is_some_and(|s| s.start <= t) {
            hi = hi.saturating_mul(2);
        }
        let lo = hi / 2;
        let window = ahead.get(lo..hi.min(ahead.len())).unwrap_or(&[]);
        let within = window.partition_point(|s| s.start <= t).saturating_sub(1);
        self.go_to(after + lo + within);
    }

    /// Makes segment `index` current (ignored if out of range, which validation rules out).
    fn go_to(&mut self, index: usize) {
        let segments = self.timeline.segments();
        if let Some(segment) = segments.get(index) {
            self.index = index;
            self.segment = segment;
            self.set_bounds(segments.get(index + 1));
        }
    }

    /// Recomputes `end` and `fast_span` for the current segment given its successor.
    fn set_bounds(&mut self, next: Option<&Segment>) {
        // Validation made starts strictly increasing, so next.start >= 1.
        self.end = next.map_or(u64::MAX, |n| n.start.saturating_sub(1));
        self.fast_span = self
            .end
            .saturating_sub(self.segment.start)
            .min(self.segment.fast_span);
    }
}

/// Stand-in for the first segment of an empty slice, which a [`Timeline`] cannot hold.
static EMPTY_GUARD: Segment = Segment::identity(GuestTicks(0));

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::vec::Vec;

    /// One random segment kind starting at `start`; an unrepresentable choice falls back to the
    /// identity so that every generated timeline has all its starts.
    #[derive(Clone, Debug)]
    enum Kind {
        Identity,
        Offset(i64),
        Ppb {
            anchor_off: i64,
            host: u64,
            ppb: i64,
        },
        Ratio {
            anchor_off: i64,
            host: u64,
            num: u64,
            den: u64,
        },
        Kvm {
            offset: i64,
            ratio: u64,
            frac: u32,
        },
    }

    fn kind() -> impl Strategy<Value = Kind> {
        prop_oneof![
            Just(Kind::Identity),
            any::<i64>().prop_map(|o| Kind::Offset(o >> 8)),
            (-(1i64 << 40)..1 << 40, any::<u64>(), -500_000i64..500_000).prop_map(
                |(anchor_off, host, ppb)| Kind::Ppb {
                    anchor_off,
                    host,
                    ppb
                }
            ),
            (-(1i64 << 40)..1 << 40, any::<u64>(), 1u64.., 1u64..).prop_map(
                |(anchor_off, host, num, den)| Kind::Ratio {
                    anchor_off,
                    host,
                    num,
                    den
                }
            ),
            (any::<i64>(), (1u64 << 47)..(1 << 49), Just(48u32)).prop_map(
                |(offset, ratio, frac)| Kind::Kvm {
                    offset,
                    ratio,
                    frac
                }
            ),
        ]
    }

    fn build(start: u64, kind: &Kind) -> Segment {
        let g = GuestTicks(start);
        let built = match *kind {
            Kind::Identity => Some(Segment::identity(g)),
            Kind::Offset(o) => Segment::try_offset(g, o),
            Kind::Ppb {
                anchor_off,
                host,
                ppb,
            } => Segment::try_from_anchor_ppb(
                g,
                GuestTicks(start.saturating_add_signed(anchor_off)),
                HostTicks(host),
                ppb,
            ),
            Kind::Ratio {
                anchor_off,
                host,
                num,
                den,
            } => Segment::try_from_anchor_ratio(
                g,
                GuestTicks(start.saturating_add_signed(anchor_off)),
                HostTicks(host),
                num,
                den,
            ),
            Kind::Kvm {
                offset,
                ratio,
                frac,
            } => Segment::try_from_kvm(g, offset, ratio, frac),
        };
        built.unwrap_or(Segment::identity(g))
    }

    /// Random timelines: a random first start (sometimes near 0 or `u64::MAX`), gaps from 1
    /// tick to 2^40, random kinds.
    fn segments() -> impl Strategy<Value = Vec<Segment>> {
        (
            prop_oneof![
                Just(0u64),
                any::<u64>().prop_map(|v| v >> 2),
                (u64::MAX - (1 << 44))..
            ],
            prop::collection::vec(
                (prop_oneof![1u64..4, 1u64..1 << 20, 1u64..1 << 40], kind()),
                1..40,
            ),
        )
            .prop_map(|(first, parts)| {
                let mut out = Vec::new();
                let mut start = first;
                for (gap, kind) in parts {
                    out.push(build(start, &kind));
                    match start.checked_add(gap) {
                        Some(next) => start = next,
                        None => break,
                    }
                }
                out
            })
    }

    /// Guest ticks that hit segment edges often: a start, one before it, or a random distance
    /// after it; sometimes any u64.
    fn ticks(segs: &[Segment], picks: &[(prop::sample::Index, u8, u64)]) -> Vec<u64> {
        picks
            .iter()
            .map(|(ix, how, far)| {
                let s = ix.get(segs).start;
                match how % 5 {
                    0 => s,
                    1 => s.wrapping_sub(1),
                    2 => s.saturating_add(far >> 24),
                    3 => s.saturating_add(far >> 44),
                    _ => *far,
                }
            })
            .collect()
    }

    fn pick() -> impl Strategy<Value = Vec<(prop::sample::Index, u8, u64)>> {
        prop::collection::vec(
            (any::<prop::sample::Index>(), any::<u8>(), any::<u64>()),
            0..300,
        )
    }

    /// Checks that both streaming APIs give exactly the random-access results for `stream`.
    fn check_stream(timeline: Timeline<'_>, stream: &[u64]) -> Result<(), TestCaseError> {
        let expected: Vec<Option<u64>> = stream
            .iter()
            .map(|&g| timeline.try_convert_floor(GuestTicks(g)).map(|h| h.0))
            .collect();
        let mut cursor = timeline.cursor();
        for (i, (&g, want)) in stream.iter().zip(&expected).enumerate() {
            let got = cursor.try_convert_floor(GuestTicks(g)).map(|h| h.0);
            prop_assert_eq!(got, *want, "element {} guest {}", i, g);
            prop_assert_eq!(
                cursor.segment_index(),
                timeline.segment_index(GuestTicks(g))
            );
        }
        // The batch API, resumed after each error like a caller skipping bad elements.
        let mut batch = stream.to_vec();
        let mut cursor = timeline.cursor();
        let mut from = 0;
        while from <= batch.len() {
            let Some(rest) = batch.get_mut(from..) else {
                break;
            };
            match cursor.try_convert_slice_floor(rest) {
                Ok(()) => break,
                Err(e) => {
                    let at = from + e.index;
                    prop_assert_eq!(
                        expected[at],
                        None,
                        "batch failed at {} guest {}",
                        at,
                        stream[at]
                    );
                    prop_assert_eq!(batch[at], stream[at], "failed element must be untouched");
                    prop_assert!(
                        batch[at + 1..] == stream[at + 1..],
                        "tail must be untouched"
                    );
                    batch[at] = u64::MAX; // mark, compared below
                    from = at + 1;
                }
            }
        }
        for (i, want) in expected.iter().enumerate() {
            prop_assert_eq!(
                batch[i],
                want.unwrap_or(u64::MAX),
                "batch element {} guest {}",
                i,
                stream[i]
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Monotone streams: the cursor and the batch path equal random access.
        #[test]
        fn cursor_equals_random_access_monotone(segs in segments(), picks in pick()) {
            let timeline = Timeline::new(&segs).unwrap();
            let mut stream = ticks(&segs, &picks);
            stream.sort_unstable();
            check_stream(timeline, &stream)?;
        }

        /// Monotone streams with occasional backward jumps (and the forward jump after each).
        #[test]
        fn cursor_equals_random_access_with_backward_jumps(
            segs in segments(),
            picks in pick(),
            jumps in prop::collection::vec((any::<prop::sample::Index>(), any::<prop::sample::Index>()), 0..8),
        ) {
            let timeline = Timeline::new(&segs).unwrap();
            let mut stream = ticks(&segs, &picks);
            stream.sort_unstable();
            if !stream.is_empty() {
                for (at, to) in &jumps {
                    let at = at.index(stream.len());
                    let to = to.index(at + 1);
                    stream[at] = stream[to];
                }
            }
            check_stream(timeline, &stream)?;
        }

        /// Unsorted random ticks: still equal, only slower.
        #[test]
        fn cursor_equals_random_access_unsorted(segs in segments(), picks in pick()) {
            let timeline = Timeline::new(&segs).unwrap();
            check_stream(timeline, &ticks(&segs, &picks))?;
        }
    }

    #[test]
    fn batch_kernels_match_random_access_on_long_runs() {
        // Both kernel shapes: unit, ppb and KVM slopes take the Q64.64 kernel (shift <= 64);
        // a slope of 1/1000 (shift > 64) takes the general one. Runs of hundreds of ticks per
        // segment exercise the eight-wide chunks, their tails and the chunk that leaves a segment.
        let g = GuestTicks;
        let segs = [
            Segment::identity(g(1_000)),
            Segment::try_from_anchor_ppb(g(50_000), g(49_000), HostTicks(60_000), -12_345).unwrap(),
            Segment::try_from_anchor_ratio(g(90_001), g(90_001), HostTicks(100_000), 1, 1_000)
                .unwrap(),
            Segment::try_from_kvm(g(150_000), 777, (1 << 48) + 12_345_678, 48).unwrap(),
            Segment::try_from_anchor_ratio(g(200_000), g(0), HostTicks(0), 1_000_001, 1_000_000)
                .unwrap(),
        ];
        assert!(segs[2].slope().shift() > 64 && segs[1].slope().shift() <= 64);
        let timeline = Timeline::new(&segs).unwrap();
        let stream: Vec<u64> = (0..300_000u64).step_by(7).chain(250_000..250_100).collect();
        let mut batch = stream.clone();
        timeline.try_convert_slice_floor(&mut batch).unwrap();
        for (&guest, &host) in stream.iter().zip(&batch) {
            assert_eq!(
                Some(HostTicks(host)),
                timeline.try_convert_floor(GuestTicks(guest)),
                "guest {guest}"
            );
        }
    }

    #[test]
    fn sparse_forward_gallops_to_the_right_segment() {
        let segs: Vec<Segment> = (0..1000u64)
            .map(|i| Segment::try_offset(GuestTicks(i * 100), i64::try_from(i).unwrap()).unwrap())
            .collect();
        let timeline = Timeline::new(&segs).unwrap();
        let mut cursor = timeline.cursor();
        for (g, index) in [
            (5, 0),
            (100, 1),
            (99_999, 999),
            (150, 1),
            (250, 2),
            (77_777, 777),
        ] {
            let host = cursor.try_convert_floor(GuestTicks(g));
            assert_eq!(cursor.segment_index(), index, "guest {g}");
            assert_eq!(
                host,
                Some(HostTicks(g + u64::try_from(index).unwrap())),
                "guest {g}"
            );
        }
    }

    #[test]
    fn batch_reports_first_unmappable_element() {
        // Host = guest - 1000 before guest 5000 and guest + 2^63 - 1 after it (near overflow).
        let segs = [
            Segment::try_offset(GuestTicks(2_000), -1_000).unwrap(),
            Segment::try_offset(GuestTicks(5_000), i64::MAX).unwrap(),
        ];
        let timeline = Timeline::new(&segs).unwrap();
        let mut ticks = [999, 1_000, 4_999, 5_000, 1 << 63, (1 << 63) + 1, 7];
        let err = timeline
            .try_convert_slice_floor(&mut ticks[..])
            .unwrap_err();
        assert_eq!(err, ConvertError { index: 0 });
        assert_eq!(ticks[0], 999);
        let err = timeline
            .try_convert_slice_floor(&mut ticks[1..])
            .unwrap_err();
        assert_eq!(err, ConvertError { index: 4 });
        assert_eq!(ticks[1..5], [0, 3_999, 5_000 + (1 << 63) - 1, u64::MAX]);
        assert_eq!(ticks[5..], [(1 << 63) + 1, 7]);
    }
}
