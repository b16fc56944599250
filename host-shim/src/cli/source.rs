//! Where every command that reads KVM debugfs and `/proc` (`kvm`, `convert --vm`, `probe
//! --anchor`, `record --vm`, `export perf`, `trace-cmd attach --vm`) finds them, and
//! `--mount-debugfs`.

use std::io;
use std::path::{Path, PathBuf};

use clap::Args;
use rustix::mount::MountFlags;

use super::exit::CliError;
use crate::kvm::debugfs::{DEBUGFS_MOUNTPOINT, DEFAULT_KVM_DEBUGFS, KvmDebugfs, VcpuState};
use crate::kvm::procinfo::{DEFAULT_PROC_ROOT, ProcFs};
use crate::kvm::scan::{ScanError, Scanner, VmReport, VmSelector};
use crate::probe::anchor::{AnchorMode, AnchorOptions};

/// Where to read KVM debugfs and /proc: the same flags on every command that reads them.
#[derive(Clone, Debug, PartialEq, Eq, Args)]
pub struct SourceArgs {
    /// KVM debugfs directory (holds one `<pid>-<fd>` directory per VM).
    #[arg(long, value_name = "DIR", default_value = DEFAULT_KVM_DEBUGFS)]
    pub debugfs_root: PathBuf,
    /// Mount debugfs at /sys/kernel/debug first if it is not mounted (needs root).
    #[arg(long)]
    pub mount_debugfs: bool,
    /// The proc filesystem used to name VMs (for tests with fixture trees).
    #[arg(long, value_name = "DIR", default_value = DEFAULT_PROC_ROOT, hide = true)]
    pub proc_root: PathBuf,
}

/// The one VM `sel` matches, scanned through `src`; several matches are
/// [`CliError::Ambiguous`] (none is the scan's own no-match error).
pub(super) fn single_vm(src: &SourceArgs, sel: &VmSelector) -> Result<VmReport, CliError> {
    let report = scanner(src)?.scan(Some(sel))?;
    match <[VmReport; 1]>::try_from(report.vms) {
        Ok([vm]) => Ok(vm),
        Err(vms) => Err(CliError::Ambiguous {
            selector: sel.to_string(),
            count: vms.len(),
            list: vms.iter().map(vm_name).collect::<Vec<_>>().join(", "),
        }),
    }
}

/// The name errors give `vm`: `pid-fd`.
pub(super) fn vm_name(vm: &VmReport) -> String {
    format!("{}-{}", vm.pid, vm.fd)
}

/// `vm`'s vCPU `vcpu`; [`CliError::NoVcpu`], naming the vCPUs it has, when it has no such one.
pub(super) fn find_vcpu(vm: &VmReport, vcpu: u32) -> Result<&VcpuState, CliError> {
    vm.vcpus
        .iter()
        .find(|v| v.vcpu == vcpu)
        .ok_or_else(|| CliError::NoVcpu {
            vm: vm_name(vm),
            vcpu,
            available: vm
                .vcpus
                .iter()
                .map(|v| format!("vcpu{}", v.vcpu))
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// `v`, a vCPU of `vm`, unless it runs a nested guest and `nested_l2` (`--nested-l2`) does not
/// accept its L0->L2 mapping ([`CliError::Nested`]).
pub(super) fn not_nested<'a>(
    vm: &VmReport,
    v: &'a VcpuState,
    nested_l2: bool,
) -> Result<&'a VcpuState, CliError> {
    if v.guest_mode == Some(true) && !nested_l2 {
        return Err(CliError::Nested {
            vm: vm_name(vm),
            vcpu: v.vcpu,
        });
    }
    Ok(v)
}

impl SourceArgs {
    /// What `--anchor MODE`, `--vm` and `--tracefs` ask of the probe rounds' exit anchoring,
    /// reading debugfs and `/proc` where these flags say (`probe` and `record`).
    pub(super) fn anchor_options(
        &self,
        mode: AnchorMode,
        vm: Option<&VmSelector>,
        tracefs: Option<&PathBuf>,
    ) -> AnchorOptions {
        AnchorOptions {
            mode,
            vm: vm.cloned(),
            tracefs: tracefs.cloned(),
            debugfs_root: self.debugfs_root.clone(),
            proc_root: self.proc_root.clone(),
            ..AnchorOptions::default()
        }
    }
}

pub(super) fn scanner(src: &SourceArgs) -> Result<Scanner, CliError> {
    mount_if_asked(src)?;
    let debugfs = KvmDebugfs::open(&src.debugfs_root).map_err(ScanError::from)?;
    Ok(Scanner {
        debugfs,
        proc: ProcFs::new(&src.proc_root),
    })
}

/// With `--mount-debugfs`: mounts debugfs unless `--debugfs-root` already exists.
///
/// # Errors
/// [`CliError::NotRoot`] or [`CliError::Mount`] when it must mount and cannot.
pub(super) fn mount_if_asked(src: &SourceArgs) -> Result<(), CliError> {
    if src.mount_debugfs {
        mount_debugfs_if_needed(&src.debugfs_root)?;
    }
    Ok(())
}

/// Mounts debugfs at the standard mount point unless `root` already exists.
fn mount_debugfs_if_needed(root: &Path) -> Result<(), CliError> {
    if root.exists() {
        return Ok(());
    }
    if !rustix::process::geteuid().is_root() {
        return Err(CliError::NotRoot);
    }
    rustix::mount::mount(
        "none",
        DEBUGFS_MOUNTPOINT,
        "debugfs",
        MountFlags::empty(),
        None,
    )
    .map_err(|errno| CliError::Mount(io::Error::from(errno)))?;
    Ok(())
}
