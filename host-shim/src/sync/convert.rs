//! `vmtsync convert --sync FILE --vcpu N`: guest TSC values through a sync file, placed by the
//! rule `record` places its events by ([`place()`], two-sided, the default `--placement`): the
//! point always lies inside the interval that provably holds the truth (docs/record.md,
//! "Placing an event").

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use super::place::{Placement, place};
use crate::syncfile::{LineRead, SyncFile, SyncFileError, read_line_bounded};

/// What [`convert_with_sync`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncConvertStats {
    /// Values converted and written.
    pub converted: u64,
    /// Bad lines skipped (with `skip_bad`).
    pub skipped: u64,
}

/// `vmtsync convert --sync FILE --vcpu N`: reads one decimal guest TSC per line from `input`,
/// writes its host TSC per line to `output`: the point `record` gives an event at that guest
/// tick (see the module docs).
///
/// Lines may have surrounding blanks; anything else is a bad line: an error, or skipped and
/// counted when `skip_bad`. Memory is bounded (lines over 4 KiB are bad lines).
///
/// # Errors
/// The timeline errors of [`SyncFile::timeline`], [`SyncFileError::BadInput`],
/// [`SyncFileError::OutOfRange`] (also for a tick whose guaranteed interval leaves the host's
/// 64-bit range, which `record` counts as unplaceable), [`SyncFileError::Output`], [`SyncFileError::Io`].
pub fn convert_with_sync(
    sync: &SyncFile,
    vcpu: u32,
    input: &mut dyn BufRead,
    output: &mut dyn Write,
    skip_bad: bool,
) -> Result<SyncConvertStats, SyncFileError> {
    // The file's checks of one vCPU's segments (present, increasing, each a valid line).
    let timeline = sync.timeline(vcpu)?;
    let segments = timeline.records();
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
            Some(v) => place(segments, v, Placement::default())
                .map(|p| p.host)
                .ok_or(SyncFileError::OutOfRange {
                    line: line_no,
                    value: v,
                }),
        };
        match result {
            Ok(h) => {
                writeln!(output, "{h}").map_err(SyncFileError::Output)?;
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
    use super::*;

    /// `input` through vCPU 2 of a file of two segments (an exact offset, then 5,000,500
    /// at +1000 ppb): the stats and the values written.
    fn convert(input: &str, skip_bad: bool) -> Result<(u64, u64, Vec<u64>), SyncFileError> {
        use crate::syncfile::samples::{file, seg};
        let f = file(&[
            seg(2, 0, 1_000_000, 5_000_000, 0),
            seg(2, 1, 2_000_000, 5_000_500, 1_000),
        ]);
        let mut out = Vec::new();
        let s = convert_with_sync(&f, 2, &mut input.as_bytes(), &mut out, skip_bad)?;
        let values = String::from_utf8(out).unwrap();
        let values = values.lines().map(|l| l.parse().unwrap()).collect();
        Ok((s.converted, s.skipped, values))
    }

    #[test]
    fn convert_with_sync_streams_lines() {
        // The first segment's start, the second's anchor, and 1e9 guest ticks past it: at
        // +1000 ppb 1e9 * 1e9 / (1e9 + 1000) host ticks, i.e. 999_999 fewer, rounded down.
        let (start, anchor) = (6_000_000 - 1000, 2_000_000 + 5_000_500);
        let input = format!("{start}\n  {anchor}  \n{}\n", anchor + 1_000_000_000);
        assert_eq!(
            convert(&input, false).unwrap(),
            (3, 0, vec![999_000, 2_000_000, 2_000_000 + 999_999_000])
        );
        let bad = "6000000\nabc\n\n99999999999999999999\n12\n";
        let err = convert(bad, false).unwrap_err();
        assert!(
            matches!(err, SyncFileError::BadInput { line: 2, .. }),
            "{err}"
        );
        // "12" maps below host 0 (out of range), the other three are not numbers.
        assert_eq!(convert(bad, true).unwrap(), (1, 4, vec![1_000_000]));
    }
}
