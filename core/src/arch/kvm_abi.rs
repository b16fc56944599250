//! KVM paravirtual ABI constants and structures, each citing where Linux defines it.
//!
//! Paths are relative to the Linux source tree; `kvm_para.h` without a directory means
//! `arch/x86/include/uapi/asm/kvm_para.h`.

/// First CPUID leaf a hypervisor may use; KVM's signature leaf when it is alone
/// (`KVM_CPUID_SIGNATURE`, kvm_para.h).
pub const KVM_CPUID_SIGNATURE: u32 = 0x4000_0000;

/// Offset of the features leaf from the KVM base leaf (`KVM_CPUID_FEATURES`, kvm_para.h).
pub const KVM_CPUID_FEATURES_OFFSET: u32 = 0x1;

/// Offset of the timing leaf from the hypervisor base leaf: EAX = TSC kHz, EBX = APIC bus
/// kHz. Defined by VMware; QEMU fills it for KVM guests with `-cpu ...,vmware-cpuid-freq=on`
/// and an invariant TSC (QEMU `target/i386/kvm/kvm.c`, `0x40000010`).
pub const HYPERVISOR_TIMING_OFFSET: u32 = 0x10;

/// The hypervisor leaves are probed at this stride: KVM moves its base to 0x40000100 when
/// it also offers Hyper-V enlightenments (Linux `arch/x86/include/asm/kvm_para.h`,
/// `kvm_cpuid_base` via `hypervisor_cpuid_base`).
pub const HYPERVISOR_LEAF_STRIDE: u32 = 0x100;

/// One past the last hypervisor base leaf that is probed (`for_each_possible_hypervisor_cpuid_base`
/// in `arch/x86/include/asm/processor.h` stops below 0x40010000).
pub const HYPERVISOR_LEAF_END: u32 = 0x4001_0000;

/// `"KVMKVMKVM\0\0\0"` as CPUID returns it in EBX, ECX, EDX of the signature leaf
/// (`KVM_SIGNATURE`, kvm_para.h), little-endian per register.
pub const KVM_SIGNATURE: [u32; 3] = [
    u32::from_le_bytes(*b"KVMK"),
    u32::from_le_bytes(*b"VMKV"),
    u32::from_le_bytes(*b"M\0\0\0"),
];

/// Features leaf EAX bit: the legacy kvmclock MSRs 0x11/0x12 exist
/// (`KVM_FEATURE_CLOCKSOURCE`, kvm_para.h).
pub const KVM_FEATURE_CLOCKSOURCE: u32 = 0;
/// Features leaf EAX bit: `MSR_KVM_SYSTEM_TIME_NEW` / `MSR_KVM_WALL_CLOCK_NEW` exist
/// (`KVM_FEATURE_CLOCKSOURCE2`, kvm_para.h).
pub const KVM_FEATURE_CLOCKSOURCE2: u32 = 3;
/// Features leaf EAX bit: the pvclock `PVCLOCK_TSC_STABLE_BIT` flag is meaningful
/// (`KVM_FEATURE_CLOCKSOURCE_STABLE_BIT`, kvm_para.h).
pub const KVM_FEATURE_CLOCKSOURCE_STABLE_BIT: u32 = 24;

/// MSR that registers the per-vCPU pvclock page: write `phys | 1` to enable, 0 to disable
/// (`MSR_KVM_SYSTEM_TIME_NEW`, kvm_para.h; Documentation/virt/kvm/x86/msr.rst).
pub const MSR_KVM_SYSTEM_TIME_NEW: u32 = 0x4b56_4d01;
/// MSR that asks KVM to write the boot wall clock once (`MSR_KVM_WALL_CLOCK_NEW`, kvm_para.h).
pub const MSR_KVM_WALL_CLOCK_NEW: u32 = 0x4b56_4d00;
/// Enable bit ORed into the physical address written to [`MSR_KVM_SYSTEM_TIME_NEW`]
/// (Documentation/virt/kvm/x86/msr.rst: "plus an enable bit in bit 0").
pub const KVM_SYSTEM_TIME_ENABLE: u64 = 1;

/// Hypercall number of `KVM_HC_CLOCK_PAIRING` (include/uapi/linux/kvm_para.h).
pub const KVM_HC_CLOCK_PAIRING: u64 = 9;
/// Clock type argument of `KVM_HC_CLOCK_PAIRING`: host `CLOCK_REALTIME`
/// (`KVM_CLOCK_PAIRING_WALLCLOCK`, kvm_para.h).
pub const KVM_CLOCK_PAIRING_WALLCLOCK: u64 = 0;
/// Hypercall return value: not supported (`-KVM_EOPNOTSUPP`, include/uapi/linux/kvm_para.h).
pub const KVM_EOPNOTSUPP: i64 = 95;
/// Hypercall return value: unknown hypercall (`-KVM_ENOSYS`, include/uapi/linux/kvm_para.h).
pub const KVM_ENOSYS: i64 = 1000;

