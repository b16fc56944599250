//! The format texts a trace.dat carries: the ring buffer's `header_page`/`header_event` and the
//! `vmtsync` event system.
//!
//! `header_page` and `header_event` are byte-for-byte what Linux 6.18 x86-64 prints in
//! `/sys/kernel/debug/tracing/events/header_{page,event}` (checked on this project's machines,
//! see `docs/trace-dat.md`); libtraceevent parses them to learn the page header layout (8-byte
//! timestamp, 8-byte `commit`) and the 5/27-bit event header.
//!
//! Our events are two layouts, so that an event without payload costs 12 bytes of data (16
//! with its header), one with a payload of up to 8 bytes 24 (28), and one with 9 to 16 bytes
//! 32 (36):
//!
//! | event | fields after the 8 common bytes |
//! |---|---|
//! | `vmtsync:event` (ID [`EVENT_ID`]) | `u32 id` @8 |
//! | `vmtsync:event_data` (ID [`EVENT_DATA_ID`]) | `u32 id` @8, `__data_loc u8[] payload` @12: the payload at @16, its length in the word's upper half, padded to 8 bytes |
//!
//! Files written before the payload became a dynamic array carry `vmtsync:event_data` as ID
//! [`EVENT_DATA_FIXED_ID`] (`u16 len` @12, `u8 payload[16]` @16, always 32 bytes); the reader
//! reads both.
//!
//! `common_pid` is 0 and `common_flags`/`common_preempt_count` are 0: a guest event has no host
//! task. `trace-cmd report` prints `id=…` and, for `event_data`, `len=…` and the `len` payload
//! bytes in hex.

/// Exactly `/sys/kernel/debug/tracing/events/header_page` of an x86-64 kernel (205 bytes).
pub const HEADER_PAGE: &str = "\tfield: u64 timestamp;\toffset:0;\tsize:8;\tsigned:0;\n\
\tfield: local_t commit;\toffset:8;\tsize:8;\tsigned:1;\n\
\tfield: int overwrite;\toffset:8;\tsize:1;\tsigned:1;\n\
\tfield: char data;\toffset:16;\tsize:4080;\tsigned:0;\n";

/// Exactly `/sys/kernel/debug/tracing/events/header_event` (205 bytes).
pub const HEADER_EVENT: &str = "# compressed entry header\n\
\ttype_len    :    5 bits\n\
\ttime_delta  :   27 bits\n\
\tarray       :   32 bits\n\
\n\
\tpadding     : type == 29\n\
\ttime_extend : type == 30\n\
\ttime_stamp : type == 31\n\
\tdata max type_len  == 28\n";

/// The event system name.
pub const SYSTEM: &str = "vmtsync";

/// Event type id of `vmtsync:event` (any id works: the file carries its own formats; this one
/// is far from the kernel's ftrace ids so a merged report never confuses them).
pub const EVENT_ID: u16 = 60001;
/// Event type id of `vmtsync:event_data` (its payload a dynamic array).
pub const EVENT_DATA_ID: u16 = 60004;
/// Event type id of `vmtsync:event_data` in files written before that (a fixed 16-byte
/// payload and a length field): read, no longer written.
pub const EVENT_DATA_FIXED_ID: u16 = 60002;

/// The largest payload an event carries.
pub const MAX_PAYLOAD: usize = 16;

/// Data bytes of a `vmtsync:event` record (common fields + `id`, a multiple of 4).
pub const EVENT_SIZE: usize = 12;

/// Where a `vmtsync:event_data`'s payload starts in its record (its `__data_loc` offset).
pub const PAYLOAD_AT: usize = 16;

/// Data bytes of a `vmtsync:event_data` record with a payload of `len` bytes (1 to
/// [`MAX_PAYLOAD`]): the payload padded to 8 bytes, so it is stored in whole words.
#[must_use]
#[inline(always)]
pub const fn event_data_size(len: usize) -> usize {
    if len <= 8 {
        PAYLOAD_AT + 8
    } else {
        PAYLOAD_AT + MAX_PAYLOAD
    }
}

/// The `__data_loc` word of a `payload` of `len` bytes: its offset in the low half, its
/// length in the high half (the kernel's encoding, which libtraceevent reads).
#[must_use]
#[inline(always)]
pub fn payload_loc(len: usize) -> u32 {
    u32::try_from(PAYLOAD_AT | len.min(MAX_PAYLOAD) << 16).unwrap_or(0)
}

/// Whether a record of type `common_type` is a recording's event (`vmtsync:event` or
/// `vmtsync:event_data` of either layout), not another record beside them.
#[must_use]
pub const fn is_vmtsync_event(common_type: u16) -> bool {
    matches!(common_type, EVENT_ID | EVENT_DATA_ID | EVENT_DATA_FIXED_ID)
}

