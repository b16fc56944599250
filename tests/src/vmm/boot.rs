//! PVH boot of an ELF in the built-in VMM: guest memory, ELF load, `hvm_start_info`, command
//! line, memory map, CPUID, and the vCPU state of the PVH 32-bit entry
//! (<https://xenbits.xen.org/docs/unstable/misc/pvh.html>).

use std::fs::File;
use std::path::Path;

use kvm_bindings::{KVM_MAX_CPUID_ENTRIES, kvm_cpuid_entry2, kvm_regs, kvm_segment};
use kvm_ioctls::{Kvm, VcpuFd};
use linux_loader::loader::KernelLoader;
use linux_loader::loader::elf::start_info::{hvm_memmap_table_entry, hvm_start_info};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryMmap};

use super::VmmError;

/// `XEN_HVM_START_MAGIC_VALUE` (Xen `public/arch-x86/hvm/start_info.h`).
pub(crate) const HVM_START_MAGIC: u32 = 0x336e_c578;
/// Guest-physical address of the `hvm_start_info` (below the ELF, above the real-mode IVT).
pub(crate) const START_INFO_ADDR: u64 = 0x6000;
/// Guest-physical address of the memory map (right after the start info).
pub(crate) const MEMMAP_ADDR: u64 = 0x6100;
/// Guest-physical address of the NUL-terminated command line.
pub(crate) const CMDLINE_ADDR: u64 = 0x7000;
/// Longest command line accepted (including the NUL), so it fits below 0x8000.
pub(crate) const CMDLINE_MAX: usize = 0x1000;
/// End of conventional low memory (the EBDA/VGA hole starts here).
const LOW_RAM_END: u64 = 0x9_fc00;
/// Start of extended memory, where PVH kernels are linked.
const HIGH_RAM_START: u64 = 0x10_0000;
/// KVM's CPUID signature leaf (Documentation/virt/kvm/x86/cpuid.rst).
const KVM_CPUID_SIGNATURE: u32 = 0x4000_0000;
/// The hypervisor timing leaf VMware defined and QEMU fills for KVM guests: EAX = TSC kHz.
const KVM_CPUID_TIMING: u32 = 0x4000_0010;
/// APIC bus frequency QEMU reports in the timing leaf (1 GHz).
const APIC_BUS_KHZ: u32 = 1_000_000;
/// `XEN_HVM_MEMMAP_TYPE_RAM` (E820 type 1).
const MEMMAP_TYPE_RAM: u32 = 1;

/// A newtype so the memory map entry can be written with vm-memory (the linux-loader struct has
/// no `ByteValued` impl of its own).
#[repr(transparent)]
#[derive(Clone, Copy, Default)]
struct MemmapEntry(hvm_memmap_table_entry);
// SAFETY: hvm_memmap_table_entry is #[repr(C)], 24 bytes of plain integers with no padding
// (u64, u64, u32, u32), so every byte pattern is a valid value.
unsafe impl ByteValued for MemmapEntry {}

/// Allocates `mem_bytes` of guest RAM at guest-physical 0.
pub(crate) fn guest_memory(mem_bytes: usize) -> Result<GuestMemoryMmap, VmmError> {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), mem_bytes)])
        .map_err(|e| VmmError::Memory(format!("{e:?}")))
}

/// Loads `elf` and writes the PVH boot data. Returns the 32-bit entry address.
pub(crate) fn load_pvh(
    mem: &GuestMemoryMmap,
    mem_bytes: u64,
    elf: &Path,
    cmdline: &str,
) -> Result<u64, VmmError> {
    let mut f = File::open(elf).map_err(|e| VmmError::Elf(format!("{}: {e}", elf.display())))?;
    let loaded = Elf::load(mem, None, &mut f, Some(GuestAddress(HIGH_RAM_START)))
        .map_err(|e| VmmError::Elf(format!("{}: {e}", elf.display())))?;
    let PvhBootCapability::PvhEntryPresent(entry) = loaded.pvh_boot_cap else {
        return Err(VmmError::Elf(format!(
            "{}: no XEN_ELFNOTE_PHYS32_ENTRY note",
            elf.display()
        )));
    };

    let mut cmd = cmdline.as_bytes().to_vec();
    cmd.push(0);
    if cmd.len() > CMDLINE_MAX || cmdline.as_bytes().contains(&0) {
        return Err(VmmError::Cmdline(cmdline.len()));
    }
    mem.write_slice(&cmd, GuestAddress(CMDLINE_ADDR))
        .map_err(|e| VmmError::Memory(format!("command line: {e}")))?;

    let memmap = [
        MemmapEntry(hvm_memmap_table_entry {
            addr: 0,
            size: LOW_RAM_END,
            type_: MEMMAP_TYPE_RAM,
            reserved: 0,
        }),
        MemmapEntry(hvm_memmap_table_entry {
            addr: HIGH_RAM_START,
            size: mem_bytes - HIGH_RAM_START,
            type_: MEMMAP_TYPE_RAM,
            reserved: 0,
        }),
    ];
    let mut at = MEMMAP_ADDR;
    for e in memmap {
        mem.write_obj(e, GuestAddress(at))
            .map_err(|e| VmmError::Memory(format!("memory map: {e}")))?;
        at += 24;
    }

    let si = hvm_start_info {
        magic: HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE_ADDR,
        memmap_paddr: MEMMAP_ADDR,
        memmap_entries: 2,
        ..Default::default()
    };
    mem.write_obj(si, GuestAddress(START_INFO_ADDR))
        .map_err(|e| VmmError::Memory(format!("start info: {e}")))?;
    Ok(entry.0)
}

