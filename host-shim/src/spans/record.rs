//! The span records' payloads (docs/memory-layout.md, "Reserved event ids").

/// First reserved id of the span records.
pub const SPAN_BEGIN_ID: u16 = 0xFF01;
/// A span's end.
pub const SPAN_END_ID: u16 = 0xFF02;
/// A function's entry.
pub const FUNC_ENTRY_ID: u16 = 0xFF03;
/// A function's exit.
pub const FUNC_EXIT_ID: u16 = 0xFF04;
/// A relocation.
pub const RELOC_ID: u16 = 0xFF05;

/// A decoded span record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanRecord<'a> {
    /// A phase begins.
    Begin(&'a [u8]),
    /// A phase ends.
    End(&'a [u8]),
    /// A function is entered from `site`.
    Entry {
        /// The function's run-time address.
        func: u64,
        /// The call site.
        site: u64,
    },
    /// A function returns to `site`.
    Exit {
        /// The function's run-time address.
        func: u64,
        /// The call site.
        site: u64,
    },
    /// Code linked at `link` runs at `runtime`, `len` bytes.
    Reloc {
        /// Link address.
        link: u64,
        /// Run-time address.
        runtime: u64,
        /// Length.
        len: u32,
    },
}

/// The span record with this id and payload; `None` for any other id, or a payload of the
/// wrong shape (such a record is then an ordinary event).
#[must_use]
pub fn decode(id: u16, p: &[u8]) -> Option<SpanRecord<'_>> {
    let word = |b: &[u8]| {
        let mut w = [0u8; 8];
        w.get_mut(..b.len())?.copy_from_slice(b);
        Some(u64::from_le_bytes(w))
    };
    let pair = || {
        let half = match p.len() {
            8 => 4,
            16 => 8,
            _ => return None,
        };
        Some((word(&p[..half])?, word(&p[half..])?))
    };
    let canonical = |b: &[u8]| word(b).map(|v| ((v << 16).cast_signed() >> 16).cast_unsigned());
    match id {
        SPAN_BEGIN_ID if (1..=16).contains(&p.len()) => Some(SpanRecord::Begin(p)),
        SPAN_END_ID if (1..=16).contains(&p.len()) => Some(SpanRecord::End(p)),
        FUNC_ENTRY_ID => pair().map(|(func, site)| SpanRecord::Entry { func, site }),
        FUNC_EXIT_ID => pair().map(|(func, site)| SpanRecord::Exit { func, site }),
        RELOC_ID if p.len() == 16 => Some(SpanRecord::Reloc {
            link: canonical(&p[..6])?,
            runtime: canonical(&p[6..12])?,
            len: u32::from_le_bytes(p[12..16].try_into().ok()?),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{SpanRecord, decode};

    #[test]
    fn payloads_decode_and_bad_shapes_do_not() {
        assert_eq!(decode(0xFF01, b"post"), Some(SpanRecord::Begin(b"post")));
        assert_eq!(decode(0xFF01, b""), None);
        assert_eq!(decode(0xFF02, &[b'x'; 17]), None);
        let mut p = [0u8; 8];
        p[..4].copy_from_slice(&0x000f_1234u32.to_le_bytes());
        p[4..].copy_from_slice(&0x000f_5678u32.to_le_bytes());
        assert_eq!(
            decode(0xFF03, &p),
            Some(SpanRecord::Entry {
                func: 0xf_1234,
                site: 0xf_5678
            })
        );
        let mut p = [0u8; 16];
        p[..8].copy_from_slice(&0xffff_ffff_8100_0000u64.to_le_bytes());
        p[8..].copy_from_slice(&7u64.to_le_bytes());
        assert_eq!(
            decode(0xFF04, &p),
            Some(SpanRecord::Exit {
                func: 0xffff_ffff_8100_0000,
                site: 7
            })
        );
        assert_eq!(decode(0xFF03, &p[..12]), None);
        let mut r = [0u8; 16];
        r[..6].copy_from_slice(&0xffff_8100_0000u64.to_le_bytes()[..6]);
        r[6..12].copy_from_slice(&0x7fb_d000u64.to_le_bytes()[..6]);
        r[12..].copy_from_slice(&0x1000u32.to_le_bytes());
        assert_eq!(
            decode(0xFF05, &r),
            Some(SpanRecord::Reloc {
                link: 0xffff_ffff_8100_0000,
                runtime: 0x7fb_d000,
                len: 0x1000
            }),
            "48-bit values are sign-extended from bit 47"
        );
        assert_eq!(decode(0xFF05, &r[..15]), None);
        assert_eq!(decode(7, b"post"), None, "an application's id");
    }
}
