//! vmtsync's one integration test binary. Each module is one area; tier-2 modules check their
//! prerequisites with `vmtsync_tests::require`.

mod agent_events;
mod agent_qemu;
mod agent_vmm;
mod anchor;
mod anchor_putc;
mod attach;
mod causality;
mod cli;
mod console;
mod ctf;
mod e2e;
mod kvm_fixtures;
mod kvm_real;
mod memory_agent;
mod minimal_kernel;
mod perf;
mod perfetto;
mod placement;
mod plot;
mod probe;
mod probe_bench;
mod record;
mod smoke;
mod smp;
mod sync_crash;
mod tracedat;
mod util;
mod validate;
mod validate_rules;
mod vsock;
