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
    use crate::syncfile::samples::{file, seg};

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
}
