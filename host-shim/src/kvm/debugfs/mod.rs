//! KVM debugfs discovery and parsing: which VMs exist and each vCPU's exact TSC mapping.
//!
//! Layout (Linux `virt/kvm/kvm_main.c`, `arch/x86/kvm/debugfs.c`):
//! `<root>/<pid>-<fd>/vcpu<N>/{tsc-offset, tsc-scaling-ratio, tsc-scaling-ratio-frac-bits,
//! guest_mode, pid}`. `<pid>` is the process that created the VM, `<fd>` its VM file
//! descriptor; some kernels append more `-suffix` parts, which are ignored. `<N>` is the vCPU
//! id the VMM chose (`KVM_CREATE_VCPU`), **not** the guest's CPU index: ids can be sparse, and
//! this module never maps them by sort order.
//!
//! The scaling files exist only when the CPU can scale the TSC (`has_tsc_control`); when they
//! are absent KVM does not scale, and the reading says so (`scaling_present: false`) while
//! carrying the identity ratio `1 / 2^0`.
//!
//! Every file is read with one bounded read into a stack buffer and parsed strictly: any byte
//! sequence yields a value or a [`DebugfsError`] naming the file and the bytes, never a panic.

//!
//! Files: `tree.rs` ([`KvmDebugfs`]: the tree, VM discovery, reading a VM with teardown
//! rechecks), `files.rs` (one vCPU's files: bounded, non-blocking, relative to the open VM
//! directory), `entries.rs` (what a reading holds), `error.rs`, `parse.rs` (strict parsers).

mod entries;
mod error;
mod files;
mod parse;
mod tree;

pub use entries::{DEBUGFS_MOUNTPOINT, Scaling, VcpuState, VmDir, VmId};
pub use error::DebugfsError;
pub use files::{
    GUEST_MODE_FILE, THREAD_PID_FILE, TSC_FRAC_FILE, TSC_OFFSET_FILE, TSC_RATIO_FILE, VcpuDir,
    read_vcpu,
};
pub use parse::{parse_i64_contents, parse_u64_contents, parse_vcpu_dir_name, parse_vm_dir_name};
pub use tree::{DEFAULT_KVM_DEBUGFS, KvmDebugfs, TEARDOWN_RECHECK, TEARDOWN_RECHECKS};
