//! # vmtsync (host side)
//!
//! Finds VMs in KVM debugfs and reads their exact per-vCPU TSC mappings, runs probe rounds
//! against the guest agent, writes sync files, converts guest timestamps and exports them.

pub mod probe;
pub mod syncfile;
