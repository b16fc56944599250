//! Numbers in flag values: hex after `0x` or `0X`, else decimal. Each flag's parser says in
//! its own words what is wrong.

use std::num::ParseIntError;

/// An integer type a flag's value is parsed as.
pub(super) trait FlagInt: std::str::FromStr<Err = ParseIntError> {
    /// `digits` in base 16.
    fn from_hex(digits: &str) -> Result<Self, ParseIntError>;
}

impl FlagInt for u16 {
    fn from_hex(digits: &str) -> Result<Self, ParseIntError> {
        Self::from_str_radix(digits, 16)
    }
}

impl FlagInt for u64 {
    fn from_hex(digits: &str) -> Result<Self, ParseIntError> {
        Self::from_str_radix(digits, 16)
    }
}

/// `s` as a `T`: hex after `0x` or `0X`, else decimal.
pub(super) fn hex_or_decimal<T: FlagInt>(s: &str) -> Result<T, ParseIntError> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => T::from_hex(hex),
        None => s.parse(),
    }
}
