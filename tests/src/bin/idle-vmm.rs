//! `idle-vmm`: KVM VMs with halted vCPUs, for tier-2 tests (see `vmtsync_tests::idle_vmm`).

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match vmtsync_tests::idle_vmm::idle_vmm_main(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idle-vmm: {e:#}");
            ExitCode::FAILURE
        }
    }
}
