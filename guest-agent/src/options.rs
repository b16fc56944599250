//! Boot options from the PVH command line: space-separated `key=value` words.
//!
//! - `transport=uart`: probes over COM1 (the only transport so far).
//! - `exit=N`: the code written to isa-debug-exit when the host says quit (default 0).
//! - `skew=OFFSET,RATIO,FRAC`: report `OFFSET + ((tsc * RATIO) >> FRAC)` instead of the raw TSC.
//!   OFFSET may be negative (it wraps, like KVM's offset); numbers are decimal or `0x` hex.
//!
//! Unknown words are reported in the log and otherwise ignored, so a host can pass options a
//! newer agent understands.

use crate::tsc::Skew;

/// The transport that carries probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// 16550 UART on COM1.
    Uart,
}

/// Parsed boot options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Probe transport.
    pub transport: Transport,
    /// Code for isa-debug-exit on quit.
    pub exit_code: u8,
    /// Software skew applied to reported TSC values.
    pub skew: Skew,
}

/// Why an option word was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OptionError {
    /// The key is not one the agent knows.
    UnknownKey,
    /// The value does not parse for its key.
    BadValue,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            transport: Transport::Uart,
            exit_code: 0,
            skew: Skew::IDENTITY,
        }
    }
}

impl Options {
    /// Parses `cmdline`, calling `on_error(word, error)` for every word it does not accept.
    pub fn parse(cmdline: &[u8], mut on_error: impl FnMut(&[u8], OptionError)) -> Self {
        let mut o = Self::default();
        for word in cmdline.split(|&b| b == b' ').filter(|w| !w.is_empty()) {
            if let Err(e) = o.apply(word) {
                on_error(word, e);
            }
        }
        o
    }

    fn apply(&mut self, word: &[u8]) -> Result<(), OptionError> {
        let eq = word.iter().position(|&b| b == b'=').ok_or(OptionError::UnknownKey)?;
        let (key, value) = (&word[..eq], &word[eq + 1..]);
        match key {
            b"transport" => match value {
                b"uart" => self.transport = Transport::Uart,
                _ => return Err(OptionError::BadValue),
            },
            b"exit" => {
                let v = parse_u64(value).ok_or(OptionError::BadValue)?;
                self.exit_code = u8::try_from(v).map_err(|_| OptionError::BadValue)?;
            }
            b"skew" => self.skew = parse_skew(value).ok_or(OptionError::BadValue)?,
            _ => return Err(OptionError::UnknownKey),
        }
        Ok(())
    }
}

fn parse_skew(v: &[u8]) -> Option<Skew> {
    let mut parts = v.split(|&b| b == b',');
    let offset = parse_i64_wrapping(parts.next()?)?;
    let ratio = parse_u64(parts.next()?)?;
    let frac_bits = u32::try_from(parse_u64(parts.next()?)?).ok()?;
    if parts.next().is_some() || frac_bits > 63 || ratio == 0 {
        return None;
    }
    Some(Skew {
        offset,
        ratio,
        frac_bits,
    })
}

/// Parses an optionally negative number into its two's-complement u64 (KVM stores the TSC
/// offset the same way).
fn parse_i64_wrapping(v: &[u8]) -> Option<u64> {
    match v.split_first() {
        Some((b'-', rest)) => parse_u64(rest).map(u64::wrapping_neg),
        _ => parse_u64(v),
    }
}

/// Parses decimal or `0x`-prefixed hex; `None` on empty input, bad digits or overflow.
pub fn parse_u64(v: &[u8]) -> Option<u64> {
    let (digits, radix) = match v {
        [b'0', b'x' | b'X', rest @ ..] => (rest, 16),
        _ => (v, 10),
    };
    if digits.is_empty() {
        return None;
    }
    let mut n: u64 = 0;
    for &d in digits {
        let x = char::from(d).to_digit(radix)?;
        n = n.checked_mul(u64::from(radix))?.checked_add(u64::from(x))?;
    }
    Some(n)
}
