//! What a debugfs scan finds: VMs, and each vCPU's reading with its host-TSC bracket.

use std::path::PathBuf;

use serde::Serialize;
use vmtsync_core::mapping::{KvmTscMapping, MappingError};

use crate::kvm::hosttsc::TscBracket;

/// Where debugfs is mounted on a standard Linux host.
pub const DEBUGFS_MOUNTPOINT: &str = "/sys/kernel/debug";

/// The longest file content accepted. A 64-bit decimal with sign and newline is 21 bytes; more
/// than this means the file is not what we think it is.
pub(super) const MAX_FILE_BYTES: usize = 64;

/// A VM's identity in debugfs: the creating process and its VM file descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VmId {
    /// PID of the process that created the VM (the VMM, e.g. QEMU).
    pub pid: u32,
    /// The VM's file descriptor number in that process.
    pub fd: u32,
}

/// A VM directory found under the debugfs root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmDir {
    /// Which VM.
    pub id: VmId,
    /// Its directory.
    pub path: PathBuf,
}

/// The TSC scaling of one vCPU: `guest = offset + (host * ratio) >> frac_bits`.
///
/// It serializes under the names `vmtsync kvm --json` gives it inside a vCPU's object
/// (`tsc_scaling_ratio`, `tsc_frac_bits`, `scaling_present`), so that the reading itself is the
/// report and no second, flattened copy of it has to be kept in step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Scaling {
    /// The multiplier (`1 << frac_bits` means no scaling).
    #[serde(rename = "tsc_scaling_ratio")]
    pub ratio: u64,
    /// Fraction bits of the multiplier.
    #[serde(rename = "tsc_frac_bits")]
    pub frac_bits: u32,
    /// Whether the scaling files exist. When false the kernel does not scale this host's TSC
    /// and `ratio`/`frac_bits` are the identity `1`/`0`.
    #[serde(rename = "scaling_present")]
    pub present: bool,
}

impl Scaling {
    /// Identity scaling, used when the scaling files are absent (no TSC scaling on this CPU).
    pub const ABSENT: Self = Self {
        ratio: 1,
        frac_bits: 0,
        present: false,
    };

    /// True when the ratio is exactly `1 << frac_bits` (guest TSC runs at host rate).
    #[must_use]
    pub fn is_identity(&self) -> bool {
        self.frac_bits < 64 && self.ratio == 1u64 << self.frac_bits
    }
}

/// One vCPU's state as read from debugfs, with the host TSC interval in which it was true.
///
/// This is also a vCPU of `vmtsync kvm --json` and of `kvm --watch`'s events: one flat object,
/// `guest_tsc = tsc_offset + (host_tsc * tsc_scaling_ratio) >> tsc_frac_bits`, true at some
/// host TSC in `[host_tsc_before, host_tsc_after]` (the scaling and the bracket flattened in,
/// in this field order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct VcpuState {
    /// The VMM's vCPU id (`vcpu<N>`), not the guest's CPU index.
    pub vcpu: u32,
    /// `tsc-offset`: added to the scaled host TSC to give the guest TSC.
    pub tsc_offset: i64,
    /// The scaling ratio and fraction bits.
    #[serde(flatten)]
    pub scaling: Scaling,
    /// `guest_mode`: `Some(true)` while the vCPU runs a nested guest, in which case offset and
    /// ratio are the combined L0→L2 values, not L1's. `None` if the file is absent.
    pub guest_mode: Option<bool>,
    /// `pid`: TID of the host thread running the vCPU; `None` if absent, not yet run, or not
    /// read ([`super::VcpuDir::read_mapping`]).
    pub thread_pid: Option<u32>,
    /// Host TSC read before the first and after the last file of this vCPU.
    #[serde(flatten)]
    pub bracket: TscBracket,
}

impl VcpuState {
    /// The guest-from-host mapping this reading states, for every command that converts with
    /// a vCPU's debugfs values (`convert --vm`, `trace-cmd attach --vm`, `export perf`).
    ///
    /// # Errors
    /// [`MappingError`] when the values are no mapping (the debugfs parser already rejects a
    /// zero ratio and fraction bits above 63, so this is not expected from a real reading).
    pub fn mapping(&self) -> Result<KvmTscMapping, MappingError> {
        KvmTscMapping::try_new(self.tsc_offset, self.scaling.ratio, self.scaling.frac_bits)
    }
}
