//! The kernel's port I/O: its console on COM1 (a polled 16550) and isa-debug-exit.
//!
//! 16550 registers (National Semiconductor PC16550D data sheet): THR/RBR at +0, IER +1, FCR
//! +2, LCR +3 (bit 7: divisor latch access), MCR +4, LSR +5 (bit 5: THR empty).
//! isa-debug-exit is QEMU's `-device isa-debug-exit,iobase=0xf4`: writing `v` ends QEMU with
//! status `(v << 1) | 1`.
//!
//! The console shares COM1 with vmtsync's link (`Uart16550::COM1` in `main.rs`): the link
//! writes a 0x00 before and after every frame, so the host tells this text from frames as
//! long as the text has no NUL and is never written while a frame is being sent (the kernel
//! prints only between two polls of the agent).

use core::arch::asm;

const COM1: u16 = 0x3f8;
const LSR_THRE: u8 = 0x20;
const DEBUG_EXIT: u16 = 0xf4;

/// Writes `value` to I/O port `port`.
pub fn outb(port: u16, value: u8) {
    // SAFETY: the kernel runs in ring 0 and only names ports of devices it owns (COM1,
    // isa-debug-exit) or that nothing decodes; a port write touches no memory.
    unsafe { asm!("out dx, al", in("dx") port, in("al") value, options(nomem, nostack)) };
}

/// Reads I/O port `port`.
pub fn inb(port: u16) -> u8 {
    let v: u8;
    // SAFETY: as in `outb`; a port read touches no memory.
    unsafe { asm!("in al, dx", in("dx") port, out("al") v, options(nomem, nostack)) };
    v
}

/// 8N1, FIFOs on, no interrupts.
pub fn com1_init() {
    for (reg, v) in [
        (1, 0x00),
        (3, 0x80),
        (0, 0x01),
        (1, 0x00),
        (3, 0x03),
        (2, 0x07),
        (4, 0x03),
    ] {
        outb(COM1 + reg, v);
    }
}

/// An ordinary console `putc`: waits until the transmitter is free, then writes.
pub fn com1_putc(b: u8) {
    while inb(COM1 + 5) & LSR_THRE == 0 {}
    outb(COM1, b);
}

/// The kernel's console: text on COM1.
#[derive(Debug)]
pub struct Console;

impl core::fmt::Write for Console {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        s.bytes().for_each(com1_putc);
        Ok(())
    }
}

/// Ends the VM through isa-debug-exit with `code`.
pub fn exit(code: u8) -> ! {
    outb(DEBUG_EXIT, code);
    halt()
}

/// Stops this vCPU for good; the VM stays up (its memory readable from the host).
pub fn halt() -> ! {
    loop {
        // SAFETY: `hlt` with interrupts off stops this vCPU for good; it touches no memory.
        unsafe { asm!("hlt", options(nomem, nostack)) };
    }
}
