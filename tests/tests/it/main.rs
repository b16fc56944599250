//! vmtsync's one integration test binary. Each module is one area; tier-2 modules check their
//! prerequisites with `vmtsync_tests::require`.

mod cli;
mod kvm_fixtures;
mod kvm_real;
mod smoke;
