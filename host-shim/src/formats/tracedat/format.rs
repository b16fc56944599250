//! The format texts a trace.dat carries: the ring buffer's `header_page`/`header_event` and the
//! `vmtsync` event system.
//!
//! `header_page` and `header_event` are byte-for-byte what Linux 6.18 x86-64 prints in
//! `/sys/kernel/debug/tracing/events/header_{page,event}` (checked on this project's machines,
//! see `docs/trace-dat.md`); libtraceevent parses them to learn the page header layout (8-byte
//! timestamp, 8-byte `commit`) and the 5/27-bit event header.
//!
//! Our events are two fixed layouts, so that an event without payload costs 16 bytes of data
//! (20 with its header) and one with payload 32 (36):
//!
//! | event | fields after the 8 common bytes |
//! |---|---|
//! | `vmtsync:event` (ID [`EVENT_ID`]) | `u32 id` @8 |
//! | `vmtsync:event_data` (ID [`EVENT_DATA_ID`]) | `u32 id` @8, `u16 len` @12, `u8 payload[16]` @16 |
//!
//! `common_pid` is 0 and `common_flags`/`common_preempt_count` are 0: a guest event has no host
//! task. `trace-cmd report` prints `id=…` and, for `event_data`, `len=…` and the first `len`
//! payload bytes in hex.

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
/// Event type id of `vmtsync:event_data`.
pub const EVENT_DATA_ID: u16 = 60002;

/// The largest payload an event carries.
pub const MAX_PAYLOAD: usize = 16;

/// Data bytes of a `vmtsync:event` record (common fields + `id`, a multiple of 4).
pub const EVENT_SIZE: usize = 12;
/// Data bytes of a `vmtsync:event_data` record.
pub const EVENT_DATA_SIZE: usize = 32;

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
        assert!(EVENT_DATA_FORMAT.contains(&format!("payload[{MAX_PAYLOAD}];\toffset:16;")));
        assert_eq!(EVENT_DATA_SIZE, 16 + MAX_PAYLOAD);
    }
}
