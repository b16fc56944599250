//! The wider port writes (fw_cfg's 16-bit selector, isa-debug-exit's 32-bit port), the
//! isa-debug-exit device, and the privilege level. Byte-wide port I/O is core's
//! (`vmtsync_core::arch::PortIo`, `NativePorts`).
//!
//! The agent runs in ring 0, or in ring 3 with IOPL 3, so `in`/`out` are always allowed. Every
//! access is a VM exit, which is exactly where the host (QEMU or the built-in VMM) timestamps
//! probe traffic.

use core::arch::asm;

/// The isa-debug-exit port (`-device isa-debug-exit,iobase=0xf4,iosize=4`). A write of `v`
/// makes QEMU exit with status `(v << 1) | 1`; the built-in VMM reports `v` itself.
pub const DEBUG_EXIT_PORT: u16 = 0xf4;

/// Exit code written to [`DEBUG_EXIT_PORT`] by the panic handler (QEMU status 0xfd = 253).
pub const PANIC_EXIT_CODE: u8 = 0x7e;

/// Writes one 16-bit value to `port`.
#[inline(always)]
pub fn outw(port: u16, v: u16) {
    // SAFETY: port output has no effect on Rust-visible memory; the only 16-bit port written
    // is the fw_cfg selector, whose side effect (selecting an item) is the point.
    unsafe {
        asm!("out dx, ax", in("dx") port, in("ax") v, options(nomem, nostack, preserves_flags))
    };
}

/// Writes one 32-bit value to `port`.
#[inline(always)]
pub fn outl(port: u16, v: u32) {
    // SAFETY: as for `outw`: no memory effects, only the device's (isa-debug-exit).
    unsafe {
        asm!("out dx, eax", in("dx") port, in("eax") v, options(nomem, nostack, preserves_flags))
    };
}

/// Asks the VMM to end the VM with `code` through isa-debug-exit, then halts forever in case no
/// such device is present.
pub fn exit(code: u8) -> ! {
    outl(DEBUG_EXIT_PORT, u32::from(code));
    halt_forever()
}

/// The current privilege level (the low two bits of CS).
#[inline(always)]
pub fn cpl() -> u8 {
    let cs: u16;
    // SAFETY: reading CS has no side effects.
    unsafe { asm!("mov {0:x}, cs", out(reg) cs, options(nomem, nostack, preserves_flags)) };
    // Masked to two bits, so the cast cannot truncate.
    #[allow(clippy::cast_possible_truncation)]
    let level = (cs & 3) as u8;
    level
}

/// Stops this CPU for good: `cli; hlt` in ring 0; in ring 3, where `hlt` would fault, a spin.
pub fn halt_forever() -> ! {
    loop {
        if cpl() == 0 {
            // SAFETY: `cli; hlt` at CPL 0 only stops this CPU; nothing is left inconsistent.
            unsafe { asm!("cli", "hlt", options(nomem, nostack)) };
        } else {
            core::hint::spin_loop();
        }
    }
}
