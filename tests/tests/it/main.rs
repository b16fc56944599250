//! vmtsync's tier-1 integration tests: pure logic and fixtures. Each module is one area.
//! Tier-2 tests (real KVM, QEMU, trace-cmd) belong in the `tier2` target, whose harness reports
//! a missing prerequisite as a skip; the modules here that still gate at run time with
//! `vmtsync_tests::require` (a skip there returns early and shows as "ok") are moving there.

mod anchor;
mod attach;
mod cli;
mod ctf;
mod e2e;
mod kvm_fixtures;
mod kvm_real;
mod minimal_kernel;
mod perfetto;
mod plot;
mod probe;
mod record;
mod sync_crash;
mod util;
