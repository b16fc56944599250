//! vmtsync's one integration test binary. Each module is one area; tier-2 modules check their
//! prerequisites with `vmtsync_tests::require`.

mod agent_qemu;
mod agent_vmm;
mod smoke;
mod vsock;
