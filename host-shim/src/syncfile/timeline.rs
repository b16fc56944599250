//! Guest→host conversion with a sync file: one vCPU's segments on `vmtsync_core::timeline`,
//! and the line filter behind `vmtsync convert --sync FILE --vcpu N`.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use vmtsync_core::timeline::{Segment, Timeline, TimelineError};
use vmtsync_core::{GuestTicks, HostTicks};

use super::reader::{LineRead, read_line_bounded};
use super::{SyncFile, SyncFileError, SyncSegment};

/// One vCPU's segments, sorted by guest start: the piecewise guest→host mapping, converted
/// by `vmtsync_core::timeline` (floor; before the first segment, the first is extrapolated
/// backwards).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncTimeline {
    records: Vec<SyncSegment>,
    segments: Vec<Segment>,
}

impl SyncTimeline {
    /// Pairs the records with their core segments (built by [`SyncFile::timeline`], which
    /// validated them).
    pub(super) fn new(records: Vec<SyncSegment>, segments: Vec<Segment>) -> Self {
        Self { records, segments }
    }

    /// The sync file records, by increasing `guest_start`.
    #[must_use]
    pub fn records(&self) -> &[SyncSegment] {
        &self.records
    }

    /// The core timeline over these segments.
    ///
    /// # Errors
    /// Never for a `SyncTimeline` from [`SyncFile::timeline`], which already checked what
    /// `Timeline::new` checks (non-empty, strictly increasing starts).
    pub fn timeline(&self) -> Result<Timeline<'_>, TimelineError> {
        Timeline::new(&self.segments)
    }

    /// Converts one guest tick, rounding down; `None` outside the host range. For streams use
    /// the core timeline's cursor (see [`convert_with_sync`]).
    #[must_use]
    pub fn try_host_from_guest_floor(&self, guest: GuestTicks) -> Option<HostTicks> {
        self.timeline().ok()?.try_convert_floor(guest)
    }
}

/// What [`convert_with_sync`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncConvertStats {
    /// Values converted and written.
    pub converted: u64,
    /// Bad lines skipped (with `skip_bad`).
    pub skipped: u64,
}

/// `vmtsync convert --sync FILE --vcpu N`: reads one decimal guest TSC per line from `input`,
/// writes the host TSC (rounded down, see the module docs) per line to `output`.
///
/// Lines may have surrounding blanks; anything else is a bad line: an error, or skipped and
/// counted when `skip_bad`. Memory is bounded (lines over 4 KiB are bad lines).
///
/// # Errors
/// The timeline errors of [`SyncFile::timeline`], [`SyncFileError::BadInput`],
/// [`SyncFileError::OutOfRange`], [`SyncFileError::Output`], [`SyncFileError::Io`].
pub fn convert_with_sync(
    sync: &SyncFile,
    vcpu: u32,
    input: &mut dyn BufRead,
    output: &mut dyn Write,
    skip_bad: bool,
) -> Result<SyncConvertStats, SyncFileError> {
    let timeline = sync.timeline(vcpu)?;
    let mut cursor = timeline
        .timeline()
        .map_err(|e| SyncFileError::BadLine {
            line: 0,
            why: e.to_string(),
        })?
        .cursor();
    let mut stats = SyncConvertStats::default();
    let mut line = Vec::with_capacity(32);
    let mut line_no = 0_u64;
    let mut input = input;
    loop {
        line.clear();
        let r = read_line_bounded(&mut input, &mut line).map_err(|source| SyncFileError::Io {
            path: PathBuf::from("<input>"),
            source,
        })?;
        if r == LineRead::Eof {
            break;
        }
        line_no += 1;
        let text = line.trim_ascii();
        let value =
            (r != LineRead::TooLong && !text.is_empty() && text.iter().all(u8::is_ascii_digit))
                .then(|| std::str::from_utf8(text).ok()?.parse::<u64>().ok())
                .flatten();
        let result = match value {
            None => Err(SyncFileError::BadInput {
                line: line_no,
                shown: text
                    .get(..text.len().min(64))
                    .unwrap_or_default()
                    .escape_ascii()
                    .to_string(),
            }),
            Some(v) => cursor
                .try_convert_floor(GuestTicks(v))
                .ok_or(SyncFileError::OutOfRange {
                    line: line_no,
                    value: v,
                }),
        };
        match result {
            Ok(h) => {
                writeln!(output, "{}", h.0).map_err(SyncFileError::Output)?;
                stats.converted += 1;
            }
            Err(_) if skip_bad => stats.skipped += 1,
            Err(e) => return Err(e),
        }
        if matches!(r, LineRead::Partial { .. }) {
            break;
        }
    }
    output.flush().map_err(SyncFileError::Output)?;
    Ok(stats)
}

/// [`SyncFile::read`] then [`convert_with_sync`]: the whole of `vmtsync convert --sync FILE
/// --vcpu N [--skip-bad]` between stdin and stdout.
///
/// # Errors
/// As [`SyncFile::read`] and [`convert_with_sync`].
pub fn convert_sync_file(
    path: &Path,
    vcpu: u32,
    input: &mut dyn BufRead,
    output: &mut dyn Write,
    skip_bad: bool,
) -> Result<SyncConvertStats, SyncFileError> {
    let sync = SyncFile::read(path)?;
    convert_with_sync(&sync, vcpu, input, output, skip_bad)
}

#[cfg(test)]
mod tests {
    use super::super::format::samples::{header, seg};
    use super::*;
    use proptest::prelude::*;

