//! trace.dat and ftrace ring-buffer constants, each with the header or document it comes from.
//!
//! Sources: trace-cmd 3.1.6 `lib/trace-cmd/include/private/trace-cmd-private.h` (option ids,
//! file versions), `include/trace-cmd/trace-cmd.h` (section flags), the file format manuals
//! `Documentation/trace-cmd/trace-cmd.dat.v6.5.txt` / `.v7.5.txt`, and the kernel's
//! `include/linux/ring_buffer.h` / `kernel/trace/ring_buffer.c` (event header). What each one
//! means for our files is in `docs/trace-dat.md`.

/// The first three bytes of every trace.dat ("INITIAL FORMAT" in both format manuals).
pub const MAGIC: [u8; 3] = [0x17, 0x08, 0x44];
/// The seven bytes after the magic.
pub const TRACING: &[u8; 7] = b"tracing";

/// Ring-buffer page size we write: the x86-64 kernel page, what `header_page` describes.
pub const PAGE_SIZE: usize = 4096;
/// [`PAGE_SIZE`] as the file's `u32` field.
pub const PAGE_SIZE_U32: u32 = 4096;
const _: () = assert!(PAGE_SIZE_U32 as usize == PAGE_SIZE);
/// `header_page`: `u64 timestamp` at 0 and `local_t commit` (8 bytes on x86-64) at 8.
pub const PAGE_HEADER_SIZE: usize = 16;
/// Bytes of event data a page holds (`field: char data; offset:16; size:4080`).
pub const PAGE_DATA_SIZE: usize = PAGE_SIZE - PAGE_HEADER_SIZE;

/// Option ids (`enum { TRACECMD_OPTION_DONE, ... }` in trace-cmd-private.h).
pub mod option {
    /// Ends an options block (v6: bare id; v7: 8-byte offset of the next options section).
    pub const DONE: u16 = 0;
    /// A per-CPU statistics text.
    pub const CPUSTAT: u16 = 2;
    /// v7: one trace buffer's flyrecord section, clock, page size and per-CPU data.
    pub const BUFFER: u16 = 3;
    /// The `trace_clock` file's text, current clock in brackets.
    pub const TRACECLOCK: u16 = 4;
    /// `uname` text of the traced system.
    pub const UNAME: u16 = 5;
    /// Version text of the writer.
    pub const VERSION: u16 = 9;
    /// `u64` trace session id.
    pub const TRACEID: u16 = 11;
    /// Guest→host timestamp corrections (guest file).
    pub const TIME_SHIFT: u16 = 12;
    /// A guest's name, trace id and vCPU → host thread map (host file).
    pub const GUEST: u16 = 13;
    /// TSC → ns multiplier, shift and offset.
    pub const TSC2NSEC: u16 = 14;
    /// v7: the strings section (also the section id).
    pub const STRINGS: u16 = 15;
    /// v7: offset of the header_page/header_event section (also its section id).
    pub const HEADER_INFO: u16 = 16;
    /// v7: offset of the ftrace event formats section.
    pub const FTRACE_EVENTS: u16 = 17;
    /// v7: offset of the event formats section.
    pub const EVENT_FORMATS: u16 = 18;
    /// v7: offset of the kallsyms section.
    pub const KALLSYMS: u16 = 19;
    /// v7: offset of the printk formats section.
    pub const PRINTK: u16 = 20;
    /// v7: offset of the saved command lines section.
    pub const CMDLINES: u16 = 21;
    /// v7: a latency (text) buffer.
    pub const BUFFER_TEXT: u16 = 22;
}

/// v7 section header flag: the section body is compressed (`TRACECMD_SEC_FL_COMPRESS`).
pub const SEC_FL_COMPRESS: u16 = 1;
/// v7 section header: `u16 id, u16 flags, u32 string id, u64 size`.
pub const SECTION_HEADER_SIZE: u64 = 16;

/// TIME_SHIFT protocol flag: interpolate the offset between samples
/// (`TRACECMD_TSYNC_FLAG_INTERPOLATE`); without it the reader steps.
pub const TSYNC_FLAG_INTERPOLATE: u32 = 1;