/// The `format` file of `vmtsync:event`.
pub const EVENT_FORMAT: &str = event_format!(
    "event",
    60001,
    [("unsigned int id", 8, 4, 0)],
    r#""id=%u", REC->id"#
);

/// The `format` file of `vmtsync:event_data`.
pub const EVENT_DATA_FORMAT: &str = event_format!(
    "event_data",
    60004,
    [
        ("unsigned int id", 8, 4, 0),
        ("__data_loc unsigned char[] payload", 12, 4, 0),
    ],
    r#""id=%u len=%u payload=%s", REC->id, __get_dynamic_array_len(payload), __print_hex(__get_dynamic_array(payload), __get_dynamic_array_len(payload))"#
);

/// The `format` file of `vmtsync:event_data` in files written before [`EVENT_DATA_FORMAT`]
/// (ID [`EVENT_DATA_FIXED_ID`]): what the reader's tests compare such a file with.
pub const EVENT_DATA_FIXED_FORMAT: &str = event_format!(
    "event_data",
    60002,
    [
        ("unsigned int id", 8, 4, 0),
        ("unsigned short len", 12, 2, 0),
        ("unsigned char payload[16]", 16, 16, 0),
    ],
    r#""id=%u len=%u payload=%s", REC->id, REC->len, __print_hex(REC->payload, REC->len)"#
);

// The function graph's events (`funcgraph.rs` writes them).

/// Event type id of `ftrace:funcgraph_entry` in our files (the kernel's differs; trace-cmd
/// finds the event by name).
pub const FUNCGRAPH_ENTRY_ID: u16 = 60010;
/// Event type id of `ftrace:funcgraph_exit`.
pub const FUNCGRAPH_EXIT_ID: u16 = 60011;
/// Event type id of `vmtsync:span_orphan`.
pub const SPAN_ORPHAN_ID: u16 = 60003;

/// Data bytes of a `funcgraph_entry` record (the kernel's: `func` @8, `depth` @16, padded).
pub const ENTRY_SIZE: usize = 24;
/// Data bytes of a `funcgraph_exit` record.
pub const EXIT_SIZE: usize = 40;

/// `funcgraph_entry`'s format, Linux 6.18's without the empty `args[]` (function arguments,
/// which a guest span has none of).
pub const FUNCGRAPH_ENTRY_FORMAT: &str = event_format!(
    "funcgraph_entry",
    60010,
    [
        ("unsigned long func", 8, 8, 0),
        ("unsigned int depth", 16, 4, 0)
    ],
    r#""--> %ps (%u)", (void *)REC->func, REC->depth"#
);

/// `funcgraph_exit`'s format, exactly Linux 6.18's.
pub const FUNCGRAPH_EXIT_FORMAT: &str = event_format!(
    "funcgraph_exit",
    60011,
    [
        ("unsigned long func", 8, 8, 0),
        ("unsigned int depth", 16, 4, 0),
        ("unsigned int overrun", 20, 4, 0),
        ("unsigned long long calltime", 24, 8, 0),
        ("unsigned long long rettime", 32, 8, 0),
    ],
    r#""<-- %ps (%u) (start: %llx  end: %llx) over: %u", (void *)REC->func, REC->depth, REC->calltime, REC->rettime, REC->depth"#
);

/// `vmtsync:span_orphan`: an exit whose entry was not seen (the same layout as an entry).
pub const SPAN_ORPHAN_FORMAT: &str = event_format!(
    "span_orphan",
    60003,
    [
        ("unsigned long func", 8, 8, 0),
        ("unsigned int depth", 16, 4, 0)
    ],
    r#""%ps exit, entry not seen (depth %u)", (void *)REC->func, REC->depth"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_texts_have_the_kernels_sizes() {
        // The kernel's files are 205 bytes each; a stray edit to the text would change that.
        assert_eq!(HEADER_PAGE.len(), 205);
        assert_eq!(HEADER_EVENT.len(), 205);
    }

    #[test]
    fn formats_name_the_ids_and_sizes_the_writer_uses() {
        assert!(EVENT_FORMAT.contains(&format!("ID: {EVENT_ID}\n")));
        assert!(EVENT_DATA_FORMAT.contains(&format!("ID: {EVENT_DATA_ID}\n")));
        assert!(EVENT_DATA_FORMAT.contains(&format!("payload;\toffset:{}", PAYLOAD_AT - 4)));
        assert!(EVENT_DATA_FIXED_FORMAT.contains(&format!("ID: {EVENT_DATA_FIXED_ID}\n")));
        assert_eq!(event_data_size(1), 24);
        assert_eq!(event_data_size(8), 24);
        assert_eq!(event_data_size(9), 32);
        assert_eq!(event_data_size(MAX_PAYLOAD), 32);
        assert_eq!(payload_loc(8), 16 | 8 << 16);
    }
}
