//! Strict parsers for KVM debugfs names and file contents: every byte sequence gives a value
//! or `None`, never a panic, and never a value the kernel could not have written.

use super::entries::MAX_FILE_BYTES;
use super::entries::VmId;

/// Parses a VM directory name `<pid>-<fd>` (extra `-suffix` parts allowed). `None` for the
/// statistics files and anything else.
#[must_use]
pub fn parse_vm_dir_name(name: &str) -> Option<VmId> {
    let mut parts = name.split('-');
    let pid = parse_dec_u32(parts.next()?.as_bytes())?;
    let fd = parse_dec_u32(parts.next()?.as_bytes())?;
    Some(VmId { pid, fd })
}

/// Parses a vCPU directory name `vcpu<N>` as the kernel writes it (`"vcpu%d"`): no leading
/// zeros, because the reader reopens the directory as `vcpu<N>` and `vcpu01` would name a
/// different (absent) directory than the one listed.
#[must_use]
pub fn parse_vcpu_dir_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("vcpu")?.as_bytes();
    if digits.len() > 1 && digits[0] == b'0' {
        return None;
    }
    parse_dec_u32(digits)
}

fn parse_dec_u32(s: &[u8]) -> Option<u32> {
    u32::try_from(parse_dec_u64(s)?).ok()
}

/// Strict unsigned decimal: one or more ASCII digits, nothing else, no overflow.
fn parse_dec_u64(s: &[u8]) -> Option<u64> {
    if s.is_empty() {
        return None;
    }
    let mut v: u64 = 0;
    for &b in s {
        let d = b.wrapping_sub(b'0');
        if d > 9 {
            return None;
        }
        v = v.checked_mul(10)?.checked_add(u64::from(d))?;
    }
    Some(v)
}

/// Strips the single trailing newline the kernel prints.
pub(super) fn strip_newline(s: &[u8]) -> &[u8] {
    s.strip_suffix(b"\n").unwrap_or(s)
}

/// Parses a signed decimal (`"%lld\n"`), strictly.
#[must_use]
pub fn parse_i64_contents(s: &[u8]) -> Option<i64> {
    let s = strip_newline(s);
    match s.split_first() {
        Some((b'-', digits)) => {
            let m = parse_dec_u64(digits)?;
            // -(2^63) is the one magnitude that does not fit a positive i64.
            0i64.checked_sub_unsigned(m)
        }
        _ => i64::try_from(parse_dec_u64(s)?).ok(),
    }
}

/// Parses an unsigned decimal (`"%llu\n"`), strictly.
#[must_use]
pub fn parse_u64_contents(s: &[u8]) -> Option<u64> {
    parse_dec_u64(strip_newline(s))
}

/// Escapes file bytes for an error message, cutting after [`MAX_FILE_BYTES`].
pub(super) fn show(bytes: &[u8]) -> String {
    let cut = bytes.len() > MAX_FILE_BYTES;
    let mut s = bytes[..bytes.len().min(MAX_FILE_BYTES)]
        .escape_ascii()
        .to_string();
    if cut {
        s.push_str("...");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn vm_dir_names() {
        assert_eq!(
            parse_vm_dir_name("1234-11"),
            Some(VmId { pid: 1234, fd: 11 })
        );
        assert_eq!(
            parse_vm_dir_name("1234-11-extra-9"),
            Some(VmId { pid: 1234, fd: 11 })
        );
        for bad in [
            "",
            "1234",
            "1234-",
            "-11",
            "blocking",
            "12a-1",
            "1-1x",
            "99999999999-1",
        ] {
            assert_eq!(parse_vm_dir_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn vcpu_dir_names() {
        assert_eq!(parse_vcpu_dir_name("vcpu0"), Some(0));
        assert_eq!(parse_vcpu_dir_name("vcpu17"), Some(17));
        for bad in [
            "vcpu", "vcpux", "cpu0", "vcpu-1", "vcpu1 ", "vcpu01", "vcpu00",
        ] {
            assert_eq!(parse_vcpu_dir_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn signed_contents() {
        assert_eq!(parse_i64_contents(b"0\n"), Some(0));
        assert_eq!(parse_i64_contents(b"-5\n"), Some(-5));
        assert_eq!(
            parse_i64_contents(b"-9223372036854775808\n"),
            Some(i64::MIN)
        );
        assert_eq!(parse_i64_contents(b"9223372036854775807"), Some(i64::MAX));
        for bad in [
            &b""[..],
            b"\n",
            b"-",
            b"--1",
            b"+1",
            b" 1",
            b"1\n\n",
            b"9223372036854775808",
            b"-9223372036854775809",
            b"0x10",
            b"\xff",
        ] {
            assert_eq!(parse_i64_contents(bad), None, "{}", bad.escape_ascii());
        }
    }

    #[test]
    fn show_escapes_and_cuts() {
        assert_eq!(show(b"ab\xff\n"), "ab\\xff\\n");
        assert_eq!(show(&[b'7'; 80]), format!("{}...", "7".repeat(64)));
    }

    proptest! {
        #[test]
        fn i64_roundtrip(v: i64) {
            prop_assert_eq!(parse_i64_contents(format!("{v}\n").as_bytes()), Some(v));
        }

        #[test]
        fn u64_roundtrip(v: u64) {
            prop_assert_eq!(parse_u64_contents(format!("{v}\n").as_bytes()), Some(v));
        }

        /// Any bytes: the strict parsers agree with std's parser (minus its `+` sign) and
        /// never panic.
        #[test]
        fn agrees_with_std(bytes in proptest::collection::vec(
            prop_oneof![Just(b'-'), Just(b'+'), Just(b'\n'), Just(b'0'), b'0'..=b'9', any::<u8>()],
            0..24,
        )) {
            let core = strip_newline(&bytes);
            let std_ref = std::str::from_utf8(core)
                .ok()
                .filter(|s| !s.starts_with('+'));
            prop_assert_eq!(
                parse_i64_contents(&bytes),
                std_ref.and_then(|s| s.parse::<i64>().ok())
            );
            prop_assert_eq!(
                parse_u64_contents(&bytes),
                std_ref.and_then(|s| s.parse::<u64>().ok())
            );
            prop_assert!(show(&bytes).is_ascii());
        }
    }
}