/// The 64-byte result of `KVM_HC_CLOCK_PAIRING` (`struct kvm_clock_pairing`, kvm_para.h):
/// the host clock `sec`/`nsec` at the moment the guest TSC read `tsc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvmClockPairing {
    /// Host clock seconds.
    pub sec: i64,
    /// Host clock nanoseconds within the second.
    pub nsec: i64,
    /// The guest TSC at the same instant.
    pub tsc: u64,
    /// Reserved flags (0 today).
    pub flags: u32,
    /// Padding to 64 bytes, reserved by the ABI.
    pub pad: [u32; 9],
}

const _: () = {
    assert!(core::mem::size_of::<KvmClockPairing>() == 64);
    assert!(core::mem::offset_of!(KvmClockPairing, sec) == 0);
    assert!(core::mem::offset_of!(KvmClockPairing, nsec) == 8);
    assert!(core::mem::offset_of!(KvmClockPairing, tsc) == 16);
    assert!(core::mem::offset_of!(KvmClockPairing, flags) == 24);
    assert!(core::mem::offset_of!(KvmClockPairing, pad) == 28);
};

/// Flag bit: the TSC is stable across vCPUs, so pvclock readings of different vCPUs are
/// monotonic with each other (`PVCLOCK_TSC_STABLE_BIT`, arch/x86/include/asm/pvclock-abi.h).
/// Only meaningful when CPUID advertises `KVM_FEATURE_CLOCKSOURCE_STABLE_BIT`.
pub const PVCLOCK_TSC_STABLE_BIT: u8 = 1 << 0;
/// Flag bit: the host stopped the guest (e.g. paused it); set by the host, cleared by the
/// guest's watchdog code (`PVCLOCK_GUEST_STOPPED`, arch/x86/include/asm/pvclock-abi.h).
pub const PVCLOCK_GUEST_STOPPED: u8 = 1 << 1;

/// The per-vCPU pvclock (kvmclock) page, exactly as the hypervisor writes it
/// (`struct pvclock_vcpu_time_info`, arch/x86/include/asm/pvclock-abi.h; 32 bytes).
///
/// Linux declares it `packed`; every field is naturally aligned at its offset anyway, so
/// `repr(C)` gives the same layout (asserted below) with 8-byte alignment, which also keeps
/// the struct inside one page.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PvclockVcpuTimeInfo {
    /// Seqlock version: odd while the hypervisor is writing, bumped by 2 per update.
    pub version: u32,
    /// Padding (reserved by the ABI).
    pub pad0: u32,
    /// Guest TSC at the moment `system_time` was taken.
    pub tsc_timestamp: u64,
    /// Nanoseconds of the guest clock at `tsc_timestamp`.
    pub system_time: u64,
    /// Multiplier of the TSC→ns scale: ns per (shifted) tick, as a 0.32 fixed-point number.
    pub tsc_to_system_mul: u32,
    /// Binary shift applied to a TSC delta before the multiply (left if positive).
    pub tsc_shift: i8,
    /// `PVCLOCK_TSC_STABLE_BIT` | `PVCLOCK_GUEST_STOPPED`.
    pub flags: u8,
    /// Padding (reserved by the ABI).
    pub pad: [u8; 2],
}

const _: () = {
    use core::mem::{align_of, offset_of, size_of};
    assert!(size_of::<PvclockVcpuTimeInfo>() == 32);
    assert!(align_of::<PvclockVcpuTimeInfo>() == 8);
    assert!(offset_of!(PvclockVcpuTimeInfo, version) == 0);
    assert!(offset_of!(PvclockVcpuTimeInfo, pad0) == 4);
    assert!(offset_of!(PvclockVcpuTimeInfo, tsc_timestamp) == 8);
    assert!(offset_of!(PvclockVcpuTimeInfo, system_time) == 16);
    assert!(offset_of!(PvclockVcpuTimeInfo, tsc_to_system_mul) == 24);
    assert!(offset_of!(PvclockVcpuTimeInfo, tsc_shift) == 28);
    assert!(offset_of!(PvclockVcpuTimeInfo, flags) == 29);
    assert!(offset_of!(PvclockVcpuTimeInfo, pad) == 30);
};
