//! Conversion through one exact KVM mapping, behind `vmtsync convert`: a streaming filter from
//! guest TSC to host TSC (or back), one decimal value per line. (The sync file's piecewise,
//! estimated conversion is `syncfile`'s.)
//!
//! It is built to never be the slow stage of a pipe: one pass over `BufRead::fill_buf` chunks,
//! a byte-at-a-time decimal parser, a stack buffer for the output digits, no allocation per line
//! and constant memory whatever the input (an overlong line is an error, never a growing buffer).

use std::io::{self, BufRead, Write};

use thiserror::Error;
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_core::{GuestTicks, HostTicks};

/// Which way to convert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Direction {
    /// Guest TSC in, host TSC out (the default: put guest events on the host timeline).
    Host,
    /// Host TSC in, guest TSC out (KVM's own forward formula, rounds down).
    Guest,
}

/// How guest→host rounds when the guest runs faster than the host (several guest ticks fall in
/// one host tick). Exact for identity scaling either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Rounding {
    /// The earliest host TSC at which the guest TSC had reached the value (the exact inverse
    /// of KVM's forward formula: `guest_from_host(h) >= g` for the result and not for `h - 1`).
    Ceil,
    /// The latest host TSC at which the guest TSC had not passed the value.
    Floor,
}

/// The advice that ends a bad-line error; left out of the warning when `--skip-bad` is on.
const SKIP_HINT: &str = " (use --skip-bad to skip such lines)";

/// Errors of a conversion run. Line numbers count from 1.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConvertError {
    /// A line is not a decimal u64.
    #[error(
        "line {line}: expected one decimal TSC value (0..=18446744073709551615), found \"{shown}\" (use --skip-bad to skip such lines)"
    )]
    BadLine {
        /// The line number.
        line: u64,
        /// The line's start, escaped.
        shown: String,
    },
    /// The converted value does not fit in 64 bits.
    #[error(
        "line {line}: {value} is outside the range of this mapping (the result does not fit 64 bits) (use --skip-bad to skip such lines)"
    )]
    OutOfRange {
        /// The line number.
        line: u64,
        /// The input value.
        value: u64,
    },
    /// Reading stdin or writing stdout failed.
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// What a run did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConvertStats {
    /// Values converted and written.
    pub converted: u64,
    /// Lines skipped with `--skip-bad`.
    pub skipped: u64,
}

/// Settings for [`convert_stream`].
#[derive(Clone, Copy, Debug)]
pub struct ConvertOptions {
    /// The vCPU's mapping (host → guest, as KVM defines it).
    pub mapping: KvmTscMapping,
    /// Which way to convert.
    pub to: Direction,
    /// Rounding of guest → host.
    pub rounding: Rounding,
    /// Report bad lines on `warn` and keep going instead of stopping at the first.
    pub skip_bad: bool,
}

/// Converts one value. `None` if the result does not fit.
#[must_use]
#[inline]
pub fn convert_one(opts: &ConvertOptions, v: u64) -> Option<u64> {
    match (opts.to, opts.rounding) {
        (Direction::Guest, _) => opts.mapping.try_guest_from_host(HostTicks(v)).map(|g| g.0),
        (Direction::Host, Rounding::Ceil) => opts
            .mapping
            .try_host_from_guest_ceil(GuestTicks(v))
            .map(|h| h.0),
        (Direction::Host, Rounding::Floor) => opts
            .mapping
            .try_host_from_guest_floor(GuestTicks(v))
            .map(|h| h.0),
    }
}

/// How much of a bad line is kept for the error message.
const EXCERPT: usize = 64;

/// The per-line parse state: constant size.
struct LineState {
    value: u64,
    digits: u32,
    /// A non-digit (other than surrounding blanks) or an overflow was seen.
    bad: bool,
    /// Trailing blanks were seen after digits; another digit makes the line bad.
    ended: bool,
    excerpt: [u8; EXCERPT],
    excerpt_len: usize,
    total_len: u64,
}

impl LineState {
    const fn new() -> Self {
        Self {
            value: 0,
            digits: 0,
            bad: false,
            ended: false,
            excerpt: [0; EXCERPT],
            excerpt_len: 0,
            total_len: 0,
        }
    }

