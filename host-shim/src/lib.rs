//! # vmtsync (host side)
//!
//! Finds VMs in KVM debugfs and reads their exact per-vCPU TSC mappings, runs probe rounds
//! against the guest agent, writes sync files, converts guest timestamps and exports them.
//!
//! Layers:
//! - [`hosttsc`]: the host TSC read that brackets every debugfs reading.
//! - [`debugfs`]: discovery of `<pid>-<fd>/vcpuN` and strict parsing of each file.
//! - [`procinfo`]: the VM's process (`comm`, QEMU `-name`), from an injectable `/proc`.
//! - [`scan`]: one scan joined with `/proc`, in the versioned `vmtsync kvm --json` shape.
//! - [`watch`]: change events by polling and by the `kvm:kvm_write_tsc_offset` tracepoint.
//! - [`ftrace`]: private tracefs instances, `trace_pipe_raw` pages, event formats (`kvm_pio`).
//! - [`exact_convert`], [`compose`]: streaming timestamp conversion and nested composition, on
//!   `vmtsync_core::mapping`.
//! - [`probe`]: `vmtsync probe`: hello + probe rounds against the guest agent, bounded
//!   estimates, continuous re-sync.
//! - [`syncfile`]: the versioned JSON Lines sync file and `convert --sync`.
//! - [`tracedat`]: trace-cmd's trace.dat (v6/v7): streaming guest-event writer, TIME_SHIFT,
//!   strict reader, GUEST option on a host trace copy.
//! - [`ftrace`]: ftrace event record layouts (`kvm:kvm_pio`) from the kernel's descriptions.
//! - [`plot`]: `vmtsync plot`, a sync file as an SVG picture.
//! - [`validate`]: `vmtsync validate`, a sync file checked against the host's `kvm_pio` exits.
//! - [`atomic_file`]: output files written to a temporary file and renamed into place.
//! - [`cli`]: the command line, its errors and exit codes.
//!
//! Guarantees: no file content makes this crate panic; a reading is never presented as a VM's
//! own (L1) mapping while its vCPU runs a nested guest; every reading carries the host TSC
//! interval in which it was true.

pub mod atomic_file;
pub mod cli;
pub mod compose;
pub mod debugfs;
pub mod exact_convert;
pub mod export;
pub mod ftrace;
pub mod guestmem;
pub mod hosttsc;
pub mod plot;
pub mod probe;
pub mod procinfo;
pub mod record;
pub mod scan;
pub mod syncfile;
pub mod tracedat;
pub mod validate;
pub mod watch;
