//! `vmtsync record`: one session that syncs the clocks and drains the guest's events into a
//! trace file.

pub mod bounds;
