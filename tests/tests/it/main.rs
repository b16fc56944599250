//! vmtsync's tier-1 integration tests: pure logic, fixtures and the loopback agent. Each
//! module is one area. Tier-2 tests (real KVM, QEMU, debugfs, tracefs, trace-cmd and the other
//! real readers) are in the `tier2` target, under the same module names, whose harness reports
//! a missing prerequisite as a skip with its reason, never as a pass.

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
mod record_memory;
mod spans;
mod sync_crash;
mod util;
