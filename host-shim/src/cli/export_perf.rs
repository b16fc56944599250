//! `vmtsync export perf`: a VM's KVM TSC mapping as `perf inject --guest-data`'s offset and
//! scale ([`crate::formats::perf`]), or why perf cannot take it.

use clap::Args;
use vmtsync_core::mapping::KvmTscMapping;

use super::exit::CliError;
use super::source::{SourceArgs, find_vcpu, not_nested, single_vm, vm_name};
use crate::formats::perf::{PerfMapping, perf_mapping};
use crate::kvm::debugfs::VcpuState;
use crate::kvm::hosttsc::read_host_tsc;
use crate::kvm::scan::VmSelector;

/// `vmtsync export perf`.
#[derive(Debug, Args)]
pub struct PerfArgs {
    /// The VM (PID, PID-FD or name): its KVM debugfs entry gives the mapping, its PID is
    /// perf's machine PID.
    #[arg(long, value_name = "PID|NAME")]
    pub vm: VmSelector,
    /// Only this vCPU's mapping (default: every vCPU, which must agree).
    #[arg(long, value_name = "N")]
    pub vcpu: Option<u32>,
    /// The guest's perf.data path to put in the argument.
    #[arg(long, value_name = "PATH", default_value = "guest.perf.data")]
    pub perf_data: String,
    /// Accept vCPUs in guest mode (their debugfs values are the L0->L2 mapping).
    #[arg(long)]
    pub nested_l2: bool,
    /// Debugfs and /proc locations.
    #[command(flatten)]
    pub source: SourceArgs,
}

fn mapping_of(v: &VcpuState) -> Result<KvmTscMapping, CliError> {
    v.mapping()
        .map_err(|e| CliError::Usage(format!("vcpu{}: {e}", v.vcpu)))
}

pub(super) fn run_export_perf(a: &PerfArgs) -> Result<(), CliError> {
    let vm = single_vm(&a.source, &a.vm)?;
    let vm_name = vm_name(&vm);
    let vcpus: Vec<&VcpuState> = match a.vcpu {
        Some(n) => vec![find_vcpu(&vm, n)?],
        None => vm.vcpus.iter().collect(),
    };
    let mut maps = Vec::with_capacity(vcpus.len());
    for v in vcpus {
        maps.push((v.vcpu, mapping_of(not_nested(&vm, v, a.nested_l2)?)?));
    }
    match perf_mapping(&maps, read_host_tsc().0) {
        PerfMapping::Exact {
            offset,
            scale,
            caveat,
        } => {
            if let Some(c) = caveat {
                eprintln!("vmtsync: warning: VM {vm_name}: {c}");
            }
            let scale = if scale == 1 {
                String::new()
            } else {
                format!(",{scale}")
            };
            println!("--guest-data={},{},{offset}{scale}", a.perf_data, vm.pid);
            Ok(())
        }
        PerfMapping::Inexpressible(why) => Err(CliError::NotExpressible(format!(
            "perf inject --guest-data cannot express VM {vm_name}'s TSC mapping exactly: {why}"
        ))),
    }
}
