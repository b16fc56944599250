//! The PVH `hvm_start_info` handed over in `ebx` (Xen `public/arch-x86/hvm/start_info.h`).

/// `XEN_HVM_START_MAGIC_VALUE` from start_info.h.
pub const START_MAGIC: u32 = 0x336e_c578;

/// Longest command line the agent looks at; the rest is ignored.
pub const CMDLINE_MAX: usize = 1024;

/// `struct hvm_start_info`, version 1 layout (56 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct StartInfo {
    /// Must be [`START_MAGIC`].
    pub magic: u32,
    /// Layout version (0 or 1; 1 adds the memory map).
    pub version: u32,
    /// `SIF_*` flags.
    pub flags: u32,
    /// Number of modules in `modlist_paddr`.
    pub nr_modules: u32,
    /// Physical address of the module list.
    pub modlist_paddr: u64,
    /// Physical address of the NUL-terminated command line, or 0.
    pub cmdline_paddr: u64,
    /// Physical address of the ACPI RSDP, or 0.
    pub rsdp_paddr: u64,
    /// Physical address of the memory map (version 1).
    pub memmap_paddr: u64,
    /// Entries in the memory map (version 1).
    pub memmap_entries: u32,
    /// Reserved, zero.
    pub reserved: u32,
}

const _: () = assert!(core::mem::size_of::<StartInfo>() == 56);
const _: () = assert!(core::mem::offset_of!(StartInfo, cmdline_paddr) == 24);
const _: () = assert!(core::mem::offset_of!(StartInfo, memmap_entries) == 48);

/// Reads the start info at `phys`, or `None` when the magic is wrong.
///
/// # Safety
/// `phys` must be the address the PVH loader passed in `ebx`, identity-mapped and readable.
pub unsafe fn read(phys: u64) -> Option<StartInfo> {
    let p = phys as *const StartInfo;
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller guarantees `phys` points at the loader's start info, which the 4 GiB
    // identity map covers; read_volatile because the loader wrote it behind the compiler's back.
    let si = unsafe { p.read_volatile() };
    (si.magic == START_MAGIC).then_some(si)
}

/// The command line named by `si`, up to its NUL or [`CMDLINE_MAX`] bytes.
///
/// # Safety
/// `si` must come from [`read`], so that `cmdline_paddr` is 0 or a loader-written string in
/// identity-mapped memory that nothing writes while the agent runs.
pub unsafe fn cmdline(si: &StartInfo) -> &'static [u8] {
    if si.cmdline_paddr == 0 {
        return &[];
    }
    let p = si.cmdline_paddr as *const u8;
    let mut len = 0;
    // SAFETY: the loader wrote a NUL-terminated string at `p`; we stop at its NUL or at the cap.
    while len < CMDLINE_MAX && unsafe { p.add(len).read_volatile() } != 0 {
        len += 1;
    }
    // SAFETY: the `len` bytes just read are initialised, mapped, and never written again.
    unsafe { core::slice::from_raw_parts(p, len) }
}