    fn file(segs: &[SyncSegment]) -> SyncFile {
        SyncFile {
            header: header(),
            segments: segs.to_vec(),
            lines: (2..).take(segs.len()).collect(),
            cut: None,
        }
    }

    #[test]
    fn timeline_is_piecewise_and_validated() {
        let a = seg(0, 0, 1_000_000, 5_000_000, 0);
        let b = seg(0, 1, 2_000_000, 5_000_500, 0);
        let other = seg(4, 0, 1_500_000, 7, 0);
        let f = file(&[a, other, b]);
        let t = f.timeline(0).unwrap();
        assert_eq!(t.records(), [a, b]);
        // Exact inverse of a pure offset inside each segment, and before the first.
        for g in [a.guest_start - 77, a.guest_start, b.guest_start - 1] {
            assert_eq!(
                t.try_host_from_guest_floor(GuestTicks(g)),
                Some(HostTicks(g - 5_000_000))
            );
        }
        for g in [b.guest_start, b.guest_start + 10_000_000] {
            assert_eq!(
                t.try_host_from_guest_floor(GuestTicks(g)),
                Some(HostTicks(g - 5_000_500))
            );
        }
        // Below host tick 0 is None, not a wrapped value.
        assert_eq!(t.try_host_from_guest_floor(GuestTicks(5)), None);
        let err = f.timeline(9).unwrap_err();
        assert!(
            matches!(&err, SyncFileError::NoSegments { vcpu: 9, present } if present == &[0, 4]),
            "{err}"
        );
        let err = file(&[b, a]).timeline(0).unwrap_err();
        assert!(
            matches!(err, SyncFileError::NotIncreasing { line: 3, vcpu: 0 }),
            "{err}"
        );
    }

    #[test]
    fn convert_with_sync_streams_lines() {
        let a = seg(2, 0, 1_000_000, 5_000_000, 0);
        let b = seg(2, 1, 2_000_000, 5_000_500, 1_000);
        let f = file(&[a, b]);
        let input = format!(
            "{}\n  {}  \n{}\n",
            a.guest_start,
            b.guest_anchor,
            b.guest_anchor + 1_000_000_000
        );
        let mut out = Vec::new();
        let stats = convert_with_sync(&f, 2, &mut input.as_bytes(), &mut out, false).unwrap();
        assert_eq!(
            stats,
            SyncConvertStats {
                converted: 3,
                skipped: 0
            }
        );
        let got: Vec<u64> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        // 1e9 guest ticks past the anchor at +1000 ppb: 1e9 * 1e9 / (1e9 + 1000) host ticks,
        // i.e. 999_999 fewer, rounded down.
        assert_eq!(
            got,
            [
                a.guest_start - 5_000_000,
                b.host_anchor,
                b.host_anchor + 999_999_000
            ]
        );
        let bad = "6000000\nabc\n\n99999999999999999999\n12\n";
        let err =
            convert_with_sync(&f, 2, &mut bad.as_bytes(), &mut Vec::new(), false).unwrap_err();
        assert!(
            matches!(err, SyncFileError::BadInput { line: 2, .. }),
            "{err}"
        );
        let mut out = Vec::new();
        let stats = convert_with_sync(&f, 2, &mut bad.as_bytes(), &mut out, true).unwrap();
        // "12" maps below host 0 (out of range), the other three are not numbers.
        assert_eq!(
            stats,
            SyncConvertStats {
                converted: 1,
                skipped: 4
            }
        );
        assert_eq!(out, b"1000000\n");
    }

    proptest! {
        /// The core cursor equals random access for any order of queries, and every
        /// conversion equals a naive rational floor of the record's line (one tick low at most
        /// for a non-zero drift).
        #[test]
        fn cursor_matches_random_access_and_naive_floor(
            anchors in proptest::collection::vec((1u64 << 20..1u64 << 40, -1_000_000i64..1_000_000, -100_000i64..100_000), 1..8),
            queries in proptest::collection::vec(0u64..1u64 << 42, 1..64),
            sorted in any::<bool>(),
        ) {
            let mut hosts: Vec<_> = anchors.clone();
            hosts.sort_by_key(|a| a.0);
            hosts.dedup_by_key(|a| a.0);
            let segs: Vec<SyncSegment> = hosts
                .iter()
                .enumerate()
                .map(|(i, &(h, off, ppb))| {
                    let mut s = seg(0, i as u64, h << 1, off, ppb);
                    s.guest_start = (h << 1) + 5_000;
                    s
                })
                .collect();
            let f = file(&segs);
            let t = f.timeline(0).unwrap();
            let mut q = queries.clone();
            if sorted { q.sort_unstable(); }
            let core = t.timeline().unwrap();
            let mut c = core.cursor();
            for g in q {
                let want = t.try_host_from_guest_floor(GuestTicks(g));
                prop_assert_eq!(c.try_convert_floor(GuestTicks(g)), want);
                let idx = segs.iter().rposition(|s| s.guest_start <= g).unwrap_or(0);
                let s = &segs[idx];
                let num = (i128::from(g) - i128::from(s.guest_anchor)) * 1_000_000_000;
                let den = 1_000_000_000 + i128::from(s.drift_ppb);
                let naive = i128::from(s.host_anchor) + num.div_euclid(den);
                // Exact for a pure offset; the core slope may round one tick low otherwise.
                let tol = i128::from(s.drift_ppb != 0);
                match want {
                    Some(h) => prop_assert!(naive - tol <= i128::from(h.0) && i128::from(h.0) <= naive,
                        "got {} naive {} ppb {}", h.0, naive, s.drift_ppb),
                    None => prop_assert!(naive - tol < 0, "None but naive {}", naive),
                }
            }
        }
    }
}
