//! Exports of guest events into other tools' trace formats.
//!
//! - [`perfetto`]: a Perfetto protobuf trace on the host's CLOCK_BOOTTIME.

pub mod perfetto;