    #[inline]
    fn push(&mut self, b: u8) {
        if self.excerpt_len < EXCERPT {
            self.excerpt[self.excerpt_len] = b;
            self.excerpt_len += 1;
        }
        self.total_len += 1;
        if self.bad {
            return;
        }
        let d = b.wrapping_sub(b'0');
        if d <= 9 {
            if self.ended {
                self.bad = true;
                return;
            }
            match self
                .value
                .checked_mul(10)
                .and_then(|v| v.checked_add(u64::from(d)))
            {
                Some(v) => {
                    self.value = v;
                    self.digits += 1;
                }
                None => self.bad = true,
            }
        } else if matches!(b, b' ' | b'\t' | b'\r') {
            if self.digits > 0 {
                self.ended = true;
            }
        } else {
            self.bad = true;
        }
    }

    fn shown(&self) -> String {
        let mut s = self.excerpt[..self.excerpt_len].escape_ascii().to_string();
        if self.total_len > EXCERPT as u64 {
            s.push_str("...");
        }
        s
    }
}

/// Formats `v` in decimal into the end of `buf`, followed by a newline; returns the bytes.
#[inline]
fn fmt_line(mut v: u64, buf: &mut [u8; 21]) -> &[u8] {
    let mut i = buf.len() - 1;
    buf[i] = b'\n';
    loop {
        i -= 1;
        // `v % 10` is below 10, so the cast cannot truncate.
        #[allow(clippy::cast_possible_truncation)]
        {
            buf[i] = b'0' + (v % 10) as u8;
        }
        v /= 10;
        if v == 0 {
            break;
        }
    }
    &buf[i..]
}

