//! Sync files: the append-only record of `vmtsync probe --continuous` (and of `record
//! --sync-out`), read by `vmtsync convert --sync FILE --vcpu N` (`crate::sync::convert`),
//! `validate`, `plot` and `trace-cmd attach`.
//!
//! # Format (schema 1)
//!
//! JSON Lines, UTF-8, one object per `\n`-terminated line; every object has a `"type"`.
//! The first line is the header, every later line a segment; lines of other types are
//! skipped (room for additions within schema 1), a different `schema` is refused.
//!
//! ```text
//! {"type":"header","schema":1,"tool":"vmtsync 0.1.0","host_clock":"x86-tsc","created_unix_s":1796000000,"source":"tcp:127.0.0.1:4444"}
//! {"type":"segment","vcpu":0,"round":0,"guest_start":…,"host_anchor":…,"guest_anchor":…,"offset":…,"offset_lo":…,"offset_hi":…,"drift_ppb":0,"drift_ppb_lo":-143,"drift_ppb_hi":143,"model":"drift","probes":64,"rtt_min_ticks":…,"host_first":…,"host_last":…,"break":false}
//! ```
//!
//! A segment is one re-sync round of one vCPU. All ticks are TSC ticks, `offset = guest - host`:
//!
//! | key | meaning |
//! |---|---|
//! | `vcpu` | the vCPU the agent read |
//! | `round` | round number within the run that wrote it |
//! | `guest_start` | first guest tick this segment applies to (its first probe's reading); it applies up to the next segment of the same vCPU |
//! | `host_anchor`, `guest_anchor` | the point the segment's line passes through: `guest_anchor = host_anchor + offset` |
//! | `offset`, `offset_lo`, `offset_hi` | offset at `host_anchor`: centre and guaranteed bounds, for any constant rate in `[1/2, 2]` (the probe session's limits) that fits every sample since the last break |
//! | `drift_ppb` | the rate used for conversion: 0 (KVM's default, identity rate) when it lies in `[drift_ppb_lo, drift_ppb_hi]`, else the centre of those bounds (which halves the worst-case error away from the anchor; files of earlier versions used the bound closest to 0) |
//! | `drift_ppb_lo`, `drift_ppb_hi` | guaranteed drift bounds over all rounds since the last break, within the same limits (`-500000000`, `1000000000` while the samples do not bound the rate); null only in files of earlier versions |
//! | `model` | `"drift"` (constant rate, the bounds above); `"offset"` only in files of earlier versions, whose bounds assumed a rate of exactly 1 and can miss a drifting guest's truth |
//! | `probes`, `rtt_min_ticks` | samples of the round and its fastest round trip |
//! | `host_first`, `host_last` | host TSC span of the round |
//! | `break` | the offset or rate changed since the previous round (migration, reset): a new estimate starts here |
//!
//! A segment's line: `host = host_anchor + floor((guest - guest_anchor) · 1e9 /
//! (1e9 + drift_ppb))`, exactly (`crate::sync::place`). `convert --sync` prints the point
//! `record` gives an event at that guest tick, inside the interval the segments guarantee
//! (docs/record.md, "Placing an event"); before the first segment the first one is
//! extrapolated backwards.
//!
//! # Append-only, readable while written, and what a crash leaves
//!
//! Other output files are written whole to a temporary file beside the target and renamed
//! over it, so a reader sees the old file or the new one. A sync file cannot be: it is read
//! (by `convert --sync`, by a trace pipeline) while `probe --continuous` is still adding to it,
//! for as long as the VM runs, and rewriting it per round would copy the whole history every
//! few milliseconds. So it is append-only, with the reader doing its share:
//!
//! - A new file appears (a temporary file beside it, synced, then renamed into place without
//!   replacing anything) already holding its whole header line: no reader ever sees a file
//!   without a header.
//! - Each segment is one `write(2)` of a whole `\n`-terminated line. A line counts only once its
//!   `\n` is in the file: the reader accepts the complete lines and **cuts** whatever follows
//!   the last `\n` (a write in progress, or one torn by `kill -9`, a full disk or a file-size
//!   limit), reporting how many bytes it cut ([`SyncFile::cut`], [`CutTail`]). A cut line is
//!   never parsed, so a torn line that happens to be valid JSON is not misread either.
//! - A failed append is rolled back (the file is truncated to its length before the write), so
//!   a torn line is never followed by a complete one.
//! - A writer reopening a file keeps its header and first truncates a torn last line left by a
//!   crash ([`SyncWriter::cut_on_open`] says how much); readers never modify the file.
//!
//! [`SyncTimeline`] puts one vCPU's segments on `vmtsync_core::timeline`
//! ([`SyncSegment::to_timeline_segment`]; its slope may round one tick low), the slopes a
//! trace.dat TIME_SHIFT carries (`trace-cmd attach`).

mod error;
mod format;
mod reader;
mod timeline;
mod writer;

pub use error::SyncFileError;
#[cfg(test)]
pub(crate) use format::samples;
pub use format::{AnchorKind, OffsetModel, SYNC_SCHEMA, SyncHeader, SyncSegment};
pub use reader::{CutTail, SyncFile};
pub(crate) use reader::{LineRead, read_line_bounded};
pub use timeline::SyncTimeline;
pub use writer::SyncWriter;
