//! # vmtsync (host side)
//!
//! Finds VMs in KVM debugfs and reads their exact per-vCPU TSC mappings, runs probe rounds
//! against the guest agent, writes sync files, converts guest timestamps and exports them.
//!
//! Wings, each owning its vocabulary, from the ground up: a wing's code imports only wings
//! above it in this list, with one exception: `ftrace`'s live pages are walked by the
//! trace.dat page reader (`formats::tracedat::page`), the same kernel page layout. No files
//! import each other in a loop.
//! - [`atomic_file`]: every output file written to a temporary file and renamed into place.
//! - [`exact_convert`]: streaming timestamp conversion on `vmtsync_core::mapping`.
//! - [`ftrace`]: private tracefs instances, `trace_pipe_raw` pages, event formats (`kvm_pio`,
//!   `kvm_write_tsc_offset`).
//! - [`kvm`]: what the host kernel says: the host TSC read, KVM debugfs, `/proc`, one scan in
//!   the `vmtsync kvm --json` shape, and change watching.
//! - [`syncfile`]: the versioned JSON Lines sync file, the vocabulary its segments are written
//!   in ([`syncfile::AnchorKind`], [`syncfile::OffsetModel`]), and its segments on
//!   `vmtsync_core::timeline` (for trace.dat's TIME_SHIFT).
//! - [`sync`]: from probe samples to a placed time: rounds, segments, the rate limits, the
//!   one rule for a segment's line and a point's interval, and `convert --sync`.
//! - [`formats`]: every trace format: trace.dat (writer, reader, TIME_SHIFT, host copy,
//!   attach planning), JSON Lines (one `Line` type both ways), CTF, Perfetto, perf, and the
//!   one event source the exporters read.
//! - [`link`]: the byte stream to the guest agent: addresses, connecting with retries,
//!   vhost-user vsock, AF_VSOCK, and the host-TSC-stamped transport.
//! - [`guestmem`]: a guest's recorder read straight out of its VMM's memory (`/proc/PID/mem`):
//!   finding the header, and a bounded, polled drain with exact lost counts.
//! - [`exits`]: the host's `kvm:kvm_pio` exits: the private trace, matching an exchange's
//!   exits, beacon chains, [`exits::PioExit`] and its counters (probe, record and validate
//!   use them).
//! - [`spans`]: a guest's span and function records paired into spans on the host timeline,
//!   functions named from an ELF image's symbols.
//! - [`compose`]: nested (L0->L1->L2) composition of scanned mappings.
//! - [`plot`]: `vmtsync plot`, a sync file as an SVG picture.
//! - [`probe`]: `vmtsync probe`: hello + probe rounds against the guest agent over a link,
//!   bounded estimates, exit anchoring, continuous re-sync into a sync file.
//! - [`record`]: `vmtsync record`: one session that syncs the clocks and drains the guest's
//!   events into a trace file of one of the [`formats`].
//! - [`validate`]: `vmtsync validate`, a sync file checked against the host's `kvm_pio` exits.
//! - [`cli`]: the command line: every clap struct, each command's glue, errors and exit codes.
//!
//! Guarantees: no file content makes this crate panic; a reading is never presented as a VM's
//! own (L1) mapping while its vCPU runs a nested guest; every reading carries the host TSC
//! interval in which it was true.

#![forbid(unsafe_code)]

pub mod atomic_file;
pub mod cli;
pub mod compose;
pub mod exact_convert;
pub mod exits;
pub mod formats;
pub mod ftrace;
pub mod guestmem;
pub mod kvm;
pub mod link;
pub mod plot;
pub mod probe;
pub mod record;
pub mod spans;
pub mod sync;
pub mod syncfile;
#[cfg(test)]
mod testutil;
pub mod validate;