/// Ring-buffer event header: `type_len:5, time_delta:27` (`struct ring_buffer_event`).
pub const TS_SHIFT: u32 = 27;
/// The largest delta the 27-bit field holds.
pub const MAX_DELTA: u64 = (1 << TS_SHIFT) - 1;
/// A time extend carries 27 + 32 bits of delta (`RINGBUF_TYPE_TIME_EXTEND`: the header's 27
/// bits plus `array[0]`).
pub const MAX_EXTENDED_DELTA: u64 = (1 << (TS_SHIFT + 32)) - 1;
/// `RINGBUF_TYPE_DATA_TYPE_LEN_MAX`: data events with `type_len` 1..=28 hold `4 * type_len`
/// bytes; 0 means the length is in `array[0]`.
pub const TYPE_DATA_MAX: u32 = 28;
/// `RINGBUF_TYPE_PADDING`.
pub const TYPE_PADDING: u32 = 29;
/// `RINGBUF_TYPE_TIME_EXTEND`.
pub const TYPE_TIME_EXTEND: u32 = 30;
/// `RINGBUF_TYPE_TIME_STAMP` (absolute timestamp).
pub const TYPE_TIME_STAMP: u32 = 31;

/// The TSC2NSEC option: trace-cmd shows `(ticks * mult) >> shift` (it reads `offset` but
/// never applies it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tsc2Nsec {
    /// Multiplier.
    pub mult: u32,
    /// Right shift.
    pub shift: u32,
    /// Offset (stored, unused by trace-cmd 3.1.6).
    pub offset: u64,
}

impl Tsc2Nsec {
    /// Nanoseconds of a TSC at `hz` ticks per second, as trace-cmd's `mul_u64_u32_shr` takes
    /// them: the largest `shift` (at most 32, which that function allows) whose
    /// `mult = 10^9 * 2^shift / hz` fits an `i32`, so the rounding error is below one part in
    /// 2^30 of the time; `None` for a frequency of 0 or one too high for any shift. trace-cmd
    /// 3.1.6 keeps `mult` in an `int` and widens it with its sign: a `mult` of 2^31 or more
    /// (any TSC below 2 GHz with shift 32) would come out as a huge number and make time run
    /// backwards.
    #[must_use]
    pub fn for_hz(hz: u64) -> Option<Self> {
        if hz == 0 {
            return None;
        }
        (0..=32u32).rev().find_map(|shift| {
            let mult = (1_000_000_000u128 << shift) / u128::from(hz);
            Some(Self {
                mult: i32::try_from(mult)
                    .ok()
                    .filter(|&m| m > 0)
                    .and_then(|m| u32::try_from(m).ok())?,
                shift,
                offset: 0,
            })
        })
    }

    /// `ticks` in nanoseconds, exactly as trace-cmd 3.1.6 computes it (two 32-bit halves).
    #[must_use]
    pub fn nanos(&self, ticks: u64) -> u64 {
        let (lo, hi) = (ticks & 0xffff_ffff, ticks >> 32);
        let m = u64::from(self.mult);
        ((lo * m) >> self.shift).wrapping_add((hi * m) << (32 - self.shift.min(32)))
    }
}

#[cfg(test)]
mod tests {
    use super::Tsc2Nsec;

    #[test]
    fn for_hz_gives_nanoseconds_within_a_part_in_two_billion() {
        for hz in [
            1_000_000u64,
            999_999_999,
            1_000_000_000,
            2_100_000_000,
            3_599_999_000,
        ] {
            let t = Tsc2Nsec::for_hz(hz).unwrap();
            // One hour of ticks.
            let ticks = hz * 3600;
            let want = 3_600_000_000_000u64;
            let got = t.nanos(ticks);
            assert!(
                got.abs_diff(want) <= want >> 29,
                "{hz} Hz: {got} ns for {want}"
            );
        }
        assert_eq!(Tsc2Nsec::for_hz(0), None);
        assert_eq!(Tsc2Nsec::for_hz(2_100_000_000).unwrap().shift, 32);
        // 2^31 would be read back as negative by trace-cmd: one shift less.
        assert_eq!(Tsc2Nsec::for_hz(2_000_000_000).unwrap().shift, 31);
        for hz in [
            1_000_000_000u64,
            1_500_000_000,
            1_999_999_999,
            3_000_000_000,
        ] {
            assert!(
                Tsc2Nsec::for_hz(hz).unwrap().mult <= i32::MAX as u32,
                "{hz}"
            );
        }
    }
}