/// Converts every line of `input` to `output`. Bad lines stop the run with their line number,
/// or with `skip_bad` are reported on `warn` and skipped.
///
/// # Errors
/// [`ConvertError::BadLine`], [`ConvertError::OutOfRange`] (without `skip_bad`), I/O errors.
pub fn convert_stream(
    input: &mut dyn BufRead,
    output: &mut dyn Write,
    warn: &mut dyn Write,
    opts: &ConvertOptions,
) -> Result<ConvertStats, ConvertError> {
    let mut stats = ConvertStats::default();
    let mut line_no: u64 = 1;
    let mut st = LineState::new();
    let mut digits = [0u8; 21];
    let mut finish =
        |st: &LineState, line_no: u64, stats: &mut ConvertStats| -> Result<(), ConvertError> {
            let err = if st.bad || st.digits == 0 {
                ConvertError::BadLine {
                    line: line_no,
                    shown: st.shown(),
                }
            } else if let Some(out) = convert_one(opts, st.value) {
                output.write_all(fmt_line(out, &mut digits))?;
                stats.converted += 1;
                return Ok(());
            } else {
                ConvertError::OutOfRange {
                    line: line_no,
                    value: st.value,
                }
            };
            if opts.skip_bad {
                stats.skipped += 1;
                let msg = err.to_string();
                let msg = msg.strip_suffix(SKIP_HINT).unwrap_or(&msg);
                writeln!(warn, "vmtsync: skipped {msg}")?;
                Ok(())
            } else {
                Err(err)
            }
        };
    loop {
        let chunk = match input.fill_buf() {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        if chunk.is_empty() {
            break;
        }
        let n = chunk.len();
        for &b in chunk {
            if b == b'\n' {
                finish(&st, line_no, &mut stats)?;
                line_no += 1;
                st = LineState::new();
            } else {
                st.push(b);
            }
        }
        input.consume(n);
    }
    // A last line without a newline still counts; an empty tail after the final newline does not.
    if st.total_len > 0 {
        finish(&st, line_no, &mut stats)?;
    }
    output.flush()?;
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn opts(m: KvmTscMapping, to: Direction, skip_bad: bool) -> ConvertOptions {
        ConvertOptions {
            mapping: m,
            to,
            rounding: Rounding::Ceil,
            skip_bad,
        }
    }

    fn run(input: &[u8], o: &ConvertOptions) -> (Result<ConvertStats, String>, String, String) {
        let mut out = Vec::new();
        let mut warn = Vec::new();
        let r = convert_stream(&mut &input[..], &mut out, &mut warn, o).map_err(|e| e.to_string());
        (
            r,
            String::from_utf8(out).unwrap(),
            String::from_utf8(warn).unwrap(),
        )
    }

    fn offset(o: i64) -> KvmTscMapping {
        KvmTscMapping::offset_only(o)
    }

    #[test]
    fn offset_only_both_ways() {
        let (r, out, _) = run(
            b"1000\n 2000 \n3000",
            &opts(offset(-100), Direction::Host, false),
        );
        assert_eq!(r.unwrap().converted, 3);
        assert_eq!(out, "1100\n2100\n3100\n");
        let (_, out, _) = run(b"1100\n", &opts(offset(-100), Direction::Guest, false));
        assert_eq!(out, "1000\n");
    }

    #[test]
    fn bad_line_stops_with_its_number() {
        let (r, out, _) = run(b"1\n2\nx3\n4\n", &opts(offset(0), Direction::Host, false));
        assert_eq!(
            r.unwrap_err(),
            "line 3: expected one decimal TSC value (0..=18446744073709551615), found \"x3\" (use --skip-bad to skip such lines)"
        );
        assert_eq!(out, "1\n2\n");
    }

    #[test]
    fn skip_bad_keeps_going() {
        let input = b"1\n\n18446744073709551616\n1 2\n\xff\n5\n";
        let (r, out, warn) = run(input, &opts(offset(0), Direction::Host, true));
        assert_eq!(
            r.unwrap(),
            ConvertStats {
                converted: 2,
                skipped: 4
            }
        );
        assert_eq!(out, "1\n5\n");
        let lines: Vec<&str> = warn.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[0].starts_with("vmtsync: skipped line 2: "), "{warn}");
        assert!(lines[3].contains("found \"\\xff\""), "{warn}");
        // Already skipping: no "(use --skip-bad …)" advice.
        assert!(!warn.contains("--skip-bad"), "{warn}");
        assert!(
            warn.lines()
                .all(|l| l.ends_with('"') || l.ends_with("64 bits)")),
            "{warn}"
        );
    }

    #[test]
    fn out_of_range_is_reported() {
        // Ratio 1/2: the guest runs at half the host rate, so a guest value above 2^63 has no
        // host tick in u64.
        let half = KvmTscMapping::try_new(0, 1, 1).unwrap();
        let (r, out, _) = run(
            b"10\n18446744073709551615\n",
            &opts(half, Direction::Host, false),
        );
        assert_eq!(out, "20\n");
        assert!(
            r.unwrap_err()
                .starts_with("line 2: 18446744073709551615 is outside the range"),
        );
    }

    #[test]
    fn overlong_line_is_cut_in_message() {
        let mut input = vec![b'7'; 100];
        input.push(b'\n');
        let (r, _, _) = run(&input, &opts(offset(0), Direction::Host, false));
        let e = r.unwrap_err();
        assert!(e.contains(&format!("\"{}...\"", "7".repeat(64))), "{e}");
    }

    #[test]
    fn formats_extremes() {
        let mut b = [0u8; 21];
        assert_eq!(fmt_line(0, &mut b), b"0\n");
        assert_eq!(fmt_line(u64::MAX, &mut b), b"18446744073709551615\n");
    }

    proptest! {
        /// The stream writes exactly what the core computes for each value, in order, and
        /// skips exactly the values the core cannot map.
        #[test]
        fn stream_matches_core(
            offset: i64,
            frac in prop_oneof![Just(32u32), Just(48u32)],
            ratio_frac in 1u64..(1 << 16),
            to_guest: bool,
            floor: bool,
            values in proptest::collection::vec(any::<u64>(), 0..64),
        ) {
            let ratio = ratio_frac << (frac - 16);
            let m = KvmTscMapping::try_new(offset, ratio, frac).unwrap();
            let o = ConvertOptions {
                mapping: m,
                to: if to_guest { Direction::Guest } else { Direction::Host },
                rounding: if floor { Rounding::Floor } else { Rounding::Ceil },
                skip_bad: true,
            };
            let mut input = String::new();
            let mut expect = String::new();
            let mut bad = 0u64;
            for v in &values {
                input.push_str(&format!("{v}\n"));
                let r = if to_guest {
                    m.try_guest_from_host(HostTicks(*v)).map(|g| g.0)
                } else if floor {
                    m.try_host_from_guest_floor(GuestTicks(*v)).map(|h| h.0)
                } else {
                    m.try_host_from_guest_ceil(GuestTicks(*v)).map(|h| h.0)
                };
                match r {
                    Some(r) => expect.push_str(&format!("{r}\n")),
                    None => bad += 1,
                }
            }
            let (r, out, _) = run(input.as_bytes(), &o);
            let stats = r.unwrap();
            prop_assert_eq!(out, expect);
            prop_assert_eq!(stats.skipped, bad);
        }
    }
}
