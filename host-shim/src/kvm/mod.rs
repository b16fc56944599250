//! The KVM wing: what the host kernel says about its VMs, read without the guest's help.
//!
//! - [`hosttsc`]: the host TSC read that brackets every debugfs reading.
//! - [`debugfs`]: discovery of `<pid>-<fd>/vcpuN` and strict parsing of each file.
//! - [`procinfo`]: the VM's process (`comm`, QEMU `-name`), from an injectable `/proc`.
//! - [`scan`]: one scan joined with `/proc`, in the versioned `vmtsync kvm --json` shape.
//! - [`watch`]: change events by polling and by the `kvm:kvm_write_tsc_offset` tracepoint.

pub mod debugfs;
pub mod hosttsc;
pub mod procinfo;
pub mod scan;
pub mod watch;