/// A flat 4 GiB segment with the given selector and type, in 32-bit protected-mode form.
fn flat_segment(selector: u16, type_: u8) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl: 0,
        db: 1,
        s: 1,
        l: 0,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// Puts the vCPU in the PVH entry state: CPUID from KVM's supported set (without it CPUID reads
/// zeros and enabling long mode triple-faults, docs/host-quirks.md), CR0.PE with paging off, flat
/// 32-bit code (type 0xb) and data (type 0x3) segments, a busy TSS in TR as VM entry requires,
/// `rip` = entry, `rbx` = start-info address.
pub(crate) fn setup_vcpu(kvm: &Kvm, vcpu: &VcpuFd, entry: u64) -> Result<(), VmmError> {
    let mut cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| VmmError::Kvm("KVM_GET_SUPPORTED_CPUID", e))?;
    // The supported set carries whatever APIC id the host CPU that answered the ioctl has;
    // a VMM must put the vCPU's own there (as QEMU does): CPUID.1:EBX[31:24] and the x2APIC
    // id in EDX of the topology leaves 0xB and 0x1F. This VMM has one vCPU, APIC id 0.
    // Like QEMU, also publish the TSC frequency in KVM's timing leaf 0x40000010 (EAX = TSC kHz,
    // EBX = APIC bus kHz), so the guest can report it without calibrating, and raise the
    // hypervisor's max leaf to cover it.
    let tsc_khz = vcpu.get_tsc_khz().ok();
    let mut has_timing_leaf = false;
    for e in cpuid.as_mut_slice() {
        match e.function {
            0x1 => e.ebx &= 0x00ff_ffff,
            0xb | 0x1f => e.edx = 0,
            KVM_CPUID_SIGNATURE if tsc_khz.is_some() => e.eax = e.eax.max(KVM_CPUID_TIMING),
            KVM_CPUID_TIMING => has_timing_leaf = true,
            _ => {}
        }
    }
    if let (Some(khz), false) = (tsc_khz, has_timing_leaf) {
        cpuid
            .push(kvm_cpuid_entry2 {
                function: KVM_CPUID_TIMING,
                eax: khz,
                ebx: APIC_BUS_KHZ,
                ..Default::default()
            })
            .map_err(|e| VmmError::Guest(format!("adding CPUID leaf 0x40000010: {e:?}")))?;
    }
    vcpu.set_cpuid2(&cpuid)
        .map_err(|e| VmmError::Kvm("KVM_SET_CPUID2", e))?;

    let mut sregs = vcpu
        .get_sregs()
        .map_err(|e| VmmError::Kvm("KVM_GET_SREGS", e))?;
    sregs.cs = flat_segment(0x08, 0xb);
    let data = flat_segment(0x10, 0x3);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = kvm_segment {
        base: 0,
        limit: 0xffff,
        selector: 0x18,
        type_: 0xb,
        present: 1,
        s: 0,
        ..flat_segment(0x18, 0xb)
    };
    sregs.tr.db = 0;
    sregs.tr.g = 0;
    sregs.cr0 = 0x1;
    sregs.cr4 = 0;
    sregs.efer = 0;
    vcpu.set_sregs(&sregs)
        .map_err(|e| VmmError::Kvm("KVM_SET_SREGS", e))?;

    let regs = kvm_regs {
        rip: entry,
        rbx: START_INFO_ADDR,
        rflags: 0x2,
        ..Default::default()
    };
    vcpu.set_regs(&regs)
        .map_err(|e| VmmError::Kvm("KVM_SET_REGS", e))?;
    Ok(())
}
